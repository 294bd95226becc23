"""A recovering run's part of its record (``RunRecord.extra["recovery"]``): its attempts, as
its controller recorded them."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace

from torchherd.engine.records.fields import NAME, Fields

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


def read_recovery(read: Fields) -> RecoveryRecord:
    attempts = []
    for index, data in enumerate(read.value("attempts", list)):
        item = Fields(read.source, f"{read.where}attempts[{index}].", data)
        nodes = item.texts("nodes")
        if not all(NAME.match(node) for node in nodes):
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
