"""torchherd node supervisor: runs one job on a node and leaves nothing behind.

Standard library and its ``torchherd.remote`` modules only (``wire``, ``framing``,
``proctable``, ``ranks``), Python >= 3.8, Linux. The controller runs it over SSH (no
PTY) as ``PYTHON -I -S -u -c PROGRAM - RUN_ID`` (``torchherd.remote.command``)
and sends its config (``wire.SupervisorConfig``) as the first line of stdin; the
config may also be ``argv[1]``. Stdin and stdout are the SSH channel; what goes
over them, and every config key, is defined in ``wire``.

Persist mode (``persist``, with a ``log_file``; a detached run with retries, whose
controller runs in the background): attached as below, and every record but heartbeats
and samples is also appended to the log file; the end of stdin or stdout, SIGHUP, and
the watchdog mean the controller is gone: the job runs on, logged. With a
``coordinator``, a STOP from it is held while the controller lives (the controller
recovers: it stops the attempt itself), and obeyed once it is gone, as in a plain
detached run.

Detached mode (``log_file`` set, no ``persist``): records are appended to the log file instead of
stdout; the supervisor forks into its own session, stdin from /dev/null (no EOF
teardown, no watchdog), and the parent prints the child's first status record
("started" or "error") and exits. A ``state_file`` is written at start and at the
end; with a ``coordinator`` the supervisor says HELLO to it, EXIT when the job ends,
and tears its job down on a STOP line (fail fast with no controller).

Stdin: every byte counts as a heartbeat from the controller; a TERM line asks for
a graceful teardown, KILL for an immediate SIGKILL teardown. EOF on stdin,
EOF/EPIPE on stdout, SIGTERM/SIGINT/SIGHUP to the supervisor and the watchdog all
start a graceful teardown; a second request while a graceful teardown runs
escalates it to SIGKILL. A line longer than MAX_LINE bytes is cut into several
records; every record the job's output makes comes before its "exit" event.

Job processes: every live descendant of the supervisor (it is a child
subreaper, so orphans stay in its tree) plus every process whose initial
environment holds TORCHHERD_RUN_ID=<run_id> and this supervisor's own
TORCHHERD_SUPERVISOR token (which only the processes it started inherit: a run
id alone is a name anyone can set, and another token is a sibling supervisor's
of the same run on the same process table), less the supervisor and its ancestors.
When the job's main process exits by itself, leftovers are swept the same way.

Exit status (= "code" in done): the job's exit status, 128+N when it died on
signal N (143 after a SIGTERM teardown, 137 after SIGKILL), 137 when it could
not be reaped after SIGKILL, 127/126 when the command was not found / not
executable, 2 for an invalid config.
"""


from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Set, Tuple

# On a node these are the stand-in modules the shipped program registered; see
# torchherd/remote/__init__.py.
from torchherd.remote import container, flight, wire
from torchherd.remote.framing import OUT_HIGH_WATER, OUT_LOW_WATER, READ_SIZE, JobPipes, LineFramer, Output, RankMender
from torchherd.remote.pace import PaceWriter, pace_path
from torchherd.remote.proctable import (
    LEFTOVER,
    Teardown,
    exit_code_from_status,
    find_job_processes,
    set_child_subreaper,
)
from torchherd.remote.ranks import RANK_POLL, BusySampler, CoordinatorLink, GpuSampler, RankFiles, tree_of
from torchherd.remote.savewatch import CheckpointWatch

AGENT_MODULE = "torch.distributed.run"
"""The job ``warm_start`` applies to: torchrun's agent."""
EXIT_BAD_CONFIG = 2
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
EXIT_UNKILLABLE = 128 + 9

COALESCE_BELOW = 16384
COALESCE_DELAY = 0.002
DRAIN_IDLE_TIMEOUT = 2.0
FINAL_FLUSH_STALL = 10.0
TEE_DIR_PREFIX = "torchherd-"
CONTAINER_RM_TIMEOUT = 60.0


