"""Recovery (``run --retries``): the ``[recovery]`` table and flags, the pure policy, and
the loop of attempts driven by a fake backend (the real one: tests/cluster/test_recovery.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from io import StringIO
from pathlib import Path

import pytest

from support.cli import assert_one_line, run_cli
from support.recovery import FakeBackend, FakePool, WarmingBackend, ended, inventory, names, outcome, plan_of, recover
from torchherd.checks.results import CheckResult
from torchherd.console import make_console
from torchherd.console.observer import ConsoleObserver
from torchherd.console.recovery import recovery_note
from torchherd.engine.events import (
    AttemptFailed,
    AttemptStarted,
    AttemptWarm,
    Collector,
    LostContainers,
    NodeExcluded,
    Output,
    RecoveryEnded,
    RunFinished,
    RunShrunk,
    SpareTaken,
    WarmReady,
)
from torchherd.engine.recovery.policy import (
    TRIAGE_CHECKS,
    Attempt,
    End,
    NextNodes,
    attempt_of,
    cooldown,
    error_key,
    known_lost,
    next_nodes,
    triage_failures,
    verdict,
)
from torchherd.engine.recovery.runner import FIRST_WARM_WAIT, RecoveringRun, attempt_plan
from torchherd.engine.run import LaunchAborted, LaunchOptions
from torchherd.engine.watch.hang import (
    HangWatch,
    RankStack,
    Targets,
    described,
    merged,
    spy_stacks,
    stacks_of,
    targets_of,
)
from torchherd.errors import InventoryError
from torchherd.inventory import Recovery, with_spares
from torchherd.plan import Plan, SyncOptions
from torchherd.runlog import OutputLine, RunSummary
from torchherd.transport.base import CommandResult

HOSTS = "".join(f'[[hosts]]\nname = "node{index}"\naddress = "192.0.2.{index + 1}"\n' for index in range(4))


# the inventory and the flags -------------------------------------------------------------


def test_recovery_table_and_spare_hosts() -> None:
    text = HOSTS + '[[hosts]]\nname = "node4"\nspare = true\n[recovery]\nretries = 3\nfinal_exit_codes = [2, 3]\n' \
        'min_nodes = 2\nspares = "node3"\n'
    parsed = inventory(text)
    assert [host.name for host in parsed.hosts] == ["node0", "node1", "node2"]  # type: ignore[attr-defined]
    assert [host.name for host in parsed.spares] == ["node3", "node4"]  # type: ignore[attr-defined]
    assert parsed.recovery == Recovery(retries=3, final_exit_codes=(2, 3), min_nodes=2)  # type: ignore[attr-defined]


def test_no_recovery_table_is_no_retries() -> None:
    parsed = inventory(HOSTS)
    assert parsed.recovery == Recovery()  # type: ignore[attr-defined]
    assert parsed.spares == ()  # type: ignore[attr-defined]


def test_a_spare_master_gives_way_and_a_named_spare_master_is_refused() -> None:
    parsed = inventory('[[hosts]]\nname = "node0"\nspare = true\n' + HOSTS.replace('name = "node0"', 'name = "n0"'))
    assert parsed.cluster.master == "n0"  # type: ignore[attr-defined]
    with pytest.raises(InventoryError, match=r"\[cluster\].master: 'node0' is a spare"):
        inventory('[cluster]\nmaster = "node0"\n[[hosts]]\nname = "node0"\nspare = true\n[[hosts]]\nname = "b"\n')
    moved = with_spares(inventory(HOSTS), frozenset({"node0"}))  # type: ignore[arg-type]
    assert moved.cluster.master == "node1" and [host.name for host in moved.spares] == ["node0"]


BAD = [
    pytest.param("[recovery]\nretries = -1\n", "[recovery].retries", id="retries-negative"),
    pytest.param("[recovery]\nretries = true\n", "[recovery].retries", id="retries-bool"),
    pytest.param("[recovery]\nretries = 5000\n", "[recovery].retries", id="retries-huge"),
    pytest.param("[recovery]\nfinal_exit_codes = [0]\n", "[recovery].final_exit_codes", id="codes-zero"),
    pytest.param('[recovery]\nfinal_exit_codes = "2"\n', "[recovery].final_exit_codes", id="codes-string"),
    pytest.param("[recovery]\nmin_nodes = 0\n", "[recovery].min_nodes", id="min-nodes-zero"),
    pytest.param('[recovery]\nspares = "node9"\n', "[recovery].spares", id="spare-unknown"),
    pytest.param('[recovery]\nspares = "node[1-"\n', "[recovery].spares", id="spare-nodeset"),
    pytest.param("[recovery]\nretry = 1\n", "[recovery].retry", id="unknown-key"),
    pytest.param('[[hosts]]\nname = "x"\nspare = "yes"\n', "hosts[4].spare", id="spare-not-bool"),
    pytest.param('[recovery]\nspares = "node[0-3]"\n', "every host is a spare", id="all-spares"),
]


@pytest.mark.parametrize(("extra", "named"), BAD)
def test_bad_recovery_keys_exit_2_naming_the_key(tmp_path: Path, extra: str, named: str) -> None:
    code, out = run_cli(tmp_path, HOSTS + extra, ["run", "--dry-run", "--", "train.py"])
    assert_one_line(code, out, named)


@pytest.mark.parametrize(("flags", "named"), [
    pytest.param(["--retries", "-1"], "--retries", id="retries-negative"),
    pytest.param(["--retries", "x"], "--retries", id="retries-word"),
    pytest.param(["--final-exit-codes", "2,0"], "--final-exit-codes", id="codes-zero"),
    pytest.param(["--final-exit-codes", "2,,3"], "--final-exit-codes", id="codes-empty"),
    pytest.param(["--min-nodes", "0"], "--min-nodes", id="min-nodes-zero"),
    pytest.param(["--spares", "node9"], "--spares", id="spare-unknown"),
    pytest.param(["--spares", "node[0-3]"], "--spares", id="all-spares"),
    pytest.param(["--spares", "node[1-"], "--spares", id="spare-nodeset"),
    pytest.param(["--hang-timeout", "0", "--scheduler", "slurm"], "--hang-timeout", id="slurm-hang-zero"),
    pytest.param(["--retries", "1", "--scheduler", "slurm", "--slurm-nodes", "2", "--spares", "node3"], "--spares",
                 id="slurm-picks-with-spares"),
    pytest.param(["--retries", "1", "--scheduler", "slurm", "--slurm-nodes", "2", "--min-nodes", "3", "--no-check"],
                 "--min-nodes 3", id="slurm-picks-min-nodes-above"),
    pytest.param(["--retries", "1", "--min-nodes", "9", "--no-check"], "--min-nodes 9", id="min-nodes-above"),
])
def test_bad_recovery_flags_exit_2_naming_the_flag(tmp_path: Path, flags: list[str], named: str) -> None:
    code, out = run_cli(tmp_path, HOSTS, ["run", *flags, "--", "train.py"])
    assert_one_line(code, out, named)


def test_dry_run_leaves_the_spares_out(tmp_path: Path) -> None:
    code, out = run_cli(tmp_path, HOSTS, ["run", "--dry-run", "--spares", "node3", "--retries", "1", "--", "t.py"])
    assert code == 0, out
    assert "node2" in out and "node3" not in out


# the policy ----------------------------------------------------------------------------------

NODES = ("node0", "node1", "node2")


def failed(number: int, culprit: str, error: str = "rank 1: RuntimeError: boom", code: int | None = 1,
           ended: str = "failed") -> Attempt:
    return Attempt(number, NODES, ended, culprit, error, code)  # type: ignore[arg-type]


def test_a_final_exit_code_ends_the_run() -> None:
    end = verdict(failed(1, "node1", code=2), [], Recovery(retries=3, final_exit_codes=(2,)))
    assert isinstance(end, End) and end.reason == "final exit code"
    assert verdict(failed(1, "node1", code=1), [], Recovery(retries=3, final_exit_codes=(2,))) is None


def test_the_same_error_on_another_node_is_a_job_bug() -> None:
    first = failed(1, "node1", "rank 1: ValueError: lr must be positive")
    second = failed(2, "node2", "rank 2: ValueError: lr must be positive")
    end = verdict(second, [first], Recovery(retries=5))
    assert isinstance(end, End) and end.reason == "job bug"
    assert "node1" in end.message and "node2" in end.message and "ValueError: lr must be positive" in end.message
    # another error, another exit code, the same node, or a lost node: not a job bug
    assert verdict(failed(2, "node2", "rank 2: OSError: disk"), [first], Recovery(retries=5)) is None
    assert verdict(failed(2, "node2", "rank 2: ValueError: lr must be positive", code=3), [first],
                   Recovery(retries=5)) is None
    assert verdict(failed(2, "node1", "rank 1: ValueError: lr must be positive"), [first], Recovery(retries=5)) is None
    assert verdict(failed(2, "node2", "rank 2: ValueError: lr must be positive", ended="lost"), [first],
                   Recovery(retries=5)) is None
    assert error_key("rank 12: x") == "x" and error_key(None) is None
    assert error_key("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:") is None


def test_retries_exhausted() -> None:
    assert verdict(failed(2, "node1"), [failed(1, "node0", "other")], Recovery(retries=2)) is None
    end = verdict(failed(3, "node1"), [failed(2, "node0", "other")], Recovery(retries=2))
    assert isinstance(end, End) and end.reason == "retries exhausted" and "2 retries used up" in end.message


def test_two_first_failures_in_a_row_exclude_the_node() -> None:
    assert cooldown(failed(2, "node1"), [failed(1, "node1")]) == "node1"
    assert cooldown(failed(2, "node1"), [failed(1, "node2")]) is None
    assert cooldown(failed(1, "node1"), []) is None


def test_spares_take_the_places_in_order_and_the_master_moves() -> None:
    chosen = next_nodes(NODES, ["node1"], ["node3", "node4"], "node0", Recovery())
    assert chosen == NextNodes(("node0", "node2", "node3"), "node0", (("node3", "node1"),), False)
    chosen = next_nodes(NODES, ["node0", "node2"], ["node3", "node4"], "node0", Recovery())
    assert isinstance(chosen, NextNodes)
    assert chosen.nodes == ("node1", "node3", "node4") and chosen.master == "node1"
    assert chosen.taken == (("node3", "node0"), ("node4", "node2"))


def test_without_a_spare_the_run_shrinks_to_min_nodes_or_ends() -> None:
    chosen = next_nodes(NODES, ["node2"], [], "node0", Recovery(min_nodes=2))
    assert isinstance(chosen, NextNodes) and chosen.nodes == ("node0", "node1") and chosen.shrunk
    end = next_nodes(NODES, ["node1", "node2"], [], "node0", Recovery(min_nodes=2))
    assert isinstance(end, End) and end.reason == "no spare left" and "node1, node2 excluded" in end.message
    end = next_nodes(NODES, ["node2"], [], "node0", Recovery())
    assert isinstance(end, End) and end.message == "node2 excluded, no spare left"
    same = next_nodes(NODES, [], [], "node0", Recovery())
    assert isinstance(same, NextNodes) and same.nodes == NODES and not same.shrunk


def test_the_lost_nodes_are_known_with_why_where_the_run_can_go_on_without_them() -> None:
    summary = RunSummary("th-test", 1, "node2 vanished", (
        outcome("node0", "torn down"), outcome("node1", "unresponsive", "node1 did not confirm the teardown; its "
                                                "processes may still run"),
        outcome("node2", "lost", "node2 vanished: nothing heard from it for 10 s")), "logs", "node2")
    attempt = attempt_of(3, NODES, summary)
    assert attempt.ended == "lost" and attempt.lost == ("node1", "node2")
    assert known_lost(attempt, [], ["node3", "node4"], Recovery(retries=5)) == {
        "node1": "lost in attempt 3: did not confirm the teardown; its processes may still run",
        "node2": "lost in attempt 3: vanished: nothing heard from it for 10 s"}
    assert known_lost(attempt, [], [], Recovery(retries=5, min_nodes=1)).keys() == {"node1", "node2"}
    # one spare for two lost nodes, and no --min-nodes: both are checked, as before
    assert known_lost(attempt, [], ["node3"], Recovery(retries=5)) == {}
    assert known_lost(attempt, ["node1"], ["node3", "node4"], Recovery(retries=5)).keys() == {"node2"}


def test_triage_failures_do_not_blame_cross_node_checks_on_an_unreachable_round() -> None:
    results = [CheckResult("node0", "ssh", "fail", "timed out"), CheckResult("node1", "port", "fail", "no route"),
               CheckResult("node2", "python", "fail", "no torch"), CheckResult("node1", "gpu", "pass", "")]
    assert triage_failures(results, NODES) == {"node0": "ssh: timed out", "node2": "python: no torch"}
    results[0] = CheckResult("node0", "ssh", "pass", "")
    assert triage_failures(results, NODES) == {"node1": "port: no route", "node2": "python: no torch"}


# the loop, on a fake backend -------------------------------------------------------------------


def test_a_crash_once_then_success_on_the_same_nodes() -> None:
    backend = FakeBackend([lambda plan: ended(plan, "node1"), lambda plan: ended(plan, None)])
    summary, events = recover(backend, plan_of(), Recovery(retries=2))
    assert summary.exit_code == 0
    assert [names(plan) for plan in backend.launched] == [NODES, NODES]
    assert [plan.nodes[0].env["TORCHHERD_ATTEMPT"] for plan in backend.launched] == ["1", "2"]
    assert [record.ended for record in summary.attempts] == ["failed", "ok"]
    assert summary.attempts[0].next == "attempt 2 on node0,node1,node2"
    assert backend.checked == [NODES]
    assert [type(event) for event in events.events if isinstance(event, (AttemptStarted, AttemptFailed))] == [
        AttemptStarted, AttemptFailed, AttemptStarted]
    assert len(events.of(RunFinished)) == 1


def test_lines_gives_every_attempt_s_lines_and_ends_with_the_run() -> None:
    """``RecoveringRun.lines`` as ``Run.lines``: what each attempt printed, in order, through
    the retry, until the run ends; ``report`` goes to the observer in order with them."""
    backend = FakeBackend([lambda plan: ended(plan, "node1"), lambda plan: ended(plan, None)], hold=True)
    events = Collector()
    run = RecoveringRun(backend, plan_of(), LaunchOptions(check=False, log_dir=Path("/nonexistent")),
                        Recovery(retries=1), events).start()
    lines = run.lines()
    got: list[OutputLine] = []
    run.report(Output((OutputLine("node0", 0, "out", "before the first read"),)))
    deadline = time.monotonic() + 10
    while not events.of(Output) and time.monotonic() < deadline:
        time.sleep(0.01)
    reader = threading.Thread(target=lambda: got.extend(lines), daemon=True)
    reader.start()
    for attempt in (1, 2):
        while (run._lines.queue is None or len(backend.jobs) < attempt or run._current is None
               or run._current.job is not backend.jobs[attempt - 1]) and time.monotonic() < deadline:
            time.sleep(0.01)
        run.report(Output((OutputLine("node0", 0, "out", f"attempt {attempt}"),
                           OutputLine("node1", None, "err", f"torchrun {attempt}"))))
        backend.jobs[attempt - 1].release.set()
    assert run.wait(timeout=10).exit_code == 0
    reader.join(5)
    assert not reader.is_alive()
    assert [(line.node, line.text) for line in got] == [("node0", "attempt 1"), ("node1", "torchrun 1"),
                                                        ("node0", "attempt 2"), ("node1", "torchrun 2")]
    assert [line.text for event in events.of(Output) for line in event.lines][0] == "before the first read"
    assert list(run.lines()) == []  # the run has ended: nothing more, at once


def test_a_lost_node_is_excluded_at_once_with_why_and_replaced_by_the_spare() -> None:
    lost = "node2 vanished: nothing heard from it for 10 s"
    backend = FakeBackend([lambda plan: ended(plan, "node2", "lost", lost), lambda plan: ended(plan, None)],
                          bad={"node2": "timed out"})
    summary, events = recover(backend, plan_of("node3", 4), Recovery(retries=1))
    assert summary.exit_code == 0
    assert names(backend.launched[1]) == ("node0", "node1", "node3")
    assert backend.launched[1].nodes[2].argv[backend.launched[1].nodes[2].argv.index("--node-rank") + 1] == "2"
    assert [(event.spare, event.replacing) for event in events.of(SpareTaken)] == [("node3", "node2")]
    why = "lost in attempt 1: vanished: nothing heard from it for 10 s"
    assert [(event.node, event.reason) for event in events.of(NodeExcluded)] == [("node2", why)]
    assert summary.attempts[0].ended == "lost" and summary.attempts[0].triage == (f"node2: {why}",)
    assert "node3 for node2" in summary.attempts[0].next
    # one triage round, without the lost node (its SSH connect would only wait for the
    # timeout): the spare is checked with the others, under the same master (and, before,
    # alone in the background while attempt 1 ran)
    assert sorted(backend.checked) == [("node0", "node1", "node3"), ("node3",)]


def test_a_lost_node_without_a_spare_is_checked_and_kept_when_it_is_back() -> None:
    backend = FakeBackend([lambda plan: ended(plan, "node2", "lost", "node2 vanished"), lambda plan: ended(plan, None)])
    summary, events = recover(backend, plan_of(), Recovery(retries=1))
    assert summary.exit_code == 0 and events.of(NodeExcluded) == []
    assert backend.checked == [NODES] and names(backend.launched[1]) == NODES
    assert backend.removed == []  # back in the last attempt: its supervisor there owns the name


def test_at_the_end_the_nodes_lost_and_left_out_are_asked_to_remove_the_runs_container() -> None:
    backend = FakeBackend([lambda plan: ended(plan, "node2", "lost", "node2 vanished"), lambda plan: ended(plan, None)],
                          containers=True)
    summary, events = recover(backend, plan_of("node3", 4), Recovery(retries=1))
    assert summary.exit_code == 0
    assert backend.removed == [(("node2",), ("node2",))]
    kinds = [type(event).__name__ for event in events.events if isinstance(event, (LostContainers, RunFinished))]
    assert kinds == ["LostContainers", "RunFinished"]  # before the summary: the note comes with the run


def test_a_removal_that_cannot_be_asked_names_what_may_be_left_and_the_run_ends_as_it_did() -> None:
    backend = FakeBackend([lambda plan: ended(plan, "node2", "lost", "node2 vanished"), lambda plan: ended(plan, None)],
                          remove_error="node2: no route")
    summary, events = recover(backend, plan_of("node3", 4), Recovery(retries=1))
    assert summary.exit_code == 0
    (event,) = events.of(LostContainers)
    assert event.removed == () and [(node, why) for node, _, _, why in event.left] == [("node2", "node2: no route")]
    assert event.left[0][1] == f"torchherd-{summary.run_id}-node2"


def test_a_run_without_a_lost_node_removes_nothing_at_its_end() -> None:
    backend = FakeBackend([lambda plan: ended(plan, "node1"), lambda plan: ended(plan, None)], containers=True)
    recover(backend, plan_of(), Recovery(retries=1))
    assert backend.removed == []


def test_the_triage_reads_torch_from_its_files_where_it_ran_lately() -> None:
    """Every node gets every triage check; torch is imported again only where nothing
    proved it lately: the spares checked at the start, the nodes whose ranks got through
    the rendezvous (not the lost node; in attempt 2, node1 is lost before any rank ran)."""
    backend = FakeBackend([lambda plan: ended(plan, "node2", "lost"), lambda plan: ended(plan, "node1", "lost"),
                           lambda plan: ended(plan, None)],
                          running=lambda plan: tuple(node.host.name for node in plan.nodes
                                                     if plan.nodes[0].env["TORCHHERD_ATTEMPT"] == "1"))
    run = RecoveringRun(backend, plan_of("node3,node4", 5), LaunchOptions(check=False, log_dir=Path("/nonexistent")),
                        Recovery(retries=2), Collector(), check_spares=True)
    assert run.start().wait(timeout=20).exit_code == 0
    assert backend.checked == [("node0", "node3", "node4"), ("node0", "node1", "node3", "node4"),
                               ("node0", "node3", "node4")]
    assert all(backend.only[names] == TRIAGE_CHECKS for names in backend.checked[1:])
    assert backend.known[("node0", "node1", "node3", "node4")] == {
        "node0": "attempt 1's ranks", "node1": "attempt 1's ranks", "node3": "the first preflight",
        "node4": "the first preflight"}
    assert backend.known[("node0", "node3", "node4")] == {"node4": "the first preflight"}
    assert names(backend.launched[2]) == ("node0", "node3", "node4")


def test_the_spares_torch_is_checked_while_the_first_attempt_runs() -> None:
    """Without the spares in a first preflight (``run --no-check``), their ``python`` check
    runs in the background: the triage then reads their torch from its files."""
    backend = FakeBackend([lambda plan: ended(plan, "node1"), lambda plan: ended(plan, None)], hold=True)
    run = RecoveringRun(backend, plan_of("node3", 4), LaunchOptions(check=False, log_dir=Path("/nonexistent")),
                        Recovery(retries=1), Collector()).start()
    deadline = time.monotonic() + 10
    while ("node3",) not in backend.checked and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # its future is set just after the fake check returned
    backend.jobs[0].release.set()
    backend.hold = False
    assert run.wait(timeout=20).exit_code == 0
    assert backend.only[("node3",)] == {"ssh", "python"}
    # node1's ranks failed first: its torch is imported again
    assert backend.known[("node0", "node1", "node2", "node3")] == {
        "node0": "attempt 1's ranks", "node2": "attempt 1's ranks", "node3": "a check while attempt 1 ran"}


def test_an_excluded_master_gives_way_and_the_run_shrinks() -> None:
    backend = FakeBackend([lambda plan: ended(plan, "node0", "lost"), lambda plan: ended(plan, None)],
                          bad={"node0": "timed out"})
    summary, events = recover(backend, plan_of(), Recovery(retries=1, min_nodes=2))
    assert summary.exit_code == 0
    second = backend.launched[1]
    assert names(second) == ("node1", "node2") and second.master == "node1"
    assert "--nnodes" in second.nodes[0].argv and second.nodes[0].argv[second.nodes[0].argv.index("--nnodes") + 1] == "2"
    assert len(events.of(RunShrunk)) == 1
    # the lost master is excluded at once: its workers are checked under the new one
    assert backend.checked == [("node1", "node2")]


def test_the_same_error_twice_ends_the_run_as_a_job_bug() -> None:
    backend = FakeBackend([lambda plan: ended(plan, "node1", error="rank 1: ValueError: bad"),
                           lambda plan: ended(plan, "node2", error="rank 2: ValueError: bad")])
    summary, events = recover(backend, plan_of(), Recovery(retries=5))
    assert summary.exit_code == 1 and len(backend.launched) == 2
    assert summary.headline.startswith("the same error on node1 (attempt 1) and on node2 (attempt 2): a bug in the job")
    assert len(events.of(RecoveryEnded)) == 1


def test_retries_exhausted_lists_every_attempt() -> None:
    backend = FakeBackend([lambda plan: ended(plan, "node1", error="rank 1: A"),
                           lambda plan: ended(plan, "node2", error="rank 2: B"),
                           lambda plan: ended(plan, "node1", error="rank 1: C")])
    summary, _ = recover(backend, plan_of(), Recovery(retries=2))
    assert summary.exit_code == 1 and [record.number for record in summary.attempts] == [1, 2, 3]
    assert summary.attempts[-1].next.startswith("2 retries used up")


def test_the_second_first_failure_of_a_node_excludes_it_though_its_checks_pass() -> None:
    backend = FakeBackend([lambda plan: ended(plan, "node1", error="rank 1: A"),
                           lambda plan: ended(plan, "node1", error="rank 1: B"), lambda plan: ended(plan, None)])
    summary, events = recover(backend, plan_of("node3", 4), Recovery(retries=3))
    assert summary.exit_code == 0
    assert names(backend.launched[2]) == ("node0", "node2", "node3")
    assert [event.node for event in events.of(NodeExcluded)] == ["node1"]


def test_no_spare_left_ends_the_run_naming_the_node() -> None:
    backend = FakeBackend([lambda plan: ended(plan, "node2", "lost")], bad={"node2": "timed out"})
    summary, _ = recover(backend, plan_of(), Recovery(retries=3))
    assert summary.exit_code == 1 and len(backend.launched) == 1
    assert summary.headline.startswith("node2 excluded, no spare left")
    assert backend.checked == [NODES]  # no spare to take its place: the lost node had its chance


def test_stop_never_retries() -> None:
    backend = FakeBackend([lambda plan: ended(plan, "node1")] * 3, hold=True)
    events = Collector()
    run = RecoveringRun(backend, plan_of(), LaunchOptions(check=False), Recovery(retries=2), events).start()
    run.stop()
    summary = run.wait(timeout=20)
    assert summary.exit_code == 130 and len(backend.launched) == 1 and backend.jobs[0].stopped == 1


def test_the_console_shows_the_attempts(tmp_path: Path) -> None:
    backend = FakeBackend([lambda plan: ended(plan, "node2"), lambda plan: ended(plan, None)],
                          bad={"node2": "timed out"})
    out = StringIO()
    observer = ConsoleObserver(make_console(out, width=200))
    summary, events = recover(backend, plan_of("node3", 4), Recovery(retries=1))
    for event in events.events:
        observer(event)
    text = out.getvalue()
    assert "attempt 1 of 2 on 3 nodes: node0, node1, node2" in text
    assert "triage: node2 failed the checks" in text
    assert "node2 excluded: ssh: timed out" in text
    assert "spare node3 takes the place of node2" in text
    assert "attempts" in text and "node0,node1,node3" in text


def test_attempt_plans_keep_the_run_id() -> None:
    plan = plan_of("node3", 4)
    again = attempt_plan(plan, ("node3", "node1"), 4)
    assert again.run_id == plan.run_id and again.master == "node3"
    assert again.nodes[0].env["TORCHHERD_RUN_ID"] == plan.run_id and again.nodes[1].env["TORCHHERD_ATTEMPT"] == "4"


# hangs -------------------------------------------------------------------------------------

def faulthandler_lines(node: str, rank: int, frames: list[tuple[str, int, str]]) -> list[OutputLine]:
    texts = ["Fatal Python error: Aborted", "", "Current thread 0x00007f911021db80 (most recent call first):"]
    texts += [f'  File "{path}", line {line} in {function}' for path, line, function in frames]
    texts += ["", "Extension modules: torch._C (total: 1)"]
    return [OutputLine(node, rank, "err", text) for text in texts]


TORCH = "/venv/lib/python3.11/site-packages/torch/distributed/"


def test_the_stack_that_differs_is_named_first() -> None:
    lines: list[OutputLine] = []
    for rank in range(8):
        node = f"node{rank // 2}"
        if rank == 5:
            lines += faulthandler_lines(node, rank, [("/work/train.py", 40, "main"), ("/work/train.py", 50, "<module>")])
        else:
            lines += faulthandler_lines(node, rank, [(TORCH + "distributed_c10d.py", 3252, "all_reduce"),
                                                     (TORCH + "c10d_logger.py", 83, "wrapper"),
                                                     ("/work/train.py", 42, "main")])
    lines.insert(3, OutputLine("node1", 3, "out", "step 3"))  # another rank's line between the frames
    stacks = stacks_of(lines)
    assert [stack.rank for stack in stacks] == list(range(8))
    assert described(stacks) == "rank 5 on node2 in main at train.py:40; ranks 0-4, 6-7 in all_reduce at train.py:42"
    assert described(stacks_of(lines[:0])) == "no rank printed its stack"


def test_every_rank_in_the_same_place() -> None:
    lines = [line for rank in range(3)
             for line in faulthandler_lines("n", rank, [(TORCH + "distributed_c10d.py", 1, "barrier"),
                                                         ("/w/t.py", 9, "main")])]
    assert described(stacks_of(lines)) == "ranks 0-2 in barrier at t.py:9"


def test_the_hang_probe_finds_ranks_by_their_environment_only(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    from torchherd.remote import argv

    env = {"PATH": "/usr/bin:/bin", "TORCHHERD_RUN_ID": "th-probe-test", "LOCAL_RANK": "0", "RANK": "7"}
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             env={**env, "TORCHHERD_RUN_ID": "th-other"})
    try:
        def probe(action: str) -> dict[str, object]:
            result = subprocess.run([sys.executable, *argv("hangprobe.py"), "th-probe-test", action],
                                    capture_output=True, text=True, timeout=30, check=True)
            return dict(json.loads(result.stdout))
        assert probe("cpu")["ranks"] == [7]
        assert probe("stop")["ranks"] == [7]
        assert probe("abort")["ranks"] == [7]
        assert rank.wait(timeout=10) == -6 and other.poll() is None
    finally:
        for process in (rank, other):
            process.kill()
            process.wait()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as file:
        return file.read().rsplit(b")", 1)[1].split()[0].decode()


SUPERVISOR = """
import os, subprocess, sys, time
env = {"PATH": "/usr/bin:/bin", "TORCHHERD_RUN_ID": sys.argv[1], "LOCAL_RANK": "0", "RANK": "7"}
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
print(rank.pid, flush=True)
rank.wait()
"""


def test_the_hang_probe_takes_only_the_supervisors_descendants_and_thaws_what_it_froze() -> None:
    """A decoy with the run's environment (another user's, when torchherd runs as root) is
    neither counted nor frozen: only descendants of the node's supervisor are ranks. And a
    rank the probe froze (``stop``) is continued by itself when no ``abort`` follows (the
    controller died between the two): a persist-mode job never stays frozen."""
    import json

    from torchherd.remote import argv

    run_id = "th-probe-tree"
    env = {"PATH": "/usr/bin:/bin", "TORCHHERD_RUN_ID": run_id, "LOCAL_RANK": "0", "RANK": "0"}
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR, run_id], stdout=subprocess.PIPE)
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    rank = 0
    try:
        assert supervisor.stdout is not None
        rank = int(supervisor.stdout.readline())

        def probe(*words: str) -> dict[str, object]:
            result = subprocess.run([sys.executable, *argv("hangprobe.py"), run_id, *words],
                                    capture_output=True, text=True, timeout=30, check=True)
            return dict(json.loads(result.stdout))

        assert probe("cpu", str(supervisor.pid))["ranks"] == [7]
        assert probe("stop", str(supervisor.pid), "1")["ranks"] == [7]
        assert _state(rank) == "T" and _state(decoy.pid) != "T"
        for _ in range(50):
            if _state(rank) != "T":
                break
            time.sleep(0.1)
        assert _state(rank) != "T", "continued by the probe's own guard"
        assert probe("cpu", "0")["ranks"] == [], "a supervisor not known yet: no rank"
        assert probe("cpu")["ranks"] == [0, 7], "without a supervisor (SLURM): the environment alone"
    finally:
        if rank:
            os.kill(rank, signal.SIGKILL)  # the supervisor's child, started by this test
        for process in (supervisor, decoy):
            process.kill()
            process.wait()
        if supervisor.stdout is not None:
            supervisor.stdout.close()


def test_the_hang_probe_takes_py_spys_dump_of_a_stopped_rank() -> None:
    # py-spy is a test extra: installed beside this Python, where the probe looks first.
    from torchherd.remote import argv

    spy = Path(sys.executable).parent / "py-spy"
    assert spy.exists() or shutil.which("py-spy"), "py-spy (a test extra) is not installed"
    env = {"PATH": "/usr/bin:/bin", "TORCHHERD_RUN_ID": "th-spy-test", "LOCAL_RANK": "0", "RANK": "3"}
    code = "import time\ndef wait_for_peer():\n    time.sleep(60)\nprint('up', flush=True)\nwait_for_peer()\n"
    rank = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE)
    try:
        assert rank.stdout is not None and rank.stdout.readline() == b"up\n"

        def probe(action: str) -> dict[str, object]:
            result = subprocess.run([sys.executable, *argv("hangprobe.py"), "th-spy-test", action],
                                    capture_output=True, text=True, timeout=60, check=True)
            return dict(json.loads(result.stdout))

        assert "dumps" not in probe("stop")
        dumps = probe("spy")["dumps"]
        assert isinstance(dumps, dict) and list(dumps) == ["3"], dumps
        (stack,) = spy_stacks({("node0", 3): dumps["3"]})
        assert (stack.node, stack.rank, stack.function, stack.where) == ("node0", 3, "wait_for_peer", "<string>:3"), \
            dumps["3"]
        probe("abort")
        assert rank.wait(timeout=10) == -6
    finally:
        rank.kill()
        rank.wait()


SPY_DUMP = """Process 87: /usr/bin/python3 -u /work/train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 87 (idle): "MainThread"
    all_reduce (/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py:3252)
    _exception_logger.<locals>.wrapper (/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py:83)
    main (/work/train.py:118)
    <module> (/work/train.py:139)
