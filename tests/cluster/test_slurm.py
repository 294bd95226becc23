"""``torchherd run`` / ``check`` / detached runs with ``scheduler = "slurm"`` on the local
cluster running a real SLURM (slurmcluster.py): munged and slurmctld on the controller
side, one slurmd per node. Real sbatch, srun, squeue, scancel; torch on CPU with gloo.

Every test ends with the queue empty and nothing of its job on any node. The box has
two cores shared with other tests: small jobs, short runs, generous timeouts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from io import StringIO
from pathlib import Path

import pytest
from localcluster import LocalCluster
from slurmcluster import SlurmCluster, slurm_unavailable_reason

from support.cluster_detach import wait_recovery
from support.cluster_recovery import assert_spied, attempt_rows
from support.cluster_runs import SKIP_TORCH
from support.cluster_topologies import ALLREDUCE_DEMO
from support.processes import default_signals
from support.slurm_runs import remove_run_dirs
from torchherd.api import Cluster
from torchherd.cli import main
from torchherd.console import make_console
from torchherd.engine.events import (
    AttemptFailed,
    AttemptStarted,
    Collector,
    Event,
    JobQueued,
    NodeExcluded,
    RunStarted,
    SpareTaken,
)
from torchherd.engine.records import load as load_record
from torchherd.engine.recovery.runner import RecoveringRun
from torchherd.engine.run import LaunchOptions
from torchherd.engine.slurm.commands import parse_scontrol
from torchherd.inventory import Recovery
from torchherd.runlog import RunSummary

pytestmark = pytest.mark.cluster

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DDP_DEMO = str(EXAMPLES / "ddp_demo.py")
CRASH_DEMO = str(EXAMPLES / "crash_demo.py")
TICKER = str(EXAMPLES / "ticker.py")
RESUMABLE = str(EXAMPLES / "resumable.py")
PRELOADED = str(Path(__file__).resolve().parent / "jobs" / "preloaded.py")


@pytest.fixture(scope="module")
def slurm(cluster: LocalCluster) -> Iterator[SlurmCluster]:
    reason = slurm_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    made = SlurmCluster(cluster).up()
    try:
        yield made
    finally:
        made.down()


@pytest.fixture
def inventory(slurm: SlurmCluster, tmp_path: Path) -> Path:
    return slurm.inventory(tmp_path / "slurm.toml")


@pytest.fixture(autouse=True)
def _one_test(slurm: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """SLURM found through SLURM_CONF; run records of the test's own; afterwards no job
    in the queue, nothing on any node, and the run directories gone."""
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    yield
    try:
        left = slurm.queue()
        if left:
            slurm.client("scancel", "--full", "--signal=KILL", *left, check=False)
        slurm.wait_idle()
        assert not left, f"jobs left in the queue: {left}"
        assert_clean(slurm.cluster)
    finally:
        remove_run_dirs(slurm, tmp_path / "state")


def assert_clean(cluster: LocalCluster, timeout: float = 30.0) -> None:
    """Nothing of any job on any node (slurmd itself is the node's, not the job's)."""
    for name in cluster.names:
        deadline = time.monotonic() + timeout
        while True:
            left = [cmd for cmd in cluster.processes(name) if not cmd.startswith(("slurmd ", "/usr/sbin/slurmd"))]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert left == [], f"processes left on {name}: {left}"


def torchherd(inventory: Path, *args: str) -> tuple[int, str]:
    """``torchherd -i INVENTORY ARGS`` in this process: the exit code and all it printed."""
    out = StringIO()
    code = main(["-i", str(inventory), *args], console=make_console(out, width=200))
    return code, out.getvalue()


def run(inventory: Path, log_dir: Path, *args: str) -> tuple[int, str]:
    return torchherd(inventory, "run", "--log-dir", str(log_dir), *args)


@pytest.mark.timeout(300)
def test_ddp_demo_three_nodes_two_ranks_through_slurm(slurm: SlurmCluster, inventory: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    code, out = run(inventory, tmp_path / "logs", "--nproc-per-node", "2", "--", DDP_DEMO, "--steps", "20")
    print(f"ddp_demo 3x2 through SLURM took {time.monotonic() - started:.1f} s")
    assert code == 0, out
    assert re.search(r"torchherd: SLURM job \d+: submitted", out), out
    losses: dict[int, list[float]] = {}
    for rank in range(6):
        node = slurm.cluster.names[rank // 2]  # SLURM_NODEID follows the sorted nodelist
        lines = [line for line in out.splitlines() if line.startswith(f"{node}:{rank}:")]
        assert lines, f"no line from {node}:{rank}:\n{out}"
        for line in lines:
            assert re.match(rf"{node}:{rank}: ", line), line
            match = re.search(rf"rank {rank}/6 host {node} step \d+ loss ([0-9.]+)", line)
            if match:
                losses.setdefault(rank, []).append(float(match.group(1)))
    assert sorted(losses) == list(range(6)), out
    for rank, values in losses.items():
        assert values[-1] < values[0], f"rank {rank}: loss did not fall: {values}"
    assert len({tuple(round(value, 5) for value in values) for values in losses.values()}) == 1, losses
    assert "all 3 nodes finished (exit 0)" in out
    (run_dir,) = (tmp_path / "logs").iterdir()
    assert "[rank 1] rank 1/6 host node0 step 1 loss" in (run_dir / "node0.log").read_text()


@pytest.mark.timeout(180)
def test_each_nodes_torchrun_starts_warm_and_its_ranks_fork_from_it(slurm: SlurmCluster, inventory: Path,
                                                                     tmp_path: Path) -> None:
    """No supervisor on a SLURM node: the task's torchrun imports torch itself, and its
    ranks fork from it (one import per node)."""
    code, out = run(inventory, tmp_path / "logs", "--nproc-per-node", "2", "--", PRELOADED)
    assert code == 0, out
    said = sorted(re.findall(r"rank (\d) torch imported before the script: (\w+)", out))
    assert said == [(str(rank), "True") for rank in range(6)], out
    assert "started cold" not in out, out


@pytest.mark.timeout(240)
def test_a_rank_crash_ends_the_job_and_names_the_node(slurm: SlurmCluster, inventory: Path, tmp_path: Path) -> None:
    # Rank 1 (node1) raises at step 3; the others hang outside any collective, so only
    # SLURM's --kill-on-bad-exit can end them.
    code, out = run(inventory, tmp_path / "logs", "--nproc-per-node", "1", "--",
                    CRASH_DEMO, "--steps", "1000", "--crash-rank", "1", "--crash-step", "3", "--hang")
    assert code == 1, out
    assert "node1 rank 1 failed first with exit code 1: rank 1: RuntimeError: crash_demo: rank 1 crashes" in out
    assert re.search(r"^node1  failed \(rank 1\)\s+1 ", out, re.M), out
    assert re.search(r"^node0  torn down ", out, re.M), out
    assert re.search(r"^node2  torn down ", out, re.M), out
    assert re.search(r"slurm: srun: error: node1: task 1: Exited with exit code 1", out), out


@pytest.mark.timeout(240)
def test_ctrl_c_cancels_the_job_and_leaves_the_queue_empty(slurm: SlurmCluster, inventory: Path,
                                                           tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "torchherd", "-i", str(inventory), "run", "--no-check", "--log-dir",
            str(tmp_path / "logs"), "--nproc-per-node", "1", "--", CRASH_DEMO, "--steps", "100000"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               text=True, env={**slurm.env(), "XDG_STATE_HOME": str(tmp_path / "state"),
                                               "COLUMNS": "200"}, preexec_fn=default_signals(signal.SIGINT))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in process.stdout or ()),
                              daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 150
        while not any(re.match(r"node2:2: step 2 ", line) for line in lines):
            assert process.poll() is None and time.monotonic() < deadline, "\n".join(lines[-40:])
            time.sleep(0.2)
        assert slurm.queue(), "the job is not in the queue while it runs"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=120) == 130, "\n".join(lines[-40:])
    finally:
        if process.poll() is None:
            process.kill()
    reader.join(timeout=5)
    out = "\n".join(lines)
    assert "interrupted: stopping every node" in out
    assert re.search(r"interrupted: SLURM job \d+ was cancelled, and it has left the queue", out), out
    assert re.search(r"^node1  interrupted ", out, re.M), out
    assert slurm.queue() == []
    assert_clean(slurm.cluster)


def _detach(inventory: Path, *args: str) -> tuple[str, str]:
    code, out = torchherd(inventory, "run", "--detach", "--no-check", "--nproc-per-node", "1", "--", TICKER, *args)
    assert code == 0, out
    (run_id,) = re.findall(r"^(th-\S+)$", out, re.M)
    (job_id,) = re.findall(r"submitted as SLURM job (\d+)", out)
    return run_id, job_id


@pytest.mark.timeout(300)
def test_detach_then_status_logs_and_stop(slurm: SlurmCluster, inventory: Path) -> None:
    # A short run: logs -f follows it to its end, status then says every node exited 0.
    run_id, _ = _detach(inventory, "5", "0.2")
    code, out = torchherd(inventory, "logs", "-f", run_id)
    assert code == 0, out
    for rank, node in enumerate(slurm.cluster.names):
        ticks = re.findall(rf"^{node}:{rank}: tick {rank} (\d)$", out, re.M)
        assert ticks == [str(index) for index in range(5)], out
    code, out = torchherd(inventory, "status", run_id)
    assert code == 0
    for node in slurm.cluster.names:
        assert re.search(rf"^{node}\s+exited \(0\)", out, re.M), out

    # A long one: status says running, stop cancels it and confirms it left the queue.
    run_id, job_id = _detach(inventory, "100000", "0.2")
    deadline = time.monotonic() + 120
    while "running" not in torchherd(inventory, "status", run_id)[1]:
        assert time.monotonic() < deadline, torchherd(inventory, "status", run_id)[1]
        time.sleep(1)
    while "tick 2 3" not in (logs := torchherd(inventory, "logs", run_id, "--node", "node2")[1]):
        assert time.monotonic() < deadline, logs
        time.sleep(1)
    assert "node0" not in logs
    code, out = torchherd(inventory, "stop", run_id)
    assert code == 0, out
    assert f"SLURM job {job_id}: stopped, nothing of the run is left" in out
    assert job_id not in slurm.queue()
    assert_clean(slurm.cluster)


@pytest.mark.timeout(180)
def test_check_reports_a_drained_node_with_slurms_reason(slurm: SlurmCluster, inventory: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    def check(*extra: str) -> tuple[int, dict[str, list[dict[str, str]]]]:
        code, _ = torchherd(inventory, "check", "--json", *extra)
        return code, json.loads(capsys.readouterr().out)

    code, report = check()
    assert code == 0, report
    assert any("partition main is up: 3 nodes (3 usable)" in item["summary"] for item in report["checks"]), report
    # The node checks ran as steps of an allocation, which is gone again.
    ran = {(item["node"], item["check"]): item["status"] for item in report["checks"]}
    for node in slurm.cluster.names:
        for check_id in ("hostname", "port", "firewall", "python"):
            assert ran.get((node, check_id)) == "pass", (node, check_id, report)
    assert slurm.queue() == []
    slurm.drain("node1", "fan failure, ticket 42")
    try:
        # The python check passed above; with a node drained, the checks whose facts import
        # torch (2 s of CPU a node) see nothing of it.
        code, report = check(*SKIP_TORCH)
        _, human = torchherd(inventory, "check", *SKIP_TORCH)
    finally:
        slurm.resume("node1")
    assert code == 1, report
    failed = [item for item in report["checks"] if item["status"] == "fail"]
    assert any(item["node"] == "node1" and item["check"] == "slurm-node" and "drained" in item["summary"]
               and "fan failure, ticket 42" in item["summary"] for item in failed), failed
    assert not any(item["node"] in ("node0", "node2") for item in failed), failed
    assert "FAIL node1 slurm-node: node1 is drained (fan failure, ticket 42)" in human, human


@pytest.mark.timeout(300)
def test_submit_through_a_login_host_over_ssh(slurm: SlurmCluster, tmp_path: Path) -> None:
    # node0 is the login host: sbatch, squeue and the output files are reached over SSH
    # (node0 sees the config at /etc/slurm; this test's own SLURM_CONF is not used there).
    inventory = slurm.inventory(tmp_path / "login.toml", login="node0")
    code, out = run(inventory, tmp_path / "logs", "--nproc-per-node", "1", "--", TICKER, "3", "0.1")
    assert code == 0, out
    for rank, node in enumerate(slurm.cluster.names):
        assert re.findall(rf"^{node}:{rank}: tick {rank} (\d)$", out, re.M) == ["0", "1", "2"], out


@pytest.mark.timeout(180)
def test_check_inside_an_allocation_finds_a_blocked_port(slurm: SlurmCluster, inventory: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    rule = ["iptables", "-I", "INPUT", "-p", "tcp", "--dport", "29500", "-j", "DROP"]
    slurm.cluster.netns_exec("node0", rule)
    try:
        code, _ = torchherd(inventory, "check", "--json", "--only", "port,firewall")
    finally:
        slurm.cluster.netns_exec("node0", ["iptables", "-D", *rule[2:]])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    failed = {(item["node"], item["check"]) for item in report["checks"] if item["status"] == "fail"}
    assert ("node0", "firewall") in failed and ("node1", "port") in failed, report
    assert slurm.queue() == []


# run --retries: each attempt a new submission -------------------------------------------

FAIL_FIRST = str(Path(__file__).resolve().parent / "jobs" / "fail_first_attempt.py")


def job_fields(slurm: SlurmCluster, job_id: str) -> dict[str, str]:
    """``scontrol show job -o``: what slurmctld recorded of a job (it remembers an ended
    one for MinJobAge, 300 s)."""
    return parse_scontrol(slurm.client("scontrol", "show", "job", "-o", job_id).stdout)


@pytest.mark.timeout(420)
def test_a_rank_failing_in_attempt_1_is_resubmitted_and_attempt_2_succeeds(slurm: SlurmCluster, inventory: Path,
                                                                              tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    code, out = run(inventory, logs, "--retries", "2", "--nproc-per-node", "1", "--", FAIL_FIRST, "--fail-rank", "1")
    assert code == 0, out
    assert "attempt 1 of 3 on 3 nodes: node0, node1, node2" in out, out
    assert "node1 rank 1 failed first" in out and "fail_first_attempt: failing on purpose" in out, out
    assert "attempt 2 of 3 on 3 nodes: node0, node1, node2" in out, out
    jobs = re.findall(r"SLURM job (\d+): submitted", out)
    assert len(jobs) == 2 and jobs[0] != jobs[1], out
    first, second = (job_fields(slurm, job) for job in jobs)
    assert first["JobState"] == "FAILED" and second["JobState"] == "COMPLETED", (first, second)
    assert second["ExcNodeList"] == "(null)", second  # nothing excluded: a first failure is no verdict
    later = out[out.index("attempt 2 of 3"):]
    for rank, node in enumerate(slurm.cluster.names):
        assert re.findall(rf"^{node}:{rank}: tick {rank} (\d)$", later, re.M) == ["0", "1", "2"], out
    rows = attempt_rows(out)
    assert len(rows) == 2 and "failed" in rows[0] and "ok" in rows[1], out
    (run_dir,) = logs.iterdir()
    text = (run_dir / "node1.log").read_text()
    assert len(re.findall(r"^==== torchherd: attempt \d ", text, re.M)) == 2, text
    assert "rank 1 in attempt 2 on node1" in text, text
    assert slurm.queue() == []


@pytest.mark.timeout(420)
def test_a_node_drained_after_attempt_1_is_excluded_from_the_resubmission(slurm: SlurmCluster, inventory: Path,
                                                                           tmp_path: Path) -> None:
    # node0 and node1 run, node2 is the spare; node1's rank fails, then an admin drains
    # node1: the triage (sinfo) excludes it, attempt 2 is submitted with --exclude=node1.
    cluster = Cluster.from_toml(inventory).with_spares("node2")
    plan = cluster.plan(FAIL_FIRST, "--fail-rank", "1", nproc_per_node=1)
    events = Collector()

    def observer(event: Event) -> None:
        events(event)
        if isinstance(event, AttemptFailed):
            slurm.drain("node1", "ECC errors, ticket 7")

    try:
        run = cluster.launch(plan, log_dir=tmp_path / "logs", on_event=observer, recovery=Recovery(retries=1))
        assert isinstance(run, RecoveringRun)
        summary = run.wait(timeout=360)
        states = slurm.node_states()
    finally:
        slurm.resume("node1")
    assert summary.exit_code == 0, summary.headline
    assert [(record.nodes, record.ended) for record in summary.attempts] == [
        (("node0", "node1"), "failed"), (("node0", "node2"), "ok")], summary.attempts
    assert states["node1"] in ("drained", "draining"), states
    (excluded,) = events.of(NodeExcluded)
    assert excluded.node == "node1" and "drain" in excluded.reason and "ECC errors, ticket 7" in excluded.reason
    assert [spare.spare for spare in events.of(SpareTaken)] == ["node2"]
    jobs = list(dict.fromkeys(event.job_id for event in events.of(JobQueued)))
    assert len(jobs) == 2, jobs
    second = job_fields(slurm, jobs[1])
    assert second["ExcNodeList"] == "node1" and second["JobState"] == "COMPLETED", second
    assert "node1" not in slurm.client("scontrol", "show", "hostnames", second["NodeList"]).stdout.split(), second
    assert {outcome.node for outcome in summary.nodes} == {"node0", "node2"}
    assert slurm.queue() == []


@pytest.mark.timeout(300)
def test_stopped_between_two_attempts_nothing_is_resubmitted(slurm: SlurmCluster, inventory: Path,
                                                             tmp_path: Path) -> None:
    # Ctrl-C (stop()) as attempt 1 has failed: no triage result starts attempt 2, no job
    # is left in the queue, the run ends interrupted (130).
    cluster = Cluster.from_toml(inventory)
    plan = cluster.plan(FAIL_FIRST, "--fail-rank", "2", nproc_per_node=1)
    events = Collector()
    runs: list[RecoveringRun] = []

    def observer(event: Event) -> None:
        events(event)
        if isinstance(event, AttemptFailed):
            runs[0].stop()

    run = RecoveringRun(cluster.backend, plan, LaunchOptions(log_dir=tmp_path / "logs"), Recovery(retries=3),
                        observer)
    runs.append(run)
    summary = run.start().wait(timeout=240)
    assert summary.exit_code == 130, summary.headline
    assert [record.ended for record in summary.attempts] == ["failed"], summary.attempts
    assert summary.attempts[0].next == "interrupted"
    assert len({event.job_id for event in events.of(JobQueued)}) == 1
    assert not events.of(AttemptStarted)[1:]
    assert slurm.queue() == []


@pytest.mark.timeout(300)
def test_a_final_exit_code_ends_the_run_without_a_resubmission(slurm: SlurmCluster, inventory: Path,
                                                               tmp_path: Path) -> None:
    code, out = run(inventory, tmp_path / "logs", "--retries", "2", "--final-exit-codes", "3", "--nproc-per-node", "1",
                    "--", FAIL_FIRST, "--fail-rank", "1", "--exit-code", "3")
    assert code == 1, out
    assert "node1 exited with 3, an exit code marked final: no retry" in out, out
    assert "attempt 2 of" not in out and len(re.findall(r"SLURM job (\d+): submitted", out)) == 1, out
    assert slurm.queue() == []


@pytest.mark.timeout(420)
def test_the_same_error_on_another_node_ends_the_run_as_a_job_bug(slurm: SlurmCluster, inventory: Path,
                                                                  tmp_path: Path) -> None:
    code, out = run(inventory, tmp_path / "logs", "--retries", "3", "--nproc-per-node", "1", "--",
                    FAIL_FIRST, "--fail-rank", "1", "--every-attempt")
    assert code == 1, out
    assert ("the same error on node1 (attempt 1) and on node2 (attempt 2): a bug in the job, not a bad node: "
            "RuntimeError: fail_first_attempt: failing on purpose") in out, out
    assert "attempt 3 of" not in out and len(re.findall(r"SLURM job (\d+): submitted", out)) == 2, out
    assert slurm.queue() == []


def drain_rank_1s_node(slurm: SlurmCluster, tmp_path: Path, nodes: int, recovery: Recovery,
                       reason: str) -> tuple[RunSummary, Collector, str]:
    """A recovering run where SLURM picks ``nodes`` nodes ([slurm].nodes): rank 1 fails in
    attempt 1, then an admin drains the node it ran on (resumed afterwards). The run's
    summary, its events, and that node."""
    cluster = Cluster.from_toml(slurm.inventory(tmp_path / "picks.toml", nodes=nodes))
    plan = cluster.plan(FAIL_FIRST, "--fail-rank", "1", nproc_per_node=1)
    events = Collector()
    drained: list[str] = []

    def observer(event: Event) -> None:
        events(event)
        if isinstance(event, AttemptFailed) and not drained:
            drained.append(events.of(RunStarted)[-1].nodes[1])
            slurm.drain(drained[0], reason)

    try:
        run = cluster.launch(plan, log_dir=tmp_path / "logs", on_event=observer, recovery=recovery)
        assert isinstance(run, RecoveringRun)
        summary = run.wait(timeout=240)
    finally:
        for node in drained:
            slurm.resume(node)
    (bad,) = drained
    return summary, events, bad


@pytest.mark.timeout(420)
def test_where_slurm_picks_the_nodes_a_drained_node_is_left_out_and_slurm_picks_another(slurm: SlurmCluster,
                                                                                         tmp_path: Path) -> None:
    # [slurm].nodes = 2 of the three: SLURM picks them. Rank 1 fails in attempt 1, then an
    # admin drains its node: the triage (sinfo, on the nodes attempt 1 ran on) excludes it,
    # and attempt 2 is submitted with --exclude; SLURM picks the two others.
    summary, events, bad = drain_rank_1s_node(slurm, tmp_path, 2, Recovery(retries=2), "PCIe AER storm")
    assert summary.exit_code == 0, summary.headline
    first, second = summary.attempts
    assert first.ended == "failed" and len(first.nodes) == 2 and first.nodes[1] == bad, summary.attempts
    assert second.ended == "ok" and len(second.nodes) == 2 and bad not in second.nodes, summary.attempts
    assert first.next == f"attempt 2 on 2 nodes SLURM picks, not {bad}", first
    (excluded,) = events.of(NodeExcluded)
    assert excluded.node == bad and "PCIe AER storm" in excluded.reason, excluded
    assert [event.picking for event in events.of(AttemptStarted)] == ["2 nodes SLURM picks",
                                                                      f"2 nodes SLURM picks, not {bad}"]
    jobs = list(dict.fromkeys(event.job_id for event in events.of(JobQueued)))
    assert len(jobs) == 2, jobs
    fields = job_fields(slurm, jobs[1])
    assert fields["ExcNodeList"] == bad and fields["JobState"] == "COMPLETED", fields
    assert slurm.queue() == []


@pytest.mark.serial  # timed: the hang watch's budget of seconds (tests/conftest.py)
@pytest.mark.timeout(300)
def test_a_hang_is_named_by_probes_run_as_steps_beside_the_job(slurm: SlurmCluster, inventory: Path,
                                                               tmp_path: Path) -> None:
    # Rank 1 (node1) sleeps at step 5; ranks 0 and 2 wait for it in all_reduce. The watch
    # samples their CPU and sends SIGABRT through srun --overlap steps of the job itself.
    sleeping = next(number for number, text in enumerate(Path(RESUMABLE).read_text().splitlines(), 1)
                    if "time.sleep(100_000)" in text)
    logs = tmp_path / "logs"
    started = time.monotonic()
    code, out = run(inventory, logs, "--hang-timeout", "5", "--nproc-per-node", "1", "--", RESUMABLE,
                    "--steps", "100", "--step-seconds", "0.05", "--hang-rank", "1", "--hang-step", "5")
    seconds = time.monotonic() - started
    assert code == 1, out
    assert re.search(rf"hung: no rank printed a line or used CPU for 5 s; rank 1 on node1 in main at "
                     rf"resumable.py:{sleeping}; ranks 0, 2 in \S+ at resumable.py:\d+", out), out
    (run_dir,) = logs.iterdir()
    assert "Fatal Python error: Aborted" in (run_dir / "node1.log").read_text(), out
    assert_spied(out, sleeping)
    print(f"hang named {seconds:.1f} s after the start (the job hangs about 3 s in)")
    assert seconds < 5 + 15 + 20, out  # the submission, torch's import and srun's steps take about 10 s of it
    assert slurm.queue() == []


def detach_recovering(inventory: Path, tmp_path: Path, retries: str, *job: str) -> str:
    """``run --detach --retries RETRIES -- JOB`` (one rank a node): the run id it printed."""
    code, out = run(inventory, tmp_path / "logs", "--detach", "--retries", retries, "--nproc-per-node", "1", "--",
                    *job)
    assert code == 0, out
    (run_id,) = re.findall(r"^(th-\S+)$", out, re.M)
    return str(run_id)


@pytest.mark.timeout(420)
def test_a_detached_run_with_retries_resubmits_from_the_background(slurm: SlurmCluster, inventory: Path,
                                                                     tmp_path: Path) -> None:
    # run returns once attempt 1 is submitted; the controller in the background sees rank 1
    # fail, triages and submits attempt 2; logs -f follows one job, then the next, to the end.
    run_id = detach_recovering(inventory, tmp_path, "2", FAIL_FIRST, "--fail-rank", "1")
    code, followed = torchherd(inventory, "logs", "-f", run_id)
    assert code == 0, followed
    status = wait_recovery(run_id, lambda found: not found.alive, 300)
    assert status.record.exit_code == 0, status
    assert [(attempt.number, attempt.ended) for attempt in status.record.attempts] == [(1, "failed"), (2, "ok")]
    assert "fail_first_attempt: failing on purpose" in followed, followed
    for rank, node in enumerate(slurm.cluster.names):
        # Each node's lines after its attempt-2 start: between nodes, lines come in the order the
        # 0.5 s polls found them, so attempt 1's last ticks on node0 may follow node1's error.
        started = f"{node}:{rank}: rank {rank} in attempt 2 on {node}"
        assert started in followed, followed
        later = followed[followed.index(started):]
        assert re.findall(rf"^{node}:{rank}: tick {rank} (\d+)$", later, re.M) == ["0", "1", "2"], followed
    record = load_record(run_id)
    assert str(record.extra["run_dir"]).endswith(f"{run_id}/attempt-2"), record.extra
    second = job_fields(slurm, str(record.extra["job_id"]))
    assert second["JobState"] == "COMPLETED", second
    code, said = torchherd(inventory, "status", run_id)
    assert code == 0, said
    assert re.search(r"^1 +node0,node1,node2  failed  node1 rank 1 failed first", said, re.M), said
    assert re.search(r"^2 +node0,node1,node2  ok +all 3 nodes finished", said, re.M), said
    assert "recovery ended after attempt 2: exit 0" in said, said
    for node in slurm.cluster.names:
        assert re.search(rf"^{node}\s+exited \(0\)", said, re.M), said
    assert slurm.queue() == []


@pytest.mark.timeout(300)
def test_stop_of_a_detached_run_with_retries_stops_its_controller_first(slurm: SlurmCluster, inventory: Path,
                                                                        tmp_path: Path) -> None:
    # stop: the controller is told first (no further attempt), then the job is cancelled.
    run_id = detach_recovering(inventory, tmp_path, "3", TICKER, "100000", "0.2")
    deadline = time.monotonic() + 120
    while "running" not in (said := torchherd(inventory, "status", run_id)[1]):
        assert time.monotonic() < deadline, said
        time.sleep(1)
    job_id = str(load_record(run_id).extra["job_id"])
    code, out = torchherd(inventory, "stop", run_id)
    assert code == 0, out
    assert f"SLURM job {job_id}: stopped, nothing of the run is left" in out, out
    status = wait_recovery(run_id, lambda found: not found.alive, 60)
    assert not status.alive and status.record.exit_code == 130, status
    assert [attempt.number for attempt in status.record.attempts] == [1], status
    assert str(load_record(run_id).extra["job_id"]) == job_id  # nothing submitted after the stop
    assert slurm.queue() == []


@pytest.mark.timeout(300)
def test_where_slurm_picks_every_node_and_one_is_excluded_the_run_ends_without_burning_retries(
        slurm: SlurmCluster, tmp_path: Path) -> None:
    # [slurm].nodes = 3 of the three. Rank 1 fails, then an admin drains its node: the
    # partition has two nodes left for a job of three, which sbatch refuses at once. The
    # run ends there, saying so, instead of spending its other retries on the same refusal.
    summary, events, bad = drain_rank_1s_node(slurm, tmp_path, 3, Recovery(retries=3), "GPU fell off the bus")
    assert summary.exit_code == 1, summary.headline
    first, second = summary.attempts
    assert first.ended == "failed" and first.next == f"attempt 2 on 3 nodes SLURM picks, not {bad}", first
    assert second.headline.startswith("attempt 2 could not start: sbatch failed on ") and \
        second.headline.endswith("Requested node configuration is not available"), second
    assert second.next == f"the scheduler cannot place the run without {bad} (it refused the attempt)", second
    assert summary.headline.startswith(f"the scheduler cannot place the run without {bad} (it refused the attempt); "
                                       "attempt 2: attempt 2 could not start"), summary.headline
    assert len({event.job_id for event in events.of(JobQueued)}) == 1
    assert slurm.queue() == []


def stand_in_docker(directory: Path) -> Path:
    """A ``docker`` for this module's nodes, which are not set up for podman (real podman
    under SLURM: test_slurm_containers.py, a cluster of its own): it appends how it was
    called and on which node to ``calls``, and for ``run`` runs the job's argv (after the
    image) in ``-w``'s directory, as the container would; the task's own command line,
    trap and removal are the real ones, and the 3-node job is real DDP."""
    directory.mkdir(parents=True, exist_ok=True)
    fake = directory / "docker"
    fake.write_text(f"""#!{sys.executable}
