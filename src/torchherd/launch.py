"""Start, supervise and tear down one job on every node.

Each node runs the standard-library supervisor (``torchherd/remote/supervisor.py``)
over an SSH channel without a PTY; the supervisor starts torchrun, frames its output
as records, and kills the whole job tree when told to, when its stdin closes (the
controller died) or when the controller has been silent too long (the network
went away). Here, one reader thread per node turns records into lines, writes them
to the node's log file at once, and queues them for the main thread, which renders
them in batches and decides how the run ends.
"""

from __future__ import annotations

import importlib.resources
import json
import queue
import shlex
import signal
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Callable, Mapping, Sequence, Union

from torchherd.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, TransportError
from torchherd.inventory import Inventory
from torchherd.plan import RANK_PREFIX_HEAD, NodeNetwork, NodePlan, Plan, RunOptions, build_plan, quote_path
from torchherd.runlog import (
    STDERR,
    NodeOutcome,
    OutputLine,
    OutputParser,
    RankLines,
    RecordSplitter,
    RunSummary,
    Status,
    is_error_line,
    parse_records,
    root_cause_rank,
    visible_text,
)
from torchherd.transport import Connection, RemoteProcess, connect_all

if TYPE_CHECKING:
    from rich.console import Console

    from torchherd.console.run import LiveRenderer

HEARTBEAT_EVERY = 1.0
"""Seconds between heartbeats, both ways."""
LOST_AFTER = 10.0
"""A node that sent nothing (not even a heartbeat) for this long has vanished."""
WATCHDOG = 10.0
"""The supervisor tears its job down when the controller is silent this long."""
STOP_MARGIN = 10.0
"""Beyond the grace period: TERM -> KILL, and KILL -> give the node up."""
TAIL_LINES = 8
_STOP_ORDER = {None: 0, "TERM": 1, "KILL": 2, "GIVE UP": 3}
MAX_BATCH = 5000
"""Queue items rendered at once; bounded so status checks run between batches."""


@dataclass(frozen=True)
class LaunchOptions:
    check: bool = True
    log_dir: Path = Path("torchherd-logs")
    grace: float = 10.0
    accept_new_host_keys: bool = False
    fail_fast: bool = True


@dataclass(frozen=True)
class Closed:
    """A node's SSH channel ended; ``code`` is None when it ended without an exit status."""

    node: str
    code: int | None


Event = Union[OutputLine, Status, Closed]
RunEvent = Union[OutputLine, RankLines, Status, Closed]
"""What a run's reader threads queue: ``RankLines`` carries a whole chunk of rank lines."""


def supervisor_source() -> str:
    return importlib.resources.files("torchherd.remote").joinpath("supervisor.py").read_text("utf-8")


def supervisor_config(node: NodePlan, run_id: str, grace: float) -> dict[str, object]:
    # cwd stays None: the shell already changed into the workdir, and a `cd` in the
    # host's setup snippet must keep its effect.
    return {"run_id": run_id, "argv": list(node.argv), "env": dict(node.env), "cwd": None,
            "grace": grace, "heartbeat": HEARTBEAT_EVERY, "watchdog": WATCHDOG,
            "cleanup_dir": node.remote_log_dir, "rank_marker": RANK_PREFIX_HEAD.decode()}


def remote_command(node: NodePlan, run_id: str, source: str) -> str:
    """The shell line sshd runs: workdir, the setup snippet, then the supervisor, which
    reads its config from the first line of stdin (``supervisor_input``).

    Every value goes through shlex.quote (the workdir and python keep a leading ``~``
    expandable); the setup snippet is the user's own shell text and runs as written.
    The job's environment is not on this line: a node's process list is public.
    """
    parts = [f"cd {quote_path(node.workdir)}"]
    if node.setup.strip():
        parts.append("{ " + node.setup.strip() + "\n}")
    parts.append(f"exec {quote_path(node.host.python)} -u -c {shlex.quote(source)} - {shlex.quote(run_id)}")
    return " && ".join(parts)


def supervisor_input(node: NodePlan, run_id: str, grace: float, extra: Mapping[str, object] | None = None) -> bytes:
    """The supervisor's config, sent as the first line of its stdin."""
    return json.dumps({**supervisor_config(node, run_id, grace), **(extra or {})}).encode("utf-8") + b"\n"


