"""An attached SLURM run: the same plan, events and summary as an SSH run, while SLURM
places the job, starts one task per node and does the killing. Nothing here prints.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

from torchherd.checks.results import CheckReport
from torchherd.engine.bookkeeping import NodeLogs, attempt_marker, dispatch, max_rank
from torchherd.engine.events import (
    Interrupted,
    JobQueued,
    NodeExited,
    NodeNotStarted,
    NodeStarted,
    Observer,
    Output,
    PreflightDone,
    RunFinished,
    RunStarted,
    StopSent,
)
from torchherd.engine.outcome import Ending, OutputTrack, first_cause, summarise
from torchherd.engine.run import LaunchAborted, LaunchOptions, Run, RunEvents
from torchherd.engine.slurm.batch import (
    BatchJob,
    attempt_settings,
    batch_job,
    for_attempt,
)
from torchherd.engine.slurm.check import slurm_view
from torchherd.engine.slurm.commands import (
    LEAVE_TIMEOUT,
    JobState,
    NodeExit,
    ask,
    cancel_command,
    final_state,
    frontend,
    hostnames,
    parse_squeue,
    pyxis_installed,
    queue_state,
    submit,
)
from torchherd.engine.slurm.files import BATCH_NODE, Item, RunFiles
from torchherd.engine.slurm.settings import settings_of
from torchherd.engine.watch.hang import Target, Targets
from torchherd.engine.watch.straggler import StragglerWatch
from torchherd.errors import TorchherdError, TransportError
from torchherd.plan import Plan
from torchherd.remote.wire import StopLevel
from torchherd.runlog import STDERR, OutcomeState, OutputLine, RunSummary
from torchherd.transport import Connector, Session
from torchherd.transport.srun import SrunConnector

POLL_EVERY = 0.5
"""Seconds between reads of the output files while the job runs."""


QUEUE_EVERY = 2.0
"""Seconds between squeue calls (slurmctld serves every user: ask it sparingly)."""


LOST_AFTER = 60.0
"""A submit host that cannot be asked for this long: the run's end is not known."""


class SlurmNode(OutputTrack):
    """What the summary needs of one node: its output (first error, failed rank, tail), its exit."""

    def __init__(self, name: str, rank: int, log_path: Path) -> None:
        super().__init__(name, rank, log_path)
        self.started_at = time.monotonic()
        self.exit: NodeExit | None = None

    def first_error(self) -> str | None:
        found = self.error_line()
        if found is None and self.exit is not None and self.exit.phase == "setup" and self.exit.code:
            return f"the job did not start (exit {self.exit.code})"
        return found


