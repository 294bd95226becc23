"""torchherd node supervisor: runs one job on a node and leaves nothing behind.

Standard library only, Python >= 3.8, Linux. The controller runs it over SSH
(no PTY) as ``PYTHON -u -c "<this source>" '<json config>'``; stdin and stdout
are the SSH channel.

Config (argv[1], JSON object):
  run_id     str             also exported to the job as TORCHHERD_RUN_ID
  argv       [str, ...]      the job command (not through a shell)
  env        {str: str}      added to os.environ for the job (optional)
  cwd        str or null     working directory for the job; "~" is expanded
  grace      float seconds   SIGTERM -> SIGKILL delay on a graceful teardown
  heartbeat  float seconds   period of H records on stdout (0 = none)
  watchdog   float seconds   teardown when no stdin byte arrives for this
                             long (0 = off)
  cleanup_dir  str or null   torchrun's per-rank tee directory; removed when
                             the job is over (only a "torchherd-*" name)
Detached mode (optional keys; with log_file set the supervisor detaches):
  log_file   str             records go here (appended) instead of stdout; the
                             supervisor forks into its own session, stdin from
                             /dev/null (no EOF teardown, no watchdog), and the
                             parent prints the child's first status record
                             ("started" or "error") and exits
  state_file str or null     JSON written at start and at the end:
                             {"run_id", "node", "supervisor", "pid", "pgid",
                              "started", "state": "running" | "exited",
                              "code", "ended", "left"}
  node       str             this node's name, for the coordinator
  coordinator {"host", "port", "token"} or null: a TCP coordinator (see
                             coordinator.py) for fail fast while detached;
                             the supervisor says "HELLO token node", then
                             "EXIT node code" when the job ends, and tears
                             its job down on a "STOP reason" line

Stdout, one record per line, TAG + payload + b"\\n", bytes as the job wrote
them (only the line's trailing newline is removed):
  O  a line of the job's stdout      E  a line of the job's stderr
  H  heartbeat (empty payload)       S  a JSON status event:
     {"event": "started", "pid": P, "pgid": G, "supervisor": SUPERVISOR_PID}
     {"event": "error", "message": M}          the job could not be started
     {"event": "stopping", "reason": R, "mode": "term" | "kill"}
     {"event": "exit", "code": C}              the job's main process ended
     {"event": "teardown", "reason": R, "signalled": [...], "killed": [...]}
     {"event": "done", "code": C, "left": N}   always the last record
A line longer than MAX_LINE bytes is cut into several records.

Stdin, lines: every byte counts as a heartbeat from the controller; a line
"TERM" asks for a graceful teardown, "KILL" for an immediate SIGKILL
teardown. EOF on stdin, EOF/EPIPE on stdout, SIGTERM/SIGINT/SIGHUP to the
supervisor and the watchdog all start a graceful teardown; a second request
while a graceful teardown runs escalates it to SIGKILL.

Job processes: every live descendant of the supervisor (it is a child
subreaper, so orphans stay in its tree) plus every process whose initial
environment holds TORCHHERD_RUN_ID=<run_id>, except those that carry another
supervisor's TORCHHERD_SUPERVISOR token (they belong to a sibling supervisor
of the same run on the same process table), the supervisor and its ancestors.
When the job's main process exits by itself, leftovers are swept the same way.

Exit status (= "code" in done): the job's exit status, 128+N when it died on
signal N (143 after a SIGTERM teardown, 137 after SIGKILL), 137 when it could
not be reaped after SIGKILL, 127/126 when the command was not found / not
executable, 2 for an invalid config.
"""

from __future__ import annotations

import json
import os
import re
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional, Set, Tuple

TAG_STDOUT = b"O"
TAG_STDERR = b"E"
TAG_HEARTBEAT = b"H"
TAG_STATUS = b"S"

CTRL_TERM = "TERM"
CTRL_KILL = "KILL"

RUN_ID_ENV = "TORCHHERD_RUN_ID"
SUPERVISOR_ENV = "TORCHHERD_SUPERVISOR"

