"""Detached runs as data: the local run record, the remote paths, and the state a
node's supervisor leaves behind.

Pure (files on this machine only, no SSH). The record is what lets a later shell
find, reconnect to, follow and stop a run: it keeps enough of the resolved
inventory to reconnect even when the inventory file changed or moved.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, NoReturn, TypeVar

from torchherd.errors import UsageError
from torchherd.inventory import ADDRESS_PATTERN, SCHEDULERS, Host, valid_hostname, valid_ruser
from torchherd.remote.wire import is_run_id

T = TypeVar("T")
MAX_RECORD_BYTES = 16 << 20
STORED_TEXT_CHARS = 4096
"""The most of a headline a record keeps: it quotes the job's first error line, which
may be a megabyte of undecodable bytes (each six bytes of JSON); the whole line stays in
the node's log."""
ATTEMPT_TEXT_CHARS = 512
"""The most of one attempt's headline a record keeps (the run's own keeps more)."""
ATTEMPT_HEADLINES = 64
"""The attempts whose headlines a record keeps: the first and the last ones (a run of a
thousand retries, each failing with a long line, stays far under ``MAX_RECORD_BYTES``);
the others keep their number, nodes and how they ended."""

REMOTE_RUNS_DIR = "~/.torchherd/runs"
"""On each node: ``<this>/<run-id>/<node>.log`` and ``<node>.state.json``. The node's
name is in the file name because nodes may share a home directory (NFS)."""


def remote_run_dir(run_id: str) -> str:
    return f"{REMOTE_RUNS_DIR}/{run_id}"


def remote_log_file(run_id: str, node: str) -> str:
    return f"{remote_run_dir(run_id)}/{node}.log"


def remote_state_file(run_id: str, node: str) -> str:
    return f"{remote_run_dir(run_id)}/{node}.state.json"


def remote_coordinator_file(run_id: str, attempt: int = 0) -> str:
    """A plain detached run's coordinator state file; with retries, one per attempt (the
    last attempt's coordinator may still be on its way out when the next one starts)."""
    name = f"coordinator-{attempt}.json" if attempt else "coordinator.json"
    return f"{remote_run_dir(run_id)}/{name}"


def runs_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_STATE_HOME/torchherd/runs`` (default ``~/.local/state/torchherd/runs``)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "torchherd" / "runs"


@dataclass(frozen=True)
class NodeRecord:
    """One node of a detached run: how to reach it, and where its run lives there."""

    name: str
    address: str
    user: str | None
    ssh_port: int | None
    identity_file: str | None
    python: str
    workdir: str
    log_file: str
    state_file: str
    supervisor: int | None = None
    pid: int | None = None
    pgid: int | None = None

    def host(self) -> Host:
        return Host(name=self.name, address=self.address, user=self.user, ssh_port=self.ssh_port,
                    identity_file=self.identity_file, python=self.python, workdir=self.workdir,
                    env=MappingProxyType({}), setup="", local_addr=None)


@dataclass(frozen=True)
class CoordinatorRecord:
    node: str
    port: int
    pid: int
    state_file: str


