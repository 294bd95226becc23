"""The straggler: the node whose progress is clearly slower than the others'.

Each node's progress rate is tqdm's own rate where its ranks draw bars (the supervisor
sends them as ``progress`` records), else the lines it prints per second. A node is
marked slow when its rate over the last ``WINDOW`` seconds is ``FACTOR`` times below
the median of the nodes. Noise never marks one: a node is judged only once it has
``MIN_SAMPLES`` samples in the window and has been sampled for the whole window, and
only among enough judged nodes (``MIN_NODES``: two bars say more than two line
counts, which move with what a job chooses to print).

A synchronous job (DDP, every collective) advances at the pace of its slowest node on
every node: the rates are all the same and name no one. There the supervisors' ``busy``
records speak: the share of the time a node's ranks were busy rather than asleep. The
others sleep in each collective while they wait for the straggler, whose ranks never
do; a node busy at least ``BUSY_FLOOR`` of the time and ``FACTOR`` times more than the
median of the other nodes is the one they wait for, and by about that factor.

Where the ranks use GPUs, the supervisors' ``gpu`` records speak of the GPUs themselves: a
busy GPU (at least ``GPU_BUSY`` % utilised) whose SM clock, as a share of its own maximum,
is ``GPU_FACTOR`` times below the median of the other busy GPUs of the run is named, with
the throttle reasons the driver gave (thermal, power brake, hardware slowdown): one slow
GPU holds back every rank of a synchronous job. Shares of each GPU's own maximum, so
nodes with different GPU models are compared fairly.

``StragglerTracker`` is fed samples with their time and knows nothing of the screen;
``StragglerWatch`` feeds one from a run's events, for the run's summary.
"""

from __future__ import annotations

import re
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable, Literal

from torchherd.engine.events import Event, NodeStatus, Observer, Output
from torchherd.runlog import THROTTLE_REASONS, GpuUsage, RankLines, RunSummary, Slowest, gpu_usage, progress_of

WINDOW = 30.0
"""Seconds over which a node's rate is averaged, and a node must be sampled to be judged."""
FACTOR = 1.5
"""How many times below the median a node's rate must be to be marked."""
MIN_SAMPLES = 5
"""Samples a node needs in the window to be judged."""
BUSY_FLOOR = 0.8
"""The share of the time a node's ranks must be busy to be the one the others wait for."""
GPU_BUSY = 50.0
"""Utilisation (%) at which a GPU's clock is judged: an idle GPU clocks down on purpose."""
GPU_FACTOR = 1.2
"""How many times below the other busy GPUs' median clock share a GPU's must be to be named
(GPU boost clocks differ by a few percent between boards of one model)."""
Signal = Literal["tqdm rate", "lines per second", "busy share", "gpu clock"]
RateSignal = Literal["tqdm rate", "lines per second"]
MIN_NODES: dict[Signal, int] = {"tqdm rate": 2, "lines per second": 3, "busy share": 2, "gpu clock": 3}
"""Judged nodes (GPUs, for the clock) needed before any is marked, per signal."""
_PER_SECOND = re.compile(r"(\d+(?:\.\d+)?)([kMGT]?)[^\s/\],\d]*/s[,\]]")
"""tqdm's ``9.80it/s]``, ``9.80it/s, loss=0.2]`` with a postfix (``unit_scale``: ``1.2kit/s]``)."""
_SECONDS_PER = re.compile(r"(\d+(?:\.\d+)?)s/[^\s\],]+[,\]]")
"""tqdm's ``1.23s/it]`` when an iteration takes more than a second."""
_SCALE = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}


def tqdm_rate(text: str) -> float | None:
    """Iterations per second that a tqdm bar shows, else None (a bar before its first rate)."""
    match = _PER_SECOND.search(text)
    if match is not None:
        return float(match.group(1)) * _SCALE[match.group(2)]
    match = _SECONDS_PER.search(text)
    if match is not None and float(match.group(1)) > 0:
        return 1.0 / float(match.group(1))
    return None


def rate_text(rate: float) -> str:
    """A rate as the panel shows it: ``9.8``, ``120``, ``1.2k``."""
    if rate >= 1000:
        return f"{rate / 1000:.1f}k"
    return f"{rate:.0f}" if rate >= 100 else f"{rate:.1f}" if rate >= 1 else f"{rate:.2f}"


@dataclass(frozen=True)
class Progress:
    """What the tracker says of every judged node at one moment."""

    signal: RateSignal | None
    rates: dict[str, float]
    marked: dict[str, float]
    """Node -> how many times below the median its rate is, for the marked ones."""


