"""``run --detach --retries`` on the local cluster: the recovering controller in the
background outlives the terminal that started it; ``status``, ``stop``, ``logs`` on it;
its death leaves the job running without recovery. Real sshd, real torchrun.

The CLI runs in a session of its own, under a shell that stands for the terminal: once
the command has returned, the whole session gets SIGHUP and its leader is killed, as
when a terminal window closes. After every test no process of any attempt is left on
any node.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from io import StringIO
from pathlib import Path

import pytest
from localcluster import LocalCluster

from support.cluster_build import Runs
from support.cluster_detach import all_exited, wait_recovery, wait_states
from support.cluster_runs import assert_clean
from torchherd.api import attach
from torchherd.cli import main
from torchherd.console import make_console
from torchherd.engine.records import RecoveryStatus, controller_alive, load

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("state_home")]

ROOT = Path(__file__).resolve().parents[2]
RESUMABLE = str(ROOT / "examples" / "resumable.py")
TICKER = str(ROOT / "examples" / "ticker.py")


def detach_from_a_terminal(runs: Runs, cluster: LocalCluster, log_dir: Path, *args: str) -> tuple[str, float]:
    """``run --detach`` from a shell in its own session; once it returned, the session is
    hung up and its leader killed (the terminal closed). The run id and how long the
    command took."""
    argv = [sys.executable, "-m", "torchherd", "-i", str(cluster.inventory), "run", "--detach", "--no-check",
            "--nproc-per-node", "1", "--log-dir", str(log_dir), *args]
    shell = '"$@"; echo "returned $?"; exec sleep 600'
    started = time.monotonic()
    terminal = subprocess.Popen(["sh", "-c", shell, "sh", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, start_new_session=True, env=runs.env(cluster))
    assert terminal.stdout is not None
    out = []
    for line in terminal.stdout:
        out.append(line)
        if line.startswith("returned "):
            break
    seconds = time.monotonic() - started
    os.killpg(terminal.pid, signal.SIGHUP)
    terminal.kill()
    terminal.wait(timeout=10)
    text = "".join(out)
    run_id = runs.started_id(cluster, text)
    assert re.search(r"^returned 0$", text, re.M) and run_id, text
    return run_id, seconds


def cli(cluster: LocalCluster, *args: str) -> tuple[int, str]:
    out = StringIO()
    code = main(["-i", str(cluster.inventory), *args], console=make_console(out, width=200))
    return code, out.getvalue()


def running(run_id: str) -> bool:
    return all(state.state == "running" for state in attach(run_id).status())


@pytest.mark.timeout(240)
def test_a_detached_recovering_run_outlives_its_terminal(cluster: LocalCluster, runs: Runs, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    run_id, seconds = detach_from_a_terminal(
        runs, cluster, logs, "--include", "node[0-1]", "--retries", "2", "--", RESUMABLE, "--steps", "12",
        "--step-seconds", "0.05", "--fail-step", "6", "--fail-rank", "1", "--fail-attempt", "1", "--fail-hang")
    assert seconds < 20
    code, out = cli(cluster, "attach", run_id)  # follows every attempt, until the controller ended
    assert code == 0, out
    assert len(re.findall(r"^node1: ==== torchherd: attempt \d ", out, re.M)) == 2, out
    assert "attempt 2, starting at step 5" in out, out
    status = wait_recovery(run_id, lambda status: status.record.ended and not status.alive, 180)
    assert status.record.exit_code == 0 and not status.alive, status
    assert [(attempt.number, attempt.ended) for attempt in status.record.attempts] == [(1, "failed"), (2, "ok")]
    code, out = cli(cluster, "status", run_id)
    assert code == 0
    assert "recovery ended after attempt 2: exit 0" in out, out
    assert re.search(r"^1 +node0,node1  failed +node1 rank 1 failed first", out, re.M), out
    assert re.search(r"^2 +node0,node1  ok ", out, re.M), out
    # the local logs, as an attached run writes them, and the nodes' own, as logs reads them
    local = (logs / run_id / "node1.log").read_text(encoding="utf-8")
    assert len(re.findall(r"^==== torchherd: attempt \d ", local, re.M)) == 2, local
    code, out = cli(cluster, "logs", "--node", "node1", run_id)
    assert code == 0, out  # the last attempt ended well on node1
    assert len(re.findall(r"==== torchherd: attempt \d ", out)) == 2, out
    assert "failing on purpose" in out and "attempt 2, starting at step 5" in out, out
    # its history, kept by the background controller in the run's log directory
    assert stat.S_IMODE((logs / run_id / "events.jsonl").stat().st_mode) == 0o600
    code, out = cli(cluster, "report", run_id, "--text")
    assert code == 0, out
    assert re.search(r"^attempt 1 on node0, node1: .*, node1 rank 1 failed first", out, re.M), out
    assert re.search(r"^recovery after attempt 1: .* to ranks running again \(triage of 2 nodes", out, re.M), out
    assert re.search(r"^attempt 2 on node0, node1: ", out, re.M), out
    assert_clean(cluster)


def detach_ticking(cluster: LocalCluster, runs: Runs, tmp_path: Path) -> tuple[str, RecoveryStatus]:
    """``run --detach --retries 2`` of a ticker on node0 and node1 that runs for minutes:
    its run id and its recovery once the first attempt runs on both."""
    run_id, _ = runs.detach(cluster, "--include", "node[0-1]", "--log-dir", str(tmp_path / "logs"), "--retries", "2",
                            "--", TICKER, "1000", "0.2")
    return run_id, wait_recovery(run_id, lambda status: status.record.attempts and running(run_id), 60)


@pytest.mark.timeout(180)
def test_stop_during_the_first_attempt_stops_the_controller_and_the_job(cluster: LocalCluster, runs: Runs,
                                                                        tmp_path: Path) -> None:
    run_id, status = detach_ticking(cluster, runs, tmp_path)
    assert status.alive and status.record.attempts[0].ended == "running", status
    code, out = cli(cluster, "stop", run_id)
    assert code == 0, out
    assert f"the recovering controller (pid {status.record.pid}): stopped the run, no further attempt" in out, out
    assert_clean(cluster)
    after = attach(run_id).recovery()
    assert after is not None and not controller_alive(after.record, run_id)
    assert after.record.exit_code == 130 and [attempt.number for attempt in after.record.attempts] == [1], after
    code, out = cli(cluster, "status", run_id)
    assert "recovery ended after attempt 1: exit 130" in out, out


@pytest.mark.timeout(180)
def test_a_killed_controller_leaves_the_job_running_without_recovery(cluster: LocalCluster, runs: Runs,
                                                                     tmp_path: Path) -> None:
    run_id, status = detach_ticking(cluster, runs, tmp_path)
    os.kill(status.record.pid, signal.SIGKILL)
    wait_recovery(run_id, lambda status: not status.alive, 10)
    time.sleep(2)  # the supervisors saw their channel close: the job must still run
    code, out = cli(cluster, "status", run_id)
    assert code == 0
    assert f"the recovering controller (pid {status.record.pid}) is gone: the job runs on without recovery" in out, out
    code, listing = cli(cluster, "status")  # every run: the controller's state in its row
    assert code == 0 and run_id in listing and "controller gone, running without" in listing, listing
    assert running(run_id)
    code, out = cli(cluster, "stop", run_id)
    assert code == 0, out
    assert "was gone already: the nodes were stopped directly" in out, out
    assert_clean(cluster)


@pytest.mark.timeout(240)
def test_logs_follow_picks_up_a_spare_that_takes_a_lost_nodes_place(cluster: LocalCluster, runs: Runs,
                                                                   tmp_path: Path) -> None:
    # node0 and node1 run, node2 is the spare. logs -f starts on the first attempt's two
    # nodes; node1 is unplugged, the controller finds it lost and the triage excludes it,
    # node2 takes its place: the same logs -f goes on with node2's lines.
    run_id, _ = runs.detach(cluster, "--spares", "node2", "--log-dir", str(tmp_path / "logs"), "--retries", "1",
                            "--", TICKER, "60", "0.25")
    wait_recovery(run_id, lambda status: status.record.attempts and running(run_id), 60)
    followed: list[tuple[int, str]] = []
    follower = threading.Thread(target=lambda: followed.append(cli(cluster, "logs", "-f", run_id)), daemon=True)
    follower.start()
    time.sleep(1.0)
    cluster.cut_network("node1")
    try:
        status = wait_recovery(run_id, lambda status: status.record.ended and not status.alive, 180)
    finally:
        cluster.restore_network("node1")
    # node1's job may still wait for its lost peers (torchrun's exit barrier, up to minutes):
    # stop ends it, as a user would once node1 answers again (a stop the moment the link is
    # back could not reach it once in twenty: node1 is then named as not stopped, rightly),
    # and logs -f then reads node1's log to its end too.
    cluster.wait_ready(["node1"], timeout=30)
    code, out = cli(cluster, "stop", run_id)
    assert code == 0, out
    follower.join(timeout=60)
    assert status.record.exit_code == 0, status
    assert [(attempt.nodes, attempt.ended) for attempt in status.record.attempts] == [
        (("node0", "node1"), "lost"), (("node0", "node2"), "ok")], status
    assert not follower.is_alive() and followed, "logs -f did not end with the run"
    code, out = followed[0]
    # node1's job ended either on its own (its exit barrier gives up once the link is back
    # and node0's store is gone: exit 0) or stopped by torchherd, whatever code torchrun then
    # chose (143, or 1 when the signal met its agent's monitor loop): by the stop (signal
    # SIGTERM), or, once the link is back and node1's supervisor finds its controller silent,
    # by attempt 1's coordinator (node0 was stopped). Its supervisor says which.
    alone = "node1: finished (exit 0)" in out
    stopped = re.search(r"^torchherd: node1: stopped \((signal SIGTERM|coordinator: .*); exit code \d+\)$", out,
                        re.M) is not None
    assert (alone, stopped) in ((True, False), (False, True)), out
    assert code == 0 if alone else code in (0, 1), out
    assert re.findall(r"^node2:1: tick 1 (\d+)$", out, re.M) == [str(index) for index in range(60)], out
    wait_no_processes = [cluster.wait_no_processes(name, timeout=60) for name in ("node0", "node1", "node2")]
    assert wait_no_processes == [[], [], []], wait_no_processes
    assert_clean(cluster)


@pytest.mark.timeout(150)
def test_without_its_controller_a_failed_node_still_stops_the_others(cluster: LocalCluster, runs: Runs,
                                                                      tmp_path: Path) -> None:
    """The controller killed, node1's rank fails: the attempt's coordinator (on the master)
    has every other node torn down, as in a plain detached run. Before the fallback the
    others ticked on (still running a minute later)."""
    run_id, _ = runs.detach(cluster, "--log-dir", str(tmp_path / "logs"), "--retries", "2", "--", TICKER, "1000",
                            "0.2", "--exit-rank", "1", "--exit-at", "50")
    status = wait_recovery(run_id, lambda status: status.record.attempts and running(run_id), 60)
    coordinator = load(run_id).coordinator
    assert coordinator is not None and coordinator.node == "node0", coordinator
    os.kill(status.record.pid, signal.SIGKILL)
    killed = time.time()
    states = wait_states(run_id, all_exited, timeout=60)
    assert all_exited(states), states
    by_node = {state.node: state for state in states}
    failed_at = by_node["node1"].since
    assert failed_at is not None and failed_at > killed, (killed, states)  # it failed with no controller
    assert by_node["node1"].code not in (0, None)
    spread = max(state.since or 0.0 for state in states) - failed_at
    print(f"the other nodes ended {spread:.1f} s after node1")
    assert spread < 8
    assert all(by_node[name].code not in (0, None) for name in ("node0", "node2")), states
    after = attach(run_id).recovery()
    assert after is not None and [attempt.number for attempt in after.record.attempts] == [1], after
    code, out = cli(cluster, "logs", "--node", "node0", run_id)
    assert "coordinator: node1 exited with code 1 (the controller is gone)" in out, out
    assert_clean(cluster)


MULTINODE = str(Path(__file__).resolve().parent / "jobs" / "multinode.py")


def _snapshot(cluster: LocalCluster, node: str) -> tuple[str, str]:
    """The SHA-256 and mode of /tmp/snapshot.pt on ``node`` (the workdir, private to each
    node); empty strings while it has none."""
    result = cluster.ssh(node, "sha256sum /tmp/snapshot.pt && stat -c %a /tmp/snapshot.pt 2>/dev/null", timeout=30)
    words = result.stdout.split()
    return (words[0], words[-1]) if result.returncode == 0 and len(words) == 3 else ("", "")


def _replicated(cluster: LocalCluster, run_id: str) -> None:
    """Waits for a replica of node0's snapshot on node1 (the same bytes as one node0 held),
    private to the user, while the run goes on."""
    deadline = time.monotonic() + 90
    seen: dict[str, float] = {}  # each snapshot node0 held, and when it was first seen there
    while time.monotonic() < deadline:
        original = _snapshot(cluster, "node0")[0]
        if original:
            seen.setdefault(original, time.monotonic())
        replica = _snapshot(cluster, "node1")
        if replica[0] in seen:
            break
        time.sleep(0.3)
    else:
        raise AssertionError(f"no replica of node0's snapshot on node1: {cli(cluster, 'logs', run_id)[1][-3000:]}")
    print(f"node0's snapshot on node1 {time.monotonic() - seen[replica[0]]:.1f} s after it was first seen on node0")
    assert replica[1] == "600", replica  # private to the user, as staging writes it
    assert running(run_id)


@pytest.mark.timeout(180)
def test_a_plain_detached_run_replicates_too(cluster: LocalCluster, runs: Runs, tmp_path: Path) -> None:
    """``run --detach --checkpoint`` without retries: its controller in the background
    copies each complete snapshot to node1 while the job runs (and makes no new attempt);
    ``stop`` ends it and the job."""
    run_id, _ = runs.detach(cluster, "--include", "node[0-1]", "--log-dir", str(tmp_path / "logs"),
                            "--checkpoint", "snapshot.pt", "--", MULTINODE, "1000", "5", "--epoch-seconds", "0.8")
    try:
        _replicated(cluster, run_id)
        code, out = cli(cluster, "stop", run_id)
        assert code == 0, out
        assert_clean(cluster)
        after = attach(run_id).recovery()
        assert after is not None and not controller_alive(after.record, run_id), out
        # no attempt told (it has no other), the summary's checkpoint line kept
        assert after.record.retries == 0 and after.record.attempts == (), after
        assert after.record.checkpoint.startswith("newest checkpoint: snapshot.pt ("), after
    finally:
        for name in cluster.names:
            cluster.ssh(name, "rm -f /tmp/snapshot.pt")


def _relay_on(cluster: LocalCluster, node: str) -> int | None:
    """The pid of a replication relay running on ``node`` (``checkpoint.py relay ... low``), if any."""
    for pid in cluster.node_pids(node):
        try:
            words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"relay" in words and b"low" in words:
            return pid
    return None


@pytest.mark.timeout(180)
def test_stop_returns_once_a_relay_held_back_mid_copy_has_ended(cluster: LocalCluster, runs: Runs,
                                                                 tmp_path: Path) -> None:
    """A replication's relays run at the lowest CPU priority: on a node whose CPUs are all
    busy one wakes up seconds after it was told to end. Here node0's relay is held stopped
    (SIGSTOP, as starved) mid-copy while ``stop`` runs, and let go 7 s later: ``stop``
    returns only once it has ended, and leaves nothing behind."""
    run_id, _ = runs.detach(cluster, "--include", "node[0-1]", "--log-dir", str(tmp_path / "logs"),
                            "--checkpoint", "snapshot.pt", "--", MULTINODE, "1000", "5", "--epoch-seconds", "0.8")
    held: int | None = None
    try:
        deadline = time.monotonic() + 90
        while held is None and time.monotonic() < deadline:
            pid = _relay_on(cluster, "node0")
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
                    held = pid
            time.sleep(0.01)
        assert held is not None, "no relay seen on node0 in 90 s"
        timer = threading.Timer(7.0, _let_go, args=(held,))
        started = time.monotonic()
        timer.start()
        code, out = cli(cluster, "stop", run_id)
        took = time.monotonic() - started
        timer.join()
        assert code == 0, out
        print(f"stop took {took:.1f} s")
        assert took >= 7.0, f"stop returned after {took:.1f} s, while node0's relay was still held"
        assert_clean(cluster, timeout=1.0)
    finally:
        if held is not None:
            _let_go(held)
        for name in cluster.names:
            cluster.ssh(name, "rm -f /tmp/snapshot.pt")


def _let_go(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # gone already: nothing to let go
        os.kill(pid, signal.SIGCONT)


@pytest.mark.timeout(180)
def test_a_detached_recovering_run_replicates_the_snapshot_to_the_next_node(cluster: LocalCluster, runs: Runs,
                                                                          tmp_path: Path) -> None:
    """PyTorch's ddp-tutorial multinode.py, detached with retries on node0 and node1 (their
    /tmp private): only node0 (rank 0) writes snapshot.pt, every 4 s or so (a checkpoint is
    complete once unchanged for 2 s). The controller in the background
    copies each complete snapshot to node1 while the job runs, and ``status`` says where the
    newest one is."""
    run_id, _ = runs.detach(cluster, "--include", "node[0-1]", "--log-dir", str(tmp_path / "logs"), "--retries", "1",
                            "--checkpoint", "snapshot.pt", "--", MULTINODE, "1000", "5", "--epoch-seconds", "0.8")
    try:
        _replicated(cluster, run_id)
        newest = re.compile(r"newest checkpoint: snapshot\.pt \([\d.]+ kB, saved \d\d:\d\d:\d\d on node0\) on "
                            r"node0, node1")
        # The record says each save at once (on node0 alone until its copy is done), and a
        # save comes every 4 s or so: ``status`` shows the copied one between the two.
        said: list[str] = []
        deadline = time.monotonic() + 30
        while not (said and newest.search(said[-1])) and time.monotonic() < deadline:
            code, out = cli(cluster, "status", run_id)
            assert code == 0, out
            said.append(out)
        assert newest.search(said[-1]), said
        status = attach(run_id).recovery()
        deadline = time.monotonic() + 30
        while status is not None and not newest.search(status.record.checkpoint) and time.monotonic() < deadline:
            time.sleep(0.2)
            status = attach(run_id).recovery()
        assert status is not None and newest.search(status.record.checkpoint), status
        code, out = cli(cluster, "stop", run_id)
        assert code == 0, out
        assert "stopped the run, no further attempt" in out, out
        assert_clean(cluster)
        code, out = cli(cluster, "status", run_id)  # the summary's line, once the controller ended
        # (a snapshot saved just before the stop may not have been copied yet: on node0 alone)
        ended = re.compile(r"newest checkpoint: snapshot\.pt \([\d.]+ kB, saved \d\d:\d\d:\d\d on node0\) on "
                           r"node0(, node1)?$", re.M)
        assert "recovery ended after attempt 1: exit 130" in out and ended.search(out), out
    finally:
        for name in cluster.names:
            cluster.ssh(name, "rm -f /tmp/snapshot.pt")
