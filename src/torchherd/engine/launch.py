"""From a plan to a running job: preflight the plan (or just connect), start it on
every node, and hand back a ``Run`` to wait on, stop, or read lines from.

The plan is built once (``plan.build_plan``); the preflight verifies that very plan,
and the launch executes it with the addresses the preflight found on the nodes
(``Plan.with_networks``). Everything is reported to an observer as typed events;
nothing here prints.
"""

from __future__ import annotations

import dataclasses
import queue
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Callable, Iterator, Mapping, Protocol

from torchherd.checks import CheckOptions, PreflightOutcome, run_preflight
from torchherd.checks import smoke as smoke_check
from torchherd.checks.analysis import port as port_check
from torchherd.checks.analysis.smoke import SmokeRun
from torchherd.checks.results import CheckReport, CheckResult, ProbeResult
from torchherd.engine.bookkeeping import max_rank
from torchherd.engine.events import (
    Collector,
    ConnectFailed,
    Event,
    Observer,
    Output,
    PreflightDone,
    Relay,
    RunStarted,
    ignore,
)
from torchherd.engine.images import stage_archives
from torchherd.engine.job import Job, LaunchOptions
from torchherd.engine.pull import pull_images, pulled_nodes
from torchherd.engine.recovery.hang import Targets
from torchherd.engine.sync import sync_nodes
from torchherd.engine.venvs import build_venvs
from torchherd.errors import TorchherdError, TransportError
from torchherd.inventory import Host
from torchherd.plan import NodePlan, Plan
from torchherd.runlog import OutputLine, RunSummary, flat
from torchherd.transport import Connector, Session, close_all, connect_all, fan_out
from torchherd.words import count

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


# preflight -----------------------------------------------------------------------


def preflight(plan: Plan, options: CheckOptions, connector: Connector,
              progress: Callable[[CheckResult], None] | None = None) -> PreflightOutcome:
    """The checks on ``plan``, and with ``options.smoke`` a real tiny job run the way
    ``run`` runs one. The caller closes the outcome."""
    outcome = run_preflight(plan, options, connector, progress)
    if "smoke" not in outcome.selected or outcome.observed is None:
        return outcome
    results = list(outcome.report.results)
    smoke = _smoke(outcome, results)
    if progress is not None:
        for result in smoke:
            progress(result)
    outcome.report = CheckReport(tuple(results + smoke))
    return outcome


def with_probes(outcome: PreflightOutcome) -> CheckReport:
    """The report, with every cross-node connect the probes made (``check``'s matrix)."""
    report, observed = outcome.report, outcome.observed
    if observed is None:
        return report
    probes = [ProbeResult(probe.prober, probe.peer, probe.kind, str(probe.outcome.get("result")),
                          probe.verdict == "fail")
              for prober in observed.connected for probe in port_check.probes_of(observed, prober)]
    return dataclasses.replace(report, probes=tuple(probes))


RUNS_WHEN_SLOW = frozenset({"bandwidth"})
"""Failed checks the smoke job still runs after: a link under the bandwidth floor still
carries a job, and the smoke's own all_reduce figure says how slow the collective is."""


def _smoke(outcome: PreflightOutcome, results: list[CheckResult]) -> list[CheckResult]:
    observed = outcome.observed
    assert observed is not None
    if any(result.status == "fail" and result.check not in RUNS_WHEN_SLOW for result in results):
        return [CheckResult(host.name, "smoke", "skip", "not run: a static check failed")
                for host in observed.inventory.hosts]
    missing = smoke_check.unreachable(observed, set(outcome.connections))
    if missing:
        return missing
    plan = smoke_check.smoke_plan(observed)
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="torchherd-smoke-") as log_dir:
            ran = run_quietly(plan, outcome.connections, Path(log_dir), smoke_check.JOB_TIMEOUT)
    finally:
        _clean_smoke(plan, outcome.connections)
    return smoke_check.verdicts(observed, ran, time.monotonic() - started)


