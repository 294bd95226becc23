"""The protocol between the controller and the scripts it runs on the nodes.

Every byte, key, word and level that both sides must agree on is defined here and
nowhere else. Standard library only, Python >= 3.8: this module travels to the
nodes inside every program that ``torchherd.remote.program`` builds, and the node
scripts (supervisor, coordinator, stop) import it there as they do in the checkout.
Nothing here may change what goes over the wire: it is in logs and state files.

Supervisor -> controller (the supervisor's stdout, or its log file when detached):
one record per line, TAG + payload + ``\\n``::

  O  a line of the job's stdout, as the job wrote it (its newline removed)
  E  a line of the job's stderr
  H  heartbeat (empty payload)
  S  a status event, compact JSON: {"event": NAME, ...}; see the *_record builders

Controller -> supervisor (its stdin): the config as the first line (JSON, see
``SupervisorConfig``), then lines: every byte counts as a heartbeat, the word
``TERM`` asks for a graceful teardown and ``KILL`` for SIGKILL at once.

Supervisor <-> coordinator (TCP, one line each way)::

  node -> coordinator   HELLO <token> <node>     EXIT <node> <code>
  coordinator -> node   STOP <reason>
"""

from __future__ import annotations

import binascii
import enum
import functools
import json
import os
from typing import Dict, Final, Iterable, List, Literal, Mapping, NamedTuple, Optional, Sequence, Tuple, TypedDict

from torchherd.remote.container import ContainerSpec

# ------------------------------------------------------------------ records

TAG_STDOUT: Final = b"O"
TAG_STDERR: Final = b"E"
TAG_HEARTBEAT: Final = b"H"
TAG_STATUS: Final = b"S"

# ``record[0]`` of a bytes record is an int: the controller's per-record path
# compares these, not one-byte slices.
TAG_STDOUT_ORD: Final = ord(TAG_STDOUT)
TAG_STDERR_ORD: Final = ord(TAG_STDERR)
TAG_HEARTBEAT_ORD: Final = ord(TAG_HEARTBEAT)
TAG_STATUS_ORD: Final = ord(TAG_STATUS)

HEARTBEAT_RECORD: Final = TAG_HEARTBEAT + b"\n"
"""The supervisor's heartbeat, a whole record."""
CONTROLLER_HEARTBEAT: Final = b"\n"
"""The controller's heartbeat on the supervisor's stdin: an empty line."""

# --------------------------------------------------------------- rank prefix

# torchrun writes this before every line a rank prints (with --tee); the controller
# parses it back off to know the rank, and the supervisor mends lines torchrun tore
# apart at it, so it must be unlikely to start a line by chance.
RANK_PREFIX_TEMPLATE: Final = "[torchherd-rank ${rank}] "
RANK_PREFIX_HEAD: Final = b"[torchherd-rank "
RANK_PREFIX_END: Final = b"] "
"""What follows the rank's number."""

# ----------------------------------------------------------------- run ids

RUN_ID_CHARS: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")
RUN_ID_MAX: Final = 100