class SlurmJob:
    """One submitted job: follow it until it has left the queue, cancel it when asked
    (again: SIGKILL), and sum it up as an SSH run is. Runs in ``Run``'s thread."""

    def __init__(self, plan: Plan, batch: BatchJob, job_id: str, session: Session,
                 options: LaunchOptions, observer: Observer, reconnect: Callable[[], Session]) -> None:
        self.plan = plan
        self.batch = batch
        self.job_id = job_id
        self.session = session
        self.options = options
        self.straggler = StragglerWatch(window=options.straggler_window)
        self.emit = self.straggler.relay(observer)
        self.reconnect = reconnect
        self.log_dir = options.log_dir / plan.run_id
        self.files = RunFiles(batch.run_dir)
        self.nodes: dict[str, SlurmNode] | None = None
        self.state: JobState | None = None
        self.interrupted = False
        self.still_queued: JobState | None = None
        self.lost: str | None = None
        self.started = time.monotonic()
        self._stops: queue.Queue[None] = queue.Queue()
        self._wake = threading.Event()
        self._cancel_deadline: float | None = None
        marker = attempt_marker(options.attempt, [node.host.name for node in plan.nodes]) if options.attempt else b""
        self.logs = NodeLogs(self.log_dir, marker)
        self._targets: dict[str, Target] | None = None
        self._targets_lock = threading.Lock()
        self._targets_closed = False

    def hang_targets(self) -> Targets:
        """The nodes SLURM started the job on, each reached as job steps beside the job's
        own (``srun --overlap``), each over a submit-host session of its own; empty until
        the job has its nodes, and once it has left the queue."""
        with self._targets_lock:
            names = tuple(self.nodes or ())
            if self._targets_closed or not names:
                return {}
            if self._targets is None:
                connector = SrunConnector(self.reconnect, self.job_id)
                python = self.plan.nodes[0].host.python  # one command on every node (batch_job)
                self._targets = {}
                try:
                    for name in names:
                        self._targets[name] = Target(python, connector.connect(replace(self.plan.nodes[0].host,
                                                                                       name=name)))
                except TransportError:
                    self._close_targets()
                    return {}
            return dict(self._targets)

    def _close_targets(self) -> None:
        for target in (self._targets or {}).values():
            target.session.close()
        self._targets = None

    def request_stop(self) -> None:
        """Thread-safe: scancel at the next step (a second request: SIGKILL)."""
        self._stops.put(None)
        self._wake.set()

    # the loop ------------------------------------------------------------------------
    def supervise(self) -> RunSummary:
        self.log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            self._follow()
            self._finish()
            summary = self.summary()
        finally:
            self.logs.close()
        self.emit(RunFinished(summary))
        return summary

    def _follow(self) -> None:
        last_queue, last_heard = 0.0, time.monotonic()
        while True:
            self._take_stops()
            now = time.monotonic()
            ask = now - last_queue >= (QUEUE_EVERY if self.nodes and not self.interrupted else 1.0)
            try:
                answer = self._step(ask)
            except TransportError as error:
                if time.monotonic() - last_heard > LOST_AFTER:
                    self.lost = f"{self.session.node} did not answer for {LOST_AFTER:.0f} s: {error}"
                    return
                self._reopen()
                continue
            last_heard = time.monotonic()
            if ask:
                last_queue = now
                if self._on_queue(answer):
                    return
            if self._cancel_deadline is not None and time.monotonic() > self._cancel_deadline:
                self.still_queued = self.state
                return
            self._wake.wait(POLL_EVERY)
            self._wake.clear()

    def _step(self, ask: bool) -> JobState | None:
        if self.nodes is None:
            return queue_state(self.session, self.job_id) if ask else self.state
        items, answer = self.files.poll(self.session, self.job_id if ask else None)
        self._dispatch(items)
        return parse_squeue(answer, self.job_id) if answer is not None else self.state

    def _on_queue(self, state: JobState | None) -> bool:
        """True when the job has left the queue."""
        previous, self.state = self.state, state
        if state is None:
            return True
        if state.phase == "pending":
            if previous is None or (previous.state, previous.reason) != (state.state, state.reason):
                self.emit(JobQueued(self.job_id, state.state, state.reason))
            return False
        if self.nodes is None and state.nodelist:
            self._start(state.nodelist)
        return state.phase == "done"

    def _reopen(self) -> None:
        try:
            self.session.close()
            self.session = self.reconnect()
        except TransportError:
            time.sleep(1.0)

    def _take_stops(self) -> None:
        while True:
            try:
                self._stops.get_nowait()
            except queue.Empty:
                return
            self._interrupt()

    def _interrupt(self) -> None:
        again = self.interrupted
        self.interrupted = True
        self.emit(Interrupted(again=again))
        level = StopLevel.KILL if again else StopLevel.TERM
        try:
            ask(self.session, cancel_command(self.job_id, kill=again), "scancel")
        except TorchherdError as error:  # the next request tries again; the loop goes on
            self.emit(Output((OutputLine(BATCH_NODE, None, STDERR, str(error)),)))
            return
        self.emit(StopSent(level, "interrupted" if not again else "interrupted twice", tuple(self.nodes or ())))
        self._cancel_deadline = time.monotonic() + LEAVE_TIMEOUT

    # the nodes -------------------------------------------------------------------------
    def _start(self, nodelist: str) -> None:
        self.allocated(hostnames(self.session, nodelist))

    def allocated(self, names: tuple[str, ...]) -> None:
        """SLURM started the job on ``names`` (in node-rank order): each node's tracker, and RunStarted."""
        self.nodes = {name: SlurmNode(name, rank, self.log_dir / f"{name}.log") for rank, name in enumerate(names)}
        master_addr = self.plan.options.master_addr or self.plan.inventory.cluster.master_addr or names[0]
        self.emit(RunStarted(self.plan.run_id, names, names[0], master_addr, self.plan.port, str(self.log_dir),
                             max_rank(self.plan, len(names))))
        for name in names:
            self.emit(NodeStarted(name, None))

    def _node(self, name: str) -> SlurmNode:
        assert self.nodes is not None
        if name not in self.nodes:  # a node whose host name is not its SLURM name
            self.nodes[name] = SlurmNode(name, len(self.nodes), self.log_dir / f"{name}.log")
        return self.nodes[name]

    def _dispatch(self, items: Sequence[Item]) -> None:
        self.logs.write(items)
        dispatch(items, self.emit, lambda name: None if name == BATCH_NODE else self._node(name), self._on_item)

    def _on_item(self, item: Item) -> None:
        if isinstance(item, NodeExit):
            self._on_exit(item)

    def _on_exit(self, exit: NodeExit) -> None:
        node = self._node(exit.node)
        node.exit, node.exit_code, node.ended_at = exit, exit.code, time.monotonic()
        if exit.phase == "setup" and exit.code:
            self.emit(NodeNotStarted(node.name, f"the job did not start (exit {exit.code})", exit.code))
            return
        failed_before = any(other.exit and other.exit.code and other is not node for other in self._all())
        self.emit(NodeExited(node.name, exit.code, expected=bool(exit.code) and (self.interrupted or failed_before)))

    def _all(self) -> list[SlurmNode]:
        return list(self.nodes.values()) if self.nodes else []

    def _finish(self) -> None:
        """SLURM's last word on the job, and whatever the files still held."""
        if self.lost is None:
            try:
                final = final_state(self.session, self.job_id)
                if final is not None:
                    self.state = final
                if self.nodes is None and self.state is not None and self.state.nodelist:
                    self._start(self.state.nodelist)
                if self.nodes is not None:
                    self._dispatch(self.files.poll(self.session)[0])
            except (TransportError, TorchherdError) as error:
                self.lost = f"{self.session.node}: {error}"
        self._dispatch(self.files.finish())
        self.session.close()
        with self._targets_lock:
            self._targets_closed = True
            self._close_targets()

    # the summary --------------------------------------------------------------------------
    def summary(self) -> RunSummary:
        nodes = self._all()
        failed = sorted((node for node in nodes if node.exit is not None and node.exit.code),
                        key=lambda node: node.exit.at if node.exit else 0.0)
        culprit = first_cause(failed[0], nodes) if failed and not self.interrupted else None
        return self.straggler.named(summarise(self.plan.run_id, nodes, lambda node: self._state(node, culprit),
                                              culprit, self._ending(bool(nodes)), time.monotonic() - self.started,
                                              str(self.log_dir)))

    def _ending(self, started: bool) -> Ending:
        job, ended = f"SLURM job {self.job_id}", self._ended()
        interrupted = None
        if self.interrupted:
            left = (f"; SLURM still lists it as {self.still_queued.state}" if self.still_queued is not None
                    else ", and it has left the queue")
            interrupted = f"{job} was cancelled{left}"
        lost = f"{job}: {self.lost}" if self.lost is not None else None
        otherwise = f"{job} ended: {ended}" if started else f"{job} ended before it started: {ended}"
        return Ending(interrupted, lost, otherwise, f"SLURM: {ended}")

    def _ended(self) -> str:
        state = self.state
        if state is None:
            return "SLURM no longer knows it"
        reason = f" ({state.reason})" if state.reason else ""
        code = f", exit code {state.exit_code}" if state.exit_code else ""
        return f"{state.state}{reason}{code}"

    def _state(self, node: SlurmNode, culprit: SlurmNode | None) -> OutcomeState:
        if node.exit_code == 0:
            return "ok"
        if node is culprit:
            return "failed"
        if self.interrupted:
            return "interrupted"
        if culprit is not None:
            return "torn down"  # SLURM ended it (--kill-on-bad-exit) after the culprit failed
        word = self.state.state.split()[0] if self.state is not None and self.state.state else ""
        if node.exit is None and word == "COMPLETED":
            return "ok"
        if node.exit is None and word == "NODE_FAIL":
            return "lost"
        return "failed"


