"""``run --image`` on the local cluster: podman on every node (docs/containers.md), a tiny
image made offline (tests/cluster/localcluster.py ``write_image_archive``: no registry is
ever reached) that borrows the host's /usr, Python and torch read-only, real torchrun, gloo.

Every test checks that no process and no container of the run is left on any node."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from io import StringIO
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from localcluster import IMAGE_TAG, LocalCluster, image_mounts, write_image_archive

if TYPE_CHECKING:
    from conftest import Runs
    from test_run import Controller

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(shutil.which("podman") is None,
                                                      reason="podman is not installed (scripts/install-deps)")]

JOBS = Path(__file__).resolve().parent / "jobs"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def boxed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Two nodes with podman and the test image loaded on each; the inventory runs in it."""
    from conftest import _start

    cluster = _start(2, tmp_path_factory.mktemp("containers"), containers=True)
    try:
        archive = write_image_archive(cluster.state_dir / "image.tar")
        ids = {name: cluster.load_image(name, archive) for name in cluster.names}
        assert len(set(ids.values())) == 1, ids
        mounts = ", ".join(f'"{mount}"' for mount in image_mounts())
        with cluster.inventory.open("a") as inventory:
            inventory.write(f'\n[container]\nimage = "{IMAGE_TAG}"\nruntime = "podman"\nmounts = [{mounts}]\n')
        yield cluster
    finally:
        cluster.down()


def containers_left(cluster: LocalCluster) -> dict[str, str]:
    """Every container on any node (the nodes' storage is this cluster's own: any is a leftover)."""
    left = {}
    for name in cluster.names:
        done = cluster.ssh(name, "podman ps -a --format '{{.Names}} {{.Labels}}'", timeout=60)
        assert done.returncode == 0, done.stderr
        if done.stdout.strip():
            left[name] = done.stdout.strip()
    return left


def assert_clean(cluster: LocalCluster, timeout: float = 10.0) -> None:
    for name in cluster.names:
        assert cluster.wait_no_processes(name, timeout=timeout) == [], f"processes left on {name}"
    assert containers_left(cluster) == {}


def run(cluster: LocalCluster, log_dir: Path, *args: str) -> tuple[int, str]:
    from test_run import run_cli

    return run_cli(cluster, log_dir, *args)


@pytest.mark.timeout(240)
def test_ddp_two_by_two_inside_podman_as_the_ssh_user(boxed: LocalCluster, tmp_path: Path) -> None:
    from torchherd.cli import main
    from torchherd.console import make_console

    started = time.monotonic()
    printed = StringIO()  # the preflight first, the container check with it
    code = main(["-i", str(boxed.inventory), "run", "--log-dir", str(tmp_path / "logs"), "--nproc-per-node", "2",
                 "--", str(JOBS / "in_container.py")], console=make_console(printed, width=200))
    out = printed.getvalue()
    print(f"2x2 in podman took {time.monotonic() - started:.1f} s")
    assert code == 0, out
    found = {int(match.group(1)): match for match in
             re.finditer(r"rank (\d) of 4 on (node\d) in-image (\w+) uid (\d+:\d+) file (\d+:\d+) sum 10", out)}
    assert sorted(found) == [0, 1, 2, 3], out
    for rank, match in found.items():
        assert match.group(2) == f"node{rank // 2}"  # the node's own hostname: --network host, --uts host
        assert match.group(3) == "True"  # inside the image (only it has /etc/torchherd-mark)
        # the image's own user is nobody (65534): the job ran as the SSH user, and its files are the user's
        assert match.group(4) == match.group(5) == "0:0", match.group(0)
    assert "all 2 nodes finished (exit 0)" in out
    assert_clean(boxed)


@pytest.mark.timeout(180)
# SIGINT ends the controller as SIGTERM does (test_run covers both): slow here, to spare CI's time
@pytest.mark.parametrize("signum", [pytest.param(signal.SIGINT, marks=pytest.mark.slow), signal.SIGTERM,
                                    signal.SIGKILL], ids=["SIGINT", "SIGTERM", "SIGKILL"])
def test_controller_signal_leaves_no_container_and_no_process(boxed: LocalCluster, tmp_path: Path, signum: int,
                                                              controllers: Callable[..., Controller]) -> None:
    controller = controllers(boxed, tmp_path / "logs", "--nproc-per-node", "1", "--",
                             str(EXAMPLES / "crash_demo.py"), "--steps", "1000")
    controller.wait_for(r"node1:1: step 2 ", timeout=90)
    running = {name: boxed.ssh(name, "podman ps --format '{{.Names}} {{.Labels}}'").stdout for name in boxed.names}
    for name, listed in running.items():
        assert re.search(rf"torchherd-th-\S+-{name} .*torchherd\.run:th-", listed), (name, listed)
    controller.process.send_signal(signum)
    if signum != signal.SIGKILL:
        assert controller.wait(timeout=60) == 130, controller.output
    assert_clean(boxed, timeout=30)


def check(cluster: LocalCluster, inventory: Path | None = None) -> dict[str, dict[str, str]]:
    """``check --only ssh,container --json``: per node, the container check's result."""
    done = subprocess.run([sys.executable, "-m", "torchherd", "-i", str(inventory or cluster.inventory), "check",
                           "--only", "ssh,container", "--json"], capture_output=True, text=True, timeout=200,
                          stdin=subprocess.DEVNULL, env=cluster.env())
    document = json.loads(done.stdout)
    assert done.returncode == (0 if document["ok"] else 1), done.stderr
    return {item["node"]: item for item in document["checks"] if item["check"] == "container"}


