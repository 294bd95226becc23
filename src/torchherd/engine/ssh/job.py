"""One job on every node: start, supervise, tear down, summarise; events to an observer.

Each node runs the standard-library supervisor (``torchherd/remote/supervisor.py``)
over a transport process without a terminal; the supervisor starts torchrun, frames
its output as records, and kills the whole job tree when told to, when its stdin
closes (the controller died) or when the controller has been silent too long (the
network went away). Here, one reader thread per node turns records into lines,
writes them to the node's log file at once, and queues them for the supervising
thread, which reports them in batches to the observer and decides how the run ends.
"""

from __future__ import annotations

import queue
import shlex
import threading
import time
from dataclasses import dataclass
from typing import Mapping, Sequence, Union

from torchherd.engine.bookkeeping import NodeLog, attempt_marker, dispatch, log_dir
from torchherd.engine.events import (
    CheckpointSaved,
    CoordinatorStarted,
    Interrupted,
    NodeExited,
    NodeLost,
    NodeNotStarted,
    NodeSilent,
    NodeStarted,
    NodeStatus,
    Observer,
    ProcessesLeft,
    RunFinished,
    StopSent,
)
from torchherd.engine.outcome import Ending, NodeRun, first_cause, ssh_state, summarise
from torchherd.engine.records import remote_coordinator_file, remote_log_file, remote_state_file
from torchherd.engine.run import HEARTBEAT_EVERY, STOP_MARGIN, LaunchOptions
from torchherd.engine.ssh.failfast import Coordination, start_coordinator
from torchherd.engine.watch.hang import Targets, targets_of
from torchherd.engine.watch.straggler import StragglerWatch
from torchherd.errors import TransportError
from torchherd.plan import NodePlan, Plan
from torchherd.remote import command, program, wire
from torchherd.remote.wire import StopLevel, control_line
from torchherd.runlog import (
    STDERR,
    OutputLine,
    OutputParser,
    RankLines,
    RecordSplitter,
    RunSummary,
    Status,
    parse_records,
    visible_text,
)
from torchherd.shell import quote_path
from torchherd.transport import Process, Session, fan_out

SILENT_LOST_AFTER = 30.0
"""A node whose sshd still answers but whose supervisor sent nothing this long is lost
too: its supervisor is stuck (a node at full load still beats, late by milliseconds)."""
WATCHDOG = 10.0
"""The supervisor tears its job down when the controller is silent this long."""
MAX_BATCH = 5000
"""Queue items rendered at once; bounded so status checks run between batches."""
GPU_EVERY = 5.0
BUSY_EVERY = 2.0
"""Seconds between two reports of a node's busy share (its ranks sampled five times a second)."""
"""Seconds between two GPU samples on a node that has nvidia-smi."""


@dataclass(frozen=True)
class Closed:
    """A node's SSH channel ended; ``code`` is None when it ended without an exit status."""

    node: str
    code: int | None


@dataclass(frozen=True)
class _StopRequest:
    """``Run.stop`` from another thread, carried to the supervising thread by the queue:
    the first one stops every node gracefully, the next kills."""


Record = Union[OutputLine, Status, Closed]
RunEvent = Union[OutputLine, RankLines, Status, Closed, _StopRequest]
"""What a run's reader threads queue: ``RankLines`` carries a whole chunk of rank lines."""


def supervisor_source() -> str:
    """The supervisor as the node runs it (after its python): isolated, one self-contained
    ``-c`` program, as shell words."""
    return command("supervisor.py")


def supervisor_config(node: NodePlan, run_id: str, grace: float, heartbeat: float = HEARTBEAT_EVERY,
                      watchdog: float = WATCHDOG, warm: bool = False) -> wire.SupervisorConfig:
    """What the node's supervisor is told (the first line of its stdin, ``to_line()``).
    ``warm`` (``LaunchOptions.warm_start``): torchrun, where it starts on the node's own
    python, starts warm (``wire.SupervisorConfig.warm_start``)."""
    # cwd stays None: the shell already changed into the workdir, and a `cd` in the
    # host's setup snippet must keep its effect.
    argv = redirected(node)
    files = argv != tuple(node.argv)
    cold = tuple(node.argv) == node.torchrun.argv()  # not a warm Python's client, nor a check's program
    # Reading the ranks' files, the supervisor writes every rank prefix itself, at the start
    # of a line; torchrun's own output then holds none to mend, and a marker in the middle
    # of a line is text (the mender would give the rest of the line to that rank).
    return wire.SupervisorConfig(run_id=run_id, argv=argv, env=node.env, cwd=None, grace=grace,
                                 heartbeat=heartbeat, watchdog=watchdog, cleanup_dir=node.remote_log_dir,
                                 rank_marker=None if files else wire.RANK_PREFIX_HEAD.decode(), gpu_every=GPU_EVERY,
                                 rank_logs=node.remote_log_dir if files else None, rank_base=node.torchrun.rank_base,
                                 busy_every=BUSY_EVERY, container=node.container,
                                 warm_start=program("zygote.py") if warm and cold else None)


