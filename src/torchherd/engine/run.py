"""The vocabulary every backend hands back: the options a launch takes (``LaunchOptions``),
the attached ``Run`` with its events (``RunEvents``) and endings (``Endings``), and the
error of a job that never started (``LaunchAborted``). Nothing here knows a scheduler:
each backend's job (SSH's supervisors, SLURM's batch job) is a ``Supervised`` that a
``Run`` drives.
"""

from __future__ import annotations

import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Callable, Iterator, Mapping, Protocol

from torchherd.checks.results import CheckReport
from torchherd.engine.events import Event, Observer, Output, Relay
from torchherd.engine.records import RunRecord
from torchherd.engine.watch.hang import Targets
from torchherd.errors import TorchherdError, TransportError
from torchherd.plan import Plan
from torchherd.runlog import OutputLine, RunSummary, flat

HEARTBEAT_EVERY = 0.5
"""Seconds between heartbeats, both ways (``[recovery] heartbeat``)."""
HEARTBEAT_MISSES = 5
"""Heartbeats missed in a row, the SSH connection silent as long: the node is lost
(``[recovery] heartbeat_misses``)."""
STOP_MARGIN = 10.0
"""Beyond the grace period: TERM -> KILL, and KILL -> give the node up."""


DEFAULT_GRACE = 10.0
"""Seconds from SIGTERM to SIGKILL when no grace period is given."""


@dataclass(frozen=True)
class LaunchOptions:
    check: bool = True
    only: frozenset[str] | None = None
    """With ``check``: the preflight runs only these check ids (``run --only``); None: all."""
    skip: frozenset[str] = frozenset()
    """With ``check``: the preflight leaves these check ids out (``run --skip``)."""
    log_dir: Path = Path("torchherd-logs")
    grace: float | None = None
    """Seconds from SIGTERM to SIGKILL; None: DEFAULT_GRACE (a backend whose scheduler
    does the killing refuses any other)."""
    fail_fast: bool = True
    timeout: float | None = None
    """Seconds after which every node is told to stop (the smoke check); None: no limit."""
    attempt: int = 0
    """A run with retries: the attempt's number (from 1); its node logs are written on
    after a marker line. 0: a run without retries (each log written afresh)."""
    exclude: tuple[str, ...] = ()
    """Nodes the scheduler must not place the job on: the nodes a recovering run excluded
    (SLURM's ``--exclude``). An SSH run starts only the nodes its plan names."""
    shrink_to: int | None = None
    """Where the scheduler picks the nodes (SLURM's ``nodes`` key): the fewest it may
    start the attempt on when it cannot find them all (``--min-nodes``; ``--nodes=K-N``)."""
    persist: bool = False
    """The job outlives the controller (a detached run with retries, its controller in the
    background): each node's supervisor also appends its records to the node's log of a
    detached run, keeps its state file there, and runs on when the controller is gone."""
    heartbeat: float = HEARTBEAT_EVERY
    """Seconds between heartbeats, both ways."""
    heartbeat_misses: int = HEARTBEAT_MISSES
    """A node silent for this many heartbeats, whose SSH connection does not answer either, is lost."""
    straggler_window: float | None = None
    """Seconds over which each node's progress is judged for the straggler (``--straggler-window``);
    None: the watch's own (``engine.watch.straggler.WINDOW``)."""
    watch_checkpoint: str | None = None
    """The checkpoint each node's supervisor watches for a new complete one (``[recovery]
    replicate``): ``CheckpointSaved`` events; None: not watched."""
    warm_start: bool = False
    """Each node whose torchrun starts cold (no warm Python of the controller's forks it)
    starts it warm on its own: the agent imports torch, and its ranks fork from it
    (``remote/zygote.py``'s ``start``: one import of torch per node, not one per process).
    ``[recovery] warm``; not with a hang watch (its probe finds each rank by its process)."""
    started_as: Callable[[Plan], Plan] | None = field(default=None, compare=False, repr=False)
    """The plan the nodes start, from the one the preflight kept (a recovering run's attempt 1
    forks each node's torchrun from its warm Python where one is ready); None: that plan."""

    @property
    def stop_grace(self) -> float:
        return DEFAULT_GRACE if self.grace is None else self.grace

    @property
    def lost_after(self) -> float:
        return self.heartbeat * self.heartbeat_misses


