"""An attached run's part of its record (``RunRecord.extra["attached"]``): how it ended, and
its nodes' endings, as its controller recorded them."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from torchherd.engine.records.fields import Fields
from torchherd.engine.records.recovery import stored_text

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


def read_attached(read: Fields) -> AttachedRecord:
    log_dir = read.text("log_dir")
    if not os.path.isabs(log_dir):
        read.fail("log_dir", f"{log_dir!r} is not an absolute path")
    ending = read.text("ending")
    if ending not in ENDINGS:
        read.fail("ending", f"{ending!r} is not one of {', '.join(ENDINGS)}")
    nodes = []
    for index, data in enumerate(read.value("nodes", list)):
        item = Fields(read.source, f"{read.where}nodes[{index}].", data)
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