EVENT_STARTED = "started"
EVENT_ERROR = "error"
EVENT_STOPPING = "stopping"
EVENT_EXIT = "exit"
EVENT_TEARDOWN = "teardown"
EVENT_DONE = "done"

EXIT_BAD_CONFIG = 2
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
EXIT_UNKILLABLE = 128 + 9

READ_SIZE = 65536
MAX_LINE = 1 << 20
OUT_HIGH_WATER = 8 << 20
OUT_LOW_WATER = 2 << 20
POLL_INTERVAL = 0.05
COALESCE_BELOW = 16384
COALESCE_DELAY = 0.002
KILL_TIMEOUT = 5.0
DRAIN_IDLE_TIMEOUT = 2.0
FINAL_FLUSH_STALL = 10.0
PR_SET_CHILD_SUBREAPER = 36
LEFTOVER = "leftover"
TEE_DIR_PREFIX = "torchherd-"
COORD_CONNECT_TIMEOUT = 1.0
COORD_RETRY = 2.0
COORD_TRIES = 15


class ConfigError(ValueError):
    """The JSON config is malformed."""


class Config:
    def __init__(
        self,
        run_id: str,
        argv: List[str],
        env: Dict[str, str],
        cwd: Optional[str],
        grace: float,
        heartbeat: float,
        watchdog: float,
        cleanup_dir: Optional[str] = None,
        log_file: Optional[str] = None,
        state_file: Optional[str] = None,
        node: str = "",
        coordinator: Optional[Tuple[str, int, str]] = None,
        rank_marker: Optional[str] = None,
    ) -> None:
        self.run_id = run_id
        self.argv = argv
        self.env = env
        self.cwd = cwd
        self.grace = grace
        self.heartbeat = heartbeat
        self.watchdog = watchdog
        self.cleanup_dir = cleanup_dir
        self.log_file = log_file
        self.state_file = state_file
        self.node = node
        self.coordinator = coordinator
        self.rank_marker = rank_marker


def _number(raw: Dict[str, object], key: str, default: float) -> float:
    value = raw.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError("config key %r must be a number" % key)
    if value < 0:
        raise ConfigError("config key %r must be >= 0" % key)
    return float(value)


def _optional_str(raw: Dict[str, object], key: str) -> Optional[str]:
    value = raw.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError("config key %r must be a non-empty string or null" % key)
    return value


def _coordinator(raw: Dict[str, object]) -> Optional[Tuple[str, int, str]]:
    value = raw.get("coordinator")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError("config key 'coordinator' must be an object or null")
    host, port, token = value.get("host"), value.get("port"), value.get("token")
    if not isinstance(host, str) or not isinstance(port, int) or not isinstance(token, str):
        raise ConfigError("config key 'coordinator' needs host (str), port (int), token (str)")
    return host, port, token


def parse_config(text: str) -> Config:
    """Parse and validate the JSON config given as argv[1]."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ConfigError("config is not valid JSON: %s" % exc) from None
    if not isinstance(raw, dict):
        raise ConfigError("config must be a JSON object")
    run_id = raw.get("run_id")
    if not isinstance(run_id, str) or not run_id or "\0" in run_id:
        raise ConfigError("config key 'run_id' must be a non-empty string")
    argv = raw.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ConfigError("config key 'argv' must be a non-empty list of strings")
    env = raw.get("env") or {}
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise ConfigError("config key 'env' must map strings to strings")
    cwd = raw.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise ConfigError("config key 'cwd' must be a string or null")
    return Config(
        run_id=run_id,
        argv=[str(a) for a in argv],
        env={str(k): str(v) for k, v in env.items()},
        cwd=cwd,
        grace=_number(raw, "grace", 10.0),
        heartbeat=_number(raw, "heartbeat", 5.0),
        watchdog=_number(raw, "watchdog", 0.0),
        cleanup_dir=_optional_str(raw, "cleanup_dir"),
        log_file=_optional_str(raw, "log_file"),
        state_file=_optional_str(raw, "state_file"),
        node=_optional_str(raw, "node") or "",
        coordinator=_coordinator(raw),
        rank_marker=_optional_str(raw, "rank_marker"),
    )


def status_record(event: str, **fields: object) -> bytes:
    """One S record: TAG_STATUS + compact JSON + newline."""
    body: Dict[str, object] = {"event": event}
    body.update(fields)
    return TAG_STATUS + json.dumps(body, separators=(",", ":")).encode() + b"\n"


def exit_code_from_status(status: int) -> int:
    """A wait() status as a shell would report it: code, or 128+signal."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    return 1