def _clean_smoke(plan: Plan, sessions: Mapping[str, Session]) -> None:
    def clean(node: NodePlan) -> None:
        try:
            sessions[node.host.name].run(smoke_check.cleanup_command(node), timeout=10.0)
        except TransportError:  # a node that went away keeps its files; its verdict says why
            pass

    fan_out(list(plan.nodes), clean)


def run_quietly(plan: Plan, sessions: Mapping[str, Session], log_dir: Path, timeout: float,
                grace: float = 2.0) -> SmokeRun:
    """Runs ``plan`` like ``run`` (same supervisor, fail-fast teardown), reporting nothing;
    every node is stopped after ``timeout`` seconds. Every line each node printed is kept."""
    collector = Collector()
    job = Job(plan, sessions, LaunchOptions(log_dir=log_dir, grace=grace, timeout=timeout), collector)
    job.start_all()
    summary = job.supervise()
    lines = {name: tuple(collector.lines.get(name, ())) for name in job.nodes}
    return SmokeRun(summary, lines, job.timed_out)


# opening the nodes ------------------------------------------------------------------


@dataclass
class Opened:
    """The plan as it will run (networks found by the preflight) and a session per node."""

    plan: Plan
    sessions: Mapping[str, Session]
    _close: Callable[[], None] = field(repr=False, default=lambda: None)

    def close(self) -> None:
        self._close()


def open_nodes(plan: Plan, options: LaunchOptions, connector: Connector, observer: Observer) -> Opened:
    """Preflights the plan (or just connects); raises LaunchAborted when a node failed.
    With ``plan.sync`` the project is made identical on every node first, so the
    preflight checks the files the job will run."""
    if plan.sync is not None:
        connector = sync_first(plan, connector, observer, options.log_dir)
    # The archive first: an air-gapped node then has the image a "missing" pull looks for.
    if any(node.host.container is not None and node.host.container.archive is not None for node in plan.nodes):
        connector = images_first(plan, connector, observer)
    if pulled_nodes(plan):
        connector = pull_first(plan, connector, observer)
    if options.check:
        return _after_preflight(plan, connector, observer, options)
    return _connect(plan, connector, observer)


def pull_first(plan: Plan, connector: Connector, observer: Observer) -> Connector:
    """Connects to every node and pulls the image on those with a pull policy, all at once
    (``engine.pull``), before the preflight compares the images' ids; returns a connector
    that hands the preflight and the launch the very same sessions. Raises LaunchAborted
    (the sessions closed) when a node could not be reached or could not pull."""
    opened = _connect(plan, connector, observer)
    try:
        done = pull_images(plan, dict(opened.sessions), observer)
    except BaseException:
        opened.close()
        raise
    if done is not None and done.failed:
        opened.close()
        images = sorted({failed.image for failed in done.failed})
        raise LaunchAborted(f"the image could not be pulled on {len(done.failed)} of "
                            f"{count(len(done.nodes), 'node')} ({', '.join(images)})")
    return _Reusing(opened.sessions, connector)


def sync_first(plan: Plan, connector: Connector, observer: Observer, log_dir: Path | None = None) -> Connector:
    """Connects to every node and syncs the project over those sessions (never ``log_dir``),
    and builds a uv-locked project's venv there (``engine.venvs``); returns a connector that
    hands the preflight and the launch the very same sessions. Raises LaunchAborted (the
    sessions closed) when a node could not be reached or synced."""
    opened = _connect(plan, connector, observer)
    try:
        done = sync_nodes(plan, opened.sessions, observer, log_dir=log_dir)
        if done.ok and any(node.venv is not None for node in plan.nodes):
            # The project's lock is on every node now: its venv is built before the
            # preflight, which checks the job's python (the venv's) and the venv itself.
            venvs = build_venvs(plan, opened.sessions, observer)
            if not venvs.ok:
                raise LaunchAborted(f"the locked environment could not be built on {len(venvs.failed)} of "
                                    f"{count(len(plan.nodes), 'node')}")
    except BaseException:
        opened.close()
        raise
    if not done.ok:
        opened.close()
        raise LaunchAborted(f"the project is not in sync on {len(done.failed)} of {count(len(plan.nodes), 'node')}")
    return _Reusing(opened.sessions, connector)