import json, os, sys
with open({str(directory / "calls")!r}, "a") as log:
    log.write(json.dumps([os.environ.get("SLURMD_NODENAME", "")] + sys.argv[1:]) + "\\n")
args = sys.argv[1:]
if args[0] == "run":
    at = args.index("img:1")
    os.chdir(args[args.index("-w") + 1])
    os.execvp(args[at + 1], args[at + 1:])
""")
    fake.chmod(0o755)
    return directory


@pytest.mark.timeout(420)
def test_a_job_in_a_container_runs_with_the_nodes_runtime_and_scancel_removes_it(slurm: SlurmCluster,
                                                                                inventory: Path,
                                                                                tmp_path: Path) -> None:
    # In the shared home: each node has a /tmp of its own.
    shim = stand_in_docker(Path.home() / f".torchherd-test-runtime-{os.getpid()}")
    try:
        job_in_a_stand_in_container(slurm, inventory, tmp_path, shim)
    finally:
        shutil.rmtree(shim, ignore_errors=True)


def job_in_a_stand_in_container(slurm: SlurmCluster, inventory: Path, tmp_path: Path, shim: Path) -> None:
    inventory.write_text(inventory.read_text() + '\n[container]\nimage = "img:1"\nruntime = "docker"\n')
    path = f"PATH={shim}:/usr/local/bin:/usr/bin:/bin"

    def calls() -> list[list[str]]:
        return [json.loads(line) for line in (shim / "calls").read_text().splitlines()]

    code, out = run(inventory, tmp_path / "logs", "--env", path, "--nproc-per-node", "1", "--",
                    ALLREDUCE_DEMO, "--steps", "5")
    assert code == 0, out
    assert "all 3 nodes finished (exit 0)" in out
    (job_id,) = re.findall(r"SLURM job (\d+): submitted", out)
    names = {call[0]: call[call.index("--name") + 1] for call in calls() if call[1] == "run"}
    assert sorted(names) == slurm.cluster.names, calls()
    for node, name in names.items():
        assert re.fullmatch(rf"torchherd-th-[\w-]+-{node}-{job_id}", name), name
        assert [node, "rm", "-f", name] in calls()
        assert re.search(rf"^{node}:\d: .*host {node} step \d+ loss", out, re.M), out  # piped: node:rank: text
    run_call = next(call for call in calls() if call[1] == "run")
    assert run_call[run_call.index("--network") + 1] == "host" and ["-e", "PATH"] == run_call[
        run_call.index("PATH") - 1:run_call.index("PATH") + 1]

    # Cancelled mid-run (stop of a detached run: scancel): every node's task removes its container.
    (shim / "calls").unlink()
    code, out = torchherd(inventory, "run", "--detach", "--no-check", "--env", path, "--nproc-per-node", "1", "--",
                          TICKER, "100000", "0.2")
    assert code == 0, out
    (run_id,) = re.findall(r"^(th-\S+)$", out, re.M)
    deadline = time.monotonic() + 120
    while "tick 2 3" not in (logs := torchherd(inventory, "logs", run_id, "--node", "node2")[1]):
        assert time.monotonic() < deadline, logs
        time.sleep(1)
    code, out = torchherd(inventory, "stop", run_id)
    assert code == 0, out
    removed = {call[0] for call in calls() if call[1:3] == ["rm", "-f"] and call[3].startswith(f"torchherd-{run_id}-")}
    assert removed == set(slurm.cluster.names), calls()
    assert_clean(slurm.cluster)
