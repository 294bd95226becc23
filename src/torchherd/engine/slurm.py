"""SLURM as the second way to launch: the same plan, events and summary as an SSH run,
while SLURM places the job, starts one task per node and does the killing.

Every SLURM command runs through one ``Session``: this machine (``sbatch`` on PATH)
or the login host over SSH (``[slurm].login``). Each node's task writes its stdout and
stderr to files in the run directory on the submit host (SLURM's ``%N`` pattern); they
are polled, and their bytes go through the same framing and parsing as a supervisor's
(``runlog``), so the console renders a SLURM run exactly as an SSH run. Nothing here
prints; ``slurm`` (the pure module) renders the commands and parses the answers.
"""

from __future__ import annotations

import dataclasses
import queue
import shlex
import shutil
import threading
import time
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Sequence, Union

from torchherd import slurm
from torchherd.checks import CheckOptions
from torchherd.engine.bookkeeping import NodeLogs, dispatch, max_rank, node_record, report, run_record
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
from torchherd.engine.job import LaunchOptions
from torchherd.engine.launch import LaunchAborted, Run, RunEvents
from torchherd.engine.outcome import Ending, OutputTrack, summarise
from torchherd.errors import TorchherdError, TransportError, UsageError
from torchherd.inventory import Host, Inventory
from torchherd.plan import RANK_PREFIX_HEAD, Plan
from torchherd.remote import wire
from torchherd.remote.framing import LineFramer, RankMender
from torchherd.remote.wire import StopLevel
from torchherd.results import CLUSTER, CheckReport, CheckResult
from torchherd.runlog import (
    STDERR,
    OutcomeState,
    OutputLine,
    OutputParser,
    RankLines,
    RunSummary,
    Status,
)
from torchherd.runrecord import NodeRecord, NodeState, RunRecord, save
from torchherd.transport import Connector, Session
from torchherd.transport.local import LocalSession

COMMAND_TIMEOUT = 60.0
POLL_EVERY = 0.5
"""Seconds between reads of the output files while the job runs."""
QUEUE_EVERY = 2.0
"""Seconds between squeue calls (slurmctld serves every user: ask it sparingly)."""
LEAVE_TIMEOUT = 120.0
"""After scancel: how long to wait for the job to leave the queue (beyond SLURM's KillWait)."""
LOST_AFTER = 60.0
"""A submit host that cannot be asked for this long: the run's end is not known."""
BATCH_NODE = "slurm"
"""The name ``batch.out``'s lines carry: what srun and slurmstepd say about the job."""
TAIL_LINES = 8
SCHEDULER = "slurm"


# where SLURM's commands run ---------------------------------------------------------


def login_host(inventory: Inventory) -> Host:
    """The login host as a node: the [defaults] user, port and key apply."""
    login = inventory.slurm.login
    assert login is not None
    return dataclasses.replace(inventory.hosts[0], name=login, address=login, env=MappingProxyType({}), setup="",
                               local_addr=None)


def frontend(inventory: Inventory, connector: Connector) -> Session:
    """The session SLURM's commands run in: the login host over SSH, or this machine."""
    if inventory.slurm.login:
        return connector.connect(login_host(inventory))
    if shutil.which("sbatch") is None:
        raise UsageError("sbatch is not on this machine's PATH",
                         'set login = "HOST" in [slurm] (or --slurm-login HOST): the host you submit jobs from')
    return LocalSession("localhost")


def _ask(session: Session, command: str, what: str, stdin: bytes = b"") -> str:
    """Runs a SLURM command; its stdout, or TorchherdError with SLURM's own words."""
    result = session.run(command, stdin=stdin, timeout=COMMAND_TIMEOUT)
    if result.exit_code != 0:
        said = (result.stderr or result.stdout).decode("utf-8", "replace").strip().splitlines()
        raise TorchherdError(f"{what} failed on {session.node}: {said[-1] if said else f'exit {result.exit_code}'}")
    return result.stdout.decode("utf-8", "replace")