def records_to_events(node: str, records: Sequence[bytes]) -> list[Event]:
    """Supervisor records -> lines and status events; heartbeats carry no event."""
    return list(parse_records(node, records))


class NodeRun:
    """The controller's view of one node during the run."""

    def __init__(self, plan: NodePlan, log_path: Path) -> None:
        self.plan = plan
        self.name = plan.host.name
        self.log_path = log_path
        self.process: RemoteProcess | None = None
        self.last_seen = time.monotonic()
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self.exit_code: int | None = None
        self.done = False
        self.closed = False
        self.ranks_running = False
        """A rank has printed: the node got through the rendezvous."""
        self.reader_done = False
        """Set by the reader thread when the channel ended; its Closed event may still be queued."""
        self.lost: str | None = None
        self.start_error: str | None = None
        self.stop_sent: str | None = None
        self.stop_at = 0.0
        self.left = 0
        self.rank_error: OutputLine | None = None
        self.other_error: OutputLine | None = None
        self.failed_rank: int | None = None
        self.rank_tail: deque[OutputLine] = deque(maxlen=TAIL_LINES)
        self.other_tail: deque[OutputLine] = deque(maxlen=TAIL_LINES)

    @property
    def finished(self) -> bool:
        return self.closed or self.lost is not None or (self.process is None and self.start_error is not None)

    @property
    def running(self) -> bool:
        return self.process is not None and not self.finished

    def track(self, line: OutputLine) -> None:
        """Keeps what the summary needs: the first error line, the failed rank, the tail."""
        (self.rank_tail if line.rank is not None else self.other_tail).append(line)
        rank = root_cause_rank(line)
        if rank is not None and self.failed_rank is None and self.rank_error is None:
            self.failed_rank = rank
        self._track_error(line)

    def track_block(self, block: RankLines) -> None:
        """``track`` for every line of the block: only its last lines can be in the tail,
        only its stderr lines can be errors, and none is torchrun's root-cause report."""
        self.rank_tail.extend(block.tail(TAIL_LINES))
        if self.rank_error is None:
            for line in block.error_candidates():
                self._track_error(line)

    def _track_error(self, line: OutputLine) -> None:
        if is_error_line(line):
            if line.rank is not None and self.rank_error is None:
                self.rank_error = line
                # The rank that raised first is the one to name; torchrun's own report
                # may call a peer that died of the same crash the root cause.
                self.failed_rank = line.rank
            elif line.rank is None and self.other_error is None:
                self.other_error = line

    def first_error(self) -> str | None:
        line = self.rank_error or self.other_error
        if line is None:
            return self.lost or self.start_error
        return line.described()


def read_node(node: NodeRun, process: RemoteProcess, events: queue.Queue[list[RunEvent]]) -> None:
    """The reader thread: every record is parsed and logged as it arrives; the queue
    only ever receives whole lines, so the terminal can never hold a node back."""
    parser, stderr_lines = OutputParser(node.name), RecordSplitter()
    with node.log_path.open("wb") as log:
        def deliver(batch: Sequence[RunEvent]) -> None:
            node.last_seen = time.monotonic()
            text = b"".join(_log_bytes(event) for event in batch)
            if text:
                log.write(text)
                log.flush()
            if batch:
                events.put(list(batch))

        def on_stdout(data: bytes) -> None:
            node.last_seen = time.monotonic()
            deliver(parser.feed(data))

        def on_stderr(data: bytes) -> None:
            # The supervisor's own stderr: the shell (a failed cd, the setup snippet).
            deliver([OutputLine(node.name, None, STDERR, visible_text(line)) for line in stderr_lines.feed(data)])

        process.pump(on_stdout, on_stderr)
        deliver(parser.finish())
        deliver([OutputLine(node.name, None, STDERR, visible_text(line)) for line in stderr_lines.finish()])
    node.reader_done = True
    events.put([Closed(node.name, process.exit_code(timeout=2.0))])


def _log_bytes(event: RunEvent) -> bytes:
    if isinstance(event, RankLines):
        return event.log_bytes()
    if isinstance(event, OutputLine):
        return (event.log_text() + "\n").encode("utf-8", "replace")
    return b""


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