def write_text_atomic(path: str, text: str) -> None:
    """Writes ``path`` (``~`` expanded) so that a reader never sees half of it: a private
    (0600) file of a random name beside it, made exclusively (never an existing file or a
    link another user planted), then renamed over ``path``. The one writer of every state
    file, the controller's run records and the nodes' supervisor and coordinator files."""
    path = os.path.expanduser(path)
    temporary = "%s.%s.tmp" % (path, binascii.hexlify(os.urandom(6)).decode("ascii"))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(temporary, flags, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


def write_json_atomic(path: str, fields: Mapping[str, object]) -> None:
    """``fields`` as compact JSON, by ``write_text_atomic``."""
    write_text_atomic(path, json.dumps(fields, separators=(",", ":")))


def is_run_id(text: object) -> bool:
    """Letters, digits and '-' only: a run id names files and directories, reaches shells,
    and is matched in process environments, so nothing in it may mean more."""
    return (isinstance(text, str) and 0 < len(text) <= RUN_ID_MAX and not text.startswith("-")
            and all(char in RUN_ID_CHARS for char in text))


# ------------------------------------------------------------- environment

RUN_ID_ENV: Final = "TORCHHERD_RUN_ID"
"""Every process of a job carries its run id in this variable: teardown and stop find them by it."""
ATTEMPT_ENV: Final = "TORCHHERD_ATTEMPT"
"""A --retries run's attempt number, in the job's environment (engine.recovery sets it)."""
SUPERVISOR_ENV: Final = "TORCHHERD_SUPERVISOR"
"""The token of the supervisor that started the process (sibling supervisors on one process table)."""

# ------------------------------------------------------------ status events

StatusEvent = Literal["started", "error", "stopping", "exit", "teardown", "done", "gpu", "progress", "busy",
                      "checkpoint"]
EVENT_STARTED: Final = "started"
EVENT_ERROR: Final = "error"
EVENT_STOPPING: Final = "stopping"
EVENT_EXIT: Final = "exit"
EVENT_TEARDOWN: Final = "teardown"
EVENT_DONE: Final = "done"
EVENT_GPU: Final = "gpu"
EVENT_PROGRESS: Final = "progress"
EVENT_BUSY: Final = "busy"
EVENT_CHECKPOINT: Final = "checkpoint"
STATUS_EVENTS: Final[Tuple[StatusEvent, ...]] = (
    EVENT_STARTED, EVENT_ERROR, EVENT_STOPPING, EVENT_EXIT, EVENT_TEARDOWN, EVENT_DONE, EVENT_GPU, EVENT_PROGRESS,
    EVENT_BUSY, EVENT_CHECKPOINT,
)

StopMode = Literal["term", "kill"]
"""The ``mode`` of a ``stopping`` event."""
MODE_TERM: Final = "term"
MODE_KILL: Final = "kill"


def status_event(name: object) -> Optional[StatusEvent]:
    """``name`` as a known event, or None for anything else."""
    for event in STATUS_EVENTS:
        if name == event:
            return event
    return None


def status_record(event: str, **fields: object) -> bytes:
    """One S record: TAG_STATUS + compact JSON + newline, ``event`` first."""
    body: Dict[str, object] = {"event": event}
    body.update(fields)
    return TAG_STATUS + json.dumps(body, separators=(",", ":")).encode() + b"\n"


def status_head(event: StatusEvent) -> bytes:
    """How every record of ``event`` starts (``status_record`` writes ``event`` first)."""
    return TAG_STATUS + b'{"event":"' + event.encode() + b'"'


def started_record(pid: int, pgid: int, supervisor: int) -> bytes:
    """The job runs: its main process, its process group, the supervisor's pid."""
    return status_record(EVENT_STARTED, pid=pid, pgid=pgid, supervisor=supervisor)


def error_record(message: str) -> bytes:
    """The job could not be started (or the config was bad)."""
    return status_record(EVENT_ERROR, message=message)


def stopping_record(reason: str, mode: StopMode) -> bytes:
    return status_record(EVENT_STOPPING, reason=reason, mode=mode)


def exit_record(code: int, stopped: Optional[str] = None) -> bytes:
    """The job's main process ended with ``code`` (128+N for signal N); ``stopped`` is the
    reason of the teardown that had signalled it first (whatever code the job then chose:
    torchrun turns SIGTERM into exit 1 in parts of its loop), None when it ended on its own."""
    if stopped is None:
        return status_record(EVENT_EXIT, code=code)
    return status_record(EVENT_EXIT, code=code, stopped=stopped)


def teardown_record(reason: str, signalled: Iterable[int], killed: Iterable[int]) -> bytes:
    return status_record(EVENT_TEARDOWN, reason=reason, signalled=sorted(signalled), killed=sorted(killed))


def done_record(code: int, left: int) -> bytes:
    """Always the supervisor's last record: its exit code, processes it could not kill."""
    return status_record(EVENT_DONE, code=code, left=left)


def gpu_record(gpus: Iterable[Sequence[float]]) -> bytes:
    """The node's GPUs as ``nvidia-smi`` saw them, every few seconds: per GPU
    [index, utilisation %, memory used MiB, memory total MiB], and where the board says
    them [SM clock MHz, maximum SM clock MHz, power W, throttle reasons bitmask]."""
    return status_record(EVENT_GPU, gpus=[list(gpu) for gpu in gpus])


def busy_record(samples: int, busy: int) -> bytes:
    """Of ``samples`` looks at the node's ranks since the last record, how many found a
    rank busy (running, runnable, stopped, in disk I/O) rather than asleep."""
    return status_record(EVENT_BUSY, samples=samples, busy=busy)


def checkpoint_record(path: str, size: int, mtime: float) -> bytes:
    """The job wrote a new checkpoint, complete now (``savewatch``): its path relative to
    the workdir, its size in bytes and its mtime (seconds since the epoch)."""
    return status_record(EVENT_CHECKPOINT, path=path, size=size, mtime=mtime)


def progress_record(rank: Optional[int], text: str) -> bytes:
    """A rank's line that is still being redrawn with ``\\r`` (a progress bar), as a
    terminal would show it now. Not a line: the line itself follows once it ends."""
    return status_record(EVENT_PROGRESS, rank=rank, text=text)


# --------------------------------------------------------------- stop levels


@functools.total_ordering
class StopLevel(enum.Enum):
    """How hard the controller is stopping a node, mildest first. TERM and KILL are
    sent to the supervisor as control words; GIVE UP is the controller's own verdict
    on a node that never confirmed its teardown, and is never sent."""

    TERM = "TERM"
    KILL = "KILL"
    GIVE_UP = "GIVE UP"

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, StopLevel):
            return NotImplemented
        order = list(StopLevel)
        return order.index(self) < order.index(other)