@dataclass(frozen=True)
class RunRecord:
    run_id: str
    inventory: str
    created: float
    command: tuple[str, ...]
    nodes: tuple[NodeRecord, ...]
    max_rank: int
    grace: float
    ssh_config: str | None = None
    ssh_timeout: float = 10.0
    coordinator: CoordinatorRecord | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def master(self) -> str:
        return self.nodes[0].name

    def node(self, name: str) -> NodeRecord:
        for node in self.nodes:
            if node.name == name:
                return node
        raise UsageError(f"run {self.run_id} has no node {name!r}",
                         "its nodes: " + ", ".join(node.name for node in self.nodes))

    def to_json(self) -> str:
        data = asdict(self)
        data["extra"] = dict(self.extra)
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "run record") -> RunRecord:
        """Parses and checks every field (RecordError names ``source`` and the key): a
        record's values reach remote shells and file paths, so nothing is taken on trust."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            raise RecordError(f"{source}: not valid JSON", _DAMAGED) from None
        read = _Fields(source, "", data)
        nodes = read.value("nodes", list)
        if not nodes:
            read.fail("nodes", "no nodes")
        records = tuple(_node(_Fields(source, f"nodes[{index}].", node)) for index, node in enumerate(nodes))
        coordinator = read.optional("coordinator", dict)
        extra = read.optional("extra", dict) or {}
        if extra.get(RECOVERY_KEY) is not None:  # checked now: a damaged one fails at load, as any key does
            _recovery(_Fields(source, f"extra.{RECOVERY_KEY}.", extra[RECOVERY_KEY]))
        if extra.get("login") is not None:  # a SLURM run's login host: reached over SSH as a node is
            extra = {**extra, "login": asdict(_node(_Fields(source, "extra.login.", extra["login"])))}
        if extra.get(ATTACHED_KEY) is not None:
            _attached(_Fields(source, f"extra.{ATTACHED_KEY}.", extra[ATTACHED_KEY]))
        run_id = read.run_id("run_id")
        _scheduler(_Fields(source, "extra.", extra), run_id)
        return cls(run_id=run_id, inventory=read.text("inventory"), created=read.number("created"),
                   command=read.texts("command"), nodes=records, max_rank=read.integer("max_rank", low=-1),
                   grace=read.number("grace"), ssh_config=read.optional_text("ssh_config"),
                   ssh_timeout=read.number("ssh_timeout", 10.0, positive=True),
                   coordinator=None if coordinator is None else _coordinator(
                       _Fields(source, "coordinator.", coordinator), records),
                   extra=extra)


class RecordError(UsageError):
    """A run record that is not what torchherd writes (damaged, or written by hand)."""


_DAMAGED = "the run record is damaged: remove the file (torchherd status lists the other runs)"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class _Fields:
    """Typed reads out of one JSON object of a record, naming the file and the key."""

    def __init__(self, source: str, where: str, data: object) -> None:
        self.source, self.where = source, where
        if not isinstance(data, dict):
            raise RecordError(f"{source}: {where or 'the record'} is not a JSON object", _DAMAGED)
        self.data: dict[str, object] = data

    def fail(self, key: str, problem: str) -> NoReturn:
        raise RecordError(f"{self.source}: {self.where}{key}: {problem}", _DAMAGED)

    def value(self, key: str, kind: type[T]) -> T:
        value = self.data.get(key)
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            self.fail(key, f"expected {kind.__name__}, got {type(value).__name__}")
        return value

    def optional(self, key: str, kind: type[T]) -> T | None:
        return None if self.data.get(key) is None else self.value(key, kind)

    def text(self, key: str) -> str:
        value = self.value(key, str)
        if _CONTROL.search(value):
            self.fail(key, "holds a control character")
        return value

    def optional_text(self, key: str) -> str | None:
        return None if self.data.get(key) is None else self.text(key)

    def texts(self, key: str) -> tuple[str, ...]:
        values = self.value(key, list)
        if not all(isinstance(value, str) and "\0" not in value for value in values):
            self.fail(key, "expected a list of strings")
        return tuple(values)

    def name(self, key: str) -> str:
        value = self.value(key, str)
        if not _NAME.match(value):
            self.fail(key, f"{value!r} is not a host name")
        return value

    def address(self, key: str) -> str:
        """A host name, an IP address or an ssh_config alias: it reaches ssh_config's
        ``Match exec`` and ``ProxyCommand`` as ``%h``, so nothing a shell reads as more."""
        value = self.text(key)
        if not (ADDRESS_PATTERN.match(value) and valid_hostname(value)):
            self.fail(key, f"{value!r} is not a host name or an address")
        return value

    def user(self, key: str) -> str | None:
        """As OpenSSH's ``valid_ruser``: the user reaches the same shell lines as ``%r``."""
        value = self.optional_text(key)
        if value is not None and not valid_ruser(value):
            self.fail(key, f"{value!r} is not a user name")
        return value

    def run_id(self, key: str) -> str:
        value = self.value(key, str)
        if not is_run_id(value):
            self.fail(key, f"{value!r} is not a run id")
        return value

    def integer(self, key: str, low: int = 1, high: int = 1 << 62) -> int:
        value = self.value(key, int)
        if not low <= value <= high:
            self.fail(key, f"{value} is out of range")
        return value

    def optional_integer(self, key: str, low: int = 1, high: int = 1 << 62) -> int | None:
        return None if self.data.get(key) is None else self.integer(key, low, high)

    def number(self, key: str, default: float | None = None, positive: bool = False) -> float:
        if default is not None and self.data.get(key) is None:
            return default
        value = self.data.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
                value <= 0 if positive else value < 0):
            self.fail(key, f"expected a number{' above 0' if positive else ''}, got {value!r}")
        return float(value)


