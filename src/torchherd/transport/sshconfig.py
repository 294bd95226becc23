"""OpenSSH's client configuration, read the way ``ssh`` (OpenSSH 9.x) reads it.

``lookup(alias, config_file, local)`` answers what ``ssh -G -F config_file alias``
would print for the options torchherd uses: ``Include`` (globs, relative paths from
``~/.ssh``, an Include under a non-matching ``Host`` read but never applied),
``Host`` patterns with ``!``, ``Match`` (``all``, ``host``, ``originalhost``,
``user``, ``localuser``, ``exec``, ``canonical``/``final``; any of them negated,
``host b`` or ``host=b``), first value wins, ``IdentityFile`` accumulating,
``ProxyJump`` lists and ``none``, ``CanonicalizeHostname`` and the second pass it
triggers, ``RevokedHostKeys``, and the ``%`` tokens and ``${VAR}`` of the options that
take them.

Standard library only, and no state: the caller says who the local user is
(``Local``), how ``Match exec`` runs and what a name resolves to, so the parser is
testable without a machine behind it. Unknown keywords are skipped (``ssh`` itself refuses them;
torchherd only needs the options below, and must not break on a newer keyword).
"""

from __future__ import annotations

import glob as _glob
import hashlib
import os
import re
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

# SshConfigError: also sshconfig's own, which its callers catch as ``sshconfig.SshConfigError``.
from torchherd.transport.sshlines import WHITESPACE, Line, match_hostname, match_pattern, match_pattern_list, read_lines
from torchherd.transport.sshlines import SshConfigError as SshConfigError

MAX_INCLUDE_DEPTH = 16  # OpenSSH's READCONF_MAX_DEPTH
SYSTEM_CONFIG = "/etc/ssh/ssh_config"
DEFAULT_IDENTITY_FILES = ("~/.ssh/id_rsa", "~/.ssh/id_ecdsa", "~/.ssh/id_ecdsa_sk", "~/.ssh/id_ed25519",
                          "~/.ssh/id_ed25519_sk", "~/.ssh/id_xmss", "~/.ssh/id_dsa")
DEFAULT_USER_KNOWN_HOSTS = ("~/.ssh/known_hosts", "~/.ssh/known_hosts2")
DEFAULT_GLOBAL_KNOWN_HOSTS = ("/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2")
STRICT_VALUES = {"yes": "yes", "true": "yes", "no": "no", "false": "no", "off": "no", "ask": "ask",
                 "accept-new": "accept-new"}
ACCUMULATING = frozenset({"identityfile", "certificatefile", "localforward", "remoteforward", "dynamicforward",
                          "sendenv"})
"""Options every active line adds to; every other option keeps its first value."""


@dataclass(frozen=True)
class Local:
    """The controller side, as the tokens and ``Match`` see it."""

    user: str
    home: str
    uid: int
    hostname: str
    environ: Mapping[str, str] = field(default_factory=dict)
    run: Callable[[str], bool] = field(default=lambda command: False, compare=False)
    """Runs a ``Match exec`` command in the local shell: True when it exits 0."""
    resolves: Callable[[str], bool] = field(default=lambda name: False, compare=False)
    """Whether a name resolves (``getaddrinfo``), for ``CanonicalizeHostname``."""

    @staticmethod
    def of_this_machine() -> Local:
        import getpass

        return Local(user=getpass.getuser(), home=account_home(), uid=os.getuid(), hostname=socket.gethostname(),
                     environ=dict(os.environ), run=_run_in_shell, resolves=_resolves)


def account_home() -> str:
    """The home directory of the account, not $HOME: OpenSSH reads ~/.ssh/config from there."""
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_dir
    except (ImportError, KeyError):
        return os.path.expanduser("~")


def _resolves(name: str) -> bool:
    try:
        return bool(socket.getaddrinfo(name, 22, type=socket.SOCK_STREAM))
    except (OSError, UnicodeError):
        return False


