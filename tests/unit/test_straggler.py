"""The straggler: each node's progress rate, the slow node marked, the run's slowest named."""

from __future__ import annotations

from io import StringIO
from random import Random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchherd.console import make_console
from torchherd.console.observer import ConsoleObserver
from torchherd.console.panel import PanelModel, render_panel
from torchherd.console.view import TerminalView, ViewOptions
from torchherd.engine.events import NodeStatus, Output, RanksRunning, RunFinished
from torchherd.engine.watch.straggler import StragglerTracker, StragglerWatch, tqdm_rate
from torchherd.runlog import OutputLine, RunSummary, Status


def bar(rate: float) -> str:
    return f" 45%|####5     | 45/100 [00:04<00:05, {rate:5.2f}it/s]"


def feed(tracker: StragglerTracker, rates: dict[str, float], until: float, step: float = 1.0) -> None:
    now = 0.0
    while now <= until:
        for node, rate in rates.items():
            tracker.bar(node, bar(rate), now)
        tracker.progress(now)
        now += step


@pytest.mark.parametrize(("text", "rate"), [(bar(9.8), 9.8), (" 12%|#  | 120/1000 [01:40<12:10, 1.2kit/s]", 1200.0),
                                            (" 3/50 [00:07<01:50, 2.50s/it]", 0.4), (" 5%|5 | 5/100 [00:01, 3.1batch/s]", 3.1),
                                            (" 60/60 [00:09<00:00,  6.25it/s, loss=0.2171]", 6.25),
                                            ("rank 0 epoch 1:  5%|#  | 3/60 [2.5it/s, loss=0.5]", 2.5),
                                            (" 10%|#", None), ("  0%|          | 0/100 [00:00<?, ?it/s]", None)])
def test_tqdm_rate_reads_what_the_bar_shows(text: str, rate: float | None) -> None:
    assert tqdm_rate(text) == rate


def test_a_node_slower_for_the_whole_window_is_marked_and_named_in_the_summary() -> None:
    tracker = StragglerTracker()
    rates = {"node0": 10.0, "node1": 10.0, "node2": 5.5}
    feed(tracker, rates, 29.0)
    assert tracker.progress(29.0).marked == {} and tracker.summary(29.0) is None  # not yet a whole window
    feed(tracker, rates, 40.0)
    progress = tracker.progress(40.0)
    assert progress.signal == "tqdm rate" and list(progress.marked) == ["node2"]
    assert tracker.summary(40.0) == "slowest node: node2, 1.8x slower than the median (tqdm rate)"


def test_two_nodes_are_enough_with_bars_but_not_with_lines() -> None:
    bars = StragglerTracker()
    feed(bars, {"node0": 10.0, "node1": 4.0}, 40.0)
    assert list(bars.progress(40.0).marked) == ["node1"]
    lines = StragglerTracker()
    for second in range(41):
        lines.lines("node0", 100, float(second))
        lines.lines("node1", 10, float(second))
    assert lines.progress(40.0).marked == {} and lines.summary(40.0) is None


def test_lines_per_second_mark_a_node_among_three() -> None:
    tracker = StragglerTracker()
    for second in range(41):
        for node, count in (("node0", 20), ("node1", 22), ("node2", 5)):
            tracker.lines(node, count, float(second))
    progress = tracker.progress(40.0)
    assert progress.signal == "lines per second" and list(progress.marked) == ["node2"]
    assert tracker.summary(40.0) == "slowest node: node2, 4.0x slower than the median (lines per second)"


def test_few_samples_never_mark_a_node() -> None:
    tracker = StragglerTracker()
    feed(tracker, {"node0": 10.0, "node1": 10.0}, 40.0)
    for second in (0.0, 20.0, 40.0):
        tracker.bar("node2", bar(1.0), second)
    assert tracker.progress(40.0).marked == {}