@pytest.mark.timeout(240)
def test_check_reads_versions_in_the_image_and_names_only_the_node_whose_image_differs(boxed: LocalCluster) -> None:
    found = check(boxed)
    assert sorted(found) == boxed.names
    for result in found.values():
        assert result["status"] == "pass", result
        assert f"image {IMAGE_TAG} " in result["summary"]
        assert f"inside: python {sys.version.split()[0]}, torch " in result["summary"], result
    # node1 gets another image under the same tag (its own storage: real machines differ so)
    other = boxed.load_image("node1", write_image_archive(boxed.state_dir / "other.tar", mark="rebuilt"))
    try:
        found = check(boxed)
        assert found["node0"]["status"] == "pass", found
        assert found["node1"]["status"] == "fail", found
        assert re.search(rf"image {re.escape(IMAGE_TAG)} on node1 is {other}, on node0 it is (sha256:)?[0-9a-f]{{64}}: "
                         "two images",
                         found["node1"]["summary"]), found["node1"]
    finally:
        boxed.load_image("node1", boxed.state_dir / "image.tar")


@pytest.mark.timeout(240)
def test_a_node_without_the_runtime_fails_the_runtime_check_not_the_image_comparison(boxed: LocalCluster) -> None:
    inventory = boxed.inventory.with_name("enroot-on-node1.toml")
    text = boxed.inventory.read_text().replace('name = "node1"', 'name = "node1"\ncontainer = { runtime = "enroot" }')
    inventory.write_text(text)
    found = check(boxed, inventory)
    assert found["node0"]["status"] == "pass", found
    assert found["node1"]["status"] == "fail"
    assert found["node1"]["summary"] == "enroot is not installed on node1 (not on PATH)"


def wait_for_containers(cluster: LocalCluster, timeout: float = 90.0) -> None:
    """Until every node runs its container of the run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = [cluster.ssh(name, "podman ps --format '{{.Names}}'").stdout for name in cluster.names]
        if all(re.search(r"^torchherd-th-", text, re.M) for text in listed):
            return
        time.sleep(1)
    raise AssertionError(f"no container on every node within {timeout:g} s")


@pytest.mark.timeout(240)
# a plain stop goes through the supervisor's teardown, which the SIGTERM test covers: slow here
@pytest.mark.parametrize("supervisor_killed", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["stop", "stop-after-supervisor-killed"])
def test_stop_of_a_detached_run_removes_its_containers(boxed: LocalCluster, runs: Runs,
                                                       supervisor_killed: bool) -> None:
    from torchherd.runrecord import remote_state_file

    run_id, _ = runs.detach(boxed, "--", str(EXAMPLES / "crash_demo.py"), "--steps", "1000")
    wait_for_containers(boxed)
    if supervisor_killed:
        # The supervisor, the podman client and conmon all killed (the OOM killer, a user's
        # kill -9): nobody is left to run --rm or the removal, but stop, by the state file.
        # Every node's pids are read first, then killed: a node killed before the next is
        # read would end that node's torchrun (its master gone), and its conmon with it.
        doomed = {}
        for name in boxed.names:
            state = json.loads(boxed.ssh(name, f"cat {remote_state_file(run_id, name)}", check=True).stdout)
            container = f"torchherd-{run_id}-{name}"
            assert state["container"] == ["podman", container]
            table = boxed.ssh(name, "ps -eo pid=,comm=", check=True).stdout.split("\n")
            conmon = [int(line.split()[0]) for line in table if line.split()[1:] == ["conmon"]]
            assert conmon, table  # the node's own process table: only this run's conmon is there
            doomed[name] = [int(state["supervisor"]), int(state["pid"]), *conmon]
            assert all(pid > 1 for pid in doomed[name]), doomed
        for name, pids in doomed.items():
            boxed.ssh(name, "kill -9 " + " ".join(map(str, pids)), check=True)
    done = subprocess.run([sys.executable, "-m", "torchherd", "stop", run_id], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL, env=runs.env(boxed))
    assert done.returncode == 0, done.stdout + done.stderr
    assert_clean(boxed, timeout=30)


@pytest.mark.timeout(180)
def test_a_vanished_node_leaves_no_container_once_it_is_back(boxed: LocalCluster, tmp_path: Path,
                                                             controllers: Callable[..., Controller]) -> None:
    controller = controllers(boxed, tmp_path / "logs", "--nproc-per-node", "1", "--grace", "3", "--",
                             str(EXAMPLES / "crash_demo.py"), "--steps", "1000")
    controller.wait_for(r"node1:1: step 2 ", timeout=90)
    boxed.cut_network("node1")
    try:
        assert controller.wait(timeout=90) == 1, controller.output
        assert "node1 vanished: nothing heard from it" in controller.output
        assert boxed.wait_no_processes("node0", timeout=15) == []
    finally:
        boxed.restore_network("node1")
    # node1's supervisor heard nothing from the controller (its watchdog), tore the job down
    # and removed the container, all while cut off
    assert_clean(boxed, timeout=40)


@pytest.mark.timeout(300)
def test_a_retried_run_starts_its_next_attempt_in_fresh_containers(boxed: LocalCluster, tmp_path: Path) -> None:
    from test_run import run_cli

    code, out = run_cli(boxed, tmp_path / "logs", "--nproc-per-node", "1", "--retries", "1", "--",
                        str(JOBS / "fail_first_attempt.py"), "--count", "2")
    assert code == 0, out
    assert "fail_first_attempt: failing on purpose" in out, out
    for rank, name in enumerate(boxed.names):
        # the same run-scoped name on the same node, attempt after attempt: the first one's was removed
        assert f"rank {rank} in attempt 2 on {name}" in out, out
    assert_clean(boxed)