def make_private_dirs(path: str, run_id: str) -> None:
    """``os.makedirs`` with every directory it makes 0700; ``path`` itself is made 0700 when
    it is the run's own directory (named after the run id), whoever made it."""
    old = os.umask(0o077)
    try:
        os.makedirs(path, exist_ok=True)
    finally:
        os.umask(old)
    if os.path.basename(path.rstrip("/")) == run_id:
        os.chmod(path, 0o700)


def make_private_dir(path: str) -> Tuple[Optional[str], Optional[str]]:
    """Creates torchrun's log directory for this attempt: ``PATH-XXXXXXXX``, a fresh random
    name, mode 0700 (``mkdtemp``: atomic, ours or it fails). (the directory, None), or
    (None, why not). ``PATH`` itself is never used: its name is guessable (the run id is in
    every process list), and another user who made it first could read the ranks' output,
    plant files the supervisor would report as theirs, or, were it refused, make every
    attempt on this node fail."""
    path = os.path.expanduser(path).rstrip("/")
    if not os.path.basename(path).startswith(TEE_DIR_PREFIX):
        return None, "%s: not a torchherd directory name" % path
    try:
        return tempfile.mkdtemp(prefix=os.path.basename(path) + "-", dir=os.path.dirname(path) or "."), None
    except OSError as exc:
        return None, "%s: cannot create it: %s" % (path, exc.strerror)


def remove_tee_dir(path: str) -> None:
    """Removes torchrun's per-rank tee directory; any other name is refused, so a
    bad config can never delete something that is not the run's own."""
    path = os.path.expanduser(path).rstrip("/")
    if os.path.basename(path).startswith(TEE_DIR_PREFIX):
        shutil.rmtree(path, ignore_errors=True)



class TeeOutput(Output):
    """The records for the channel (fd 1), and in persist mode each also appended to the
    node's log file at once: a file takes what it is given, where the channel may stall
    or be gone. Heartbeats and samples (``add_sample``) only feed a live controller."""

    def __init__(self, fd: int, log_fd: Optional[int] = None) -> None:
        super().__init__(fd)
        self.log_fd = log_fd

    def add(self, data: bytes) -> None:
        if data and self.log_fd is not None and data != wire.HEARTBEAT_RECORD:
            self._log(data)
        super().add(data)

    def add_sample(self, data: bytes) -> None:
        super().add(data)

    def _log(self, data: bytes) -> None:
        fd, view = self.log_fd, memoryview(data)
        try:
            while fd is not None and view:
                view = view[os.write(fd, view):]
        except OSError:
            pass  # a full disk: the channel still has the records while it lasts


def open_log(config: wire.SupervisorConfig) -> int:
    """The persist mode's log file (appended to, 0600, its directory 0700), opened after
    ``log_head``: the marker that opens an attempt's part."""
    path = os.path.expanduser(config.log_file or "")
    if os.path.dirname(path):
        make_private_dirs(os.path.dirname(path), config.run_id)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    if config.log_head:
        os.write(fd, wire.TAG_STDOUT + config.log_head.encode("utf-8", "replace") + b"\n")
    return fd


class StateFile:
    """The node's state file (``wire.NodeStateFile``), where ``status`` and ``stop`` read
    what runs; written whole at start and at the end (nowhere when the config names none)."""

    def __init__(self, config: wire.SupervisorConfig, pid: int, token: str) -> None:
        self.path = config.state_file
        self.fields: wire.NodeStateFile = {
            "run_id": config.run_id, "node": config.node, "supervisor": pid,
            "start": wire.process_start(pid), "token": token,
            "started": time.time(), "state": wire.STATE_RUNNING,
        }
        self.stopped: Optional[str] = None
        """The teardown's reason, once it had signalled the job before the job ended."""

    def started(self, pid: int, pgid: int) -> None:
        self.fields["pid"], self.fields["pgid"] = pid, pgid

    def contained(self, runtime: str, name: str) -> None:
        """The job's container, which ``stop`` removes should this supervisor be gone."""
        self.fields["container"] = [runtime, name]

    def exited(self, code: int, left: int) -> None:
        self.fields.update({"state": wire.STATE_EXITED, "code": code, "ended": time.time(), "left": left})
        if self.stopped is not None:
            self.fields["stopped"] = self.stopped
        self.write()

    def write(self) -> None:
        if self.path:
            try:
                wire.write_json_atomic(self.path, self.fields)
            except OSError:
                pass