def _node(read: _Fields) -> NodeRecord:
    return NodeRecord(name=read.name("name"), address=read.address("address"), user=read.user("user"),
                      ssh_port=read.optional_integer("ssh_port", 1, 65535),
                      identity_file=read.optional_text("identity_file"), python=read.text("python"),
                      workdir=read.text("workdir"), log_file=read.text("log_file"),
                      state_file=read.text("state_file"), supervisor=read.optional_integer("supervisor"),
                      pid=read.optional_integer("pid"), pgid=read.optional_integer("pgid"))


_JOB_ID = re.compile(r"(?:[0-9]+(?:_[0-9]+)?)?\Z", re.ASCII)
"""``sbatch --parsable``'s job id (``commands.parse_job_id``); empty before the first
submission of a run with retries."""


def _scheduler(read: _Fields, run_id: str) -> None:
    """The scheduler's part of ``extra``: its values reach ``scancel``, ``squeue`` and
    remote paths (a job id ``--partition=gpu`` once made ``stop`` cancel every job of the
    user in that partition), so each is what torchherd writes, or the record is damaged."""
    scheduler = read.data.get("scheduler")
    if scheduler is not None and scheduler not in SCHEDULERS:
        read.fail("scheduler", f"{scheduler!r} is not one of {', '.join(SCHEDULERS)}")
    if scheduler != "slurm":
        return
    job_id = read.value("job_id", str)
    if not _JOB_ID.match(job_id):
        read.fail("job_id", f"{job_id!r} is not a SLURM job id")
    directory = read.value("run_dir", str)
    if not re.fullmatch(re.escape(remote_run_dir(run_id)) + r"(?:/attempt-[1-9][0-9]{0,8})?", directory):
        read.fail("run_dir", f"{directory!r} is not the run's directory ({remote_run_dir(run_id)})")


def _coordinator(read: _Fields, nodes: tuple[NodeRecord, ...]) -> CoordinatorRecord:
    node = read.name("node")
    if node not in {record.name for record in nodes}:
        read.fail("node", f"{node!r} is not a node of the run")
    return CoordinatorRecord(node=node, port=read.integer("port", 1, 65535), pid=read.integer("pid"),
                             state_file=read.text("state_file"))


# an attached run ------------------------------------------------------------------

ATTACHED_KEY = "attached"
"""The key of ``RunRecord.extra`` an attached run keeps its ``AttachedRecord`` in: its
record is history (``status``, ``logs``), not a way back to the job (its controller owns it)."""
ENDINGS = ("running", "finished", "failed", "stopped", "interrupted")
"""How an attached run ended, as its controller recorded it (running: not yet)."""
CONTROLLER_GONE = "ended (controller gone)"
"""An attached run whose controller is gone without recording the end (killed with -9,
this machine rebooted): its jobs ended with it (each node's supervisor stops its job when
the controller's connection goes), how is not known."""
OUTCOMES = ("ok", "failed", "torn down", "lost", "interrupted", "not started", "unresponsive")
"""``runlog.OutcomeState``: how one node's part ended."""
KEPT_RUNS = 200
"""The attached runs the history keeps: starting one more removes the oldest ended ones
(their records, not their log files). Detached runs' records are never pruned: they are
the way back to jobs that may still run."""


@dataclass(frozen=True)
class NodeEnding:
    """One node of an attached run, as the run's summary had it."""

    node: str
    state: str
    """One of ``OUTCOMES``."""
    exit_code: int | None = None


@dataclass(frozen=True)
class AttachedRecord:
    """An attached run: its controller (this process on this machine, known by its pid,
    its start time and the run's controller lock, as a recovering controller is), where
    its logs are, and once it ended, how."""

    pid: int
    start: int | None
    log_dir: str
    """The run's own log directory (``<--log-dir>/<run id>``), absolute."""
    ending: str = "running"
    exit_code: int | None = None
    headline: str = ""
    ended: float | None = None
    nodes: tuple[NodeEnding, ...] = ()

    def to_json_object(self) -> dict[str, object]:
        data = asdict(self)
        data["headline"] = stored_text(self.headline)
        data["nodes"] = [asdict(node) for node in self.nodes]
        return data


