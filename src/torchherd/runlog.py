"""The run's output as data: the supervisors' framed records cut into lines, each
line's rank parsed back off torch's prefix, and the per-node outcome of a run.

Pure: no sockets, no threads, no terminal. ``launch`` feeds bytes in, the console
renders what comes out, and the unit tests check both with exact text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from torchherd.plan import RANK_PREFIX_HEAD

STDOUT = "out"
STDERR = "err"

TAG_STDOUT = ord("O")
TAG_STDERR = ord("E")
TAG_HEARTBEAT = ord("H")
TAG_STATUS = ord("S")

_RANK_PREFIX = re.compile(rb"\[torchherd-rank (\d+)\] ")
# torchrun's failure report names the root-cause rank as "  rank      : 3 (local_rank: 1)".
_ROOT_CAUSE_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank")
# The line of a Python traceback that says what went wrong ("ValueError: boom"); torch
# repeats a rank's traceback with "[rank3]: " before each line.
_TORCH_RANK_TAG = re.compile(r"^\[rank\d+\]:\s*")
_EXCEPTION_LINE = re.compile(r"^(\[rank\d+\]:\s*)?[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b(:|$)")


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


@dataclass(frozen=True)
class Status:
    """One ``S`` record of a supervisor: started, exit, stopping, teardown, done, error."""

    node: str
    event: str
    fields: dict[str, Any]


class RecordSplitter:
    """Cuts a supervisor's stdout into complete records (TAG + payload), across chunks."""

    def __init__(self) -> None:
        self._partial = b""

    def feed(self, data: bytes) -> list[bytes]:
        if self._partial:
            data = self._partial + data
        records = data.split(b"\n")
        self._partial = records.pop()
        return [record for record in records if record]

    def finish(self) -> list[bytes]:
        rest, self._partial = self._partial, b""
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


def parse_status(node: str, payload: bytes) -> Status:
    try:
        fields = json.loads(payload.decode("utf-8", "replace"))
    except ValueError:
        fields = None
    if not isinstance(fields, dict):
        return Status(node, "garbled", {"payload": payload.decode("utf-8", "replace")})
    return Status(node, str(fields.get("event", "")), fields)


def is_error_line(line: OutputLine) -> bool:
    """A line worth naming as a node's first error: an exception, or any rank's stderr
    text that says error (torch's own warnings on stderr do not count)."""
    if line.stream != STDERR:
        return False
    text = line.text.strip()
    if not text:
        return False
    return bool(_EXCEPTION_LINE.match(text)) or text.lower().startswith(("error", "fatal"))


def root_cause_rank(line: OutputLine) -> int | None:
    """The failed rank when the line is part of torchrun's "Root Cause" report."""
    if line.rank is not None:
        return None
    match = _ROOT_CAUSE_RANK.match(line.text)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class NodeOutcome:
    """How one node's part of the run ended, for the summary table."""

    node: str
    node_rank: int
    state: str
    """ok, failed, torn down, lost, interrupted, not started, unresponsive."""
    exit_code: int | None
    seconds: float | None
    first_error: str | None
    failed_rank: int | None
    last_lines: tuple[str, ...]
    left: int = 0
    """Processes the supervisor could not kill (0 when the node is clean)."""


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    exit_code: int
    headline: str
    """One sentence: what happened, naming the node (and rank) that ended the run."""
    nodes: tuple[NodeOutcome, ...]
    log_dir: str