def control_line(level: StopLevel) -> bytes:
    """The line that asks a supervisor for ``level`` (TERM or KILL)."""
    if level is StopLevel.GIVE_UP:
        raise ValueError("GIVE UP is never sent to a node")
    return str(level.value).encode("ascii") + b"\n"


def parse_control(line: bytes) -> Optional[StopLevel]:
    """The level a control line asks for; None for a heartbeat or anything else."""
    word = line.strip().decode("ascii", "replace")
    if word == StopLevel.TERM.value:
        return StopLevel.TERM
    if word == StopLevel.KILL.value:
        return StopLevel.KILL
    return None


# ------------------------------------------------------------ coordinator

HELLO: Final = "HELLO"
EXIT: Final = "EXIT"
STOP: Final = "STOP"


def hello_line(token: str, node: str) -> bytes:
    return ("%s %s %s\n" % (HELLO, token, node)).encode()


def exit_line(node: str, code: int) -> bytes:
    return ("%s %s %d\n" % (EXIT, node, code)).encode()


def stop_line(reason: str) -> bytes:
    return ("%s %s\n" % (STOP, reason)).encode()


def parse_stop(line: str) -> Optional[str]:
    """The reason of a STOP line ("" when it gives none); None for any other line."""
    if not line.startswith(STOP):
        return None
    return line[len(STOP):].strip()


# ------------------------------------------------------------ state files


def process_start(pid: int) -> Optional[int]:
    """When the process started (clock ticks since boot, field 22 of /proc/PID/stat); None
    when it is gone. A pid and its start name one process, never a later one that reuses
    the pid: state files record both, and ``stop`` kills only what still matches."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            stat = f.read()
        return int(stat[stat.rfind(b")") + 2:].split()[19])
    except (OSError, IndexError, ValueError):
        return None


RunState = Literal["running", "exited"]
STATE_RUNNING: Final = "running"
STATE_EXITED: Final = "exited"


class NodeStateFile(TypedDict, total=False):
    """The supervisor's state file (detached runs), read back by ``torchherd status``."""

    run_id: str
    node: str
    supervisor: int
    start: Optional[int]
    """The supervisor's ``process_start``: ``stop`` signals that pid only while it matches."""
    token: str
    """The supervisor's TORCHHERD_SUPERVISOR: ``stop`` ends the processes that carry it."""
    pid: int
    pgid: int
    started: float
    state: RunState
    code: Optional[int]
    ended: float
    container: List[str]
    """[runtime, name] of the job's container: ``stop`` removes it should the supervisor be gone."""
    left: int
    stopped: str
    """Set when the supervisor had signalled the job before it ended: the teardown's reason."""