def attached_of(record: RunRecord) -> AttachedRecord | None:
    """The record's ``AttachedRecord``; None for a detached run."""
    data = record.extra.get(ATTACHED_KEY)
    return None if data is None else _attached(_Fields(f"run record {record.run_id}", f"extra.{ATTACHED_KEY}.", data))


def with_attached(record: RunRecord, attached: AttachedRecord) -> RunRecord:
    return replace(record, extra={**record.extra, ATTACHED_KEY: attached.to_json_object()})


def _attached(read: _Fields) -> AttachedRecord:
    log_dir = read.text("log_dir")
    if not os.path.isabs(log_dir):
        read.fail("log_dir", f"{log_dir!r} is not an absolute path")
    ending = read.text("ending")
    if ending not in ENDINGS:
        read.fail("ending", f"{ending!r} is not one of {', '.join(ENDINGS)}")
    nodes = []
    for index, data in enumerate(read.value("nodes", list)):
        item = _Fields(read.source, f"{read.where}nodes[{index}].", data)
        state = item.text("state")
        if state not in OUTCOMES:
            item.fail("state", f"{state!r} is not one of {', '.join(OUTCOMES)}")
        nodes.append(NodeEnding(item.name("node"), state, item.optional_integer("exit_code", -255, 255)))
    ended = None if read.data.get("ended") is None else read.number("ended")
    return AttachedRecord(pid=read.integer("pid"), start=read.optional_integer("start", 0),
                          log_dir=log_dir, ending=ending, exit_code=read.optional_integer("exit_code", 0, 255),
                          headline=stored_text(read.value("headline", str)), ended=ended, nodes=tuple(nodes))


def attached_state(attached: AttachedRecord, alive: bool) -> str:
    """One word (or three) for an attached run: how it ended, running while its controller
    runs, and ``CONTROLLER_GONE`` when that is gone without recording the end."""
    if attached.ending != "running":
        return attached.ending
    return "running" if alive else CONTROLLER_GONE


@dataclass(frozen=True)
class AttachedStatus:
    """What ``status`` says about an attached run: its record, and whether its controller
    still runs."""

    record: AttachedRecord
    alive: bool

    @property
    def state(self) -> str:
        """running, finished, failed, interrupted, or ``ended (controller gone)``."""
        return attached_state(self.record, self.alive)


def attached_node_states(record: RunRecord, attached: AttachedRecord, alive: bool) -> list[NodeState]:
    """``status`` of an attached run, from its record alone (its controller owns the job:
    nothing to ask the nodes): each node as the summary had it, running while the
    controller runs, unknown once it is gone without a word."""
    if attached.ending != "running":
        return [_node_ending(node, attached.ended) for node in attached.nodes]
    if alive:
        return [NodeState(node.name, "running", since=record.created) for node in record.nodes]
    gone = f"the controller (pid {attached.pid}) ended without recording how the run ended"
    return [NodeState(node.name, "unknown", detail=gone) for node in record.nodes]


def _node_ending(node: NodeEnding, ended: float | None) -> NodeState:
    if node.state in ("ok", "failed", "torn down", "interrupted") and node.exit_code is not None:
        stopped = node.state in ("torn down", "interrupted")
        return NodeState(node.node, "exited", node.exit_code, ended, node.state if stopped else "", stopped=stopped)
    return NodeState(node.node, node.state, node.exit_code, ended)


# a detached run with retries ------------------------------------------------------

RECOVERY_KEY = "recovery"
"""The key of ``RunRecord.extra`` a detached run with retries keeps its ``RecoveryRecord`` in."""
ATTEMPT_STATES = ("running", "ok", "failed", "lost", "hung", "interrupted")


@dataclass(frozen=True)
class AttemptState:
    """One attempt of a detached run with retries, as its controller recorded it."""

    number: int
    nodes: tuple[str, ...]
    ended: str
    """running (not over yet), or how it ended: ok, failed, lost, hung, interrupted."""
    headline: str = ""


