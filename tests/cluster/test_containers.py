"""``run --image`` on the local cluster: podman on every node (docs/containers.md), a tiny
image made offline (tests/cluster/localcluster.py ``write_image_archive``: no registry is
ever reached) that borrows the host's /usr, Python and torch read-only, real torchrun, gloo.

Every test checks that no process and no container of the run is left on any node."""

from __future__ import annotations

import json
import re
import shlex
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
    from support.cluster_build import Runs
    from support.cluster_runs import Controller

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(shutil.which("podman") is None,
                                                      reason="podman is not installed (scripts/install-deps)")]

JOBS = Path(__file__).resolve().parent / "jobs"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def boxed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Two nodes with podman and the test image loaded on each; the inventory runs in it."""
    from support.cluster_build import start_cluster

    cluster = start_cluster(2, tmp_path_factory.mktemp("containers"), containers=True)
    try:
        yield with_image(cluster)
    finally:
        cluster.down()


def with_image(cluster: LocalCluster, runtime: str = "podman") -> LocalCluster:
    """``cluster`` with the test image loaded on every node and its inventory running in it."""
    archive = write_image_archive(cluster.state_dir / "image.tar")
    ids = {name: cluster.load_image(name, archive) for name in cluster.names}
    assert len(set(ids.values())) == 1, ids
    mounts = ", ".join(f'"{mount}"' for mount in image_mounts())
    with cluster.inventory.open("a") as inventory:
        inventory.write(f'\n[container]\nimage = "{IMAGE_TAG}"\nruntime = "{runtime}"\nmounts = [{mounts}]\n')
    return cluster


def assert_clean(cluster: LocalCluster, timeout: float = 10.0) -> None:
    for name in cluster.names:
        assert cluster.wait_no_processes(name, timeout=timeout) == [], f"processes left on {name}"
    assert cluster.containers_left() == {}


def run(cluster: LocalCluster, log_dir: Path, *args: str) -> tuple[int, str]:
    from support.cluster_runs import run_cli

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
             re.finditer(r"rank (\d) of 4 on (node\d) in-image (\w+) uid (\d+:\d+) file (\d+:\d+) sum 10 "
                         r"preloaded (\w+)", out)}
    assert sorted(found) == [0, 1, 2, 3], out
    for rank, match in found.items():
        assert match.group(6) == "True"  # forked from its torchrun, started warm inside the container
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


def check(cluster: LocalCluster, inventory: Path | None = None, *flags: str) -> dict[str, dict[str, str]]:
    """``check --only ssh,container --json``: per node, the container check's result."""
    done = subprocess.run([sys.executable, "-m", "torchherd", "-i", str(inventory or cluster.inventory), "check",
                           "--only", "ssh,container", "--json", *flags], capture_output=True, text=True, timeout=200,
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


PLANTED = "import os\nopen('/tmp/planted-ran', 'w').write(str(os.getuid()))\n"
"""What another user leaves in a node's /tmp: it says so, in /tmp, when anyone imports it."""


@pytest.mark.timeout(240)
def test_the_check_never_imports_what_another_user_left_in_the_nodes_tmp(boxed: LocalCluster,
                                                                          other_user: str) -> None:
    """Security review 4, H1: the check's ``python -c`` in the image once started in the
    node's /tmp (mounted), so a json.py or torch/ planted there ran as the checking user."""
    plant = ("printf '%s' \"$1\" > /tmp/json.py && mkdir -p /tmp/torch && cp /tmp/json.py /tmp/torch/__init__.py "
             "&& chmod -R a+rX /tmp/json.py /tmp/torch")
    for name in boxed.names:
        done = boxed.ssh(name, f"runuser -u {other_user} -- sh -c {shlex.quote(plant)} sh {shlex.quote(PLANTED)}")
        assert done.returncode == 0, done.stderr
    try:
        found = check(boxed)
        for name in boxed.names:
            assert found[name]["status"] == "pass", found[name]
            assert f"inside: python {sys.version.split()[0]}, torch " in found[name]["summary"], found[name]
            assert boxed.ssh(name, "test -e /tmp/planted-ran").returncode == 1, f"the planted module ran on {name}"
    finally:
        for name in boxed.names:
            boxed.ssh(name, "rm -rf /tmp/json.py /tmp/torch /tmp/planted-ran")


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
    from torchherd.engine.records import remote_state_file

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
    from support.cluster_runs import run_cli

    code, out = run_cli(boxed, tmp_path / "logs", "--nproc-per-node", "1", "--retries", "1", "--",
                        str(JOBS / "fail_first_attempt.py"), "--count", "2")
    assert code == 0, out
    assert "fail_first_attempt: failing on purpose" in out, out
    for rank, name in enumerate(boxed.names):
        # the same run-scoped name on the same node, attempt after attempt: the first one's was removed
        assert f"rank {rank} in attempt 2 on {name}" in out, out
    assert_clean(boxed)


@pytest.mark.timeout(420)
def test_a_spare_takes_the_place_of_a_node_killed_mid_run_in_containers(
        make_cluster: Callable[..., LocalCluster], tmp_path: Path, controllers: Callable[..., Controller]) -> None:
    """node2 dies (its link down, every process of it killed: sshd, conmon, the container's
    ranks); the spare node3 starts attempt 2 in a container of its own. node2 comes back
    while attempt 2 runs (a rebooted machine: sshd again, its podman storage as it was,
    listing the dead container): at the end the controller removes the run's container
    there, and the run ends 0 with nothing of it left on any node."""
    from support.cluster_recovery import RESUMABLE, kill_node

    cluster = with_image(make_cluster(4, nproc_per_node=1, containers=True))
    controller = controllers(cluster, tmp_path / "logs", "--spares", "node3", "--retries", "1", "--plain", "--",
                             RESUMABLE, "--steps", "100", "--step-seconds", "0.15")
    controller.wait_for(r"step 12 loss", timeout=120)
    kill_node(cluster, "node2")
    try:
        controller.wait_for(r"attempt 2 of 2 on 3 nodes: node0, node1, node3", timeout=150)
    finally:
        cluster.restore_network("node2")
    cluster.start_sshd("node2")
    listed = cluster.ssh("node2", "podman ps -a --format '{{.Names}}'", timeout=60).stdout
    assert re.search(r"^torchherd-th-\S+-node2$", listed, re.M), listed  # what the test is about: it is there
    assert controller.wait(timeout=240) == 0, controller.output
    out = controller.output
    assert "node2 excluded: lost in attempt 1: vanished: nothing heard from it" in out, out
    assert "spare node3 takes the place of node2" in out
    assert re.search(r"attempt 2, starting at step (10|15)", out), out
    assert "the run's container removed from node2, lost in an attempt" in out, out
    assert_clean(cluster, timeout=30)


PODMAN_DOCKER = Path("/usr/bin/docker")


def podman_docker() -> bool:
    """Debian's podman-docker: /usr/bin/docker, a script that execs podman (scripts/install-deps)."""
    try:
        return "exec /usr/bin/podman" in PODMAN_DOCKER.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


@pytest.mark.timeout(300)
@pytest.mark.skipif(not podman_docker(), reason="/usr/bin/docker is not podman-docker's (scripts/install-deps)")
def test_ddp_through_the_docker_command(make_cluster: Callable[..., LocalCluster], tmp_path: Path) -> None:
    """``runtime = "docker"``, through podman-docker's ``docker`` (Debian's package; no docker
    daemon on this machine). The nodes' PATH (sshd's SetEnv) has /usr/bin first: this
    machine's /usr/local/bin/docker, a docker client without a daemon, shadows it otherwise,
    as a second docker install would on a real node. The preflight runs: the container
    check reads the image's id and the versions through ``docker`` too."""
    from torchherd.cli import main
    from torchherd.console import make_console

    cluster = with_image(make_cluster(2, containers=True,
                                      node_path="/usr/bin:/bin:/usr/sbin:/sbin:/usr/local/bin"), runtime="docker")
    assert cluster.ssh("node0", "command -v docker").stdout.strip() == str(PODMAN_DOCKER)
    printed = StringIO()
    code = main(["-i", str(cluster.inventory), "run", "--log-dir", str(tmp_path / "logs"), "--nproc-per-node", "2",
                 "--", str(JOBS / "in_container.py")], console=make_console(printed, width=200))
    out = printed.getvalue()
    assert code == 0, out
    found = {int(match.group(1)): match for match in
             re.finditer(r"rank (\d) of 4 on (node\d) in-image (\w+) uid (\d+:\d+) file (\d+:\d+) sum 10", out)}
    assert sorted(found) == [0, 1, 2, 3], out
    assert all(match.group(3) == "True" and match.group(2) == f"node{rank // 2}" for rank, match in found.items())
    image_id = cluster.ssh("node0", f"podman image inspect --format '{{{{.Id}}}}' {IMAGE_TAG}").stdout.strip()
    assert len(image_id) == 64, image_id
    found_by_check = check(cluster)
    for name in cluster.names:
        # the id, not podman-docker's "Emulate Docker CLI using podman..." said before it
        assert found_by_check[name]["summary"].startswith(f"docker, image {IMAGE_TAG} {image_id[:12]}; inside: "), \
            found_by_check
    assert_clean(cluster)


UNPULLABLE = "127.0.0.1:9/torchherd/none:1"
"""An image no registry serves: nothing listens on the node's own port 9 (no registry is ever reached)."""


@pytest.mark.timeout(240)
def test_an_image_that_cannot_be_pulled_stops_the_run_before_the_launch_in_one_line(boxed: LocalCluster,
                                                                                    tmp_path: Path) -> None:
    started = time.monotonic()
    code, out = run(boxed, tmp_path / "logs", "--nproc-per-node", "1", "--image", UNPULLABLE, "--pull", "missing",
                    "--", str(JOBS / "in_container.py"))
    print(f"the failed pull took {time.monotonic() - started:.1f} s")
    assert code == 1, out
    failed = [line for line in out.splitlines() if "could not be pulled" in line]
    assert len(failed) == 1, out  # both nodes, one line: the same image, the same error
    assert re.fullmatch(rf"torchherd: pull: {re.escape(UNPULLABLE)} could not be pulled on node\[0-1\]: "
                        rf"initializing source docker://{re.escape(UNPULLABLE)}: .*127\.0\.0\.1:9.*", failed[0]), failed
    assert f"pull: {UNPULLABLE} on 2 nodes (pull missing), all at once" in out
    assert "pull: 0 of 2 nodes have the image" in out
    assert "torchrun started" not in out and "preflight" not in out  # before the preflight and the launch
    assert_clean(boxed)


@pytest.mark.slow  # a whole run for what tests/unit/test_pull.py shows on in-process nodes
@pytest.mark.timeout(240)
def test_the_image_there_is_not_pulled_again_with_missing(boxed: LocalCluster, tmp_path: Path) -> None:
    code, out = run(boxed, tmp_path / "logs", "--nproc-per-node", "1", "--pull", "missing", "--",
                    str(JOBS / "in_container.py"))
    assert code == 0, out
    assert f"node[0-1]: {IMAGE_TAG} there already" in out, out
    assert "pull: 2 of 2 nodes have the image" in out
    assert_clean(boxed)


@pytest.mark.timeout(240)
def test_check_with_pull_never_fails_each_node_without_the_image(boxed: LocalCluster) -> None:
    inventory = boxed.inventory.with_name("absent-image.toml")
    inventory.write_text(boxed.inventory.read_text().replace(f'image = "{IMAGE_TAG}"', 'image = "localhost/absent:1"'))
    found = check(boxed, inventory)
    for name in boxed.names:
        assert found[name]["status"] == "fail", found
        assert found[name]["summary"].startswith(f"image localhost/absent:1 is not on {name} (podman: "), found
        assert "--pull missing" in found[name]["fix"]


STAND_INS = "/tmp/torchherd-stand-ins"
"""In each node's private /tmp: a stand-in written there is that node's alone."""


@pytest.mark.timeout(300)
@pytest.mark.skipif(any(Path(d).is_dir() and any(Path(d).iterdir()) for d in ("/etc/cdi", "/var/run/cdi")),
                    reason="this machine has CDI specs (/etc/cdi, /var/run/cdi): every node would see them")
def test_gpu_ranks_in_podman_need_the_cdi_device_named_by_check(make_cluster: Callable[..., LocalCluster]) -> None:
    """nproc_per_node = gpu: node0 has a stand-in nvidia-ctk whose ``cdi list`` prints the real
    list of a 4-GPU machine (tests/unit/data/nvidia-toolkit); node1 has neither nvidia-ctk nor a
    CDI spec. The nodes' PATH starts with their private stand-in directory (sshd's SetEnv)."""
    data = Path(__file__).resolve().parents[1] / "unit" / "data" / "nvidia-toolkit" / "nvidia-ctk-1.17-cdi-list.txt"
    cluster = with_image(make_cluster(2, containers=True, node_path=f"{STAND_INS}:/usr/local/sbin:/usr/local/bin:"
                                                                   "/usr/sbin:/usr/bin:/sbin:/bin"))
    cluster.write_file("node0", f"{STAND_INS}/nvidia-ctk",
                       f'#!/bin/sh\n[ "$*" = "cdi list" ] || exit 2\necho "INFO[0000] Found 9 CDI devices" >&2\n'
                       f"cat {data}\n", mode=0o755)
    done = subprocess.run([sys.executable, "-m", "torchherd", "-i", str(cluster.inventory), "check", "--only",
                           "ssh,container", "--nproc-per-node", "gpu", "--json"], capture_output=True, text=True,
                          timeout=200, stdin=subprocess.DEVNULL, env=cluster.env())
    found = {item["node"]: item for item in json.loads(done.stdout)["checks"] if item["check"] == "container"}
    assert done.returncode == 1, done.stdout + done.stderr
    assert found["node0"]["status"] == "pass", found
    assert found["node0"]["summary"].endswith("; GPUs passed in through nvidia.com/gpu=all"), found
    assert found["node1"]["status"] == "fail", found
    assert found["node1"]["summary"] == ("podman on node1 cannot pass the GPUs in: the NVIDIA container toolkit is "
                                         "not installed (no nvidia-ctk, no CDI spec of nvidia.com/gpu in /etc/cdi or "
                                         "/var/run/cdi)")
    assert found["node1"]["fix"].startswith("install nvidia-container-toolkit there, then sudo nvidia-ctk cdi generate")


@pytest.mark.timeout(240)
def test_the_hang_watch_names_the_hung_rank_inside_a_container(boxed: LocalCluster, tmp_path: Path) -> None:
    """Rank 1 (node1) sleeps at step 5 inside its container; rank 0 waits for it in all_reduce.
    The hang probe runs outside the containers (the supervisor's side): it finds the ranks in
    the node's process table by their environment, stops them, has py-spy (the test extra,
    beside the node's Python) read their stacks, and SIGABRTs them (faulthandler inside)."""
    from support.cluster_recovery import RESUMABLE

    sleeping = next(number for number, text in enumerate(Path(RESUMABLE).read_text().splitlines(), 1)
                    if "time.sleep(100_000)" in text)
    code, out = run(boxed, tmp_path / "logs", "--no-check", "--nproc-per-node", "1", "--hang-timeout", "5", "--",
                    RESUMABLE, "--steps", "100", "--step-seconds", "0.05", "--hang-rank", "1", "--hang-step", "5")
    assert code == 1, out
    # two ranks, two places: both named, the sleeping one in its own frame
    assert re.search(rf"hung: no rank printed a line or used CPU for 5 s; rank 0 on node0 in \S+ at "
                     rf"resumable.py:\d+; rank 1 on node1 in main at resumable.py:{sleeping} \(py-spy: ", out), out
    spied = re.search(r"\(py-spy: (\S+py-spy-attempt-1\.txt)\)", out)
    assert spied, out  # py-spy, outside, reads a rank in its container (another mount namespace)
    dumps = Path(spied.group(1)).read_text(encoding="utf-8")
    one = dumps[dumps.index("==== rank 1 on node1"):]
    assert re.search(rf"^\s+main \(\S+/resumable\.py:{sleeping}\)$", one, re.M), dumps
    assert "Fatal Python error: Aborted" in out  # faulthandler inside the container, after the SIGABRT
    assert_clean(boxed, timeout=30)


@pytest.mark.slow  # test_terminal's runs it without a container
@pytest.mark.serial  # it measures the ranks' CPU (tests/conftest.py)
@pytest.mark.timeout(300)
def test_the_node_the_others_wait_for_is_named_the_straggler_inside_a_container(boxed: LocalCluster,
                                                                                tmp_path: Path) -> None:
    """node1's ranks, in their container, stopped 70% of the time (support.cluster_straggler's
    ``less_cpu``); node0's wait for them in every all_reduce. The supervisor, outside,
    finds the ranks in its own process tree (podman's conmon, orphaned, is its child: it is
    the subreaper) and samples their states: node1 is named as it is without a container."""
    from support.cluster_straggler import assert_named_the_straggler, compute_job, less_cpu

    with less_cpu(boxed, "node1"):
        code, text = compute_job(boxed, tmp_path / "logs")
    assert_named_the_straggler(code, text, "node1")
    assert_clean(boxed)


@pytest.mark.slow  # the docker command's own path in a later attempt; the podman one runs in CI
@pytest.mark.timeout(300)
@pytest.mark.skipif(not podman_docker(), reason="/usr/bin/docker is not podman-docker's (scripts/install-deps)")
def test_a_retried_run_through_the_docker_command(make_cluster: Callable[..., LocalCluster], tmp_path: Path) -> None:
    """Attempt 2 through ``docker``: its supervisor removes a container of the run's name
    first (docker has no --replace), then starts its own under that name."""
    from support.cluster_runs import run_cli

    cluster = with_image(make_cluster(2, containers=True,
                                      node_path="/usr/bin:/bin:/usr/sbin:/sbin:/usr/local/bin"), runtime="docker")
    code, out = run_cli(cluster, tmp_path / "logs", "--no-check", "--nproc-per-node", "1", "--retries", "1", "--",
                        str(JOBS / "fail_first_attempt.py"), "--count", "2")
    assert code == 0, out
    for rank, name in enumerate(cluster.names):
        assert f"rank {rank} in attempt 2 on {name}" in out, out
    assert_clean(cluster)


ARCHIVED = "localhost/th-archive:1"
"""The test image under a name of its own, which the nodes lack until the archive loads it."""


def untag(cluster: LocalCluster, image: str) -> None:
    for name in cluster.names:
        cluster.ssh(name, f"podman rmi {image} >/dev/null 2>&1 || true", timeout=60)


@pytest.mark.timeout(300)
def test_a_missing_image_is_relayed_through_the_master_and_loaded_on_every_node(boxed: LocalCluster,
                                                                                tmp_path: Path) -> None:
    from torchherd.console.sync import size
    from torchherd.imagearchive import read_archive

    archive = boxed.state_dir / "th-archive.tar"  # the nodes' /tmp is their own
    untag(boxed, ARCHIVED)
    # A real podman save of the test image under another name, then that name removed
    # again: no node has the image by that name (node0 keeps it under IMAGE_TAG: the
    # load gives it the name back).
    boxed.ssh("node0", f"podman tag {IMAGE_TAG} {ARCHIVED} && podman save -o {archive} {ARCHIVED} && "
                       f"podman rmi {ARCHIVED} >/dev/null", check=True, timeout=120)
    saved = read_archive(str(archive))
    assert saved.tags == (ARCHIVED,), saved
    try:
        flags = ["--image", ARCHIVED, "--image-archive", str(archive)]
        found = check(boxed, None, *flags)
        assert found["node0"]["status"] == found["node1"]["status"] == "warn", found
        assert "--image-archive would load it" in found["node1"]["summary"], found
        assert found["cluster"]["summary"] == f"image {ARCHIVED} missing on 2 nodes; --image-archive would load it"

        code, out = run(boxed, tmp_path / "logs", "--nproc-per-node", "1", *flags, "--", str(JOBS / "in_container.py"))
        assert code == 0, out
        assert (f"image archive: sending {archive} ({size(saved.size)}, image {ARCHIVED} {saved.image_id[:12]}) once, "
                "relayed node to node: this machine -> node0 -> node1") in out, out
        for name in boxed.names:  # one bar per node, in its last state
            assert re.search(rf"^  {name} ━+ {re.escape(size(saved.size))} / {re.escape(size(saved.size))} loaded$",
                             out, re.M), out
        # This machine sent the archive once (to node0): node1's verified copy came from node0.
        assert re.search(rf"image archive: {re.escape(ARCHIVED)} loaded on 2 of 2 nodes \(\d+\.\d s; "
                         rf"{re.escape(size(saved.size))} sent from this machine\)", out), out
        for name in boxed.names:
            shown = boxed.ssh(name, f"podman image inspect --format '{{{{.Id}}}}' {ARCHIVED}", check=True).stdout
            assert shown.strip() == saved.image_id, (name, shown)
            left = boxed.ssh(name, "ls -A ~/.cache/torchherd/archives", check=True).stdout
            assert ".torchherd-image-" not in left, (name, left)  # each node's copy removed once loaded
        ranks = re.findall(r"rank (\d) of 2 on (node\d) in-image True", out)
        assert sorted(ranks) == [("0", "node0"), ("1", "node1")], out
        assert_clean(boxed)

        found = check(boxed, None, *flags)  # now every node holds the archive's image: nothing to load
        assert [found[name]["status"] for name in boxed.names] == ["pass", "pass"], found
        assert "cluster" not in found, found
    finally:
        untag(boxed, ARCHIVED)
        archive.unlink(missing_ok=True)