Ended = Callable[[RunSummary | None, BaseException | None], None]
"""Told how a run ended (its summary, or what went wrong instead), before ``wait`` returns."""

LINE_BUFFER = 100_000
"""Lines ``Run.lines`` holds for a reader that falls behind; older ones are dropped
from the iterator only, never from the log files."""


class LaunchAborted(TorchherdError):
    """The job was not started: the preflight failed or a node could not be reached.
    What went wrong was already reported to the observer (``PreflightDone``, ``ConnectFailed``)."""

    def __init__(self, message: str, report: CheckReport | None = None,
                 errors: tuple[TransportError, ...] = ()) -> None:
        super().__init__(message)
        self.report = report
        self.errors = errors



class Supervised(Protocol):
    """What ``Run`` drives in its thread: a backend's job (SSH's ``Job``, SLURM's batch job)."""

    plan: Plan
    log_dir: Path

    def supervise(self) -> RunSummary: ...

    def request_stop(self) -> None: ...

    def hang_targets(self) -> Targets:
        """Its nodes as the hang watch reaches them (empty until they are known)."""


class RunEvents:
    """A run's observer: every event to the caller's through a ``Relay`` (a thread of its
    own), and every line to ``Run.lines`` once someone reads them. Made before the job,
    which reports to it."""

    def __init__(self, observer: Observer) -> None:
        self.relay = Relay(observer)
        self.lines: queue.Queue[OutputLine | None] | None = None

    def __call__(self, event: Event) -> None:
        if self.lines is not None and isinstance(event, Output):
            for line in flat(event.lines):
                self.offer(line)
        self.relay(event)

    def offer(self, line: OutputLine | None) -> None:
        """Queues a line for ``Run.lines`` (None: the end), dropping the oldest when full."""
        assert self.lines is not None
        while True:
            try:
                self.lines.put_nowait(line)
                return
            except queue.Full:
                try:
                    self.lines.get_nowait()
                except queue.Empty:
                    pass


class Run:
    """A job launched on every node: ``wait`` for its summary, ``stop`` it, read its ``lines``.

    A supervising thread reads every node, writes the log files, and tears the job down
    when it ends; the caller's thread stays free. The observer gets its events from a
    ``Relay`` thread: a terminal that stops reading never holds the supervising thread.
    Built with its job (which reports to ``events``); ``start`` starts the supervising thread.
    """

    def __init__(self, job: Supervised, events: RunEvents, on_end: Callable[[], None] = lambda: None) -> None:
        self.job = job
        self.plan = job.plan
        self.run_id = job.plan.run_id
        self.log_dir = job.log_dir
        self._on_end = on_end
        self._events = events
        self._observer = events.relay
        self._summary: RunSummary | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._endings = Endings(self._done)
        self._thread = threading.Thread(target=self._supervise, name="torchherd-run", daemon=True)

    def start(self) -> None:
        """Supervises the job in a thread of its own until it ends (once)."""
        self._thread.start()

    def report(self, event: Event) -> None:
        """Hands ``event`` to the run's observer, in order with the job's own (what a
        watcher of the run found, such as a hang)."""
        self._events(event)

    def _supervise(self) -> None:
        try:
            self._summary = self.job.supervise()
        except BaseException as error:  # handed to wait(): a bug must not vanish in a thread
            self._error = error
        finally:
            self._on_end()
            if self._events.lines is not None:
                self._events.offer(None)
            self._error = self._endings.end(self._summary, self._error)

    def when_done(self, ended: Ended) -> None:
        """``ended`` is told how the run ended, before ``wait`` returns (at once when it has)."""
        self._endings.add(ended)

    def wait(self, timeout: float | None = None) -> RunSummary:
        """The summary once every node has finished. Ctrl-C while waiting stops the run as
        ``stop`` does (a second one kills) and waits on for the teardown."""
        wait_stopping(self._done, timeout, self.stop, self.run_id)
        self._delivered()
        if self._error is not None:
            raise self._error
        assert self._summary is not None
        return self._summary

    def _delivered(self) -> None:
        """Waits until the observer has had every event (the summary included): the run is
        over, only a terminal that stopped reading can hold this, or a Ctrl-C end it."""
        while True:
            try:
                if self._observer.close(0.2):
                    break
            except KeyboardInterrupt:
                break
        if self._observer.error is not None and self._error is None:
            self._error = self._observer.error

    def stop(self) -> None:
        """The same teardown as Ctrl-C: every node stops gracefully; called again, at once."""
        self.job.request_stop()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def lines(self) -> Iterator[OutputLine]:
        """Every line of every node as it arrives, until the run ends (node, rank, stream,
        text). Lines printed before the first call are in the log files."""
        if self._events.lines is None:
            self._events.lines = queue.Queue(LINE_BUFFER)
            if self._done.is_set():
                return
        while True:
            line = self._events.lines.get()
            if line is None:
                return
            yield line