class Signals:
    """SIGTERM, SIGINT, SIGHUP and SIGCHLD, kept until the loop takes them; each wakes the
    loop's selector (its wakeup pipe is in it as "wake")."""

    def __init__(self) -> None:
        self.pending: List[int] = []
        self.wake_r, self.wake_w = os.pipe()

    def install(self, sel: selectors.BaseSelector) -> None:
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, self._on_signal)
        sel.register(self.wake_r, selectors.EVENT_READ, "wake")

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.pending.append(signum)

    def take(self) -> List[int]:
        pending, self.pending = self.pending, []
        return pending

    def woken(self) -> None:
        try:
            os.read(self.wake_r, 4096)
        except OSError:
            pass


def container_argv(config: wire.SupervisorConfig, runtime: str, argv: List[str]) -> List[str]:
    """``argv`` inside the config's container: in the job's workdir (mounted at itself, as
    is torchrun's log directory, which this supervisor reads), as this user, with the job's
    variables passed by name (the runtime reads their values from its own environment)."""
    spec = config.container
    assert spec is not None
    # "~" in a mount is the user's home, as everywhere in the inventory (runtimes take no "~")
    spec = spec._replace(mounts=tuple(":".join(os.path.expanduser(part) if index < 2 else part
                                               for index, part in enumerate(mount.split(":")))
                                      for mount in spec.mounts))
    workdir = os.path.expanduser(config.cwd) if config.cwd else os.getcwd()
    binds = [os.path.expanduser(path) for path in (config.cleanup_dir, config.rank_logs) if path]
    names = list(config.env) + [wire.RUN_ID_ENV, wire.SUPERVISOR_ENV]
    return container.run_argv(spec, runtime, argv, names, workdir, container.node_identity(), binds)


def start_job(config: wire.SupervisorConfig, token: str, runtime: Optional[str] = None) -> "subprocess.Popen[bytes]":
    """The job, in a session of its own, with the environment this supervisor was given
    (``-I`` made its own interpreter ignore PYTHON* variables, not the job) plus the
    config's, the run id and this supervisor's token; inside the config's container with
    ``runtime`` (resolved) when there is one. Raises OSError."""
    env = dict(os.environ)
    env.update(config.env)
    env[wire.RUN_ID_ENV] = config.run_id
    env[wire.SUPERVISOR_ENV] = token
    argv = list(config.argv)
    if argv[0] == "~" or argv[0].startswith("~/"):  # the python, by the rule every command follows
        argv[0] = os.path.expanduser(argv[0])
    if config.warm_start is not None and argv[1:3] == ["-m", AGENT_MODULE]:
        argv[1:1] = ["-c", config.warm_start, "start"]
    if config.container is not None and runtime is not None:
        argv = container_argv(config, runtime, argv)
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, env=env,
                            cwd=os.path.expanduser(config.cwd) if config.cwd else None)


