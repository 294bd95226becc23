"""Recorded histories of runs for the report's tests: the events each kind of run gives
its observer, with their times, written by the real ``HistoryRecorder`` into a real file
and read back. The GPU samples of ``h200`` are the real ones of one H200 (the fixtures'
``gpu-h200/gpu-samples-busy.txt``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Callable, Sequence

from torchherd.checks.results import CLUSTER, CheckReport, CheckResult
from torchherd.engine.eventlog import HISTORY_FILE, HistoryRecorder, Recorded, read_history
from torchherd.engine.events import (
    AttemptFailed,
    AttemptStarted,
    CheckpointSaved,
    CheckpointStaged,
    Event,
    HangFound,
    NodeExcluded,
    NodeExited,
    NodeLost,
    NodeStarted,
    NodeStatus,
    Output,
    PreflightDone,
    RanksRunning,
    RunFinished,
    RunStarted,
    SpareTaken,
    TriageDone,
)
from torchherd.runlog import AttemptRecord, NodeOutcome, OutputLine, RunSummary, Slowest, Status

T0 = 1_800_000_000.0
"""2027-01-15 08:00:00 UTC."""
H200_SAMPLES = Path(__file__).parent / "data" / "gpu-h200-samples-busy.txt"
"""A copy of the session's real H200 samples (shared/fixtures/gpu-h200/gpu-samples-busy.txt)."""


class Timeline:
    """Events at given seconds after ``T0``, in time order."""

    def __init__(self) -> None:
        self.items: list[tuple[float, Event]] = []

    def at(self, second: float, *events: Event) -> None:
        self.items.extend((second, event) for event in events)

    def recorded(self, directory: Path) -> list[Recorded]:
        now = [T0]
        recorder = HistoryRecorder(clock=lambda: now[0])
        for second, event in sorted(self.items, key=lambda item: item[0]):
            now[0] = T0 + second
            if isinstance(event, RunStarted):
                event = RunStarted(event.run_id, event.nodes, event.master, event.master_addr, event.port,
                                   str(directory), event.max_rank)
            recorder(event)
        return read_history(directory / HISTORY_FILE)


def started(*nodes: str) -> RunStarted:
    return RunStarted("r1", nodes, nodes[0], "10.0.0.1", 29500, "", 2 * len(nodes) - 1)


def gpu(node: str, gpus: Sequence[Sequence[float]]) -> NodeStatus:
    return NodeStatus(Status(node, "gpu", {"event": "gpu", "gpus": [list(sample) for sample in gpus]}))


def busy(node: str, share: int) -> NodeStatus:
    return NodeStatus(Status(node, "busy", {"event": "busy", "samples": 10, "busy": share}))


def bar(node: str, rank: int, rate: float) -> NodeStatus:
    return NodeStatus(Status(node, "progress", {"event": "progress", "rank": rank,
                                                "text": f" 40%|####      | 40/100 [00:10<00:15, {rate:.2f}it/s]"}))


def lines(node: str, count: int) -> Output:
    return Output(tuple(OutputLine(node, 0, "stdout", f"step {index}") for index in range(count)))


def outcome(node: str, rank: int, state: str = "ok", code: int | None = 0, seconds: float = 60.0,
            error: str | None = None) -> NodeOutcome:
    return NodeOutcome(node, rank, state, code, seconds, error, None, ())  # type: ignore[arg-type]


def preflight(*nodes: str) -> PreflightDone:
    results = [CheckResult(node, check, "pass", f"{check} fine") for node in nodes for check in ("ssh", "gpu")]
    results.append(CheckResult(CLUSTER, "port", "pass", "master port free"))
    return PreflightDone(CheckReport(tuple(results)))


def steady(timeline: Timeline, nodes: Sequence[str], start: int, end: int,
           utilisation: Callable[[str], float] = lambda node: 90.0) -> None:
    """Every 2 s: a busy record and 20 lines per node; every 10 s a GPU sample (2 GPUs)."""
    for second in range(start, end, 2):
        for node in nodes:
            timeline.at(second, busy(node, 3), lines(node, 20))
            if second % 10 == 0:
                value = utilisation(node)
                timeline.at(second, gpu(node, [[0, value, 1000.0, 81559.0, 1980.0, 1980.0, 400.0, 0],
                                               [1, value, 1000.0, 81559.0, 1980.0, 1980.0, 410.0, 0]]))


def clean(directory: Path) -> list[Recorded]:
    timeline = Timeline()
    nodes = ("node1", "node2")
    timeline.at(0, preflight(*nodes))
    timeline.at(2, started(*nodes), NodeStarted("node1", 100), NodeStarted("node2", 200))
    timeline.at(6, RanksRunning("node1"), RanksRunning("node2"))
    steady(timeline, nodes, 6, 66)
    timeline.at(66, NodeExited("node1", 0), NodeExited("node2", 0))
    summary = RunSummary("r1", 0, "every node finished (exit 0) in 64.0 s",
                         (outcome("node1", 0), outcome("node2", 1)), str(directory))
    timeline.at(67, RunFinished(summary))
    return timeline.recorded(directory)