class RankMender:
    """Mends lines that torchrun's --tee tore apart.

    torchrun copies each rank's output with one thread per rank, each reading its
    rank's file line by line; a line the rank had not finished writing comes out
    without its newline, and the next rank's line is glued to it:
    ``[M 7] rank 7 li[M 6] a whole line`` ... ``[M 7] ne 12`` (M the rank marker).
    A segment that ends at another marker instead of a newline is such a partial
    line: it is held back and joined to the same rank's next segment."""

    def __init__(self, marker: bytes) -> None:
        self.marker = marker
        self.prefix = re.compile(re.escape(marker) + rb"(\d+)\] ")
        self.pending: Dict[bytes, bytes] = {}

    def mend(self, lines: bytes) -> bytes:
        """``lines``: complete lines, each ending in a newline; returns them mended."""
        starts = lines.count(b"\n" + self.marker) + (1 if lines.startswith(self.marker) else 0)
        if not self.pending and lines.count(self.marker) == starts:
            return lines  # nothing torn: the common case costs two counts
        out: List[bytes] = []
        for line in lines[:-1].split(b"\n"):
            prefixes = list(self.prefix.finditer(line))
            if not prefixes or prefixes[0].start() > 0:
                out.append(line[: prefixes[0].start()] if prefixes else line)  # torchrun's own text
            for index, prefix in enumerate(prefixes):
                last = index == len(prefixes) - 1
                rank, body = prefix.group(1), line[prefix.end(): None if last else prefixes[index + 1].start()]
                if last:
                    out.append(self.marker + rank + b"] " + self.pending.pop(rank, b"") + body)
                else:
                    self._hold(rank, body)
        return b"".join(line + b"\n" for line in out)

    def _hold(self, rank: bytes, body: bytes) -> None:
        self.pending[rank] = self.pending.get(rank, b"") + body

    def finish(self) -> bytes:
        """What was still held back when the stream ended, as lines of their own."""
        held = [self.marker + rank + b"] " + body for rank, body in self.pending.items()]
        self.pending = {}
        return b"".join(line + b"\n" for line in held)


class LineFramer:
    """Cuts a byte stream into TAG-prefixed records, one per line."""

    def __init__(self, tag: bytes, max_line: int = MAX_LINE, mender: Optional[RankMender] = None) -> None:
        self.tag = tag
        self.max_line = max_line
        self.partial = b""
        self.mender = mender

    def feed(self, data: bytes) -> bytes:
        if not data:
            return b""
        if self.partial:
            data = self.partial + data
        end = data.rfind(b"\n") + 1
        self.partial = data[end:]
        out = b""
        complete = data[:end]
        if complete and self.mender is not None:
            complete = self.mender.mend(complete)
        if complete:
            # one replace over the chunk, not a bytes object per line: the node's
            # cores are the job's too
            out = self.tag + complete[:-1].replace(b"\n", b"\n" + self.tag) + b"\n"
        if len(self.partial) >= self.max_line:
            out += self.tag + self.partial + b"\n"
            self.partial = b""
        return out

    def finish(self) -> bytes:
        """Flush a final line that had no newline, and any torn line still held back."""
        rest = self.partial + b"\n" if self.partial else b""
        self.partial = b""
        if rest and self.mender is not None:
            rest = self.mender.mend(rest)
        if self.mender is not None:
            rest += self.mender.finish()
        if not rest:
            return b""
        return self.tag + rest[:-1].replace(b"\n", b"\n" + self.tag) + b"\n"