def redirected(node: NodePlan) -> tuple[str, ...]:
    """torchrun's command rendered with ``--redirects 3`` where the plan's has ``--tee 3``:
    the ranks write only to their files, and the supervisor reads those byte for byte
    (``rank_logs``), where torchrun's tee would read them as text, turning each ``\\r`` of a
    progress bar into a line break, with a thread per rank that can tear lines apart. The
    plan keeps ``--tee 3``: its command, pasted by hand, prints every rank's lines. The
    interpreter may be another (a warm Python's client, ``engine.ssh.warm``). A node
    running some other command (a check's own program) runs it as it is."""
    if tuple(node.argv[1:]) != node.torchrun.argv()[1:]:
        return tuple(node.argv)
    return (node.argv[0], *node.torchrun.argv(output="--redirects")[1:])


def remote_command(node: NodePlan, run_id: str, source: str) -> str:
    """The shell line sshd runs: workdir, the setup snippet, then the supervisor, which
    reads its config from the first line of stdin (``supervisor_config(...).to_line()``).

    Every value goes through shlex.quote (the workdir and python keep a leading ``~``
    expandable); the setup snippet is the user's own shell text and runs as written.
    The job's environment is not on this line: a node's process list is public.
    """
    parts = node.shell_prefix()  # the setup's output goes to stderr: stdout is the record stream
    parts.append(f"exec {quote_path(node.host.python)} {source} - {shlex.quote(run_id)}")
    return " && ".join(parts)


def records_to_events(node: str, records: Sequence[bytes]) -> list[Record]:
    """Supervisor records -> lines and status events; heartbeats carry no event."""
    return list(parse_records(node, records))


def read_node(node: NodeRun, process: Process, events: queue.Queue[list[RunEvent]], marker: bytes = b"") -> None:
    """The reader thread: every record is parsed and logged as it arrives; the queue
    only ever receives whole lines, so the terminal can never hold a node back. With a
    ``marker`` (an attempt of a run with retries) the log is written on after it."""
    parser, stderr_lines = OutputParser(node.name), RecordSplitter()
    log = NodeLog(node.log_path, marker)

    def deliver(batch: Sequence[RunEvent]) -> None:
        node.last_seen = time.monotonic()
        log.write(batch)
        if batch:
            events.put(list(batch))

    def on_stdout(data: bytes) -> None:
        node.last_seen = time.monotonic()
        deliver(parser.feed(data))

    def on_stderr(data: bytes) -> None:
        # The supervisor's own stderr: the shell (a failed cd, the setup snippet).
        deliver([OutputLine(node.name, None, STDERR, visible_text(line)) for line in stderr_lines.feed(data)])

    try:
        process.pump(on_stdout, on_stderr)
        deliver(parser.finish())
        deliver([OutputLine(node.name, None, STDERR, visible_text(line)) for line in stderr_lines.finish()])
    finally:
        log.close()
    node.reader_done = True
    events.put([Closed(node.name, process.exit_code(timeout=2.0))])