Thread 0x7F3A12345678 (idle): "pin_memory"
    wait (/usr/lib/python3.11/threading.py:320)
"""


def test_py_spys_dump_reads_as_the_same_stack_as_faulthandlers() -> None:
    (stack,) = spy_stacks({("node2", 5): SPY_DUMP})
    assert (stack.node, stack.rank, stack.function, stack.where) == ("node2", 5, "all_reduce", "train.py:118")
    assert spy_stacks({("node2", 5): "Error: Failed to find python version from target process\n"}) == []


def test_faulthandlers_stack_of_a_rank_comes_before_py_spys() -> None:
    faulthandler = [RankStack("node0", 0, "main", "train.py:40")]
    spied = [RankStack("node0", 0, "sleep", "train.py:41"), RankStack("node1", 1, "all_reduce", "train.py:42")]
    assert merged(faulthandler, spied) == [faulthandler[0], spied[1]]


class _ProbeSession:
    """A node's session that answers the hang probe with ``ranks`` (and no CPU used)."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks
        self.actions: list[str] = []

    def run(self, command: str, stdin: bytes = b"", timeout: float = 30.0) -> CommandResult:
        self.actions.append(command.split()[-3])  # ... RUN_ID ACTION SUPERVISOR THAW
        answer = json.dumps({"ticks": 0, "cpu": 0.0, "ranks": self.ranks}).encode()
        return CommandResult(0, answer + b"\n", b"", 0.0)


