"""The run's output as data: the supervisors' framed records cut into lines, each
line's rank parsed back off torch's prefix, and the per-node outcome of a run.

Pure: no sockets, no threads, no terminal. ``launch`` feeds bytes in, the console
renders what comes out, and the unit tests check both with exact text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Literal, NamedTuple, Sequence, Union

from torchherd.remote import wire
from torchherd.remote.wire import RANK_PREFIX_END, RANK_PREFIX_HEAD, StatusEvent

STDOUT = "out"
STDERR = "err"

# A record's first byte, as an int (``record[0]``).
TAG_STDOUT = wire.TAG_STDOUT_ORD
TAG_STDERR = wire.TAG_STDERR_ORD
TAG_HEARTBEAT = wire.TAG_HEARTBEAT_ORD
TAG_STATUS = wire.TAG_STATUS_ORD

_HEAD = re.escape(RANK_PREFIX_HEAD)
_END = re.escape(RANK_PREFIX_END)
_OUT = re.escape(wire.TAG_STDOUT)
_ERR = re.escape(wire.TAG_STDERR)
_RANK_PREFIX = re.compile(_HEAD + rb"(\d+)" + _END)
OUT_HEAD = b"\n" + wire.TAG_STDOUT + RANK_PREFIX_HEAD
"""How a rank's stdout record starts inside a block (every record follows a newline)."""
ERR_HEAD = b"\n" + wire.TAG_STDERR + RANK_PREFIX_HEAD
_HEARTBEATS = b"\n" + wire.HEARTBEAT_RECORD
# A rank prefix the bulk path must not take: not digits, a leading zero, no "] ".
_ODD_RANK_PREFIX = re.compile(rb"\n[" + _OUT + _ERR + rb"]" + _HEAD + rb"(?!(?:0|[1-9]\d*)" + _END + rb")")
OUT_RANKS = re.compile(rb"\n" + _OUT + _HEAD + rb"(\d+)" + _END)
ERR_RANKS = re.compile(rb"\n" + _ERR + _HEAD + rb"(\d+)" + _END)
_ERR_RECORDS = re.compile(rb"\n" + _ERR + rb"[^\n]*")
# Status records that only feed the live view (a bar's state, GPU samples): taken out of a
# chunk of rank lines so that the rest stays on the bytes path.
_SIDE_RECORDS = re.compile(rb"\n" + re.escape(wire.TAG_STATUS) + rb'\{"event":"(?:gpu|progress|busy)"[^\n]*')
# Every line is_error_line accepts holds one of these words (in any case).
_ERROR_WORDS = (b"error", b"fatal", b"exception", b"interrupt", b"exit", b"[errno ", b"terminate called")
# torchrun's failure report names the root-cause rank as "  rank      : 3 (local_rank: 1)".
_ROOT_CAUSE_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank")
# ... and its exit code, under "Root Cause (first observed failure):", as "  exitcode  : 7 (pid: 12)".
_ROOT_CAUSE_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
# The line of a Python traceback that says what went wrong ("ValueError: boom"); torch
# repeats a rank's traceback with "[rank3]: " before each line.
_TORCH_RANK_TAG = re.compile(r"^\[rank\d+\]:\s*")
_OS_ERROR = re.compile(r"\[Errno \d+\]")
_EXCEPTION_LINE = re.compile(r"^(\[rank\d+\]:\s*)?[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b(:|$)")
_PEER_GONE = re.compile(r"connection closed by peer|connection reset by peer|remote worker crashing|broken pipe|"
                        r"remote process exited|ncclRemoteError|watchdog caught collective operation timeout",
                        re.IGNORECASE)
"""What gloo ("Connection closed by peer ... typically caused by a remote worker crashing"),
NCCL ("remote process exited or there was a network error", its watchdog's timeout) and the
c10d store raise in a rank whose peer went away."""


class OutputLine(NamedTuple):
    """One complete line a node's job printed (a tuple: a chatty job makes millions)."""

    node: str
    rank: int | None
    """The global rank that printed it, or None for torchrun's (or the shell's) own lines."""
    stream: str
    text: str

    def described(self) -> str:
        """The line for a summary: which rank said it, then what it said."""
        text = self.text.strip()
        if self.rank is None:
            return text
        return f"rank {self.rank}: {_TORCH_RANK_TAG.sub('', text, count=1)}"

    def log_text(self) -> str:
        """The line as the node's log file holds it: the rank stays visible and countable."""
        if self.rank is None:
            return self.text if self.stream == STDOUT else f"[stderr] {self.text}"
        suffix = "" if self.stream == STDOUT else " stderr"
        return f"[rank {self.rank}{suffix}] {self.text}"