@dataclass(frozen=True)
class RecoveryRecord:
    """A detached run with retries: its recovering controller, a process in the background
    on this machine (known by its pid and start time: a later process that reuses the pid
    is not it), every attempt so far, and once it ended, the run's exit code and headline."""

    pid: int
    start: int | None
    """When the process started (clock ticks since boot, /proc); None where unknown."""
    retries: int
    attempts: tuple[AttemptState, ...] = ()
    exit_code: int | None = None
    headline: str = ""
    checkpoint: str = ""
    """Where the newest checkpoint is (a run with ``[recovery] checkpoint`` and replication:
    the summary's line, kept up to date while the run goes on); empty: none said."""

    @property
    def ended(self) -> bool:
        return self.exit_code is not None

    def started(self, number: int, nodes: tuple[str, ...]) -> RecoveryRecord:
        return replace(self, attempts=(*self.attempts, AttemptState(number, nodes, "running")))

    def failed(self, number: int, headline: str) -> RecoveryRecord:
        return replace(self, attempts=tuple(replace(attempt, ended="failed", headline=headline)
                                            if attempt.number == number else attempt for attempt in self.attempts))

    def finished(self, exit_code: int, headline: str, attempts: tuple[AttemptState, ...] = ()) -> RecoveryRecord:
        """The run's end: its summary's exit code and headline, and every attempt as the
        summary has it (how each really ended; none given: as recorded so far)."""
        return replace(self, attempts=attempts or self.attempts, exit_code=exit_code, headline=headline)

    def to_json_object(self) -> dict[str, object]:
        data = asdict(self)
        data["headline"] = stored_text(self.headline)
        data["checkpoint"] = stored_text(self.checkpoint)
        kept = _kept_headlines(len(self.attempts))
        data["attempts"] = [{**asdict(attempt), "nodes": list(attempt.nodes),
                             "headline": stored_text(attempt.headline, ATTEMPT_TEXT_CHARS) if index in kept else ""}
                            for index, attempt in enumerate(self.attempts)]
        return data


def _kept_headlines(count: int) -> range | set[int]:
    """The indexes of the attempts whose headlines a record keeps (``ATTEMPT_HEADLINES``)."""
    if count <= ATTEMPT_HEADLINES:
        return range(count)
    first = ATTEMPT_HEADLINES // 4
    return set(range(first)) | set(range(count - (ATTEMPT_HEADLINES - first), count))


_UNSTORABLE = re.compile(r"[\x00-\x1f\x7f\ud800-\udfff]")


def stored_text(text: str, most: int = STORED_TEXT_CHARS) -> str:
    """``text`` as a record keeps what the job said: control characters as their escapes
    (a coloured error line must not make the record one the loader refuses), a lone
    surrogate as U+FFFD, at most ``most`` characters."""
    text = _UNSTORABLE.sub(lambda found: "\ufffd" if found.group() >= "\ud800" else f"\\x{ord(found.group()):02x}",
                           text[:most + 1])
    if len(text) > most:
        return text[:most] + " [cut: the node's log has the whole line]"
    return text


def recovery_of(record: RunRecord) -> RecoveryRecord | None:
    """The record's ``RecoveryRecord``; None for a run without retries."""
    data = record.extra.get(RECOVERY_KEY)
    return None if data is None else _recovery(_Fields(f"run record {record.run_id}", f"extra.{RECOVERY_KEY}.", data))


def with_recovery(record: RunRecord, recovery: RecoveryRecord) -> RunRecord:
    return replace(record, extra={**record.extra, RECOVERY_KEY: recovery.to_json_object()})


def _recovery(read: _Fields) -> RecoveryRecord:
    attempts = []
    for index, data in enumerate(read.value("attempts", list)):
        item = _Fields(read.source, f"{read.where}attempts[{index}].", data)
        nodes = item.texts("nodes")
        if not all(_NAME.match(node) for node in nodes):
            item.fail("nodes", "expected host names")
        ended = item.text("ended")
        if ended not in ATTEMPT_STATES:
            item.fail("ended", f"{ended!r} is not one of {', '.join(ATTEMPT_STATES)}")
        attempts.append(AttemptState(item.integer("number"), nodes, ended, stored_text(item.value("headline", str))))
    return RecoveryRecord(pid=read.integer("pid"), start=read.optional_integer("start", 0),
                          retries=read.integer("retries", 0), attempts=tuple(attempts),
                          exit_code=read.optional_integer("exit_code", 0, 255),
                          headline=stored_text(read.value("headline", str)),
                          checkpoint=stored_text(read.optional("checkpoint", str) or ""))


