"""One box first: a one-node cluster judged as one node, and ``-H localhost`` on a machine
with no sshd at all.

The ``-H localhost`` tests run torchherd inside a fresh network namespace with only ``lo``
up (``unshare -n``): no sshd can be listening there, and each test shows it (no TCP
listener at all before torchherd starts). Everything must then go through the in-process
transport: check, a 1x2 job, --detach with status and stop, --retries, the hang watch.
The multi-node hostname check on 127.0.1.1 still fails (test_check.py's
test_hostname_on_loopback)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from localcluster import LocalCluster

from support.cluster_topologies import ALLREDUCE_DEMO

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
NO_LISTENER = "no TCP listener here"
JOB = """\
import os, sys, time
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} up in attempt {os.environ.get('TORCHHERD_ATTEMPT', '-')}", flush=True)
mode = sys.argv[1]
if mode == "fail-once" and os.environ.get("TORCHHERD_ATTEMPT") == "1" and rank == 1:
    raise SystemExit(3)
if mode in ("sleep", "hang"):
    time.sleep(600)
print(f"rank {rank} done", flush=True)
"""


def _skip_unless_root_with_unshare() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs root, unshare and ip (a network namespace of the test's own)")


def in_empty_netns(command: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """``command`` (sh) in a new network namespace with only ``lo`` up, after proving no
    TCP socket listens there (so no sshd): /proc/net/tcp{,6} hold no LISTEN (state 0A)."""
    prove = ("if awk 'NR > 1 && $4 == \"0A\"' /proc/net/tcp /proc/net/tcp6 | grep -q .; "
             f"then echo 'a TCP listener is here'; exit 97; else echo '{NO_LISTENER}'; fi")
    script = f"ip link set lo up && {prove} && {command}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
           "COLUMNS": "200"}
    return subprocess.run(["unshare", "-n", "sh", "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def torchherd(*args: str) -> str:
    return shlex.join([sys.executable, "-m", "torchherd", *args])


@pytest.fixture
def box(tmp_path: Path) -> Path:
    _skip_unless_root_with_unshare()
    (tmp_path / "job.py").write_text(JOB)
    return tmp_path


@pytest.mark.timeout(240)
def test_localhost_checks_and_runs_a_1x2_job_with_no_sshd_listening(box: Path) -> None:
    # the README's one-box start, as a pip user has it: the example script shipped in the package
    done = in_empty_netns(f"{torchherd('init', '--example-script')} >/dev/null && "
                          f"{torchherd('check', '-H', 'localhost', '--json')} > check.json; "
                          f"{torchherd('run', '-H', 'localhost', '--nproc-per-node', '2', '--', 'train.py', '--steps', '3')}",
                          box, 200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.splitlines()[0] == NO_LISTENER
    report = json.loads((box / "check.json").read_text())
    assert report["ok"] is True, report
    checks = {item["check"]: item for item in report["checks"]}
    assert checks["ssh"]["summary"].startswith("this machine, no SSH")
    assert checks["network"]["summary"].startswith("127.0.0.1 on lo")
    assert checks["hostname"]["status"] == "pass"
    assert re.search(r"(?m)^localhost:0: rank 0 done: loss", done.stdout), done.stdout
    assert re.search(r"(?m)^localhost:1: rank 1 done: loss", done.stdout), done.stdout
    assert "the node finished (exit 0)" in done.stdout


@pytest.mark.timeout(240)
def test_localhost_detach_status_and_stop_with_no_sshd(box: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    done = in_empty_netns(torchherd("run", "-H", "localhost", "--nproc-per-node", "2", "--detach", "--", "job.py",
                                    "sleep"), box, 150)
    run_id = next((line for line in done.stdout.splitlines() if line.startswith("th-")), None)
    try:
        assert done.returncode == 0 and run_id is not None, done.stdout[-3000:] + done.stderr[-3000:]
        status = subprocess.run([sys.executable, "-m", "torchherd", "status", run_id], capture_output=True, text=True,
                                timeout=60)
        assert re.search(r"(?m)^localhost +running", status.stdout), status.stdout + status.stderr
    finally:
        if run_id is not None:
            stopped = subprocess.run([sys.executable, "-m", "torchherd", "stop", run_id], capture_output=True,
                                     text=True, timeout=90)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "localhost: stopped, nothing of the run is left" in stopped.stdout
    assert not [line for line in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
                if str(box / "job.py") in line or (run_id in line)]


@pytest.mark.timeout(300)
def test_localhost_retries_and_the_hang_watch_with_no_sshd(box: Path) -> None:
    retried = in_empty_netns(torchherd("run", "-H", "localhost", "--nproc-per-node", "2", "--retries", "1", "--",
                                       "job.py", "fail-once"), box, 200)
    assert retried.returncode == 0, retried.stdout[-3000:] + retried.stderr[-3000:]
    assert "the node finished (exit 0)" in retried.stdout and "(attempt 2)" in retried.stdout
    # Both attempts fork from the warm Python, started over the local transport as over SSH.
    assert re.search(r"(?m)^1 +localhost +warm +failed", retried.stdout), retried.stdout
    assert re.search(r"(?m)^2 +localhost +warm +ok", retried.stdout), retried.stdout
    hung = in_empty_netns(torchherd("run", "-H", "localhost", "--nproc-per-node", "2", "--hang-timeout", "4", "--",
                                    "job.py", "hang"), box, 200)
    assert hung.returncode == 1, hung.stdout[-3000:] + hung.stderr[-3000:]
    assert re.search(r"(?m)^hung: no rank printed a line or used CPU for 4 s; ranks 0-1 in <module> at job\.py:\d+",
                     hung.stdout), hung.stdout[-3000:]


@pytest.mark.timeout(300)
def test_a_one_node_cluster_whose_hostname_is_on_127_0_1_1_passes_check_and_runs_1x2(
        make_cluster: object, tmp_path: Path) -> None:
    """Over SSH, on the local cluster: one node whose /etc/hosts puts its name on
    127.0.1.1 (Debian's way). No other node needs to reach it: check passes, the job runs."""
    cluster: LocalCluster = make_cluster(1)  # type: ignore[operator]
    hosts = cluster.read_file("node0", "/etc/hosts")
    cluster.write_file("node0", "/etc/hosts", "127.0.1.1\tnode0\n" + hosts)
    env = {**cluster.env(), "COLUMNS": "200"}
    checked = subprocess.run([sys.executable, "-m", "torchherd", "check", "--json"], capture_output=True, text=True,
                             env=env, timeout=120)
    report = json.loads(checked.stdout)
    assert report["ok"] is True, checked.stdout
    summaries = {item["check"]: item["summary"] for item in report["checks"]}
    assert summaries["hostname"].startswith("node0 -> 127.0.1.1 (loopback: fine on one machine")
    assert summaries["ssh"].startswith("logged in to ")  # a cluster's node: SSH as ever
    ran = subprocess.run([sys.executable, "-m", "torchherd", "run", "--nproc-per-node", "2", "--log-dir",
                          str(tmp_path / "logs"), "--", ALLREDUCE_DEMO, "--steps", "3"], capture_output=True, text=True,
                         env=env, timeout=180)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert re.search(r"(?m)^node0:1: rank 1 done: loss", ran.stdout), ran.stdout
    assert cluster.wait_no_processes("node0", timeout=10) == []
