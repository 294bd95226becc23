"""A run's bookkeeping, written once for every backend: the node log files, the
dispatch of a batch of lines and records to the observer, the highest rank, the run
record of a detached run, and the report of a detached run's output.

Each backend reads its nodes its own way (a supervisor's record stream over SSH,
SLURM's output files); what it reads goes through here, so the log files, the events
and the records are the same whichever backend ran the job.
"""

from __future__ import annotations

import os
import pwd
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Mapping, Sequence, TypeVar, Union

from torchherd.engine.events import NodeStatus, Observer, Output, RanksRunning
from torchherd.engine.outcome import OutputTrack
from torchherd.engine.records import CoordinatorRecord, NodeRecord, RunRecord
from torchherd.errors import TorchherdError
from torchherd.inventory import Host
from torchherd.plan import Plan
from torchherd.runlog import OutputLine, RankLines, Status, flat
from torchherd.transport import Connector
from torchherd.transport.ssh import SshConnector

Item = TypeVar("Item")
Line = Union[OutputLine, RankLines]


# the node logs ------------------------------------------------------------------------


class LogDir:
    """A run's log directory on this machine (``<log dir>/<run id>``), held open: every file
    of the run is opened relative to it. Where the parent of ``--log-dir`` is writable by
    others (a group project), the directory could be renamed away and another put in its
    place between two attempts; files opened through the path would then be theirs to
    read. Through this descriptor they stay in the directory that was checked."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    def open(self, name: str, flags: int) -> int:
        """``name`` in the directory, opened (created 0600) with ``flags``, never through a
        symbolic link; refused unless it is the user's own regular file (made private)."""
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
        try:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid():
                raise TorchherdError(f"{self.path / name}: not your own file ({_owner(found.st_uid)}'s): not written",
                                     "someone else can write the log directory's parent: choose a --log-dir "
                                     "only you can write")
            if found.st_mode & 0o077:
                os.fchmod(fd, 0o600)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


_LOG_DIRS: OrderedDict[Path, LogDir] = OrderedDict()
_LOG_DIRS_LOCK = threading.Lock()
KEPT_LOG_DIRS = 64
"""Run log directories kept open by one process (each attempt of a run finds its own
again); one no longer kept is closed once nothing uses it."""


