"""The supervisor's busy samples, on real processes of this machine: a stand-in torchrun
whose two workers (torchrun's environment) are one busy and one asleep; a process that
is not a worker, or not in the job's tree, is never sampled."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from torchherd.remote import ranks
from torchherd.runlog import OutputParser, Status

LAUNCHER = """
import os, subprocess, sys, time
def worker(rank, code):
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), TORCHELASTIC_RESTART_COUNT="0")
    return subprocess.Popen([sys.executable, "-c", code], env=env)
busy = worker(0, "while True: pass")
asleep = worker(1, "import time; time.sleep(60)")
helper = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # busy, but no worker
print(busy.pid, asleep.pid, helper.pid, flush=True)
time.sleep(60)
"""


@pytest.fixture
def job() -> Iterator[tuple[int, list[int]]]:
    """(the launcher's pid, its workers' and helper's pids)."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert launcher.stdout is not None
        pids = [int(word) for word in launcher.stdout.readline().split()]
        yield launcher.pid, pids
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


def busy_records(sampler: ranks.BusySampler, seconds: float) -> list[Status]:
    records = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        records += sampler.poll(time.monotonic())
        time.sleep(0.02)
    return [chunk for chunk in OutputParser("node0").feed(records) if isinstance(chunk, Status)]


def test_one_busy_and_one_sleeping_worker_are_busy_half_of_the_samples(job: tuple[int, list[int]]) -> None:
    root, _pids = job
    time.sleep(0.3)  # the sleeping worker past its start
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
    time.sleep(0.3)
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
