"""docs/getting-started.md shows what its commands print today (issue 41, item 10):
scripts/getting-started runs them in order, on a local 2-node cluster and on a box with no
sshd, and fails with a diff when the page no longer matches (run ids, addresses, pids,
durations and losses normalised; a run's lines compared in any order)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_the_getting_started_page_matches_what_its_commands_print() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "getting-started"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=560, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert done.stdout.strip() == "docs/getting-started.md matches what its commands print"
