"""What happened to a run, from its history (``engine.eventlog``): each node's states over
time, the attempts and the recoveries between them, the marks (triage, exclusions, spares,
checkpoints, the hang, the straggler), each node's progress and busy share, each GPU's
samples, the preflight, the summary, the hang's stacks. Plain data: ``text`` says it in a
few lines, ``html`` draws it. Nothing here prints or imports a plotting library.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from torchherd.checks.results import CheckReport
from torchherd.engine.eventlog import LinesSeen, Recorded
from torchherd.engine.events import (
    AttemptFailed,
    AttemptStarted,
    CheckpointReplicated,
    CheckpointSaved,
    CheckpointStaged,
    HangFound,
    NodeExcluded,
    NodeExited,
    NodeLost,
    NodeNotStarted,
    NodeSilent,
    NodeStatus,
    Output,
    PreflightDone,
    RanksRunning,
    RunFinished,
    RunStarted,
    SpareTaken,
    TriageDone,
)
from torchherd.engine.watch.hang import RankStack, stacks_of
from torchherd.engine.watch.straggler import StragglerTracker, tqdm_rate
from torchherd.runlog import GpuUsage, OutputLine, RunSummary, Status, flat, gpu_usage, progress_of
from torchherd.words import count


@dataclass(frozen=True)
class Segment:
    """``node`` was in ``state`` from ``start`` to ``end`` (seconds since the epoch)."""

    node: str
    state: str
    start: float
    end: float


@dataclass(frozen=True)
class Attempt:
    number: int
    nodes: tuple[str, ...]
    start: float
    end: float
    outcome: str
    """How it ended (its headline); the last attempt's is the run's."""
    ok: bool


@dataclass(frozen=True)
class Recovery:
    """From attempt ``after``'s failure to the next attempt's ranks running (or, where
    none ran, its start)."""

    after: int
    start: float
    end: float
    steps: tuple[str, ...]
    """What happened meanwhile: the triage, the exclusions, the spares, the staging."""


@dataclass(frozen=True)
class Mark:
    """Something that happened to ``node`` at ``at``: ``kind`` one of triage, excluded,
    spare, checkpoint, staged, replica, hang, straggler."""

    at: float
    node: str
    kind: str
    text: str


@dataclass(frozen=True)
class Point:
    at: float
    value: float


@dataclass(frozen=True)
class GpuPoint:
    at: float
    usage: GpuUsage


@dataclass
class Story:
    run_id: str
    start: float
    end: float
    nodes: list[str] = field(default_factory=list)
    """Every node that took part, in the order they first did (node-rank order, spares after)."""
    segments: list[Segment] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    recoveries: list[Recovery] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    progress: dict[str, list[Point]] = field(default_factory=dict)
    progress_signal: str = ""
    """``tqdm rate`` (iterations per second) or ``lines per second``; "" when there were neither."""
    busy: dict[str, list[Point]] = field(default_factory=dict)
    """Each node's busy share (0 to 1) per busy record."""
    gpus: dict[tuple[str, int], list[GpuPoint]] = field(default_factory=dict)
    preflight: CheckReport | None = None
    summary: RunSummary | None = None
    stacks: list[RankStack] = field(default_factory=list)
    straggler: str | None = None
    """The node named the slowest (its marks say since when)."""


JUDGE_EVERY = 5.0
"""Seconds between two judgements of the replayed straggler tracker (the live run's: 1)."""


def story_of(run_id: str, records: Sequence[Recorded]) -> Story:
    """The story of one run's history (records in any order: sorted by time here)."""
    ordered = sorted(records, key=lambda record: record.at)
    start = ordered[0].at if ordered else 0.0
    end = ordered[-1].at if ordered else 0.0
    finished = next((record.event for record in reversed(ordered) if isinstance(record.event, RunFinished)), None)
    slowest = finished.summary.slowest if finished is not None else None
    builder = _Builder(Story(run_id, start, end))
    # the GPUs' clocks are judged (each against all the others) only where they named the
    # straggler: at 512 GPUs a judgement costs a second
    builder.judge_gpus = finished is None or (slowest is not None and slowest.signal == "gpu clock")
    for record in ordered:
        builder.add(record)
    return builder.finished()


def _gpus(status: Status) -> tuple[GpuUsage, ...]:
    """``runlog.gpu_usage``'s reading of a gpu record, for the full records the supervisor
    writes (8 values per GPU) at a tenth of its cost; anything else goes to it."""
    gpus = status.fields.get("gpus")
    if not isinstance(gpus, list) or not all(
            type(gpu) is list and len(gpu) == 8 and all(type(value) in _NUMBERS for value in gpu) for gpu in gpus):
        return gpu_usage(status)
    return tuple(GpuUsage(int(gpu[0]), float(gpu[1]), float(gpu[2]), float(gpu[3]), float(gpu[4]), float(gpu[5]),
                          float(gpu[6]), int(gpu[7])) for gpu in gpus)