def _run_in_shell(command: str) -> bool:
    # As OpenSSH does: the user's shell, stdin from /dev/null, output discarded.
    shell = os.environ.get("SHELL") or "/bin/sh"
    try:
        return subprocess.run([shell, "-c", command], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              check=False).returncode == 0
    except OSError as error:
        raise SshConfigError(f"Match exec {command!r}: cannot run {shell}: {error.strerror}") from None


@dataclass(frozen=True)
class Jump:
    """One ``ProxyJump`` hop: ``[user@]host[:port]`` (or an ``ssh://`` URI)."""

    host: str
    user: str | None = None
    port: int | None = None

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.user + '@' if self.user else ''}{host}{f':{self.port}' if self.port else ''}"


@dataclass(frozen=True)
class Setting:
    """One option's value as written, and where."""

    args: tuple[str, ...]
    file: str
    line: int

    @property
    def where(self) -> str:
        return f"{self.file} line {self.line}"


@dataclass(frozen=True)
class HostConfig:
    """One destination, resolved. Paths are expanded (``~``, ``${VAR}``, ``%`` tokens)."""

    original_host: str
    hostname: str
    user: str
    port: int
    identity_files: tuple[str, ...]
    identity_files_as_written: tuple[str, ...]
    """As ``ssh -G`` prints them (OpenSSH expands these only when it loads the keys)."""
    identities_only: bool
    proxy_jump: tuple[Jump, ...]
    proxy_command: str | None
    """With its tokens (``%h %n %p %r %%``) already expanded; run it with ``sh -c``."""
    proxy_command_as_written: str | None
    connect_timeout: float | None
    host_key_alias: str | None
    user_known_hosts_files: tuple[str, ...]
    global_known_hosts_files: tuple[str, ...]
    strict_host_key_checking: str
    """``yes``, ``ask`` (the default; refuses unknown keys without a terminal), ``accept-new`` or ``no``."""
    hash_known_hosts: bool
    batch_mode: bool
    revoked_host_keys: tuple[str, ...] = ()
    """``RevokedHostKeys`` files (``~``, ``${VAR}`` and tokens expanded): a key they list is refused."""
    settings: Mapping[str, Setting] = field(default_factory=dict, compare=False)
    """Every option that a line set (first value wins), with the file and line it came from."""

    @property
    def host_key_name(self) -> str:
        """The name known_hosts is searched for: HostKeyAlias, else ``host`` or ``[host]:port``."""
        if self.host_key_alias:
            return self.host_key_alias
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"


# ---------------------------------------------------------------- evaluation


@dataclass
class _State:
    """Options as they are set while the files are read (first value wins)."""

    settings: dict[str, Setting] = field(default_factory=dict)
    identity_files: list[str] = field(default_factory=list)
    proxy_jump: Setting | None = None
    proxy_command: Setting | None = None
    want_final: bool = False
    final_hostname: str | None = None
    """The host name the second pass matched (canonicalized): what ``ssh -G`` prints."""

    def first(self, keyword: str) -> str | None:
        setting = self.settings.get(keyword)
        return setting.args[0] if setting is not None and setting.args else None


@dataclass(frozen=True)
class _Pass:
    host: str
    """What ``Host`` lines match: the name given, or (final pass) the resolved HostName."""
    original: str
    local: Local
    final: bool
    reader: Callable[[str], tuple[Line, ...] | None]
    lister: Callable[[str], list[str]]