def submit(session: Session, job: slurm.BatchJob) -> str:
    """Writes the script (0600, from stdin: never on a command line) and sbatch's it; the job id."""
    answer = _ask(session, slurm.submit_command(job), "sbatch", job.script.encode("utf-8"))
    try:
        return slurm.parse_job_id(answer)
    except ValueError as error:
        raise TorchherdError(f"sbatch on {session.node}: {error}") from None


def queue_state(session: Session, job_id: str) -> slurm.JobState | None:
    """The job as squeue sees it; None when SLURM no longer lists it."""
    result = session.run(slurm.squeue_command(job_id), timeout=COMMAND_TIMEOUT)
    return slurm.parse_squeue(result.stdout.decode("utf-8", "replace"), job_id)


def final_state(session: Session, job_id: str) -> slurm.JobState | None:
    result = session.run(slurm.final_state_command(job_id), timeout=COMMAND_TIMEOUT)
    return slurm.parse_final_state(result.stdout.decode("utf-8", "replace"), job_id)


def hostnames(session: Session, nodelist: str) -> tuple[str, ...]:
    return slurm.parse_hostnames(_ask(session, slurm.hostnames_command(nodelist), "scontrol show hostnames"))


def cancel_and_wait(session: Session, job_id: str, kill: bool = False,
                    timeout: float = LEAVE_TIMEOUT) -> slurm.JobState | None:
    """scancel, then wait until the job has left the queue; what SLURM still shows
    when it has not (None: it has)."""
    _ask(session, slurm.cancel_command(job_id, kill), "scancel")
    deadline = time.monotonic() + timeout
    while True:
        state = queue_state(session, job_id)
        if state is None or state.phase == "done" or time.monotonic() > deadline:
            return None if state is None or state.phase == "done" else state
        time.sleep(0.5)


# reading the run directory --------------------------------------------------------------


Item = Union[OutputLine, RankLines, slurm.NodeExit]


class NodeFiles:
    """One node's files as they grow: stdout and stderr framed like a supervisor's
    records (torn rank lines mended), then parsed by ``runlog``; its exit record."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.parser = OutputParser(node)
        mender = RankMender(RANK_PREFIX_HEAD) if node != BATCH_NODE else None
        out_tag = wire.TAG_STDERR if node == BATCH_NODE else wire.TAG_STDOUT
        self.framers = {slurm.OUT: LineFramer(out_tag, mender=mender),
                        slurm.ERR: LineFramer(wire.TAG_STDERR, mender=RankMender(RANK_PREFIX_HEAD))}
        self.exit_text = ""
        self.exit: slurm.NodeExit | None = None

    def feed(self, suffix: str, data: bytes) -> list[Item]:
        if suffix == slurm.EXIT:
            self.exit_text += data.decode("utf-8", "replace")
            if self.exit is None and self.exit_text.endswith("\n"):
                self.exit = slurm.parse_exit_file(self.node, self.exit_text)
                return [self.exit] if self.exit is not None else []
            return []
        return self._lines(self.framers[suffix].feed(data))

    def finish(self) -> list[Item]:
        rest = self._lines(b"".join(framer.finish() for framer in self.framers.values()))
        return rest + [chunk for chunk in self.parser.finish() if not isinstance(chunk, Status)]

    def _lines(self, records: bytes) -> list[Item]:
        if not records:
            return []
        return [chunk for chunk in self.parser.feed(records) if not isinstance(chunk, Status)]


def split_name(name: str) -> tuple[str, str] | None:
    """``node0.out`` -> ("node0", ".out"); ``batch.out`` -> (BATCH_NODE, ".out")."""
    if name == slurm.BATCH_OUTPUT:
        return BATCH_NODE, slurm.OUT
    for suffix in (slurm.OUT, slurm.ERR, slurm.EXIT):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[:-len(suffix)], suffix
    return None


class RunFiles:
    """The run directory on the submit host, read from where the last read stopped, so
    no line is shown twice or lost; optionally squeue's answer in the same round trip."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.offsets: dict[str, int] = {}
        self.nodes: dict[str, NodeFiles] = {}

    def node(self, name: str) -> NodeFiles:
        if name not in self.nodes:
            self.nodes[name] = NodeFiles(name)
        return self.nodes[name]

    def poll(self, session: Session, job_id: str | None = None,
             suffixes: Sequence[str] = (slurm.OUT, slurm.ERR, slurm.EXIT)) -> tuple[list[Item], str | None]:
        command = slurm.poll_command(self.directory, self.offsets, job_id, suffixes=suffixes)
        result = session.run(command, timeout=COMMAND_TIMEOUT)
        answer = slurm.parse_poll(result.stdout)
        items: list[Item] = []
        for chunk in answer.chunks:
            where = split_name(chunk.name)
            if where is None or chunk.offset != self.offsets.get(chunk.name, 0):
                continue
            self.offsets[chunk.name] = chunk.offset + len(chunk.data)
            items += self.node(where[0]).feed(where[1], chunk.data)
        return items, answer.queue

    def finish(self) -> list[Item]:
        return [item for files in self.nodes.values() for item in files.finish()]


