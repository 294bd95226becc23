"""torchrun started warm by the node's supervisor (remote/zygote.py's ``start``, the
supervisor's ``warm_start``): the real torchrun and real torch on this machine, gloo on CPU."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from torchherd.remote import program
from torchherd.remote.ranks import job_workers, warm_client

JOB = textwrap.dedent("""\
    import os, signal, sys, time
    rank = os.environ["RANK"]
    def say(line):  # one write a line: print() writes the newline apart where stdout is
        os.write(1, (line + "\\n").encode())  # unbuffered, and the two ranks share the pipe
    if sys.argv[1] == "sleep":  # the handler before the line the test waits for
        signal.signal(signal.SIGTERM, lambda *_: (say(f"rank {rank} got SIGTERM"), sys.exit(7)))
    say(f"rank {rank} preloaded {'torch' in sys.modules} pid {os.getpid()}")
    if sys.argv[1] == "sleep":
        time.sleep(120)
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    total = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(total)
    say(f"rank {rank} sum {int(total.item())}")
    dist.destroy_process_group()
    sys.exit(int(sys.argv[1]) if rank == "1" else 0)
""")


@pytest.fixture
def job(tmp_path: Path) -> Path:
    path = tmp_path / "job.py"
    path.write_text(JOB)
    return path


def env_for(tmp_path: Path) -> dict[str, str]:
    """The private directory under the test's own TMPDIR, so that what is left there is seen."""
    temp = tmp_path / "tmp"
    temp.mkdir(exist_ok=True)
    return {**os.environ, "TMPDIR": str(temp)}


def torchrun(job: Path, *args: str) -> list[str]:
    return ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(job), *args]


def warm(job: Path, *args: str) -> list[str]:
    return [sys.executable, "-c", program("zygote.py"), "start", *torchrun(job, *args)]


def left_in(tmp_path: Path) -> list[str]:
    return sorted(path.name for path in (tmp_path / "tmp").glob("torchherd-warm-*"))


def ranks_of(output: str) -> dict[str, str]:
    return {words[1]: words[3] for words in (line.split() for line in output.splitlines())
            if words[:1] == ["rank"] and words[2:3] == ["preloaded"]}


@pytest.mark.timeout(120)
def test_a_warm_torchrun_imports_torch_once_and_its_ranks_fork_from_it(job: Path, tmp_path: Path) -> None:
    done = subprocess.run(warm(job, "0"), cwd=tmp_path, env=env_for(tmp_path), capture_output=True, text=True,
                          timeout=90)
    assert done.returncode == 0, done.stderr
    assert ranks_of(done.stdout) == {"0": "True", "1": "True"}, done.stdout
    assert "rank 0 sum 3" in done.stdout and "rank 1 sum 3" in done.stdout
    assert "started cold" not in done.stderr
    assert left_in(tmp_path) == []


@pytest.mark.timeout(180)
def test_a_failing_rank_ends_a_warm_torchrun_as_it_ends_a_cold_one(job: Path, tmp_path: Path) -> None:
    cold = subprocess.run([sys.executable, *torchrun(job, "3")], cwd=tmp_path, env=env_for(tmp_path),
                          capture_output=True, text=True, timeout=90)
    started = subprocess.run(warm(job, "3"), cwd=tmp_path, env=env_for(tmp_path), capture_output=True, text=True,
                             timeout=90)
    # What each torchrun printed, in every assertion's message: run 37 (a loaded machine) once
    # missed the cold run's second rank's first line, and said no more.
    said = f"cold:\n{cold.stdout}{cold.stderr[-3000:]}\nwarm:\n{started.stdout}{started.stderr[-3000:]}"
    assert cold.returncode == started.returncode == 1, said
    assert ranks_of(cold.stdout) == {"0": "False", "1": "False"}, said
    assert ranks_of(started.stdout) == {"0": "True", "1": "True"}, said
    assert "exitcode  : 3" in cold.stderr and "exitcode  : 3" in started.stderr, said
    assert left_in(tmp_path) == []


