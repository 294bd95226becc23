"""When the controller counts a node as lost: heartbeats missed and its sshd silent too
(a link down), or its supervisor alone silent for long; never a node that is only late.
The clock is the test's: ``Job._silence`` is asked at chosen moments. The real faults
(a link down, every process killed, a loaded node, a slow link, a stalled terminal)
are in tests/cluster/test_detection.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.engine import cluster
from torchherd.console.observer import silent_note
from torchherd.engine.events import NodeSilent
from torchherd.engine.outcome import NodeRun
from torchherd.engine.run import LaunchOptions
from torchherd.engine.ssh.job import SILENT_LOST_AFTER, Job
from torchherd.inventory import Recovery, heartbeat_problem
from torchherd.transport.local import LocalSession


class Probed(LocalSession):
    """A session whose sshd last answered ``quiet`` seconds ago (None: nothing to probe)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.quiet: float | None = 0.2
        self.asked: list[float] = []

    def link_quiet(self, every: float) -> float | None:
        self.asked.append(every)
        return self.quiet


def watched(tmp_path: Path, events: list[object] | None = None, **options: float) -> tuple[Job, NodeRun, Probed]:
    plan = cluster(tmp_path).plan("train.py", run_id="t-detect")
    sessions = {node.host.name: Probed(node.host.name) for node in plan.nodes}
    job = Job(plan, sessions, LaunchOptions(log_dir=tmp_path / "logs", **options),
              (lambda event: None) if events is None else events.append)
    node = job.nodes["n1"]
    node.last_seen = job._watching_since = 100.0
    return job, node, sessions["n1"]


def test_missed_heartbeats_with_sshd_silent_too_lose_the_node(tmp_path: Path) -> None:
    job, node, session = watched(tmp_path)
    assert job._silence(node, 102.4) is None  # 4.8 beats: not yet
    session.quiet = 2.5
    assert job._silence(node, 102.4) is None
    assert job._silence(node, 102.5) == ("nothing heard from it for 2.5 s: no heartbeat, and its SSH connection "
                                         "does not answer")
    assert session.asked[-1] == 0.5


def test_late_heartbeats_while_sshd_answers_are_no_loss_until_the_supervisor_is_stuck(tmp_path: Path) -> None:
    job, node, session = watched(tmp_path)
    session.quiet = 0.7  # a slow link's round trip
    assert job._silence(node, 100.0 + SILENT_LOST_AFTER - 0.1) is None
    assert job._silence(node, 100.0 + SILENT_LOST_AFTER) == (
        f"nothing heard from it for {SILENT_LOST_AFTER:.0f} s (its sshd answers: its supervisor is stuck)")


def test_without_a_link_to_probe_only_the_long_silence_loses_a_node(tmp_path: Path) -> None:
    job, node, session = watched(tmp_path)
    session.quiet = None
    assert job._silence(node, 110.0) is None
    assert job._silence(node, 100.0 + SILENT_LOST_AFTER) == f"nothing heard from it for {SILENT_LOST_AFTER:.0f} s"


def test_a_controller_held_up_judges_silences_afresh(tmp_path: Path) -> None:
    """Its own stall (a suspended laptop) is not the nodes' silence: the readers had no
    turn either."""
    job, node, session = watched(tmp_path)
    session.quiet = 9.0
    job._watching_since = 108.0
    assert job._silence(node, 110.0) is None
    assert job._silence(node, 110.5) is not None


def test_the_settings_set_the_count(tmp_path: Path) -> None:
    job, node, session = watched(tmp_path, heartbeat=0.2, heartbeat_misses=10)
    session.quiet = 5.0
    assert job._silence(node, 101.9) is None
    assert job._silence(node, 102.0) is not None
    assert session.asked[-1] == 0.2


@pytest.mark.parametrize("heartbeat,misses,problem", [
    (0.5, 5, None), (0.1, 10, None), (5.0, 60, None), (0.05, 40, "heartbeat is 0.05 s"),
    (0.5, 1, "heartbeat_misses is 1"), (0.25, 3, "is 0.75 s"), (float("nan"), 5, "heartbeat is nan s")])
def test_heartbeat_settings_given_through_the_api_are_checked_too(heartbeat: float, misses: int,
                                                                  problem: str | None) -> None:
    found = heartbeat_problem(Recovery(heartbeat=heartbeat, heartbeat_misses=misses))
    assert found == problem if problem is None else problem in (found or "")


def test_a_supervisor_waits_for_its_controller_longer_than_the_controller_waits_for_it(tmp_path: Path) -> None:
    job, node, _ = watched(tmp_path)
    assert job._config(node, b"").watchdog == 10.0
    job, node, _ = watched(tmp_path, heartbeat=5.0, heartbeat_misses=4)
    assert (job._config(node, b"").heartbeat, job._config(node, b"").watchdog) == (5.0, 40.0)