_NUMBERS = (int, float)


class _Builder:
    def __init__(self, story: Story) -> None:
        self.story = story
        self.state: dict[str, tuple[str, float]] = {}
        self.attempt: tuple[int, tuple[str, ...], float] | None = None
        self.failed: dict[int, tuple[float, str]] = {}
        self.last_ended = 0
        self.first_running: dict[int, float] = {}
        self.steps: dict[int, list[str]] = {}
        self.lines: dict[str, tuple[float, int]] = {}
        self.bar_rank: dict[str, int] = {}
        self.rates: dict[str, list[Point]] = {}
        self.line_rates: dict[str, list[Point]] = {}
        self.hang_lines: list[OutputLine] = []
        self.tracker = StragglerTracker()
        self.judged_at: float | None = None
        self.marked_since: dict[str, float] = {}
        self.judge_gpus = True

    # the records -------------------------------------------------------------------
    def add(self, record: Recorded) -> None:
        event, at = record.event, record.at
        if isinstance(event, (NodeStatus, LinesSeen)):
            self._sample(event, at)
            self._judge(at)
            return
        if isinstance(event, PreflightDone):
            self.story.preflight = event.report
        elif isinstance(event, AttemptStarted):
            self._attempt_started(event, at)
        elif isinstance(event, RunStarted):
            self._run_started(event, at)
        elif isinstance(event, AttemptFailed):
            self._ended_attempt(at)
            self.failed[event.number] = (at, event.headline)
        elif isinstance(event, RunFinished):
            self._ended_attempt(at)
            self.story.summary = event.summary
        elif isinstance(event, Output):
            self.hang_lines.extend(flat(event.lines))  # only a hang's lines are kept in a history
        else:
            self._node_event(event, at)
            self._mark_event(event, at)

    def _attempt_started(self, event: AttemptStarted, at: float) -> None:
        self._ended_attempt(at)
        self.attempt = (event.number, event.nodes, at)
        self._join(event.nodes)

    def _run_started(self, event: RunStarted, at: float) -> None:
        if self.attempt is None:
            self.attempt = (1, event.nodes, at)
        elif not self.attempt[1]:  # the scheduler picked them
            self.attempt = (self.attempt[0], event.nodes, self.attempt[2])
        self._join(event.nodes)
        for node in event.nodes:
            self._set(node, "starting", at)

    def _join(self, nodes: Sequence[str]) -> None:
        for node in nodes:
            if node not in self.story.nodes:
                self.story.nodes.append(node)

    def _node_event(self, event: object, at: float) -> None:
        if isinstance(event, RanksRunning):
            self._set(event.node, "running", at)
            if self.attempt is not None:
                self.first_running.setdefault(self.attempt[0], at)
        elif isinstance(event, NodeSilent):
            self._set(event.node, "running" if event.heard else "silent", at)
        elif isinstance(event, NodeLost):
            self._set(event.node, "lost", at)
        elif isinstance(event, NodeExited):
            self._set(event.node, "finished" if event.code == 0 else "torn down" if event.expected else "failed", at)
        elif isinstance(event, NodeNotStarted):
            self._set(event.node, "not started", at)

    def _mark_event(self, event: object, at: float) -> None:
        # between two attempts: the recovery after the one that ended
        number = self.attempt[0] if self.attempt is not None else self.last_ended
        steps = self.steps.setdefault(number, [])
        if isinstance(event, TriageDone):
            for node, why in event.failed:
                self._mark(at, node, "triage", f"failed the triage: {why}")
            failed = f", {len(event.failed)} failed" if event.failed else ", all passed"
            steps.append(f"triage of {len(event.nodes)} nodes {event.seconds:.1f} s{failed}")
        elif isinstance(event, NodeExcluded):
            self._mark(at, event.node, "excluded", f"excluded: {event.reason}")
            steps.append(f"{event.node} excluded")
        elif isinstance(event, SpareTaken):
            self._join((event.spare,))
            self._mark(at, event.spare, "spare", f"spare, in place of {event.replacing}")
            steps.append(f"{event.spare} in place of {event.replacing}")
        elif isinstance(event, CheckpointSaved):
            self._mark(at, event.node, "checkpoint", f"saved {event.path} ({event.size:,} bytes)")
        elif isinstance(event, CheckpointStaged):
            for node in event.nodes or (event.source,):
                self._mark(at, node, "staged", f"checkpoint {event.path} staged from {event.source}")
            steps.append(f"checkpoint staged on {count(len(event.nodes), 'node')} in {event.seconds:.1f} s")
        elif isinstance(event, CheckpointReplicated):
            for node in event.nodes:
                self._mark(at, node, "replica", f"replica of {event.path} from {event.source}")
        elif isinstance(event, HangFound):
            for node in self.attempt[1] if self.attempt is not None else self.story.nodes:
                self._mark(at, node, "hang", f"hang found: no line and no CPU for {event.seconds:g} s")

    def _mark(self, at: float, node: str, kind: str, text: str) -> None:
        self.story.marks.append(Mark(at, node, kind, text))

    def _set(self, node: str, state: str, at: float) -> None:
        self._close(node, at)
        self.state[node] = (state, at)

    def _close(self, node: str, at: float) -> None:
        found = self.state.pop(node, None)
        if found is not None and at > found[1]:
            self.story.segments.append(Segment(node, found[0], found[1], at))

    def _ended_attempt(self, at: float) -> None:
        """The attempt under way ended at ``at``: every node's state ends with it."""
        for node in list(self.state):
            self._close(node, at)
        if self.attempt is None:
            return
        number, nodes, start = self.attempt
        self.last_ended = number
        self.story.attempts.append(Attempt(number, nodes, start, at, "", True))
        self.attempt = None

    # the samples --------------------------------------------------------------------
    def _sample(self, event: NodeStatus | LinesSeen, at: float) -> None:
        if isinstance(event, LinesSeen):
            before = self.lines.get(event.node)
            self.lines[event.node] = (at, event.total)
            if before is not None and at > before[0] and event.total >= before[1]:
                count = event.total - before[1]
                self.line_rates.setdefault(event.node, []).append(Point(at, count / (at - before[0])))
                self.tracker.lines(event.node, count, at)
            return
        status = event.status
        if status.event == "gpu":
            usage = _gpus(status)
            for gpu in usage:
                self.story.gpus.setdefault((status.node, gpu.gpu), []).append(GpuPoint(at, gpu))
            if self.judge_gpus:
                self.tracker.gpus(status.node, usage, at)
        elif status.event == "busy":
            samples, busy = status.fields.get("samples"), status.fields.get("busy")
            if isinstance(samples, int) and isinstance(busy, int) and samples > 0:
                self.story.busy.setdefault(status.node, []).append(Point(at, busy / samples))
                self.tracker.busy(status.node, samples, busy, at)
        else:
            self._bar(status.node, progress_of(status), at)

    def _bar(self, node: str, bar: tuple[int | None, str] | None, at: float) -> None:
        if bar is None:
            return
        rank, text = bar
        lowest = self.bar_rank.get(node)  # one bar per node, its lowest rank's, as the panel shows it
        if rank is not None and (lowest is None or rank < lowest):
            self.bar_rank[node] = lowest = rank
        rate = tqdm_rate(text)
        if rate is not None and (rank is None or rank == lowest):
            self.rates.setdefault(node, []).append(Point(at, rate))
            self.tracker.bar(node, text, at)

    def _judge(self, at: float) -> None:
        """The straggler as the run judged it, replayed at most once a second."""
        if self.judged_at is not None and at - self.judged_at < JUDGE_EVERY:
            return
        self.judged_at = at
        for node in self.tracker.progress(at).marked:
            self.marked_since.setdefault(node, at)

    # the end ------------------------------------------------------------------------
    def finished(self) -> Story:
        story = self.story
        self._ended_attempt(story.end)
        self._outcomes()
        story.recoveries = [self._recovery(attempt, following)
                            for attempt, following in zip(story.attempts, story.attempts[1:])]
        story.progress, story.progress_signal = ((self.rates, "tqdm rate") if self.rates else
                                                 (self.line_rates, "lines per second") if self.line_rates else
                                                 ({}, ""))
        slowest = story.summary.slowest if story.summary is not None else self.tracker.slowest
        if slowest is not None:
            story.straggler = slowest.node
            since = self.marked_since.get(slowest.node)
            if since is not None:
                self._mark(since, slowest.node, "straggler", slowest.text())
        story.marks.sort(key=lambda mark: mark.at)
        story.stacks = stacks_of(self.hang_lines)
        return story

    def _outcomes(self) -> None:
        """Each attempt's end: the failure's headline, the last one's the run's."""
        story = self.story
        records = {record.number: record for record in story.summary.attempts} if story.summary else {}
        for index, attempt in enumerate(story.attempts):
            failed = self.failed.get(attempt.number)
            record = records.get(attempt.number)
            if failed is not None:
                outcome, ok = failed[1], False
            elif story.summary is not None and index == len(story.attempts) - 1:
                outcome, ok = story.summary.headline, story.summary.exit_code == 0
            else:
                outcome, ok = "no end recorded", False
            if record is not None:
                ok = record.ended == "ok"
            story.attempts[index] = Attempt(attempt.number, attempt.nodes, attempt.start, attempt.end, outcome, ok)

    def _recovery(self, attempt: Attempt, following: Attempt) -> Recovery:
        end = self.first_running.get(following.number, following.start)
        return Recovery(attempt.number, attempt.end, max(end, attempt.end),
                        tuple(self.steps.get(attempt.number, ())))