@dataclass
class _Reach:
    targets: Targets

    def hang_targets(self) -> Targets:
        return self.targets


def _watch(ranks: list[int], seconds: float) -> tuple[HangWatch, list[float], dict[str, _ProbeSession]]:
    plan = plan_of()
    sessions = {node.host.name: _ProbeSession(ranks) for node in plan.nodes}
    found: list[float] = []
    job = _Reach(targets_of(plan, sessions, {node.host.name: 4242 for node in plan.nodes}))  # type: ignore[arg-type]
    watch = HangWatch(plan.run_id, job, 1.0, found.append, lambda: None).start()
    time.sleep(seconds)
    watch.close()
    return watch, found, sessions


def test_a_job_whose_ranks_have_not_started_is_not_hung() -> None:
    # torchrun imports torch and meets the rendezvous before any rank exists: silent, no CPU
    watch, found, sessions = _watch([], 3.5)
    assert watch.hung is None and found == []
    assert all(set(session.actions) == {"cpu"} for session in sessions.values())


def test_ranks_silent_without_cpu_past_the_timeout_are_hung() -> None:
    watch, found, sessions = _watch([0], 3.5)
    assert watch.hung is not None and len(found) == 1
    assert all(session.actions[-3:] == ["stop", "spy", "abort"] for session in sessions.values())
    assert watch.dumps == {}  # the nodes have no py-spy: the stacks come from faulthandler alone


