"""Hosts without a TOML inventory: ``-H [user@]host[:port],...``, ``--nodelist``, the
DeepSpeed/MPI hostfiles users already have (``host slots=N``), ``--include``/``--exclude``,
and the commented ``hosts.toml`` that ``torchherd init`` writes.

Everything becomes the same document a TOML file gives and goes through
``inventory.parse``: one validation, one set of dataclasses. Pure: no SSH.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from torchherd.errors import InventoryError, UsageError
from torchherd.inventory import HOST_NAME_PATTERN, Host, Inventory, loads, parse, read
from torchherd.nodeset import NodesetError, expand, split_top

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

_HOSTFILE_LINE = re.compile(r"^[^\s=#\[][^\s=]*(?:\s+[A-Za-z_-]+=\S*)*$")
_MPICH_SLOTS = re.compile(r"^(?P<host>[^\s:]+):(?P<slots>\d+)$")
HOSTFILE_IGNORED = ("max_slots", "max-slots")
"""OpenMPI keys that say nothing torchrun uses."""


@dataclass(frozen=True)
class HostEntry:
    """One item of ``-H`` as written: a name or a nodeset, and its user and port."""

    name: str
    user: str | None = None
    ssh_port: int | None = None

    def tables(self) -> list[dict[str, Any]]:
        extra: dict[str, Any] = {}
        if self.user:
            extra["user"] = self.user
        if self.ssh_port is not None:
            extra["ssh_port"] = self.ssh_port
        return [{"name": name, **extra} for name in expand(self.name)]


def host_entries(text: str, flag: str = "-H") -> list[HostEntry]:
    """``[user@]host[:port]`` items, comma-separated, each host possibly a nodeset.
    Errors name ``flag`` and the item."""
    try:
        items = split_top(text)
    except NodesetError as error:
        raise UsageError(f"{flag} {error}", "write hosts like node0,ubuntu@node1:2222,gpu[01-04]") from None
    entries = [_entry(item, flag) for item in items]
    _no_duplicates([name for entry in entries for name in expand(entry.name)], flag)
    return entries


def host_items(text: str, flag: str = "-H") -> list[dict[str, Any]]:
    """The ``[[hosts]]`` tables ``-H`` stands for, one per host."""
    return [table for entry in host_entries(text, flag) for table in entry.tables()]


def _entry(item: str, flag: str) -> HostEntry:
    if not item:
        raise UsageError(f"{flag}: empty host (two commas, or one at an end)", "write hosts like node0,node1")
    user, _, rest = item.rpartition("@")
    if rest.startswith("[") and ":" in rest.split("]", 1)[0]:
        raise UsageError(f"{flag} {item!r}: an IPv6 address needs a name",
                         'list it in hosts.toml: name = "node3", address = "fe80::1"')
    host, port = _split_port(rest, item, flag)
    if not host or "@" in user or "[" in user:
        raise UsageError(f"{flag} {item!r}: expected [user@]host[:port]", "for example ubuntu@node1:2222")
    try:
        names = expand(host)
    except NodesetError as error:
        raise UsageError(f"{flag} {error}", "write a range like gpu[01-16] or gpu[1-3,7]") from None
    for name in names:
        if not HOST_NAME_PATTERN.match(name):
            raise UsageError(f"{flag} {item!r}: {name!r} is not a usable host name",
                             "use letters, digits, '.', '_' and '-' (it names the log file)")
    return HostEntry(host, user or None, port)


def _split_port(text: str, item: str, flag: str) -> tuple[str, int | None]:
    """``host:port`` -> (host, port); only a colon after the last bracket group counts."""
    head, bracket, tail = text.rpartition("]")
    if ":" not in tail:
        return text, None
    before, _, port = tail.rpartition(":")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(f"{flag} {item!r}: {port!r} is not an SSH port (1-65535)", "for example node1:2222")
    return head + bracket + before, int(port)


def _no_duplicates(names: Sequence[str], flag: str) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise UsageError(f"{flag}: host {name!r} is listed twice", "list every host once")
        seen.add(name)


def nodelist_items(text: str) -> list[dict[str, Any]]:
    """A SLURM nodelist (``gpu[01-04],cpu1``): names only, no user or port."""
    tables = host_items(text, "--nodelist")
    for table in tables:
        if set(table) != {"name"}:
            raise UsageError(f"--nodelist {text!r}: a nodelist holds host names only",
                             "give users and ports with -H, or in hosts.toml")
    return tables


def document(hosts: Sequence[Mapping[str, Any]], *, python: str | None = None, workdir: str | None = None,
             nproc_per_node: int | str | None = None, master: str | None = None,
             flag: str = "-H") -> dict[str, Any]:
    """The inventory document for hosts given on the command line or by a hostfile."""
    names = [str(host["name"]) for host in hosts]
    if master is not None and master not in names:
        raise UsageError(f"--master {master}: not one of the hosts given with {flag} ({_shown(names)})",
                         _did_you_mean(master, names))
    cluster: dict[str, Any] = {}
    if master is not None:
        cluster["master"] = master
    if nproc_per_node is not None:
        cluster["nproc_per_node"] = nproc_per_node
    defaults = {key: value for key, value in (("python", python), ("workdir", workdir)) if value is not None}
    return {"cluster": cluster, "defaults": defaults, "hosts": [dict(host) for host in hosts]}


# hostfiles -------------------------------------------------------------------------


def looks_like_hostfile(path: Path, text: str) -> bool:
    """A DeepSpeed/MPI hostfile (``host slots=N``, one host a line) and not TOML."""
    if path.suffix == ".toml":
        return False
    lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    if not lines or not all(_HOSTFILE_LINE.match(line) for line in lines):
        return False
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return True
    return False


def hostfile_items(path: Path, text: str) -> list[dict[str, Any]]:
    """The hosts of a DeepSpeed/OpenMPI hostfile (``worker-1 slots=4``) or an MPICH one
    (``worker-1:4``); ``slots`` is the host's nproc_per_node. Errors name the line."""
    tables: list[dict[str, Any]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if line:
            tables.extend(_hostfile_line(path, number, line))
    _no_duplicates([table["name"] for table in tables], str(path))
    if not tables:
        raise InventoryError(f"{path}: no hosts listed", "write one host a line: worker-1 slots=4")
    return tables


def _hostfile_line(path: Path, number: int, line: str) -> list[dict[str, Any]]:
    where = f"{path}:{number}"
    host, *fields = line.split()
    slots: int | None = None
    mpich = _MPICH_SLOTS.match(host)
    if mpich:
        host, slots = mpich.group("host"), int(mpich.group("slots"))
    for field in fields:
        key, _, value = field.partition("=")
        if key == "slots":
            if not value.isdigit() or int(value) < 1:
                raise InventoryError(f"{where}: slots={value}: expected a positive integer", "for example slots=4")
            slots = int(value)
        elif key not in HOSTFILE_IGNORED:
            raise InventoryError(f"{where}: {key}: unknown key", "a hostfile line is: host slots=N")
    try:
        names = expand(host)
    except NodesetError as error:
        raise InventoryError(f"{where}: {error}", "write a host name, or a range like gpu[01-04]") from None
    for name in names:
        if not HOST_NAME_PATTERN.match(name):
            raise InventoryError(f"{where}: {name!r} is not a usable host name",
                                 "use letters, digits, '.', '_' and '-' (it names the log file)")
    return [{"name": name, **({"nproc_per_node": slots} if slots is not None else {})} for name in names]


def load_any(path: Path, **flags: Any) -> Inventory:
    """A TOML inventory, or a DeepSpeed/MPI hostfile (then ``flags`` give python, workdir, ...)."""
    raw = read(path)  # read once, and never more than an inventory can be (-i /dev/zero)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return loads(raw, path)  # which says what is wrong with the file
    if not looks_like_hostfile(path, text):
        return override(loads(raw, path), **flags)
    return parse(document(hostfile_items(path, text), flag=str(path), **flags), path)


# choosing hosts for one run ------------------------------------------------------


def override(inventory: Inventory, *, python: str | None = None, workdir: str | None = None,
             nproc_per_node: int | str | None = None, master: str | None = None) -> Inventory:
    """The inventory with the command line's ``--python``, ``--workdir``,
    ``--nproc-per-node`` (every host) and ``--master``."""
    hosts = inventory.hosts
    changes: dict[str, Any] = {key: value for key, value in (("python", python), ("workdir", workdir))
                               if value is not None}
    if nproc_per_node is not None:
        changes["nproc_per_node"] = None  # the cluster's count, set below, for every host
    if changes:
        hosts = tuple(replace(host, **changes) for host in hosts)
    cluster = inventory.cluster
    if nproc_per_node is not None:
        cluster = replace(cluster, nproc_per_node=nproc_per_node)
    if master is not None:
        names = [host.name for host in hosts]
        if master not in names:
            raise UsageError(f"--master {master}: not one of the hosts ({_shown(names)})",
                             _did_you_mean(master, names))
        hosts = _with_master(hosts, master)
        cluster = replace(cluster, master=master)
    return replace(inventory, cluster=cluster, hosts=hosts)


def select(inventory: Inventory, include: str | None = None, exclude: str | None = None) -> Inventory:
    """The hosts ``include`` names (all when None) less those ``exclude`` names: names,
    nodesets or globs, comma-separated. When the master is left out, the first host left
    is the master."""
    hosts = list(inventory.hosts)
    names = [host.name for host in hosts]
    if include is not None:
        wanted = _matching(include, names, "--include")
        hosts = [host for host in hosts if host.name in wanted]
    if exclude is not None:
        unwanted = _matching(exclude, names, "--exclude")
        hosts = [host for host in hosts if host.name not in unwanted]
    if not hosts:
        raise UsageError("--include/--exclude: no host is left", f"the hosts are {_shown(names)}")
    if len(hosts) == len(inventory.hosts):
        return inventory
    return replace(inventory, hosts=tuple(hosts), cluster=replace(inventory.cluster, master=hosts[0].name))


def _matching(text: str, names: Sequence[str], flag: str) -> set[str]:
    found: set[str] = set()
    try:
        items = split_top(text)
    except NodesetError as error:
        raise UsageError(f"{flag} {text!r}: {error}", "write names, nodesets or globs: node1,gpu[01-04],cpu*") from None
    for item in items:
        matched = _match_item(item, names, flag)
        if not matched:
            raise UsageError(f"{flag} {item}: no such host", _did_you_mean(item, names))
        found |= matched
    return found


def _match_item(item: str, names: Sequence[str], flag: str) -> set[str]:
    if "*" in item or "?" in item:
        return {name for name in names if fnmatch.fnmatchcase(name, item)}
    try:
        expanded = set(expand(item))
    except NodesetError as error:
        raise UsageError(f"{flag} {item!r}: {error}", "write names, nodesets or globs: node1,gpu[01-04],cpu*") from None
    return expanded & set(names)


def _with_master(hosts: Iterable[Host], master: str) -> tuple[Host, ...]:
    listed = tuple(hosts)
    return tuple(host for host in listed if host.name == master) + tuple(host for host in listed
                                                                        if host.name != master)


def _shown(names: Sequence[str]) -> str:
    return ", ".join(names[:8]) + (f", ... ({len(names)} hosts)" if len(names) > 8 else "")


def _did_you_mean(name: str, names: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(names), n=1)
    return f"did you mean {close[0]!r}?" if close else f"the hosts are {_shown(names)}"


# torchherd init -----------------------------------------------------------------------


def ssh_config_aliases(text: str, pattern: str) -> list[str]:
    """The ``Host`` aliases of an OpenSSH config matching the glob ``pattern`` (wildcard
    entries such as ``Host *`` stand for no host and are left out)."""
    aliases: list[str] = []
    for raw in text.splitlines():
        words = raw.split("#", 1)[0].replace("=", " ").split()
        if len(words) < 2 or words[0].lower() != "host":
            continue
        for alias in words[1:]:
            plain = not any(char in alias for char in "*?!")
            if plain and fnmatch.fnmatchcase(alias, pattern) and alias not in aliases:
                aliases.append(alias)
    return aliases


FILL = "FILL IN"


def inventory_text(entries: Sequence[HostEntry], *, python: str | None = None, workdir: str | None = None,
                   nproc_per_node: int | str | None = None, master: str | None = None, source: str = "") -> str:
    """A commented ``hosts.toml``: one ``[[hosts]]`` table per entry (a nodeset stays one
    table); what the user gave is filled in, the rest is marked FILL IN."""
    def line(key: str, given: object, default: object, comment: str) -> str:
        assignment = f"{key} = {_toml(default if given is None else given)}"
        return f"{assignment:<28}# {FILL + ': ' if given is None else ''}{comment}"

    first = expand(entries[0].name)[0] if entries else "node0"
    lines = [
        f"# torchherd inventory, written by `torchherd init`{source} on {time.strftime('%Y-%m-%d')}.",
        f"# Fill in what is marked {FILL}, then: torchherd hosts; torchherd check -- train.py",
        "# Every key is explained in hosts.example.toml of torchherd's repository.",
        "",
        "[cluster]",
        f"{'master = ' + _toml(master or first):<28}# node_rank 0 (the first host unless you change it)",
        f"{'port = 29500':<28}# the master port: every worker must reach it on the master",
        line("nproc_per_node", nproc_per_node, 1, 'processes per node (its GPUs), or "gpu"; a [[hosts]] table '
             "may set its own"),
        "",
        "[defaults]",
        line("python", python, "python3", 'the interpreter on the nodes that has torch, e.g. "/opt/venv/bin/python"'),
        line("workdir", workdir, "~", "where the job runs on each node (`torchherd run --sync` sends your project "
             "there)"),
    ]
    for entry in entries or [HostEntry("node0"), HostEntry("node1")]:
        names = expand(entry.name)
        about = f"{len(names)} hosts: {names[0]} ... {names[-1]}" if len(names) > 1 else "how logs and reports call it"
        lines += ["", "[[hosts]]", f"{'name = ' + _toml(entry.name):<28}# {about}"]
        if not entries:
            lines[-1] = f"{'name = ' + _toml(entry.name):<28}# {FILL}: the host's name (or a nodeset: gpu[01-16])"
        if entry.user:
            lines.append(f"user = {_toml(entry.user)}")
        if entry.ssh_port is not None:
            lines.append(f"ssh_port = {entry.ssh_port}")
    return "\n".join(lines) + "\n"


def _toml(value: object) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)
