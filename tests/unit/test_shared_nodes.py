"""Nodes shared with other users (issue 11): another local user must gain nothing.

The node scripts run here as the controller runs them over SSH (``python -c PROGRAM``,
pipes); the engine runs on the local transport. Attacks that need a second user create
one (``useradd``, as root) and are skipped, saying why, when this is not root."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from torchherd.api import Cluster
from torchherd.engine.events import Collector, NodeNotStarted
from torchherd.engine.job import LaunchOptions
from torchherd.engine.launch import launch
from torchherd.remote import program, wire
from torchherd.transport.local import LocalConnector

PY = sys.executable
SUPERVISOR = program("supervisor.py")
FAKE = str(Path(__file__).parent / "fakes" / "fake_torchrun.py")


def supervise(config: wire.SupervisorConfig, timeout: float = 30) -> list[bytes]:
    """The supervisor's records, run to the end with its stdin open (the controller's way)."""
    process = subprocess.Popen([PY, "-u", "-c", SUPERVISOR, "-", config.run_id], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE)
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(config.to_line())
    process.stdin.flush()
    try:
        out = process.stdout.read()
        process.wait(timeout=timeout)
    finally:
        process.kill()
        process.stdin.close()
    return out.splitlines()


def status(records: list[bytes], event: str) -> dict[str, object]:
    return next(json.loads(record[1:]) for record in records if record.startswith(b'S{"event":"%s"' % event.encode()))


@pytest.fixture
def other_user() -> Iterator[str]:
    """A second local account, removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a second local user")
    if shutil.which("useradd") is None or shutil.which("runuser") is None:
        pytest.skip("needs useradd and runuser")
    name = "th" + uuid.uuid4().hex[:10]
    subprocess.run(["useradd", "-M", "-s", "/bin/sh", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], check=False)


def as_user(user: str, command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["runuser", "-u", user, "--", "sh", "-c", command], capture_output=True, text=True,
                          timeout=30, cwd="/")


# item 1: torchrun's log directory ------------------------------------------------------


def test_the_log_directory_is_made_private_by_the_supervisor_and_removed(tmp_path: Path) -> None:
    log_dir = tmp_path / "torchherd-t1-n0"
    code = f"import os; print(oct(os.stat({str(log_dir)!r}).st_mode & 0o777))"
    records = supervise(wire.SupervisorConfig(run_id="t1", argv=(PY, "-c", code), heartbeat=0,
                                              cleanup_dir=str(log_dir)))
    assert b"O0o700" in records
    assert status(records, "done")["code"] == 0
    assert not log_dir.exists()


def test_a_log_directory_that_already_exists_is_refused_and_left_alone(tmp_path: Path) -> None:
    log_dir = tmp_path / "torchherd-t2-n0"
    planted = log_dir / "none_x" / "attempt_0" / "0"
    planted.mkdir(parents=True)
    (planted / "stdout.log").write_text("I am rank 0, trust me\n")
    ran = tmp_path / "ran"
    records = supervise(wire.SupervisorConfig(run_id="t2", argv=(PY, "-c", f"open({str(ran)!r}, 'w')"),
                                              heartbeat=0, cleanup_dir=str(log_dir), rank_logs=str(log_dir)))
    error = status(records, "error")
    assert "already exists" in str(error["message"]) and str(log_dir) in str(error["message"])
    assert status(records, "done")["code"] != 0
    assert not ran.exists(), "the job never started"
    assert not any(b"trust me" in record for record in records)
    assert (planted / "stdout.log").exists(), "not ours: never removed"


def test_every_node_has_its_own_log_directory() -> None:
    cluster = Cluster(["a", "b"], python="python3")
    plan = cluster.plan("train.py", run_id="t3")
    dirs = [node.remote_log_dir for node in plan.nodes]
    assert dirs == ["/tmp/torchherd-t3-a", "/tmp/torchherd-t3-b"]
    assert all(node.argv[node.argv.index("--log-dir") + 1] == node.remote_log_dir for node in plan.nodes)


def test_another_user_who_made_the_log_directory_first_gets_nothing(other_user: str, tmp_path: Path) -> None:
    run_id = "t4-" + uuid.uuid4().hex[:8]
    log_dir = f"/tmp/torchherd-{run_id}-n0"
    made = as_user(other_user, f"mkdir -m 777 {log_dir} && mkdir -p {log_dir}/x/attempt_0/0 && "
                               f"echo planted > {log_dir}/x/attempt_0/0/stdout.log")
    assert made.returncode == 0, made.stderr
    try:
        cluster = Cluster([{"name": "n0", "address": "127.0.0.1"}], python=PY, workdir=str(tmp_path),
                          connector=LocalConnector())
        plan = cluster.plan("train.py", run_id=run_id)
        node = plan.nodes[0]
        from dataclasses import replace

        plan = replace(plan, nodes=(replace(node, argv=(PY, FAKE, "ranks=0", "lines=1")),))
        events = Collector()
        summary = launch(plan, LaunchOptions(check=False, log_dir=tmp_path / "logs", grace=1.0), LocalConnector(),
                         events).wait(timeout=60)
        assert summary.exit_code == 1
        refused = events.of(NodeNotStarted)
        assert refused and "already exists" in refused[0].message  # type: ignore[attr-defined]
        assert not any("planted" in line.text for line in events.lines.get("n0", []))
        assert pwd.getpwuid(os.stat(log_dir).st_uid).pw_name == other_user, "theirs, left as it was"
    finally:
        subprocess.run(["rm", "-rf", log_dir], check=False)