class CoordinatorStateFile(TypedDict):
    pid: int
    start: Optional[int]
    """The coordinator's start time (clock ticks since boot): ``stop`` kills that pid only if it matches."""
    port: int
    state: RunState
    culprit: Optional[str]
    reason: Optional[str]


# ---------------------------------------------------------------- configs
# NamedTuples, not dataclasses: ``dataclasses`` imports ``inspect``, which would add
# tens of milliseconds to every supervisor's start on the node. ``_replace`` makes a
# changed copy.


class ConfigError(ValueError):
    """A config (or a reply) that is not what the protocol says."""


def _load_object(text: str, what: str) -> Dict[str, object]:
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ConfigError("%s is not valid JSON: %s" % (what, exc)) from None
    if not isinstance(raw, dict):
        raise ConfigError("%s must be a JSON object" % what)
    return raw


def _number(raw: Mapping[str, object], key: str, default: float) -> float:
    value = raw.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError("config key %r must be a number" % key)
    if value < 0:
        raise ConfigError("config key %r must be >= 0" % key)
    return float(value)


def _optional_count(raw: Mapping[str, object], key: str) -> Optional[int]:
    value = raw.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError("config key %r must be an integer >= 0 or null" % key)
    return value


def _optional_str(raw: Mapping[str, object], key: str) -> Optional[str]:
    value = raw.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError("config key %r must be a non-empty string or null" % key)
    return value


def _flag(raw: Mapping[str, object], key: str) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError("config key %r must be true or false" % key)
    return value


def _strings(raw: Mapping[str, object], key: str) -> Tuple[str, ...]:
    value = raw.get(key)
    if not isinstance(value, list) or not value or not all(isinstance(item, str) for item in value):
        raise ConfigError("config key %r must be a non-empty list of strings" % key)
    return tuple(value)


class CoordinatorAddress(NamedTuple):
    """Where a detached supervisor finds its run's coordinator, and the token to say."""

    host: str
    port: int
    token: str

    def to_json_object(self) -> Dict[str, object]:
        return {"host": self.host, "port": self.port, "token": self.token}

    @classmethod
    def from_json_object(cls, value: object) -> Optional[CoordinatorAddress]:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ConfigError("config key 'coordinator' must be an object or null")
        host, port, token = value.get("host"), value.get("port"), value.get("token")
        if not isinstance(host, str) or not isinstance(port, int) or not isinstance(token, str):
            raise ConfigError("config key 'coordinator' needs host (str), port (int), token (str)")
        return cls(host, port, token)


