"""Hosts without a TOML inventory: ``-H [user@]host[:port],...``, ``--nodelist``, the
DeepSpeed/MPI hostfiles users already have (``host slots=N``), ``--include``/``--exclude``
(the commented ``hosts.toml`` that ``torchherd init`` writes: ``inventory.writer``).

Everything becomes the same document a TOML file gives and goes through
``inventory.parse``: one validation, one set of dataclasses. Pure: no SSH.
"""

from __future__ import annotations

import difflib
import fnmatch
import os
import re
from dataclasses import dataclass, replace
from ipaddress import ip_address
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Optional, Sequence, Tuple

from torchherd.errors import InventoryError, UsageError
from torchherd.inventory.model import Host, Inventory
from torchherd.inventory.nodeset import NodesetError, expand, pattern_size, split_top
from torchherd.inventory.options import NPROC_PER_NODE, SSH_TIMEOUT
from torchherd.inventory.parse import loads, master_port_problem, parse, read
from torchherd.inventory.rules import HOST_NAME_PATTERN, MAX_NPROC, USER_HINT, valid_ruser
from torchherd.inventory.tables import SSH_ONLY, Schedulers


@dataclass(frozen=True)
class HostEntry:
    """One item of ``-H`` as written: a name or a nodeset, and its user and port."""

    name: str
    user: str | None = None
    ssh_port: int | None = None
    address: str | None = None
    """Set where the name is not the address: one address at two ports (``host-PORT``)."""
    transport: str | None = None
    """"ssh" for ``ssh://host``: SSH even to this machine (to test one's own sshd)."""

    def tables(self) -> list[dict[str, Any]]:
        extra: dict[str, Any] = {}
        if self.address is not None:
            extra["address"] = self.address
        if self.transport is not None:
            extra["transport"] = self.transport
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
    limit = max_hosts()
    entries: list[HostEntry] = []
    count = 0
    for item in items:
        entry = _entry(item, flag, limit - count)
        count += pattern_size(entry.name)
        entries.append(entry)
    entries = _apart(entries)
    _no_duplicates([name for entry in entries for name in expand(entry.name)], flag)
    return entries


def _apart(entries: list[HostEntry]) -> list[HostEntry]:
    """One host at different SSH ports (``127.0.0.1:2222,127.0.0.1:2223``: containers or
    sshds side by side) is that many hosts: each is named ``HOST-PORT``, reached at HOST."""
    seen: dict[str, int] = {}
    for entry in entries:
        for name in expand(entry.name):
            seen[name] = seen.get(name, 0) + 1
    return [replace(entry, name=f"{entry.name}-{entry.ssh_port}", address=entry.name)
            if entry.ssh_port is not None and seen.get(entry.name, 0) > 1 else entry for entry in entries]


def host_items(text: str, flag: str = "-H") -> list[dict[str, Any]]:
    """The ``[[hosts]]`` tables ``-H`` stands for, one per host."""
    return [table for entry in host_entries(text, flag) for table in entry.tables()]


SSH_SCHEME = "ssh://"
"""``ssh://[user@]host[:port]``: SSH whatever the host is (``localhost`` is otherwise this
machine without SSH)."""
LOOPBACK_V6 = ("::1", "[::1]")
"""``-H ::1``: this machine, named ``localhost`` (a name must be able to name a log file)."""


MAX_HOSTS = 10_000
"""More hosts than this in ``-H`` is a typo (``gpu[01-1000000]``), refused before anything
is made of them; ``TORCHHERD_MAX_HOSTS`` raises it for a cluster that big."""


def max_hosts() -> int:
    given = os.environ.get("TORCHHERD_MAX_HOSTS", "")
    return int(given) if given.isdigit() and int(given) > 0 else MAX_HOSTS


def _too_many(flag: str, item: str, count: int) -> UsageError:
    return UsageError(f"{flag} {item!r}: {count:,} hosts, more than {max_hosts():,} (a typo in a range?)",
                      f"check the range; for a cluster that big, set TORCHHERD_MAX_HOSTS={count}")