def _warm_argv(plan: Plan) -> list[tuple[str, str | None]]:
    return [(node.argv[0], node.env.get("PYTHON_EXEC")) for node in plan.nodes]


def test_attempt_1_forks_from_the_warm_pythons_ready_after_its_preflight_and_the_others_start_cold() -> None:
    pool = FakePool({"node0": "/run/w0", "node1": "/run/w1", "node3": "/run/w3"}, {"node2": "No module named 'torch'"})
    pool.answered.set()
    lost = "node2 vanished: nothing heard from it for 10 s"
    backend = WarmingBackend([lambda plan: ended(plan, "node2", "lost", lost), lambda plan: ended(plan, None)],
                             bad={"node2": "timed out"}, pool=pool)
    plan = plan_of("node3", 4)
    summary, events = recover(backend, plan, Recovery(retries=1))
    assert summary.exit_code == 0, summary.headline
    assert backend.started == [0]  # the warm Pythons start before attempt 1, beside its preflight
    assert pool.waited == [(("node0", "node1", "node2"), FIRST_WARM_WAIT)]
    cold = plan.nodes[2].argv[0]
    assert _warm_argv(backend.launched[0]) == [("/run/w0/python", "/run/w0/python"),
                                               ("/run/w1/python", "/run/w1/python"), (cold, None)]
    assert _warm_argv(backend.launched[1]) == [("/run/w0/python", "/run/w0/python"),
                                               ("/run/w1/python", "/run/w1/python"),
                                               ("/run/w3/python", "/run/w3/python")]
    warm = [(event.number, event.nodes, event.cold, event.why) for event in events.of(AttemptWarm)]
    assert warm == [(1, ("node0", "node1"), ("node2",), (("node2", "No module named 'torch'"),)),
                    (2, ("node0", "node1", "node3"), (), ())]
    kinds = [type(event).__name__ for event in events.events if isinstance(event, (AttemptStarted, AttemptWarm))]
    assert kinds == ["AttemptStarted", "AttemptWarm"] * 2
    assert [record.warm for record in summary.attempts] == [("node0", "node1"), ("node0", "node1", "node3")]
    assert pool.closed == [("node2",)]  # the lost node's warm Python is not waited for


