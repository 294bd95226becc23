"""The history of attached runs: what lets ``status`` and ``logs`` know a run that was
started in the foreground, as they know detached ones.

An attached run writes its record into the same private state directory as a detached
run (``records.runs_dir``) once its job started, and again when it ended; its
controller (this process) holds the run's controller lock meanwhile, so a controller
killed mid-run leaves a record that ``status`` calls ``ended (controller gone)``, never
running forever. Its logs are the local log files the run wrote (``<log dir>/<run
id>/<node>.log``): ``logs`` reads them back, no node is asked. Nothing here prints.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from torchherd.engine.bookkeeping import max_rank, node_record, report, run_record
from torchherd.engine.events import NodeStatus, Observer
from torchherd.engine.records import (
    ATTACHED_KEY,
    AttachedRecord,
    NodeEnding,
    RunRecord,
    attached_of,
    hold_controller_lock,
    holds_lock,
    load,
    prune,
    save,
    with_attached,
)
from torchherd.errors import UsageError
from torchherd.plan import Plan
from torchherd.remote.wire import process_start
from torchherd.runlog import STDERR, STDOUT, OutputLine, RunSummary, Status

INTERRUPTED = 130
POLL_EVERY = 0.5
"""Seconds between reads of a running attached run's log files (``logs -f``)."""
BATCH_LINES = 2000
"""Lines read back from a log file before they are reported."""


class History:
    """One attached run's record: written when its job started (``start``), updated when
    it ended (``ended``: a ``Run.when_done`` callback)."""

    def __init__(self, record: RunRecord, lock: int) -> None:
        self.record = record
        self._lock = lock

    @classmethod
    def start(cls, plan: Plan, log_dir: Path, grace: float) -> History:
        """Holds the run's controller lock, saves its record, prunes the oldest ones."""
        pid = os.getpid()
        run_dir = Path(os.path.abspath(log_dir / plan.run_id))
        nodes = [node_record(node.host, str(run_dir / f"{node.host.name}.log"), "", node.workdir)
                 for node in plan.nodes]
        attached = AttachedRecord(pid, process_start(pid), str(run_dir))
        record = run_record(plan, grace, nodes, max_rank(plan), extra={ATTACHED_KEY: attached.to_json_object()})
        lock = hold_controller_lock(plan.run_id)
        save(record)
        prune()
        return cls(record, lock)

    def ended(self, summary: RunSummary | None, error: BaseException | None) -> None:
        """Records how the run ended, then lets the lock go."""
        try:
            attached = attached_of(self.record)
            assert attached is not None
            save(with_attached(self.record, ending_of(attached, summary, error, time.time())))
        finally:
            os.close(self._lock)


def ending_of(attached: AttachedRecord, summary: RunSummary | None, error: BaseException | None,
              now: float) -> AttachedRecord:
    """The record of a run that ended: its summary's exit code, headline and nodes; a run
    whose supervision failed (no summary) failed, with what went wrong as its headline."""
    if summary is None:
        return replace(attached, ending="failed", exit_code=1, ended=now,
                       headline=f"the run's supervision failed: {error!r}")
    code = summary.exit_code
    ending = "finished" if code == 0 else "interrupted" if code == INTERRUPTED else "failed"
    nodes = tuple(NodeEnding(node.node, node.state, node.exit_code) for node in summary.nodes)
    return replace(attached, ending=ending, exit_code=code, headline=summary.headline, ended=now, nodes=nodes)


# reading the logs back ------------------------------------------------------------

_RANK_LINE = re.compile(r"\[rank (\d{1,9})( stderr)?\] ")
_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")


def parse_log_line(node: str, text: str) -> OutputLine:
    """A line of a node's local log file (``OutputLine.log_text``) as the line it was."""
    found = _RANK_LINE.match(text)
    if found:
        return OutputLine(node, int(found.group(1)), STDERR if found.group(2) else STDOUT, text[found.end():])
    if text.startswith("[stderr] "):
        return OutputLine(node, None, STDERR, text[len("[stderr] "):])
    return OutputLine(node, None, STDOUT, text)