class Supervisor:
    """The loop: starts the job, frames its output, watches the controller (stdin), the
    coordinator and the signals, and tears the job down when one of them says so."""

    def __init__(self, config: wire.SupervisorConfig, notify_fd: Optional[int] = None) -> None:
        self.cfg = config
        self.notify_fd = notify_fd
        self.detached = config.log_file is not None and not config.persist
        self.persist = config.persist
        coordinator = config.coordinator
        self.link = (CoordinatorLink(coordinator.host, coordinator.port, coordinator.token, config.node)
                     if coordinator is not None else None)
        self.token = os.urandom(8).hex()
        self.pid = os.getpid()
        self.out = TeeOutput(1, open_log(config) if config.persist else None)
        self.sel = selectors.PollSelector()
        self.pipes = JobPipes(self.sel)
        self.signals = Signals()
        self.state = StateFile(config, self.pid, self.token)
        self.proc: Optional["subprocess.Popen[bytes]"] = None
        self.code: Optional[int] = None
        self.teardown: Optional[Teardown] = None
        self.child_exited = True
        self.got = 0
        self.stdin_open = True
        self.held_stop: Optional[str] = None
        """Persist mode: the coordinator's STOP, kept while the controller lives."""
        self.stdin_partial = b""
        self.stdin_pending = b""
        self.last_in = time.monotonic()
        self.next_heartbeat = self.last_in + config.heartbeat
        self.last_data = self.last_in
        self.writing = False
        self.made_dir = False
        self.runtime: Optional[str] = None
        """The container runtime the job was started with (None: no container)."""
        # In a container the ranks may be outside this supervisor's tree (docker's are the
        # daemon's), and a warm start's ranks are the warm Python's children (its client,
        # named by PYTHON_EXEC, is what torchrun starts): then they are found by the token
        # they carry, as the teardown finds them.
        def job_processes() -> Set[int]:  # the tree, and what carries the run's token
            return find_job_processes(config.run_id, self.token, self.pid)

        elsewhere = job_processes if config.container is not None or "PYTHON_EXEC" in config.env else None
        # The ranks' own files (torchrun --redirects) and GPU samples; progress bars and
        # GPUs only feed a live view, so a detached run's log is spared them (and a background
        # controller has no view).
        self.ranks = (RankFiles(config.rank_logs, self.pid, not (self.detached or self.persist), config.rank_base,
                                elsewhere) if config.rank_logs else None)
        self.gpus = GpuSampler(0.0 if self.detached else config.gpu_every)
        self.busy = BusySampler(self.pid, 0.0 if self.detached else config.busy_every, elsewhere)
        workdir = os.path.expanduser(config.cwd) if config.cwd else os.getcwd()
        self.saves = (CheckpointWatch(workdir, config.checkpoint, job_processes)
                      if config.checkpoint and not self.detached else None)
        """The job's new checkpoints, for the controller's replication (a live one only)."""
        # The job's CPU counts the ranks wherever the busy sampler finds them (a warm or a
        # container's rank outside this tree too), each once.
        self.pace = (PaceWriter(pace_path(config.run_id, config.node or "node"),
                                lambda: sorted(set(tree_of(self.pid)) | (elsewhere() if elsewhere is not None else set())),
                                lambda path: make_private_dirs(path, config.run_id), wire.write_json_atomic)
                     if self.saves is not None else None)
        """The job's lines and CPU seconds, which a replication's source keeps its rate to."""

    def _handle_signals(self, now: float) -> None:
        for signum in self.signals.take():
            if signum == signal.SIGCHLD:
                self.child_exited = True
            elif signum == signal.SIGHUP and self.persist:
                continue  # the controller's session ended: the job runs on
            else:
                self.request_teardown("signal " + signal.Signals(signum).name, False, now, escalate=True)

    # job ------------------------------------------------------------------
    def _spawn(self) -> bool:
        if self.cfg.cleanup_dir:
            made, refused = make_private_dir(self.cfg.cleanup_dir)
            if made is None:
                self.code = 1
                self._announce(wire.error_record("cannot start job: torchrun's log directory " + str(refused)))
                return False
            self._log_dir_is(made)
            self.made_dir = True
            if self.cfg.env.get(flight.ENABLE_ENV) == "1":
                try:
                    added = flight.install(made, self.cfg.env)
                except OSError:
                    added = {}  # the run goes on; the hang watch reads the stacks without it
                self.cfg = self.cfg._replace(env=dict(self.cfg.env, **added))
        spec = self.cfg.container
        if spec is not None:
            self.runtime = container.resolve_runtime(spec.runtime)
            if self.runtime is None:
                self.code = EXIT_NOT_FOUND
                wanted = "any of " + ", ".join(container.RUNTIMES) if spec.runtime == "auto" else spec.runtime
                self._announce(wire.error_record("cannot start job: no container runtime: %s is not installed "
                                                 "on this node (not on PATH)" % wanted))
                return False
            self.state.contained(self.runtime, spec.name)
            if not container.RUNTIME[self.runtime].replaces and self.cfg.env.get(wire.ATTEMPT_ENV, "1") != "1":
                # a later attempt: a container of this run's own name may be left by an
                # earlier one on this node, its supervisor dead with the node (podman: --replace;
                # a runtime that keeps no container by name has none to remove)
                self._remove_container()
        try:
            self.proc = proc = start_job(self.cfg, self.token, self.runtime)
        except OSError as exc:
            self.code = EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) else EXIT_NOT_EXECUTABLE
            self._announce(wire.error_record("cannot start job: %s" % exc))
            return False
        try:
            pgid = os.getpgid(proc.pid)
        except OSError:
            pgid = proc.pid
        self.state.started(proc.pid, pgid)
        self._announce(wire.started_record(proc.pid, pgid, self.pid))
        assert proc.stdout is not None and proc.stderr is not None
        marker = self.cfg.rank_marker
        for stream, tag in ((proc.stdout, wire.TAG_STDOUT), (proc.stderr, wire.TAG_STDERR)):
            self.pipes.add(stream, LineFramer(tag, mender=RankMender(marker.encode()) if marker else None))
        return True

    def _log_dir_is(self, made: str) -> None:
        """torchrun's ``--log-dir``, the ranks' files and the teardown's removal: the fresh
        directory ``made`` instead of the configured name."""
        named = self.cfg.cleanup_dir
        self.cfg = self.cfg._replace(argv=tuple(made if word == named else word for word in self.cfg.argv),
                                     cleanup_dir=made,
                                     rank_logs=made if self.cfg.rank_logs == named else self.cfg.rank_logs)
        if self.ranks is not None and self.cfg.rank_logs == made:
            self.ranks.log_dir = made

    def _announce(self, record: bytes) -> None:
        """The first status record: to the output, the state file, and (detached)
        to the parent that waits for it to say the job is running."""
        self.out.add(record)
        self.state.write()
        if self.notify_fd is not None:
            try:
                os.write(self.notify_fd, record)
            except OSError:
                pass
            os.close(self.notify_fd)
            self.notify_fd = None

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            except InterruptedError:
                continue
            if pid == 0:
                return
            if self.proc is not None and pid == self.proc.pid:
                self.code = self.proc.returncode = exit_code_from_status(status)
                self._took(self.pipes.read_ready(OUT_HIGH_WATER))  # its last lines go out before "exit"
                if self.ranks is not None:
                    self.out.add(self.ranks.drain())
                stopped = self._stopped_by()
                self.out.add(wire.exit_record(self.code, stopped))
                self.state.stopped = stopped
                if self.link is not None:
                    self.link.send(wire.exit_line(self.cfg.node, self.code))

    # teardown ---------------------------------------------------------------
    def _stopped_by(self) -> Optional[str]:
        """The teardown's reason when it had signalled the job before the job ended: the
        job was stopped, whichever exit code it chose on the way out."""
        td = self.teardown
        if td is None or not (td.signalled or td.killed):
            return None
        return td.reason

    def request_teardown(self, reason: str, kill_now: bool, now: float, escalate: bool = False,
                         announce: bool = True) -> None:
        td = self.teardown
        if td is not None:
            if (kill_now or escalate) and not td.complete:
                td.escalate(now)
            return
        self.teardown = Teardown(reason, kill_now, now, self.cfg.grace)
        if announce:
            self.out.add(wire.stopping_record(reason, wire.MODE_KILL if kill_now else wire.MODE_TERM))

    def _step_teardown(self, now: float) -> None:
        td = self.teardown
        if td is None or not td.due(now):
            return
        self._reap()
        pids = find_job_processes(self.cfg.run_id, self.token, self.pid)
        if not pids:
            self._reap()
        if td.step(now, pids):
            self.last_data = time.monotonic()
            self.out.add(td.record())

    # io -------------------------------------------------------------------
    def _took(self, read: Optional[Tuple[bytes, int]]) -> None:
        """Records read from the job's pipes go out; ``got`` counts what the job wrote."""
        if read is not None:
            self.last_data = time.monotonic()
            self.got += read[1]
            self.out.add(read[0])
            if self.pace is not None:
                self.pace.count(read[0])

    def _read_ranks(self, now: float) -> None:
        """What the ranks wrote to their files since the last look, as far as the output
        buffer takes it (the rest waits in the files: a rank never blocks on it)."""
        budget = OUT_HIGH_WATER - self.out.size
        if self.ranks is not None and budget > 0:
            data = self.ranks.poll(now, budget)
            self.got += len(data)
            self.out.add(data)
            if self.pace is not None:
                self.pace.count(data)
        if self.teardown is None:
            self.out.add_sample(self.gpus.poll(now))
            self.out.add_sample(self.busy.poll(now))

    def _read_stdin(self, now: float) -> None:
        try:
            data = os.read(0, READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.stdin_open = False
            self.sel.unregister(0)
            if not self.persist:  # persist: the controller is gone, the job runs on
                self.request_teardown("stdin closed", False, now)
            return
        self._stdin_data(data, now)

    def _stdin_data(self, data: bytes, now: float) -> None:
        self.last_in = now
        lines = (self.stdin_partial + data).split(b"\n")
        self.stdin_partial = lines.pop()[-64:]
        for line in lines:
            level = wire.parse_control(line)
            if level is not None:
                self.request_teardown("control " + str(level.value), level is wire.StopLevel.KILL, now)

    def _update_registrations(self) -> None:
        if self.out.size > OUT_HIGH_WATER:
            self.pipes.pause()
        elif self.pipes.paused and self.out.size < OUT_LOW_WATER:
            self.pipes.resume()
            self.last_data = time.monotonic()
        want_write = self.out.size > 0 and not self.out.closed
        if want_write != self.writing:
            self.writing = want_write
            if want_write:
                self.sel.register(1, selectors.EVENT_WRITE, "out")
            else:
                self.sel.unregister(1)

    def _finished(self, now: float) -> bool:
        td = self.teardown
        if td is None or not td.complete:
            return False
        if self.code is None and not td.gave_up:
            return False
        return not (self.pipes.framers and (self.pipes.paused or now - self.last_data < DRAIN_IDLE_TIMEOUT))

    def _timeout(self, now: float) -> float:
        deadlines: List[float] = []
        if self.cfg.heartbeat > 0:
            deadlines.append(self.next_heartbeat)
        td = self.teardown
        if td is None:
            # persist: the watchdog matters only to a held stop (a silent controller is
            # no reason to wake up otherwise)
            if self.stdin_open and self.cfg.watchdog > 0 and (not self.persist or self.held_stop is not None):
                deadlines.append(self.last_in + self.cfg.watchdog)
        elif not td.complete:
            deadlines.append(td.next_poll)
        elif self.pipes.framers:
            deadlines.append(self.last_data + DRAIN_IDLE_TIMEOUT)
        if self.ranks is not None:
            deadlines.append(now + RANK_POLL)  # files have no readiness to wait on
        if self.saves is not None and td is None:
            deadlines.append(self.saves.due)
        if not deadlines:
            return 1.0
        return min(1.0, max(0.0, min(deadlines) - now))

    def _timers(self, now: float) -> None:
        if self.cfg.heartbeat > 0 and now >= self.next_heartbeat:
            self.out.add(wire.HEARTBEAT_RECORD)
            self.next_heartbeat = now + self.cfg.heartbeat
        watchdog = self.cfg.watchdog
        if (self.teardown is None and self.stdin_open and watchdog > 0 and now - self.last_in >= watchdog
                and not self.persist):
            self.request_teardown("watchdog: no word from the controller for %gs" % watchdog, False, now)
        if self.teardown is None and self.held_stop is not None and self._controller_gone(now):
            self.request_teardown("coordinator: %s (the controller is gone)" % self.held_stop, False, now)
        if self.teardown is None and self.code is not None:
            self.request_teardown(LEFTOVER, False, now, announce=False)
        if self.saves is not None and self.teardown is None:
            saved = self.saves.poll(now)
            if saved is not None:
                self.out.add(wire.checkpoint_record(*saved))
        if self.pace is not None and self.teardown is None:
            self.pace.poll(now)
        self._link_connect(now)

    def _controller_gone(self, now: float) -> bool:
        """Persist mode: its channel ended, or it has been silent for the watchdog's time
        (its machine went away, or sleeps: no channel ends then)."""
        watchdog = self.cfg.watchdog
        return (not self.stdin_open or self.out.closed
                or (watchdog > 0 and now - self.last_in >= watchdog))

    def _link_connect(self, now: float) -> None:
        link = self.link
        if link is None or (self.code is not None and link.sock is None and link.tries):
            return  # no coordinator; or the job is over and it was out of reach: nobody to tell
        if link.connect_in(self.sel, now) and self.code is not None:
            link.send(wire.exit_line(self.cfg.node, self.code))

    # main -----------------------------------------------------------------
    def run(self) -> int:
        set_child_subreaper()
        self.signals.install(self.sel)
        self._register_stdin()
        if not self._spawn():
            code = self.code if self.code is not None else EXIT_NOT_EXECUTABLE
            self._remove_container()
            if self.cfg.cleanup_dir and self.made_dir:
                remove_tee_dir(self.cfg.cleanup_dir)
            self.state.exited(code, 0)
            self.out.add(wire.done_record(code, 0))
            self._final_flush()
            return code
        if self.stdin_pending:
            # control lines that came right behind the config line on stdin
            self._stdin_data(self.stdin_pending, time.monotonic())
        while not self._iterate():
            pass
        return self._finish()

    def _register_stdin(self) -> None:
        try:
            if self.detached:
                # stdin is /dev/null: its EOF means nothing, and nobody sends heartbeats
                self.stdin_open = False
            else:
                self.sel.register(0, selectors.EVENT_READ, "stdin")
        except (OSError, ValueError):
            self.stdin_open = False

    def _iterate(self) -> bool:
        """One turn of the loop: read, react, write; True once the run is over."""
        now = time.monotonic()
        if self.out.closed and self.teardown is None and not self.persist:
            self.request_teardown("output closed", False, now)
        for key, _mask in self.sel.select(self._timeout(now)):
            self._dispatch(key, time.monotonic())
        now = time.monotonic()
        self._handle_signals(now)
        self._read_ranks(now)
        if self.child_exited:
            self.child_exited = False
            self._reap()
        self._timers(now)
        self._step_teardown(now)
        self.out.flush()
        if self._finished(time.monotonic()):
            return True
        self._update_registrations()
        if 0 < self.got < COALESCE_BELOW and self.teardown is None:
            # output trickles in line by line: let it pile up a moment,
            # so that one read and one write carry many lines
            time.sleep(COALESCE_DELAY)
        self.got = 0
        return False

    def _dispatch(self, key: selectors.SelectorKey, now: float) -> None:
        if key.data == "pipe":
            if key.fd in self.pipes.framers:
                self._took(self.pipes.read(key.fd))
        elif key.data == "stdin":
            self._read_stdin(now)
        elif key.data == "coord" and self.link is not None:
            for reason in self.link.stop_reasons(self.sel):
                if self.persist:
                    self.held_stop = self.held_stop or reason  # obeyed in _timers once the controller is gone
                else:
                    self.request_teardown("coordinator: " + reason, False, now)
        elif key.data == "wake":
            self.signals.woken()

    def _finish(self) -> int:
        """Flushes the last output, reports ``done`` and returns the exit code."""
        if self.ranks is not None:
            self.out.add(self.ranks.finish())
        self.gpus.stop()
        self.out.add(self.pipes.finish())
        td = self.teardown
        code = self.code if self.code is not None else EXIT_UNKILLABLE
        left = td.left if td is not None else 0
        if self.link is not None:
            self.link.close_in(self.sel)
        self._remove_container()
        if self.pace is not None:
            self.pace.remove()
        if self.cfg.cleanup_dir and self.made_dir:  # never one this supervisor did not make
            remove_tee_dir(self.cfg.cleanup_dir)
        self.out.add(wire.done_record(code, left))
        self._final_flush()
        self.state.exited(code, left)
        return code

    def _remove_container(self) -> None:
        """Removes the job's container by its run-scoped name, whatever ended the job: its
        processes are gone by now (the teardown found them by their token), but the
        runtime keeps the container itself (a killed client never ran ``--rm``)."""
        spec, runtime = self.cfg.container, self.runtime
        if spec is None or runtime is None:
            return
        argv = container.remove_argv(runtime, spec.name)
        if argv is None:
            return
        try:
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=CONTAINER_RM_TIMEOUT, check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            note = "torchherd: could not remove container %s: %s" % (spec.name, exc)
            self.out.add(wire.TAG_STDERR + note.encode("utf-8", "replace") + b"\n")

    def _final_flush(self) -> None:
        if self.writing:
            self.sel.unregister(1)
            self.writing = False
        self.out.flush_all(FINAL_FLUSH_STALL)


def detach(config: wire.SupervisorConfig) -> int:
    """Forks the supervisor into its own session, writing its records to the log
    file; returns once the job has started (or failed to), so that the SSH
    command ends while the job runs on."""
    log = os.path.expanduser(config.log_file or "")
    if os.path.dirname(log):
        make_private_dirs(os.path.dirname(log), config.run_id)
    ready_r, ready_w = os.pipe()
    if os.fork() > 0:
        os.close(ready_w)
        first = b""
        while True:
            chunk = os.read(ready_r, READ_SIZE)
            if not chunk:
                break
            first += chunk
        if not first:
            first = wire.error_record("the detached supervisor died at start")
        os.write(1, first)
        return 0 if first.startswith(wire.status_head(wire.EVENT_STARTED)) else 1
    os.close(ready_r)
    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(null)
        os.close(out)
        code = Supervisor(config, notify_fd=ready_w).run()
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def read_config_line() -> Tuple[str, bytes]:
    """The config as the first line of stdin, and whatever followed it. The config holds
    the job's environment: on the command line every user of the node could read it."""
    data = b""
    while b"\n" not in data:
        chunk = os.read(0, READ_SIZE)
        if not chunk:
            break
        data += chunk
    line, _, rest = data.partition(b"\n")
    return line.decode("utf-8", "replace"), rest


def main(args: List[str]) -> int:
    # "- RUN_ID": the config comes on stdin; the run id stays on the command line only
    # so that ``status``/``stop`` can tell this run's supervisor from a reused pid.
    if not (len(args) == 1 or (len(args) == 2 and args[0] == "-")):
        sys.stderr.write("usage: supervisor.py JSON_CONFIG | - [RUN_ID]  (- reads the config from stdin)\n")
        return EXIT_BAD_CONFIG
    text, pending = read_config_line() if args[0] == "-" else (args[0], b"")
    try:
        config = wire.SupervisorConfig.from_json(text)
    except wire.ConfigError as exc:
        record = wire.error_record(str(exc)) + wire.done_record(EXIT_BAD_CONFIG, 0)
        os.write(1, record)
        return EXIT_BAD_CONFIG
    if config.log_file and not config.persist:
        return detach(config)
    flags = None
    try:
        flags = os.get_blocking(1)
        os.set_blocking(1, False)
    except OSError:
        pass
    try:
        supervisor = Supervisor(config)
        supervisor.stdin_pending = pending
        return supervisor.run()
    finally:
        if flags is not None:
            try:
                os.set_blocking(1, flags)
            except OSError:
                pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
