"""The engine on the local transport: real supervisors in real subprocesses on this
machine, a stand-in torchrun (fakes/fake_torchrun.py), no SSH and no root.

Each test builds a plan with ``torchherd.Cluster``, swaps torchrun's argv for the
stand-in, launches it, and checks the events, the summary and the log files."""

from __future__ import annotations

import os
import shutil
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest

from support.engine import cluster, faked
from torchherd.engine.events import (
    Collector,
    ConnectFailed,
    Interrupted,
    NodeExited,
    NodeLost,
    NodeNotStarted,
    NodeStarted,
    RanksRunning,
    RunFinished,
    RunStarted,
    StopSent,
)
from torchherd.engine.run import LaunchAborted, LaunchOptions, Run
from torchherd.engine.ssh.job import Job
from torchherd.engine.ssh.launch import launch
from torchherd.engine.ssh.preflight import run_quietly
from torchherd.plan import Plan
from torchherd.remote.wire import StopLevel
from torchherd.transport.local import LocalConnector, LocalSession


def start(tmp_path: Path, plan: Plan, collector: Collector, **options: object) -> Run:
    settings = {"check": False, "log_dir": tmp_path / "logs", "grace": 2.0, **options}
    connector = LocalConnector()
    return launch(plan, LaunchOptions(**settings), connector, collector)  # type: ignore[arg-type]


def test_a_clean_run_reports_each_step_and_logs_every_line(tmp_path: Path) -> None:
    plan = faked(cluster(tmp_path).plan("train.py", run_id="t-clean"), n0="lines=3", n1="lines=3")
    events = Collector()
    summary = start(tmp_path, plan, events).wait(timeout=30)
    assert summary.exit_code == 0
    assert [outcome.state for outcome in summary.nodes] == ["ok", "ok"]
    assert summary.headline.startswith("all 2 nodes finished (exit 0)")
    kinds = [type(event) for event in events.events]
    assert kinds[0] is RunStarted and kinds[-1] is RunFinished
    assert {event.node for event in events.of(RanksRunning)} == {"n0", "n1"}
    assert {(event.node, event.code) for event in events.of(NodeExited)} == {("n0", 0), ("n1", 0)}
    assert all(isinstance(event.pid, int) for event in events.of(NodeStarted))
    log = (tmp_path / "logs" / "t-clean" / "n1.log").read_text()
    assert [line for line in log.splitlines() if line.startswith("[rank")] == [
        f"[rank {rank}] line {index} from rank {rank}" for index in range(3) for rank in (2, 3)]
    assert [line.text for line in events.lines["n0"]] == [
        f"line {index} from rank {rank}" for index in range(3) for rank in (0, 1)]


def test_one_failing_node_tears_the_others_down_and_is_blamed(tmp_path: Path) -> None:
    plan = faked(cluster(tmp_path, 3).plan("train.py", run_id="t-fail"),
                 n0="sleep=60", n1="stderr=ValueError:_boom exit=3", n2="sleep=60")
    events = Collector()
    began = time.monotonic()
    summary = start(tmp_path, plan, events).wait(timeout=30)
    assert time.monotonic() - began < 15, "fail fast: the sleeping nodes were stopped, not waited for"
    assert summary.exit_code == 1
    states = {outcome.node: outcome.state for outcome in summary.nodes}
    assert states == {"n0": "torn down", "n1": "failed", "n2": "torn down"}
    assert summary.headline.startswith("n1 rank 2 failed first with exit code 3: rank 2: ValueError:_boom")
    stops = events.of(StopSent)
    assert stops and stops[0].level is StopLevel.TERM and stops[0].reason == "n1 failed"
    assert [event.node for event in events.of(NodeExited) if not event.expected and event.code] == ["n1"]


def test_stop_is_the_same_teardown_as_ctrl_c(tmp_path: Path) -> None:
    plan = faked(cluster(tmp_path).plan("train.py", run_id="t-stop"), n0="sleep=60", n1="sleep=60")
    events = Collector()
    run = start(tmp_path, plan, events)
    lines = run.lines()
    assert next(lines).text.startswith("line 0 from rank")
    run.stop()
    summary = run.wait(timeout=30)
    assert summary.exit_code == 130
    assert [outcome.state for outcome in summary.nodes] == ["interrupted", "interrupted"]
    assert events.of(Interrupted) == [Interrupted()]
    rest = list(lines)  # ends with the run
    assert all(line.node in ("n0", "n1") for line in rest)


def test_a_second_stop_kills_at_once(tmp_path: Path) -> None:
    plan = faked(cluster(tmp_path).plan("train.py", run_id="t-kill"),
                 n0="sleep=60 ignore_term=1", n1="sleep=60 ignore_term=1")
    events = Collector()
    run = start(tmp_path, plan, events, grace=30.0)
    _wait_for(lambda: len(events.of(RanksRunning)) == 2)
    run.stop()
    _wait_for(lambda: bool(events.of(StopSent)))
    run.stop()
    summary = run.wait(timeout=20)
    assert summary.exit_code == 130
    assert [event.level for event in events.of(StopSent)] == [StopLevel.TERM, StopLevel.KILL]