class Job:
    """One run across all nodes: start, supervise, end, summarise."""

    def __init__(self, plan: Plan, connections: Mapping[str, Connection], options: LaunchOptions,
                 renderer: LiveRenderer) -> None:
        self.plan = plan
        self.connections = connections
        self.options = options
        self.renderer = renderer
        self.log_dir = options.log_dir / plan.run_id
        self.nodes = {node.host.name: NodeRun(node, self.log_dir / f"{node.host.name}.log") for node in plan.nodes}
        self.events: queue.Queue[list[RunEvent]] = queue.Queue()
        self.stopping: str | None = None
        self.interrupted = False
        self.culprit: NodeRun | None = None
        self.started = time.monotonic()
        self._quiet = threading.Event()

    # starting -----------------------------------------------------------------
    def start_all(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        source = supervisor_source()
        with ThreadPoolExecutor(max_workers=max(1, min(32, len(self.nodes)))) as pool:
            list(pool.map(lambda node: self._start(node, source), self.nodes.values()))
        threading.Thread(target=self._heartbeat, name="torchherd-heartbeat", daemon=True).start()

    def _start(self, node: NodeRun, source: str) -> None:
        command = remote_command(node.plan, self.plan.run_id, source)
        try:
            process = self.connections[node.name].start(command)
            process.send(supervisor_input(node.plan, self.plan.run_id, self.options.grace))
        except TransportError as error:
            node.start_error = str(error)
            self.events.put([Status(node.name, "error", {"message": str(error)})])
            return
        except Exception as error:  # paramiko's own errors, when the session cannot open
            node.start_error = f"{node.name}: cannot start the job: {error}"
            self.events.put([Status(node.name, "error", {"message": node.start_error})])
            return
        node.last_seen = node.started_at = time.monotonic()
        node.process = process
        threading.Thread(target=read_node, args=(node, process, self.events), name=f"torchherd-read-{node.name}",
                         daemon=True).start()

    def _heartbeat(self) -> None:
        """Any line tells the supervisor the controller is still there."""
        while not self._quiet.wait(HEARTBEAT_EVERY):
            for node in self.nodes.values():
                if node.running and node.process is not None:
                    node.process.send(b"\n")

    # supervising --------------------------------------------------------------
    def supervise(self) -> None:
        while not all(node.finished for node in self.nodes.values()):
            try:
                self._step()
            except KeyboardInterrupt:
                self.interrupt()
        self._quiet.set()
        self._render(self._drain(0.0))

    def interrupt(self) -> None:
        if not self.interrupted:
            self.interrupted = True
            self.renderer.note("interrupted: stopping every node (interrupt again to kill at once)", "bold yellow")
            self.stop_all("TERM", "interrupted")
        else:
            self.stop_all("KILL", "interrupted twice")

    def _step(self) -> None:
        self._render(self._drain(0.1))
        now = time.monotonic()
        for node in self.nodes.values():
            # A node whose channel already ended is not lost, only not yet processed.
            if node.running and not node.reader_done and now - node.last_seen > LOST_AFTER:
                self._lose(node, f"{node.name} vanished: nothing heard from it for {now - node.last_seen:.0f} s")
            self._escalate(node, now)

    def _drain(self, timeout: float) -> list[RunEvent]:
        batch: list[RunEvent] = []
        try:
            batch.extend(self.events.get(timeout=timeout) if timeout > 0 else self.events.get_nowait())
            while len(batch) < MAX_BATCH:
                batch.extend(self.events.get_nowait())
        except queue.Empty:
            pass
        return batch

    def _render(self, batch: list[RunEvent]) -> None:
        lines: list[OutputLine | RankLines] = []
        for event in batch:
            if isinstance(event, (OutputLine, RankLines)):
                node = self.nodes[event.node]
                if not node.ranks_running and (isinstance(event, RankLines) or event.rank is not None):
                    node.ranks_running = True
                    self.renderer.render(lines)
                    lines = []
                    self.renderer.note(f"{node.name}: ranks running (through the rendezvous)", "dim")
                if isinstance(event, OutputLine):
                    node.track(event)
                else:
                    node.track_block(event)
                lines.append(event)
                continue
            self.renderer.render(lines)
            lines = []
            if isinstance(event, Status):
                self._on_status(self.nodes[event.node], event)
            else:
                self._on_closed(self.nodes[event.node], event.code)
        self.renderer.render(lines)

    def _on_status(self, node: NodeRun, status: Status) -> None:
        fields = status.fields
        if status.event == "started":
            self.renderer.note(f"{node.name}: torchrun started (pid {fields.get('pid')})", "dim")
        elif status.event == "error":
            node.start_error = str(fields.get("message", "the job could not be started"))
            self.renderer.note(f"{node.name}: {node.start_error}", "bold red")
            self._failed(node)
        elif status.event == "exit":
            self._on_exit(node, int(fields.get("code", 1)))
        elif status.event == "done":
            node.done = True
            node.left = int(fields.get("left", 0))
            if node.exit_code is None:
                self._on_exit(node, int(fields.get("code", 1)))
            if node.left:
                self.renderer.note(f"{node.name}: {node.left} processes of the job could not be killed", "bold red")

    def _on_exit(self, node: NodeRun, code: int) -> None:
        node.exit_code = code
        node.ended_at = time.monotonic()
        if code == 0:
            self.renderer.note(f"{node.name}: finished (exit 0)", "green")
        elif node.stop_sent is None:
            self.renderer.note(f"{node.name}: exited with code {code}", "bold red")
            self._failed(node)

    def _on_closed(self, node: NodeRun, code: int | None) -> None:
        node.closed = True
        if node.done or node.lost is not None:
            return
        if code is None and node.stop_sent != "GIVE UP":
            self._lose(node, f"{node.name} vanished: its SSH channel closed without an exit status")
            return
        # The supervisor never ran (a failed cd or setup snippet): the shell's status.
        node.ended_at = node.ended_at or time.monotonic()
        if node.exit_code is None and code is not None:
            node.exit_code = code
            if code != 0 and node.stop_sent is None:
                self.renderer.note(f"{node.name}: the job did not start (exit {code})", "bold red")
                self._failed(node)

    def _failed(self, node: NodeRun) -> None:
        if self.culprit is None and not self.interrupted:
            self.culprit = node
        if self.options.fail_fast:
            self.stop_all("TERM", f"{node.name} failed")

    def _lose(self, node: NodeRun, reason: str) -> None:
        node.lost = reason
        node.ended_at = time.monotonic()
        self.renderer.note(reason, "bold red")
        if self.culprit is None and not self.interrupted:
            self.culprit = node
        self.stop_all("TERM", f"{node.name} vanished")
        connection = self.connections.get(node.name)
        if connection is not None:
            # Closing may wait on a dead network; the run must not.
            threading.Thread(target=connection.close, daemon=True).start()

    def stop_all(self, mode: str, reason: str) -> None:
        """TERM (graceful, SIGKILL after the grace period) or KILL to every running node."""
        self.stopping = self.stopping or reason
        now = time.monotonic()
        for node in self.nodes.values():
            if node.running and node.process is not None and _STOP_ORDER[node.stop_sent] < _STOP_ORDER[mode]:
                node.stop_sent, node.stop_at = mode, now
                node.process.send(f"{mode}\n".encode())

    def _escalate(self, node: NodeRun, now: float) -> None:
        if not node.running or node.process is None:
            return
        if node.stop_sent == "TERM" and now - node.stop_at > self.options.grace + STOP_MARGIN:
            node.stop_sent, node.stop_at = "KILL", now
            node.process.send(b"KILL\n")
        elif node.stop_sent == "KILL" and now - node.stop_at > STOP_MARGIN:
            node.stop_sent = "GIVE UP"
            self._lose(node, f"{node.name} did not confirm the teardown; its processes may still run")

    # ending -------------------------------------------------------------------
    def summary(self) -> RunSummary:
        outcomes = tuple(self._outcome(node) for node in self.nodes.values())
        if self.interrupted:
            code, headline = EXIT_INTERRUPTED, "interrupted: every node was told to stop"
        elif self.culprit is not None:
            code, headline = EXIT_FAILED, self._blame(self.culprit)
        elif all(outcome.state == "ok" for outcome in outcomes):
            code = EXIT_OK
            headline = f"all {len(outcomes)} nodes finished (exit 0) in {time.monotonic() - self.started:.1f} s"
        else:
            code, headline = EXIT_FAILED, "the job failed on " + ", ".join(
                outcome.node for outcome in outcomes if outcome.state != "ok")
        left = sum(outcome.left for outcome in outcomes)
        if left:
            headline += f"; {left} processes could not be killed (see the table)"
        return RunSummary(self.plan.run_id, code, headline, outcomes, str(self.log_dir))

    def _blame(self, node: NodeRun) -> str:
        if node.lost is not None:
            return f"{node.lost}; the other nodes were torn down"
        rank = f" rank {node.failed_rank}" if node.failed_rank is not None else ""
        code = f" with exit code {node.exit_code}" if node.exit_code is not None else ""
        error = node.first_error()
        return f"{node.name}{rank} failed first{code}" + (f": {error}" if error else "")

    def _outcome(self, node: NodeRun) -> NodeOutcome:
        if node.lost is not None:
            state = "unresponsive" if node.stop_sent == "GIVE UP" else "lost"
        elif node.process is None:
            state = "not started"
        elif node.exit_code == 0:
            state = "ok"
        elif node.stop_sent is not None and node is not self.culprit:
            state = "interrupted" if self.interrupted else "torn down"
        else:
            state = "failed"
        seconds = None if node.started_at is None else (node.ended_at or time.monotonic()) - node.started_at
        tail = tuple(line.log_text() for line in node.rank_tail or node.other_tail)
        return NodeOutcome(node.name, node.plan.node_rank, state, node.exit_code, seconds,
                           node.first_error() if state != "ok" else None,
                           node.failed_rank if state == "failed" else None, tail, node.left)


def run_job(inventory: Inventory, run_options: RunOptions, options: LaunchOptions, console: Console) -> int:
    """``torchherd run``: preflight (or just connect), launch, stream, end; the exit code."""
    from torchherd.console.run import LiveRenderer, render_summary

    opened = open_plan(inventory, run_options, options, console)
    if opened is None:
        return EXIT_FAILED
    plan, connections, close = opened
    try:
        renderer = LiveRenderer(console, [node.host.name for node in plan.nodes], _max_rank(plan))
        job = Job(plan, connections, options, renderer)
        renderer.note(f"run {plan.run_id}: {len(plan.nodes)} nodes, master {plan.master} at "
                      f"{plan.master_addr}:{plan.port}; logs in {job.log_dir}", "bold")
        with _sigterm_as_interrupt():
            try:
                job.start_all()
            except KeyboardInterrupt:
                job.interrupt()
            job.supervise()
        summary = job.summary()
        render_summary(console, summary)
        return summary.exit_code
    finally:
        close()


def _max_rank(plan: Plan) -> int:
    nproc = plan.nodes[0].argv[plan.nodes[0].argv.index("--nproc-per-node") + 1]
    return len(plan.nodes) * int(nproc) - 1 if nproc.isdigit() else 99


class _sigterm_as_interrupt:
    """SIGTERM to the controller ends the run like Ctrl-C (130, every node stopped)."""

    def __enter__(self) -> None:
        self.previous: Callable[[int, FrameType | None], object] | int | None = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, _raise_interrupt)

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