def launch(plan: Plan, options: LaunchOptions, connector: Connector, observer: Observer) -> Run:
    """Preflights (SLURM's view, unless ``options.check`` is off), submits, and returns the
    running ``Run``: its thread follows the job until it has left the queue."""
    session, batch, job_id = submitted(plan, options, connector, observer)
    inventory = plan.inventory
    events = RunEvents(observer)
    run = Run(SlurmJob(plan, batch, job_id, session, options, events, lambda: frontend(inventory, connector)), events)
    observer(JobQueued(job_id, "SUBMITTED"))
    run.start()
    return run


def submitted(plan: Plan, options: LaunchOptions, connector: Connector,
               observer: Observer) -> tuple[Session, BatchJob, str]:
    session = frontend(plan.inventory, connector)
    try:
        batch = attempt_job(plan, options, session)
        if options.check:
            _preflight(session, plan, batch, observer)
        return session, batch, submit(session, batch)
    except BaseException:
        session.close()
        raise


def attempt_job(plan: Plan, options: LaunchOptions, session: Session) -> BatchJob:
    """The batch job ``plan`` is submitted as (an attempt of a recovering run: its own);
    in a container, through pyxis where ``session``'s srun has it."""
    settings = attempt_settings(settings_of(plan.inventory), options.exclude)
    pyxis = any(node.container is not None for node in plan.nodes) and pyxis_installed(session)
    return for_attempt(batch_job(plan, settings, options.fail_fast, pyxis, options.warm_start), options.attempt,
                       options.exclude, options.shrink_to)


def preflight(plan: Plan, options: LaunchOptions, connector: Connector, observer: Observer) -> None:
    """SLURM's view of the job (sinfo, ``sbatch --test-only``) as ``launch`` checks it
    first, without submitting: for a controller that submits it elsewhere (a detached run
    with retries). Raises LaunchAborted when SLURM would not run it."""
    session = frontend(plan.inventory, connector)
    try:
        _preflight(session, plan, attempt_job(plan, options, session), observer)
    finally:
        session.close()


def _preflight(session: Session, plan: Plan, batch: BatchJob, observer: Observer) -> None:
    report = CheckReport(tuple(slurm_view(session, plan, batch)))
    observer(PreflightDone(report))
    if not report.ok:
        raise LaunchAborted("the preflight checks failed", report=report)