def recovered(directory: Path) -> list[Recorded]:
    """node2 is lost in attempt 1; spare1 takes its place; the checkpoint is staged on it."""
    timeline = Timeline()
    first, second = ("node1", "node2"), ("node1", "spare1")
    timeline.at(0, preflight(*first), AttemptStarted(1, 3, first))
    timeline.at(2, started(*first))
    timeline.at(6, RanksRunning("node1"), RanksRunning("node2"))
    steady(timeline, first, 6, 40)
    timeline.at(30, CheckpointSaved("node1", "ckpt/last.pt", 4096, T0 + 30))
    timeline.at(40, NodeLost("node2", "ssh: the connection went silent"))
    timeline.at(44, NodeExited("node1", 143, expected=True))
    timeline.at(45, AttemptFailed(1, "node2 was lost (ssh: the connection went silent)", 43.0))
    timeline.at(48, TriageDone(first, (("node2", "ssh: timed out"),), 3.0),
                NodeExcluded("node2", "failed the triage: ssh: timed out"), SpareTaken("spare1", "node2"))
    timeline.at(50, CheckpointStaged(2, "ckpt/last.pt", 4096, "node1", ("spare1",), 1.5),
                AttemptStarted(2, 3, second))
    timeline.at(51, started(*second))
    timeline.at(57, RanksRunning("node1"), RanksRunning("spare1"))
    steady(timeline, second, 58, 100)
    timeline.at(100, NodeExited("node1", 0), NodeExited("spare1", 0))
    attempts = (AttemptRecord(1, first, "lost", "node2 was lost (ssh: the connection went silent)", 43.0,
                              ("node2: ssh: timed out",), "attempt 2 on node1, spare1"),
                AttemptRecord(2, second, "ok", "every node finished", 50.0))
    summary = RunSummary("r1", 0, "every node finished (exit 0) after 2 attempts",
                         (outcome("node1", 0), outcome("spare1", 1)), str(directory), attempts=attempts,
                         checkpoint="newest checkpoint: ckpt/last.pt on node1, spare1")
    timeline.at(101, RunFinished(summary))
    return timeline.recorded(directory)


def hung(directory: Path) -> list[Recorded]:
    timeline = Timeline()
    nodes = ("node1", "node2")
    timeline.at(0, started(*nodes))
    timeline.at(4, RanksRunning("node1"), RanksRunning("node2"))
    steady(timeline, nodes, 4, 20)
    timeline.at(40, HangFound(20.0))
    stacks = []
    for node, rank, where in (("node1", 0, 12), ("node1", 1, 12), ("node2", 2, 12), ("node2", 3, 9)):
        stacks += [OutputLine(node, rank, "stderr", "Current thread 0x00007f (most recent call first):"),
                   OutputLine(node, rank, "stderr", '  File "/usr/lib/python3/site-packages/torch/distributed.py", '
                                                    'line 2 in all_reduce' if where == 12 else
                                                    '  File "/work/train.py", line 9 in load'),
                   OutputLine(node, rank, "stderr", f'  File "/work/train.py", line {where} in main')]
    timeline.at(41, Output(tuple(stacks)))
    timeline.at(44, NodeExited("node1", 1), NodeExited("node2", 1, expected=True))
    headline = "hung: no rank printed a line or used CPU for 20 s; rank 3 on node2 in load at train.py:9"
    summary = RunSummary("r1", 1, headline, (outcome("node1", 0, "failed", 1, 44.0, "rank 0: SIGABRT"),
                                             outcome("node2", 1, "torn down", 1, 44.0)), str(directory))
    timeline.at(45, RunFinished(summary))
    return timeline.recorded(directory)


def straggling(directory: Path) -> list[Recorded]:
    """Three nodes drawing tqdm bars; node3 at a third of the others' rate."""
    timeline = Timeline()
    nodes = ("node1", "node2", "node3")
    timeline.at(0, started(*nodes))
    timeline.at(3, *(RanksRunning(node) for node in nodes))
    for second in range(4, 64, 2):
        for rank, node in enumerate(nodes):
            timeline.at(second, bar(node, rank, 2.0 if node == "node3" else 6.0), busy(node, 9 if node == "node3" else 3))
    timeline.at(64, *(NodeExited(node, 0) for node in nodes))
    summary = RunSummary("r1", 0, "every node finished (exit 0) in 61.0 s",
                         tuple(outcome(node, rank) for rank, node in enumerate(nodes)), str(directory),
                         slowest=Slowest("node3", 3.0, "tqdm rate"),
                         straggler="slowest node: node3, 3.0x slower than the median (tqdm rate)")
    timeline.at(65, RunFinished(summary))
    return timeline.recorded(directory)


def h200_samples() -> list[list[list[float]]]:
    """The four GPU samples of the real H200 run (one GPU each)."""
    text = H200_SAMPLES.read_text()
    return [ast.literal_eval(found) for found in re.findall(r"'gpus': (\[\[[^\]]*\]\])", text)]


def h200(directory: Path) -> list[Recorded]:
    """The real H200 run: one node, a bf16 matmul job, its GPU sampled every 5 s."""
    timeline = Timeline()
    node = "192.0.2.2"
    timeline.at(0, started(node))
    timeline.at(9, RanksRunning(node))
    for index, sample in enumerate(h200_samples()):
        timeline.at(20 + 5 * index, gpu(node, sample))
    timeline.at(49, NodeExited(node, 0))
    summary = RunSummary("r1", 0, "the node finished (exit 0) in 49.2 s", (outcome(node, 0, seconds=49.2),),
                         str(directory))
    timeline.at(49.2, RunFinished(summary))
    return timeline.recorded(directory)