class StragglerTracker:
    """Every node's progress samples, judged against the median (times are arguments)."""

    def __init__(self, window: float = WINDOW, factor: float = FACTOR, min_samples: int = MIN_SAMPLES) -> None:
        self.window, self.factor, self.min_samples = window, factor, min_samples
        self._samples: dict[RateSignal, dict[str, deque[tuple[float, float]]]] = {"tqdm rate": {},
                                                                                   "lines per second": {}}
        self._busy: dict[str, deque[tuple[float, int, int]]] = {}
        self._gpus: dict[tuple[str, int], deque[tuple[float, float, float, int]]] = {}
        """(node, GPU index) -> (time, SM clock, its maximum, throttle reasons) while busy."""
        self._gpu_first: dict[tuple[str, int], float] = {}
        self._first: dict[tuple[Signal, str], float] = {}
        self._started: float | None = None
        self.slowest: Slowest | None = None

    def bar(self, node: str, text: str, now: float) -> None:
        """A rank's tqdm bar as it stands (a bar without a rate yet is no sample)."""
        rate = tqdm_rate(text)
        if rate is not None:
            self._add("tqdm rate", node, rate, now)

    def lines(self, node: str, count: int, now: float) -> None:
        if count > 0:
            self._add("lines per second", node, float(count), now)

    def busy(self, node: str, samples: int, busy: int, now: float) -> None:
        """A supervisor's busy record: of ``samples`` looks at its ranks, ``busy`` found one busy."""
        if samples > 0:
            self._busy.setdefault(node, deque()).append((now, samples, busy))
            self._first.setdefault(("busy share", node), now)

    def gpus(self, node: str, gpus: tuple[GpuUsage, ...], now: float) -> None:
        """A supervisor's ``gpu`` record: the busy GPUs' clocks, where the board reports them."""
        for gpu in gpus:
            if gpu.clock is not None and gpu.max_clock and gpu.utilisation >= GPU_BUSY:
                key = (node, gpu.gpu)
                self._gpus.setdefault(key, deque()).append((now, gpu.clock, gpu.max_clock, gpu.reasons))
                self._gpu_first.setdefault(key, now)

    def _add(self, signal: RateSignal, node: str, value: float, now: float) -> None:
        self._samples[signal].setdefault(node, deque()).append((now, value))
        self._first.setdefault((signal, node), now)

    def _judged(self, signal: RateSignal, now: float) -> dict[str, float]:
        """Each judged node's rate over the window: tqdm's rates averaged, lines counted."""
        rates = {}
        for node, samples in self._samples[signal].items():
            if not self._judged_now(samples, self._first[(signal, node)], now):
                continue
            values = [value for _at, value in samples]
            rates[node] = sum(values) / (len(values) if signal == "tqdm rate" else self.window)
        return rates

    def _judged_now(self, samples: deque[Any], first: float, now: float) -> bool:
        """Drops ``samples`` (time first) older than the window; whether what is left may be
        judged: enough of them, and sampled since ``first`` for the whole window."""
        while samples and now - samples[0][0] > self.window:
            samples.popleft()
        return len(samples) >= self.min_samples and now - first >= self.window

    def progress(self, now: float) -> Progress:
        """The rates and marks now; the run's slowest node is kept from one call to the next."""
        self._started = now if self._started is None else self._started
        waited_for = {**self._gpu_marks(now), **self._busy_marks(now)}
        signal: RateSignal
        for signal in ("tqdm rate", "lines per second"):
            rates = self._judged(signal, now)
            if len(rates) >= MIN_NODES[signal]:
                return Progress(signal, rates, {**waited_for, **self._marks(signal, rates)})
        tqdm = self._judged("tqdm rate", now)
        return Progress("tqdm rate" if tqdm else None, tqdm, waited_for)

    def _marks(self, signal: RateSignal, rates: dict[str, float]) -> dict[str, float]:
        median = statistics.median(rates.values())
        marked = {node: median / rate for node, rate in rates.items() if rate > 0 and median >= self.factor * rate}
        for node, ratio in marked.items():
            self._keep(Slowest(node, ratio, signal))
        return marked

    def _busy_marks(self, now: float) -> dict[str, float]:
        """The node the others wait for, by its busy share against the others' median."""
        shares = {}
        for node, records in self._busy.items():
            if self._judged_now(records, self._first[("busy share", node)], now):
                shares[node] = sum(busy for _at, _samples, busy in records) / sum(n for _at, n, _busy in records)
        if len(shares) < MIN_NODES["busy share"]:
            return {}
        marked = {}
        for node, share in shares.items():
            others = statistics.median(other for name, other in shares.items() if name != node)
            if share >= BUSY_FLOOR and share >= self.factor * others:
                marked[node] = share / max(others, 0.01)
                detail = (f"the others waited for it: its ranks busy {share:.0%} of the time, "
                          f"the other nodes' {others:.0%}")
                self._keep(Slowest(node, marked[node], "busy share", detail))
        return marked

    def _gpu_marks(self, now: float) -> dict[str, float]:
        """The nodes with a GPU clocked well below the run's other busy GPUs."""
        judged: dict[tuple[str, int], tuple[float, float, int]] = {}
        for key, samples in self._gpus.items():
            if self._judged_now(samples, self._gpu_first[key], now):
                clock = statistics.fmean(sample[1] for sample in samples)
                share = statistics.fmean(sample[1] / sample[2] for sample in samples)
                judged[key] = (clock, share, _steady_reasons([sample[3] for sample in samples]))
        if len(judged) < MIN_NODES["gpu clock"]:
            return {}
        marked: dict[str, float] = {}
        for (node, index), (clock, share, reasons) in judged.items():
            others = [value for key, value in judged.items() if key != (node, index)]
            median_share = statistics.median(value[1] for value in others)
            if share <= 0 or median_share < GPU_FACTOR * share:
                continue
            ratio = median_share / share
            marked[node] = max(marked.get(node, 0.0), ratio)
            why = "".join(f", {words}" for bit, words in THROTTLE_REASONS.items() if reasons & bit)
            others_clock = statistics.median(value[0] for value in others)
            self._keep(Slowest(node, ratio, "gpu clock",
                               f"GPU {index} at {clock:,.0f} MHz{why}; the others at {others_clock:,.0f}"))
        return marked

    def _keep(self, candidate: Slowest) -> None:
        if self.slowest is None or candidate.ratio > self.slowest.ratio:
            self.slowest = candidate

    def summary(self, now: float) -> str | None:
        """The summary's line: the slowest node; that there was no progress signal when
        the run went a whole window without one; else None (nothing to say)."""
        if self.slowest is not None:
            return self.slowest.text()
        started = self._started if self._started is not None else now
        if not self._first and now - started >= self.window:
            return "slowest node: no progress signal (no tqdm bar or printed line to compare)"
        return None