Opened = tuple[Mapping[str, Connection], Mapping[str, NodeNetwork], Callable[[], None]]


def open_plan(inventory: Inventory, run_options: RunOptions, options: LaunchOptions, console: Console
              ) -> tuple[Plan, Mapping[str, Connection], Callable[[], None]] | None:
    """Validates the options, runs the preflight (or just connects), then plans with what
    it found; None when a node failed (already reported). The caller closes."""
    build_plan(inventory, run_options)  # a bad option is a usage error before any node is touched
    opened = _open(inventory, run_options, options, console)
    if opened is None:
        return None
    connections, networks, close = opened
    try:
        return build_plan(inventory, run_options, networks), connections, close
    except BaseException:
        close()
        raise


def _open(inventory: Inventory, run_options: RunOptions, options: LaunchOptions, console: Console) -> Opened | None:
    if options.check:
        return _preflight(inventory, run_options, options, console)
    return _connect(inventory, options, console)


def _connect(inventory: Inventory, options: LaunchOptions, console: Console) -> Opened | None:
    from torchherd.console import render_error

    results = connect_all(inventory.hosts, inventory.cluster.ssh_config, inventory.cluster.ssh_timeout,
                          options.accept_new_host_keys)
    connections = {name: result for name, result in results.items() if isinstance(result, Connection)}
    failures = [result for result in results.values() if isinstance(result, TransportError)]

    def close() -> None:
        for connection in connections.values():
            connection.close()

    if failures:
        for error in failures:
            render_error(console, error)
        close()
        return None
    return connections, {}, close