@pytest.fixture
def sleeping(job: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], list[int]]]:
    """A warm torchrun whose two ranks sleep, in a session of its own; its ranks' pids."""
    process = subprocess.Popen(warm(job, "sleep"), cwd=tmp_path, env=env_for(tmp_path), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert process.stdout is not None
    pids = [int(process.stdout.readline().split()[-1]) for _ in range(2)]
    try:
        yield process, pids
    finally:
        for pid in pids:
            _kill(pid)
        _kill(process.pid)
        process.wait(timeout=30)


@pytest.mark.timeout(120)
def test_the_rank_finders_see_each_forked_rank_once_and_not_its_client(
        sleeping: tuple[subprocess.Popen[str], list[int]]) -> None:
    """torchrun's children are the clients (they carry the ranks' variables and sleep); the
    ranks are the warm Python's: the busy sampler and the rank files count the ranks."""
    process, pids = sleeping
    found = job_workers(process.pid)
    assert sorted(found) == sorted(pids)
    assert sorted(rank for _restarts, rank, _local in found.values()) == [0, 1]
    clients = [pid for pid in _children(process.pid) if warm_client(pid)]
    assert len(clients) == 2
    assert not any(warm_client(pid) for pid in pids)


@pytest.mark.timeout(120)
def test_a_teardown_signal_to_the_agents_group_reaches_the_ranks_through_torchrun(
        sleeping: tuple[subprocess.Popen[str], list[int]], tmp_path: Path) -> None:
    process, pids = sleeping
    os.killpg(process.pid, signal.SIGTERM)
    out, _err = process.communicate(timeout=60)
    assert "rank 0 got SIGTERM" in out and "rank 1 got SIGTERM" in out
    assert process.returncode != 0
    assert all(_gone(pid) for pid in pids)
    assert left_in(tmp_path) == []


@pytest.mark.timeout(120)
def test_a_killed_agent_takes_its_ranks_and_its_warm_python_with_it(
        sleeping: tuple[subprocess.Popen[str], list[int]], tmp_path: Path) -> None:
    process, pids = sleeping
    warm_python = [pid for pid in _children(process.pid) if not warm_client(pid)]
    assert len(warm_python) == 1
    process.kill()
    process.wait(timeout=30)
    assert all(_gone(pid) for pid in [*pids, *warm_python])
    assert left_in(tmp_path) == []


@pytest.mark.timeout(60)
def test_what_cannot_start_warm_starts_cold_and_says_why(tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    script.write_text("import sys; print('hello', 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", program("zygote.py"), "start", str(script)], cwd=tmp_path,
                          env=env_for(tmp_path), capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout) == (0, "hello False\n")
    assert done.stderr == "torchherd: started cold (a script, not a module)\n"
    missing = subprocess.run([sys.executable, "-c", program("zygote.py"), "start", "-m", "no_such_module_here"],
                             cwd=tmp_path, env=env_for(tmp_path), capture_output=True, text=True, timeout=30)
    assert missing.returncode == 1
    assert missing.stderr.startswith("torchherd: started cold (ModuleNotFoundError: No module named "
                                     "'no_such_module_here')\n")
    assert "No module named no_such_module_here" in missing.stderr  # python's own word, as a cold start says it
    assert left_in(tmp_path) == []


SLOW_LEAVER = textwrap.dedent("""\
    # torchrun's agent whose exit barrier is slow between its last check-in and its wait (the
    # moment the rendezvous host's agent, told all have checked in, ends with its store).
    import runpy, sys, time
    from torch.distributed.elastic.utils import store
    checked_in = store._barrier_nonblocking
    store._barrier_nonblocking = lambda *args, **kwargs: (checked_in(*args, **kwargs), time.sleep(2))[0]
    sys.argv[0] = "torchrun"
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
""")


def two_agents(tmp_path: Path, host: list[str], backend: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """A 2-node torchrun on this machine, its rendezvous ``backend`` the static one (torchherd's
    default: ``--node-rank`` and ``--master-addr``) or c10d: ``host`` (the words before ``-m
    torch.distributed.run``) serves the rendezvous store and its rank ends first; the other
    agent checks in last and is slow to wait. The host's outcome and the other agent's stderr."""
    script = tmp_path / "ends.py"
    script.write_text("import os, time; time.sleep(3 if 'LAST_TO_END' in os.environ else 0)\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def args(rank: int) -> list[str]:
        if backend == "static":
            return ["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank), "--master-addr",
                    "127.0.0.1", "--master-port", str(port), str(script)]
        return ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-id", "barrier", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf",
                f"is_host={int(rank == 0)}", str(script)]

    other = subprocess.Popen([sys.executable, "-c", SLOW_LEAVER, *args(1)], cwd=tmp_path,
                             env={**env_for(tmp_path), "LAST_TO_END": "1"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        first = subprocess.run([*host, "-m", "torch.distributed.run", *args(0)], cwd=tmp_path,
                               env=env_for(tmp_path), capture_output=True, text=True, timeout=90)
        _out, err = other.communicate(timeout=60)
    finally:
        _kill(other.pid)
        other.wait()
    assert other.returncode == 0, err  # torchrun logs the barrier's error and ends well either way
    return first, err


BARRIER_ERROR = "Error waiting on exit barrier"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_the_rendezvous_hosts_warm_agent_keeps_its_store_up_until_the_other_agents_left(tmp_path: Path,
                                                                                          backend: str) -> None:
    """torch issue 69520: the host's cold agent ends once the last agent has checked in, and
    that agent's wait meets a closed store (the control, so the race is shown to be there);
    the warm one serves its store until the other agent has gone. Both rendezvous backends:
    each makes its store its own way."""
    cold_host, cold_err = two_agents(tmp_path, [sys.executable], backend)
    assert cold_host.returncode == 0, cold_host.stderr
    assert BARRIER_ERROR in cold_err and "Failed to recv" in cold_err
    warm_host, warm_err = two_agents(tmp_path, [sys.executable, "-c", program("zygote.py"), "start"], backend)
    assert warm_host.returncode == 0, warm_host.stderr
    assert "started cold" not in warm_host.stderr
    assert BARRIER_ERROR not in warm_err, warm_err
    assert left_in(tmp_path) == []


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as file:
        return [int(child) for child in file.read().split()]


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as file:
                if file.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False
