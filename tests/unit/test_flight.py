"""torch's flight recorder in a hung job: the hook each rank runs (its private files, the
sitecustomize it hides run after it), the probe's summary of real records, and the line
naming the collective the others wait in and the rank that never issued it."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from torchherd.engine.watch.hang import Issued, flight_described, flight_issued
from torchherd.remote import flight

DATA = Path(__file__).parent / "data" / "flight"


def records() -> dict[tuple[str, int], dict[str, object]]:
    """The real records of rank 0, 1 and 2 (on node0, node1, node2) as the probe sends them."""
    return {(f"node{rank}", rank): flight._summary(json.loads((DATA / f"gloo-2.13-rank{rank}.json").read_text()))
            for rank in range(3)}


def test_real_records_name_the_rank_behind() -> None:
    issued = flight_issued(records())
    assert [(one.rank, one.seq, one.name) for one in issued] == [(0, 6, "gloo:all_reduce"), (1, 5, "gloo:all_reduce"),
                                                                 (2, 6, "gloo:all_reduce")]
    assert flight_described(issued) == ("flight recorder: ranks 0, 2 wait in collective 6 (gloo:all_reduce); rank 1 "
                                        "on node1 never issued it (its last: 5)", "node1")


def test_the_probe_keeps_the_last_entries_of_each_group() -> None:
    summary = records()[("node0", 0)]
    entries = summary["groups"]["default_pg"]  # type: ignore[index]
    assert len(entries) == flight.KEPT and entries[-1] == {  # type: ignore[index]
        "seq": 6, "p2p_seq": 0, "p2p": False, "name": "gloo:all_reduce", "state": "scheduled", "retired": False,
        "sizes": "[[4]]"}


@pytest.mark.parametrize(("issued", "text", "culprit"), [
    ([Issued("a", 0, 9, "nccl:all_gather"), Issued("a", 1, 9, "nccl:all_gather")],
     "flight recorder: every rank issued collective 9 (nccl:all_gather), the last", None),
    ([Issued("a", 0, 9, "nccl:all_reduce"), Issued("b", 1, 7, "x"), Issued("c", 2, 8, "x"), Issued("a", 3, 9, "x")],
     "flight recorder: ranks 0, 3 wait in collective 9 (nccl:all_reduce); ranks 1-2 never issued it (their last: "
     "7, 8)", None),
    ([], "", None),
])
def test_what_the_records_say(issued: list[Issued], text: str, culprit: str | None) -> None:
    assert flight_described(issued) == (text, culprit)


def test_a_record_that_is_an_error_or_garbage_says_nothing_wrong() -> None:
    assert flight._summary({"error": "this torch has no flight recorder"}) == {"error": "this torch has no flight recorder"}
    assert flight._summary([1, 2]) == {"error": "not a JSON object"}
    assert flight_issued({("n", 0): {"error": "x"}, ("n", 1): {"groups": {"default_pg": [{"seq": True}]}}}) == [
        Issued("n", 1, 0, "none")]


def test_install_writes_a_private_hook_and_keeps_the_job_s_pythonpath(tmp_path: Path) -> None:
    added = flight.install(str(tmp_path), {"PYTHONPATH": "/job/lib", "TORCH_FR_BUFFER_SIZE": "50"})
    directory = tmp_path / flight.DIR_NAME
    assert added == {"PYTHONPATH": f"{directory}{os.pathsep}/job/lib", flight.DIR_ENV: str(directory)}
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE((directory / "sitecustomize.py").stat().st_mode) == 0o600
    with pytest.raises(FileExistsError):  # never into a directory someone made first
        flight.install(str(tmp_path), {})


def test_the_hook_runs_the_sitecustomize_it_hides_and_answers_the_probe(tmp_path: Path) -> None:
    """A real interpreter with the hook first on its path: the job's own sitecustomize
    still runs; the probe's ask is answered with the process's record (here: no process
    group, so no record: a helper process of a rank writes nothing)."""
    added = flight.install(str(tmp_path), {})
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['CHAINED'] = 'yes'\n")
    env = dict(os.environ, **added, LOCAL_RANK="0", RANK="0")
    env["PYTHONPATH"] = added["PYTHONPATH"] + os.pathsep + str(other)
    program = ("import os, sys, threading, time\n"
               "print(os.environ.get('CHAINED'), sys.modules['sitecustomize'].__file__, "
               "[t.name for t in threading.enumerate()], flush=True)\n"
               "time.sleep(3)\n")
    child = subprocess.Popen([sys.executable, "-c", program], env=env, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    line = child.stdout.readline().split()
    assert line[0] == "yes" and line[1] == str(other / "sitecustomize.py") and "'torchherd-fr']" in line[-1]
    found = flight.collect({child.pid: added[flight.DIR_ENV]}, {child.pid: 0}, 1.0)
    child.wait(10)
    assert found == {}  # asked and waited: no torch, no process group, no record


def test_collect_refuses_a_directory_that_is_not_the_hooks_own(tmp_path: Path) -> None:
    planted = tmp_path / flight.DIR_NAME
    planted.mkdir(mode=0o755)
    os.chmod(planted, 0o755)
    (planted / "fr-0-1.json").write_text('{"entries": []}')
    started = time.monotonic()
    assert flight.collect({1: str(planted)}, {1: 0}, 2.0) == {}
    assert time.monotonic() - started < 1.0 and not (planted / "dump").exists()


def test_collect_reads_a_record_written_while_it_waits(tmp_path: Path) -> None:
    flight.install(str(tmp_path), {})
    directory = tmp_path / flight.DIR_NAME
    record = (DATA / "gloo-2.13-rank1.json").read_bytes()

    def write_when_asked() -> None:
        while not (directory / flight.TRIGGER).exists():
            time.sleep(0.05)
        (directory / "fr-1-4242.json").write_bytes(record)

    threading.Thread(target=write_when_asked, daemon=True).start()
    found = flight.collect({4242: str(directory)}, {4242: 1}, 3.0)
    assert list(found) == ["1"] and found["1"]["groups"]["default_pg"][-1]["seq"] == 5


def hooked(tmp_path: Path, program: str, torch_version: str | None, **env: str) -> subprocess.CompletedProcess[str]:
    """``program`` in a real interpreter with the hook installed as the supervisor does; with
    ``torch_version``, a stand-in torch package of that version first on the path."""
    (tmp_path / "base").mkdir()
    added = flight.install(str(tmp_path / "base"), env)
    path = [added["PYTHONPATH"]]
    if torch_version is not None:
        (tmp_path / "lib" / "torch").mkdir(parents=True)
        (tmp_path / "lib" / "torch" / "__init__.py").write_text("")
        (tmp_path / "lib" / "torch" / "version.py").write_text(f"__version__ = '{torch_version}'\ncuda = None\n")
        path.append(str(tmp_path / "lib"))
    clean = {key: value for key, value in os.environ.items() if key not in flight.NAMES}
    return subprocess.run([sys.executable, "-c", program], env={**clean, **added, **env, "PYTHONPATH": os.pathsep.join(path)},
                          capture_output=True, text=True, timeout=120)


NAMES_SET = "import os; print(sorted((name, os.environ[name]) for name in os.environ if 'BUFFER_SIZE' in name))"


@pytest.mark.parametrize(("version", "expected"), [
    ("2.13.0+cpu", [("TORCH_FR_BUFFER_SIZE", flight.BUFFER)]),
    ("2.8.0a0+git1234", [("TORCH_FR_BUFFER_SIZE", flight.BUFFER)]),
    ("2.7.1+cu126", [("TORCH_NCCL_TRACE_BUFFER_SIZE", flight.BUFFER)]),
    ("1.13.1", [("TORCH_NCCL_TRACE_BUFFER_SIZE", flight.BUFFER)]),
    ("garbage", [("TORCH_FR_BUFFER_SIZE", flight.BUFFER)]),
])
def test_the_hook_sets_the_one_buffer_variable_the_rank_s_torch_reads(tmp_path: Path, version: str,
                                                                      expected: list[tuple[str, str]]) -> None:
    done = hooked(tmp_path, NAMES_SET, version)
    assert (done.returncode, done.stdout) == (0, f"{expected}\n"), done.stderr


def test_the_job_s_own_buffer_size_is_kept_under_its_own_name(tmp_path: Path) -> None:
    done = hooked(tmp_path, NAMES_SET, "2.13.0", TORCH_NCCL_TRACE_BUFFER_SIZE="50")
    assert done.stdout == "[('TORCH_NCCL_TRACE_BUFFER_SIZE', '50')]\n", done.stderr


def test_the_installed_torch_records_collectives_without_a_deprecation_warning(tmp_path: Path) -> None:
    """The installed torch (2.13 here) under the hook: one gloo all_reduce lands in its flight
    recorder, and no rank says the buffer's variable is deprecated."""
    torch = pytest.importorskip("torch")
    program = ("import json, torch, torch.distributed as dist\n"
               f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1)\n"
               "dist.all_reduce(torch.ones(4))\n"
               "from torch._C._distributed_c10d import _dump_fr_trace_json\n"
               "entries = json.loads(_dump_fr_trace_json()).get('entries', [])\n"
               "print([entry['profiling_name'] for entry in entries])\n"
               "dist.destroy_process_group()\n")
    done = hooked(tmp_path, program, None, LOCAL_RANK="0", RANK="0")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "['gloo:all_reduce']\n", (torch.__version__, done.stderr)
    assert "deprecated" not in done.stderr