def _entry(item: str, flag: str, room: int = MAX_HOSTS) -> HostEntry:
    if not item:
        raise UsageError(f"{flag}: empty host (two commas, or one at an end)", "write hosts like node0,node1")
    if item.startswith(SSH_SCHEME):
        return replace(_entry(item[len(SSH_SCHEME):], flag, room), transport="ssh")
    if item in LOOPBACK_V6:
        return HostEntry("localhost", address="::1")
    user, _, rest = item.rpartition("@")
    if _ipv6(rest):  # one message for every spelling: [fe80::1], fe80::1%eth0, ::
        address = rest.strip("[]").rsplit("]", 1)[0].strip("[")
        raise UsageError(f"{flag} {item!r}: {flag} does not take IPv6 addresses",
                         f'name the host in an inventory: name = "node3", address = "{address}"')
    host, port = _split_port(rest, item, flag)
    if not host or "@" in user or "[" in user:
        raise UsageError(f"{flag} {item!r}: expected [user@]host[:port]", "for example ubuntu@node1:2222")
    if "@" in item and not user:
        raise UsageError(f"{flag} {item!r}: an empty user before '@'", f"write {rest} (your own user name), "
                         f"or name the user: ubuntu@{rest}")
    if user and not valid_ruser(user):
        raise UsageError(f"{flag} {item!r}: {user!r} is not a user name: ssh would hand it to a shell", USER_HINT)
    try:
        count = pattern_size(host)
        if count > room:  # counted, not made: a million names take seconds and hundreds of MB
            raise _too_many(flag, item, count + max_hosts() - room)
        names = expand(host)
    except NodesetError as error:
        raise UsageError(f"{flag} {error}", "write a range like gpu[01-16] or gpu[1-3,7]") from None
    for name in names:
        if not HOST_NAME_PATTERN.match(name):
            raise UsageError(f"{flag} {item!r}: {name!r} is not a usable host name",
                             "use letters, digits, '.', '_' and '-' (it names the log file)")
        if name.isdigit():  # ssh and the resolver take 2 for the address 0.0.0.2
            raise UsageError(f"{flag} {item!r}: {name!r} is all digits, an address ({ip_address(int(name) % 2**32)}) "
                             "to ssh, not a name", "name hosts with a letter in them: node1, gpu[01-04]")
    return HostEntry(host, user or None, port)


def _ipv6(text: str) -> bool:
    """``[fe80::1]``, ``[::1]:22``, ``fe80::1%eth0``: colons inside a bracket group, or more
    than the one of host:port (a nodeset's brackets hold no colon)."""
    return (text.startswith("[") and ":" in text.split("]", 1)[0]) or text.count(":") > 1


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

_TOML_LINE = re.compile(r"""^(?:\[\[?[^\]]*\]\]?$|[A-Za-z0-9_.\-"']+\s*=)""")
"""A TOML table header, or a ``key = value`` line: a hostfile line starts with a host,
and a host is never followed by '=' (nor is the whole line one bracket group)."""
_BLOCK_COMMENT = re.compile(r"/\*.*?(?:\*/|\Z)", re.DOTALL)
_LINE_COMMENT = re.compile(r"#.*|//.*")
_EQUALS = re.compile(r"\s*=\s*")
_MPICH_SLOTS = re.compile(r"^(?P<host>[^\s:]+):(?P<slots>\d+)$")
HOSTFILE_SLOTS = ("slots", "count", "cpu")
"""PRRTE's names for a host's slot count: torchherd's nproc_per_node for that host."""
HOSTFILE_USER = ("username", "user-name", "user_name")
HOSTFILE_IGNORED = tuple(f"{a}{sep}{b}" for a, b in (("max", "slots"), ("slots", "max"), ("max", "cpu"),
                                                      ("cpu", "max"), ("max", "count"), ("count", "max"))
                         for sep in ("_", "-"))
"""PRRTE's ceilings (max_slots, slots-max, ...): they say nothing torchrun uses."""


def hostfile_lines(text: str) -> list[tuple[int, str]]:
    """(line number, text) of each line that says something, comments gone as PRRTE's
    lexer drops them: ``#`` and ``//`` to the end of the line, ``/* ... */`` anywhere."""
    text = _BLOCK_COMMENT.sub(lambda match: "\n" * match.group().count("\n"), text)
    lines = [(number, _LINE_COMMENT.sub("", raw).strip()) for number, raw in enumerate(text.splitlines(), start=1)]
    return [(number, line) for number, line in lines if line]