# the attached run -------------------------------------------------------------------------


class SlurmNode(OutputTrack):
    """What the summary needs of one node: its output (first error, failed rank, tail), its exit."""

    def __init__(self, name: str, rank: int, log_path: Path) -> None:
        super().__init__(name, rank, log_path)
        self.started_at = time.monotonic()
        self.exit: slurm.NodeExit | None = None

    def first_error(self) -> str | None:
        found = self.error_line()
        if found is None and self.exit is not None and self.exit.phase == "setup" and self.exit.code:
            return f"the job did not start (exit {self.exit.code})"
        return found


class SlurmJob:
    """One submitted job: follow it until it has left the queue, cancel it when asked
    (again: SIGKILL), and sum it up as an SSH run is. Runs in ``Run``'s thread."""

    def __init__(self, plan: Plan, batch: slurm.BatchJob, job_id: str, session: Session,
                 options: LaunchOptions, observer: Observer, reconnect: Callable[[], Session]) -> None:
        self.plan = plan
        self.batch = batch
        self.job_id = job_id
        self.session = session
        self.options = options
        self.emit = observer
        self.reconnect = reconnect
        self.log_dir = options.log_dir / plan.run_id
        self.files = RunFiles(batch.run_dir)
        self.nodes: dict[str, SlurmNode] | None = None
        self.state: slurm.JobState | None = None
        self.interrupted = False
        self.still_queued: slurm.JobState | None = None
        self.lost: str | None = None
        self.started = time.monotonic()
        self._stops: queue.Queue[None] = queue.Queue()
        self._wake = threading.Event()
        self._cancel_deadline: float | None = None
        self.logs = NodeLogs(self.log_dir)

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

    def _step(self, ask: bool) -> slurm.JobState | None:
        if self.nodes is None:
            return queue_state(self.session, self.job_id) if ask else self.state
        items, answer = self.files.poll(self.session, self.job_id if ask else None)
        self._dispatch(items)
        return slurm.parse_squeue(answer, self.job_id) if answer is not None else self.state

    def _on_queue(self, state: slurm.JobState | None) -> bool:
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
            _ask(self.session, slurm.cancel_command(self.job_id, kill=again), "scancel")
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
        if isinstance(item, slurm.NodeExit):
            self._on_exit(item)

    def _on_exit(self, exit: slurm.NodeExit) -> None:
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

    # the summary --------------------------------------------------------------------------
    def summary(self) -> RunSummary:
        nodes = self._all()
        failed = sorted((node for node in nodes if node.exit is not None and node.exit.code),
                        key=lambda node: node.exit.at if node.exit else 0.0)
        culprit = failed[0] if failed and not self.interrupted else None
        return summarise(self.plan.run_id, nodes, lambda node: self._state(node, culprit), culprit,
                         self._ending(bool(nodes)), time.monotonic() - self.started, str(self.log_dir))

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


# launching ------------------------------------------------------------------------------------


def launch(plan: Plan, options: LaunchOptions, connector: Connector, observer: Observer) -> Run:
    """Preflights (SLURM's view, unless ``options.check`` is off), submits, and returns the
    running ``Run``: its thread follows the job until it has left the queue."""
    session, batch, job_id = _submitted(plan, options, connector, observer)
    inventory = plan.inventory
    events = RunEvents(observer)
    run = Run(SlurmJob(plan, batch, job_id, session, options, events, lambda: frontend(inventory, connector)), events)
    observer(JobQueued(job_id, "SUBMITTED"))
    run.start()
    return run


