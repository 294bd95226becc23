"""Building local clusters for the tests (tests/cluster/localcluster.py): a prefix per
process (a pytest-xdist worker is one) and counter, ``start_cluster`` (recorded in
``made_prefixes`` for the end-of-session leftover check of tests/cluster/conftest.py),
and ``Runs``, which starts detached runs and stops them afterwards."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from localcluster import LocalCluster, unavailable_reason

from torchherd.api import attach
from torchherd.engine.records import remote_run_dir

# Prefixes made here: "tc" + this pid in base 36 + "-" + a counter, so parallel
# pytest runs on one machine never collide and stay within interface-name limits.
PREFIX_RE = re.compile(r"tc[0-9a-z]+-[0-9a-z]+")
_counter = itertools.count()
made_prefixes: list[tuple[str, tuple[int, ...]]] = []


def _base36(value: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        value, rest = divmod(value, 36)
        out = digits[rest] + out
        if not value:
            return out


def new_prefix() -> str:
    return f"tc{_base36(os.getpid())}-{_base36(next(_counter))}"


def skip_unless_available() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def start_cluster(n: int, workdir: Path, **kwargs: object) -> LocalCluster:
    """Start an n-node cluster with a fresh prefix that the end-of-session check
    covers (skips the test where no cluster can run). The caller calls down()."""
    skip_unless_available()
    cluster = LocalCluster(n, workdir, new_prefix(), **kwargs)  # type: ignore[arg-type]
    made_prefixes.append((cluster.prefix, ()))
    cluster.up()
    made_prefixes[-1] = (cluster.prefix, tuple(cluster.netns_inodes))
    return cluster


class Runs:
    """Starts detached runs as a separate process (so no controller outlives the command)."""

    def __init__(self, state_home: Path) -> None:
        self.state_home = state_home
        self.started: list[tuple[LocalCluster, str]] = []

    def detach(self, cluster: LocalCluster, *args: str, inventory: Path | None = None) -> tuple[str, float]:
        argv = [sys.executable, "-m", "torchherd", "-i", str(inventory or cluster.inventory), "run", "--detach",
                "--no-check", "--nproc-per-node", "1", *args]
        started = time.monotonic()
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                              env=self.env(cluster))
        seconds = time.monotonic() - started
        run_id = self.started_id(cluster, done.stdout)
        assert done.returncode == 0 and run_id, done.stdout + done.stderr
        return run_id, seconds

    def env(self, cluster: LocalCluster) -> dict[str, str]:
        return {**cluster.env(), "XDG_STATE_HOME": str(self.state_home), "COLUMNS": "200"}

    def started_id(self, cluster: LocalCluster, stdout: str) -> str | None:
        """The run id ``run --detach`` printed (None: none, or several); kept for the cleanup."""
        ids = re.findall(r"^(th-\S+)$", stdout, re.M)
        if ids:
            self.started.append((cluster, ids[0]))
        return ids[0] if len(ids) == 1 else None

    def cleanup(self) -> None:
        for cluster, run_id in self.started:
            try:
                attach(run_id).stop()
            finally:
                for name in cluster.names:
                    cluster.ssh(name, f"rm -rf {remote_run_dir(run_id)}")
