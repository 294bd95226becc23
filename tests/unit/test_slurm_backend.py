"""The SLURM backend (engine.slurm) against a stand-in SLURM: shell scripts named sbatch, squeue, scontrol,
sacct and scancel on PATH, answering from files the test writes. The engine's own
commands (the submit, the poll of the run directory) run for real in sh, on this
machine, as they would on a login host; the test plays the nodes by writing their
output files. No root, no SLURM."""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from torchherd.api import Cluster, DetachedRun
from torchherd.engine.events import Collector, JobQueued, NodeExited, NodeStatus, Output, RunStarted
from torchherd.engine.run import Run
from torchherd.engine.slurm.commands import frontend
from torchherd.errors import UsageError
from torchherd.runlog import RankLines
from torchherd.transport.local import LocalConnector

FAKES = {
    "sbatch": 'if [ "$1" = --test-only ]; then cat > /dev/null; echo "sbatch: Job 9 to start now" >&2; exit 0; fi\n'
              'cp "$2" "$FAKE_SLURM/submitted"; echo 42',
    "squeue": 'cat "$FAKE_SLURM/state"',
    "scontrol": 'case "$2" in hostnames) cat "$FAKE_SLURM/hostnames" ;; job) cat "$FAKE_SLURM/final" ;; esac',
    "sacct": 'echo "Slurm accounting storage is disabled" >&2; exit 1',
    "scancel": 'echo "$@" >> "$FAKE_SLURM/scancel.log"; sed -i "s/|RUNNING|/|CANCELLED|/" "$FAKE_SLURM/state"',
    "sinfo": 'printf "n0|main*|up|idle|2|(null)|none\\nn1|main*|up|idle|2|(null)|none\\n"',
    "salloc": 'echo "$@" > "$FAKE_SLURM/salloc"; echo "42|RUNNING|2|n[0-1]|None" > "$FAKE_SLURM/state"; '
              'echo "salloc: Granted job allocation 42" >&2',
    # A step runs here, as the node would run it; which node is in the log.
    "srun": 'echo "$@" >> "$FAKE_SLURM/srun.log"; while [ "$1" != bash ]; do shift; done; exec "$@"',
}


class FakeSlurm:
    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dir = root / "slurm"
        self.bin = root / "bin"
        self.home = root / "home"
        for path in (self.dir, self.bin, self.home):
            path.mkdir()
        for name, body in FAKES.items():
            script = self.bin / name
            script.write_text("#!/bin/sh\n" + body + "\n")
            script.chmod(script.stat().st_mode | stat.S_IEXEC)
        monkeypatch.setenv("PATH", f"{self.bin}:{os.environ['PATH']}")
        monkeypatch.setenv("HOME", str(self.home))
        monkeypatch.setenv("FAKE_SLURM", str(self.dir))
        monkeypatch.setenv("XDG_STATE_HOME", str(root / "state"))
        self.queue("PENDING", "(null)", "Resources")
        (self.dir / "hostnames").write_text("n0\nn1\n")
        (self.dir / "final").write_text("")

    def queue(self, state: str, nodelist: str = "n[0-1]", reason: str = "None") -> None:
        (self.dir / "state").write_text(f"42|{state}|2|{nodelist}|{reason}\n")

    def final(self, state: str, code: str = "0:0") -> None:
        (self.dir / "final").write_text(f"JobId=42 JobName=x JobState={state} Reason=None ExitCode={code} "
                                        "NodeList=n[0-1]\n")

    def node(self, run_id: str, name: str, text: str) -> None:
        path = self.home / ".torchherd" / "runs" / run_id / name
        with path.open("a") as file:
            file.write(text)


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeSlurm:
    return FakeSlurm(tmp_path, monkeypatch)


def cluster() -> Cluster:
    return Cluster(["n0", "n1"], scheduler="slurm", python="python3", connector=LocalConnector())