def _submitted(plan: Plan, options: LaunchOptions, connector: Connector,
               observer: Observer) -> tuple[Session, slurm.BatchJob, str]:
    batch = slurm.batch_job(plan, plan.inventory.slurm, options.fail_fast)
    session = frontend(plan.inventory, connector)
    try:
        if options.check:
            report = CheckReport(tuple(slurm_view(session, plan, batch)))
            observer(PreflightDone(report))
            if not report.ok:
                raise LaunchAborted("the preflight checks failed", report=report)
        return session, batch, submit(session, batch)
    except BaseException:
        session.close()
        raise


def slurm_view(session: Session, plan: Plan, batch: slurm.BatchJob) -> list[CheckResult]:
    """What SLURM itself says: partitions and nodes (sinfo), and whether it would take
    the job (``sbatch --test-only``, the script on stdin: nothing is submitted)."""
    try:
        rows = slurm.parse_sinfo(_ask(session, f"sinfo -h -N -o {shlex.quote(slurm.SINFO_FORMAT)}", "sinfo"))
    except (TorchherdError, TransportError) as error:
        return [CheckResult(CLUSTER, "slurm", "fail", str(error), "is SLURM's controller up? (scontrol ping)")]
    results = slurm.slurm_view(rows, plan.inventory.slurm, batch.placement, plan.nproc_per_node)
    test = session.run("sbatch --test-only", stdin=batch.script.encode("utf-8"), timeout=COMMAND_TIMEOUT)
    said = test.stderr.decode("utf-8", "replace").strip().splitlines()
    last = said[-1].removeprefix("sbatch: ") if said else f"exit {test.exit_code}"
    if test.exit_code == 0:
        results.append(CheckResult(CLUSTER, "sbatch", "pass", f"SLURM would take the job: {last}"))
    else:
        results.append(CheckResult(CLUSTER, "sbatch", "fail", f"SLURM would refuse the job: {last}",
                                   "torchherd run --dry-run shows the batch script"))
    return results


def check(plan: Plan, options: CheckOptions, connector: Connector,
          progress: Callable[[CheckResult], None] | None = None) -> CheckReport:
    """``check`` for a SLURM cluster: SLURM's own view (partition, nodes, GRES, a dry
    submission), then the node checks as steps of an allocation (``engine.slurm_check``)."""
    from torchherd.engine import slurm_check

    return slurm_check.check(plan, options, connector, progress)


# detached runs ---------------------------------------------------------------------------------


def start_detached(plan: Plan, options: LaunchOptions, connector: Connector, observer: Observer) -> RunRecord:
    """Submits the job and saves a run record that says it is SLURM's (job id, run
    directory, the login host); ``status``, ``logs``, ``stop`` and ``attach`` read it."""
    session, batch, job_id = _submitted(plan, options, connector, observer)
    session.close()
    observer(JobQueued(job_id, "SUBMITTED"))
    inventory = plan.inventory
    login = dataclasses.asdict(_node_record(login_host(inventory), batch.run_dir)) if inventory.slurm.login else None
    names = batch.placement.nodelist.split(",") if batch.placement.source != "[slurm]" and \
        batch.placement.nodelist else []
    nodes = [_node_record(dataclasses.replace(plan.nodes[0].host, name=name, address=name), batch.run_dir)
             for name in names]
    record = run_record(plan, options.stop_grace, nodes, max_rank(plan, batch.placement.nodes or len(names) or 1),
                        extra={"scheduler": SCHEDULER, "job_id": job_id, "run_dir": batch.run_dir, "login": login})
    save(record)
    return record


def _node_record(host: Host, directory: str) -> NodeRecord:
    return node_record(host, f"{directory}/{host.name}{slurm.OUT}", f"{directory}/{host.name}{slurm.EXIT}")


