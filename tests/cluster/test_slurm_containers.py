"""A SLURM job in a real podman container on the local cluster: slurmd on nodes that
run podman (their cgroup2 hierarchy left at /sys/fs/cgroup for crun, slurmd's cgroup v1
mounts elsewhere), the test image loaded on each node, real sbatch/srun/scancel, real
torchrun inside the image. No pyxis (it cannot be installed here): the runtime form."""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Iterator
from io import StringIO
from pathlib import Path

import pytest
from localcluster import IMAGE_TAG, LocalCluster, image_mounts, write_image_archive
from slurmcluster import SlurmCluster, slurm_unavailable_reason

from support.slurm_runs import remove_run_dirs
from torchherd.cli import main
from torchherd.console import make_console

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(shutil.which("podman") is None,
                                                      reason="podman is not installed (scripts/install-deps)")]

JOBS = Path(__file__).resolve().parent / "jobs"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def slurm_boxed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    from support.cluster_build import start_cluster

    reason = slurm_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    cluster = start_cluster(2, tmp_path_factory.mktemp("slurm-containers"), containers=True)
    slurm: SlurmCluster | None = None
    try:
        archive = write_image_archive(cluster.state_dir / "image.tar")
        for name in cluster.names:
            cluster.load_image(name, archive)
        slurm = SlurmCluster(cluster).up()
        yield slurm
    finally:
        if slurm is not None:
            slurm.down()
        cluster.down()


def inventory(slurm: SlurmCluster, path: Path) -> Path:
    slurm.inventory(path)
    mounts = ", ".join(f'"{mount}"' for mount in image_mounts())
    with path.open("a") as file:
        file.write(f'\n[container]\nimage = "{IMAGE_TAG}"\nruntime = "podman"\nmounts = [{mounts}]\n')
    return path


def job_processes(cluster: LocalCluster, name: str, timeout: float = 30.0) -> list[str]:
    """What is left on the node but slurmd (the node's, not the job's), once it settles."""
    deadline = time.monotonic() + timeout
    while True:
        left = [cmd for cmd in cluster.processes(name) if not cmd.startswith(("slurmd ", "/usr/sbin/slurmd"))]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def torchherd(inventory: Path, *args: str) -> tuple[int, str]:
    out = StringIO()
    code = main(["-i", str(inventory), *args], console=make_console(out, width=200))
    return code, out.getvalue()


@pytest.mark.timeout(400)
def test_ddp_in_podman_through_slurm_then_scancel_leaves_no_container(slurm_boxed: SlurmCluster, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_CONF", str(slurm_boxed.conf))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    cluster = slurm_boxed.cluster
    path = inventory(slurm_boxed, tmp_path / "slurm.toml")
    try:
        code, out = torchherd(path, "run", "--log-dir", str(tmp_path / "logs"), "--nproc-per-node", "2", "--",
                              str(JOBS / "in_container.py"))
        assert code == 0, out
        found = {int(match.group(1)): match for match in
                 re.finditer(r"rank (\d) of 4 on (node\d) in-image (\w+) uid (\d+:\d+) file (\d+:\d+) sum 10", out)}
        assert sorted(found) == [0, 1, 2, 3], out
        for rank, match in found.items():
            assert match.group(2) == f"node{rank // 2}" and match.group(3) == "True", match.group(0)
            assert match.group(4) == match.group(5) == "0:0", match.group(0)  # the user's, not the image's nobody
        assert cluster.containers_left() == {}

        code, out = torchherd(path, "run", "--detach", "--no-check", "--nproc-per-node", "1", "--",
                              str(EXAMPLES / "ticker.py"), "100000", "0.2")
        assert code == 0, out
        (run_id,) = re.findall(r"^(th-\S+)$", out, re.M)
        deadline = time.monotonic() + 120
        while "tick 1 3" not in (logs := torchherd(path, "logs", run_id)[1]) or "tick 0 3" not in logs:
            assert time.monotonic() < deadline, logs
            time.sleep(1)
        running = {name: cluster.ssh(name, "podman ps --format '{{.Names}}'").stdout.strip() for name in cluster.names}
        for name, listed in running.items():
            assert re.fullmatch(rf"torchherd-{run_id}-{name}-\d+", listed), (name, listed)
        code, out = torchherd(path, "stop", run_id)
        assert code == 0, out
        assert slurm_boxed.queue() == []
        assert cluster.containers_left() == {}
        for name in cluster.names:
            assert job_processes(cluster, name) == [], f"processes left on {name}"
    finally:
        left = slurm_boxed.queue()
        if left:
            slurm_boxed.client("scancel", "--full", "--signal=KILL", *left, check=False)
        remove_run_dirs(slurm_boxed, tmp_path / "state")