class Endings:
    """Who is told how a run ended (``when_done``): each once, as it ends, or at once when
    it has ended already; ``done`` is set with the telling."""

    def __init__(self, done: threading.Event) -> None:
        self._lock = threading.Lock()
        self._waiting: list[Ended] = []
        self._told: tuple[RunSummary | None, BaseException | None] | None = None
        self._done = done

    def end(self, summary: RunSummary | None, error: BaseException | None) -> BaseException | None:
        """Tells everyone waiting how the run ended; the error ``wait`` raises: the first
        one's failure, else ``error`` (never lost in the supervising thread, never a
        ``wait`` that waits forever)."""
        failed: BaseException | None = None
        with self._lock:
            for callback in self._waiting:
                try:
                    callback(summary, error)
                except Exception as failure:  # the job is over either way: the others are told still
                    failed = failed or failure
            error = failed or error
            self._told = (summary, error)
            self._done.set()
        return error

    def add(self, ended: Ended) -> None:
        with self._lock:
            told = self._told
            if told is None:
                self._waiting.append(ended)
                return
        ended(*told)
def wait_stopping(done: threading.Event, timeout: float | None, stop: Callable[[], None], run_id: str) -> None:
    """Waits for ``done``; Ctrl-C meanwhile calls ``stop`` (again: again) and waits on for
    the teardown. TimeoutError after ``timeout`` seconds (None: no limit)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not done.is_set():
        try:
            done.wait(0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic())))
        except KeyboardInterrupt:
            stop()
        if deadline is not None and time.monotonic() >= deadline and not done.is_set():
            raise TimeoutError(f"run {run_id} still running after {timeout:g} s")


class sigterm_as_interrupt:
    """SIGTERM to the controller ends the run like Ctrl-C (130, every node stopped),
    unless the controller was started with SIGTERM ignored: an inherited ignore is kept,
    as Python keeps an ignored SIGINT (torchherd docs run)."""

    def __enter__(self) -> None:
        self.previous: Callable[[int, FrameType | None], object] | int | None = None
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGTERM) != signal.SIG_IGN:
            self.previous = signal.signal(signal.SIGTERM, _raise_interrupt)

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@dataclass(frozen=True)
class DetachedStart:
    """How ``run --detach`` went: the saved record, and per node why it did not start
    (empty when every node started). When one did not, the others were stopped and
    ``left`` says what could not be."""

    record: RunRecord
    errors: tuple[str, ...] = ()
    left: Mapping[str, list[str]] | None = None

    @property
    def ok(self) -> bool:
        return not self.errors


class DetachedStartFailed(TorchherdError):
    """Not every node of a detached run started; the others were stopped."""

    def __init__(self, start: DetachedStart) -> None:
        super().__init__(f"run {start.record.run_id}: not every node started; the others were stopped")
        self.start = start


@dataclass(frozen=True)
class Follow:
    follow: bool = False
    node: str | None = None
    rank: int | None = None
    more: Callable[[], bool] | None = None
    """A detached run with retries: while this says so (its recovering controller runs), a
    node's job ending is not the end of its log: the next attempt writes on in it."""