def _steady_reasons(reasons: list[int]) -> int:
    """The throttle reasons present in at least half of the samples (a brief power cap
    while a kernel starts is no cause)."""
    found = 0
    for bit in THROTTLE_REASONS:
        if 2 * sum(1 for value in reasons if value & bit) >= len(reasons):
            found |= bit
    return found


class StragglerWatch:
    """A ``StragglerTracker`` fed from a run's events (its lines, its bars, its busy
    records), judged at most once a second: the slowest node for the run's summary."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window: float | None = None) -> None:
        self.tracker = StragglerTracker(WINDOW if window is None else window)
        self.clock = clock
        self._bar_rank: dict[str, int] = {}
        self._judged_at: float | None = None
        self._lock = threading.Lock()
        """Events come from the run's reader threads."""

    def relay(self, observer: Observer) -> Observer:
        """``observer``, with every event seen here first."""
        def both(event: Event) -> None:
            self.observe(event)
            observer(event)
        return both

    def observe(self, event: Event) -> None:
        with self._lock:
            self._observe(event, self.clock())

    def _observe(self, event: Event, now: float) -> None:
        if isinstance(event, Output):
            counts: dict[str, int] = {}
            for chunk in event.lines:
                count = chunk.records.count(b"\n") - 1 if isinstance(chunk, RankLines) else 1
                counts[chunk.node] = counts.get(chunk.node, 0) + count
            for node, count in counts.items():
                self.tracker.lines(node, count, now)
        elif isinstance(event, NodeStatus):
            self._status(event, now)
        if self._judged_at is None or now - self._judged_at >= 1.0:
            self._judged_at = now
            self.tracker.progress(now)

    def _status(self, event: NodeStatus, now: float) -> None:
        status = event.status
        if status.event == "gpu":
            self.tracker.gpus(status.node, gpu_usage(status), now)
            return
        if status.event == "busy":
            samples, busy = status.fields.get("samples"), status.fields.get("busy")
            if isinstance(samples, int) and isinstance(busy, int):
                self.tracker.busy(status.node, samples, busy, now)
            return
        bar = progress_of(status)
        if bar is None:
            return
        rank, text = bar
        # One bar per node, its lowest rank's, as the panel shows it.
        lowest = self._bar_rank.get(status.node)
        if rank is not None and (lowest is None or rank < lowest):
            self._bar_rank[status.node] = lowest = rank
        if rank is None or rank == lowest:
            self.tracker.bar(status.node, text, now)

    def progress(self, now: float) -> Progress:
        """The tracker's rates and marks now (the live panel's)."""
        with self._lock:
            return self.tracker.progress(now)

    def summary(self) -> tuple[Slowest | None, str | None]:
        """The slowest node of the run, and the summary's line on it."""
        with self._lock:
            now = self.clock()
            self.tracker.progress(now)
            return self.tracker.slowest, self.tracker.summary(now)

    def named(self, summary: RunSummary) -> RunSummary:
        """``summary`` with the run's slowest node and the line on it."""
        slowest, straggler = self.summary()
        return replace(summary, slowest=slowest, straggler=straggler)
