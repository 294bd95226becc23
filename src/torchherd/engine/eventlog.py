"""A run's history: every typed event and every node sample, appended as it arrives to
``events.jsonl`` in the run's log directory (``<log dir>/<run id>/``, private as its
node logs are), read back as typed objects (``read_history``) by ``logs --events``,
``report`` and ``torchherd.events_of``.

One JSON object a line, in arrival order, ``t`` its wall-clock time (seconds since the epoch):

- an event: ``{"t": ..., "event": "AttemptStarted", "data": {its fields}}``;
- a sample: ``{"t": ..., "sample": KIND, "node": NODE, "data": {...}}``, KIND one of
  ``gpu``, ``busy``, ``progress`` (the supervisor's status record's fields), ``lines``
  (``{"total": N}``: the lines the node printed so far, written at most every
  ``LINES_EVERY`` seconds), or the name of a transfer's progress event (``PullProgress``,
  ``WheelsProgress``, ``ArchiveProgress``).

The ranks' lines themselves are in the node logs, not here; only the lines after a hang
was found (the ranks' stacks, ``STACK_LINES`` at most) are kept, as ``Output`` events.

The bound: the file never passes ``HISTORY_CAP`` bytes (32 MiB). A record that would take
it past the cap first has the file rewritten (atomically) with every other sample of each
node's stream of each kind, events all kept, and from then on only every 2**level-th
sample of a stream is written: the samples' density halves each time the file fills, so a
run of any length and size keeps its whole span at an even density (a week of 1,000 nodes
sampled every 2 s: 10 halvings, a sample every half hour per node and kind). Where the events
alone fill three quarters of the cap, samples stop; where they fill it, nothing more is
written. Bursts of bar updates are taken at most every ``PROGRESS_EVERY`` seconds per node.
"""

from __future__ import annotations

import enum
import json
import os
import threading
import time
import types
import typing
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Union, get_type_hints

from torchherd.checks.results import CheckReport, CheckResult, ProbeResult
from torchherd.engine import events as event_types
from torchherd.engine.bookkeeping import LogDir, log_dir
from torchherd.engine.events import (
    ArchiveProgress,
    AttemptFailed,
    Event,
    HangFound,
    NodeStatus,
    Observer,
    Output,
    PullProgress,
    RunFinished,
    RunStarted,
    WheelsProgress,
)
from torchherd.engine.records import RunRecord, attached_of
from torchherd.errors import TorchherdError, TransportError
from torchherd.runlog import (
    AttemptRecord,
    NodeOutcome,
    RankLines,
    RunSummary,
    Slowest,
    Status,
    flat,
)

HISTORY_FILE = "events.jsonl"
HISTORY_KEY = "history"
"""The key of ``RunRecord.extra`` a detached run with retries names its history file in
(an attached run's is in its log directory, ``AttachedRecord.log_dir``)."""
HISTORY_CAP = 32 << 20
"""Bytes the history file may hold (see the module's docstring)."""
LINES_EVERY = 2.0
"""Seconds between two ``lines`` samples of a node."""
PROGRESS_EVERY = 2.0
"""Seconds between two bar samples of a node kept (its supervisor sends one every 0.25 s)."""
STACK_LINES = 2000
"""Lines kept after a hang was found: the ranks' stacks as they die."""
PENDING_RECORDS = 10_000
"""Records held before the run's log directory is known (its ``RunStarted``): the sync,
the venvs, the preflight. Beyond, they are not kept."""
SAMPLE_STATUSES = frozenset({"gpu", "busy", "progress"})
TRANSFER_SAMPLES = (PullProgress, WheelsProgress, ArchiveProgress)


@dataclass(frozen=True)
class LinesSeen:
    """``node`` had printed ``total`` lines by then (its ranks, torchrun and its shell)."""

    node: str
    total: int


Recordable = Union[Event, LinesSeen]


@dataclass(frozen=True)
class Recorded:
    """One record of a run's history: ``event`` as it arrived at ``at`` (seconds since the epoch)."""

    at: float
    event: Recordable


# encoding ----------------------------------------------------------------------------