def _apply(state: _State, line: Line) -> None:
    keyword = line.keyword
    if keyword == "proxyjump":
        value = line.rest.split("#", 1)[0].rstrip(WHITESPACE)
        if state.proxy_jump is None and state.proxy_command is None:
            state.proxy_jump = Setting((value,), line.file, line.number)
    elif keyword == "proxycommand":
        # As OpenSSH 9.2 does: ProxyJump none does not hide a later ProxyCommand.
        jump = state.proxy_jump.args[0].lower() if state.proxy_jump is not None else "none"
        if state.proxy_command is None and jump == "none":
            state.proxy_command = Setting((line.rest.lstrip(WHITESPACE + "="),), line.file, line.number)
    elif keyword == "identityfile":
        for path in line.args:
            if path not in state.identity_files:
                state.identity_files.append(path)
    elif keyword in ACCUMULATING:
        previous = state.settings.get(keyword)
        args = (previous.args if previous is not None else ()) + line.args
        state.settings[keyword] = Setting(args, line.file, line.number)
    elif keyword not in state.settings:
        state.settings[keyword] = Setting(line.args, line.file, line.number)


def _host_line(line: Line, host: str) -> bool:
    active = False
    for pattern in line.args:
        negated = pattern.startswith("!")
        if match_pattern(host, pattern[1:] if negated else pattern):
            if negated:
                return False
            active = True
    return active


MATCH_VALUE_CRITERIA = ("host", "originalhost", "user", "localuser", "exec", "localnetwork", "version", "tagged",
                        "command")
"""The criteria OpenSSH also takes as one ``criterion=value`` word (``Match host=b``)."""


def _match_line(line: Line, state: _State, run: _Pass, never: bool) -> bool:
    """One ``Match`` line: every criterion must hold (OpenSSH's ``match_cfg_line``)."""
    where = f"{line.file} line {line.number}"
    host = _match_host(state, run)
    user = state.first("user") or run.local.user
    args = list(line.args)
    result, seen = True, 0
    while args:
        criterion = args.pop(0)
        if criterion.startswith("#"):
            break
        negate = criterion.startswith("!")
        name = criterion[1:] if negate else criterion
        if name.lower() == "all":
            # As OpenSSH: one criterion may come before it ("Match canonical all"), none after.
            if seen > 1 or (args and args[0] and not args[0].startswith("#")):
                raise SshConfigError(f"{where}: 'all' cannot be combined with other Match attributes")
            return result and not negate
        seen += 1
        name, equals, value = name.partition("=")
        name = name.lower()
        if name in ("canonical", "final") and not equals:
            state.want_final = state.want_final or (name == "final" and not negate)
            result = result and (run.final != negate)
            continue
        if not equals or name not in MATCH_VALUE_CRITERIA:
            if equals:
                name = f"{name}={value}"
            if not args or not args[0] or args[0].startswith("#"):
                raise SshConfigError(f"{where}: missing Match criteria for {name}")
            value = args.pop(0)
        elif not value:
            raise SshConfigError(f"{where}: missing Match criteria for {name}")
        matched = _criterion(name, value, state, run, host, user, where, result and not never)
        if matched is not None:
            result = result and (matched != negate)
    if seen == 0:
        raise SshConfigError(f"{where}: one or more attributes required for Match")
    return result


def _criterion(name: str, value: str, state: _State, run: _Pass, host: str, user: str, where: str,
               may_run: bool) -> bool | None:
    """Whether one criterion holds; None for an ``exec`` not run (an earlier one failed)."""
    if name == "host":
        return match_hostname(host, value) == 1
    if name == "originalhost":
        return match_hostname(run.original, value) == 1
    if name == "user":
        return match_pattern_list(user, value) == 1
    if name == "localuser":
        return match_pattern_list(run.local.user, value) == 1
    if name == "exec":
        if not may_run:
            return None  # OpenSSH skips the command once an earlier criterion failed
        return run.local.run(expand_tokens(value, _exec_tokens(state, run, host, user), where))
    raise SshConfigError(f"{where}: unsupported Match attribute {name}")


def _match_host(state: _State, run: _Pass) -> str:
    """What ``Match host`` tests: the HostName so far (its ``%h`` expanded), else the name given."""
    hostname = state.first("hostname")
    if run.final or hostname is None:
        return run.host
    return expand_tokens(hostname, {"h": run.host}, "HostName")