class SupervisorConfig(NamedTuple):
    """The supervisor's config: built by the controller, sent as the first line of the
    supervisor's stdin (``to_line``), parsed and checked on the node (``from_json``)."""

    run_id: str
    """Also exported to the job as TORCHHERD_RUN_ID."""
    argv: Tuple[str, ...]
    """The job command (not through a shell); a leading "~/" of argv[0] is expanded, as the
    shell expands the python of every other command torchherd runs on the node."""
    env: Mapping[str, str] = {}
    """Added to the job's environment."""
    cwd: Optional[str] = None
    """The job's working directory ("~" is expanded); None: the supervisor's own."""
    grace: float = 10.0
    """Seconds from SIGTERM to SIGKILL in a graceful teardown."""
    heartbeat: float = 5.0
    """Seconds between H records (0: none)."""
    watchdog: float = 0.0
    """Tear the job down when no stdin byte arrived for this long (0: off); with
    ``persist``, the controller counts as gone instead (the job runs on)."""
    cleanup_dir: Optional[str] = None
    """torchrun's log directory (only a "torchherd-*" name): the supervisor creates it, mode
    0700, before the job starts, refuses to start when it already exists, and removes it
    at the end."""
    rank_marker: Optional[str] = None
    """The rank prefix's head (``RANK_PREFIX_HEAD``): mend lines torchrun tore apart at it."""
    log_file: Optional[str] = None
    """Detached: records are appended here, the supervisor forks into its own session."""
    state_file: Optional[str] = None
    """Detached: a ``NodeStateFile`` written at the start and at the end."""
    node: str = ""
    """This node's name, for the coordinator."""
    coordinator: Optional[CoordinatorAddress] = None
    """Detached fail fast: the run's coordinator (with ``persist``: obeyed once the
    controller is gone)."""
    rank_logs: Optional[str] = None
    """torchrun's ``--log-dir`` when it runs with ``--redirects 3`` (no tee): the supervisor
    reads each rank's files there itself, byte for byte, so a ``\\r`` survives."""
    gpu_every: float = 0.0
    """Seconds between GPU samples (``gpu`` records) where ``nvidia-smi`` exists; 0: none."""
    busy_every: float = 0.0
    """Seconds between ``busy`` records (the ranks' busy share, for the straggler); 0: none."""
    rank_base: Optional[int] = None
    """The node's first global rank, when the controller knows it (static rendezvous:
    node rank x processes per node): the ranks' files are named at once, even a rank that
    ends before the supervisor sees its environment. None (c10d): learned from a worker."""
    persist: bool = False
    """Attached, but outliving the controller (a detached run with retries): records go to
    stdout and are appended to ``log_file`` too (less heartbeats and samples), no fork; the
    end of stdin or stdout, or SIGHUP, leaves the job running on (the controller is gone)."""
    log_head: Optional[str] = None
    """With ``persist``: one line written to ``log_file`` first, as the node's own output
    (the marker that opens an attempt's part of the log)."""
    checkpoint: Optional[str] = None
    """The job's checkpoint (relative to its workdir; a glob: the newest match), watched
    for a new complete one (``checkpoint`` records, ``savewatch``); None: not watched."""
    container: Optional[ContainerSpec] = None
    """Run ``argv`` inside this container (``torchherd.remote.container``): the supervisor
    stays outside, and removes the container by its run-scoped name at the end."""
    warm_start: Optional[str] = None
    """``remote/zygote.py``'s program text: a job that is torchrun's agent
    (``PYTHON -m torch.distributed.run ...``) starts as ``PYTHON -c TEXT start -m
    torch.distributed.run ...``, which imports torch once and forks each rank; None: as given."""

    def to_json(self) -> str:
        # ASCII JSON never holds a raw newline: the config is exactly one line.
        return json.dumps({
            "run_id": self.run_id, "argv": list(self.argv), "env": dict(self.env), "cwd": self.cwd,
            "grace": self.grace, "heartbeat": self.heartbeat, "watchdog": self.watchdog,
            "cleanup_dir": self.cleanup_dir, "rank_marker": self.rank_marker,
            "log_file": self.log_file, "state_file": self.state_file, "node": self.node or None,
            "coordinator": None if self.coordinator is None else self.coordinator.to_json_object(),
            "rank_logs": self.rank_logs, "gpu_every": self.gpu_every, "rank_base": self.rank_base,
            "busy_every": self.busy_every, "persist": self.persist, "log_head": self.log_head,
            "container": None if self.container is None else self.container.to_json_object(),
            "checkpoint": self.checkpoint, "warm_start": self.warm_start,
        })

    def to_line(self) -> bytes:
        """The first line of the supervisor's stdin."""
        return self.to_json().encode("ascii") + b"\n"

    @classmethod
    def from_json(cls, text: str) -> SupervisorConfig:
        """Parse and check; ConfigError says which key is wrong."""
        raw = _load_object(text, "config")
        run_id = raw.get("run_id")
        if not isinstance(run_id, str) or not run_id or "\0" in run_id:
            raise ConfigError("config key 'run_id' must be a non-empty string")
        argv = _strings(raw, "argv")
        env = raw.get("env") or {}
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ConfigError("config key 'env' must map strings to strings")
        cwd = raw.get("cwd")
        if cwd is not None and not isinstance(cwd, str):
            raise ConfigError("config key 'cwd' must be a string or null")
        try:
            container = ContainerSpec.from_json_object(raw.get("container"))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return cls(
            run_id=run_id, argv=argv, env=dict(env), cwd=cwd,
            grace=_number(raw, "grace", 10.0), heartbeat=_number(raw, "heartbeat", 5.0),
            watchdog=_number(raw, "watchdog", 0.0), cleanup_dir=_optional_str(raw, "cleanup_dir"),
            rank_marker=_optional_str(raw, "rank_marker"), log_file=_optional_str(raw, "log_file"),
            state_file=_optional_str(raw, "state_file"), node=_optional_str(raw, "node") or "",
            coordinator=CoordinatorAddress.from_json_object(raw.get("coordinator")),
            rank_logs=_optional_str(raw, "rank_logs"), gpu_every=_number(raw, "gpu_every", 0.0),
            rank_base=_optional_count(raw, "rank_base"), busy_every=_number(raw, "busy_every", 0.0),
            persist=_flag(raw, "persist"), log_head=_optional_str(raw, "log_head"), container=container,
            checkpoint=_optional_str(raw, "checkpoint"), warm_start=_optional_str(raw, "warm_start"),
        )._checked()

    def _checked(self) -> SupervisorConfig:
        if self.persist and not self.log_file:
            raise ConfigError("config key 'persist' needs a 'log_file'")
        if self.log_head is not None and ("\n" in self.log_head or "\r" in self.log_head):
            raise ConfigError("config key 'log_head' must be one line")
        return self