_NESTED: dict[str, type] = {cls.__name__: cls for cls in (
    CheckReport, CheckResult, ProbeResult, RunSummary, NodeOutcome, AttemptRecord, Slowest, Status,
    event_types.NodeSynced, event_types.SyncFailed, event_types.VenvReady, event_types.VenvFailed,
    event_types.NodePulled, event_types.PullFailed)}
EVENT_TYPES: dict[str, type] = {name: value for name, value in vars(event_types).items()
                                if isinstance(value, type) and is_dataclass(value)
                                and value.__module__ == event_types.__name__ and name != "Collector"}


def encoded(value: Any) -> Any:
    """``value`` as JSON holds it: a dataclass as its fields (``_type`` naming it), a
    NamedTuple and a tuple as a list, an enum as its value, a transport error as its parts."""
    if is_dataclass(value) and not isinstance(value, type):
        found = {"_type": type(value).__name__}
        found.update({field.name: encoded(getattr(value, field.name)) for field in fields(value)})
        return found
    if isinstance(value, TransportError):
        return {"_type": "TransportError", "node": value.node, "kind": value.kind, "message": str(value),
                "hint": value.hint}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [encoded(item) for item in value]
    if isinstance(value, dict):
        return {str(key): encoded(item) for key, item in value.items()}
    if isinstance(value, typing.Mapping):
        return {str(key): encoded(item) for key, item in value.items()}
    return value


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """``cls``'s fields' types (resolved once a class: ``get_type_hints`` is slow)."""
    found = _HINTS.get(cls)
    if found is None:
        found = _HINTS[cls] = get_type_hints(cls)
    return found


def decoded(hint: Any, value: Any) -> Any:
    """``value`` (as ``encoded`` wrote it) as an object of type ``hint``."""
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin is Union or origin is types.UnionType:
        return _decoded_union(typing.get_args(hint), value)
    if origin in (tuple, list, typing.Sequence, typing.get_origin(typing.Sequence[int])):
        args = typing.get_args(hint)
        if origin is tuple and args and args[-1] is not Ellipsis:
            return tuple(decoded(arg, item) for arg, item in zip(args, value))
        items = [decoded(args[0] if args else Any, item) for item in value]
        return items if origin is list else tuple(items)
    if isinstance(value, dict) and "_type" in value:
        return _object(value)
    if isinstance(hint, type):
        if issubclass(hint, enum.Enum):
            return hint(value)
        if is_dataclass(hint):
            return _object({"_type": hint.__name__, **value})
        if issubclass(hint, tuple) and hasattr(hint, "_fields"):
            return hint(*value)
        if hint is float and isinstance(value, int):
            return float(value)
    return value


def _decoded_union(members: tuple[Any, ...], value: Any) -> Any:
    if isinstance(value, dict) and "_type" in value:
        return _object(value)
    for member in members:
        if isinstance(member, type) and hasattr(member, "_fields") and isinstance(value, list):
            return member(*value)
    for member in members:
        if member is not type(None):
            return decoded(member, value)
    return value


def _object(value: dict[str, Any]) -> Any:
    name = value["_type"]
    if name == "TransportError":
        return TransportError(value["node"], value["kind"], value["message"], value.get("hint", ""))
    cls = _NESTED.get(name) or EVENT_TYPES.get(name)
    if cls is None:
        raise ValueError(f"unknown type {name}")
    hints = _hints(cls)
    return cls(**{key: decoded(hints[key], item) for key, item in value.items() if key in hints})


def event_line(at: float, event: Event) -> str:
    data = encoded(event)
    del data["_type"]
    return json.dumps({"t": round(at, 3), "event": type(event).__name__, "data": data},
                      separators=(",", ":"), ensure_ascii=False) + "\n"


def sample_line(at: float, kind: str, node: str, data: Any) -> str:
    return json.dumps({"t": round(at, 3), "sample": kind, "node": node, "data": data},
                      separators=(",", ":"), ensure_ascii=False) + "\n"


def recorded_of(record: dict[str, Any]) -> Recorded | None:
    """One line's record as a typed object; None for a kind this version does not know."""
    at = float(record["t"])
    if "event" in record:
        cls = EVENT_TYPES.get(record["event"])
        if cls is None:
            return None
        return Recorded(at, _object({"_type": record["event"], **record["data"]}))
    kind, node, data = record["sample"], record["node"], record["data"]
    if kind in SAMPLE_STATUSES:
        return Recorded(at, NodeStatus(Status(node, kind, {"event": kind, **data})))
    if kind == "lines":
        return Recorded(at, LinesSeen(node, int(data["total"])))
    if kind in EVENT_TYPES:
        return Recorded(at, _object({"_type": kind, **data}))
    return None