def images_first(plan: Plan, connector: Connector, observer: Observer) -> Connector:
    """Loads ``--image-archive`` on every node that lacks the image (``engine.images``), so
    the preflight's ``container`` check and the launch find it there; returns a connector
    that hands them the same sessions. Raises LaunchAborted (the sessions closed) when a
    node could not be reached or could not load it."""
    opened = _connect(plan, connector, observer)
    try:
        done = stage_archives(plan.nodes, opened.sessions, observer)
    except BaseException:
        opened.close()
        raise
    failed = sorted({name for archive in done for name, _ in archive.failed})
    if failed:
        opened.close()
        raise LaunchAborted(f"the image could not be loaded from the archive on {len(failed)} of "
                            f"{count(len(plan.nodes), 'node')}")
    return _Reusing(opened.sessions, connector)


@dataclass(frozen=True)
class _Reusing:
    """A connector that gives out sessions already open (the sync's), else connects."""

    sessions: Mapping[str, Session]
    fallback: Connector

    def connect(self, host: Host) -> Session:
        session = self.sessions.get(host.name)
        return session if session is not None else self.fallback.connect(host)


def _connect(plan: Plan, connector: Connector, observer: Observer,
             already: Mapping[str, Session] | None = None) -> Opened:
    already = already or {}
    missing = [node.host for node in plan.nodes if node.host.name not in already]
    results = connect_all(connector, missing)
    sessions = {**already, **results.succeeded}
    failures = tuple(results.failed.values())
    if failures:
        for error in failures:
            observer(ConnectFailed(error))
        close_all(sessions.values())
        raise LaunchAborted(f"{len(failures)} of {count(len(plan.nodes), 'node')} could not be reached", errors=failures)
    return Opened(plan, sessions, lambda: close_all(sessions.values()))


def _after_preflight(plan: Plan, connector: Connector, observer: Observer, options: LaunchOptions) -> Opened:
    only = options.only
    outcome = preflight(plan, CheckOptions(only=only, skip=options.skip, smoke=only is not None and "smoke" in only),
                        connector)
    observer(PreflightDone(outcome.report))
    if not outcome.report.ok:
        outcome.close()
        raise LaunchAborted("the preflight checks failed", report=outcome.report)
    try:
        # A node the checks did not keep a session to (none today) is connected now.
        return _connect(plan.with_networks(outcome.networks), connector, observer, outcome.connections)
    except BaseException:
        outcome.close()
        raise


# the run ------------------------------------------------------------------------------


class Supervised(Protocol):
    """What ``Run`` drives in its thread: an SSH ``Job``, or a SLURM job (``engine.slurm.job``)."""

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


def launch(plan: Plan, options: LaunchOptions, connector: Connector, observer: Observer = ignore) -> Run:
    """Preflights ``plan`` (unless ``options.check`` is off), starts it on every node and
    returns the running ``Run``. Raises LaunchAborted when it could not start."""
    opened = open_nodes(plan, options, connector, observer)
    events = RunEvents(observer)
    job = Job(opened.plan, opened.sessions, options, events)
    run = Run(job, events, opened.close)
    observer(RunStarted(plan.run_id, tuple(node.host.name for node in plan.nodes), plan.master,
                        opened.plan.master_addr, plan.port, str(job.log_dir), max_rank(plan)))
    try:
        job.start_all()
    except KeyboardInterrupt:
        job.interrupt()
    run.start()
    return run


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
