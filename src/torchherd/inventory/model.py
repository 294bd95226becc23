"""The inventory as data: the frozen dataclasses a parsed ``hosts.toml`` (or ``-H``, a
hostfile, ``--nodelist``) becomes. Nothing here reads a file or checks a value."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping

from torchherd.imagearchive import ImageArchive
from torchherd.inventory.tables import TableSettings


@dataclass(frozen=True)
class ContainerSettings:
    """The ``[container]`` table (a host's ``container`` table overrides it key by key),
    ``--image``: the job runs inside this image on the node (torchherd docs containers)."""

    image: str
    runtime: str = "auto"
    """One of ``remote.container.RUNTIME_CHOICES``: "auto", or a runtime of its table; "auto": the first installed."""
    mounts: tuple[str, ...] = ()
    """More ``SRC[:DST[:OPTIONS]]`` mounts; the workdir is always mounted at itself."""
    options: tuple[str, ...] = ()
    """More options of the runtime's run command, one word each."""
    pull: str = "never"
    """docker/podman: "never" (the image must be there), "missing" or "always": ``run``
    pulls it on every node before its preflight (``engine.prepare.pull``); ``check`` never pulls."""
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
    transport: str = "ssh"
    """How the controller reaches it: "ssh", or "local": this machine itself, in-process
    (``transport.local``), no sshd and no keys. An inventory's "auto" (its default) is
    decided once it is read (``inventory.parse.reached``)."""


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
    """Who starts the nodes: "ssh", torchherd itself, or another of ``engine.schedulers``
    (whose own table, where it has one, is in ``Inventory.tables``)."""
    nproc_per_node_set: bool = False
    """Whether nproc_per_node was given (the inventory, ``--nproc-per-node``), not the default 1."""


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
    """The most a replica's copy may take of the link (``Bandwidth``), at its start: then
    the job's pace moves it (``remote/pace.py``)."""
    resume_args: tuple[str, ...] = ()
    """Words added after the script's own arguments on an attempt that starts from a staged
    checkpoint (``("--init_from=resume",)``: nanoGPT's); never on attempt 1, nor on one with
    no checkpoint. The API also takes one string, split as a shell splits it."""
    warm: bool = True
    """A warm Python per node (torch imported beside the preflight) from which the run's
    torchrun and ranks fork, every attempt's with retries (SSH backend); where there is
    none (a detached run, a container), torchrun imports torch and its ranks fork from it.
    False: every process starts cold."""

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


DEFAULT_REPLICATE_SHARE = 0.25
"""A replica's copy takes at most a quarter of the link: the job's own traffic keeps the rest."""
DEFAULT_REPLICATE_PER_CORE = 5e6
"""And by default at most 5 MB/s per CPU core of the node to start with (the source then
keeps the rate to the job's pace, up to four times this: ``remote/pace.py``): what a copy costs in the kernel
(its packets, the pages it writes) is no one's to lower by priority, and where cores are
few or the link is virtual (a veth pair states 10 Gb/s) a share of the link does not bind.
Measured on 2 cores, each node one rank busy with a 9 ms step (``scripts/bench-replication``,
1 GB copied): 10 MB/s slowed the steps by 0.5-2.5 %, 20 MB/s by about 5 %, the link's
quarter (unbound there) by half. A 64-core node may copy at 320 MB/s: the share binds first
on links of 10 Gb/s and slower."""


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


@dataclass(frozen=True)
class ChecksSettings:
    """The ``[checks]`` table: what ``check --bandwidth`` holds the links to."""

    min_bandwidth: float | None = None
    """Bits per second: a link or node below fails; None: no floor."""
    slow_ratio: float = 0.5
    """A link or node below this share of the cluster's median warns."""


@dataclass(frozen=True)
class Inventory:
    path: Path
    cluster: Cluster
    hosts: tuple[Host, ...]
    """In node-rank order: the master first, then the others as the file lists them."""
    sync: SyncSettings | None = None
    tables: tuple[tuple[str, TableSettings], ...] = ()
    """Each scheduler table's settings (``inventory.tables``), by the scheduler's name: every
    table the reader was told of, the file's keys or the defaults."""
    spares: tuple[Host, ...] = ()
    """Hosts marked ``spare = true`` (or named by ``[recovery].spares``), in file order: not in
    ``hosts``, never launched unless recovery takes one."""
    recovery: Recovery = Recovery()
    checks: ChecksSettings = ChecksSettings()
    uv: UvSettings = UvSettings()

    def table(self, name: str) -> TableSettings | None:
        """The settings of scheduler ``name``'s table; None where the reader knew no such table."""
        return dict(self.tables).get(name)

    def with_table(self, name: str, settings: TableSettings) -> Inventory:
        return replace(self, tables=tuple((key, settings if key == name else value) for key, value in self.tables)
                       + (() if name in dict(self.tables) else ((name, settings),)))

    def named_tables(self) -> tuple[tuple[str, TableSettings], ...]:
        """The tables where the inventory names every host itself (``TableSettings.named``)."""
        return tuple((name, settings.named()) for name, settings in self.tables)

    def host(self, name: str) -> Host:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(name)