def until(condition: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def launched(fake: FakeSlurm, tmp_path: Path, collector: Collector) -> Run:
    made = cluster()
    plan = made.plan("train.py", run_id="th-fake", nproc_per_node=1)
    run = made.launch(plan, log_dir=tmp_path / "logs", on_event=collector, check=False)
    assert isinstance(run, Run)
    return run


def test_a_crash_on_one_node_is_named_and_the_other_is_torn_down(fake: FakeSlurm, tmp_path: Path) -> None:
    collector = Collector()
    run = launched(fake, tmp_path, collector)
    script = (fake.dir / "submitted").read_text()
    assert "#SBATCH --nodelist=n0,n1" in script
    until(lambda: any(isinstance(event, JobQueued) and event.reason == "Resources" for event in collector.events))
    fake.queue("RUNNING")
    until(lambda: collector.of(RunStarted))
    fake.node("th-fake", "n0.out", "[torchherd-rank 0] hello\n[torchherd-rank 0] still here\n")
    fake.node("th-fake", "n1.err", "[torchherd-rank 1] RuntimeError: boom\n")
    fake.node("th-fake", "n1.exit", "job 1 100.5\n")
    fake.node("th-fake", "batch.out", "srun: error: n1: task 1: Exited with exit code 1\n")
    fake.final("FAILED", "1:0")
    fake.queue("FAILED")
    summary = run.wait(timeout=60)
    assert summary.exit_code == 1
    assert summary.headline == "n1 rank 1 failed first with exit code 1: rank 1: RuntimeError: boom"
    assert [(node.node, node.state) for node in summary.nodes] == [("n0", "torn down"), ("n1", "failed")]
    started = collector.of(RunStarted)[0]
    assert isinstance(started, RunStarted) and started.nodes == ("n0", "n1") and started.master_addr == "n0"
    assert any(isinstance(event, NodeExited) and (event.node, event.code) == ("n1", 1) for event in collector.events)
    lines = [line for lines in collector.lines.values() for line in lines]
    assert ("n0", 0, "hello") in [(line.node, line.rank, line.text) for line in lines]
    assert ("slurm", None, "srun: error: n1: task 1: Exited with exit code 1") in [
        (line.node, line.rank, line.text) for line in lines]
    log = (tmp_path / "logs" / "th-fake" / "n0.log").read_text()
    assert log == "[rank 0] hello\n[rank 0] still here\n"
    assert stat.S_IMODE((tmp_path / "logs" / "th-fake" / "n0.log").stat().st_mode) == 0o600


def test_every_node_exiting_zero_is_a_clean_run(fake: FakeSlurm, tmp_path: Path) -> None:
    collector = Collector()
    fake.queue("RUNNING")
    run = launched(fake, tmp_path, collector)
    until(lambda: collector.of(RunStarted))
    for rank, node in enumerate(("n0", "n1")):
        fake.node("th-fake", f"{node}.out", f"[torchherd-rank {rank}] done\n")
        fake.node("th-fake", f"{node}.exit", f"job 0 10{rank}.0\n")
    fake.final("COMPLETED")
    fake.queue("COMPLETED")
    summary = run.wait(timeout=60)
    assert summary.exit_code == 0 and summary.headline.startswith("all 2 nodes finished (exit 0)")


def test_stop_cancels_the_job_and_waits_until_it_left_the_queue(fake: FakeSlurm, tmp_path: Path) -> None:
    collector = Collector()
    fake.queue("RUNNING")
    run = launched(fake, tmp_path, collector)
    until(lambda: collector.of(RunStarted))
    run.stop()
    summary = run.wait(timeout=60)
    assert (fake.dir / "scancel.log").read_text() == "42\n"
    assert summary.exit_code == 130
    assert summary.headline == "interrupted: SLURM job 42 was cancelled, and it has left the queue"
    assert [node.state for node in summary.nodes] == ["interrupted", "interrupted"]


def test_a_job_cancelled_while_it_waits_has_no_nodes(fake: FakeSlurm, tmp_path: Path) -> None:
    collector = Collector()
    run = launched(fake, tmp_path, collector)
    until(lambda: collector.of(JobQueued))
    fake.queue("CANCELLED", "(null)")
    summary = run.wait(timeout=60)
    assert summary.exit_code == 1 and summary.nodes == ()
    assert summary.headline.startswith("SLURM job 42 ended before it started: CANCELLED")


def test_a_detached_job_is_followed_stopped_and_described(fake: FakeSlurm, tmp_path: Path) -> None:
    made = cluster()
    detached = made.launch(made.plan("train.py", run_id="th-det", nproc_per_node=1), detach=True, check=False)
    assert isinstance(detached, DetachedRun)
    assert detached.record.extra["scheduler"] == "slurm" and detached.record.extra["job_id"] == "42"
    assert [state.state for state in detached.status()] == ["pending"]
    fake.queue("RUNNING")
    fake.node("th-det", "n0.out", "[torchherd-rank 0] tick\n")
    fake.node("th-det", "n0.exit", "job 0 5.0\n")
    assert [(state.node, state.state, state.code) for state in detached.status()] == [
        ("n0", "exited", 0), ("n1", "running", None)]
    seen: list[object] = []
    codes = detached.follow(seen.append, follow=False)
    assert codes == {"n0": 0}
    texts = [line.text for event in seen if isinstance(event, Output) for chunk in event.lines
             for line in (chunk.lines() if isinstance(chunk, RankLines) else [chunk])]
    assert texts == ["tick"] and any(isinstance(event, NodeStatus) for event in seen)
    assert detached.stop() == {"SLURM job 42": []}
    assert (fake.dir / "scancel.log").read_text() == "42\n"


def test_following_lines_yields_each_as_it_arrives(fake: FakeSlurm, tmp_path: Path) -> None:
    made = cluster()
    detached = made.launch(made.plan("train.py", run_id="th-lines", nproc_per_node=1), detach=True, check=False)
    assert isinstance(detached, DetachedRun)
    fake.queue("RUNNING")
    fake.node("th-lines", "n0.out", "[torchherd-rank 0] first\n")
    lines = detached.lines(follow=True)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(next(lines).text), daemon=True)
    reader.start()
    reader.join(timeout=20)
    assert got == ["first"], "the first line must come while the job still runs"
    fake.node("th-lines", "n0.out", "[torchherd-rank 0] second\n")
    fake.queue("COMPLETED")
    assert [line.text for line in lines] == ["second"]