def looks_like_hostfile(path: Path, text: str) -> bool:
    """A DeepSpeed/MPI hostfile (``host slots=N``, one host a line) and not TOML, told
    by the content: a TOML file has a table header or a ``key = value`` line, a hostfile
    neither (``host slots = 4`` is a hostfile line that TOML would refuse)."""
    if path.suffix == ".toml":
        return False
    lines = [line for _, line in hostfile_lines(text)]
    return bool(lines) and not any(_TOML_LINE.match(line) for line in lines)


def hostfile_items(path: Path, text: str) -> list[dict[str, Any]]:
    """The hosts of a DeepSpeed/OpenMPI/PRRTE hostfile (``[user@]worker-1 slots=4``) or
    an MPICH one (``worker-1:4``); ``slots`` is the host's nproc_per_node. Errors name the line."""
    tables: list[dict[str, Any]] = []
    lines: dict[str, int] = {}
    for number, line in hostfile_lines(text):
        for table in _hostfile_line(path, number, line):
            if table["name"] in lines:
                raise InventoryError(f"{path}:{number}: host {table['name']!r} is listed twice (first on line "
                                     f"{lines[table['name']]})", "list every host once, with its slots")
            lines[table["name"]] = number
            tables.append(table)
    if not tables:
        raise InventoryError(f"{path}: no hosts listed", "write one host a line: worker-1 slots=4")
    return tables


def _hostfile_line(path: Path, number: int, line: str) -> list[dict[str, Any]]:
    where = f"{path}:{number}"
    host, *fields = _EQUALS.sub("=", line).split()  # PRRTE reads "slots = 4" as "slots=4"
    extra: dict[str, Any] = {}
    mpich = _MPICH_SLOTS.match(host)
    if mpich:
        host, extra["nproc_per_node"] = mpich.group("host"), int(mpich.group("slots"))
    if "@" in host:
        user, host = _hostfile_user(where, host)
        extra["user"] = user
    for field in fields:
        extra.update(_hostfile_field(where, field))
    try:
        names = expand(host)
    except NodesetError as error:
        raise InventoryError(f"{where}: {error}", "write a host name, or a range like gpu[01-04]") from None
    for name in names:
        if not HOST_NAME_PATTERN.match(name):
            raise InventoryError(f"{where}: {name!r} is not a usable host name",
                                 "a hostfile line is: [user@]host slots=N (the name has letters, digits, '.', "
                                 "'_' and '-')")
    return [{"name": name, **extra} for name in names]


def _hostfile_user(where: str, text: str) -> tuple[str, str]:
    user, _, host = text.partition("@")
    if "@" in host:
        raise InventoryError(f"{where}: {text!r}: more than one '@'", "a hostfile line is: [user@]host slots=N")
    if not user:
        raise InventoryError(f"{where}: {text!r}: an empty user before '@'", f"write {host}, or user@{host}")
    if not valid_ruser(user):
        raise InventoryError(f"{where}: {user!r} is not a user name: ssh would hand it to a shell", USER_HINT)
    return user, host


def _hostfile_field(where: str, field: str) -> dict[str, Any]:
    key, equals, value = field.partition("=")
    if key in HOSTFILE_SLOTS:
        if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= MAX_NPROC:
            raise InventoryError(f"{where}: {key}={value}: expected a positive integer", "for example slots=4")
        return {"nproc_per_node": int(value)}
    if key in HOSTFILE_USER and equals:
        if not value or not valid_ruser(value):
            raise InventoryError(f"{where}: {key}={value}: not a user name", USER_HINT)
        return {"user": value}
    if key == "port" and equals:
        if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= 65535:
            raise InventoryError(f"{where}: port={value}: expected an SSH port (1-65535)", "for example port=2222")
        return {"ssh_port": int(value)}
    if key in HOSTFILE_IGNORED and equals:
        return {}
    if not equals:
        raise InventoryError(f"{where}: {field!r}: expected key=value after the host",
                             "a hostfile line is: [user@]host slots=N (one host a line)")
    raise InventoryError(f"{where}: {key}: unknown key", "a hostfile line is: [user@]host slots=N")


