"""Detached runs on the local transport: start, status, logs, fail fast through the
coordinator, and stop; real supervisors (detached), a real coordinator, no SSH."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from support.engine import faked
from torchherd.api import Cluster, DetachedRun, attach, runs
from torchherd.engine.events import Collector, NodeStatus, Output
from torchherd.transport.local import LocalConnector


@pytest.fixture
def local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    home = tmp_path / "home"
    home.mkdir()
    connector = LocalConnector(env={"*": {"HOME": str(home)}})
    hosts = [{"name": f"n{index}", "address": "127.0.0.1"} for index in range(2)]
    return Cluster(hosts, python=sys.executable, workdir=str(tmp_path), nproc_per_node=2, connector=connector)


def _detach(cluster: Cluster, run_id: str, **behaviour: str) -> DetachedRun:
    run = cluster.launch(faked(cluster.plan("train.py", run_id=run_id), **behaviour), check=False, detach=True,
                         grace=2.0)
    assert isinstance(run, DetachedRun)
    return run


def _until(run: DetachedRun, wanted: set[str], seconds: float = 20.0) -> list[str]:
    deadline = time.monotonic() + seconds
    states: list[str] = []
    while time.monotonic() < deadline:
        states = [f"{state.state} {state.code}" for state in run.status()]
        if set(states) <= wanted:
            return states
        time.sleep(0.2)
    raise AssertionError(f"states {states}, wanted {wanted}")


def test_a_detached_run_is_found_followed_and_finishes_alone(local: Cluster) -> None:
    run = _detach(local, "t-det-ok", n0="lines=3 sleep=1", n1="lines=3 sleep=1")
    assert [found.run_id for found in runs()] == ["t-det-ok"]
    assert _until(run, {"exited 0"}) == ["exited 0", "exited 0"]
    events = Collector()
    codes = attach("t-det-ok", local.connector).follow(events, follow=True)
    assert codes == {"n0": 0, "n1": 0}
    assert [line.text for line in events.lines["n1"] if line.rank is not None] == [
        f"line {index} from rank {rank}" for index in range(3) for rank in (2, 3)]
    assert any(isinstance(event, NodeStatus) and event.status.event == "started" for event in events.events)
    only = [line.text for line in attach("t-det-ok", local.connector).lines() if line.rank == 0]
    assert only == [f"line {index} from rank 0" for index in range(3)]


def test_one_failing_node_stops_the_other_through_the_coordinator(local: Cluster) -> None:
    run = _detach(local, "t-det-fail", n0="sleep=60", n1="exit=3 sleep=1")
    states = _until(run, {"exited 3", "exited 143", "exited 137"})
    assert sorted(states) == ["exited 143", "exited 3"]


def test_stop_leaves_nothing_of_the_run(local: Cluster) -> None:
    run = _detach(local, "t-det-stop", n0="sleep=60", n1="sleep=60")
    assert _until(run, {"running None"}) == ["running None", "running None"]
    left = run.stop()
    assert left == {"n0": [], "n1": []}
    assert {state.state for state in run.status()} == {"exited"}
    events = Collector()
    run.follow(events, follow=False, node="n0")
    assert all(isinstance(event, (Output, NodeStatus)) for event in events.events)
    assert {line.node for line in events.lines.get("n0", [])} <= {"n0"}