def test_a_run_without_progress_says_so_once_it_lasted_a_window() -> None:
    tracker = StragglerTracker()
    tracker.progress(0.0)
    assert tracker.summary(10.0) is None
    assert tracker.summary(30.0) == "slowest node: no progress signal (no tqdm bar or printed line to compare)"


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 8), st.floats(0.5, 500.0), st.floats(0.2, 3.0), st.integers(0, 2**32))
def test_a_constant_rate_cluster_is_never_marked(nodes: int, rate: float, step: float, seed: int) -> None:
    random = Random(seed)
    tracker = StragglerTracker()
    now = 0.0
    while now < 120.0:
        for index in range(nodes):
            # tqdm's own rate wobbles around the true one; each node reports at its own moments
            tracker.bar(f"node{index}", bar(rate * random.uniform(0.85, 1.15)), now + random.uniform(0, step))
            tracker.lines(f"node{index}", 7, now + random.uniform(0, step))
        assert tracker.progress(now).marked == {}
        now += step
    assert tracker.summary(now) is None


def test_the_panel_marks_the_slow_node_and_shows_tqdm_rates() -> None:
    tracker = StragglerTracker()
    feed(tracker, {"node0": 10.0, "node1": 10.0, "node2": 5.0}, 40.0)
    model = PanelModel(["node0", "node1", "node2"])
    for node in ("node0", "node1", "node2"):
        model.state(node, "running")
        model.lines([OutputLine(node, 0, "out", "step")], 39.0)
    out = StringIO()
    make_console(out, width=80).print(render_panel(model, 40.0, progress=tracker.progress(40.0)))
    assert out.getvalue() == (
        "node    state       ranks   lines/s   it/s   quiet   last line\n"
        "──────────────────────────────────────────────────────────────\n"
        "node0   running         1         1   10.0      1s   step     \n"
        "node1   running         1         1   10.0      1s   step     \n"
        "node2   slow 2.0x       1         1    5.0      1s   step     \n")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_terminal_view_feeds_the_tracker_from_the_progress_records() -> None:
    out = StringIO()
    clock = Clock()
    view = TerminalView(make_console(out, width=100), ["node0", "node1", "node2"], 2,
                        ViewOptions(panel=True), clock=clock)
    for node in ("node0", "node1", "node2"):
        view.observe(RanksRunning(node))
    for second in range(41):
        clock.now = float(second)
        for index, rate in enumerate((12.0, 11.0, 6.0)):
            node = f"node{index}"
            view.observe(NodeStatus(Status(node, "progress", {"event": "progress", "rank": index, "text": bar(rate)})))
        view.render([OutputLine("node0", 0, "out", "tick")])
    assert view.watch is not None
    assert view.watch.summary()[1] == "slowest node: node2, 1.8x slower than the median (tqdm rate)"
    assert "slow 1.8x" in out.getvalue()
    view.close()


def test_a_plain_view_tracks_nothing() -> None:
    view = TerminalView(make_console(StringIO()), ["node0"], 0, ViewOptions(collapse=True))
    assert view.watch is None


def feed_busy(tracker: StragglerTracker, shares: dict[str, float], until: float, every: float = 2.0) -> None:
    """Each node's busy record every ``every`` seconds: 10 samples per second, its share busy."""
    now = 0.0
    while now <= until:
        for node, share in shares.items():
            samples = int(10 * every)
            tracker.busy(node, samples, round(samples * share), now)
        tracker.progress(now)
        now += every


def test_a_synchronous_job_names_the_node_the_others_wait_for() -> None:
    """Every rate the same (the job moves in lockstep): the busy shares name the node."""
    tracker = StragglerTracker()
    feed(tracker, {"node0": 5.0, "node1": 5.0, "node2": 5.0, "node3": 5.0}, 28.0)
    feed_busy(tracker, {"node0": 0.4, "node1": 0.45, "node2": 0.95, "node3": 0.4}, 28.0)
    assert tracker.progress(28.0).marked == {}  # not yet a whole window
    feed(tracker, {"node0": 5.0, "node1": 5.0, "node2": 5.0, "node3": 5.0}, 40.0)
    feed_busy(tracker, {"node0": 0.4, "node1": 0.45, "node2": 0.95, "node3": 0.4}, 40.0)
    progress = tracker.progress(40.0)
    assert progress.signal == "tqdm rate" and list(progress.marked) == ["node2"]
    assert progress.marked["node2"] == pytest.approx(0.95 / 0.4)
    assert tracker.summary(40.0) == ("slowest node: node2, 2.4x slower than the median (the others waited for it: "
                                     "its ranks busy 95% of the time, the other nodes' 40%)")