def load_any(path: Path, schedulers: Schedulers = SSH_ONLY, **flags: Any) -> Inventory:
    """A TOML inventory, or a DeepSpeed/MPI hostfile (then ``flags`` give python, workdir, ...);
    ``schedulers``: as ``parse`` takes them."""
    raw = read(path)  # read once, and never more than an inventory can be (-i /dev/zero)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return loads(raw, path, schedulers)  # which says what is wrong with the file
    if not looks_like_hostfile(path, text):
        return override(loads(raw, path, schedulers), **flags)
    return parse(document(hostfile_items(path, text), flag=str(path), **flags), path, schedulers)


# choosing hosts for one run ------------------------------------------------------


def override(inventory: Inventory, *, python: str | None = None, workdir: str | None = None,
             nproc_per_node: int | str | None = None, master: str | None = None,
             port: int | None = None, ssh_timeout: float | None = None) -> Inventory:
    """The inventory with the command line's ``--python``, ``--workdir``,
    ``--nproc-per-node`` (every host, spares too), ``--master``, ``--master-port`` and
    ``--ssh-timeout``."""
    if nproc_per_node is not None:
        NPROC_PER_NODE.from_argument(nproc_per_node, "override")
    if ssh_timeout is not None:
        SSH_TIMEOUT.from_argument(ssh_timeout, "override")
    hosts, spares = inventory.hosts, inventory.spares
    changes: dict[str, Any] = {key: value for key, value in (("python", python), ("workdir", workdir))
                               if value is not None}
    if nproc_per_node is not None:
        changes["nproc_per_node"] = None  # the cluster's count, set below, for every host
    if changes:
        hosts = tuple(replace(host, **changes) for host in hosts)
        spares = tuple(replace(host, **changes) for host in spares)
    cluster = inventory.cluster
    if nproc_per_node is not None:
        cluster = replace(cluster, nproc_per_node=nproc_per_node, nproc_per_node_set=True)
    if port is not None:
        cluster = replace(cluster, port=port)
    if ssh_timeout is not None:
        cluster = replace(cluster, ssh_timeout=ssh_timeout)
    if master is not None:
        names = [host.name for host in hosts]
        if master not in names:
            raise UsageError(f"--master {master}: not one of the hosts ({_shown(names)})",
                             _did_you_mean(master, names))
        hosts = _with_master(hosts, master)
        cluster = replace(cluster, master=master)
    clash = master_port_problem(cluster.port, hosts, cluster.master) if port is not None or master else None
    if clash:
        raise UsageError(f"--master-port {cluster.port}: {clash}" if port is not None else f"--master {master}: "
                         f"[cluster].port {clash}", "choose a free port for the rendezvous (torchrun's default is 29500)")
    return replace(inventory, cluster=cluster, hosts=hosts, spares=spares)


SLOTS_ENV = "CUDA_VISIBLE_DEVICES"
Slots = Optional[Tuple[int, ...]]
"""A host's chosen slots (GPU numbers), sorted; None: all of them."""


def select(inventory: Inventory, include: str | None = None, exclude: str | None = None) -> Inventory:
    """The hosts ``include`` names (all when None) less those ``exclude`` names: names,
    nodesets or globs, comma-separated, or DeepSpeed's ``NAME[:SLOT[,SLOT...]][@...]``
    (``worker-0:0,1@worker-1:3``), which chooses or removes single slots: the slots left
    become that host's CUDA_VISIBLE_DEVICES and its nproc_per_node. When the master is
    left out, the first host left is the master."""
    names = [host.name for host in inventory.hosts]
    chosen: dict[str, Slots] = {name: None for name in names}
    if include is not None:
        wanted = _specs(include, names, "--include")
        chosen = {name: _checked(inventory, name, slots, f"--include {include!r}")
                  for name, slots in wanted.items()}
    if exclude is not None:
        for name, slots in _specs(exclude, names, "--exclude").items():
            left = () if slots is None or name not in chosen else \
                _without(inventory, name, chosen[name], slots, f"--exclude {exclude!r}")
            chosen = {key: value for key, value in chosen.items() if key != name} if not left else \
                {**chosen, name: left}
    hosts = [_with_slots(host, chosen[host.name]) for host in inventory.hosts if host.name in chosen]
    if not hosts:
        raise UsageError("--include/--exclude: no host is left", f"the hosts are {_shown(names)}")
    if hosts == list(inventory.hosts):
        return inventory
    master = inventory.cluster.master if inventory.cluster.master in chosen else hosts[0].name
    return replace(inventory, hosts=tuple(hosts), cluster=replace(inventory.cluster, master=master))