def record_session(record: RunRecord, connector: Connector | None = None) -> Session:
    """The submit host of a detached SLURM run, again."""
    login = record.extra.get("login")
    if not login:
        return LocalSession("localhost")
    if connector is None:
        from torchherd.engine.detach import connector_for

        connector = connector_for(record)
    return connector.connect(NodeRecord(**login).host())


def _job(record: RunRecord) -> tuple[str, str]:
    return str(record.extra["job_id"]), str(record.extra["run_dir"])


def job_status(record: RunRecord, connector: Connector | None = None) -> list[NodeState]:
    """``status``: per node, running or exited (its code) as its exit record says; while
    the job waits, one row for the job and SLURM's reason."""
    job_id, directory = _job(record)
    try:
        session = record_session(record, connector)
    except TransportError as error:
        return [NodeState(f"job {job_id}", "unreachable", detail=str(error))]
    try:
        state = queue_state(session, job_id) or final_state(session, job_id)
        files = RunFiles(directory)
        items, _ = files.poll(session, suffixes=(slurm.EXIT,))
        names = hostnames(session, state.nodelist) if state is not None and state.nodelist else ()
    except (TransportError, TorchherdError) as error:
        return [NodeState(f"job {job_id}", "unreachable", detail=str(error))]
    finally:
        session.close()
    return job_states(job_id, state, names, [item for item in items if isinstance(item, slurm.NodeExit)])


def job_states(job_id: str, state: slurm.JobState | None, names: Sequence[str],
               exits: Sequence[slurm.NodeExit]) -> list[NodeState]:
    """Pure: the rows of ``status`` for a SLURM run."""
    said = "SLURM no longer knows the job" if state is None else f"SLURM: {state.state}" + (
        f" ({state.reason})" if state.reason else "")
    if state is not None and state.phase == "pending":
        return [NodeState(f"job {job_id}", "pending", detail=said)]
    by_node = {exit.node: exit for exit in exits}
    rows = []
    for name in list(names) + [node for node in by_node if node not in names]:
        exit = by_node.get(name)
        if exit is not None:
            rows.append(NodeState(name, "exited", exit.code, exit.at or None, said))
        elif state is not None and state.phase in ("running", "ending"):
            rows.append(NodeState(name, "running", detail=said))
        else:
            rows.append(NodeState(name, "exited", None, detail=said))
    return rows or [NodeState(f"job {job_id}", "exited" if state is not None else "unknown", detail=said)]


def follow_job(record: RunRecord, observer: Observer, follow: bool = False, node: str | None = None,
               rank: int | None = None, connector: Connector | None = None) -> None:
    """``logs`` (``-f``: until the job has left the queue): every node's lines and exit
    records as ``Output`` and ``NodeStatus`` events, from the start of the files."""
    job_id, directory = _job(record)
    session = record_session(record, connector)
    files = RunFiles(directory)
    try:
        while True:
            items, answer = files.poll(session, job_id if follow else None)
            _report(items, observer, node, rank)
            state = slurm.parse_squeue(answer, job_id) if answer is not None else None
            if not follow or state is None or state.phase == "done":
                break
            time.sleep(POLL_EVERY)
        if follow:  # what the nodes wrote between the last read and the end
            _report(files.poll(session)[0], observer, node, rank)
        _report(files.finish(), observer, node, rank)
    finally:
        session.close()


def _report(items: Sequence[Item], observer: Observer, node: str | None, rank: int | None) -> None:
    """``bookkeeping.report``, a node's exit record as the status record an SSH node writes."""
    report([Status(item.node, "exit", {"code": item.code}) if isinstance(item, slurm.NodeExit) else item
            for item in items], observer, node, rank)


def stop_job(record: RunRecord, connector: Connector | None = None) -> dict[str, list[str]]:
    """``stop``: scancel, and wait until the job has left the queue; what is left."""
    job_id, _ = _job(record)
    name = f"SLURM job {job_id}"
    try:
        session = record_session(record, connector)
    except TransportError as error:
        return {name: [f"unreachable: {error}"]}
    try:
        left = cancel_and_wait(session, job_id)
    except (TransportError, TorchherdError) as error:
        return {name: [f"unknown: {error}"]}
    finally:
        session.close()
    return {name: [] if left is None else [f"still in the queue: {left.state}"]}