def history_file(record: RunRecord) -> Path | None:
    """Where the run's history is kept; None for a run without one (a plain detached run:
    no controller stays to receive its events)."""
    attached = attached_of(record)
    if attached is not None:
        return Path(attached.log_dir) / HISTORY_FILE
    named = record.extra.get(HISTORY_KEY)
    return Path(named) if isinstance(named, str) else None


def read_history(path: Path) -> list[Recorded]:
    """Every record of a history file, in order (a line cut short or damaged is left out).
    OSError when the file cannot be read."""
    found = []
    with open(path, encoding="utf-8", errors="replace") as file:
        for line in file:
            try:
                record = recorded_of(json.loads(line))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            if record is not None:
                found.append(record)
    return found


# recording -----------------------------------------------------------------------------


def _stream(record: str) -> tuple[str, str] | None:
    """(kind, node) of a sample line; None for an event's."""
    if not record.startswith('{"t":') or '"sample":' not in record[:40]:
        return None
    parsed = json.loads(record)
    return parsed["sample"], parsed["node"]


class HistoryRecorder:
    """The observer that keeps a run's history (see the module's docstring). Called from
    several threads (a recovering run's): one lock. When the file cannot be written, it
    says so once through ``failed`` and records nothing more; the run goes on."""

    def __init__(self, cap: int = HISTORY_CAP, clock: Callable[[], float] = time.time,
                 failed: Callable[[str], None] | None = None) -> None:
        self.cap = cap
        self.clock = clock
        self.on_failure = failed
        self.level = 0
        """Halvings so far: every 2**level-th sample of a stream is written."""
        self.size = 0
        self.path: Path | None = None
        self._dir: LogDir | None = None
        self._fd: int | None = None
        self._pending: list[str] = []
        self._counts: dict[tuple[str, str], int] = {}
        self._bar_at: dict[str, float] = {}
        self._lines: dict[str, int] = {}
        self._lines_written: dict[str, int] = {}
        self._lines_at = 0.0
        self._stack_left = 0
        self._samples = True
        self._closed = False
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                self._record(event, self.clock())
            except (OSError, TorchherdError) as error:
                self._fail(error)

    def _record(self, event: Event, now: float) -> None:
        if isinstance(event, Output):
            self._output(event, now)
            return
        if isinstance(event, NodeStatus) and event.status.event in SAMPLE_STATUSES:
            self._status_sample(event.status, now)
            return
        if isinstance(event, TRANSFER_SAMPLES):
            data = encoded(event)
            del data["_type"]
            self._sample(type(event).__name__, event.node, data, now)
            return
        if isinstance(event, RunStarted) and self._fd is None:
            self._open(Path(event.log_dir))
        if isinstance(event, (RunFinished, AttemptFailed, HangFound)):  # the counts up to the moment
            self._flush_lines(now)
        if isinstance(event, HangFound):
            self._stack_left = STACK_LINES
        self._write(event_line(now, event), sample=None)
        if isinstance(event, RunFinished):  # the run's last event
            self._close()

    def _output(self, event: Output, now: float) -> None:
        for chunk in event.lines:
            count = chunk.records.count(b"\n") - 1 if isinstance(chunk, RankLines) else 1
            self._lines[chunk.node] = self._lines.get(chunk.node, 0) + count
        if self._stack_left > 0:
            lines = flat(event.lines)[:self._stack_left]
            self._stack_left -= len(lines)
            self._write(event_line(now, Output(tuple(lines))), sample=None)
        if now - self._lines_at >= LINES_EVERY:
            self._flush_lines(now)

    def _flush_lines(self, now: float) -> None:
        self._lines_at = now
        for node, total in self._lines.items():
            if self._lines_written.get(node) != total:
                self._lines_written[node] = total
                self._sample("lines", node, {"total": total}, now)

    def _status_sample(self, status: Status, now: float) -> None:
        if status.event == "progress":
            if now - self._bar_at.get(status.node, -PROGRESS_EVERY) < PROGRESS_EVERY:
                return
            self._bar_at[status.node] = now
        data = {key: value for key, value in status.fields.items() if key != "event"}
        self._sample(status.event, status.node, data, now)

    def _sample(self, kind: str, node: str, data: Any, now: float) -> None:
        if not self._samples:
            return
        key = (kind, node)
        count = self._counts.get(key, 0)
        self._counts[key] = count + 1
        if count % (1 << self.level) == 0:
            self._write(sample_line(now, kind, node, data), sample=key)

    def _write(self, line: str, sample: tuple[str, str] | None) -> None:
        data = line.encode("utf-8")
        if self._fd is None:
            if len(self._pending) < PENDING_RECORDS:
                self._pending.append(line)
            return
        if self.size + len(data) > self.cap:
            self._compact()
            if sample is not None and not self._samples:
                return
            if self.size + len(data) > self.cap:
                self._closed = True  # the events alone filled it: nothing more is written
                return
        os.write(self._fd, data)
        self.size += len(data)

    def _open(self, directory: Path) -> None:
        self._dir = log_dir(directory)
        self.path = self._dir.path / HISTORY_FILE
        self._fd = self._dir.open(HISTORY_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        self.size = os.fstat(self._fd).st_size
        pending, self._pending = self._pending, []
        for line in pending:
            self._write(line, sample=_stream(line))

    def _compact(self) -> None:
        """Every other sample of each stream dropped from the file (atomically), the level up."""
        assert self._dir is not None and self._fd is not None
        kept = list(_thinned(self._read_back()))
        self.level += 1
        events_size = sum(len(line) for line, sample in kept if sample is None)
        if events_size > self.cap * 3 // 4:
            self._samples = False
            kept = [(line, sample) for line, sample in kept if sample is None]
        temporary = HISTORY_FILE + ".new"
        try:
            os.unlink(temporary, dir_fd=self._dir.fd)
        except FileNotFoundError:
            pass
        fd = self._dir.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            data = b"".join(line for line, _sample in kept)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.rename(temporary, HISTORY_FILE, src_dir_fd=self._dir.fd, dst_dir_fd=self._dir.fd)
        os.close(self._fd)
        self._fd = self._dir.open(HISTORY_FILE, os.O_WRONLY | os.O_APPEND)
        self.size = len(data)

    def _read_back(self) -> Iterator[tuple[bytes, tuple[str, str] | None]]:
        assert self._dir is not None
        fd = self._dir.open(HISTORY_FILE, os.O_RDONLY)
        with os.fdopen(fd, "rb") as file:
            for line in file:
                if line.endswith(b"\n"):
                    yield line, _stream(line.decode("utf-8", "replace"))

    def _fail(self, error: BaseException) -> None:
        self._closed = True
        if self.on_failure is not None:
            where = self.path or getattr(error, "filename", None) or HISTORY_FILE
            why = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
            self.on_failure(f"{where}: {why}")

    def keep_in(self, directory: Path) -> None:
        """Writes into ``directory`` (the run's log directory) from now on, what came before
        first: a run that says no ``RunStarted`` here (a detached one's foreground)."""
        with self._lock:
            if self._fd is None and not self._closed:
                try:
                    self._open(directory)
                except (OSError, TorchherdError) as error:
                    self._fail(error)

    def close(self) -> None:
        """Writes the line counts not written yet; closes the file."""
        with self._lock:
            if self._closed:
                return
            try:
                self._flush_lines(self.clock())
            except (OSError, TorchherdError) as error:
                self._fail(error)
            self._close()

    def _close(self) -> None:
        self._closed = True
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _thinned(lines: Iterator[tuple[bytes, tuple[str, str] | None]]) -> Iterator[tuple[bytes, tuple[str, str] | None]]:
    seen: dict[tuple[str, str], int] = {}
    for line, sample in lines:
        if sample is None:
            yield line, sample
            continue
        count = seen.get(sample, 0)
        seen[sample] = count + 1
        if count % 2 == 0:
            yield line, sample


def recording(observer: Observer, recorder: HistoryRecorder) -> Observer:
    """``observer`` with every event recorded first."""
    def both(event: Event) -> None:
        recorder(event)
        observer(event)
    return both