def _exec_tokens(state: _State, run: _Pass, host: str, user: str) -> dict[str, str]:
    port = _port(state.settings.get("port"), 22)
    alias = state.first("hostkeyalias") or host
    return {**_local_tokens(run.local), "C": connection_hash(run.local.hostname, host, port, user), "h": host,
            "k": alias, "n": run.original, "p": str(port), "r": user}


def _include(line: Line, state: _State, run: _Pass, active: bool, never: bool, depth: int, userconf: bool) -> None:
    if depth >= MAX_INCLUDE_DEPTH:
        raise SshConfigError(f"{line.file} line {line.number}: Include nested too deeply (a loop?)")
    for pattern in line.args:
        if pattern.startswith("~") and not userconf:
            raise SshConfigError(f"{line.file} line {line.number}: bad include path {pattern}")
        if not pattern.startswith(("/", "~")):
            pattern = ("~/.ssh/" if userconf else "/etc/ssh/") + pattern
        for path in run.lister(expand_tilde(pattern, run.local.home)):
            _read(path, state, run, active, never or not active, depth + 1, userconf)


def _read(path: str, state: _State, run: _Pass, active: bool, never: bool, depth: int, userconf: bool) -> bool:
    lines = run.reader(path)
    if lines is None:
        return False
    blocks = _blocks(lines)
    if blocks is not None:
        if not never:
            _read_blocks(blocks, state, run.host, active)
        return True
    for line in lines:
        if line.keyword == "host":
            active = not never and _host_line(line, run.host)
        elif line.keyword == "match":
            matched = _match_line(line, state, run, never)
            active = not never and matched
        elif line.keyword == "include":
            _include(line, state, run, active, never, depth, userconf)
        elif active:
            _apply(state, line)
    return True


@dataclass(frozen=True)
class _Blocks:
    """A file of ``Host`` blocks only (no ``Match``, no ``Include``), indexed: a cluster's
    ssh_config names every node in a block of its own, and every lookup walked every block
    (O(nodes) a lookup, O(nodes^2) a run). A block whose patterns are all plain names
    applies only to those names; the others are tried one by one, in file order."""

    preamble: tuple[Line, ...]
    hosts: tuple[Line, ...]
    """Each block's ``Host`` line."""
    bodies: tuple[tuple[Line, ...], ...]
    named: dict[str, tuple[int, ...]]
    """Plain name -> the blocks that name it."""
    patterned: tuple[int, ...]


def _is_plain(pattern: str) -> bool:
    return not pattern.startswith("!") and "*" not in pattern and "?" not in pattern


_BLOCKS: dict[int, tuple[tuple[Line, ...], _Blocks | None]] = {}
"""By the id of a parsed file's lines (kept alive in the value, so the id stays theirs)."""


def _blocks(lines: tuple[Line, ...]) -> _Blocks | None:
    known = _BLOCKS.get(id(lines))
    if known is not None and known[0] is lines:
        return known[1]
    found = _index_blocks(lines)
    if len(_BLOCKS) >= 64:  # a few files per run; never grows without bound
        _BLOCKS.clear()
    _BLOCKS[id(lines)] = (lines, found)
    return found


def _index_blocks(lines: tuple[Line, ...]) -> _Blocks | None:
    if any(line.keyword in ("match", "include") for line in lines):
        return None
    starts = [index for index, line in enumerate(lines) if line.keyword == "host"]
    ends = starts[1:] + [len(lines)]
    named: dict[str, list[int]] = {}
    patterned: list[int] = []
    for block, start in enumerate(starts):
        patterns = lines[start].args
        if all(_is_plain(pattern) for pattern in patterns):
            for pattern in dict.fromkeys(patterns):
                named.setdefault(pattern, []).append(block)
        else:
            patterned.append(block)
    return _Blocks(preamble=lines[:starts[0]] if starts else lines, hosts=tuple(lines[start] for start in starts),
                   bodies=tuple(lines[start + 1:end] for start, end in zip(starts, ends)),
                   named={name: tuple(blocks) for name, blocks in named.items()}, patterned=tuple(patterned))