def log_dir(path: Path) -> LogDir:
    """The run's log directory, made (0700) and checked the first time this process asks
    for it (the user's own, private), then the same open directory for every later
    attempt, wherever its path leads by then. TorchherdError when it is someone else's."""
    key = Path(os.path.abspath(path))
    with _LOG_DIRS_LOCK:
        found = _LOG_DIRS.get(key)
        if found is not None:
            _LOG_DIRS.move_to_end(key)
            return found
        key.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(key, 0o700)
        except FileExistsError:
            pass
        fd = os.open(key, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        made = LogDir(key, fd)
        seen = os.fstat(fd)
        if seen.st_uid != os.geteuid():
            raise TorchherdError(f"{key}: the run's log directory is {_owner(seen.st_uid)}'s, not yours: not used",
                                 "someone else can write its parent: choose a --log-dir only you can write")
        if seen.st_mode & 0o077:
            os.fchmod(fd, 0o700)
        _LOG_DIRS[key] = made
        while len(_LOG_DIRS) > KEPT_LOG_DIRS:
            _LOG_DIRS.popitem(last=False)
        return made


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def log_bytes(chunk: Line) -> bytes:
    """A line or a block as the node's log file keeps it."""
    if isinstance(chunk, RankLines):
        return chunk.log_bytes()
    return (chunk.log_text() + "\n").encode("utf-8", "replace")


class NodeLog:
    """One node's log file: private (0600, whatever the umask), never written through a
    symlink someone put in its place, and appended to (following a run again, or the
    next attempt of a run with retries, goes on in the same file), after ``marker`` (the
    line that opens an attempt's part). Written by one thread."""

    def __init__(self, path: Path, marker: bytes = b"") -> None:
        self.path = path
        fd = log_dir(path.parent).open(path.name, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        self._file: IO[bytes] = os.fdopen(fd, "ab")
        if marker:
            self._file.write(marker)
            self._file.flush()

    def write(self, chunks: Iterable[object]) -> None:
        """Appends the lines and blocks among ``chunks`` (anything else is not output), at once."""
        text = b"".join(log_bytes(chunk) for chunk in chunks if isinstance(chunk, (OutputLine, RankLines)))
        if text:
            self._file.write(text)
            self._file.flush()

    def close(self) -> None:
        self._file.close()


class NodeLogs:
    """Every node's log of one run, each opened at its node's first line (after ``marker``,
    the line that opens an attempt's part, when there is one)."""

    def __init__(self, log_dir: Path, marker: bytes = b"") -> None:
        self.log_dir = log_dir
        self.marker = marker
        self._logs: dict[str, NodeLog] = {}

    def write(self, chunks: Sequence[object]) -> None:
        by_node: dict[str, list[Line]] = {}
        for chunk in chunks:
            if isinstance(chunk, (OutputLine, RankLines)):
                by_node.setdefault(chunk.node, []).append(chunk)
        for node, lines in by_node.items():
            if node not in self._logs:
                self._logs[node] = NodeLog(self.log_dir / f"{node}.log", self.marker)
            self._logs[node].write(lines)

    def close(self) -> None:
        for log in self._logs.values():
            log.close()


# the observer ------------------------------------------------------------------------


def dispatch(items: Iterable[Item], emit: Observer, track: Callable[[str], OutputTrack | None],
             other: Callable[[Item], None]) -> None:
    """Reports a batch in its order: consecutive lines as one ``Output`` (a node's first
    rank line after ``RanksRunning``: it got through the rendezvous), and each item that
    is not a line to ``other``, between them. ``track``: the node's tracker (None: a node
    not tracked)."""
    lines: list[Line] = []

    def flush() -> None:
        if lines:
            emit(Output(tuple(lines)))
            lines.clear()

    for item in items:
        if isinstance(item, (OutputLine, RankLines)):
            tracker = track(item.node)
            if tracker is not None and tracker.take(item):
                flush()
                emit(RanksRunning(item.node))
            lines.append(item)
            continue
        flush()
        other(item)
    flush()


def report(items: Iterable[object], observer: Observer, node: str | None = None,
           rank: int | None = None) -> None:
    """A detached run's output as ``logs`` reports it: lines as ``Output``, status records
    as ``NodeStatus``, in order; only ``node``'s and ``rank``'s when given."""
    lines: list[OutputLine] = []
    for item in items:
        if isinstance(item, Status):
            if lines:
                observer(Output(tuple(lines)))
                lines = []
            if node is None or item.node == node:
                observer(NodeStatus(item))
        elif isinstance(item, (OutputLine, RankLines)):
            lines += [line for line in flat((item,))
                      if (node is None or line.node == node) and (rank is None or line.rank == rank)]
    if lines:
        observer(Output(tuple(lines)))


# ranks and records -------------------------------------------------------------------


def max_rank(plan: Plan, nodes: int | None = None) -> int:
    """The highest global rank: every node's own count summed, less one; on ``nodes``
    nodes (SLURM's, when not the plan's own hosts) each with the plan's largest count.
    99 when a node's count is found there ("gpu", "auto")."""
    counts = [node.nproc_per_node for node in plan.nodes]
    if not all(isinstance(count, int) for count in counts):
        return 99
    if nodes is None or nodes == len(counts):
        return sum(int(count) for count in counts) - 1
    return nodes * max(int(count) for count in counts) - 1


def node_record(host: Host, log_file: str, state_file: str, workdir: str | None = None) -> NodeRecord:
    """What it takes to reach a node of a detached run again, and its files there."""
    return NodeRecord(name=host.name, address=host.address, user=host.user, ssh_port=host.ssh_port,
                      identity_file=host.identity_file, python=host.python,
                      workdir=host.workdir if workdir is None else workdir, log_file=log_file, state_file=state_file,
                      transport=host.transport)


def run_record(plan: Plan, grace: float, nodes: Sequence[NodeRecord], ranks: int,
               coordinator: CoordinatorRecord | None = None, extra: Mapping[str, Any] | None = None) -> RunRecord:
    """A detached run's record (``records.save`` keeps it): how to find every node again."""
    inventory = plan.inventory
    ssh_config = inventory.cluster.ssh_config
    return RunRecord(run_id=plan.run_id, inventory=str(inventory.path.resolve()), created=time.time(),
                     command=(plan.options.script, *plan.options.script_args), nodes=tuple(nodes),
                     max_rank=ranks, grace=grace, ssh_config=str(ssh_config) if ssh_config else None,
                     ssh_timeout=inventory.cluster.ssh_timeout, coordinator=coordinator, extra=dict(extra or {}))


def attempt_marker(attempt: int, nodes: Sequence[str]) -> bytes:
    """The line that opens an attempt's part of a node log (``run --retries``)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return f"==== torchherd: attempt {attempt} at {stamp} on {','.join(nodes)} ====\n".encode()


def _ssh_config(record: RunRecord) -> Path | None:
    return Path(record.ssh_config) if record.ssh_config else None


def connector_for(record: RunRecord, timeout: float | None = None) -> Connector:
    """The connector the run was started with, rebuilt from its record."""
    return SshConnector(_ssh_config(record), record.ssh_timeout if timeout is None else timeout)
