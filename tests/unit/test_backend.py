"""The backend is chosen once, from the scheduler; a flag the chosen backend cannot honour
is refused with one line and exit 2 before anything is contacted (``--sync`` on both of
check's paths, JSON and terminal, alike)."""

from __future__ import annotations

import json
import time
from io import StringIO
from pathlib import Path

import pytest

from torchherd.api import Cluster, DetachedRun
from torchherd.cli import main
from torchherd.console import make_console
from torchherd.engine.backend import backend_of
from torchherd.engine.records import RunRecord
from torchherd.engine.slurm.backend import SlurmBackend
from torchherd.engine.ssh.backend import SshBackend
from torchherd.errors import UsageError

# 192.0.2.0/24 is TEST-NET-1: nothing answers there, so touching a node would hang.
INVENTORY = '[[hosts]]\nname = "a"\naddress = "192.0.2.1"\n[[hosts]]\nname = "b"\naddress = "192.0.2.2"\n'


def _main(tmp_path: Path, *args: str) -> tuple[int, str]:
    path = tmp_path / "hosts.toml"
    path.write_text(INVENTORY)
    out = StringIO()
    started = time.monotonic()
    code = main(["-i", str(path), *args], console=make_console(out, width=300))
    assert time.monotonic() - started < 5
    assert "Traceback" not in out.getvalue()
    return code, out.getvalue()


@pytest.mark.parametrize("flags", [["--json"], []], ids=["json", "terminal"])
def test_check_sync_with_slurm_is_refused_on_both_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        flags: list[str]) -> None:
    code, text = _main(tmp_path, "check", "--scheduler", "slurm", *flags, "--sync", str(tmp_path))
    assert code == 2
    assert text.splitlines()[0] == "error: --sync: not for SLURM runs (torchherd does not reach SLURM's nodes itself)"
    # no report: with --json, the error's own document
    assert capsys.readouterr().out == ("" if not flags else json.dumps({
        "schema": 1, "ok": False, "exit_code": 2,
        "error": "--sync: not for SLURM runs (torchherd does not reach SLURM's nodes itself)",
        "hint": "keep the project on the cluster's shared filesystem, or sync it to the login host first"},
        indent=2) + "\n")


@pytest.mark.parametrize("args,flag", [
    (["check", "--smoke"], "--smoke"),
    (["check", "--matrix"], "--matrix"),
    (["check", "--json", "--smoke"], "--smoke"),
    (["run", "--grace", "5", "--", "x.py"], "--grace"),
    (["run", "--detach", "--grace", "5", "--", "x.py"], "--grace"),
    (["run", "--dry-run", "--sync", "SYNC_DIR", "--", "x.py"], "--sync"),
    (["run", "--sync", "SYNC_DIR", "--", "x.py"], "--sync"),
])
def test_flags_slurm_cannot_honour_are_refused_with_one_line(tmp_path: Path, args: list[str], flag: str) -> None:
    args = [str(tmp_path) if arg == "SYNC_DIR" else arg for arg in args]
    code, text = _main(tmp_path, args[0], "--scheduler", "slurm", *args[1:])
    assert code == 2
    assert text.splitlines()[0].startswith(f"error: {flag}: not for SLURM")
    assert len([line for line in text.splitlines() if line.startswith("error:")]) == 1


def test_the_backend_is_picked_once_from_the_scheduler() -> None:
    cluster = Cluster(hosts=["a", "b"])
    assert isinstance(cluster.backend, SshBackend) and cluster.backend.connector is cluster.connector
    slurm = cluster.using("slurm")
    assert isinstance(slurm.backend, SlurmBackend) and slurm.backend.connector is cluster.connector
    assert isinstance(cluster.using("slurm").using("ssh").backend, SshBackend)


def _record(extra: dict[str, object]) -> RunRecord:
    return RunRecord(run_id="th-x", inventory="hosts.toml", created=0.0, command=("x.py",), nodes=(), max_rank=1,
                     grace=10.0, extra=extra)


def test_a_detached_runs_backend_comes_from_its_record() -> None:
    assert isinstance(backend_of(_record({})), SshBackend)
    slurm = _record({"scheduler": "slurm", "job_id": "42", "run_dir": "/nowhere"})
    assert isinstance(backend_of(slurm), SlurmBackend)
    with pytest.raises(UsageError, match="^--grace: not for SLURM runs"):
        DetachedRun(slurm).stop(grace=5.0)