def _read_blocks(blocks: _Blocks, state: _State, host: str, active: bool) -> None:
    """``_read``'s loop over the blocks that can apply to ``host`` (the others would not)."""
    if active:
        for line in blocks.preamble:
            _apply(state, line)
    candidates = sorted(blocks.named.get(host, ()) + blocks.patterned)
    for block in candidates:
        if _host_line(blocks.hosts[block], host):
            for line in blocks.bodies[block]:
                _apply(state, line)


def _list_glob(pattern: str) -> list[str]:
    return sorted(_glob.glob(pattern))


def evaluate(alias: str, config_file: str | None, local: Local, *, user: str | None = None,
             port: int | None = None, jump: str | None = None, system_file: str | None = SYSTEM_CONFIG,
             reader: Callable[[str], tuple[Line, ...] | None] = read_lines,
             lister: Callable[[str], list[str]] = _list_glob) -> _State:
    """Reads the files as ``ssh [-l user] [-p port] [-J jump] [-F config_file] alias`` does:
    with ``config_file``, that file only (it must exist); without, ``~/.ssh/config`` then
    ``system_file``. Values given here come first, as command-line options do."""
    state = _State()
    if user is not None:
        state.settings["user"] = Setting((user,), "command line", 0)
    if port is not None:
        state.settings["port"] = Setting((str(port),), "command line", 0)
    if jump is not None:
        state.proxy_jump = Setting((jump,), "command line", 0)
    _read_files(config_file, state, _Pass(alias, alias, local, False, reader, lister), system_file)
    host = state.final_hostname = _canonical_host(state, alias, local)
    if state.want_final or _canonicalize(state) != "no":
        # As OpenSSH: a second pass, its Host lines matched against the host name so far
        # (canonicalized), which stays the HostName whatever a later line says.
        _read_files(config_file, state, _Pass(host, alias, local, True, reader, lister), system_file)
    return state


def _read_files(config_file: str | None, state: _State, run: _Pass, system_file: str | None) -> None:
    if config_file is not None:
        if not _read(config_file, state, run, True, False, 0, True):
            raise SshConfigError(f"{config_file}: ssh_config file not found")
        return
    _read(expand_tilde("~/.ssh/config", run.local.home), state, run, True, False, 0, True)
    if system_file is not None:
        _read(system_file, state, run, True, False, 0, False)


# ---------------------------------------------------------------- canonicalization

CANONICALIZE_VALUES = {"yes": "yes", "true": "yes", "no": "no", "false": "no", "always": "always"}


def _canonicalize(state: _State) -> str:
    setting = state.settings.get("canonicalizehostname")
    if setting is None:
        return "no"
    value = _single(setting).lower()
    if value not in CANONICALIZE_VALUES:
        raise SshConfigError(f"{setting.where}: CanonicalizeHostname must be yes, no or always, got {value!r}")
    return CANONICALIZE_VALUES[value]


def _is_address_shaped(name: str) -> bool:
    """OpenSSH's ``is_addr_fast``: a name that can only be an address."""
    return "%" in name or ":" in name or all(char in "0123456789." for char in name)


def numeric_address(name: str) -> str | None:
    """The address ``name`` spells (``10.1`` is 10.0.0.1), as ``getnameinfo`` writes it;
    None when it is not one address."""
    try:
        found = socket.getaddrinfo(name, 22, type=socket.SOCK_STREAM,
                                   flags=socket.AI_NUMERICHOST | socket.AI_NUMERICSERV)
        if len(found) != 1:
            return None
        return socket.getnameinfo(found[0][4], socket.NI_NUMERICHOST)[0]
    except (OSError, UnicodeError, ValueError):
        return None