def log_files(record: RunRecord, attached: AttachedRecord) -> dict[str, Path]:
    """Per node, its log file: the record's nodes first, then any other node's file in the
    run's directory (a scheduler that picked the nodes itself named them)."""
    directory = Path(attached.log_dir)
    files = {node.name: directory / f"{node.name}.log" for node in record.nodes}
    try:
        others = sorted(path for path in directory.iterdir() if path.suffix == ".log")
    except OSError:
        others = []
    for path in others:
        if path.stem not in files and _NODE.match(path.stem):
            files[path.stem] = path
    return files


@dataclass
class _Reader:
    node: str
    path: Path
    offset: int = 0
    failed: bool = False


def follow_history(record: RunRecord, observer: Observer, follow: bool = False, node: str | None = None,
                   rank: int | None = None, current: Callable[[], tuple[AttachedRecord, bool]] | None = None) -> None:
    """Reports an attached run's output from its local log files (``Output``), then each
    node's end as the record has it (``NodeStatus`` exit); with ``follow`` on as the files
    grow, while ``current`` (the record as it is now, and whether its controller runs) says
    the run goes on. A file that cannot be read is one ``NodeStatus`` error for its node."""
    attached = attached_of(record)
    assert attached is not None
    if node is not None:
        record.node(node)  # UsageError naming the run's nodes
    readers = [_Reader(name, path) for name, path in log_files(record, attached).items()
               if node is None or name == node]
    current = current or (lambda: _now(record))
    while True:
        grew = any([_read(reader, observer, node, rank) for reader in readers])
        if not follow:
            break
        now, alive = current()
        if now.ending != "running" or not alive:
            if not grew:
                attached = now
                break
            continue
        if not grew:
            time.sleep(POLL_EVERY)
    for reader in readers:
        if reader.failed:
            continue
        ending = next((found for found in attached.nodes if found.node == reader.node), None)
        if ending is not None and ending.exit_code is not None:
            fields: dict[str, object] = {"event": "exit", "code": ending.exit_code}
            if ending.state in ("torn down", "interrupted"):
                fields["stopped"] = ending.state
            observer(NodeStatus(Status(reader.node, "exit", fields)))


def attached_now(record: RunRecord) -> AttachedRecord:
    """The run's record as it is now (its controller rewrites it when the run ends)."""
    try:
        found = attached_of(load(record.run_id))
    except UsageError:  # the record went away (pruned) or was damaged: the one read before stands
        found = None
    if found is not None:
        return found
    attached = attached_of(record)
    assert attached is not None
    return attached


def controller_runs(record: RunRecord, attached: AttachedRecord) -> bool:
    return holds_lock(record.run_id, attached.pid, attached.start)


def _now(record: RunRecord) -> tuple[AttachedRecord, bool]:
    attached = attached_now(record)
    return attached, controller_runs(record, attached)


def _read(reader: _Reader, observer: Observer, node: str | None, rank: int | None) -> bool:
    """Reports the complete lines added to the reader's file since the last read; True when there were any."""
    if reader.failed:
        return False
    try:
        with open(reader.path, "rb") as file:
            file.seek(reader.offset)
            read = False
            while True:
                lines = file.readlines(1 << 20)
                if lines and not lines[-1].endswith(b"\n"):  # a line still being written: the next read
                    lines.pop()
                if not lines:
                    return read
                reader.offset += sum(len(line) for line in lines)
                read = True
                for start in range(0, len(lines), BATCH_LINES):
                    report([parse_log_line(reader.node, line[:-1].decode("utf-8", "replace"))
                            for line in lines[start:start + BATCH_LINES]], observer, node, rank)
    except OSError as error:
        reader.failed = True
        observer(NodeStatus(Status(reader.node, "error", {
            "event": "error", "message": f"cannot read its log ({reader.path}): {error.strerror}"})))
        return False