def test_an_unreachable_node_stops_the_launch_before_anything_starts(tmp_path: Path) -> None:
    plan = faked(cluster(tmp_path).plan("train.py", run_id="t-down"))
    events = Collector()
    with pytest.raises(LaunchAborted) as raised:
        launch(plan, LaunchOptions(check=False, log_dir=tmp_path / "logs"), LocalConnector(unreachable=frozenset({"n1"})),
               events)
    assert [event.error.node for event in events.of(ConnectFailed)] == ["n1"]
    assert raised.value.errors[0].kind == "timeout"
    assert not (tmp_path / "logs" / "t-down").exists()


def test_a_workdir_that_does_not_exist_is_a_job_that_did_not_start(tmp_path: Path) -> None:
    plan = faked(cluster(tmp_path).plan("train.py", run_id="t-cd"), n0="sleep=60")
    plan = replace(plan, nodes=(plan.nodes[0], replace(plan.nodes[1], workdir=str(tmp_path / "missing"))))
    events = Collector()
    summary = start(tmp_path, plan, events).wait(timeout=30)
    assert summary.exit_code == 1
    assert [(event.node, event.code) for event in events.of(NodeNotStarted)] == [("n1", 2)]
    assert "missing" in (tmp_path / "logs" / "t-cd" / "n1.log").read_text()


def test_a_node_whose_supervisor_vanishes_is_lost_and_the_others_stop(tmp_path: Path) -> None:
    plan = faked(cluster(tmp_path).plan("train.py", run_id="t-lost"), n0="sleep=60", n1="sleep=60")
    events = Collector()
    run = start(tmp_path, plan, events)
    _wait_for(lambda: len(events.of(NodeStarted)) == 2)
    assert isinstance(run.job, Job)
    session = run.job.sessions["n1"]
    assert isinstance(session, LocalSession)
    os.kill(session.processes[0].popen.pid, signal.SIGKILL)
    summary = run.wait(timeout=30)
    assert summary.exit_code == 1
    assert [event.node for event in events.of(NodeLost)] == ["n1"]
    assert summary.headline.startswith("n1 vanished: its SSH channel closed without an exit status")
    assert {outcome.node: outcome.state for outcome in summary.nodes} == {"n0": "torn down", "n1": "lost"}
    for node in plan.nodes:  # the killed supervisor could not remove its log directory
        shutil.rmtree(node.remote_log_dir, ignore_errors=True)


def test_a_quiet_run_keeps_every_line_and_stops_at_its_deadline(tmp_path: Path) -> None:
    plan = faked(cluster(tmp_path).plan("train.py", run_id="t-quiet"), n0="lines=2 sleep=60", n1="lines=2 sleep=60")
    sessions = {name: LocalSession(name) for name in ("n0", "n1")}
    began = time.monotonic()
    # The deadline leaves the stand-ins time to print on a loaded two-core machine.
    ran = run_quietly(plan, sessions, tmp_path / "logs", timeout=6.0, grace=1.0)
    assert time.monotonic() - began < 25
    assert ran.timed_out
    assert [line.text for line in ran.lines["n1"] if line.rank is not None] == [
        "line 0 from rank 2", "line 0 from rank 3", "line 1 from rank 2", "line 1 from rank 3"]
    assert {outcome.state for outcome in ran.summary.nodes} == {"torn down"}


def _wait_for(condition: object, seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_the_preflight_runs_on_the_local_transport_and_a_failure_stops_the_launch(tmp_path: Path) -> None:
    """The checks' gathering speaks the transport seam: on the local one, the facts script
    really runs; a missing script fails on every node, and the launch does not start."""
    local = cluster(tmp_path)
    report = local.check("missing.py", only=["ssh", "script"])
    assert not report.ok
    assert {(result.node, result.check, result.status) for result in report.results} == {
        ("n0", "ssh", "pass"), ("n1", "ssh", "pass"), ("n0", "script", "fail"), ("n1", "script", "fail")}
    events = Collector()
    plan = faked(local.plan("missing.py", run_id="t-pre"))
    with pytest.raises(LaunchAborted) as raised:
        launch(plan, LaunchOptions(check=True, log_dir=tmp_path / "logs"), local.connector, events)
    assert raised.value.report is not None and not raised.value.report.ok
    assert [type(event).__name__ for event in events.events] == ["PreflightDone"]
    assert not (tmp_path / "logs").exists()


def test_an_inherited_ignore_of_sigterm_is_kept() -> None:
    # Started with SIGTERM ignored, the controller keeps ignoring it (as Python keeps an
    # ignored SIGINT); otherwise SIGTERM ends the run like Ctrl-C.
    import signal

    from torchherd.engine.run import sigterm_as_interrupt

    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with sigterm_as_interrupt():
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with sigterm_as_interrupt():
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, signal.SIG_DFL)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)