def _canonical_host(state: _State, alias: str, local: Local) -> str:
    """The host name after the first pass, as ssh.c's main() makes it: HostName (``%h``
    expanded), lowercased unless an address, an address written the one way
    (``10.1`` is 10.0.0.1), and with ``CanonicalizeHostname`` a name found in the
    ``CanonicalDomains`` (OpenSSH's ``resolve_canonicalize``)."""
    written = state.first("hostname")
    host = expand_tokens(written, {"h": alias}, "HostName") if written else alias
    mode = _canonicalize(state)
    numeric = numeric_address(host)
    if numeric is not None or _is_address_shaped(host):
        return numeric if numeric is not None and numeric.lower() != host.lower() else host
    host = host.lower()
    command = state.proxy_command.args[0].lower() if state.proxy_command is not None else "none"
    direct = command == "none" and _jump_host(state) is None
    if mode == "no" or (not direct and mode != "always"):
        return host
    if host.endswith("."):
        if local.resolves(host):
            return host[:-1]
    elif host.count(".") > _max_dots(state):
        return host
    else:
        for domain in _domains(state):
            if local.resolves(f"{host}.{domain}."):
                return f"{host}.{domain}"
    if not _flag(state.settings.get("canonicalizefallbacklocal"), True):
        raise SshConfigError(f"Could not resolve host {host!r} (CanonicalizeHostname with "
                             "CanonicalizeFallbackLocal no)")
    return host


def _jump_host(state: _State) -> str | None:
    if state.proxy_jump is None or state.proxy_jump.args[0].lower() == "none":
        return None
    return state.proxy_jump.args[0]


def _max_dots(state: _State) -> int:
    setting = state.settings.get("canonicalizemaxdots")
    if setting is None:
        return 1
    value = _single(setting)
    if not value.isdigit():
        raise SshConfigError(f"{setting.where}: CanonicalizeMaxDots must be a number, got {value!r}")
    return int(value)


def _domains(state: _State) -> list[str]:
    """``CanonicalDomains`` up to a ``none`` (checked, lowercased, without a final dot)."""
    setting = state.settings.get("canonicaldomains")
    domains = []
    for domain in setting.args if setting is not None else ():
        if domain.lower() == "none":
            break
        domains.append(domain.lower().removesuffix("."))
    return domains


# ---------------------------------------------------------------- resolution


def lookup(alias: str, config_file: str | Path | None, local: Local, *, user: str | None = None,
           port: int | None = None, jump: str | None = None, system_file: str | None = SYSTEM_CONFIG,
           reader: Callable[[str], tuple[Line, ...] | None] = read_lines,
           lister: Callable[[str], list[str]] = _list_glob) -> HostConfig:
    """What ``ssh`` would use to reach ``alias``; raises SshConfigError naming file and line."""
    state = evaluate(alias, None if config_file is None else str(config_file), local, user=user, port=port,
                     jump=jump, system_file=system_file, reader=reader, lister=lister)
    return resolve(alias, state, local)


