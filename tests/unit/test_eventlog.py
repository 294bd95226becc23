"""A run's history file (``events.jsonl``): every typed event and sample written as it
arrives and read back as the same typed objects; private; bounded by halving the samples'
density. A real file in a temporary log directory, a fake clock."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from torchherd.checks.results import CheckReport, CheckResult
from torchherd.engine.eventlog import (
    HISTORY_FILE,
    HistoryRecorder,
    LinesSeen,
    Recorded,
    read_history,
    recording,
)
from torchherd.engine.events import (
    AttemptFailed,
    AttemptStarted,
    Collector,
    HangFound,
    NodeExcluded,
    NodeStatus,
    NodeSynced,
    Output,
    PreflightDone,
    PullProgress,
    RunFinished,
    RunStarted,
    SpareTaken,
    StopSent,
    SyncDone,
    SyncFailed,
    TriageDone,
)
from torchherd.remote.wire import StopLevel
from torchherd.runlog import AttemptRecord, NodeOutcome, OutputLine, RunSummary, Slowest, Status


class Clock:
    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def started(log_dir: Path) -> RunStarted:
    return RunStarted("r1", ("node1", "node2"), "node1", "10.0.0.1", 29500, str(log_dir), 3)


def gpu(node: str, utilisation: float) -> NodeStatus:
    return NodeStatus(Status(node, "gpu", {"event": "gpu", "gpus": [[0, utilisation, 1661.0, 143771.0, 1440.0,
                                                                       1980.0, 693.39, 4]]}))


def summary() -> RunSummary:
    node = NodeOutcome("node1", 0, "ok", 0, 12.5, None, None, ("done",))
    attempt = AttemptRecord(1, ("node1", "node2"), "lost", "node2 was lost", 30.0, ("node2: ssh: timeout",),
                            "attempt 2 on node1, spare1")
    return RunSummary("r1", 0, "every node finished", (node,), "/logs/r1", attempts=(attempt,),
                      slowest=Slowest("node1", 1.8, "tqdm rate"), straggler="slowest node: node1")


def test_events_and_samples_come_back_as_the_typed_objects_they_were(tmp_path: Path) -> None:
    clock = Clock()
    recorder = HistoryRecorder(clock=clock)
    kept = Collector()
    observer = recording(kept, recorder)
    report = CheckReport((CheckResult("node1", "gpu", "pass", "1 GPU"), CheckResult("node2", "ssh", "fail", "no", "fix")))
    sync = SyncDone("/src", (NodeSynced("node1", "/w", ("a.py",), 10, (), 3, 0.5), SyncFailed("node2", "refused")), 1.0)
    early = [sync, PreflightDone(report)]
    later = [AttemptStarted(1, 3, ("node1", "node2")), gpu("node1", 99.0),
             NodeStatus(Status("node2", "busy", {"event": "busy", "samples": 10, "busy": 9})),
             PullProgress("node1", 2, 5, "Downloading"),
             StopSent(StopLevel.TERM, "node2 was lost", ("node1",)),
             AttemptFailed(1, "node2 was lost", 30.0), TriageDone(("node2",), (("node2", "ssh: timeout"),), 2.0),
             NodeExcluded("node2", "ssh: timeout"), SpareTaken("spare1", "node2"), RunFinished(summary())]
    for event in early:
        observer(event)
        clock.now += 1
    observer(started(tmp_path))
    for event in later:
        clock.now += 1
        observer(event)
    assert kept.events == early + [started(tmp_path)] + later
    found = read_history(tmp_path / HISTORY_FILE)
    start = 1_800_000_000.0
    expected = [Recorded(start, sync), Recorded(start + 1, PreflightDone(report)),
                Recorded(start + 2, started(tmp_path))]
    expected += [Recorded(start + 3 + index, event) for index, event in enumerate(later)]
    # the samples are kept as samples: the status record's fields without its "event"
    assert found == expected


def test_line_counts_and_the_hang_stacks(tmp_path: Path) -> None:
    clock = Clock()
    recorder = HistoryRecorder(clock=clock)
    recorder(started(tmp_path))
    recorder(Output((OutputLine("node1", 0, "stdout", "step 1"), OutputLine("node2", 1, "stdout", "step 1"))))
    clock.now += 0.5
    recorder(Output((OutputLine("node1", 0, "stdout", "step 2"),)))  # within LINES_EVERY: no sample yet
    clock.now += 2.0
    recorder(Output((OutputLine("node1", 0, "stdout", "step 3"),)))
    clock.now += 1.0
    recorder(HangFound(20.0))
    stack = (OutputLine("node1", 0, "stderr", "Current thread 0x1 (most recent call first):"),
             OutputLine("node1", 0, "stderr", '  File "train.py", line 9 in <module>'))
    recorder(Output(stack))
    start = 1_800_000_000.0
    assert read_history(tmp_path / HISTORY_FILE) == [
        Recorded(start, started(tmp_path)),
        Recorded(start, LinesSeen("node1", 1)), Recorded(start, LinesSeen("node2", 1)),
        Recorded(start + 2.5, LinesSeen("node1", 3)),
        Recorded(start + 3.5, HangFound(20.0)),
        Recorded(start + 3.5, Output(stack)),
    ]


def test_the_file_is_private_and_bars_are_taken_every_two_seconds(tmp_path: Path) -> None:
    clock = Clock()
    recorder = HistoryRecorder(clock=clock)
    log_dir = tmp_path / "logs" / "r1"
    recorder(started(log_dir))
    for _ in range(12):  # three seconds of a bar redrawn every 0.25 s
        recorder(NodeStatus(Status("node1", "progress", {"event": "progress", "rank": 0, "text": "5it [00:01, 4.0it/s]"})))
        clock.now += 0.25
    assert stat.S_IMODE(os.stat(log_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(log_dir / HISTORY_FILE).st_mode) == 0o600
    assert [record.at - 1_800_000_000.0 for record in read_history(log_dir / HISTORY_FILE)] == [0.0, 0.0, 2.0]


def test_the_bound_halves_the_samples_density_and_keeps_every_event(tmp_path: Path) -> None:
    clock = Clock()
    cap = 40_000
    recorder = HistoryRecorder(cap=cap, clock=clock)
    recorder(started(tmp_path))
    path = tmp_path / HISTORY_FILE
    sizes = []
    for second in range(0, 4000, 2):
        clock.now = 1_800_000_000.0 + second
        for node in ("node1", "node2"):
            recorder(gpu(node, float(second % 100)))
        if second % 1000 == 0:
            recorder(AttemptStarted(second // 1000 + 1, 9, ("node1", "node2")))
        sizes.append(path.stat().st_size)
    assert max(sizes) <= cap
    records = read_history(path)
    assert [record.event.number for record in records if isinstance(record.event, AttemptStarted)] == [1, 2, 3, 4]
    times = [record.at - 1_800_000_000.0 for record in records
             if isinstance(record.event, NodeStatus) and record.event.status.node == "node1"]
    gaps = {round(later - earlier) for earlier, later in zip(times, times[1:])}
    # 2,000 samples per node written as they came, halved as the file filled: an even
    # density over the whole span, from its first second to its last stretch
    assert recorder.level == 4
    assert gaps == {2 << recorder.level}
    assert times[0] == 0.0 and times[-1] >= 4000 - (2 << recorder.level)
    assert not (tmp_path / (HISTORY_FILE + ".new")).exists()


def test_events_alone_past_the_cap_stop_the_file(tmp_path: Path) -> None:
    recorder = HistoryRecorder(cap=2_000, clock=Clock())
    recorder(started(tmp_path))
    for number in range(100):
        recorder(AttemptFailed(number, "x" * 50, 1.0))
    size = (tmp_path / HISTORY_FILE).stat().st_size
    assert size <= 2_000
    lines = (tmp_path / HISTORY_FILE).read_text().splitlines()
    assert json.loads(lines[-1])["event"] == "AttemptFailed"


def test_a_file_that_cannot_be_written_is_said_once(tmp_path: Path) -> None:
    said: list[str] = []
    blocked = tmp_path / "file"
    blocked.write_text("")
    recorder = HistoryRecorder(clock=Clock(), failed=said.append)
    recorder(RunStarted("r1", ("node1",), "node1", "a", 1, str(blocked / "r1"), 0))
    recorder(AttemptStarted(1, 2, ("node1",)))
    assert said == [f"{blocked}: File exists"]  # the log directory's parent is a file: said once
