"""What the engine reports while it works: typed events, handed to an observer.

The engine never writes to a screen. The rich console (``console.observer``) is one
observer; ``Collector`` below keeps everything (the smoke check, tests); a library
user passes any callable. Observers are called one event at a time, in order: from the
run's ``Relay`` thread during a launched run (never from the supervising thread, which
a slow observer must not hold), else from the calling thread.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence, TypeVar, Union

from torchherd.checks.results import CheckReport
from torchherd.engine.observer import ignore as ignore  # re-exported: engine.events.ignore, as before
from torchherd.errors import TransportError
from torchherd.remote.wire import StopLevel
from torchherd.runlog import OutputLine, RankLines, RunSummary, Status, flat


@dataclass(frozen=True)
class PreflightDone:
    """The checks ran on the plan; ``report.ok`` says whether the launch goes on."""

    report: CheckReport


@dataclass(frozen=True)
class ConnectFailed:
    """A node could not be reached (a run without preflight): the run does not start."""

    error: TransportError


@dataclass(frozen=True)
class RunStarted:
    run_id: str
    nodes: tuple[str, ...]
    master: str
    master_addr: str
    port: int
    log_dir: str
    max_rank: int
    """The highest global rank the job will have (99 when it depends on the nodes' GPUs)."""


@dataclass(frozen=True)
class Output:
    """Lines the ranks (or torchrun, or the node's shell) printed, in arrival order; every
    one is already in its node's log file."""

    lines: Sequence[OutputLine | RankLines]


@dataclass(frozen=True)
class NodeStarted:
    """torchrun runs on the node under its supervisor."""

    node: str
    pid: int | None
    supervisor: int | None = None
    """The supervisor's own pid (a detached run's record keeps it, for ``status``)."""


@dataclass(frozen=True)
class RanksRunning:
    """A rank of the node printed: it got through the rendezvous."""

    node: str


@dataclass(frozen=True)
class NodeExited:
    """The node's torchrun ended with ``code`` (0: finished)."""

    node: str
    code: int
    expected: bool = False
    """True when it ended because it was told to stop (not a failure of its own)."""


@dataclass(frozen=True)
class NodeNotStarted:
    """The job could not start on the node: ``code`` is the shell's status (a failed cd or
    setup snippet) or None when the supervisor said why in ``message``."""

    node: str
    message: str
    code: int | None = None


@dataclass(frozen=True)
class NodeLost:
    node: str
    reason: str


@dataclass(frozen=True)
class NodeSilent:
    """``node``'s supervisor has sent nothing for ``seconds`` (past the heartbeats' limit)
    while its sshd still answers the keepalive probes: not lost (a link or a machine down
    silences sshd too), but overloaded, or its supervisor stuck; lost after ``lost_after``
    seconds of it. ``heard``: it spoke again after ``seconds`` of silence."""

    node: str
    seconds: float
    lost_after: float
    heard: bool = False


@dataclass(frozen=True)
class ProcessesLeft:
    """The node's supervisor could not kill ``count`` processes of the job."""

    node: str
    count: int


@dataclass(frozen=True)
class StopSent:
    """Every running node was told to stop (TERM: graceful, KILL: at once)."""

    level: StopLevel
    reason: str
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class Interrupted:
    """The user (Ctrl-C, SIGTERM, ``Run.stop``) ended the run; ``again``: a second time."""

    again: bool = False


@dataclass(frozen=True)
class NodeStatus:
    """A supervisor's status record as a detached run's log holds it (``logs``, ``attach``);
    in a live run, its ``gpu`` samples and ``progress`` bars (``runlog.gpu_usage``,
    ``runlog.progress_of``)."""

    status: Status


@dataclass(frozen=True)
class RunFinished:
    summary: RunSummary


@dataclass(frozen=True)
class LinesDropped:
    """The observer fell behind (a terminal that stopped reading): ``count`` lines were not
    handed to it. Every one of them is in the log files."""

    count: int


@dataclass(frozen=True)
class HistoryNotKept:
    """An attached run's record could not be written into the state directory (``status``
    and ``logs`` will not know the run); the run goes on, its log files are written."""

    reason: str


@dataclass(frozen=True)
class EventsNotKept:
    """The run's history (``events.jsonl`` in its log directory) could not be written:
    ``report`` will lack what came after; the run goes on."""

    reason: str


@dataclass(frozen=True)
class JobQueued:
    """A scheduler holds the job (SLURM: submitted, or still waiting for nodes, and why)."""

    job_id: str
    state: str
    reason: str = ""


@dataclass(frozen=True)
class SyncStarted:
    """``--sync``: the local project ``source`` is being made identical on ``nodes``
    (with ``dry_run``, only compared: nothing is written)."""

    source: str
    nodes: tuple[str, ...]
    files: int
    bytes: int
    skipped: tuple[str, ...] = ()
    """Local paths that cannot be sent, and why (a socket, an unreadable directory)."""
    dry_run: bool = False
    private: tuple[str, ...] = ()
    """Local paths left out as private material (``tree.PRIVATE``; a directory ends with ``/``)."""


@dataclass(frozen=True)
class NodeSynced:
    """The node has the project under ``dest``, every file written verified by its SHA-256
    (with ``dry_run``: what would be sent and deleted)."""

    node: str
    dest: str
    sent: tuple[str, ...]
    """The files sent, in path order."""
    sent_bytes: int
    deleted: tuple[str, ...]
    """Files an earlier sync put there that the project no longer has."""
    unchanged: int
    seconds: float
    dry_run: bool = False


@dataclass(frozen=True)
class SyncFailed:
    """The node is not in sync: the receiver refused (a destination outside the workdir),
    the connection failed, or ``files`` could not be written or verified."""

    node: str
    message: str
    seconds: float = 0.0
    files: tuple[tuple[str, str], ...] = ()
    """(path, why) for each file not in sync."""


@dataclass(frozen=True)
class SyncDone:
    """Every node's outcome, in node-rank order."""

    source: str
    nodes: tuple[Union[NodeSynced, SyncFailed], ...]
    seconds: float
    dry_run: bool = False
    private: tuple[str, ...] = ()
    """As ``SyncStarted.private``: what was left out as private material."""

    @property
    def ok(self) -> bool:
        return all(isinstance(node, NodeSynced) for node in self.nodes)

    @property
    def failed(self) -> tuple[SyncFailed, ...]:
        return tuple(node for node in self.nodes if isinstance(node, SyncFailed))


@dataclass(frozen=True)
class VenvReady:
    """A uv-locked project's venv is on the node: ``built`` now by ``uv sync --frozen``
    (in ``seconds``), or found built from the same lock (uv not run)."""

    node: str
    path: str
    built: bool
    seconds: float = 0.0
    uv: str = ""
    """The uv that built it."""
    shipped: bool = False
    """That uv was sent from the controller (the node had none)."""
    wheel: str = ""
    """The wheel that uv was taken out of (a node of another platform); "": the controller's own."""
    offline: bool = False
    """Built with no network from the lock's wheels sent from the controller (``--uv-offline``)."""


@dataclass(frozen=True)
class VenvFailed:
    """The node's venv could not be built: no uv there, or ``uv sync --frozen`` failed (its last lines)."""

    node: str
    message: str
    hint: str = ""


@dataclass(frozen=True)
class VenvsDone:
    """Every node's venv, in node-rank order; after the sync, before the preflight."""

    nodes: tuple[Union[VenvReady, VenvFailed], ...]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(isinstance(node, VenvReady) for node in self.nodes)

    @property
    def failed(self) -> tuple[VenvFailed, ...]:
        return tuple(node for node in self.nodes if isinstance(node, VenvFailed))


@dataclass(frozen=True)
class WheelsStarted:
    """``--uv-offline``: the lock's wheels for one node platform and python (``tag``,
    ``python``), this machine's wheelhouse ``path`` (``files`` of ``size`` bytes), are
    being sent once per chain and relayed node to node down each of ``chains`` (node-rank
    order; nodes whose venvs differ get copies of their own, one chain after the other).
    ``WheelsProgress`` per node follows, then ``WheelsRelayed``."""

    tag: str
    python: str
    path: str
    chains: tuple[tuple[str, ...], ...]
    files: int
    size: int

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(node for chain in self.chains for node in chain)


@dataclass(frozen=True)
class WheelsDownloading:
    """``--uv-offline``: the lock's wheels ``names`` (``name==version``) for one node
    platform and python (``tag``, ``python``) are in none of the wheel directories here
    (``looked``): pip downloads them now, before the wheelhouse goes out. A
    ``WheelFetched`` follows for each file pip begins."""

    tag: str
    python: str
    names: tuple[str, ...]
    looked: str
    backend: bool = False
    """The package project's build backend (``names``: its requirements, fetched with their
    dependencies), not the lock's wheels."""


@dataclass(frozen=True)
class WheelFetched:
    """pip began one file of a ``WheelsDownloading``: ``file`` (the wheel's name), ``size``
    as pip says it ("" when unknown); ``cached``: from pip's own cache, not the network."""

    file: str
    size: str
    cached: bool


@dataclass(frozen=True)
class WheelsProgress:
    """How far ``node`` is in receiving the wheelhouse: ``done`` of ``total`` bytes (its
    copy is then checked against the wheelhouse's SHA-256; ``WheelsRelayed`` says how that went)."""

    node: str
    done: int
    total: int


@dataclass(frozen=True)
class WheelsRelayed:
    """``--uv-offline``: the lock's wheels for one node platform and python (``tag``,
    ``python``), in this machine's wheelhouse ``path`` (``files`` of ``size`` bytes;
    ``downloaded``: the wheels pip fetched now, the others were here already), sent once
    per chain and relayed node to node down each of ``chains`` (as ``WheelsStarted``'s);
    ``sent``: the bytes this machine sent; ``failed``: the nodes the copy did not reach,
    and why (the venvs say the rest)."""

    tag: str
    python: str
    path: str
    chains: tuple[tuple[str, ...], ...]
    files: int
    size: int
    sent: int
    downloaded: tuple[str, ...]
    seconds: float
    failed: tuple[tuple[str, str], ...] = ()

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(node for chain in self.chains for node in chain)


@dataclass(frozen=True)
class AttemptStarted:
    """A run with retries (``run --retries``) starts attempt ``number`` on ``nodes``
    (node-rank order, its master first)."""

    number: int
    of: int
    """The most attempts the run may make (retries + 1)."""
    nodes: tuple[str, ...]
    picking: str = ""
    """Where the scheduler picks the nodes (``nodes`` empty): how many, and which it must
    leave out ("2 nodes SLURM picks, not node1")."""


@dataclass(frozen=True)
class WarmReady:
    """The run's warm Pythons (``[recovery] warm``) answered, ``seconds`` after they were
    started while attempt 1 ran: ready on ``nodes``; ``failed``: (node, why not)."""

    nodes: tuple[str, ...]
    failed: tuple[tuple[str, str], ...]
    seconds: float


@dataclass(frozen=True)
class AttemptWarm:
    """Attempt ``number`` (``[recovery] warm``) starts its torchrun and ranks forked from each
    node's warm Python (torch imported beforehand) on ``nodes``; the nodes of ``cold`` start
    Python and import torch themselves (their warm Python was not ready, or could not start:
    ``why``). Attempt 1 has one where its warm Pythons started beside its preflight (no sync)."""

    number: int
    nodes: tuple[str, ...]
    cold: tuple[str, ...] = ()
    why: tuple[tuple[str, str], ...] = ()
    """(node, why it has no warm Python) for the nodes of ``cold`` that say."""


@dataclass(frozen=True)
class CoordinatorStarted:
    """An attempt of a detached run with retries started its fail-fast coordinator on
    ``node``; the supervisors obey it only once the background controller is gone."""

    node: str
    port: int
    pid: int
    state_file: str


@dataclass(frozen=True)
class AttemptFailed:
    """Attempt ``number`` ended without success; ``headline`` says how (as a run's summary would)."""

    number: int
    headline: str
    seconds: float


@dataclass(frozen=True)
class TriageDone:
    """The fast node checks ran on ``nodes`` before the next attempt; ``failed``: per
    node that failed them, why."""

    nodes: tuple[str, ...]
    failed: tuple[tuple[str, str], ...]
    seconds: float


@dataclass(frozen=True)
class HangFound:
    """No rank printed a line or used CPU for ``seconds`` (``--hang-timeout``): every rank
    is sent SIGABRT, and prints its stack as it dies."""

    seconds: float


@dataclass(frozen=True)
class NodeExcluded:
    """``node`` takes no part in the next attempts, and why."""

    node: str
    reason: str


@dataclass(frozen=True)
class SpareTaken:
    """The spare host ``spare`` takes the place of the excluded ``replacing``."""

    spare: str
    replacing: str


@dataclass(frozen=True)
class RunShrunk:
    """No spare was left: the next attempt runs on fewer nodes (``--min-nodes``)."""

    nodes: int
    was: int


@dataclass(frozen=True)
class RecoveryEnded:
    """The run ends after a failed attempt without another: why (retries used up, the same
    error twice, a final exit code, no spare left)."""

    message: str


@dataclass(frozen=True)
class CheckpointStaged:
    """Before attempt ``attempt``: the newest copy of the checkpoint (``[recovery].checkpoint``),
    found on ``source``, was put on ``nodes`` (empty: every node had it already); it could
    not be on ``failed`` (node, why)."""

    attempt: int
    path: str
    size: int
    source: str
    nodes: tuple[str, ...]
    seconds: float
    failed: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class CheckpointMissing:
    """Before attempt ``attempt``: no checkpoint to stage (none found on any node reached,
    or the nodes could not be asked); the attempt starts anyway."""

    attempt: int
    message: str


@dataclass(frozen=True)
class PullStarted:
    """``--pull missing|always``: each of ``nodes`` (node, image) pulls its image before
    the launch, all at once."""

    nodes: tuple[tuple[str, str], ...]
    policy: str


@dataclass(frozen=True)
class PullProgress:
    """A node's pull went on: ``done`` of the ``layers`` it has named so far are there
    (docker names them all first; podman one by one, so ``layers`` grows); ``status`` is
    what the runtime says it is doing."""

    node: str
    done: int
    layers: int
    status: str


@dataclass(frozen=True)
class NodePulled:
    """The node has the image: pulled now (``pulled``), or found there (``missing``)."""

    node: str
    image: str
    pulled: bool
    layers: int
    seconds: float


@dataclass(frozen=True)
class PullFailed:
    """The node could not pull the image: the runtime's own last error line."""

    node: str
    image: str
    message: str


@dataclass(frozen=True)
class PullsDone:
    """Every node's pull, in node-rank order; the launch goes on only when all have the image."""

    nodes: tuple[Union[NodePulled, PullFailed], ...]
    seconds: float

    @property
    def failed(self) -> tuple[PullFailed, ...]:
        return tuple(node for node in self.nodes if isinstance(node, PullFailed))


PULL_EVENTS = (PullStarted, PullProgress, NodePulled, PullFailed, PullsDone)


@dataclass(frozen=True)
class LostContainers:
    """At the end of a run with retries in containers: the run's containers on nodes lost in
    an attempt (their supervisor died with them, so nobody removed them), removed where the
    node answers again (``removed``: node names), or named where it does not (``left``:
    node, container name, its runtime (an OCI runtime's name, or those it may be, joined by
    "or", where the inventory says "auto"), why)."""

    removed: tuple[str, ...]
    left: tuple[tuple[str, str, str, str], ...] = ()


@dataclass(frozen=True)
class ArchiveStarted:
    """``--image-archive``: ``archive`` (``size`` bytes, image ``image_id``) is being sent once,
    to ``loading[0]``, and relayed node to node down ``loading``; ``having`` hold the image
    with that id already (neither sent nor loaded)."""

    archive: str
    image: str
    image_id: str
    size: int
    loading: tuple[str, ...]
    having: tuple[str, ...]


@dataclass(frozen=True)
class ArchiveProgress:
    """How far ``node`` is: ``phase`` "receiving" (``done`` of ``total`` bytes) or "loading"
    (the runtime's ``load``, after the whole archive was received and verified)."""

    node: str
    phase: str
    done: int
    total: int


@dataclass(frozen=True)
class ArchiveDone:
    """Every node of ``ArchiveStarted.loading`` loaded the image (``loaded``) or not
    (``failed``: node, why); ``sent``: the bytes this machine sent (the archive once, or
    nothing when every node had the image)."""

    archive: str
    image: str
    loaded: tuple[str, ...]
    having: tuple[str, ...]
    failed: tuple[tuple[str, str], ...]
    seconds: float
    sent: int

    @property
    def ok(self) -> bool:
        return not self.failed


ARCHIVE_EVENTS = (ArchiveStarted, ArchiveProgress, ArchiveDone)
WHEELS_EVENTS = (WheelsStarted, WheelsProgress, WheelsRelayed)
"""The relay's events (its bars); the download's before it are notes (``console.sync``)."""


@dataclass(frozen=True)
class CheckpointSaved:
    """The job wrote a new checkpoint on ``node``, complete now (its supervisor's watch,
    ``[recovery] replicate``): ``path`` relative to the workdir, ``size`` bytes, ``mtime``
    seconds since the epoch. Read by the recovery, which replicates it, and passed on to
    the observer when the node saved it itself (not a copy the run made): a detached run's
    record then says where the newest checkpoint is; not rendered."""

    node: str
    path: str
    size: int
    mtime: float


@dataclass(frozen=True)
class CheckpointReplicated:
    """The checkpoint ``path`` saved on ``source`` at ``mtime`` was copied, while the job
    ran, to ``nodes`` (the next ones in the ring); ``held`` are the ring's nodes that had
    it already, ``failed`` (node, why) those it could not reach; ``kept`` those that hold a
    newer copy of their own (left as it is)."""

    path: str
    size: int
    mtime: float
    source: str
    nodes: tuple[str, ...]
    seconds: float
    cap: str
    """The bandwidth cap it ran under, as said (``Bandwidth``)."""
    held: tuple[str, ...] = ()
    failed: tuple[tuple[str, str], ...] = ()
    kept: tuple[str, ...] = ()
    pace: str = ""
    """How the source kept its rate to the job's pace ("10 MB/s at first, 12.5 MB/s at the
    end, cut 2 times"); empty: it was not (no pace to keep to)."""


RECOVERY_EVENTS = (AttemptStarted, AttemptWarm, WarmReady, AttemptFailed, TriageDone, NodeExcluded, SpareTaken, RunShrunk, RecoveryEnded,
                   HangFound, CheckpointStaged, CheckpointMissing, LostContainers, CheckpointReplicated)

Event = Union[PreflightDone, ConnectFailed, RunStarted, Output, NodeStarted, RanksRunning, NodeExited,
              NodeNotStarted, NodeLost, ProcessesLeft, StopSent, Interrupted, NodeStatus, RunFinished, JobQueued,
              SyncStarted, NodeSynced, SyncFailed, SyncDone, LinesDropped, AttemptStarted, AttemptWarm, WarmReady, AttemptFailed, TriageDone,
              VenvsDone, WheelsRelayed, NodeExcluded, SpareTaken, RunShrunk, RecoveryEnded, HangFound, CoordinatorStarted,
              CheckpointStaged, CheckpointMissing, LostContainers, PullStarted, PullProgress, NodePulled,
              PullFailed, PullsDone, ArchiveStarted, ArchiveProgress, ArchiveDone, HistoryNotKept, CheckpointSaved,
              CheckpointReplicated, WheelsStarted, WheelsProgress, WheelsDownloading, WheelFetched, NodeSilent,
              EventsNotKept]
Observer = Callable[[Event], None]

MAX_PENDING_LINES = 50_000
"""Lines a ``Relay`` holds for an observer that fell behind; beyond, they are dropped from it."""


def line_count(event: Output) -> int:
    return sum(chunk.records.count(b"\n") - 1 if isinstance(chunk, RankLines) else 1 for chunk in event.lines)


class Relay:
    """Hands events to an observer from a thread of its own, in order. The supervising
    thread only queues them: a terminal that stops reading (Ctrl-S, a full pipe) never
    holds it, so fail-fast and teardowns go on. Lines beyond ``max_lines`` waiting are
    dropped (the observer gets one ``LinesDropped`` for them); every other event is kept."""

    def __init__(self, observer: Observer, max_lines: int | None = None) -> None:
        self.observer = observer
        self.max_lines = MAX_PENDING_LINES if max_lines is None else max_lines
        self.error: BaseException | None = None
        self._events: deque[Event] = deque()
        self._lines = 0
        self._dropped = 0
        self._closed = False
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._deliver, name="torchherd-observer", daemon=True)
        self._thread.start()

    def __call__(self, event: Event) -> None:
        with self._ready:
            if isinstance(event, Output):
                count = line_count(event)
                if self._lines + count > self.max_lines:
                    self._dropped += count
                    return
                self._lines += count
            self._events.append(event)
            self._ready.notify()

    def close(self, timeout: float | None = None) -> bool:
        """No more events; True once every queued one was delivered (within ``timeout``)."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _next(self) -> tuple[Event | None, int]:
        with self._ready:
            while not self._events and not self._closed:
                self._ready.wait()
            dropped, self._dropped = self._dropped, 0
            if not self._events:
                return None, dropped
            event = self._events.popleft()
            if isinstance(event, Output):
                self._lines -= line_count(event)
            return event, dropped

    def _deliver(self) -> None:
        while True:
            event, dropped = self._next()
            try:
                if dropped:
                    self.observer(LinesDropped(dropped))
                if event is None:
                    return
                self.observer(event)
            except BaseException as error:  # handed to Run.wait(): a bug must not vanish in a thread
                self.error = self.error or error


E = TypeVar("E")


@dataclass
class Collector:
    """Keeps every event, and every line per node (the smoke check, tests)."""

    events: list[Event] = field(default_factory=list)
    lines: dict[str, list[OutputLine]] = field(default_factory=dict)

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        if isinstance(event, Output):
            for line in flat(event.lines):
                self.lines.setdefault(line.node, []).append(line)

    def of(self, kind: type[E]) -> list[E]:
        """Every event of one kind, in order, typed as that kind."""
        return [event for event in self.events if isinstance(event, kind)]