def resolve(alias: str, state: _State, local: Local) -> HostConfig:
    settings = state.settings
    hostname = _hostname(state, alias)
    remote_user = state.first("user") or local.user
    port = _port(settings.get("port"), 22)
    alias_key = state.first("hostkeyalias")
    tokens = {**_local_tokens(local), "C": connection_hash(local.hostname, hostname, port, remote_user),
              "h": hostname, "k": alias_key.lower() if alias_key else alias, "n": alias, "p": str(port),
              "r": remote_user}
    identity_written = tuple(state.identity_files) or DEFAULT_IDENTITY_FILES
    user_known = _file_list(settings.get("userknownhostsfile"), DEFAULT_USER_KNOWN_HOSTS)
    global_known = _file_list(settings.get("globalknownhostsfile"), DEFAULT_GLOBAL_KNOWN_HOSTS)
    command = state.proxy_command.args[0] if state.proxy_command is not None else None
    command = None if command is None or command.lower() == "none" else command
    proxy_tokens = {"h": hostname, "n": alias, "p": str(port), "r": remote_user}
    return HostConfig(
        original_host=alias,
        hostname=hostname,
        user=remote_user,
        port=port,
        identity_files=tuple(expand_path(path, tokens, local, "IdentityFile") for path in identity_written),
        identity_files_as_written=identity_written,
        identities_only=_flag(settings.get("identitiesonly"), False),
        proxy_jump=parse_jump(state.proxy_jump.args[0], proxy_tokens, state.proxy_jump.where)
        if state.proxy_jump is not None else (),
        proxy_command=expand_tokens(command, proxy_tokens, "ProxyCommand") if command else None,
        proxy_command_as_written=command,
        connect_timeout=_seconds(settings.get("connecttimeout")),
        host_key_alias=alias_key.lower() if alias_key else None,
        user_known_hosts_files=tuple(expand_path(path, tokens, local, "UserKnownHostsFile") for path in user_known),
        global_known_hosts_files=global_known,
        strict_host_key_checking=_strict(settings.get("stricthostkeychecking")),
        hash_known_hosts=_flag(settings.get("hashknownhosts"), False),
        batch_mode=_flag(settings.get("batchmode"), False),
        revoked_host_keys=tuple(expand_path(path, tokens, local, "RevokedHostKeys")
                                for path in _file_list(settings.get("revokedhostkeys"), ())),
        settings=dict(settings),
    )


def _hostname(state: _State, alias: str) -> str:
    if state.final_hostname is not None:
        return state.final_hostname
    written = state.first("hostname")
    hostname = expand_tokens(written, {"h": alias}, "HostName") if written else alias
    return hostname.lower()


def _file_list(setting: Setting | None, default: tuple[str, ...]) -> tuple[str, ...]:
    if setting is None:
        return default
    if setting.args and setting.args[0].lower() == "none":
        if len(setting.args) > 1:
            raise SshConfigError(f"{setting.where}: 'none' must be the only file")
        return ()
    return setting.args


def _single(setting: Setting) -> str:
    if len(setting.args) != 1:
        raise SshConfigError(f"{setting.where}: expected one value, got {len(setting.args)}")
    return setting.args[0]


def _flag(setting: Setting | None, default: bool) -> bool:
    if setting is None:
        return default
    value = _single(setting).lower()
    if value in ("yes", "true"):
        return True
    if value in ("no", "false"):
        return False
    raise SshConfigError(f"{setting.where}: expected yes or no, got {value!r}")


def _strict(setting: Setting | None) -> str:
    if setting is None:
        return "ask"
    value = _single(setting).lower()
    if value not in STRICT_VALUES:
        raise SshConfigError(f"{setting.where}: StrictHostKeyChecking must be yes, accept-new, no or ask, "
                             f"got {value!r}")
    return STRICT_VALUES[value]


def _port(setting: Setting | None, default: int) -> int:
    if setting is None:
        return default
    return parse_port(_single(setting), setting.where)


def parse_port(text: str, where: str) -> int:
    """A port number from 1 to 65535, or a service name (``ssh``), as OpenSSH's ``a2port``."""
    if text.isdigit():
        port = int(text)
    else:
        try:
            port = socket.getservbyname(text, "tcp")
        except OSError:
            port = 0
    if not 1 <= port <= 65535:
        raise SshConfigError(f"{where}: bad port {text!r}")
    return port


TIME_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_time(text: str) -> int | None:
    """OpenSSH's ``convtime``: ``90``, ``1m30s``, ``2h``; None when malformed."""
    parts = re.findall(r"(\d+)([smhdwSMHDW]?)", text)
    if not text or "".join(number + unit for number, unit in parts) != text:
        return None
    return sum(int(number) * TIME_UNITS[unit.lower()] for number, unit in parts)


