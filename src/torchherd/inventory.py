"""The host inventory: TOML in, frozen dataclasses out.

The file is parsed and validated once, here; nothing downstream sees raw dicts.
Every error names the file and the key, says what was expected, and how to fix it.
"""

from __future__ import annotations

import difflib
import re
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, NoReturn, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from torchherd.errors import InventoryError
from torchherd.imagearchive import HINT as ARCHIVE_HINT
from torchherd.imagearchive import ImageArchive, holds, read_archive
from torchherd.nodeset import NodesetError, expand
from torchherd.remote import container as containers

NPROC_WORDS = ("gpu", "cpu", "auto")
RDZV_BACKENDS = ("static", "c10d")
SCHEDULERS = ("ssh", "slurm")
HOST_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")  # \Z: "$" takes a final newline
ADDRESS_PATTERN = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9._-]{0,252}|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*)\Z")  # \Z: "$" takes a final newline
"""A host name, an IPv4 or IPv6 address, or an ssh_config alias: nothing a shell would
read as more (an address reaches ssh_config's `Match exec` and `ProxyCommand` tokens)."""

MAX_NPROC = 4096
"""More processes than any node runs: a larger count is a typo (or 10**18)."""
MAX_SECONDS = 3600.0
MAX_INVENTORY_BYTES = 16 << 20
"""Far above 50,000 hosts (3 MB); a larger "inventory" (``-i /dev/zero``) is refused."""
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
"""Never in a one-line value (a name, a path, a user): a newline or NUL there splits or
cuts what the shell, ssh or the terminal sees."""
SHELL_USER_CHARS = frozenset("'`\";&<>|(){}")
SHELL_HOST_CHARS = frozenset("'`\"$\\;&<>|(){},")
C_SPACE = frozenset(" \t\n\v\f\r")


def valid_ruser(user: str) -> bool:
    """OpenSSH's ``ssh_valid_ruser`` (readconf.c): a user name that ssh_config's ``%r`` can
    put into a ``Match exec`` or ``ProxyCommand`` shell line without the shell acting on
    it (CVE-2023-51385). Not empty, no leading '-', no control character, none of
    ``'`";&<>|(){}``, no '-' after a space, no '\\' at the end."""
    if not user or user.startswith("-"):
        return False
    for index, char in enumerate(user):
        following = user[index + 1:index + 2]
        if CONTROL.match(char) or char in SHELL_USER_CHARS:
            return False
        if (char in C_SPACE and following == "-") or (char == "\\" and not following):
            return False
    return True


def valid_hostname(host: str) -> bool:
    """OpenSSH's ``ssh_valid_hostname`` (readconf.c), for ``%h``: not empty, no leading '-',
    no space or control character, none of ``'`"$\\;&<>|(){},``."""
    if not host or host.startswith("-"):
        return False
    return not any(CONTROL.match(char) or char in C_SPACE or char in SHELL_HOST_CHARS for char in host)


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
LOCAL_ADDR = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,252}\Z|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*\Z")

USER_HINT = "a user name is letters, digits, '.', '_' and '-' (OpenSSH refuses the others too)"

CLUSTER_KEYS = (
    "master", "port", "nproc_per_node", "rdzv_backend", "master_addr",
    "ssh_config", "ssh_timeout", "scheduler",
)
NODE_KEYS = ("user", "ssh_port", "identity_file", "python", "workdir", "env", "setup", "uv", "venv_dir")
HOST_KEYS = ("name", "address", "local_addr", "nproc_per_node", "spare", "container") + NODE_KEYS
CONTAINER_KEYS = ("image", "runtime", "mounts", "options", "pull", "archive")
STEP_KEYS = ("address", "local_addr")
"""Host keys that may be nodesets too, expanding in step with the name."""
SYNC_KEYS = ("dir", "exclude", "include", "dest")
TOP_KEYS = ("cluster", "defaults", "hosts", "sync", "slurm", "recovery", "checks", "container", "uv")
UV_KEYS = ("wheels", "offline")
RECOVERY_KEYS = ("retries", "final_exit_codes", "spares", "min_nodes", "hang_timeout", "checkpoint", "heartbeat",
                 "heartbeat_misses", "replicate", "replicate_bandwidth")
