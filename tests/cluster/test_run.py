"""``torchherd run`` on the local cluster: real sshd, real torchrun, gloo on CPU.

Every test checks, with the node's own process table, that nothing of the job is
left on any node afterwards. The box has two cores: clusters are small and runs
short (torch's import alone takes about a second per process).
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from io import StringIO
from pathlib import Path

import pytest
from localcluster import LocalCluster

from support.cluster_runs import Controller, assert_clean, run_cli
from torchherd.cli import main
from torchherd.console import make_console

pytestmark = pytest.mark.cluster

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
JOBS = Path(__file__).resolve().parent / "jobs"
CRASH_DEMO = str(EXAMPLES / "crash_demo.py")


def run_log(log_dir: Path, node: str) -> list[str]:
    (run_dir,) = [path for path in log_dir.iterdir() if path.is_dir()]
    return (run_dir / f"{node}.log").read_text(encoding="utf-8").splitlines()


@pytest.mark.timeout(60)
def test_dry_run_prints_every_command_and_starts_nothing(cluster: LocalCluster, tmp_path: Path) -> None:
    code, out = run_cli(cluster, tmp_path / "logs", "--dry-run", "--", CRASH_DEMO, "--steps", "1")
    assert code == 0
    for rank, name in enumerate(cluster.names):
        assert f"{name} (node_rank {rank})" in out
        assert re.search(rf"\$ cd /tmp && env .* -m torch\.distributed\.run .*--node-rank {rank} ", out)
    assert "dry run: nothing was started" in out
    assert not (tmp_path / "logs").exists()
    assert_clean(cluster, timeout=0.1)


@pytest.mark.timeout(120)
def test_a_plain_run_forks_its_ranks_from_each_nodes_warm_python_and_no_warm_starts_them_cold(
        cluster: LocalCluster, tmp_path: Path) -> None:
    """One import of torch per node: the ranks (and torchrun) fork from the warm Python
    that imported it beside the preflight; ``--no-warm`` starts each cold. Nothing of
    either, the warm Pythons included, is left on any node."""
    script = str(JOBS / "preloaded.py")
    for flags, preloaded in (((), True), (("--no-warm",), False)):
        code, out = run_cli(cluster, tmp_path / f"logs{len(flags)}", *flags, "--nproc-per-node", "2", "--", script)
        assert code == 0, out
        said = sorted(re.findall(r"rank (\d) torch imported before the script: (\w+)", out))
        assert said == [(str(rank), str(preloaded)) for rank in range(6)], out
        assert "warm" not in out and "cold" not in out, out
        assert_clean(cluster)


@pytest.mark.timeout(120)
def test_ddp_demo_three_nodes_two_ranks_each(cluster: LocalCluster, tmp_path: Path) -> None:
    demo = EXAMPLES / "ddp_demo.py"
    if not demo.exists():
        pytest.skip("examples/ddp_demo.py is not there yet")
    started = time.monotonic()
    code, out = run_cli(cluster, tmp_path / "logs", "--nproc-per-node", "2", "--", str(demo))
    print(f"ddp_demo 3x2 took {time.monotonic() - started:.1f} s")
    assert code == 0, out
    losses: dict[int, list[float]] = {}
    for rank in range(6):
        node = cluster.names[rank // 2]
        lines = [line for line in out.splitlines() if line.startswith(f"{node}:{rank}:")]
        assert lines, f"no line from {node}:{rank}:\n{out}"
        for line in lines:
            match = re.search(r"step \d+ loss ([0-9.]+)", line)
            if match:
                losses.setdefault(rank, []).append(float(match.group(1)))
    assert sorted(losses) == list(range(6)), out
    for rank, values in losses.items():
        assert values[-1] < values[0], f"rank {rank}: loss did not fall: {values}"
    assert len({round(values[-1], 4) for values in losses.values()}) == 1, losses
    assert "all 3 nodes finished (exit 0)" in out
    # The nodes' /etc/hosts name every IPv4-mapped address: c10d never says it cannot name a peer.
    assert "The hostname of the client socket cannot be retrieved" not in out
    assert_clean(cluster)


LINES_PER_RANK = 50_000


@pytest.mark.timeout(180)
def test_log_files_hold_every_line(cluster: LocalCluster, tmp_path: Path) -> None:
    started = time.monotonic()
    code, out = run_cli(cluster, tmp_path / "logs", "--nproc-per-node", "2", "--",
                        str(EXAMPLES / "chatty.py"), str(LINES_PER_RANK))
    print(f"{LINES_PER_RANK} lines x 6 ranks took {time.monotonic() - started:.1f} s")
    assert code == 0, out[-3000:]
    for index, name in enumerate(cluster.names):
        lines = run_log(tmp_path / "logs", name)
        for rank in (2 * index, 2 * index + 1):
            expected = [f"[rank {rank}] chatty {rank} {i}" for i in range(LINES_PER_RANK)]
            assert [line for line in lines if line.startswith(f"[rank {rank}] chatty ")] == expected
            # the \r progress line keeps only what a terminal would show last
            assert f"[rank {rank}] progress 100%" in lines
    # the terminal may skip lines when it falls behind (it says so); the logs never do
    assert (f"{cluster.names[2]}:5: chatty 5 {LINES_PER_RANK - 1}" in out
            or "lines not shown: the terminal fell behind" in out), out[-3000:]
    assert_clean(cluster)


@pytest.mark.timeout(120)
def test_rank_crash_tears_the_other_nodes_down(cluster: LocalCluster, tmp_path: Path) -> None:
    # Rank 1 (node1) raises at step 3; the others then hang outside any collective, so
    # only torchherd's fail-fast teardown can end them.
    started = time.monotonic()
    code, out = run_cli(cluster, tmp_path / "logs", "--nproc-per-node", "1", "--grace", "3", "--",
                        CRASH_DEMO, "--steps", "1000", "--crash-rank", "1", "--crash-step", "3", "--hang")
    seconds = time.monotonic() - started
    assert code == 1, out
    assert "node1 rank 1 failed first with exit code 1: rank 1: RuntimeError: crash_demo: rank 1 crashes" in out
    assert re.search(r"^node0  torn down ", out, re.M), out
    assert re.search(r"^node2  torn down ", out, re.M), out
    assert re.search(r"^node1  failed \(rank 1\)\s+1 ", out, re.M), out
    assert seconds < 45, f"the run took {seconds:.0f} s"
    assert_clean(cluster)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_to_the_controller_stops_every_node(cluster: LocalCluster, tmp_path: Path, signum: int,
                                                   controllers: Callable[..., Controller]) -> None:
    controller = controllers(cluster, tmp_path / "logs", "--nproc-per-node", "1", "--",
                             CRASH_DEMO, "--steps", "1000")
    controller.wait_for(r"node2:2: step 2 ", timeout=60)
    controller.process.send_signal(signum)
    assert controller.wait(timeout=30) == 130, controller.output
    assert "interrupted: every node was told to stop" in controller.output
    assert_clean(cluster)


@pytest.mark.timeout(120)
def test_sigkill_of_the_controller_leaves_nothing(cluster: LocalCluster, tmp_path: Path,
                                                  controllers: Callable[..., Controller]) -> None:
    controller = controllers(cluster, tmp_path / "logs", "--nproc-per-node", "1", "--env", "API_TOKEN=hunter2-s3cret",
                             "--", CRASH_DEMO, "--steps", "1000")
    controller.wait_for(r"node2:2: step 2 ", timeout=60)
    assert all(cluster.processes(name) for name in cluster.names)
    # The job's environment reached it over stdin: no node's process list shows it.
    assert not [line for name in cluster.names for line in cluster.processes(name) if "hunter2" in line]
    controller.process.kill()
    killed = time.monotonic()
    assert_clean(cluster, timeout=15)
    print(f"nodes clean {time.monotonic() - killed:.1f} s after kill -9 of the controller")


@pytest.mark.timeout(150)
def test_network_cut_names_the_vanished_node(make_cluster: Callable[..., LocalCluster], tmp_path: Path,
                                             controllers: Callable[..., Controller]) -> None:
    cluster = make_cluster(3, nproc_per_node=1)
    controller = controllers(cluster, tmp_path / "logs", "--grace", "3", "--", CRASH_DEMO, "--steps", "1000")
    controller.wait_for(r"node2:2: step 2 ", timeout=60)
    cluster.cut_network("node2")
    cut = time.monotonic()
    try:
        assert controller.wait(timeout=60) == 1, controller.output
        print(f"controller ended {time.monotonic() - cut:.1f} s after the cut")
        assert "node2 vanished: nothing heard from it" in controller.output
        assert re.search(r"^node2  lost ", controller.output, re.M), controller.output
        for name in ("node0", "node1"):
            assert cluster.wait_no_processes(name, timeout=5) == [], f"processes left on {name}"
    finally:
        cluster.restore_network("node2")
    # The cut-off supervisor heard nothing from the controller and tore its job down.
    assert cluster.wait_no_processes("node2", timeout=15) == []


@pytest.mark.timeout(90)
def test_default_run_checks_first_and_uses_the_found_addresses(cluster: LocalCluster, tmp_path: Path) -> None:
    out = StringIO()
    code = main(["-i", str(cluster.inventory), "run", "--log-dir", str(tmp_path / "logs"), "--nproc-per-node", "1",
                 "--", str(EXAMPLES / "env_echo.py"), "MASTER_ADDR"], console=make_console(out, width=200))
    text = out.getvalue()
    assert code == 0, text
    assert re.search(r"preflight: \d+ checks passed", text), text
    master_ip = cluster.node("node0").ip
    assert f"master node0 at {master_ip}:" in text
    assert f"node2:2: MASTER_ADDR={master_ip!r}" in text
    assert_clean(cluster)


PWNED = "/tmp/pwned-torchherd-run"


@pytest.mark.timeout(90)
def test_env_values_arrive_byte_for_byte_and_run_nothing(cluster: LocalCluster, tmp_path: Path) -> None:
    value = f"a b'c\"$(touch {PWNED}) `touch {PWNED}` ; \\ $HOME *"
    code, out = run_cli(cluster, tmp_path / "logs", "--nproc-per-node", "1", "--env", f"X={value}", "--",
                        str(EXAMPLES / "env_echo.py"), "X")
    assert code == 0, out
    for rank, name in enumerate(cluster.names):
        assert f"[rank {rank}] X={value!r}" in run_log(tmp_path / "logs", name)
        assert cluster.ssh(name, f"test -e {PWNED}").returncode == 1, f"{PWNED} exists on {name}"
    assert not os.path.exists(PWNED)
    assert_clean(cluster)


@pytest.mark.timeout(120)
def test_c10d_rendezvous_with_an_elastic_range(cluster: LocalCluster, tmp_path: Path) -> None:
    """c10d: the master hosts the store (is_host=1) and every rank is told the master's
    address, not an FQDN; --nnodes MIN:MAX is accepted and the job still forms."""
    output = StringIO()
    code = main(["-i", str(cluster.inventory), "run", "--log-dir", str(tmp_path / "logs"), "--rdzv-backend", "c10d",
                 "--nnodes", "1:3", "--nproc-per-node", "1", "--", str(EXAMPLES / "env_echo.py"), "MASTER_ADDR",
                 "WORLD_SIZE"], console=make_console(output, width=200))
    out = output.getvalue()
    assert code == 0, out
    master_ip = cluster.node("node0").ip
    # c10d hands out node ranks at the rendezvous: a rank that ends before its supervisor
    # has read its environment (this one prints two lines) keeps its local rank's label.
    for name in cluster.names:
        who = rf"^(?:{name}:\d: |{name}: \[local rank 0\] )"
        assert re.search(rf"{who}MASTER_ADDR={re.escape(repr(master_ip))}", out, re.MULTILINE), out
        assert re.search(rf"{who}WORLD_SIZE='3'", out, re.MULTILINE), out
    assert "The hostname of the client socket cannot be retrieved" not in out
    assert_clean(cluster)


@pytest.mark.timeout(120)
def test_deepspeed_slot_selection_sets_each_nodes_devices_and_count(cluster: LocalCluster, tmp_path: Path) -> None:
    """--exclude node1:0@node2 (DeepSpeed's form): node0 keeps its 2 slots, node1 runs its slot 1
    only, with CUDA_VISIBLE_DEVICES=1, node2 none; one job of 3 ranks (c10d: uneven counts)."""
    code, out = run_cli(cluster, tmp_path / "logs", "--nproc-per-node", "2", "--exclude", "node1:0@node2", "--",
                        str(EXAMPLES / "env_echo.py"), "CUDA_VISIBLE_DEVICES", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    assert code == 0, out
    node0, node1 = run_log(tmp_path / "logs", "node0"), run_log(tmp_path / "logs", "node1")
    assert len([line for line in node0 if line.endswith("CUDA_VISIBLE_DEVICES=None")]) == 2, node0
    assert len([line for line in node0 if line.endswith("LOCAL_WORLD_SIZE='2'")]) == 2, node0
    assert len([line for line in node1 if line.endswith("CUDA_VISIBLE_DEVICES='1'")]) == 1, node1
    assert len([line for line in node1 if line.endswith("LOCAL_WORLD_SIZE='1'")]) == 1, node1
    world = [line for line in node0 + node1 if " WORLD_SIZE=" in line]
    assert len(world) == 3 and all(line.endswith("WORLD_SIZE='3'") for line in world), world
    assert not (next((tmp_path / "logs").iterdir()) / "node2.log").exists()
    assert "node2" not in out
    assert_clean(cluster)