StatusName = Union[StatusEvent, Literal["garbled"]]
"""A status record's event; "garbled" when the record is not one the supervisor writes."""


@dataclass(frozen=True)
class Status:
    """One ``S`` record of a supervisor: started, exit, stopping, teardown, done, error;
    gpu and progress for the live view (``gpu_usage``, ``progress_of``)."""

    node: str
    event: StatusName
    fields: dict[str, Any]


class GpuUsage(NamedTuple):
    """One GPU of a node as its supervisor last sampled it (``nvidia-smi``)."""

    gpu: int
    """Its index on the node."""
    utilisation: float
    """Percent."""
    memory_used: float
    """MiB."""
    memory_total: float
    clock: float | None = None
    """The SM clock, MHz, where the board reports it (and the three below)."""
    max_clock: float | None = None
    power: float | None = None
    """Watts."""
    reasons: int = 0
    """NVML's clock throttle (event) reasons, a bitmask (``THROTTLE_REASONS``)."""


THROTTLE_REASONS = {0x4: "power cap", 0x8: "hardware slowdown", 0x20: "thermal slowdown (driver)",
                    0x40: "thermal slowdown", 0x80: "power brake"}
"""NVML's clock throttle reasons that slow a busy GPU (nvml.h's ``nvmlClocksThrottleReason*``;
idle, application clocks, sync boost and display clocks say nothing of a fault)."""


def gpu_usage(status: Status) -> tuple[GpuUsage, ...]:
    """The GPUs of a ``gpu`` status record (none for any other record, or a garbled one)."""
    gpus = status.fields.get("gpus") if status.event == "gpu" else None
    found = []
    for gpu in gpus if isinstance(gpus, list) else ():
        if not (isinstance(gpu, list) and len(gpu) in (4, 8)
                and all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in gpu)):
            continue
        usage = GpuUsage(int(gpu[0]), float(gpu[1]), float(gpu[2]), float(gpu[3]))
        if len(gpu) == 8:
            usage = usage._replace(clock=float(gpu[4]), max_clock=float(gpu[5]), power=float(gpu[6]),
                                   reasons=int(gpu[7]))
        found.append(usage)
    return tuple(found)


def progress_of(status: Status) -> tuple[int | None, str] | None:
    """(rank, the bar as it stands) of a ``progress`` status record, else None."""
    text, rank = status.fields.get("text"), status.fields.get("rank")
    if status.event != "progress" or not isinstance(text, str):
        return None
    return (rank if isinstance(rank, int) else None), text


MAX_RECORD = 4 << 20
"""Bytes a record may hold before it is cut (the supervisor's own are at most 1 MiB): a
stream without newlines (a shell's output, a hostile node) must not grow without bound."""


class RecordSplitter:
    """Cuts a supervisor's stdout into complete records (TAG + payload), across chunks.

    A record still incomplete is kept as a list of its chunks, joined once its newline
    comes: joining on every chunk made a long line quadratic (20 MB without a newline
    took seconds). One longer than ``limit`` is cut into records of ``limit`` bytes."""

    def __init__(self, limit: int = MAX_RECORD) -> None:
        self.limit = limit
        self._parts: list[bytes] = []
        self._size = 0

    def _take(self, data: bytes) -> bytes:
        """``data`` with the held part of its first record in front of it."""
        if not self._parts:
            return data
        self._parts.append(data)
        data, self._parts, self._size = b"".join(self._parts), [], 0
        return data

    def _hold(self, rest: bytes) -> bytes:
        """Keeps ``rest`` (no newline in it) for later; the part beyond ``limit``, as whole records."""
        if rest:
            self._parts.append(rest)
            self._size += len(rest)
        if self._size < self.limit:
            return b""
        held = b"".join(self._parts)
        cut = len(held) - len(held) % self.limit
        self._parts, self._size = ([held[cut:]], len(held) - cut) if cut < len(held) else ([], 0)
        return b"".join(held[start:start + self.limit] + b"\n" for start in range(0, cut, self.limit))

    def feed(self, data: bytes) -> list[bytes]:
        return [record for record in self.feed_block(data).split(b"\n") if record]

    def feed_block(self, data: bytes) -> bytes:
        """The complete records in ``data`` as one bytes object, each ending in ``\\n``."""
        end = data.rfind(b"\n") + 1
        if not end:
            return self._hold(data)
        return self._take(data[:end]) + self._hold(data[end:])

    def finish(self) -> list[bytes]:
        rest, self._parts, self._size = b"".join(self._parts), [], 0
        return [rest] if rest else []


