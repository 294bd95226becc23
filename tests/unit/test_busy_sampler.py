"""The supervisor's busy samples, on real processes of this machine: a stand-in torchrun
whose two workers (torchrun's environment) are one busy and one asleep; a process that
is not a worker, or not in the job's tree, is never sampled. In a container the workers
may be outside the tree (docker's are its daemon's): found there by the run's token, for
the busy samples and to name the ranks' output files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from torchherd.remote import ranks, wire
from torchherd.remote.proctable import find_job_processes
from torchherd.runlog import OutputLine, OutputParser, RankLines, Status

LAUNCHER = """
import os, subprocess, sys, time
def worker(rank, code):
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), TORCHELASTIC_RESTART_COUNT="0")
    return subprocess.Popen([sys.executable, "-c", code], env=env)
busy = worker(0, "while True: pass")
asleep = worker(1, "import time; print('asleep', flush=True); time.sleep(60)")
helper = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # busy, but no worker
print(busy.pid, asleep.pid, helper.pid, flush=True)
time.sleep(60)
"""


def launched(launcher: subprocess.Popen[bytes]) -> list[int]:
    """The LAUNCHER's pids, once its sleeping worker is asleep. Its line and that worker's word
    come in either order; the worker is asleep only once it has said so (its Python's start is
    busy, and took most of a second on a loaded CI run)."""
    assert launcher.stdout is not None
    lines = [launcher.stdout.readline().split() for _ in range(2)]
    assert [b"asleep"] in lines, lines
    return [int(word) for line in lines if line != [b"asleep"] for word in line]


@pytest.fixture
def job() -> Iterator[tuple[int, list[int]]]:
    """(the launcher's pid, its workers' and helper's pids)."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, start_new_session=True)
    try:
        yield launcher.pid, launched(launcher)
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


def busy_records(sampler: ranks.BusySampler, seconds: float) -> list[Status]:
    """The records of ``seconds`` of polls every 20 ms, the sampler told the times: each look
    at the processes is real, but how many samples and records fall due does not depend on
    the CPU this test gets (CI run 65: starved beside the serial tests, one record of two came)."""
    records = b""
    start = time.monotonic()
    for step in range(round(seconds / 0.02)):
        records += sampler.poll(start + step * 0.02)
        time.sleep(0.005)  # the processes' states change between looks, as they do between a supervisor's
    return [chunk for chunk in OutputParser("node0").feed(records) if isinstance(chunk, Status)]


def test_one_busy_and_one_sleeping_worker_are_busy_half_of_the_samples(job: tuple[int, list[int]]) -> None:
    root, _pids = job
    statuses = busy_records(ranks.BusySampler(root, 1.0), 3.2)
    assert [status.event for status in statuses] == ["busy"] * 3
    samples = sum(int(status.fields["samples"]) for status in statuses)  # type: ignore[call-overload]
    busy = sum(int(status.fields["busy"]) for status in statuses)  # type: ignore[call-overload]
    # two workers at five looks a second for about three seconds; the helper is no worker
    assert 2 * 13 <= samples <= 2 * 17 and samples % 2 == 0
    assert busy == pytest.approx(samples / 2, abs=2)


def test_a_stopped_worker_is_busy_not_waiting(job: tuple[int, list[int]]) -> None:
    """cpulimit-style throttling (SIGSTOP): the node is slow, not waiting for its peers."""
    root, (_busy, asleep, _helper) = job
    os.kill(asleep, signal.SIGSTOP)
    try:
        statuses = busy_records(ranks.BusySampler(root, 1.0), 1.1)
    finally:
        os.kill(asleep, signal.SIGCONT)
    assert statuses and all(status.fields["busy"] == status.fields["samples"] for status in statuses)


def test_no_workers_or_no_interval_no_records() -> None:
    assert busy_records(ranks.BusySampler(os.getpid(), 0.2), 0.5) == []
    assert ranks.BusySampler(os.getpid(), 0.0).poll(time.monotonic()) == b""


def test_the_tree_from_children_files_is_the_process_tables(job: tuple[int, list[int]]) -> None:
    from torchherd.remote.proctable import descendants, read_proc_table

    root, pids = job
    assert sorted(ranks.tree_of(root)) == sorted(descendants(read_proc_table(), root)) == sorted(pids)
    assert ranks.tree_of(2**22 + 1) == []  # no such process


@pytest.fixture
def daemons_job() -> Iterator[tuple[int, list[int]]]:
    """(a client's pid, the workers' pids): the workers, with the run's id and token in
    their environment, are children of another process, as a docker container's ranks are
    the daemon's shim's and never the client's (the supervisor's child)."""
    env = dict(os.environ, **{wire.RUN_ID_ENV: "r1", wire.SUPERVISOR_ENV: "token1"})
    shim = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, start_new_session=True, env=env)
    client = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield client.pid, launched(shim)[:2]
    finally:
        os.killpg(shim.pid, signal.SIGKILL)
        client.kill()
        shim.wait()
        client.wait()


def test_workers_outside_the_tree_are_found_by_the_runs_token(daemons_job: tuple[int, list[int]]) -> None:
    client, (busy, asleep) = daemons_job
    assert ranks.job_workers(client) == {}  # the tree alone: blind
    assert ranks.job_workers(client, lambda: find_job_processes("r1", "token2", client)) == {}  # another's
    mine = lambda: find_job_processes("r1", "token1", client)  # noqa: E731
    assert ranks.job_workers(client, mine) == {busy: (0, 0, 0), asleep: (0, 1, 1)}
    assert busy_records(ranks.BusySampler(client, 1.0), 1.1) == []
    statuses = busy_records(ranks.BusySampler(client, 1.0, mine), 2.5)
    samples = sum(int(status.fields["samples"]) for status in statuses)  # type: ignore[call-overload]
    busy_count = sum(int(status.fields["busy"]) for status in statuses)  # type: ignore[call-overload]
    assert len(statuses) == 2 and 2 * 7 <= samples <= 2 * 12 and busy_count == pytest.approx(samples / 2, abs=2)


def test_a_rank_file_is_named_by_a_worker_outside_the_tree(daemons_job: tuple[int, list[int]],
                                                           tmp_path: Path) -> None:
    client, _workers = daemons_job
    folder = tmp_path / "none_x1y2" / "attempt_0" / "1"
    folder.mkdir(parents=True)
    (folder / "stdout.log").write_text("hello\n")
    blind = ranks.RankFiles(str(tmp_path), client, False)
    assert blind.poll(time.monotonic()) == b""  # the line waits for its rank
    seeing = ranks.RankFiles(str(tmp_path), client, False, None, lambda: find_job_processes("r1", "token1", client))
    chunks = OutputParser("node0").feed(seeing.poll(time.monotonic()))
    lines = [line for chunk in chunks if isinstance(chunk, RankLines) for line in chunk.lines()]
    assert [(line.rank, line.text) for line in lines if isinstance(line, OutputLine)] == [(1, "hello")]