def test_no_sbatch_here_and_no_login_host_is_a_usage_error(fake: FakeSlurm, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(UsageError, match="sbatch is not on this machine's PATH"):
        frontend(cluster().inventory, LocalConnector())


def test_check_runs_the_node_checks_as_steps_of_an_allocation(fake: FakeSlurm, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    made = Cluster(["n0", "n1"], scheduler="slurm", python="python3", workdir=str(tmp_path),
                   connector=LocalConnector(), slurm={"partition": "main"})
    report = made.check(str(script), only=["slurm", "slurm-node", "sbatch", "script"])
    by = {(result.node, result.check): result.status for result in report.results}
    assert by == {("cluster", "slurm"): "pass", ("n0", "slurm-node"): "pass", ("n1", "slurm-node"): "pass",
                  ("cluster", "sbatch"): "pass", ("n0", "script"): "pass", ("n1", "script"): "pass"}, report
    assert "--no-shell" in (fake.dir / "salloc").read_text()
    steps = (fake.dir / "srun.log").read_text()
    assert "--jobid=42 --overlap" in steps and "--nodelist=n0" in steps and "--nodelist=n1" in steps
    assert (fake.dir / "scancel.log").read_text() == "42\n"  # the allocation, whatever happened


def test_check_without_node_checks_takes_no_allocation(fake: FakeSlurm) -> None:
    made = Cluster(["n0", "n1"], scheduler="slurm", python="python3", connector=LocalConnector())
    report = made.check("train.py", only=["slurm", "gres"])
    assert {result.check for result in report.results} == {"slurm", "gres"} and report.ok
    assert not (fake.dir / "salloc").exists()
    with pytest.raises(UsageError, match="unknown check id nope"):
        made.check("train.py", only=["nope"])