@dataclass(frozen=True)
class RecoveryStatus:
    """What ``status`` says about a detached run's recovery: what its controller recorded,
    and whether that controller still runs."""

    record: RecoveryRecord
    alive: bool


def controller_lock(run_id: str, directory: Path | None = None) -> Path:
    """The file the background controller of ``run_id`` holds locked for as long as it
    lives, in the private run-record directory: what tells it from a process that reuses
    its pid (after a reboot, or where there is no /proc to read its start time)."""
    return (directory or runs_dir()) / f"{run_id}.controller.lock"


def hold_controller_lock(run_id: str, directory: Path | None = None, timeout: float = 10.0) -> int:
    """The background controller: locks its run's file and writes its pid in it. The
    descriptor is never closed: the kernel releases the lock when the process ends, however
    it ends. Not inherited by the processes it starts (Python's descriptors are not)."""
    path = controller_lock(run_id, directory)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    deadline = time.monotonic() + timeout
    while True:  # a ``status`` may hold it shared for a moment
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise
            time.sleep(0.05)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _lock_holder(run_id: str, directory: Path | None = None) -> int | None:
    """The pid written in the run's controller lock while some process holds it locked;
    None when no one does (the controller ended, or never ran on this machine)."""
    try:
        fd = os.open(controller_lock(run_id, directory), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None  # taken: nobody holds it (closing the file lets it go)
        except OSError as error:
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None
        text = os.read(fd, 32).decode("ascii", "replace").strip()
        return int(text) if text.isascii() and text.isdigit() else None
    finally:
        os.close(fd)


def controller_alive(recovery: RecoveryRecord, run_id: str) -> bool:
    """Whether the recovering controller of ``run_id`` still runs (``holds_lock``)."""
    return holds_lock(run_id, recovery.pid, recovery.start)


def holds_lock(run_id: str, pid: int, start: int | None, directory: Path | None = None) -> bool:
    """Whether the controller of ``run_id`` (pid ``pid``, started at ``start``) still runs:
    it holds its run's lock (``controller_lock``), with that pid written in it; where /proc
    says, also started then, and not a zombie. A pid alone is never enough: after a reboot
    or a crash it is another process's, perhaps another user's."""
    if _lock_holder(run_id, directory) != pid:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            fields = file.read().rsplit(b")", 1)[1].split()
    except OSError:
        return True  # no /proc (macOS): the lock is the proof
    except IndexError:
        return False
    # after the command: state is field 3, the start time field 22 (proc(5))
    return fields[0] != b"Z" and (start is None or fields[19:20] == [str(start).encode()])


def save(record: RunRecord, directory: Path | None = None) -> Path:
    """Writes the record atomically (a concurrent ``status`` never reads half of it)."""
    directory = directory or runs_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)  # how to reach the nodes: the user's only, however it was made
    path = directory / f"{record.run_id}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as file:
        file.write(record.to_json())
    os.replace(tmp, path)
    return path


AMBIGUOUS_SHOWN = 10
"""The runs an ambiguous run id lists."""


def load(run_id: str, directory: Path | None = None) -> RunRecord:
    """The record of ``run_id``; a unique prefix (or the last characters) is enough, never
    a part in the middle (``stop 1200`` would stop whichever run started at 12:00)."""
    if not is_run_id(run_id):  # never a path: "../../x" must not name a file
        raise UsageError(f"run id {run_id!r}: not a run id (letters, digits and '-')",
                         "torchherd status lists the known runs")
    directory = directory or runs_dir()
    exact = directory / f"{run_id}.json"
    if exact.is_file():
        return read_record(exact)
    matches = [path for path in _record_files(directory) if path.stem.startswith(run_id) or path.stem.endswith(run_id)]
    if len(matches) == 1:
        return read_record(matches[0])
    if matches:  # one line still, however many runs the state directory holds
        shown = ", ".join(path.stem for path in matches[:AMBIGUOUS_SHOWN])
        more = f", ... ({len(matches)} in all)" if len(matches) > AMBIGUOUS_SHOWN else ""
        raise UsageError(f"run id {run_id!r} is ambiguous: {shown}{more}", "give more of the run id")
    raise UsageError(f"no run {run_id!r} in {directory}", "torchherd status lists the known runs")


