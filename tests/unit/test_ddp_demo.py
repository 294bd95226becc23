"""examples/ddp_demo.py really trains under torchrun: 2 ranks, gloo on CPU."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "ddp_demo.py"
DONE = re.compile(r"^rank (\d+) done: loss (\S+) -> (\S+)$")
STEP = re.compile(r"^rank (\d+)/(\d+) host (\S+) step (\d+) loss (\S+)$")


def _kill_marked(marker: bytes) -> None:
    """SIGKILL every process whose environment carries marker (torchrun's workers
    live in their own sessions, so killing torchrun's group is not enough)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if marker in env:
            try:
                os.kill(int(name), signal.SIGKILL)
            except OSError:
                pass


@pytest.mark.timeout(120)
def test_ddp_demo_trains_and_ranks_agree() -> None:
    mark = uuid.uuid4().hex
    env = dict(os.environ, TORCHHERD_DDP_DEMO_TEST=mark)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", str(DEMO), "--steps", "20"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _kill_marked(f"TORCHHERD_DDP_DEMO_TEST={mark}".encode())
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text

    done = {}
    steps: dict[tuple[int, int], str] = {}
    for line in text.splitlines():
        if m := DONE.match(line):
            done[int(m[1])] = (float(m[2]), float(m[3]))
        elif m := STEP.match(line):
            assert m[2] == "2"
            steps[(int(m[1]), int(m[4]))] = m[5]
    assert sorted(done) == [0, 1], text
    assert done[0] == done[1], "ranks disagree on the averaged loss"
    first, last = done[0]
    assert last < first * 0.7, f"loss did not fall: {first} -> {last}"
    # every logged step prints the same averaged loss on both ranks
    assert {s for (_r, s) in steps} == {1, 10, 20}
    for s in (1, 10, 20):
        assert steps[(0, s)] == steps[(1, s)]
