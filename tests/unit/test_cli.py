"""Usage errors exit 2 with one line and a hint, before any node is contacted."""

from __future__ import annotations

import time
from io import StringIO
from pathlib import Path

import pytest

from torchherd.cli import main
from torchherd.console import make_console

# 192.0.2.0/24 is TEST-NET-1: nothing answers there, so touching a node would hang.
INVENTORY = '[[hosts]]\nname = "a"\naddress = "192.0.2.1"\n[[hosts]]\nname = "b"\naddress = "192.0.2.2"\n'


@pytest.mark.parametrize("args,message", [
    (["run", "--nnodes", "1:3", "--", "x.py"], "error: --nnodes 1:3: an elastic range needs the c10d rendezvous"),
    (["run", "--env", "NOEQUALS", "--", "x.py"], "error: --env 'NOEQUALS': expected NAME=VALUE"),
    (["run", "--nproc-per-node", "0", "--", "x.py"], "error: --nproc-per-node '0': expected a positive integer"),
    (["run", "--env-pass", "TORCHHERD_SURELY_UNSET", "--", "x.py"],
     "error: --env-pass TORCHHERD_SURELY_UNSET: not set in this shell"),
    (["run"], "error: run: no training script given"),
    (["check", "--only", "bogus"], "error: --only bogus: unknown check id 'bogus'"),
])
def test_usage_errors_exit_2_without_touching_a_node(tmp_path: Path, args: list[str], message: str) -> None:
    path = tmp_path / "hosts.toml"
    path.write_text(INVENTORY)
    out = StringIO()
    started = time.monotonic()
    code = main(["-i", str(path), *args], console=make_console(out, width=300))
    assert code == 2
    assert out.getvalue().splitlines()[0].startswith(message)
    assert "Traceback" not in out.getvalue()
    assert time.monotonic() - started < 2


def test_dry_run_prints_every_node_and_starts_nothing(tmp_path: Path) -> None:
    path = tmp_path / "hosts.toml"
    path.write_text(INVENTORY)
    out = StringIO()
    assert main(["-i", str(path), "run", "--dry-run", "--env", "X=a b", "--", "train.py", "--lr", "1"],
                console=make_console(out, width=400)) == 0
    text = out.getvalue()
    assert "--node-rank 0" in text and "--node-rank 1" in text
    assert "X='a b'" in text and "train.py --lr 1" in text
    assert not (tmp_path / "torchherd-logs").exists()


def test_dry_run_never_prints_a_secret(tmp_path: Path) -> None:
    path = tmp_path / "hosts.toml"
    path.write_text(INVENTORY)
    out = StringIO()
    assert main(["-i", str(path), "run", "--dry-run", "--env", "WANDB_API_KEY=s3cr3t-value", "--env",
                 "HF_TOKEN=hf_abc", "--env", "NCCL_DEBUG=INFO", "--", "train.py"],
                console=make_console(out, width=400)) == 0
    text = out.getvalue()
    assert "s3cr3t-value" not in text and "hf_abc" not in text
    assert "WANDB_API_KEY=***" in text and "HF_TOKEN=***" in text and "NCCL_DEBUG=INFO" in text
