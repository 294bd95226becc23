"""The run's bookkeeping is written once for both backends: an SSH run and a SLURM run
that end the same way read the same in the summary, the node logs are private, never
followed through a symlink and appended to, and the highest rank is counted one way."""

from __future__ import annotations

import os
import stat
from dataclasses import replace
from io import StringIO
from pathlib import Path
from unittest import mock

import pytest

from torchherd.api import Cluster
from torchherd.console import make_console
from torchherd.console.run import render_summary
from torchherd.engine.bookkeeping import NodeLog, max_rank
from torchherd.engine.events import ignore
from torchherd.engine.run import LaunchOptions
from torchherd.engine.slurm.batch import batch_job
from torchherd.engine.slurm.commands import JobState, NodeExit
from torchherd.engine.slurm.job import SlurmJob
from torchherd.engine.slurm.settings import settings_of
from torchherd.engine.ssh.job import Job
from torchherd.remote.wire import StopLevel
from torchherd.runlog import STDERR, STDOUT, OutputLine, RunSummary
from torchherd.transport.local import LocalSession

STARTED = 1000.0


def _cluster() -> Cluster:
    return Cluster(["n0", "n1"], python="python3", nproc_per_node=2)


def _ssh_summary(tmp_path: Path, failed: bool) -> RunSummary:
    plan = _cluster().plan("train.py", run_id="th-same")
    job = Job(plan, {}, LaunchOptions(log_dir=tmp_path), ignore)
    job.started = STARTED
    n0, n1 = job.nodes["n0"], job.nodes["n1"]
    for node in (n0, n1):
        node.process = mock.Mock()
        node.started_at, node.ended_at = STARTED, STARTED + 4.0
        node.take(OutputLine(node.name, node.rank * 2, STDOUT, "step 1"))
    if failed:
        n1.take(OutputLine("n1", 3, STDERR, "RuntimeError: boom"))
        n1.exit_code = 1
        job.culprit = n1
        n0.stop_sent = StopLevel.TERM
    else:
        n0.exit_code = n1.exit_code = 0
    return _at(job.summary())


def _slurm_summary(tmp_path: Path, failed: bool) -> RunSummary:
    cluster = _cluster().using("slurm")
    plan = cluster.plan("train.py", run_id="th-same")
    job = SlurmJob(plan, batch_job(plan, settings_of(plan.inventory)), "42", LocalSession("localhost"),
                   LaunchOptions(log_dir=tmp_path), ignore, lambda: LocalSession("localhost"))
    job.started = STARTED
    job.allocated(("n0", "n1"))
    assert job.nodes is not None
    n0, n1 = job.nodes["n0"], job.nodes["n1"]
    for node in (n0, n1):
        node.started_at, node.ended_at = STARTED, STARTED + 4.0
        node.take(OutputLine(node.name, node.rank * 2, STDOUT, "step 1"))
    if failed:
        n1.take(OutputLine("n1", 3, STDERR, "RuntimeError: boom"))
        n1.exit, n1.exit_code = NodeExit("n1", "job", 1, 5.0), 1
        job.state = JobState("42", "FAILED", "", "n[0-1]", 1)
    else:
        for node in (n0, n1):
            node.exit, node.exit_code = NodeExit(node.name, "job", 0, 5.0), 0
        job.state = JobState("42", "COMPLETED", "", "n[0-1]", 0)
    return _at(job.summary())


def _at(summary: RunSummary) -> RunSummary:
    """The headline's seconds are the clock's: the same for both runs here."""
    if summary.exit_code != 0:
        return summary
    return replace(summary, headline=summary.headline.replace(summary.headline.rpartition(" in ")[2], "X s"))


def _rendered(summary: RunSummary) -> str:
    out = StringIO()
    render_summary(make_console(out, width=200), summary)
    return out.getvalue()


@pytest.mark.parametrize("failed", [True, False], ids=["a rank fails", "all exit 0"])
def test_ssh_and_slurm_summaries_of_the_same_outcome_read_the_same(tmp_path: Path, failed: bool) -> None:
    ssh, slurm_run = _ssh_summary(tmp_path, failed), _slurm_summary(tmp_path, failed)
    assert _rendered(ssh) == _rendered(slurm_run)
    assert ssh == replace(slurm_run, log_dir=ssh.log_dir)
    if failed:
        assert ssh.headline == "n1 rank 3 failed first with exit code 1: rank 3: RuntimeError: boom"
        assert [(node.node, node.state) for node in ssh.nodes] == [("n0", "torn down"), ("n1", "failed")]
    else:
        assert ssh.headline == "all 2 nodes finished (exit 0) in X s"


def test_a_node_log_is_private_appended_to_and_never_a_symlinks_target(tmp_path: Path) -> None:
    os.umask(0o022)
    path = tmp_path / "n0.log"
    for text in ("one", "two"):
        log = NodeLog(path)
        log.write([OutputLine("n0", 0, STDOUT, text), object()])
        log.close()
    assert path.read_text() == "[rank 0] one\n[rank 0] two\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    target = tmp_path / "elsewhere"
    target.write_text("kept\n")
    (tmp_path / "n1.log").symlink_to(target)
    with pytest.raises(OSError):
        NodeLog(tmp_path / "n1.log")
    assert target.read_text() == "kept\n"


def test_the_highest_rank_is_counted_one_way() -> None:
    plan = Cluster([{"name": "n0", "nproc_per_node": 2}, {"name": "n1", "nproc_per_node": 3}],
                   python="python3", rdzv_backend="c10d").plan("train.py")
    assert max_rank(plan) == 4  # 2 + 3 ranks: 0..4
    assert max_rank(plan, 2) == 4
    assert max_rank(plan, 4) == 11  # SLURM's four nodes, each as the largest
    assert max_rank(Cluster(["n0"], python="python3", nproc_per_node="gpu").plan("train.py")) == 99