def _preflight(inventory: Inventory, run_options: RunOptions, options: LaunchOptions,
               console: Console) -> Opened | None:
    from torchherd.checks import CheckOptions, run_preflight
    from torchherd.console.checks import render_report

    check_options = CheckOptions(only=None, skip=frozenset(),
                                 script=None if run_options.module else run_options.script,
                                 smoke=False, accept_new_host_keys=options.accept_new_host_keys)
    outcome = run_preflight(inventory, check_options)
    if not outcome.report.ok:
        render_report(console, outcome.report)
        outcome.close()
        return None
    warnings = [result for result in outcome.report.results if result.status == "warn"]
    console.print(f"preflight: {len(outcome.report.results)} checks passed"
                  + (f", {len(warnings)} warnings (torchherd check shows them)" if warnings else ""),
                  style="dim", markup=False, highlight=False)
    connections = dict(outcome.connections)
    missing = [host for host in inventory.hosts if host.name not in connections]
    extra = _connect(Inventory(inventory.path, inventory.cluster, tuple(missing)), options, console) \
        if missing else ({}, {}, lambda: None)
    if extra is None:
        outcome.close()
        return None
    connections.update(extra[0])

    def close() -> None:
        extra[2]()
        outcome.close()

    return connections, outcome.networks, close