# ---------------------------------------------------------------- processes

ProcTable = Dict[int, Tuple[int, str]]


def read_proc_table(proc: str = "/proc") -> ProcTable:
    """pid -> (ppid, state letter) for every process visible in /proc."""
    table: ProcTable = {}
    try:
        names = os.listdir(proc)
    except OSError:
        return table
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(proc + "/" + name + "/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        end = data.rfind(b")")
        fields = data[end + 2 :].split()
        if len(fields) < 2:
            continue
        try:
            table[int(name)] = (int(fields[1]), fields[0].decode("ascii", "replace"))
        except ValueError:
            continue
    return table


def descendants(table: ProcTable, root: int) -> Set[int]:
    children: Dict[int, List[int]] = {}
    for pid, (ppid, _state) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: Set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found and child != root:
                found.add(child)
                stack.append(child)
    return found


def ancestors(table: ProcTable, pid: int) -> Set[int]:
    found: Set[int] = set()
    while pid in table and pid not in found:
        found.add(pid)
        pid = table[pid][0]
    return found


def environ_belongs(pid: int, run_id: str, token: Optional[str], proc: str = "/proc") -> bool:
    """True when the process's environment marks it as part of this run.

    A process that carries another supervisor's token belongs to that
    supervisor (a sibling node of the same run sharing this process table).
    """
    try:
        with open(proc + "/" + str(pid) + "/environ", "rb") as f:
            data = f.read()
    except OSError:
        return False
    run_entry = (RUN_ID_ENV + "=" + run_id).encode()
    if run_entry not in data:
        return False
    entries = data.split(b"\0")
    if run_entry not in entries:
        return False
    if token is not None:
        prefix = (SUPERVISOR_ENV + "=").encode()
        mine = prefix + token.encode()
        for entry in entries:
            if entry.startswith(prefix) and entry != mine:
                return False
    return True


def find_job_processes(
    run_id: str, token: Optional[str], root: int, proc: str = "/proc"
) -> Set[int]:
    """Live processes of this run: descendants of root, plus environ matches."""
    table = read_proc_table(proc)
    live = {pid for pid, (_pp, state) in table.items() if state not in ("Z", "X", "x")}
    found = descendants(table, root) & live
    exclude = ancestors(table, root) | {root}
    for pid in live:
        if pid in found or pid in exclude:
            continue
        if environ_belongs(pid, run_id, token, proc):
            found.add(pid)
    return found


def send_signal(pids: Set[int], sig: int) -> Set[int]:
    sent: Set[int] = set()
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            continue
        sent.add(pid)
    return sent


def set_child_subreaper() -> bool:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except Exception:
        return False


# ------------------------------------------------------------------- output


class Output:
    """Non-blocking writer for fd 1, so a stalled channel never stops the loop."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.chunks: List[bytes] = []
        self.current = b""
        self.offset = 0
        self.size = 0
        self.closed = False

    def add(self, data: bytes) -> None:
        if data and not self.closed:
            self.chunks.append(data)
            self.size += len(data)

    def flush(self) -> bool:
        """Write what the fd takes now; True when something was written."""
        wrote = False
        while not self.closed and self.size:
            if self.offset >= len(self.current):
                self.current = b"".join(self.chunks)
                self.chunks = []
                self.offset = 0
            try:
                n = os.write(self.fd, memoryview(self.current)[self.offset :])
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.close()
                break
            wrote = wrote or n > 0
            self.offset += n
            self.size -= n
        return wrote

    def close(self) -> None:
        self.closed = True
        self.chunks = []
        self.current = b""
        self.offset = 0
        self.size = 0


def write_json_atomic(path: str, fields: Dict[str, object]) -> None:
    """Readers (torchherd status over SSH) never see a half-written file."""
    path = os.path.expanduser(path)
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "w") as f:
        json.dump(fields, f, separators=(",", ":"))
    os.replace(tmp, path)


def remove_tee_dir(path: str) -> None:
    """Removes torchrun's per-rank tee directory; any other name is refused, so a
    bad config can never delete something that is not the run's own."""
    path = os.path.expanduser(path).rstrip("/")
    if os.path.basename(path).startswith(TEE_DIR_PREFIX):
        shutil.rmtree(path, ignore_errors=True)