def _specs(text: str, names: Sequence[str], flag: str) -> dict[str, Slots]:
    """Host name -> the slots the text names there (None: the whole host), in the
    inventory's order. DeepSpeed's '@' separates hosts that carry slot lists."""
    found: dict[str, Slots] = {}
    parts = text.split("@") if "@" in text or _top_colon(text) >= 0 else [text]
    for part in parts:
        colon = _top_colon(part)
        items = _items(part if colon < 0 else part[:colon], flag)
        slots = None if colon < 0 else _slot_numbers(part, part[colon + 1:], flag)
        if slots is not None and len(items) != 1:
            raise UsageError(f"{flag} {part!r}: a slot list follows one host (or one nodeset)",
                             "write worker-0:0,1@worker-1:3 (DeepSpeed's form)")
        for item in items:
            matched = _match_item(item, names, flag)
            if not matched:
                raise UsageError(f"{flag} {item}: no such host", _did_you_mean(item, names))
            for name in matched:
                # As DeepSpeed: the slot lists of one host add up; a bare name is the whole host.
                whole = slots is None or (name in found and found[name] is None)
                found[name] = None if whole else tuple(sorted(set(found.get(name) or ()) | set(slots or ())))
    return {name: found[name] for name in names if name in found}


def _top_colon(text: str) -> int:
    """Where the first ':' outside brackets is (a slot list follows it), or -1."""
    depth = 0
    for index, char in enumerate(text):
        depth += (char == "[") - (char == "]")
        if char == ":" and depth == 0:
            return index
    return -1


def _items(text: str, flag: str) -> list[str]:
    try:
        return split_top(text)
    except NodesetError as error:
        raise UsageError(f"{flag} {text!r}: {error}", "write names, nodesets or globs: node1,gpu[01-04],cpu*") from None


def _slot_numbers(part: str, text: str, flag: str) -> tuple[int, ...]:
    numbers = [item.strip() for item in text.split(",")]
    bad = next((number for number in numbers if not (number.isascii() and number.isdigit())), None)
    if bad is not None:
        raise UsageError(f"{flag} {part!r}: {bad!r} is not a slot number",
                         "slots are GPU numbers from 0: worker-0:0,1@worker-1:3")
    return tuple(sorted({int(number) for number in numbers}))


def _slot_count(inventory: Inventory, name: str, given: str) -> int:
    """How many slots the host has: its process count (a number is needed to choose)."""
    host = inventory.host(name)
    count = inventory.cluster.nproc_per_node if host.nproc_per_node is None else host.nproc_per_node
    if not isinstance(count, int):
        raise UsageError(f"{given}: choosing slots of {name} needs its slot count (its nproc_per_node is "
                         f"{count!r})", "give it slots=N in the hostfile, nproc_per_node = N in the inventory, "
                         "or --nproc-per-node N")
    return count


def _checked(inventory: Inventory, name: str, slots: Slots, given: str) -> Slots:
    if slots is None:
        return None
    count = _slot_count(inventory, name, given)
    missing = [slot for slot in slots if slot >= count]
    if missing:
        raise UsageError(f"{given}: {name} has no slot {missing[0]} (its slots are 0-{count - 1})",
                         f"{name} runs {count} process(es): one slot each, numbered from 0")
    return slots


def _without(inventory: Inventory, name: str, kept: Slots, slots: tuple[int, ...], given: str) -> tuple[int, ...]:
    """The slots of ``kept`` (None: all of the host's) left once ``slots`` go."""
    _checked(inventory, name, slots, given)
    every = tuple(range(_slot_count(inventory, name, given))) if kept is None else kept
    return tuple(slot for slot in every if slot not in slots)


def _with_slots(host: Host, slots: Slots) -> Host:
    if slots is None:
        return host
    # Slot i is the host's i-th GPU: the i-th of its own CUDA_VISIBLE_DEVICES when it sets
    # one that long, else GPU i (DeepSpeed's reading of a hostfile's slots).
    visible = [item.strip() for item in host.env.get(SLOTS_ENV, "").split(",") if item.strip()]
    devices = [visible[slot] if len(visible) > max(slots) else str(slot) for slot in slots]
    return replace(host, nproc_per_node=len(slots), env=MappingProxyType({**host.env, SLOTS_ENV: ",".join(devices)}))


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