def test_two_nodes_name_the_one_the_other_waits_for() -> None:
    tracker = StragglerTracker()
    feed_busy(tracker, {"node0": 1.0, "node1": 0.5}, 40.0)
    assert list(tracker.progress(40.0).marked) == ["node0"]


@pytest.mark.parametrize("shares", [
    {"node0": 0.05, "node1": 0.02, "node2": 0.12},  # a job that sleeps: far apart in ratio, all idle
    {"node0": 1.0, "node1": 0.98, "node2": 1.0},  # compute-bound, no collective to wait in
    {"node0": 0.75, "node1": 0.4, "node2": 0.45},  # busier, but not a node that never waits
    {"node0": 0.9, "node1": 0.7, "node2": 0.75},  # busy, but not 1.5x the others
])
def test_busy_shares_that_name_no_straggler(shares: dict[str, float]) -> None:
    tracker = StragglerTracker()
    feed_busy(tracker, shares, 60.0)
    assert tracker.progress(60.0).marked == {} and tracker.summary(60.0) is None


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 8), st.floats(0.0, 1.0), st.integers(0, 2**32))
def test_nodes_equally_busy_are_never_marked(nodes: int, share: float, seed: int) -> None:
    """Sampling noise (each record's share off by up to 0.1) marks no one."""
    random = Random(seed)
    tracker = StragglerTracker()
    now = 0.0
    while now < 120.0:
        for index in range(nodes):
            noisy = min(1.0, max(0.0, share + random.uniform(-0.1, 0.1)))
            tracker.busy(f"node{index}", 20, round(20 * noisy), now + random.uniform(0, 2.0))
        assert tracker.progress(now).marked == {}
        now += 2.0
    assert tracker.summary(now) is None


def test_the_terminal_view_feeds_the_tracker_from_the_busy_records() -> None:
    clock = Clock()
    view = TerminalView(make_console(StringIO(), width=100), ["node0", "node1", "node2"], 2,
                        ViewOptions(panel=True), clock=clock)
    for second in range(0, 42, 2):
        clock.now = float(second)
        for node, busy in (("node0", 8), ("node1", 10), ("node2", 20)):
            view.observe(NodeStatus(Status(node, "busy", {"event": "busy", "samples": 20, "busy": busy})))
        view.render([OutputLine("node0", 0, "out", "tick")])
    assert view.watch is not None
    slowest, line = view.watch.summary()
    assert slowest is not None and (slowest.node, slowest.signal) == ("node2", "busy share")
    assert line == ("slowest node: node2, 2.2x slower than the median (the others waited for it: "
                    "its ranks busy 100% of the time, the other nodes' 45%)")
    view.close()


def test_the_engines_watch_relays_every_event_and_names_the_slowest_for_the_summary() -> None:
    clock = Clock()
    seen: list[object] = []
    watch = StragglerWatch(clock)
    relay = watch.relay(seen.append)
    for second in range(0, 42, 2):
        clock.now = float(second)
        for node, busy in (("node0", 9), ("node1", 20)):
            relay(NodeStatus(Status(node, "busy", {"event": "busy", "samples": 20, "busy": busy})))
        relay(Output((OutputLine("node0", 0, "out", "step"),)))
    assert len(seen) == 21 * 3
    slowest, line = watch.summary()
    assert slowest is not None and slowest.node == "node1" and slowest.ratio == pytest.approx(20 / 9)
    assert line is not None and line.startswith("slowest node: node1, 2.2x slower than the median")


@pytest.mark.parametrize("window", [12.0, 30.0])
def test_the_window_asked_for_is_the_one_the_watch_and_the_panel_judge_over(window: float) -> None:
    """--straggler-window: neither names a node sampled for less than the window, both name
    it once it has been sampled for all of it (one busy record every 2 s, as supervisors send)."""
    clock = Clock()
    watch = StragglerWatch(clock, window)
    view = TerminalView(make_console(StringIO(), width=100), ["node0", "node1"], 1,
                        ViewOptions(panel=True, straggler_window=window), clock=clock)
    named = {}
    for second in range(0, 44, 2):
        clock.now = float(second)
        for node, busy in (("node0", 9), ("node1", 20)):
            event = NodeStatus(Status(node, "busy", {"event": "busy", "samples": 20, "busy": busy}))
            watch.observe(event)
            view.observe(event)
        view.render([OutputLine("node0", 0, "out", "step")])
        assert view.watch is not None
        for name, judge in (("watch", watch), ("panel", view.watch)):
            if judge.summary()[0] is not None:
                named.setdefault(name, clock.now)
    view.close()
    assert set(named) == {"watch", "panel"} and all(window <= at <= window + 4 for at in named.values()), named