def test_a_silent_supervisor_while_sshd_answers_is_told_once_and_again_when_it_speaks(tmp_path: Path) -> None:
    """Not lost for 30 s (a loaded node, a stuck supervisor), but not a silence to keep
    from the user either."""
    events: list[object] = []
    job, node, session = watched(tmp_path, events)
    session.quiet = 0.4
    assert job._silence(node, 102.4) is None and events == []  # within the heartbeats' limit
    assert job._silence(node, 102.5) is None
    assert job._silence(node, 110.0) is None
    assert events == [NodeSilent("n1", 2.5, SILENT_LOST_AFTER)]  # once
    node.last_seen = 111.0  # a record came
    assert job._silence(node, 111.2) is None
    assert events[1:] == [NodeSilent("n1", 11.0, SILENT_LOST_AFTER, heard=True)]
    assert job._silence(node, 113.5) is None and len(events) == 3  # a new silence: told again


def test_a_link_going_down_is_a_loss_not_a_silent_supervisor(tmp_path: Path) -> None:
    """sshd's last answer lags the last heartbeat by up to a probe's period: when the link
    goes down both fall silent, and the node is lost a moment later, with no warning first."""
    events: list[object] = []
    job, node, session = watched(tmp_path, events)
    session.quiet = 2.0
    assert job._silence(node, 102.5) is None
    session.quiet = 2.5
    assert job._silence(node, 103.0) is not None
    assert events == []


def test_the_silent_supervisors_notes_exactly() -> None:
    assert silent_note(NodeSilent("node1", 2.54, 30.0)) == (
        "node1: its supervisor has sent nothing for 2.5 s, though its sshd answers: the node is overloaded, or the "
        "supervisor stuck (lost after 30 s of silence)", "yellow")
    assert silent_note(NodeSilent("node1", 7.25, 30.0, heard=True)) == (
        "node1: its supervisor speaks again, after 7.2 s of silence", "dim")


def test_the_panel_shows_a_silent_supervisor_until_it_speaks_again() -> None:
    """Through the observer (as the run feeds it), each row exactly: node1 silent while its
    sshd answers, then running again once its supervisor speaks."""
    from io import StringIO

    from rich.console import Console

    from torchherd.console.observer import ConsoleObserver
    from torchherd.console.panel import render_panel
    from torchherd.console.view import TerminalView, ViewOptions
    from torchherd.engine.events import RanksRunning, RunStarted

    console = Console(file=StringIO(), width=60, height=40, force_terminal=True, color_system=None)
    observer = ConsoleObserver(console, view=ViewOptions(panel=True))
    observer(RunStarted("r1", ("node0", "node1"), "node0", "10.0.0.1", 29500, "logs", 1))
    observer(RanksRunning("node0"))
    observer(RanksRunning("node1"))
    observer(NodeSilent("node1", 2.5, 30.0))
    view = observer.renderer
    assert isinstance(view, TerminalView) and view.model is not None

    def panel() -> str:
        out = StringIO()
        Console(file=out, width=60, color_system=None).print(render_panel(view.model, 10.0))  # type: ignore[arg-type]
        return out.getvalue()

    assert panel() == ("node    state     ranks   lines/s   quiet   last line\n"
                       "─────────────────────────────────────────────────────\n"
                       "node0   running       0         0       -            \n"
                       "node1   silent        0         0       -            \n")
    observer(NodeSilent("node1", 5.1, 30.0, heard=True))
    assert panel().splitlines()[3] == "node1   running       0         0       -            "
    observer.close()


def test_the_summary_names_each_silent_supervisor_but_a_node_lost_for_it() -> None:
    from io import StringIO

    from torchherd.console import make_console
    from torchherd.console.observer import ConsoleObserver
    from torchherd.engine.events import NodeLost, RunFinished, RunStarted
    from torchherd.runlog import NodeOutcome, RunSummary

    out = StringIO()
    observer = ConsoleObserver(make_console(out, width=200))
    observer(RunStarted("r1", ("node0", "node1", "node2", "node3"), "node0", "10.0.0.1", 29500, "logs", 3))
    for event in (NodeSilent("node1", 2.5, 30.0), NodeSilent("node1", 5.14, 30.0, heard=True),
                  NodeSilent("node2", 2.5, 30.0), NodeSilent("node2", 3.0, 30.0, heard=True),
                  NodeSilent("node2", 2.6, 30.0), NodeSilent("node2", 7.25, 30.0, heard=True),
                  NodeSilent("node0", 2.5, 30.0),
                  NodeSilent("node3", 2.5, 30.0), NodeLost("node3", "node3 vanished: nothing heard from it for 30 s "
                                                                     "(its sshd answers: its supervisor is stuck)")):
        observer(event)
    nodes = tuple(NodeOutcome(name, index, "ok", 0, 9.0, None, None, ()) for index, name in enumerate(("node0", "node1", "node2")))
    observer(RunFinished(RunSummary("r1", 0, "all 3 nodes finished (exit 0)", nodes, "logs")))
    text = out.getvalue()
    summary = text[text.index("run r1\n"):].splitlines()
    assert summary[-3:] == [
        "node1: its supervisor was silent for 5.1 s while its sshd answered (the node overloaded, or the supervisor "
        "stuck)",
        "node2: its supervisor was silent 2 times, 7.2 s at the longest, while its sshd answered (the node overloaded, "
        "or the supervisor stuck)",
        "node0: its supervisor was silent for 2.5 s or more while its sshd answered (the node overloaded, or the "
        "supervisor stuck)"], text