def read_record(path: Path) -> RunRecord:
    """The record in ``path``; RecordError (exit 2) names the file and what is wrong."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_RECORD_BYTES + 1)
    except OSError as error:
        raise RecordError(f"{path}: cannot read the run record: {error.strerror}") from None
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError(f"{path}: larger than {MAX_RECORD_BYTES >> 20} MiB: not a run record", _DAMAGED)
    return RunRecord.from_json(data.decode("utf-8", "replace"), str(path))


def load_all(directory: Path | None = None) -> list[RunRecord]:
    """Every readable record, oldest first."""
    return scan(directory)[0]


def scan(directory: Path | None = None) -> tuple[list[RunRecord], list[RecordError]]:
    """Every readable record, oldest first, and what is wrong with each damaged one (its
    error names the file): ``status`` lists those too, never hides a run."""
    records, damaged = [], []
    for path in _record_files(directory or runs_dir()):
        try:
            records.append(read_record(path))
        except RecordError as error:
            damaged.append(error)
    return sorted(records, key=lambda record: record.created), damaged


def prune(directory: Path | None = None, keep: int = KEPT_RUNS) -> list[str]:
    """Keeps the history bounded: removes the records (and controller locks) of the oldest
    attached runs beyond ``keep``, never one whose controller still runs; returns their ids.
    Detached runs are not touched, nor damaged records (``status`` shows those)."""
    directory = directory or runs_dir()
    attached = []
    for record in scan(directory)[0]:
        found = attached_of(record)
        if found is not None:
            attached.append((record, found))
    removed = []
    for record, found in attached[:max(0, len(attached) - keep)]:
        if found.ending == "running" and holds_lock(record.run_id, found.pid, found.start, directory):
            continue
        for path in (directory / f"{record.run_id}.json", controller_lock(record.run_id, directory)):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        removed.append(record.run_id)
    return removed


def _record_files(directory: Path) -> list[Path]:
    try:
        return sorted(path for path in directory.iterdir() if path.suffix == ".json")
    except OSError:
        return []


@dataclass(frozen=True)
class NodeState:
    """What ``status`` says about one node."""

    node: str
    state: str
    """running, exited, gone (the supervisor vanished without a word), unreachable, unknown."""
    code: int | None = None
    since: float | None = None
    detail: str = ""
    stopped: bool = False
    """The supervisor had signalled the job before it ended (stop, a teardown): its exit
    code is how the job died of that, not a failure of its own."""


def parse_node_state(node: str, state_text: str, alive: bool) -> NodeState:
    """A node's state file (written by its supervisor) and whether the supervisor still runs."""
    try:
        fields = json.loads(state_text) if state_text.strip() else None
    except ValueError:
        fields = None
    if not isinstance(fields, dict):
        if alive:
            return NodeState(node, "running", detail="no state file yet")
        return NodeState(node, "unknown", detail="no state file on the node")
    if fields.get("state") == "exited":
        code = fields.get("code")
        stopped = fields.get("stopped")
        return NodeState(node, "exited", int(code) if isinstance(code, int) else None, _float(fields.get("ended")),
                         f"stopped ({stopped[:200]})" if isinstance(stopped, str) else "",
                         stopped=isinstance(stopped, str))
    if alive:
        return NodeState(node, "running", since=_float(fields.get("started")))
    return NodeState(node, "gone", since=_float(fields.get("started")),
                     detail="the supervisor is gone without recording an exit (killed, or the node rebooted)")


def _float(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def describe_since(since: float | None, now: float | None = None) -> str:
    """``2024-05-01 12:00:03 (5m ago)``; ``-`` when unknown."""
    if since is None:
        return "-"
    now = time.time() if now is None else now
    ago = max(0, int(now - since))
    span = f"{ago}s" if ago < 120 else f"{ago // 60}m" if ago < 7200 else f"{ago // 3600}h"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) + f" ({span} ago)"