def visible_text(payload: bytes) -> str:
    """What a terminal would show of the line: only the text after the last ``\\r``
    (a progress bar redraws itself), decoded without ever failing."""
    text = payload.decode("utf-8", "replace")
    if "\r" not in text:
        return text
    return text.rstrip("\r").rsplit("\r", 1)[-1]


def parse_output(node: str, stream: str, payload: bytes) -> OutputLine:
    """A job line; torchrun's ``[torchherd-rank N] `` prefix becomes the rank."""
    rank: int | None = None
    if payload.startswith(RANK_PREFIX_HEAD):
        match = _RANK_PREFIX.match(payload)
        if match:
            rank = int(match.group(1))
            payload = payload[match.end():]
    return OutputLine(node, rank, stream, visible_text(payload))


_INTEGER_FIELDS: dict[str, tuple[str, ...]] = {
    wire.EVENT_STARTED: ("pid", "pgid", "supervisor"), wire.EVENT_EXIT: ("code",), wire.EVENT_DONE: ("code", "left")}
"""The fields the controller counts on, per event: a record without them is garbled."""


def parse_status(node: str, payload: bytes) -> Status:
    """One S record; "garbled" for anything the supervisor does not write (a shell's output
    can land in the record stream, ``S{"event":"exit","code":"x"}`` included)."""
    try:
        fields = json.loads(payload.decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        fields = None
    if not isinstance(fields, dict):
        return Status(node, "garbled", {"payload": payload.decode("utf-8", "replace")})
    event = wire.status_event(fields.get("event"))
    if event is not None and not all(isinstance(fields.get(key), int) and not isinstance(fields.get(key), bool)
                                     for key in _INTEGER_FIELDS.get(event, ())):
        event = None
    return Status(node, "garbled" if event is None else event, fields)


def parse_records(node: str, records: Sequence[bytes]) -> list[OutputLine | Status]:
    """Supervisor records -> lines and status events, one record at a time; heartbeats
    carry no event."""
    events: list[OutputLine | Status] = []
    for record in records:
        tag, payload = record[0], record[1:]
        if tag == TAG_STDOUT:
            events.append(parse_output(node, STDOUT, payload))
        elif tag == TAG_STDERR:
            events.append(parse_output(node, STDERR, payload))
        elif tag == TAG_STATUS:
            events.append(parse_status(node, payload))
        elif tag != TAG_HEARTBEAT:
            events.append(OutputLine(node, None, STDOUT, visible_text(record)))
    return events


def as_log_file_text(data: bytes) -> bytes:
    """Job bytes as the log file keeps them: valid UTF-8, bad bytes replaced."""
    return data if data.isascii() else data.decode("utf-8", "replace").encode("utf-8")


@dataclass(frozen=True)
class RankLines:
    """Consecutive lines of one node, every one printed by a rank and free of ``\\r``,
    kept as the supervisor's O and E records, each after a newline (``b"\\nO[torchherd-rank
    3] text\\n..."``): a whole chunk is rewritten for the log and the terminal with a
    few bytes operations, where an object per line would cost the controller its CPU."""

    node: str
    records: bytes

    def log_bytes(self) -> bytes:
        """The lines as the node's log file holds them (``OutputLine.log_text``, each + ``\\n``)."""
        data = self.records.replace(OUT_HEAD, b"\n[rank ")
        for rank in self.stderr_ranks():
            data = data.replace(b"%s%d] " % (ERR_HEAD, rank), b"\n[rank %d stderr] " % rank)
        return as_log_file_text(data[1:])

    def stderr_ranks(self) -> set[int]:
        if ERR_HEAD not in self.records:
            return set()
        return {int(rank) for rank in ERR_RANKS.findall(self.records)}

    def lines(self) -> list[OutputLine]:
        return self._parse(self.records[1:-1].split(b"\n"))

    def tail(self, count: int) -> list[OutputLine]:
        return self._parse(self.records.rsplit(b"\n", count + 1)[1:-1])

    def error_candidates(self) -> list[OutputLine]:
        """The stderr lines that may be errors (a superset of what ``is_error_line`` takes)."""
        if ERR_HEAD not in self.records or not any(word in self.records.lower() for word in _ERROR_WORDS):
            return []
        found = [record[1:] for record in _ERR_RECORDS.findall(self.records)
                 if any(word in record.lower() for word in _ERROR_WORDS)]
        return self._parse(found)

    def _parse(self, records: Sequence[bytes]) -> list[OutputLine]:
        return [parse_output(self.node, STDERR if record[0] == TAG_STDERR else STDOUT, record[1:])
                for record in records]


def flat(chunks: Iterable[OutputLine | RankLines]) -> list[OutputLine]:
    """Every line of ``chunks``, a block's one by one (the one place a block is taken apart)."""
    lines: list[OutputLine] = []
    for chunk in chunks:
        if isinstance(chunk, RankLines):
            lines += chunk.lines()
        else:
            lines.append(chunk)
    return lines


Chunk = Union[OutputLine, RankLines, Status]


class OutputParser:
    """One node's supervisor stdout -> events, a chunk at a time: a chunk of nothing but
    well-formed rank lines (and heartbeats) stays one ``RankLines``; any other chunk
    (torchrun's own lines, status records, ``\\r``, odd prefixes) is parsed line by line."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._splitter = RecordSplitter()

    def feed(self, data: bytes) -> list[Chunk]:
        block = self._splitter.feed_block(data)
        if not block:
            return []
        records = b"\n" + block
        side: list[Chunk] = []
        if b'\nS{"event":"' in records:
            stripped = _SIDE_RECORDS.sub(b"", records)
            if _only_rank_lines(stripped):
                # Only a bar's state or a GPU sample kept the chunk off the bytes path.
                side = list(parse_records(self.node, [record[1:] for record in _SIDE_RECORDS.findall(records)]))
                records = stripped
        if _only_rank_lines(records):
            records = records.replace(_HEARTBEATS, b"\n")
            return ([RankLines(self.node, records)] if len(records) > 1 else []) + side
        return list(parse_records(self.node, [record for record in block.split(b"\n") if record]))

    def finish(self) -> list[Chunk]:
        return list(parse_records(self.node, self._splitter.finish()))


def _only_rank_lines(records: bytes) -> bool:
    """True when every record (each after a newline) is a rank's line with a well-formed
    prefix and no ``\\r``, or a heartbeat: each count matches one record's start only."""
    total = records.count(b"\n") - 1
    counted = records.count(OUT_HEAD)
    if counted != total:
        counted += records.count(ERR_HEAD) + records.count(_HEARTBEATS)
    return (counted == total and b"\r" not in records
            and _ODD_RANK_PREFIX.search(records) is None)


def is_error_line(line: OutputLine) -> bool:
    """A line worth naming as a node's first error: an exception, or any rank's stderr
    text that says error (torch's own warnings on stderr do not count)."""
    if line.stream != STDERR:
        return False
    text = line.text.strip()
    if not text:
        return False
    # "python3: can't open file 'x.py': [Errno 2] ..." is how a missing script fails.
    # "terminate called after throwing an instance of ..." is C++'s std::terminate (an abort).
    return (bool(_EXCEPTION_LINE.match(text)) or text.lower().startswith(("error", "fatal", "terminate called"))
            or _OS_ERROR.search(text) is not None)


def is_peer_error(line: OutputLine) -> bool:
    """An error line that only says a peer went away: what every other rank of a collective
    raises when one rank crashes, not a cause of its own."""
    return says_peer_gone(line.text)


def says_peer_gone(text: str) -> bool:
    """Whether an error's text only says a peer went away (``is_peer_error``)."""
    return _PEER_GONE.search(text) is not None


def root_cause_exit(line: OutputLine) -> int | None:
    """The exit code in a line of torchrun's failure report ("exitcode  : 7 (pid: 12)")."""
    if line.rank is not None:
        return None
    match = _ROOT_CAUSE_EXIT.match(line.text)
    return int(match.group(1)) if match else None


def root_cause_rank(line: OutputLine) -> int | None:
    """The failed rank when the line is part of torchrun's "Root Cause" report."""
    if line.rank is not None:
        return None
    match = _ROOT_CAUSE_RANK.match(line.text)
    return int(match.group(1)) if match else None


OutcomeState = Literal["ok", "failed", "torn down", "lost", "interrupted", "not started", "unresponsive"]


@dataclass(frozen=True)
class NodeOutcome:
    """How one node's part of the run ended, for the summary table."""

    node: str
    node_rank: int
    state: OutcomeState
    exit_code: int | None
    seconds: float | None
    first_error: str | None
    failed_rank: int | None
    last_lines: tuple[str, ...]
    left: int = 0
    """Processes the supervisor could not kill (0 when the node is clean)."""
    rank_exit_code: int | None = None
    """The failed rank's own exit code, as torchrun's root-cause report gives it (torchrun
    itself exits 1)."""

    def as_json(self) -> dict[str, object]:
        return {"node": self.node, "node_rank": self.node_rank, "state": self.state, "exit_code": self.exit_code,
                "seconds": None if self.seconds is None else round(self.seconds, 3), "first_error": self.first_error,
                "failed_rank": self.failed_rank, "rank_exit_code": self.rank_exit_code, "left": self.left,
                "last_lines": list(self.last_lines)}


AttemptEnd = Literal["ok", "failed", "lost", "hung", "interrupted"]


@dataclass(frozen=True)
class AttemptRecord:
    """One attempt of a run with retries (``run --retries``), for the summary's table."""

    number: int
    """1 for the first attempt."""
    nodes: tuple[str, ...]
    """In node-rank order: the master first."""
    ended: AttemptEnd
    headline: str
    """The attempt's own one-sentence end (the node and rank that ended it)."""
    seconds: float
    triage: tuple[str, ...] = ()
    """What the triage after it found, one line per node that failed a check; empty: all passed
    (or none ran)."""
    next: str = ""
    """What followed: the nodes of the next attempt, or why the run ended here."""
    warm: tuple[str, ...] = ()
    """The nodes whose torchrun and ranks forked from a warm Python (torch imported
    beforehand); the others started cold."""

    @property
    def start(self) -> str:
        """How the attempt's nodes started: "cold", "warm", or "warm on node0,node1" (some)."""
        if not self.warm:
            return "cold"
        return "warm" if set(self.warm) >= set(self.nodes) else f"warm on {','.join(self.warm)}"

    def as_json(self) -> dict[str, object]:
        return {"attempt": self.number, "nodes": list(self.nodes), "ended": self.ended, "headline": self.headline,
                "seconds": round(self.seconds, 3), "triage": list(self.triage), "next": self.next,
                "start": self.start, "warm": list(self.warm)}


@dataclass(frozen=True)
class Slowest:
    """The slowest node marked during a run, at its worst (``engine.watch.straggler``)."""

    node: str
    ratio: float
    signal: str
    """What the figure rests on: ``tqdm rate``, ``lines per second`` or ``busy share``."""
    detail: str = ""
    """What the figure rests on, where the signal needs saying (the busy shares)."""

    def text(self) -> str:
        return f"slowest node: {self.node}, {self.ratio:.1f}x slower than the median ({self.detail or self.signal})"


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    exit_code: int
    headline: str
    """One sentence: what happened, naming the node (and rank) that ended the run."""
    nodes: tuple[NodeOutcome, ...]
    log_dir: str
    culprit: str | None = None
    """The node that failed first or was lost, when one ended the run."""
    attempts: tuple[AttemptRecord, ...] = ()
    """Every attempt of a run with retries, the last one's ``nodes`` above; empty without retries."""
    slowest: Slowest | None = None
    """The node the run waited for most, and by how much (None: none clearly slower)."""
    straggler: str | None = None
    """The summary's line on it: ``slowest.text()``, or that the run had no progress
    signal to compare; None: nothing to say."""
    checkpoint: str | None = None
    """With checkpoint replication: where the newest checkpoint is (``Holdings.line``)."""

    def as_json(self) -> dict[str, object]:
        """What ``run --json`` prints: every figure of the summary, the attempts included."""
        slowest = self.slowest
        return {"run_id": self.run_id, "exit_code": self.exit_code, "headline": self.headline,
                "culprit": self.culprit, "log_dir": self.log_dir, "nodes": [node.as_json() for node in self.nodes],
                "attempts": [attempt.as_json() for attempt in self.attempts],
                "slowest": None if slowest is None else {"node": slowest.node, "ratio": round(slowest.ratio, 3),
                                                         "signal": slowest.signal, "detail": slowest.detail},
                "straggler": self.straggler, "checkpoint": self.checkpoint}