def test_attempt_1_starts_cold_on_every_node_whose_warm_python_is_not_ready_in_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("torchherd.engine.recovery.runner.FIRST_WARM_WAIT", 0.05)
    pool = FakePool({"node0": "/run/w0"})  # never answers
    backend = WarmingBackend([lambda plan: ended(plan, None)], pool=pool)
    plan = plan_of()
    summary, events = recover(backend, plan, Recovery(retries=1))
    assert summary.exit_code == 0
    assert _warm_argv(backend.launched[0]) == [(node.argv[0], None) for node in plan.nodes]
    assert [(event.number, event.nodes, event.why) for event in events.of(AttemptWarm)] == [
        (1, (), (("node0", "not ready yet"), ("node1", "not ready yet"), ("node2", "not ready yet")))]
    assert summary.attempts[0].warm == ()


def test_a_synced_run_starts_its_warm_pythons_after_attempt_1_which_starts_cold() -> None:
    """The sync makes the workdir and the venv the warm Python would start in: it comes first."""
    pool = FakePool({"node0": "/run/w0", "node1": "/run/w1", "node2": "/run/w2"})
    pool.answered.set()
    backend = WarmingBackend([lambda plan: ended(plan, None)], pool=pool)
    plan = plan_of()
    synced = replace(plan, options=replace(plan.options, sync=SyncOptions("/home/me/project")))
    summary, events = recover(backend, synced, Recovery(retries=1))
    assert summary.exit_code == 0
    assert backend.started == [1] and pool.waited == []
    assert _warm_argv(backend.launched[0]) == [(node.argv[0], None) for node in synced.nodes]
    assert events.of(AttemptWarm) == [] and summary.attempts[0].warm == ()