class CoordinatorConfig(NamedTuple):
    """The coordinator's config: the first line of its stdin (``to_line``), never its command
    line, which every user of the master can read."""

    run_id: str
    """On its command line (``- RUN_ID``): it names the process, nothing more."""
    tokens: Mapping[str, str]
    """node -> that node's own secret: its HELLO must say it, and only once."""
    host: str = ""
    """The address to listen on: the master address the workers reach ("": every interface)."""
    state_file: Optional[str] = None
    """A ``CoordinatorStateFile`` written on every change."""
    wait: float = 60.0
    """Seconds to wait for nodes that never connect."""

    @property
    def nodes(self) -> Tuple[str, ...]:
        return tuple(self.tokens)

    def to_json(self) -> str:
        return json.dumps({"run_id": self.run_id, "tokens": dict(self.tokens), "host": self.host,
                           "state_file": self.state_file, "wait": self.wait})

    def to_line(self) -> bytes:
        """The first line of the coordinator's stdin."""
        return self.to_json().encode("ascii") + b"\n"

    @classmethod
    def from_json(cls, text: str) -> CoordinatorConfig:
        raw = _load_object(text, "config")
        run_id, tokens, host = raw.get("run_id", ""), raw.get("tokens"), raw.get("host") or ""
        if not isinstance(run_id, str):
            raise ConfigError("config key 'run_id' must be a string")
        if not isinstance(tokens, dict) or not tokens or not all(
                isinstance(node, str) and node and isinstance(token, str) and len(token) >= 16
                for node, token in tokens.items()):
            raise ConfigError("config key 'tokens' must map node names to tokens of 16 characters or more")
        if not isinstance(host, str):
            raise ConfigError("config key 'host' must be a string")
        return cls(run_id=run_id, tokens=dict(tokens), host=host, state_file=_optional_str(raw, "state_file"),
                   wait=_number(raw, "wait", 60.0))


class CoordinatorReply(NamedTuple):
    """What the coordinator prints, one JSON line, once it listens."""

    port: int
    pid: int

    def to_json(self) -> str:
        return json.dumps({"port": self.port, "pid": self.pid})

    @classmethod
    def from_json(cls, text: str) -> CoordinatorReply:
        raw = _load_object(text, "the coordinator's reply")
        port, pid = raw.get("port"), raw.get("pid")
        if not isinstance(port, int) or not isinstance(pid, int):
            raise ConfigError("the coordinator's reply needs port (int) and pid (int)")
        return cls(port, pid)


class StopReply(NamedTuple):
    """What the stop script prints, one JSON line, once the run's processes are gone."""

    was_running: bool
    """The supervisor still ran when stop began."""
    left: Tuple[str, ...]
    """The command lines of the processes that could not be killed."""

    def to_json(self) -> str:
        return json.dumps({"was_running": self.was_running, "left": list(self.left)})

    @classmethod
    def from_json(cls, text: str) -> StopReply:
        raw = _load_object(text, "the stop reply")
        was_running, left = raw.get("was_running"), raw.get("left")
        if not isinstance(was_running, bool) or not isinstance(left, list):
            raise ConfigError("the stop reply needs was_running (bool) and left (list)")
        return cls(was_running, tuple(str(line) for line in left))
