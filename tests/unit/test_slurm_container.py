"""A SLURM job in a container (engine.slurm.container): pyxis's srun options, quoted;
without pyxis the task's own runtime command line, run for real by bash with a stand-in
runtime on PATH (a program that records how it was called and runs the job's argv), its
container removed at the end and on SIGTERM as scancel sends it. pyxis itself cannot be
installed here (it is a SPANK plugin built against the cluster's SLURM, with enroot)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchherd.api import Cluster
from torchherd.engine.slurm.batch import batch_job, node_command
from torchherd.engine.slurm.commands import parse_exit_file
from torchherd.engine.slurm.container import has_pyxis, pyxis_image, pyxis_options
from torchherd.engine.slurm.settings import settings_of
from torchherd.errors import UsageError
from torchherd.plan import Plan
from torchherd.remote.container import ContainerSpec

SRUN_HELP_PYXIS = """\
Usage: srun [OPTIONS(0)... [executable(0) [args(0)...]]] [ : [OPTIONS(N)...]] executable(N) [args(N)...]

Parallel run options:
  -A, --account=name          charge job to specified account
Options provided by plugins:
      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH
                              [pyxis] the image to use for the container
      --container-mounts=SRC:DST[:FLAGS][,SRC:DST...]
                              [pyxis] bind mount[s] inside the container.