def test_the_warm_pythons_end_when_attempt_1_cannot_start() -> None:
    pool = FakePool({"node0": "/run/w0"})

    def refused(plan: Plan) -> RunSummary:
        raise LaunchAborted("the preflight checks failed")

    backend = WarmingBackend([refused], pool=pool)
    with pytest.raises(LaunchAborted):
        RecoveringRun(backend, plan_of(), LaunchOptions(check=False, log_dir=Path("/nonexistent")),
                      Recovery(retries=1), Collector()).start()
    assert backend.started == [0] and pool.closed == [()]


def test_the_warm_notes_name_each_node_and_why_one_starts_cold() -> None:
    ready = WarmReady(("node0", "node1"), (("node2", "No module named 'torch'"),), 2.34)
    assert recovery_note(ready) == ("warm Python ready on node0, node1 in 2.3 s (torch imported); "
                                    "no warm Python on node2: No module named 'torch'", "bold yellow")
    assert recovery_note(WarmReady(("node0",), (), 1.0)) == ("warm Python ready on node0 in 1.0 s (torch imported)",
                                                             "dim")
    first = AttemptWarm(1, ("node0", "node1"), ("node2",), (("node2", "not ready yet"),))
    assert recovery_note(first) == ("attempt 1 starts warm on node0, node1 (torch imported beforehand); "
                                    "cold on node2 (not ready yet)", "dim")
    assert recovery_note(AttemptWarm(2, (), ("node0",), ())) == ("attempt 2 starts cold on node0", "dim")