class Job:
    """One run across all nodes: start, supervise, end, summarise. Reports to ``observer``."""

    def __init__(self, plan: Plan, sessions: Mapping[str, Session], options: LaunchOptions,
                 observer: Observer) -> None:
        self.plan = plan
        self.sessions = sessions
        self.options = options
        self.straggler = StragglerWatch(window=options.straggler_window)
        self.emit = self.straggler.relay(observer)
        self.log_dir = options.log_dir / plan.run_id
        self.nodes = {node.host.name: NodeRun(node, self.log_dir / f"{node.host.name}.log") for node in plan.nodes}
        self.events: queue.Queue[list[RunEvent]] = queue.Queue()
        self.interrupted = False
        self.culprit: NodeRun | None = None
        self.started = time.monotonic()
        self.deadline = None if options.timeout is None else self.started + options.timeout
        self.timed_out = False
        self._quiet = threading.Event()
        self.coordination: Coordination | None = None
        self._stepped = self.started
        self._watching_since = self.started
        """Since when the supervising thread has looked often enough to judge silences."""

    def hang_targets(self) -> Targets:
        """The nodes as the hang watch reaches them: over the run's own sessions."""
        return targets_of(self.plan, self.sessions, {name: node.supervisor for name, node in self.nodes.items()})

    # starting -----------------------------------------------------------------
    def start_all(self) -> None:
        log_dir(self.log_dir)  # made and checked once: every attempt's files open relative to it
        self.coordination = self._start_coordinator()
        source = supervisor_source()
        fan_out(list(self.nodes.values()), lambda node: self._start(node, source))
        threading.Thread(target=self._heartbeat, name="torchherd-heartbeat", daemon=True).start()

    def _start(self, node: NodeRun, source: str) -> None:
        command = remote_command(node.plan, self.plan.run_id, source)
        try:
            process = self.sessions[node.name].start(command)
        except TransportError as error:
            node.start_error = str(error)
            self.events.put([Status(node.name, "error", {"message": str(error)})])
            return
        marker = attempt_marker(self.options.attempt, list(self.nodes)) if self.options.attempt else b""
        process.send(self._config(node, marker).to_line())
        node.last_seen = node.started_at = time.monotonic()
        node.process = process
        threading.Thread(target=read_node, args=(node, process, self.events, marker),
                         name=f"torchherd-read-{node.name}", daemon=True).start()

    def _start_coordinator(self) -> Coordination | None:
        """Persist mode (the controller in the background): the coordinator of a plain
        detached run, for when the controller is gone. When it cannot start, the attempt
        runs without it, as with a supervisor that cannot reach it: only that is lost."""
        if not (self.options.persist and self.options.fail_fast and len(self.nodes) > 1):
            return None
        state_file = remote_coordinator_file(self.plan.run_id, self.options.attempt)
        try:
            coordination = start_coordinator(self.plan, self.sessions[self.plan.master], state_file)
        except TransportError:
            return None
        record = coordination.record
        self.emit(CoordinatorStarted(record.node, record.port, record.pid, record.state_file))
        return coordination

    def _config(self, node: NodeRun, marker: bytes) -> wire.SupervisorConfig:
        # A supervisor gives the controller up no sooner than the controller gives the node
        # up, with room: a longer silence setting (a link that drops out) holds both ends.
        config = supervisor_config(node.plan, self.plan.run_id, self.options.stop_grace, self.options.heartbeat,
                                   max(WATCHDOG, 2 * self.options.lost_after), self.options.warm_start)._replace(
            checkpoint=self.options.watch_checkpoint, node=node.name)
        if not self.options.persist:
            return config
        # The watchdog only says when the controller counts as gone (its machine went
        # away): the job runs on, and the coordinator's fail fast applies from then on.
        coordination = self.coordination
        return config._replace(persist=True, node=node.name,
                               log_file=remote_log_file(self.plan.run_id, node.name),
                               state_file=remote_state_file(self.plan.run_id, node.name),
                               log_head=marker.decode().rstrip("\n") or None,
                               coordinator=coordination.for_node(node.name) if coordination else None)

    def _heartbeat(self) -> None:
        """Any line tells the supervisor the controller is still there. Its own thread: a
        terminal that stalls the supervising thread stalls no heartbeat."""
        every = self.options.heartbeat
        while not self._quiet.wait(every):
            for node in self.nodes.values():
                if node.running and node.process is not None:
                    node.process.send(wire.CONTROLLER_HEARTBEAT)
                    self.sessions[node.name].link_quiet(every)  # the first call starts the probes

    # supervising --------------------------------------------------------------
    def supervise(self) -> RunSummary:
        """Until every node has finished; then the summary (also reported as RunFinished)."""
        while not all(node.finished for node in self.nodes.values()):
            self._step()
        self._quiet.set()
        self._dispatch(self._drain(0.0))
        summary = self.summary()
        self.emit(RunFinished(summary))
        return summary

    def request_stop(self) -> None:
        """Thread-safe: the supervising thread stops the run as on Ctrl-C (again: kills)."""
        self.events.put([_StopRequest()])

    def interrupt(self) -> None:
        if not self.interrupted:
            self.interrupted = True
            self.emit(Interrupted())
            self.stop_all(StopLevel.TERM, "interrupted")
        else:
            self.emit(Interrupted(again=True))
            self.stop_all(StopLevel.KILL, "interrupted twice")

    def _step(self) -> None:
        self._dispatch(self._drain(0.1))
        now = time.monotonic()
        if now - self._stepped > self.options.lost_after / 2:
            # This thread was held up (a stalled terminal, a suspended machine): the silences
            # it finds now are partly its own, and are judged afresh from here.
            self._watching_since = now
        self._stepped = now
        for node in self.nodes.values():
            # A node whose channel already ended is not lost, only not yet processed.
            if node.running and not node.reader_done:
                reason = self._silence(node, now)
                if reason is not None:
                    self._lose(node, f"{node.name} vanished: {reason}")
            self._escalate(node, now)
        if self.deadline is not None and not self.timed_out and now > self.deadline:
            self.timed_out = True
            self.stop_all(StopLevel.TERM, "timed out")

    def _silence(self, node: NodeRun, now: float) -> str | None:
        """Why ``node`` counts as lost, or None. Lost: no heartbeat (nor any other record)
        for ``heartbeat_misses`` beats while its sshd does not answer keepalive requests
        either (the link or the machine is down); or, while sshd answers, nothing from the
        supervisor for ``SILENT_LOST_AFTER``. Late heartbeats from a loaded node, or a slow
        link, are not silence: the probes still come back."""
        silent = now - max(node.last_seen, self._watching_since)
        lost_after = self.options.lost_after
        longest = max(SILENT_LOST_AFTER, lost_after)
        if node.silent_from is not None and node.last_seen > node.silent_from:
            self.emit(NodeSilent(node.name, node.last_seen - node.silent_from, longest, heard=True))
            node.silent_from = None
        if silent < lost_after:
            return None
        session = self.sessions.get(node.name)
        quiet = session.link_quiet(self.options.heartbeat) if session is not None else None
        if quiet is not None and quiet >= lost_after:
            return f"nothing heard from it for {silent:.1f} s: no heartbeat, and its SSH connection does not answer"
        if silent >= longest:
            stuck = " (its sshd answers: its supervisor is stuck)" if quiet is not None else ""
            return f"nothing heard from it for {silent:.0f} s{stuck}"
        # Told once per silence, and only while sshd answered lately: a link going down
        # silences both, sshd a probe's period later, and is lost, not warned of.
        if quiet is not None and quiet <= lost_after / 2 and node.silent_from is None:
            node.silent_from = node.last_seen
            self.emit(NodeSilent(node.name, silent, longest))
        return None

    def _drain(self, timeout: float) -> list[RunEvent]:
        batch: list[RunEvent] = []
        try:
            batch.extend(self.events.get(timeout=timeout) if timeout > 0 else self.events.get_nowait())
            while len(batch) < MAX_BATCH:
                batch.extend(self.events.get_nowait())
        except queue.Empty:
            pass
        return batch

    def _dispatch(self, batch: list[RunEvent]) -> None:
        dispatch(batch, self.emit, self.nodes.__getitem__, self._on_record)

    def _on_record(self, event: RunEvent) -> None:
        if isinstance(event, Status):
            self._on_status(self.nodes[event.node], event)
        elif isinstance(event, Closed):
            self._on_closed(self.nodes[event.node], event.code)
        elif isinstance(event, _StopRequest):
            self.interrupt()

    def _on_status(self, node: NodeRun, status: Status) -> None:
        fields = status.fields
        if status.event == "started":
            pid, supervisor = fields.get("pid"), fields.get("supervisor")
            if isinstance(supervisor, int) and not isinstance(supervisor, bool) and supervisor > 0:
                node.supervisor = supervisor  # the hang probe's root: only its descendants are ranks
            self.emit(NodeStarted(node.name, int(pid) if isinstance(pid, int) else None,
                                  int(supervisor) if isinstance(supervisor, int) else None))
        elif status.event == "error":
            node.start_error = str(fields.get("message", "the job could not be started"))
            self.emit(NodeNotStarted(node.name, node.start_error))
            self._failed(node)
        elif status.event == "exit":
            self._on_exit(node, int(fields.get("code", 1)))
        elif status.event == "done":
            node.done = True
            node.left = int(fields.get("left", 0))
            if node.exit_code is None:
                self._on_exit(node, int(fields.get("code", 1)))
            if node.left:
                self.emit(ProcessesLeft(node.name, node.left))
        elif status.event == "checkpoint":
            path, size, mtime = fields.get("path"), fields.get("size"), fields.get("mtime")
            if isinstance(path, str) and isinstance(size, int) and isinstance(mtime, (int, float)):
                self.emit(CheckpointSaved(node.name, path, size, float(mtime)))
        elif status.event in ("gpu", "progress", "busy"):
            # Only for the live view: the GPUs sampled, a progress bar as it stands, how
            # busy the ranks were.
            self.emit(NodeStatus(status))

    def _on_exit(self, node: NodeRun, code: int) -> None:
        node.exit_code = code
        node.ended_at = time.monotonic()
        expected = code != 0 and node.stop_sent is not None
        self.emit(NodeExited(node.name, code, expected))
        if code != 0 and not expected:
            self._failed(node)

    def _on_closed(self, node: NodeRun, code: int | None) -> None:
        node.closed = True
        if node.done or node.lost is not None:
            return
        if code is None and node.stop_sent is not StopLevel.GIVE_UP:
            self._lose(node, f"{node.name} vanished: its SSH channel closed without an exit status")
            return
        # The supervisor never ran (a failed cd or setup snippet): the shell's status.
        node.ended_at = node.ended_at or time.monotonic()
        if node.exit_code is None and code is not None:
            node.exit_code = code
            if code != 0 and node.stop_sent is None:
                self.emit(NodeNotStarted(node.name, f"the job did not start (exit {code})", code))
                self._failed(node)

    def _failed(self, node: NodeRun) -> None:
        if self.culprit is None and not self.interrupted:
            self.culprit = node
        if self.options.fail_fast:
            self.stop_all(StopLevel.TERM, f"{node.name} failed")

    def _lose(self, node: NodeRun, reason: str) -> None:
        node.lost = reason
        node.ended_at = time.monotonic()
        self.emit(NodeLost(node.name, reason))
        if self.culprit is None and not self.interrupted:
            self.culprit = node
        self.stop_all(StopLevel.TERM, f"{node.name} vanished")
        session = self.sessions.get(node.name)
        if session is not None:
            # Closing may wait on a dead network; the run must not.
            threading.Thread(target=session.close, daemon=True).start()

    def stop_all(self, level: StopLevel, reason: str) -> None:
        """TERM (graceful, SIGKILL after the grace period) or KILL to every running node."""
        now = time.monotonic()
        told = []
        for node in self.nodes.values():
            if node.running and node.process is not None and (node.stop_sent is None or node.stop_sent < level):
                node.stop_sent, node.stop_at = level, now
                node.process.send(control_line(level))
                told.append(node.name)
        if told:
            self.emit(StopSent(level, reason, tuple(told)))

    def _escalate(self, node: NodeRun, now: float) -> None:
        if not node.running or node.process is None:
            return
        if node.stop_sent is StopLevel.TERM and now - node.stop_at > self.options.stop_grace + STOP_MARGIN:
            node.stop_sent, node.stop_at = StopLevel.KILL, now
            node.process.send(control_line(StopLevel.KILL))
            self.emit(StopSent(StopLevel.KILL, f"{node.name} did not stop within the grace period", (node.name,)))
        elif node.stop_sent is StopLevel.KILL and now - node.stop_at > STOP_MARGIN:
            node.stop_sent = StopLevel.GIVE_UP
            self._lose(node, f"{node.name} did not confirm the teardown; its processes may still run")

    # ending -------------------------------------------------------------------
    def summary(self) -> RunSummary:
        ending = Ending(interrupted="every node was told to stop" if self.interrupted else None)
        nodes = list(self.nodes.values())
        culprit = first_cause(self.culprit, nodes)
        return self.straggler.named(summarise(self.plan.run_id, nodes,
                                              lambda node: ssh_state(node, culprit, self.interrupted),
                                              culprit, ending, time.monotonic() - self.started,
                                              str(self.log_dir)))