# a quiet run (check --smoke) ------------------------------------------------------
@dataclass(frozen=True)
class QuietRun:
    """How a job run by ``run_quietly`` ended: per-node outcomes and every line each node printed."""

    summary: RunSummary
    lines: Mapping[str, tuple[OutputLine, ...]]
    timed_out: bool


class _DeadlineJob(Job):
    """A Job that keeps every line and stops every node once ``timeout`` seconds have passed."""

    def __init__(self, plan: Plan, connections: Mapping[str, Connection], options: LaunchOptions,
                 renderer: LiveRenderer, timeout: float) -> None:
        super().__init__(plan, connections, options, renderer)
        self.deadline = time.monotonic() + timeout
        self.timed_out = False
        self.kept: dict[str, list[OutputLine]] = {name: [] for name in self.nodes}

    def _render(self, batch: list[RunEvent]) -> None:
        for event in batch:
            if isinstance(event, OutputLine):
                self.kept[event.node].append(event)
            elif isinstance(event, RankLines):
                self.kept[event.node].extend(event.lines())
        super()._render(batch)

    def _step(self) -> None:
        super()._step()
        if not self.timed_out and time.monotonic() > self.deadline:
            self.timed_out = True
            self.stop_all("TERM", "timed out")


def run_quietly(plan: Plan, connections: Mapping[str, Connection], log_dir: Path, timeout: float,
                grace: float = 2.0) -> QuietRun:
    """Runs ``plan`` like ``run`` (same supervisor, fail-fast teardown) but prints nothing;
    every node is stopped after ``timeout`` seconds."""
    from io import StringIO

    from torchherd.console import make_console
    from torchherd.console.run import LiveRenderer

    renderer = LiveRenderer(make_console(StringIO()), [node.host.name for node in plan.nodes], _max_rank(plan))
    job = _DeadlineJob(plan, connections, LaunchOptions(log_dir=log_dir, grace=grace), renderer, timeout)
    job.start_all()
    job.supervise()
    lines = {name: tuple(kept) for name, kept in job.kept.items()}
    return QuietRun(job.summary(), lines, job.timed_out)