class CoordinatorLink:
    """The supervisor's TCP line to the run's coordinator on the master node."""

    def __init__(self, host: str, port: int, token: str, node: str) -> None:
        self.address = (host, port)
        self.hello = ("HELLO %s %s\n" % (token, node)).encode()
        self.node = node
        self.sock: Optional[socket.socket] = None
        self.next_try = 0.0
        self.tries = 0
        self.gone = False
        self.partial = b""

    def connect(self, now: float) -> Optional[socket.socket]:
        """One try when it is due; the connected socket, else None."""
        if self.sock is not None or self.gone or now < self.next_try:
            return None
        self.tries += 1
        self.next_try = now + COORD_RETRY
        try:
            sock = socket.create_connection(self.address, timeout=COORD_CONNECT_TIMEOUT)
            sock.sendall(self.hello)
        except OSError:
            self.gone = self.tries >= COORD_TRIES
            return None
        sock.setblocking(False)
        self.sock = sock
        return sock

    def send(self, line: str) -> None:
        if self.sock is None:
            return
        try:
            self.sock.sendall((line + "\n").encode())
        except OSError:
            pass

    def read(self) -> List[str]:
        """Complete lines received; [] and closed when the coordinator went away."""
        if self.sock is None:
            return []
        try:
            data = self.sock.recv(READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if not data:
            self.close()
            return []
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()[-4096:]
        return [line.decode("utf-8", "replace").strip() for line in lines]

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock = None
        self.gone = True


# -------------------------------------------------------------- supervisor


class Teardown:
    def __init__(self, reason: str, kill_now: bool, now: float, grace: float) -> None:
        self.reason = reason
        self.kill_phase = kill_now
        self.term_deadline = now + grace
        self.kill_deadline = now + KILL_TIMEOUT
        self.next_poll = now
        self.signalled: Set[int] = set()
        self.killed: Set[int] = set()
        self.complete = False
        self.gave_up = False
        self.left = 0

    def escalate(self, now: float) -> None:
        if not self.kill_phase and not self.complete:
            self.kill_phase = True
            self.kill_deadline = now + KILL_TIMEOUT
            self.next_poll = now


class Supervisor:
    def __init__(self, config: Config, notify_fd: Optional[int] = None) -> None:
        self.cfg = config
        self.notify_fd = notify_fd
        self.detached = config.log_file is not None
        self.link: Optional[CoordinatorLink] = None
        if config.coordinator is not None:
            host, port, token = config.coordinator
            self.link = CoordinatorLink(host, port, token, config.node)
        self.token = os.urandom(8).hex()
        self.pid = os.getpid()
        self.out = Output(1)
        self.sel = selectors.PollSelector()
        self.proc: Optional["subprocess.Popen[bytes]"] = None
        self.code: Optional[int] = None
        self.teardown: Optional[Teardown] = None
        self.signals: List[int] = []
        self.child_exited = True
        self.got = 0
        self.stdin_open = True
        self.stdin_partial = b""
        self.stdin_pending = b""
        self.last_in = time.monotonic()
        self.next_heartbeat = self.last_in + config.heartbeat
        self.pipes: Dict[int, LineFramer] = {}
        self.paused = False
        self.last_data = self.last_in
        self.writing = False
        self.wake_r, self.wake_w = os.pipe()
        self.state: Dict[str, object] = {
            "run_id": config.run_id, "node": config.node, "supervisor": self.pid,
            "started": time.time(), "state": "running",
        }

    # signals ------------------------------------------------------------
    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signals.append(signum)

    def _install_signals(self) -> None:
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, self._on_signal)
        self.sel.register(self.wake_r, selectors.EVENT_READ, "wake")

    def _handle_signals(self, now: float) -> None:
        pending, self.signals = self.signals, []
        for signum in pending:
            if signum == signal.SIGCHLD:
                self.child_exited = True
                continue
            name = signal.Signals(signum).name
            self.request_teardown("signal " + name, False, now, escalate=True)

    # job ------------------------------------------------------------------
    def _spawn(self) -> bool:
        cfg = self.cfg
        env = dict(os.environ)
        env.update(cfg.env)
        env[RUN_ID_ENV] = cfg.run_id
        env[SUPERVISOR_ENV] = self.token
        cwd = os.path.expanduser(cfg.cwd) if cfg.cwd else None
        try:
            self.proc = subprocess.Popen(
                cfg.argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                env=env,
                cwd=cwd,
            )
        except OSError as exc:
            self.code = (
                EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) else EXIT_NOT_EXECUTABLE
            )
            self._announce(status_record(EVENT_ERROR, message="cannot start job: %s" % exc))
            return False
        try:
            pgid = os.getpgid(self.proc.pid)
        except OSError:
            pgid = self.proc.pid
        self.state.update(pid=self.proc.pid, pgid=pgid)
        self._announce(
            status_record(EVENT_STARTED, pid=self.proc.pid, pgid=pgid, supervisor=self.pid)
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        for stream, tag in ((self.proc.stdout, TAG_STDOUT), (self.proc.stderr, TAG_STDERR)):
            fd = stream.fileno()
            marker = self.cfg.rank_marker
            self.pipes[fd] = LineFramer(tag, mender=RankMender(marker.encode()) if marker else None)
            self.sel.register(fd, selectors.EVENT_READ, "pipe")
        return True

    def _announce(self, record: bytes) -> None:
        """The first status record: to the output, the state file, and (detached)
        to the parent that waits for it to say the job is running."""
        self.out.add(record)
        self._write_state()
        if self.notify_fd is not None:
            try:
                os.write(self.notify_fd, record)
            except OSError:
                pass
            os.close(self.notify_fd)
            self.notify_fd = None

    def _write_state(self, **fields: object) -> None:
        self.state.update(fields)
        if self.cfg.state_file:
            try:
                write_json_atomic(self.cfg.state_file, self.state)
            except OSError:
                pass

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
                self.code = exit_code_from_status(status)
                self.proc.returncode = self.code
                self._drain_ready()
                self.out.add(status_record(EVENT_EXIT, code=self.code))
                if self.link is not None:
                    self.link.send("EXIT %s %d" % (self.cfg.node, self.code))

    def _scan(self) -> Set[int]:
        return find_job_processes(self.cfg.run_id, self.token, self.pid)

    # teardown ---------------------------------------------------------------
    def request_teardown(
        self,
        reason: str,
        kill_now: bool,
        now: float,
        escalate: bool = False,
        announce: bool = True,
    ) -> None:
        td = self.teardown
        if td is not None:
            if (kill_now or escalate) and not td.complete:
                td.escalate(now)
            return
        self.teardown = Teardown(reason, kill_now, now, self.cfg.grace)
        if announce:
            self.out.add(
                status_record(EVENT_STOPPING, reason=reason, mode="kill" if kill_now else "term")
            )

    def _step_teardown(self, now: float) -> None:
        td = self.teardown
        if td is None or td.complete or now < td.next_poll:
            return
        td.next_poll = now + POLL_INTERVAL
        self._reap()
        pids = self._scan()
        if not pids:
            self._reap()
            self._finish_teardown(td, 0)
            return
        if not td.kill_phase and now >= td.term_deadline:
            td.kill_phase = True
            td.kill_deadline = now + KILL_TIMEOUT
        if td.kill_phase:
            if now >= td.kill_deadline:
                td.gave_up = True
                self._finish_teardown(td, len(pids))
                return
            td.killed |= send_signal(pids, signal.SIGKILL)
        else:
            td.signalled |= send_signal(pids - td.signalled, signal.SIGTERM)

    def _finish_teardown(self, td: Teardown, left: int) -> None:
        td.complete = True
        td.left = left
        self.last_data = time.monotonic()
        if td.reason != LEFTOVER or td.signalled or td.killed:
            self.out.add(
                status_record(
                    EVENT_TEARDOWN,
                    reason=td.reason,
                    signalled=sorted(td.signalled),
                    killed=sorted(td.killed),
                )
            )

    # io -------------------------------------------------------------------
    def _read_pipe(self, fd: int) -> None:
        try:
            data = os.read(fd, READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        framer = self.pipes[fd]
        self.last_data = time.monotonic()
        if data:
            self.got += len(data)
            self.out.add(framer.feed(data))
            return
        self.out.add(framer.finish())
        self._close_pipe(fd)

    def _drain_ready(self) -> None:
        """Read what the pipes hold right now, so it goes out before "exit"."""
        budget = OUT_HIGH_WATER
        while self.pipes and budget > 0:
            poller = select.poll()
            for fd in self.pipes:
                poller.register(fd, select.POLLIN)
            ready = [fd for fd, _ev in poller.poll(0)]
            if not ready:
                return
            for fd in ready:
                if fd in self.pipes:
                    before = self.out.size
                    self._read_pipe(fd)
                    budget -= max(1, self.out.size - before)

    def _close_pipe(self, fd: int) -> None:
        if not self.paused:
            self.sel.unregister(fd)
        del self.pipes[fd]
        os.close(fd)

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
            self.request_teardown("stdin closed", False, now)
            return
        self._stdin_data(data, now)

    def _stdin_data(self, data: bytes, now: float) -> None:
        self.last_in = now
        lines = (self.stdin_partial + data).split(b"\n")
        self.stdin_partial = lines.pop()[-64:]
        for line in lines:
            word = line.strip().decode("ascii", "replace")
            if word == CTRL_KILL:
                self.request_teardown("control KILL", True, now)
            elif word == CTRL_TERM:
                self.request_teardown("control TERM", False, now)

    def _update_registrations(self) -> None:
        if not self.paused and self.out.size > OUT_HIGH_WATER:
            self.paused = True
            for fd in self.pipes:
                self.sel.unregister(fd)
        elif self.paused and self.out.size < OUT_LOW_WATER:
            self.paused = False
            self.last_data = time.monotonic()
            for fd in self.pipes:
                self.sel.register(fd, selectors.EVENT_READ, "pipe")
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
        if self.pipes and (self.paused or now - self.last_data < DRAIN_IDLE_TIMEOUT):
            return False
        return True

    def _timeout(self, now: float) -> float:
        deadlines: List[float] = []
        if self.cfg.heartbeat > 0:
            deadlines.append(self.next_heartbeat)
        td = self.teardown
        if td is None:
            if self.stdin_open and self.cfg.watchdog > 0:
                deadlines.append(self.last_in + self.cfg.watchdog)
        elif not td.complete:
            deadlines.append(td.next_poll)
        elif self.pipes:
            deadlines.append(self.last_data + DRAIN_IDLE_TIMEOUT)
        if not deadlines:
            return 1.0
        return min(1.0, max(0.0, min(deadlines) - now))

    def _timers(self, now: float) -> None:
        if self.cfg.heartbeat > 0 and now >= self.next_heartbeat:
            self.out.add(TAG_HEARTBEAT + b"\n")
            self.next_heartbeat = now + self.cfg.heartbeat
        if (
            self.teardown is None
            and self.stdin_open
            and self.cfg.watchdog > 0
            and now - self.last_in >= self.cfg.watchdog
        ):
            self.request_teardown(
                "watchdog: no word from the controller for %gs" % self.cfg.watchdog,
                False,
                now,
            )
        if self.teardown is None and self.code is not None:
            self.request_teardown(LEFTOVER, False, now, announce=False)
        self._link_connect(now)

    # coordinator ------------------------------------------------------------
    def _link_connect(self, now: float) -> None:
        link = self.link
        if link is None:
            return
        if self.code is not None and link.sock is None and link.tries:
            # the job is over and the coordinator was out of reach: nobody to tell
            return
        sock = link.connect(now)
        if sock is None:
            return
        self.sel.register(sock.fileno(), selectors.EVENT_READ, "coord")
        if self.code is not None:
            link.send("EXIT %s %d" % (self.cfg.node, self.code))

    def _read_link(self, now: float) -> None:
        link = self.link
        if link is None or link.sock is None:
            return
        fd = link.sock.fileno()
        for line in link.read():
            if line.startswith("STOP"):
                reason = line[4:].strip() or "another node failed"
                self.request_teardown("coordinator: " + reason, False, now)
        if link.sock is None:
            self.sel.unregister(fd)

    def _close_link(self) -> None:
        link = self.link
        if link is not None and link.sock is not None:
            self.sel.unregister(link.sock.fileno())
            link.close()

    # main -----------------------------------------------------------------
    def run(self) -> int:
        set_child_subreaper()
        self._install_signals()
        self._register_stdin()
        if not self._spawn():
            self._write_state(state="exited", code=self.code, ended=time.time(), left=0)
            self.out.add(status_record(EVENT_DONE, code=self.code, left=0))
            self._final_flush()
            return int(self.code or 0)
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
        if self.out.closed and self.teardown is None:
            self.request_teardown("output closed", False, now)
        for key, _mask in self.sel.select(self._timeout(now)):
            self._dispatch(key, time.monotonic())
        now = time.monotonic()
        self._handle_signals(now)
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
            if key.fd in self.pipes:
                self._read_pipe(key.fd)
        elif key.data == "stdin":
            self._read_stdin(now)
        elif key.data == "coord":
            self._read_link(now)
        elif key.data == "wake":
            try:
                os.read(self.wake_r, 4096)
            except OSError:
                pass

    def _finish(self) -> int:
        """Flushes the last output, reports ``done`` and returns the exit code."""
        for fd in list(self.pipes):
            self.out.add(self.pipes[fd].finish())
            self._close_pipe(fd)
        td = self.teardown
        code = self.code if self.code is not None else EXIT_UNKILLABLE
        left = td.left if td is not None else 0
        self._close_link()
        if self.cfg.cleanup_dir:
            remove_tee_dir(self.cfg.cleanup_dir)
        self.out.add(status_record(EVENT_DONE, code=code, left=left))
        self._final_flush()
        self._write_state(state="exited", code=code, ended=time.time(), left=left)
        return code

    def _final_flush(self) -> None:
        if self.writing:
            self.sel.unregister(1)
            self.writing = False
        last_progress = time.monotonic()
        while self.out.size and not self.out.closed:
            if self.out.flush():
                last_progress = time.monotonic()
                continue
            if time.monotonic() - last_progress > FINAL_FLUSH_STALL:
                return
            try:
                select.select([], [1], [], 0.2)
            except (OSError, ValueError):
                time.sleep(0.05)


def detach(config: Config) -> int:
    """Forks the supervisor into its own session, writing its records to the log
    file; returns once the job has started (or failed to), so that the SSH
    command ends while the job runs on."""
    log = os.path.expanduser(config.log_file or "")
    os.makedirs(os.path.dirname(log) or ".", exist_ok=True)
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
            first = status_record(EVENT_ERROR, message="the detached supervisor died at start")
        os.write(1, first)
        return 0 if first.startswith(TAG_STATUS + b'{"event":"started"') else 1
    os.close(ready_r)
    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
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
        config = parse_config(text)
    except ConfigError as exc:
        record = status_record(EVENT_ERROR, message=str(exc))
        record += status_record(EVENT_DONE, code=EXIT_BAD_CONFIG, left=0)
        os.write(1, record)
        return EXIT_BAD_CONFIG
    if config.log_file:
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