HEARTBEAT_RANGE = (0.1, 5.0)
"""Seconds between heartbeats: below 0.1 s the beats cost more than they tell; above 5 s a lost
node goes unnoticed for half a minute or more."""
MISSES_RANGE = (2, 60)
"""Heartbeats missed in a row before a node whose link does not answer is lost: one late beat
is never a loss."""
MIN_LOST_AFTER = 1.0
"""``heartbeat`` x ``heartbeat_misses`` at least: a shorter silence is a busy scheduler, not a lost node."""
MAX_REPLICAS = 64
"""More copies of a checkpoint than any run keeps: a larger count is a typo."""
MAX_RETRIES = 1000
"""More attempts than any run makes: a larger count is a typo."""
CHECKS_KEYS = ("min_bandwidth", "slow_ratio")
RATE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT]?)(?:bit|b)?(?:/s|ps)?\s*\Z")
RATE_UNITS = {"": 1e9, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
"""A rate without a unit is in Gbit/s."""
SLURM_KEYS = ("login", "partition", "account", "nodes", "nodelist", "gpus_per_node", "time", "extra")
SLURM_TEMPLATE_HOST = "slurm-node"
"""The one host of a SLURM inventory without [[hosts]]: the [defaults] every node runs with."""

T = TypeVar("T")


@dataclass(frozen=True)
class ContainerSettings:
    """The ``[container]`` table (a host's ``container`` table overrides it key by key),
    ``--image``: the job runs inside this image on the node (torchherd docs containers)."""

    image: str
    runtime: str = "auto"
    """One of "auto", "podman", "docker", "apptainer", "enroot"; "auto": the first installed."""
    mounts: tuple[str, ...] = ()
    """More ``SRC[:DST[:OPTIONS]]`` mounts; the workdir is always mounted at itself."""
    options: tuple[str, ...] = ()
    """More options of the runtime's run command, one word each."""
    pull: str = "never"
    """docker/podman: "never" (the image must be there), "missing" or "always": ``run``
    pulls it on every node before its preflight (``engine.pull``); ``check`` never pulls."""
    archive: ImageArchive | None = None
    """docker/podman: a ``docker save`` tar of the image on the controller, relayed node to
    node and loaded where the image is missing (``--image-archive``)."""


@dataclass(frozen=True)
class Host:
    """One node as the inventory describes it, defaults already applied."""

    name: str
    address: str
    """How the controller reaches the node over SSH (an ssh_config alias works)."""
    user: str | None
    ssh_port: int | None
    identity_file: str | None
    python: str
    workdir: str
    env: Mapping[str, str]
    setup: str
    local_addr: str | None
    """The address the other nodes reach this node at, when not its SSH address."""
    nproc_per_node: int | str | None = None
    """This node's own process count (uneven GPU counts); None: the cluster's."""
    spare: bool = False
    """Checked in the first preflight, not launched: it takes the place of an excluded node."""
    container: ContainerSettings | None = None
    """The image the job runs in on this node; None: on the node itself."""
    uv: str | None = None
    """The uv binary on the node, for a uv-locked project (None: looked for on the node)."""
    venv_dir: str | None = None
    """Where a uv-locked project's venvs are kept on the node, one per lock; None: in the
    synced project (``.torchherd-venvs``), as local or as shared as the project is."""


@dataclass(frozen=True)
class Cluster:
    master: str
    port: int
    nproc_per_node: int | str
    rdzv_backend: str
    master_addr: str | None
    ssh_config: Path | None
    ssh_timeout: float
    rdzv_backend_set: bool = False
    """Whether the inventory chose the rendezvous itself (not the "static" default)."""
    scheduler: str = "ssh"
    """"ssh": torchherd starts every node itself; "slurm": SLURM does (``[slurm]``)."""


@dataclass(frozen=True)
class SlurmSettings:
    """The ``[slurm]`` table: how the job is handed to SLURM (``--scheduler slurm``)."""

    login: str | None = None
    """The host sbatch runs on, reached over SSH like a node; None: run it on this machine."""
    partition: str | None = None
    account: str | None = None
    nodes: int | None = None
    nodelist: str | None = None
    """A nodeset (``gpu[01-04]``); without it and ``nodes``, the [[hosts]] by name."""
    gpus_per_node: int | None = None
    time: str | None = None
    extra: tuple[str, ...] = ()
    """More sbatch options, each one as sbatch takes it (``--qos=high``)."""


@dataclass(frozen=True)
class UvSettings:
    """The ``[uv]`` table: what this machine offers nodes that lack uv (`torchherd docs environments`)."""

    wheels: str | None = None
    """A directory of this machine's holding ``uv`` wheels (``pip download uv --platform ...``):
    a node of another platform gets the binary of the wheel for its own; and the lock's
    wheels are looked for there first (``offline``)."""
    offline: bool = False
    """A node that must build its venv gets the lock's wheels from this machine, relayed
    node to node, and builds with no network (``--uv-offline``)."""


@dataclass(frozen=True)
class SyncSettings:
    """The ``[sync]`` table: what ``--sync`` sends, and where it goes on each node."""

    dir: Path | None = None
    """The local project (default: the enclosing git repository, else the current directory)."""
    exclude: tuple[str, ...] = ()
    """Patterns left out, as .gitignore writes them."""
    include: tuple[str, ...] = ()
    """Patterns sent although the private defaults (or ``exclude``) leave them out, e.g. ``.env``."""
    dest: str | None = None
    """Where the project goes on each node: relative to the workdir, or a path inside it."""


@dataclass(frozen=True)
class Recovery:
    """The ``[recovery]`` table, ``run --retries`` and friends, ``Cluster.launch(recovery=...)``
    (torchherd docs run: Recovery). The default, no retries, is a run as it always was."""

    retries: int = 0
    """New attempts after a failed one (a rank failed, a node lost), each after triage."""
    final_exit_codes: tuple[int, ...] = ()
    """Exit codes that end the run at once (a bad-arguments exit is no node's fault)."""
    min_nodes: int | None = None
    """With no spare left, go on with fewer nodes, down to this many; None: never shrink."""
    hang_timeout: float | None = None
    """Seconds without a line from any rank and without CPU used by any: the job is hung
    (every rank's stack is taken, the attempt fails); None: never."""
    checkpoint: str | None = None
    """The job's checkpoint, a file or a directory relative to the workdir (a glob: its
    newest match), put on every node of a new attempt that lacks it; None: none staged."""
    heartbeat: float = 0.5
    """Seconds between two heartbeats, both ways (controller and each node's supervisor)."""
    heartbeat_misses: int = 5
    """A node is lost once this many heartbeats in a row are missing and its SSH connection
    does not answer either (0.5 s x 5: noticed in 2.5 s)."""

    replicate: int | None = None
    """Other nodes each new checkpoint is copied to while the job runs (the next ones in
    the ring of node ranks); None: 1 when there is a ``checkpoint``; 0: none."""
    replicate_bandwidth: Bandwidth = field(default_factory=lambda: DEFAULT_REPLICATE_BANDWIDTH)
    """The most a replica's copy may take of the link (``Bandwidth``)."""

    @property
    def lost_after(self) -> float:
        """Seconds of silence, from the node and its SSH connection both, that lose a node."""
        return self.heartbeat * self.heartbeat_misses

    @property
    def replicas(self) -> int:
        """How many other nodes each new checkpoint is copied to (0: no replication)."""
        if self.checkpoint is None:
            return 0
        return 1 if self.replicate is None else self.replicate


HEARTBEAT_HINT = "heartbeat = 0.5 with heartbeat_misses = 5 (the default) notices a lost node in 2.5 s"


def heartbeat_problem(recovery: Recovery) -> str | None:
    """Why ``recovery``'s heartbeat settings cannot be used, or None (the inventory's reader
    and ``Cluster.launch(recovery=...)`` both ask)."""
    low, high = HEARTBEAT_RANGE
    if not low <= recovery.heartbeat <= high:
        return f"heartbeat is {recovery.heartbeat:g} s; expected seconds between heartbeats, from {low:g} to {high:g}"
    low_misses, high_misses = MISSES_RANGE
    if not low_misses <= recovery.heartbeat_misses <= high_misses:
        return f"heartbeat_misses is {recovery.heartbeat_misses}; expected an integer from {low_misses} to {high_misses}"
    if recovery.lost_after < MIN_LOST_AFTER:
        return (f"heartbeat x heartbeat_misses is {recovery.lost_after:g} s: a node would be lost after less than "
                f"{MIN_LOST_AFTER:g} s of silence, which a busy node can take")
    return None


DEFAULT_REPLICATE_SHARE = 0.25
"""A replica's copy takes at most a quarter of the link: the job's own traffic keeps the rest."""
DEFAULT_REPLICATE_PER_CORE = 5e6
"""And by default at most 5 MB/s per CPU core of the node: what a copy costs in the kernel
(its packets, the pages it writes) is no one's to lower by priority, and where cores are
few or the link is virtual (a veth pair states 10 Gb/s) a share of the link does not bind.
Measured on 2 cores, each node one rank busy with a 9 ms step (``scripts/bench-replication``,
1 GB copied): 10 MB/s slowed the steps by 0.5-2.5 %, 20 MB/s by about 5 %, the link's
quarter (unbound there) by half. A 64-core node may copy at 320 MB/s: the share binds first
on links of 10 Gb/s and slower."""
BANDWIDTH = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(%|[kKMGT]?B/s|[kKMGT]?bit/s)\s*\Z")
BANDWIDTH_HINT = ('give "auto" (the default), a share of the link such as "25%", or a rate such as "200MB/s" '
                  'or "800Mbit/s"')


@dataclass(frozen=True)
class Bandwidth:
    """A cap on a background copy: a share of the link's speed (as the node's kernel
    states it), or so many bytes per second."""

    share: float | None = None
    """From 0 to 1 (exclusive of 0)."""
    bytes_per_second: float | None = None
    per_core: float | None = None
    """With a share: at most so many bytes per second per CPU core the node gives the copy
    (the default's, ``"auto"``)."""

    def wire(self) -> dict[str, float]:
        """As the node program ``checkpoint.py`` takes it (its ``rate``)."""
        if self.bytes_per_second is not None:
            return {"bytes": self.bytes_per_second}
        share = {"share": self.share if self.share is not None else DEFAULT_REPLICATE_SHARE}
        return share if self.per_core is None else {**share, "per_core": self.per_core}

    def __str__(self) -> str:
        if self.bytes_per_second is not None:
            return f"{self.bytes_per_second / 1e6:g} MB/s"
        cores = f" and {self.per_core / 1e6:g} MB/s per CPU core" if self.per_core is not None else ""
        return f"{(self.share or 0) * 100:g}% of the link{cores}"


DEFAULT_REPLICATE_BANDWIDTH: Bandwidth = Bandwidth(share=DEFAULT_REPLICATE_SHARE, per_core=DEFAULT_REPLICATE_PER_CORE)
"""``replicate_bandwidth = "auto"``."""


def parse_bandwidth(text: str) -> Bandwidth | None:
    """"auto" (the default), "25%", "200MB/s", "1.5GB/s", "800Mbit/s"; None when it is none
    of these (or 0, or over 100%)."""
    if text.strip() == "auto":
        return DEFAULT_REPLICATE_BANDWIDTH
    match = BANDWIDTH.match(text)
    if match is None or float(match.group(1)) <= 0:
        return None
    number, unit = float(match.group(1)), match.group(2)
    if unit == "%":
        return Bandwidth(share=number / 100) if number <= 100 else None
    scale = RATE_UNITS[unit[0].lower()] if unit[0] in "kKMGT" else 1.0
    return Bandwidth(bytes_per_second=number * scale / (8 if "bit" in unit else 1))


def replicate_problem(value: Any) -> str | None:
    """Why ``value`` is not a count of replicas, or None."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_REPLICAS:
        return f"expected an integer from 0 to {MAX_REPLICAS} (0: no replication), got {_show(value)}"
    return None


CHECKPOINT_HINT = "give a path inside the job's workdir, relative to it (e.g. snapshot.pt or checkpoints/step-*.pt)"


def checkpoint_problem(path: str) -> str | None:
    """Why ``path`` cannot name a checkpoint (relative to the workdir, staying inside it:
    staging writes it on every node, and nothing outside the workdir is ever written), or None."""
    if not path.strip():
        return "an empty path"
    if CONTROL.search(path):
        return f"{path!r} holds a control character"
    if path.startswith(("/", "~")):
        return f"{path!r} is absolute: a checkpoint is staged inside the workdir only"
    parts = path.split("/")
    if ".." in parts:
        return f"{path!r} leaves the workdir ('..'): a checkpoint is staged inside the workdir only"
    if all(part in ("", ".") for part in parts):
        return f"{path!r} is the workdir itself"
    return None


@dataclass(frozen=True)
class ChecksSettings:
    """The ``[checks]`` table: what ``check --bandwidth`` holds the links to."""

    min_bandwidth: float | None = None
    """Bits per second: a link or node below fails; None: no floor."""
    slow_ratio: float = 0.5
    """A link or node below this share of the cluster's median warns."""


def parse_rate(text: str) -> float | None:
    """Bits per second from "10Gbit", "100 Mbit/s", "25G" or "40" (Gbit/s); None when it is none of these."""
    match = RATE.match(text)
    if match is None or float(match.group(1)) <= 0:
        return None
    return float(match.group(1)) * RATE_UNITS[match.group(2).lower()]


@dataclass(frozen=True)
class Inventory:
    path: Path
    cluster: Cluster
    hosts: tuple[Host, ...]
    """In node-rank order: the master first, then the others as the file lists them."""
    sync: SyncSettings | None = None
    slurm: SlurmSettings = SlurmSettings()
    spares: tuple[Host, ...] = ()
    """Hosts marked ``spare = true`` (or named by ``[recovery].spares``), in file order: not in
    ``hosts``, never launched unless recovery takes one."""
    recovery: Recovery = Recovery()
    checks: ChecksSettings = ChecksSettings()
    uv: UvSettings = UvSettings()

    def host(self, name: str) -> Host:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(name)


class _Reader:
    """Reads typed values out of one TOML table, naming the key in every error."""

    def __init__(self, path: Path, where: str, table: Mapping[str, Any], allowed: tuple[str, ...]):
        self.path = path
        self.where = where
        self.table = table
        for key in table:
            if key not in allowed:
                self.fail(key, "unknown key", _did_you_mean(key, allowed))

    def fail(self, key: str, problem: str, hint: str = "") -> NoReturn:
        shown = repr(key) if CONTROL.search(key) else key  # the error stays one line
        raise InventoryError(f"{self.path}: {self.where}{shown}: {problem}", hint)

    def get(self, key: str, default: T, convert: Callable[[str, Any], T]) -> T:
        if key not in self.table:
            return default
        return convert(key, self.table[key])

    def text(self, key: str, value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            self.fail(key, f"expected a non-empty string, got {_show(value)}")
        if CONTROL.search(value):
            self.fail(key, f"{value!r} holds a control character (a newline, a NUL, ...)", "write it on one line")
        return str(value)

    def user(self, key: str, value: Any) -> str:
        text = self.text(key, value)
        if not valid_ruser(text):
            self.fail(key, f"{text!r} is not a user name: ssh would hand it to a shell", USER_HINT)
        return text

    def host(self, key: str, value: Any) -> str:
        text = self.text(key, value)
        if not (ADDRESS_PATTERN.match(text) and valid_hostname(text)):
            self.fail(key, f"{text!r} is not a host name, an IP address or an ssh_config alias",
                      "use letters, digits, '.', '-' and '_' (or an IP address); put the user in [defaults].user")
        return text

    def local_addr(self, key: str, value: Any) -> str:
        text = self.text(key, value)
        if not LOCAL_ADDR.match(text):
            self.fail(key, f"{text!r} is not an IP address or a host name",
                      "the address the other nodes reach this node at, e.g. 10.0.0.5")
        return text

    def address(self, key: str, value: Any) -> str:
        text = self.text(key, value)
        if not ADDRESS_PATTERN.match(text):
            self.fail(key, f"{text!r} is not a host name, an IP address or an ssh_config alias",
                      "use letters, digits, '.', '-' and '_' (or an IP address); put users and ports "
                      "in user and ssh_port")
        return text

    def existing_file(self, key: str, value: Any) -> str:
        text = self.text(key, value)
        if not Path(text).expanduser().is_file():
            self.fail(key, f"{text!r}: no such file", "fix the path, or leave the key out")
        return text

    def script(self, key: str, value: Any) -> str:
        if not isinstance(value, str):
            self.fail(key, f"expected a string, got {_show(value)}")
        if "\0" in value:
            self.fail(key, "holds a NUL character, which no shell can run")
        return str(value)

    def port(self, key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
            self.fail(key, f"expected a port number from 1 to 65535, got {_show(value)}")
        return int(value)

    def seconds(self, key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_SECONDS:
            self.fail(key, f"expected a positive number of seconds (at most {MAX_SECONDS:g}), got {_show(value)}")
        return float(value)

    def rate(self, key: str, value: Any) -> float:
        found = parse_rate(str(value)) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else None
        if found is None:
            self.fail(key, f"expected a rate such as \"10Gbit\" or \"800Mbit\", got {_show(value)}")
        return found

    def ratio(self, key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
            self.fail(key, f"expected a share of the median between 0 and 1 (0.5: half), got {_show(value)}")
        return float(value)

    def nproc(self, key: str, value: Any) -> int | str:
        if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_NPROC:
            return value
        if isinstance(value, str) and value in NPROC_WORDS:
            return value
        self.fail(key, f"expected a positive integer (at most {MAX_NPROC}) or one of {', '.join(map(repr, NPROC_WORDS))}, "
                       f"got {_show(value)}")

    def count(self, key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            self.fail(key, f"expected a positive integer, got {_show(value)}")
        return int(value)

    def flag(self, key: str, value: Any) -> bool:
        if not isinstance(value, bool):
            self.fail(key, f"expected true or false, got {_show(value)}")
        return value

    def checkpoint(self, key: str, value: Any) -> str:
        text = self.text(key, value)
        problem = checkpoint_problem(text)
        if problem is not None:
            self.fail(key, problem, CHECKPOINT_HINT)
        return text

    def heartbeat(self, key: str, value: Any) -> float:
        low, high = HEARTBEAT_RANGE
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            self.fail(key, f"expected seconds between heartbeats, from {low:g} to {high:g}, got {_show(value)}",
                      HEARTBEAT_HINT)
        return float(value)

    def misses(self, key: str, value: Any) -> int:
        low, high = MISSES_RANGE
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            self.fail(key, f"expected an integer from {low} to {high}, got {_show(value)}", HEARTBEAT_HINT)
        return int(value)

    def replicate(self, key: str, value: Any) -> int:
        problem = replicate_problem(value)
        if problem is not None:
            self.fail(key, problem)
        return int(value)

    def bandwidth(self, key: str, value: Any) -> Bandwidth:
        found = parse_bandwidth(value) if isinstance(value, str) else None
        if found is None:
            self.fail(key, f"expected a share or a rate, got {_show(value)}", BANDWIDTH_HINT)
        return found

    def retries(self, key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_RETRIES:
            self.fail(key, f"expected an integer from 0 to {MAX_RETRIES}, got {_show(value)}")
        return int(value)

    def exit_codes(self, key: str, value: Any) -> tuple[int, ...]:
        if not isinstance(value, list) or not all(
                isinstance(code, int) and not isinstance(code, bool) and 1 <= code <= 255 for code in value):
            self.fail(key, f"expected a list of exit codes from 1 to 255, got {_show(value)}",
                      "write final_exit_codes = [2]")
        return tuple(int(code) for code in value)

    def nodeset(self, key: str, value: Any) -> str:
        text = self.text(key, value)
        if "/" in text:  # sbatch reads a nodelist with a "/" as a file of names: torchherd would count one name
            self.fail(key, f"{text!r} names a file (sbatch reads it as one); torchherd needs the nodes themselves",
                      'write them as a nodeset, e.g. "gpu[01-04],cpu7"')
        try:
            names = expand(text)
        except NodesetError as error:
            self.fail(key, f"not a nodeset: {error}", 'write it as SLURM does, e.g. "gpu[01-04],cpu7"')
        seen: set[str] = set()
        for name in names:  # sbatch counts a node once: a retry that leaves one out would ask for too many
            if name in seen:
                self.fail(key, f"node {name!r} is listed twice", "list every node once")
            seen.add(name)
        return text

    def options(self, key: str, value: Any) -> tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(item, str) and item.startswith("-") for item in value):
            self.fail(key, f"expected a list of sbatch options, got {_show(value)}",
                      'write extra = ["--qos=high", "--exclusive"]')
        return tuple(value)

    def image(self, key: str, value: Any) -> str:
        problem = containers.image_problem(value)
        if problem:
            self.fail(key, problem, "quote nothing: write the reference as docker pull takes it")
        return str(value)

    def archive(self, key: str, value: Any) -> ImageArchive:
        text = self.text(key, value)
        path = Path(text).expanduser()
        if not path.is_absolute() and self.path.is_file():
            path = self.path.parent / path  # as [sync].dir: relative to the inventory
        try:
            return read_archive(str(path))
        except ValueError as error:
            self.fail(key, f"{path}: {error}", ARCHIVE_HINT)

    def mounts(self, key: str, value: Any) -> tuple[str, ...]:
        return self._items(key, value, "mounts", containers.mount_problem, 'write mounts = ["/data:/data:ro"]',
                           'write mounts = ["/data:/data:ro"]')

    def runtime_options(self, key: str, value: Any) -> tuple[str, ...]:
        return self._items(key, value, "options", containers.option_problem,
                           'write options = ["--cap-add=SYS_PTRACE"]', "one option per item, as one word: --name=value")

    def _items(self, key: str, value: Any, what: str, problem_of: Callable[[Any], str | None], shape_hint: str,
               item_hint: str) -> tuple[str, ...]:
        """A list whose every item ``problem_of`` passes (it names what is wrong with one)."""
        if not isinstance(value, list):
            self.fail(key, f"expected a list of {what}, got {_show(value)}", shape_hint)
        for item in value:
            problem = problem_of(item)
            if problem:
                self.fail(key, problem, item_hint)
        return tuple(value)

    def choice(self, choices: tuple[str, ...]) -> Callable[[str, Any], str]:
        def convert(key: str, value: Any) -> str:
            if value not in choices:
                self.fail(key, f"expected one of {', '.join(map(repr, choices))}, got {_show(value)}")
            return str(value)
        return convert

    def env(self, key: str, value: Any) -> Mapping[str, str]:
        if not isinstance(value, dict):
            self.fail(key, f"expected a table of NAME = \"value\", got {_show(value)}",
                      'write env = { NCCL_DEBUG = "WARN" }')
        result: dict[str, str] = {}
        for name, item in value.items():
            if not ENV_NAME.match(name):
                self.fail(f"{key}.{name!r}", "not a valid environment variable name",
                          "letters, digits and '_', not starting with a digit")
            if isinstance(item, bool) or not isinstance(item, (str, int, float)):
                self.fail(f"{key}.{name}", f"expected a string, got {_show(item)}", "quote the value")
            if "\0" in str(item):
                self.fail(f"{key}.{name}", "holds a NUL character, which no environment can")
            result[name] = str(item)
        return result


def _did_you_mean(key: str, allowed: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    if close:
        return f"did you mean {close[0]!r}?"
    return f"known keys: {', '.join(allowed)}"


def _show(value: Any) -> str:
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(value), type(value).__name__)
    shown = repr(value) if not isinstance(value, (dict, list)) else ""
    return f"{kind} {shown}".strip()


def load(path: Path) -> Inventory:
    """Reads and validates the inventory at ``path``; raises InventoryError naming file and key."""
    return loads(read(path), path)


def read(path: Path) -> bytes:
    """The file's bytes, at most MAX_INVENTORY_BYTES (``-i /dev/zero`` must not eat the memory)."""
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_INVENTORY_BYTES + 1)
    except FileNotFoundError:
        raise InventoryError(f"{path}: inventory file not found",
                             "pass one with -i FILE or set TORCHHERD_INVENTORY; write one with `torchherd init "
                             "-H HOSTS` (or `torchherd init --example`: every key, explained); or give the "
                             "hosts with -H instead") from None
    except OSError as error:
        raise InventoryError(f"{path}: cannot read the inventory: {error.strerror}") from None
    if len(raw) > MAX_INVENTORY_BYTES:
        raise InventoryError(f"{path}: larger than {MAX_INVENTORY_BYTES >> 20} MiB: not an inventory",
                             "pass the TOML inventory file with -i")
    return raw


def loads(raw: bytes, path: Path) -> Inventory:
    """The inventory in ``raw`` (the bytes of ``path``, which errors name)."""
    try:
        document = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise InventoryError(f"{path}: not UTF-8 text", "save the inventory as UTF-8") from None
    except RecursionError:  # tomllib recurses once per level of nesting
        raise InventoryError(f"{path}: TOML nested too deeply", "an inventory is a few flat tables") from None
    except tomllib.TOMLDecodeError as error:
        raise InventoryError(f"{path}: TOML syntax error: {error}",
                             "fix the line named; `torchherd init --example -i example.toml` writes an example "
                             "of every key") from None
    return parse(document, path)


def parse(document: Mapping[str, Any], path: Path) -> Inventory:
    _Reader(path, "", document, TOP_KEYS)
    defaults, cluster_table = _defaults_nproc(_table(document, "defaults", path), _table(document, "cluster", path),
                                              path)
    slurm = parse_slurm(_table(document, "slurm", path), path, "[slurm].")
    recovery, spare_names = _parse_recovery(_table(document, "recovery", path), path)
    container = _container_table(_Reader(path, "[container].", _table(document, "container", path), CONTAINER_KEYS))
    if _slurm_without_hosts(document, cluster_table, slurm, path):
        hosts: tuple[Host, ...] = (_slurm_template(defaults, path, container),)
    else:
        hosts = _spares_marked(_parse_hosts(document, defaults, path, container), spare_names, path)
    spares = tuple(host for host in hosts if host.spare)
    hosts = tuple(host for host in hosts if not host.spare)
    if not hosts:
        raise InventoryError(f"{path}: hosts: every host is a spare", "a run needs at least one host that is not")
    cluster = _parse_cluster(cluster_table, hosts, path, tuple(host.name for host in spares))
    master = next(host for host in hosts if host.name == cluster.master)
    ranked = (master,) + tuple(host for host in hosts if host is not master)
    sync = _parse_sync(_table(document, "sync", path), path) if "sync" in document else None
    checks = _parse_checks(_table(document, "checks", path), path)
    uv = _parse_uv(_table(document, "uv", path), path)
    return Inventory(path=path, cluster=cluster, hosts=ranked, sync=sync, slurm=slurm, spares=spares,
                     recovery=recovery, checks=checks, uv=uv)


def _parse_uv(table: Mapping[str, Any], path: Path) -> UvSettings:
    read = _Reader(path, "[uv].", table, UV_KEYS)
    wheels = read.get("wheels", None, read.text)
    if wheels is not None and not Path(wheels).expanduser().is_dir():
        read.fail("wheels", f"{wheels} is not a directory on this machine",
                  f"mkdir -p {wheels} && pip download uv --no-deps --only-binary=:all: --platform "
                  f"manylinux_2_17_x86_64 -d {wheels} (the nodes' platform)")
    return UvSettings(wheels=wheels, offline=read.get("offline", False, read.flag))


def _parse_recovery(table: Mapping[str, Any], path: Path) -> tuple[Recovery, frozenset[str]]:
    """The ``[recovery]`` table, and the host names its ``spares`` nodeset stands for."""
    read = _Reader(path, "[recovery].", table, RECOVERY_KEYS)
    spares = read.get("spares", None, read.nodeset)
    min_nodes = read.get("min_nodes", None, read.count)
    recovery = Recovery(retries=read.get("retries", 0, read.retries),
                        final_exit_codes=read.get("final_exit_codes", (), read.exit_codes), min_nodes=min_nodes,
                        hang_timeout=read.get("hang_timeout", None, read.seconds),
                        checkpoint=read.get("checkpoint", None, read.checkpoint),
                        heartbeat=read.get("heartbeat", 0.5, read.heartbeat),
                        heartbeat_misses=read.get("heartbeat_misses", 5, read.misses),
                        replicate=read.get("replicate", None, read.replicate))
    problem = heartbeat_problem(recovery)
    if problem is not None:
        read.fail("heartbeat_misses" if "heartbeat_misses" in table else "heartbeat", problem, HEARTBEAT_HINT)
    if "replicate_bandwidth" in table:
        recovery = replace(recovery, replicate_bandwidth=read.bandwidth("replicate_bandwidth",
                                                                         table["replicate_bandwidth"]))
    if recovery.checkpoint is None and (recovery.replicate or "replicate_bandwidth" in table):
        key = "replicate" if recovery.replicate else "replicate_bandwidth"
        read.fail(key, "replication copies the checkpoint, and [recovery].checkpoint names none",
                  'add checkpoint = "PATH" to [recovery] (e.g. "snapshot.pt"), or remove ' + key)
    return recovery, frozenset(expand(spares) if spares else ())


def _spares_marked(hosts: tuple[Host, ...], names: frozenset[str], path: Path) -> tuple[Host, ...]:
    unknown = sorted(names - {host.name for host in hosts})
    if unknown:
        raise InventoryError(f"{path}: [recovery].spares: {unknown[0]!r} is not one of the hosts",
                             "list the spare under [[hosts]] too, or mark it there with spare = true")
    return tuple(replace(host, spare=True) if host.name in names else host for host in hosts)


def with_spares(inventory: Inventory, names: frozenset[str], where: str = "--spares") -> Inventory:
    """The inventory with the hosts ``names`` set aside as spares (after those it has);
    the master gives way to the first host left when it is one of them."""
    known = {host.name for host in inventory.hosts} | {host.name for host in inventory.spares}
    unknown = sorted(names - known)
    if unknown:
        raise InventoryError(f"{where}: {unknown[0]!r} is not one of the hosts",
                             f"the hosts are {', '.join(sorted(known))}")
    hosts = tuple(host for host in inventory.hosts if host.name not in names)
    if not hosts:
        raise InventoryError(f"{where}: every host would be a spare", "a run needs at least one host that is not")
    spares = inventory.spares + tuple(replace(host, spare=True) for host in inventory.hosts if host.name in names)
    cluster = inventory.cluster
    if cluster.master in names:
        cluster = replace(cluster, master=hosts[0].name)
    return replace(inventory, hosts=hosts, spares=spares, cluster=cluster)


def _container_table(read: _Reader) -> dict[str, Any]:
    """The container keys of ``read``'s table, read and validated."""
    values: dict[str, Any] = {}
    for key, convert in (("image", read.image), ("runtime", read.choice(containers.RUNTIME_CHOICES)),
                         ("mounts", read.mounts), ("options", read.runtime_options),
                         ("pull", read.choice(containers.PULL_CHOICES)), ("archive", read.archive)):
        if key in read.table:
            values[key] = convert(key, read.table[key])
    return values


def _host_container(read: _Reader, base: Mapping[str, Any]) -> ContainerSettings | None:
    """``[container]`` with the host's own ``container`` table over it, key by key."""
    own: dict[str, Any] = {}
    if "container" in read.table:
        table = read.table["container"]
        if not isinstance(table, dict):
            read.fail("container", f"expected a table of container keys, got {_show(table)}",
                      'write container = { image = "..." }')
        own = _container_table(_Reader(read.path, f"{read.where}container.", table, CONTAINER_KEYS))
    merged = {**base, **own}
    if not merged:
        return None
    if "image" not in merged:
        read.fail("container", "no image: [container] has none, nor this host's container table",
                  'set image = "..." in [container]')
    # The archive's key is named where it was written: the host's table, else [container].
    named = _Reader(read.path, f"{read.where}container." if "archive" in own else "[container].", {}, CONTAINER_KEYS)
    return _with_archive(named, ContainerSettings(**merged))


def _with_archive(read: _Reader, settings: ContainerSettings) -> ContainerSettings:
    """``settings``, once its archive (if any) is known to hold its image and to be loadable
    by its runtime (docker or podman: Apptainer and enroot take no ``docker save`` tar)."""
    archive = settings.archive
    if archive is None:
        return settings
    if settings.runtime not in ("auto", *containers.OCI_RUNTIMES):
        read.fail("archive", f"{archive.path}: runtime {settings.runtime} does not load docker save archives",
                  "use runtime = \"podman\" or \"docker\" (or \"auto\") with an archive")
    if not holds(archive, settings.image):
        saved = ", ".join(archive.tags) or "no name"
        read.fail("archive", f"{archive.path} holds {saved}, not {settings.image}",
                  f"run with --image {archive.tags[0]}" if archive.tags else
                  f"save it by name: podman save -o FILE {settings.image}")
    return settings


CONTAINER_FLAGS = {"image": "--image", "runtime": "--container-runtime", "pull": "--pull",
                   "archive": "--image-archive"}
"""The command line's flag for each container key."""


class _FlagReader(_Reader):
    """The container keys as the command line gave them: errors name the flag."""

    def fail(self, key: str, problem: str, hint: str = "") -> NoReturn:
        raise InventoryError(f"{CONTAINER_FLAGS.get(key, key)}: {problem}", hint)


def with_container(inventory: Inventory, table: Mapping[str, Any], where: str = "") -> Inventory:
    """The inventory with ``table``'s container keys over every host's: ``where`` "" for the
    command line's flags (``--image``, ``--container-runtime``, ``--pull``, named so in
    errors), else what names the keys (``Cluster.with_container``)."""
    read = _Reader(Path(where), "", table, CONTAINER_KEYS) if where else _FlagReader(Path("-"), "", table, CONTAINER_KEYS)
    values = _container_table(read)

    def merged(host: Host) -> Host:
        own = host.container
        keys = {**({field.name: getattr(own, field.name) for field in fields(own)} if own is not None else {}),
                **values}
        if "image" not in keys:
            read.fail(next(iter(values), "runtime"), "no image to run it with",
                      "give the image too (--image IMAGE), or image in [container]")
        return replace(host, container=_with_archive(read, ContainerSettings(**keys)))

    return replace(inventory, hosts=tuple(map(merged, inventory.hosts)), spares=tuple(map(merged, inventory.spares)))


def _parse_checks(table: Mapping[str, Any], path: Path) -> ChecksSettings:
    read = _Reader(path, "[checks].", table, CHECKS_KEYS)
    return ChecksSettings(min_bandwidth=read.get("min_bandwidth", None, read.rate),
                          slow_ratio=read.get("slow_ratio", 0.5, read.ratio))


def parse_slurm(table: Mapping[str, Any], path: Path, where: str) -> SlurmSettings:
    """The ``[slurm]`` keys (``where`` names them in errors: ``[slurm].`` in a file)."""
    read = _Reader(path, where, table, SLURM_KEYS)
    return SlurmSettings(
        login=read.get("login", None, read.host),
        partition=read.get("partition", None, read.text),
        account=read.get("account", None, read.text),
        nodes=read.get("nodes", None, read.count),
        nodelist=read.get("nodelist", None, read.nodeset),
        gpus_per_node=read.get("gpus_per_node", None, read.count),
        time=read.get("time", None, read.text),
        extra=read.get("extra", (), read.options),
    )


def _slurm_without_hosts(document: Mapping[str, Any], cluster: Mapping[str, Any], slurm: SlurmSettings,
                         path: Path) -> bool:
    """True for a SLURM inventory that lets SLURM pick the nodes (no [[hosts]])."""
    if cluster.get("scheduler") != "slurm" or document.get("hosts") not in (None, []):
        return False
    if slurm.nodes is None and slurm.nodelist is None:
        raise InventoryError(f"{path}: [slurm].nodes: missing: SLURM must know how many nodes, or which",
                             'set nodes = 4 or nodelist = "gpu[01-04]" in [slurm], or list [[hosts]]')
    if "master" in cluster:
        raise InventoryError(f"{path}: [cluster].master: SLURM decides the nodes; the first node of the "
                             "allocation is node_rank 0", "remove master")
    return True


def _slurm_template(defaults: Mapping[str, Any], path: Path, container: Mapping[str, Any]) -> Host:
    base = _read_node_keys(_Reader(path, "[defaults].", defaults, NODE_KEYS), {})
    return _parse_host(_Reader(path, "", {"name": SLURM_TEMPLATE_HOST}, HOST_KEYS), base, container)


def _table(document: Mapping[str, Any], key: str, path: Path) -> Mapping[str, Any]:
    value = document.get(key, {})
    if not isinstance(value, dict):
        raise InventoryError(f"{path}: {key}: expected a table [{key}], got {_show(value)}")
    return value


def _defaults_nproc(defaults: Mapping[str, Any], cluster: Mapping[str, Any],
                    path: Path) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """``[defaults].nproc_per_node`` (where the other per-host keys stand) is
    ``[cluster].nproc_per_node``: every host's count unless its table sets its own."""
    if "nproc_per_node" not in defaults:
        return defaults, cluster
    read = _Reader(path, "[defaults].", defaults, NODE_KEYS + ("nproc_per_node",))
    if "nproc_per_node" in cluster:
        read.fail("nproc_per_node", "[cluster].nproc_per_node is set too",
                  "keep one of them: both are every host's process count")
    value = read.nproc("nproc_per_node", defaults["nproc_per_node"])
    return ({key: item for key, item in defaults.items() if key != "nproc_per_node"},
            {**cluster, "nproc_per_node": value})


def _parse_cluster(table: Mapping[str, Any], hosts: tuple[Host, ...], path: Path,
                   spares: tuple[str, ...] = ()) -> Cluster:
    read = _Reader(path, "[cluster].", table, CLUSTER_KEYS)
    names = [host.name for host in hosts]
    master = read.get("master", names[0], read.text)
    if master in spares:
        read.fail("master", f"{master!r} is a spare: a spare is not launched until a node is excluded",
                  "choose another master, or drop spare = true from that host")
    if master not in names:
        read.fail("master", f"{master!r} is not one of the hosts ({', '.join(names)})",
                  _did_you_mean(master, tuple(names)))
    ssh_config = read.get("ssh_config", None, read.text)
    if ssh_config and not _relative_to(path, ssh_config).is_file():
        read.fail("ssh_config", f"{str(_relative_to(path, ssh_config))!r}: no such file",
                  "fix the path (relative to the inventory), or leave the key out to use ~/.ssh/config")
    default_nproc: int | str = 1
    return Cluster(
        master=master,
        port=read.get("port", 29500, read.port),
        nproc_per_node=read.get("nproc_per_node", default_nproc, read.nproc),
        rdzv_backend=read.get("rdzv_backend", "static", read.choice(RDZV_BACKENDS)),
        master_addr=read.get("master_addr", None, read.text),
        ssh_config=_relative_to(path, ssh_config) if ssh_config else None,
        ssh_timeout=read.get("ssh_timeout", 10.0, read.seconds),
        rdzv_backend_set="rdzv_backend" in table,
        scheduler=read.get("scheduler", "ssh", read.choice(SCHEDULERS)),
    )


def _parse_sync(table: Mapping[str, Any], path: Path) -> SyncSettings:
    read = _Reader(path, "[sync].", table, SYNC_KEYS)
    directory = read.get("dir", None, read.text)
    no_patterns: list[str] = []
    exclude = read.get("exclude", no_patterns, _patterns(read))
    include = read.get("include", no_patterns, _patterns(read))
    return SyncSettings(dir=_relative_to(path, directory) if directory else None, exclude=tuple(exclude),
                        include=tuple(include), dest=read.get("dest", None, read.text))


def _patterns(read: _Reader) -> Callable[[str, Any], list[str]]:
    def convert(key: str, value: Any) -> list[str]:
        if not isinstance(value, list) or not all(isinstance(item, str) and item.strip() for item in value):
            example = '[".env"]' if key == "include" else '["data/", "*.ckpt"]'
            read.fail(key, f"expected a list of patterns, got {_show(value)}", f"write {key} = {example}")
        return [str(item) for item in value]
    return convert


def _relative_to(inventory_path: Path, value: str) -> Path:
    candidate = Path(value).expanduser()
    if candidate.is_absolute():
        return candidate
    return inventory_path.parent / candidate


def _parse_hosts(document: Mapping[str, Any], defaults: Mapping[str, Any], path: Path,
                 container: Mapping[str, Any]) -> tuple[Host, ...]:
    entries = document.get("hosts")
    if entries is None or entries == []:
        raise InventoryError(f"{path}: hosts: no hosts listed",
                             'add at least one [[hosts]] table with name = "..."')
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        raise InventoryError(f"{path}: hosts: expected [[hosts]] tables, got {_show(entries)}")
    base = _read_node_keys(_Reader(path, "[defaults].", defaults, NODE_KEYS), {})
    hosts: list[Host] = []
    seen: set[str] = set()  # a set, not a scan of the hosts so far: 50,000 hosts parse in linear time
    for index, entry in enumerate(entries):
        read = _Reader(path, f"hosts[{index}].", entry, HOST_KEYS)
        for expanded in _expand_entry(read):
            host = _parse_host(_Reader(path, f"hosts[{index}].", expanded, HOST_KEYS), base, container)
            if host.name in seen:
                raise InventoryError(f"{path}: hosts[{index}].name: duplicate host name {host.name!r}",
                                     "give every host a unique name")
            seen.add(host.name)
            hosts.append(host)
    return tuple(hosts)


def _expand_entry(read: _Reader) -> list[Mapping[str, Any]]:
    """One ``[[hosts]]`` table per name its nodeset stands for (``name = "gpu[01-16]"``);
    an address or local_addr nodeset expands in step with the name."""
    table = read.table
    # The plain case first, without the nodeset parser: 50,000 hosts must parse in seconds.
    if not any(isinstance(table.get(key), str) and "[" in table[key] for key in ("name",) + STEP_KEYS):
        return [table]
    if "name" not in table:
        read.fail("name", "missing", 'every [[hosts]] table needs name = "..."')
    names = _nodeset(read, "name")
    stepped = {key: _nodeset(read, key) for key in STEP_KEYS if key in read.table}
    for key, values in stepped.items():
        if len(values) != len(names):
            read.fail(key, f"{read.table[key]!r} stands for {len(values)} addresses but name "
                           f"{read.table['name']!r} for {len(names)} hosts",
                      f"write {key} with a range of the same length, e.g. name = \"gpu[01-04]\", "
                      f"{key} = \"10.0.0.[1-4]\"")
    return [{**read.table, "name": name, **{key: values[index] for key, values in stepped.items()}}
            for index, name in enumerate(names)]


def _nodeset(read: _Reader, key: str) -> list[str]:
    text = read.text(key, read.table[key])
    try:
        return expand(text)
    except NodesetError as error:
        read.fail(key, f"not a host name or nodeset: {error}", 'write a name, or a range like "gpu[01-16]"')


def _read_node_keys(read: _Reader, base: Mapping[str, Any]) -> dict[str, Any]:
    values = dict(base)
    for key, convert in (("user", read.user), ("ssh_port", read.port), ("identity_file", read.existing_file),
                         ("python", read.text), ("workdir", read.text), ("setup", read.script),
                         ("uv", read.text), ("venv_dir", read.text)):
        if key in read.table:
            values[key] = convert(key, read.table[key])
    if "env" in read.table:
        values["env"] = {**values.get("env", {}), **read.env("env", read.table["env"])}
    return values


def _parse_host(read: _Reader, base: Mapping[str, Any], container: Mapping[str, Any]) -> Host:
    if "name" not in read.table:
        read.fail("name", "missing", 'every [[hosts]] table needs name = "..."')
    name = read.text("name", read.table["name"])
    if not HOST_NAME_PATTERN.match(name):
        read.fail("name", f"{name!r} is not a usable host name",
                  "use letters, digits, '.', '_' and '-' (it names the log file)")
    values = _read_node_keys(read, base)
    return Host(
        name=name,
        address=read.get("address", name, read.address),
        user=values.get("user"),
        ssh_port=values.get("ssh_port"),
        identity_file=values.get("identity_file"),
        python=values.get("python", "python3"),
        workdir=values.get("workdir", "~"),
        env=MappingProxyType(dict(values.get("env", {}))),
        setup=values.get("setup", ""),
        local_addr=read.get("local_addr", None, read.local_addr),
        nproc_per_node=read.get("nproc_per_node", None, read.nproc),
        spare=read.get("spare", False, read.flag),
        container=_host_container(read, container),
        uv=values.get("uv"),
        venv_dir=values.get("venv_dir"),
    )