def _seconds(setting: Setting | None) -> float | None:
    if setting is None:
        return None
    value = parse_time(_single(setting))
    if value is None:
        raise SshConfigError(f"{setting.where}: invalid time value {setting.args[0]!r}")
    return float(value)


def parse_jump(text: str, tokens: Mapping[str, str], where: str) -> tuple[Jump, ...]:
    """``ProxyJump`` hops, first to last; ``none`` is none."""
    if text.lower() == "none":
        return ()
    hops = []
    for item in expand_tokens(text, tokens, "ProxyJump").split(","):
        hop = _parse_hop(item.strip())
        if hop is None:
            raise SshConfigError(f"{where}: invalid ProxyJump hop {item.strip()!r}")
        hops.append(hop)
    return tuple(hops)


def _parse_hop(text: str) -> Jump | None:
    if text.lower().startswith("ssh://"):
        text = text[len("ssh://"):].rstrip("/")
        if "/" in text:
            return None
    user, at, rest = text.rpartition("@")
    if at and not user:
        return None
    if rest.startswith("["):
        host, closing, after = rest[1:].partition("]")
        if not closing or (after and not after.startswith(":")):
            return None
        port_text = after[1:] if after else ""
    elif rest.count(":") == 1:
        host, _, port_text = rest.partition(":")
    else:
        host, port_text = rest, ""
    if not host or any(char in host for char in " \t'\"`;&|<>$\\"):
        return None
    port = None
    if port_text:
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            return None
        port = int(port_text)
    return Jump(host=host, user=user or None, port=port)


# ---------------------------------------------------------------- tokens and paths


def connection_hash(local_hostname: str, host: str, port: int, user: str) -> str:
    """``%C``: SHA-1 of ``%l%h%p%r``, in hex (OpenSSH 9.2)."""
    return hashlib.sha1(f"{local_hostname}{host}{port}{user}".encode()).hexdigest()


def _local_tokens(local: Local) -> dict[str, str]:
    return {"%": "%", "d": local.home, "i": str(local.uid), "L": local.hostname.split(".")[0],
            "l": local.hostname, "u": local.user}


def expand_tokens(text: str, tokens: Mapping[str, str], where: str,
                  environ: Mapping[str, str] | None = None) -> str:
    """``%x`` tokens (``%%`` is ``%``) and, given ``environ``, ``${NAME}`` in one pass, as
    OpenSSH's ``percent_dollar_expand``: a value put in is never expanded again. An unknown
    token or an unset variable is an error, as in OpenSSH."""
    allowed = {"%": "%", **tokens}
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if environ is not None and text.startswith("${", i):
            end = text.find("}", i + 2)
            name = text[i + 2:end] if end != -1 else ""
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise SshConfigError(f"{where}: malformed ${{...}} in {text!r}")
            if name not in environ:
                raise SshConfigError(f"{where}: environment variable ${{{name}}} is not set")
            out.append(environ[name])
            i = end + 1
        elif char == "%":
            if i + 1 >= len(text) or text[i + 1] not in allowed:
                raise SshConfigError(f"{where}: unknown token {text[i:i + 2]!r} in {text!r}")
            out.append(allowed[text[i + 1]])
            i += 2
        else:
            out.append(char)
            i += 1
    return "".join(out)


def expand_tilde(path: str, home: str) -> str:
    if path == "~" or path.startswith("~/"):
        return home + path[1:]
    if path.startswith("~"):
        return os.path.expanduser(path)
    return path


def expand_path(path: str, tokens: Mapping[str, str], local: Local, where: str) -> str:
    """A file option's path: ``~``, then ``${VAR}`` and ``%`` tokens (OpenSSH's order)."""
    return expand_tokens(expand_tilde(path, local.home), tokens, where, local.environ)