"""


def plan(hosts: int = 2, *args: str, container: dict[str, object] | None = None, **keys: object) -> Plan:
    made = Cluster([f"node{index}" for index in range(hosts)], scheduler="slurm", python="python3",
                   workdir=keys.pop("workdir", "~/proj"), slurm={"partition": "main"},
                   container=container or {"image": "nvcr.io/nvidia/pytorch:24.05-py3"}, **keys)
    return made.plan("train.py", *args, run_id="th-c", nproc_per_node=2)


def srun_line(script: str) -> list[str]:
    """The batch script's srun, as bash splits it (with SLURM's variables as words)."""
    return shlex.split(script[script.index("\nsrun ") + 1:])


# pyxis --------------------------------------------------------------------------------


def test_pyxis_is_what_srun_help_lists() -> None:
    assert has_pyxis(SRUN_HELP_PYXIS)
    assert not has_pyxis("Usage: srun [OPTIONS]\n  -A, --account=name   charge job\n")
    assert not has_pyxis("      --container-imagery   not pyxis's\n")


def test_image_names_become_enroot_uris() -> None:
    assert pyxis_image("nvcr.io/nvidia/pytorch:24.05-py3") == "nvcr.io#nvidia/pytorch:24.05-py3"
    assert pyxis_image("localhost:5000/team/img:1") == "localhost:5000#team/img:1"
    assert pyxis_image("docker://nvcr.io/nvidia/pytorch:24.05-py3") == "nvcr.io#nvidia/pytorch:24.05-py3"
    assert pyxis_image("ubuntu:22.04") == "ubuntu:22.04"
    assert pyxis_image("pytorch/pytorch:2.3.0") == "pytorch/pytorch:2.3.0"  # Docker Hub: enroot's default
    assert pyxis_image("/shared/images/pytorch.sqsh") == "/shared/images/pytorch.sqsh"


def test_with_pyxis_the_step_is_srun_container_image() -> None:
    job = batch_job(plan(container={"image": "nvcr.io/nvidia/pytorch:24.05-py3", "mounts": ["/data:/data:ro,z"],
                                    "options": ["--cap-add=SYS_PTRACE", "--container-remap-root"]}),
                    settings_of(plan().inventory), pyxis=True)
    words = srun_line(job.script)
    assert "--container-image=nvcr.io#nvidia/pytorch:24.05-py3" in words
    assert "--container-mounts=$HOME/proj:$HOME/proj,$TORCHHERD_DIR:$TORCHHERD_DIR,/data:/data:ro+z" in words
    assert "--container-workdir=$HOME/proj" in words
    assert "--container-remap-root" in words and "--cap-add=SYS_PTRACE" not in words
    assert words.index("--container-image=nvcr.io#nvidia/pytorch:24.05-py3") < words.index("bash")
    inside = words[words.index("bash") + 2]
    assert "podman" not in inside and "python3 -m torch.distributed.run" in inside
    assert any("left out options that are not pyxis's: --cap-add=SYS_PTRACE" in note for note in job.notes)
    assert subprocess.run(["bash", "-n"], input=job.script, text=True).returncode == 0


def test_a_runtime_named_other_than_enroot_runs_on_the_nodes_even_with_pyxis() -> None:
    job = batch_job(plan(container={"image": "img:1", "runtime": "podman"}), settings_of(plan().inventory), pyxis=True)
    assert "--container-image" not in job.script and "podman run --rm" in job.script


def test_pyxis_options_quote_every_value() -> None:
    """Values that passed the inventory's checks but hold what a shell reads in a word
    (a ``#``, ``~``, ``=``, ``+``) stay literal; a workdir with a space and a quote too."""
    spec = ContainerSpec(image="reg.io/a+b/c@sha256:00ff", mounts=("~/in put:/x",),
                         options=("--container-env=A,B",))
    words = pyxis_options(spec, "/w d/it's", [])
    line = " ".join(["printf '%s\\n'", *words])
    printed = subprocess.run(["bash", "-c", line], capture_output=True, text=True,
                             env={**os.environ, "HOME": "/h o", "TORCHHERD_DIR": "/r $x"}).stdout.splitlines()
    assert printed == ["--container-image=reg.io#a+b/c@sha256:00ff",
                       "--container-mounts=/w d/it's:/w d/it's,/r $x:/r $x,/h o/in put:/x",
                       "--container-workdir=/w d/it's", "--container-env=A,B"]


def test_hostile_image_and_mounts_are_refused_before_any_script() -> None:
    with pytest.raises(UsageError):
        plan(container={"image": "img;touch /tmp/owned"})
    with pytest.raises(UsageError):
        plan(container={"image": "img:1", "mounts": ["/a:/b:$(id)"]})


def test_the_dry_run_without_asking_shows_the_runtime_and_says_pyxis_is_asked_at_submission() -> None:
    job = batch_job(plan(), settings_of(plan().inventory), pyxis=None)
    assert "podman run --rm" in job.script
    assert any("asked at submission" in note for note in job.notes)


@pytest.mark.parametrize("policy", ["missing", "always", "never"])
def test_a_slurm_task_s_container_pulls_as_the_inventory_says(policy: str) -> None:
    """Over SSH the run pulls before its launch and the container never does; a SLURM task
    has no such step, so its container takes the host's pull policy itself."""
    made = plan(container={"image": "nvcr.io/nvidia/pytorch:24.05-py3", "pull": policy})
    assert made.nodes[0].container is not None and made.nodes[0].container.pull == "never"  # the SSH plan's
    script = batch_job(made, settings_of(made.inventory), pyxis=False).script
    assert f"--pull {policy} " in script and (policy == "never" or "--pull never" not in script)


def test_a_container_that_differs_between_hosts_is_refused() -> None:
    made = Cluster(["node0", "node1"], scheduler="slurm", python="python3", workdir="~/proj",
                   container={"image": "img:1"})
    hosts = made.inventory.hosts
    assert hosts[1].container is not None
    changed = replace(made.inventory, hosts=(hosts[0], replace(hosts[1], container=replace(hosts[1].container,
                                                                                             image="img:2"))))
    the_plan = Cluster(inventory=changed).plan("train.py", run_id="th-d", nproc_per_node=1)
    with pytest.raises(UsageError, match="container differs"):
        batch_job(the_plan, settings_of(changed))


# the runtime on the node, run for real ---------------------------------------------------------


def stand_in_runtime(tmp_path: Path, name: str = "podman", sleep: float = 0.0) -> Path:
    """A ``name`` on PATH that appends its argv (JSON) to ``calls`` and, for ``run``, runs
    the job's argv (after the image) in ``-w``'s directory, as the container would."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / name
    fake.write_text(f"""#!{sys.executable}
import json, os, sys, time
with open({str(tmp_path / "calls")!r}, "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
args = sys.argv[1:]
if args[0] == "run":
    at = args.index("img:1")
    os.chdir(args[args.index("-w") + 1])
    time.sleep({sleep})
    os.execvp(args[at + 1], args[at + 1:])
""")
    fake.chmod(0o755)
    return bin_dir


def fake_python(tmp_path: Path) -> str:
    fake = tmp_path / "fake-python"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$PWD" "$@" > "{tmp_path}/argv"\nexit "${{EXIT_WITH:-0}}"\n')
    fake.chmod(0o755)
    return str(fake)


def calls(tmp_path: Path) -> list[list[str]]:
    path = tmp_path / "calls"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def task_env(tmp_path: Path, bin_dir: Path, **more: str) -> dict[str, str]:
    return {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "2",
            "TORCHHERD_MASTER_ADDR": "n0", "TORCHHERD_DIR": str(tmp_path), "SLURMD_NODENAME": "n1",
            "SLURM_JOB_ID": "77", **more}


@pytest.mark.parametrize("code", [0, 3])
def test_without_pyxis_the_task_runs_torchrun_in_the_nodes_runtime_and_removes_the_container(
        tmp_path: Path, code: int) -> None:
    work = tmp_path / "work dir"
    work.mkdir()
    bin_dir = stand_in_runtime(tmp_path)
    the_plan = Cluster(["n0", "n1"], scheduler="slurm", python=fake_python(tmp_path), workdir=str(work),
                       container={"image": "img:1", "mounts": ["/data:/data:ro"]},
                       env={"SECRET_TOKEN": "s3cret", "EXIT_WITH": str(code)}).plan(
        "train.py", "--lr", "it's 1", run_id="th-n", nproc_per_node=2)
    ran = subprocess.run(["bash", "-c", node_command(the_plan, the_plan.nodes)], capture_output=True,
                         env=task_env(tmp_path, bin_dir, SECRET_TOKEN="s3cret", EXIT_WITH=str(code)))
    assert ran.returncode == code, ran.stderr
    run, remove = calls(tmp_path)
    # podman (the stand-in's name) replaces a stale container of the name, as over SSH
    assert run[:7] == ["run", "--rm", "--name", "torchherd-th-n-n1-77", "--replace", "--label", "torchherd.run=th-n"]
    assert run[run.index("-w") + 1] == str(work)
    mounts = [run[index + 1] for index, word in enumerate(run) if word == "-v"]
    assert mounts[0] == f"{work}:{work}" and mounts[-1] == "/data:/data:ro"
    logs = mounts[1].split(":")[0]
    assert logs.startswith("/tmp/torchherd-th-n-n1-77-") and mounts[1] == f"{logs}:{logs}"
    assert ["-e", "SECRET_TOKEN"] == run[run.index("SECRET_TOKEN") - 1:run.index("SECRET_TOKEN") + 1]
    assert "s3cret" not in " ".join(run), "values never on the runtime's command line"
    expected_user = ["--user", f"{os.getuid()}:{os.getgid()}"] if os.getuid() == 0 else ["--userns", "keep-id"]
    assert run[run.index(expected_user[0]):run.index(expected_user[0]) + 2] == expected_user
    assert remove == ["rm", "-f", "torchherd-th-n-n1-77"]
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[0] == str(work)
    assert argv[argv.index("--node-rank") + 1] == "1" and argv[argv.index("--log-dir") + 1] == logs
    assert argv[-3:] == ["train.py", "--lr", "it's 1"]
    record = parse_exit_file("n1", (tmp_path / "n1.exit").read_text())
    assert record is not None and (record.phase, record.code) == ("job", code)
    assert not Path(logs).exists()


def test_no_runtime_on_the_node_is_a_setup_failure_naming_the_node(tmp_path: Path) -> None:
    # A PATH with the task's own tools only: this machine may have a docker (podman-docker's) in /usr/bin.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("mktemp", "date", "rm", "id"):
        found = shutil.which(tool)
        assert found is not None
        (bin_dir / tool).symlink_to(found)
    the_plan = Cluster(["n0"], scheduler="slurm", python="python3", workdir=str(tmp_path),
                       container={"image": "img:1", "runtime": "docker"}).plan("train.py", run_id="th-m")
    ran = subprocess.run([shutil.which("bash") or "/bin/bash", "-c", node_command(the_plan, the_plan.nodes)],
                         capture_output=True, text=True, env={**task_env(tmp_path, bin_dir), "PATH": str(bin_dir)})
    assert ran.returncode != 0
    assert "no container runtime on n1: docker is not installed there" in ran.stderr
    assert calls(tmp_path) == []


def test_sigterm_as_scancel_sends_it_removes_the_container_at_once(tmp_path: Path) -> None:
    bin_dir = stand_in_runtime(tmp_path, "docker", sleep=60)
    the_plan = Cluster(["n0"], scheduler="slurm", python=fake_python(tmp_path), workdir=str(tmp_path),
                       container={"image": "img:1", "runtime": "docker"}).plan("train.py", run_id="th-t")
    task = subprocess.Popen(["bash", "-c", node_command(the_plan, the_plan.nodes)], env=task_env(tmp_path, bin_dir),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while not calls(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert calls(tmp_path), "the client started"
        signalled = time.monotonic()
        os.killpg(task.pid, signal.SIGTERM)  # slurmd signals every process of the step
        task.wait(timeout=10)
        assert time.monotonic() - signalled < 5, "within SLURM's KillWait"
    finally:
        if task.poll() is None:
            os.killpg(task.pid, signal.SIGKILL)
            task.wait()
    assert ["rm", "-f", "torchherd-th-t-n1-77"] in calls(tmp_path)
    assert not (tmp_path / "argv").exists(), "the job never ran"


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00\n\r"), max_size=20))
def test_an_argument_reaches_the_job_inside_the_container_as_it_was(argument: str) -> None:
    the_plan = Cluster(["n0"], scheduler="slurm", python="python3", workdir="/w",
                       container={"image": "img:1", "runtime": "docker"}).plan("train.py", argument, run_id="th-q")
    script = node_command(the_plan, the_plan.nodes)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    line = next(line for line in script.split("\n") if line.startswith("  docker:*:0)"))
    words = shlex.split(line.removeprefix("  docker:*:0)").removesuffix(" & ;;"))
    assert words[-1] == argument