def test_plain_output_prints_the_summarys_straggler_line() -> None:
    out = StringIO()
    observer = ConsoleObserver(make_console(out, width=200))
    line = "slowest node: node1, 2.2x slower than the median (lines per second)"
    observer(RunFinished(RunSummary("th-1", 0, "all 2 nodes finished (exit 0) in 40.0 s", (), "logs",
                                    straggler=line)))
    assert line in out.getvalue().splitlines()


def gpu_record(node: str, gpus: list[list[float]]) -> NodeStatus:
    return NodeStatus(Status(node, "gpu", {"gpus": gpus}))


def feed_gpus(watch: StragglerWatch, clocks: dict[tuple[str, int], tuple[float, int]], until: float,
              utilisation: float = 98.0) -> None:
    """Every node's gpu record every 2 s: each GPU's SM clock (of 1,980 MHz) and throttle reasons."""
    now = 0.0
    while now <= until:
        watch.clock = lambda now=now: now  # type: ignore[misc]
        for node in sorted({node for node, _index in clocks}):
            gpus = [[index, utilisation, 60000.0, 81559.0, clock, 1980.0, 690.0, reasons]
                    for (name, index), (clock, reasons) in sorted(clocks.items()) if name == node]
            watch.observe(gpu_record(node, gpus))
        now += 2.0


def test_a_gpu_clocked_down_by_heat_is_named_with_its_reason_in_the_summary() -> None:
    watch = StragglerWatch(clock=lambda: 0.0)
    clocks = {(node, index): (1980.0, 0) for node in ("node0", "node1", "node2", "node3") for index in range(4)}
    clocks["node3", 2] = (1100.0, 0x40)  # HW thermal slowdown
    feed_gpus(watch, clocks, 40.0)
    slowest, line = watch.summary()
    assert slowest is not None and slowest.node == "node3" and slowest.signal == "gpu clock"
    assert line == ("slowest node: node3, 1.8x slower than the median (GPU 2 at 1,100 MHz, thermal slowdown; "
                    "the others at 1,980)")


@pytest.mark.parametrize("clocks", [
    {("node0", 0): (1980.0, 0), ("node1", 0): (1900.0, 0x4), ("node2", 0): (1860.0, 0)},  # a few % apart
    {("node0", 0): (1980.0, 0), ("node1", 0): (1100.0, 0x40)},  # too few GPUs to say which is odd
])
def test_gpu_clocks_that_name_no_straggler(clocks: dict[tuple[str, int], tuple[float, int]]) -> None:
    watch = StragglerWatch(clock=lambda: 0.0)
    feed_gpus(watch, clocks, 40.0)
    assert watch.summary()[0] is None


def test_idle_gpus_clocked_down_are_not_judged() -> None:
    watch = StragglerWatch(clock=lambda: 0.0)
    clocks = {("node0", 0): (1980.0, 0), ("node1", 0): (1980.0, 0), ("node2", 0): (300.0, 0x1)}
    feed_gpus(watch, clocks, 40.0, utilisation=3.0)
    assert watch.summary()[0] is None


def test_a_gpu_record_without_clocks_still_gives_the_panel_its_use() -> None:
    from torchherd.runlog import GpuUsage, gpu_usage

    old = Status("n", "gpu", {"gpus": [[0, 87, 12000, 81920]]})
    new = Status("n", "gpu", {"gpus": [[1, 99, 1000, 81920, 1410, 1980, 400.5, 0x80], [2, True, 1, 2]]})
    assert gpu_usage(old) == (GpuUsage(0, 87.0, 12000.0, 81920.0),)
    assert gpu_usage(new) == (GpuUsage(1, 99.0, 1000.0, 81920.0, 1410.0, 1980.0, 400.5, 0x80),)
