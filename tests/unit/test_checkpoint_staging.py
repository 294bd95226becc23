"""Checkpoint staging (``[recovery] checkpoint``, ``run --checkpoint``): the pure choices
(the newest copy, the nodes that lack it, the path refused), the console's note, and the
node program itself (``remote/checkpoint.py``) run as it runs on a node: ``find`` in a
real directory, and a real chain of ``relay`` programs over TCP on 127.0.0.1."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import pytest

from support.cli import assert_one_line, run_cli
from support.recovery import Collector, FakeBackend, ended, names, plan_of, recover
from support.staging import find, node_program, nodes_in, relay_chain
from torchherd.console.recovery import recovery_note
from torchherd.engine.events import AttemptStarted, CheckpointMissing, CheckpointStaged, SpareTaken
from torchherd.engine.prepare.staging import Copy, lacking, newest
from torchherd.engine.recovery.runner import RecoveringRun
from torchherd.engine.run import LaunchOptions
from torchherd.inventory import Recovery, checkpoint_problem
from torchherd.plan import Plan

HOSTS = '[[hosts]]\nname = "a"\naddress = "192.0.2.1"\n[[hosts]]\nname = "b"\naddress = "192.0.2.2"\n'


def copy(node: str, mtime: float, sha: str = "aa", path: str = "snapshot.pt") -> Copy:
    return Copy(node, path, "file", 10, mtime, sha)


# ------------------------------------------------------------------ the pure choices


def test_the_newest_copy_wins_and_the_first_of_equal_ones() -> None:
    assert newest([]) is None
    assert newest([copy("node0", 5.0), copy("node1", 9.0, "bb"), copy("node2", 7.0)]) == copy("node1", 9.0, "bb")
    assert newest([copy("node0", 5.0), copy("node1", 5.0)]) == copy("node0", 5.0)


def test_a_node_lacks_it_without_the_same_path_and_hash() -> None:
    best = copy("node0", 9.0, "aa")
    found = {"node0": best, "node1": copy("node1", 3.0, "old"), "node2": None,
             "node4": copy("node4", 9.0, "aa", path="other.pt"), "node5": copy("node5", 1.0, "aa")}
    assert lacking(best, found, ["node0", "node1", "node2", "node3", "node4", "node5"]) == (
        "node1", "node2", "node3", "node4")


@pytest.mark.parametrize("path", ["snapshot.pt", "checkpoints/step-*.pt", "ckpt/", "./snap.pt", "a/./b"])
def test_a_path_inside_the_workdir_is_taken(path: str) -> None:
    assert checkpoint_problem(path) is None


@pytest.mark.parametrize(("path", "why"), [
    ("/scratch/snapshot.pt", "is absolute"), ("~/snapshot.pt", "is absolute"), ("../snapshot.pt", "leaves the workdir"),
    ("ckpt/../../x", "leaves the workdir"), ("", "empty"), (".", "the workdir itself"), ("a\nb", "control character"),
])
def test_a_path_leaving_the_workdir_is_refused(path: str, why: str) -> None:
    problem = checkpoint_problem(path)
    assert problem is not None and why in problem


@pytest.mark.parametrize("value", ['"/abs/snap.pt"', '"../snap.pt"', "3"])
def test_a_bad_checkpoint_key_is_one_line_naming_it(tmp_path: Path, value: str) -> None:
    code, out = run_cli(tmp_path, f"[recovery]\ncheckpoint = {value}\n" + HOSTS, ["hosts"])
    assert_one_line(code, out, "[recovery].checkpoint")


@pytest.mark.parametrize("value", ["/abs/snap.pt", "../snap.pt", "ckpt/../../x"])
def test_a_bad_checkpoint_flag_is_one_line_naming_it(tmp_path: Path, value: str) -> None:
    code, out = run_cli(tmp_path, HOSTS, ["run", "--retries", "1", f"--checkpoint={value}", "--dry-run", "--", "t.py"])
    assert_one_line(code, out, "--checkpoint")


def test_the_flag_without_retries_is_refused_before_any_node_is_reached(tmp_path: Path) -> None:
    code, out = run_cli(tmp_path, HOSTS, ["run", "--checkpoint", "snapshot.pt", "--", "t.py"])
    assert_one_line(code, out, "--checkpoint: it is staged before a new attempt, and without retries there is none")


def test_the_key_and_the_flag_reach_the_recovery(tmp_path: Path) -> None:
    import argparse

    from torchherd.api import Cluster
    from torchherd.cli.run import _recovery

    path = tmp_path / "hosts.toml"
    path.write_text('[recovery]\ncheckpoint = "ckpt/step-*.pt"\n' + HOSTS, encoding="utf-8")
    cluster = Cluster.from_toml(path)
    assert cluster.recovery.checkpoint == "ckpt/step-*.pt"
    flags = dict(retries=None, final_exit_codes=None, min_nodes=None, hang_timeout=None, replicate=None,
                 replicate_bandwidth=None, resume_args=None, warm=None, detach=False)
    assert _recovery(argparse.Namespace(**flags, checkpoint=None), cluster).checkpoint == "ckpt/step-*.pt"
    flags["retries"] = 1
    assert _recovery(argparse.Namespace(**flags, checkpoint="snap.pt"), cluster).checkpoint == "snap.pt"


# ------------------------------------------------------------------ the controller's side, on this machine


def test_staging_copies_the_newest_to_the_nodes_that_lack_it_only(tmp_path: Path) -> None:
    from torchherd.engine.prepare.staging import stage
    from torchherd.transport.local import LocalConnector

    nodes = nodes_in(tmp_path, 5)
    newest_data, older = os.urandom(200_000), b"older"
    for name, data, mtime in (("n0", newest_data, 2000), ("n1", older, 1000), ("n2", newest_data, 2000)):
        (tmp_path / name / "ckpt").mkdir()
        (tmp_path / name / "ckpt" / "step-20.pt").write_bytes(data)
        os.utime(tmp_path / name / "ckpt" / "step-20.pt", (mtime, mtime))
    untouched = (tmp_path / "n2" / "ckpt" / "step-20.pt").stat().st_ino
    event = stage(LocalConnector(unreachable=frozenset({"n4"})), nodes, ["n1", "n0"], ["n0", "n1", "n3", "n2", "n4"],
                  "ckpt/step-*.pt", 2)
    assert isinstance(event, CheckpointStaged), event
    assert (event.attempt, event.path, event.size, event.source, event.nodes) == (
        2, "ckpt/step-20.pt", 200_000, "n0", ("n1", "n3"))
    assert [node for node, _ in event.failed] == ["n4"] and "not reached" in event.failed[0][1]
    for name in ("n1", "n3"):
        assert (tmp_path / name / "ckpt" / "step-20.pt").read_bytes() == newest_data
    assert (tmp_path / "n2" / "ckpt" / "step-20.pt").stat().st_ino == untouched  # had it: left alone


def test_staging_says_where_it_looked_when_no_node_has_it(tmp_path: Path) -> None:
    from torchherd.engine.prepare.staging import stage
    from torchherd.transport.local import LocalConnector

    nodes = nodes_in(tmp_path, 3)
    (tmp_path / "n2" / "snapshot.pt").write_bytes(b"on the spare only: not a source")
    event = stage(LocalConnector(), nodes, ["n0", "n1"], ["n0", "n1", "n2"], "snapshot.pt", 3)
    assert event == CheckpointMissing(3, "snapshot.pt found on none of n0, n1")


# ------------------------------------------------------------------ the recovery asks for it


@dataclass
class StagingBackend(FakeBackend):
    """The recovery tests' backend, whose staging is recorded and answers ``answer``."""

    staged: list[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], str, int]] = field(default_factory=list)
    answer: str = "staged"

    staging: threading.Event = field(default_factory=threading.Event)

    def stage_checkpoint(self, plan: Plan, sources: Sequence[str], receivers: Sequence[str], path: str,
                         attempt: int, stopping: Callable[[], bool] = lambda: False,
                         ) -> CheckpointStaged | CheckpointMissing:
        self.staged.append((names(plan), tuple(sources), tuple(receivers), path, attempt))
        self.staging.set()
        if self.answer == "wait":  # a long copy, given up on Ctrl-C
            while not stopping():
                time.sleep(0.01)
            return CheckpointMissing(attempt, "given up")
        if self.answer == "missing":
            return CheckpointMissing(attempt, f"{path} found on none of {', '.join(sources)}")
        return CheckpointStaged(attempt, path, 2000, sources[0], ("node3",), 0.5)


def test_before_the_next_attempt_the_checkpoint_goes_from_the_nodes_left_to_the_next_ones() -> None:
    backend = StagingBackend([lambda plan: ended(plan, "node2", "lost", "node2 vanished"),
                              lambda plan: ended(plan, None)], bad={"node2": "timed out"})
    summary, events = recover(backend, plan_of("node3", 4), Recovery(retries=1, checkpoint="snapshot.pt"))
    assert summary.exit_code == 0
    # node2 was lost and the triage could not reach it: never asked; the spare node3 is a receiver.
    assert backend.staged == [(("node0", "node1", "node3"), ("node0", "node1"), ("node0", "node1", "node3"),
                               "snapshot.pt", 2)]
    kinds = [type(event).__name__ for event in events.events
             if isinstance(event, (CheckpointStaged, SpareTaken, AttemptStarted))]
    assert kinds == ["AttemptStarted", "SpareTaken", "CheckpointStaged", "AttemptStarted"]
    assert summary.attempts[0].next == ("attempt 2 on node0,node1,node3; node3 for node2; checkpoint snapshot.pt "
                                        "from node0 to node3")


def test_a_checkpoint_found_nowhere_is_a_note_and_the_attempt_starts() -> None:
    backend = StagingBackend([lambda plan: ended(plan, "node1"), lambda plan: ended(plan, None)], answer="missing")
    summary, events = recover(backend, plan_of(), Recovery(retries=1, checkpoint="snapshot.pt"))
    assert summary.exit_code == 0 and len(backend.launched) == 2
    assert [event.message for event in events.of(CheckpointMissing)] == [
        "snapshot.pt found on none of node0, node1, node2"]
    assert summary.attempts[0].next.endswith("; no checkpoint: snapshot.pt found on none of node0, node1, node2")


def test_ctrl_c_during_the_staging_starts_no_further_attempt() -> None:
    backend = StagingBackend([lambda plan: ended(plan, "node1"), lambda plan: ended(plan, None)], answer="wait")
    run = RecoveringRun(backend, plan_of(), LaunchOptions(check=False, log_dir=Path("/nonexistent")),
                        Recovery(retries=1, checkpoint="snapshot.pt"), Collector()).start()
    assert backend.staging.wait(timeout=20)
    run.stop()
    summary = run.wait(timeout=20)
    assert summary.exit_code == 130 and len(backend.launched) == 1
    assert [record.next for record in summary.attempts] == ["interrupted"]


def test_without_a_checkpoint_nothing_is_staged() -> None:
    backend = StagingBackend([lambda plan: ended(plan, "node1"), lambda plan: ended(plan, None)])
    summary, _ = recover(backend, plan_of(), Recovery(retries=1))
    assert summary.exit_code == 0 and backend.staged == []


# ------------------------------------------------------------------ the console


def test_the_notes_say_what_went_where() -> None:
    staged = CheckpointStaged(2, "snapshot.pt", 12_300_000, "node0", ("node2", "node3"), 0.44)
    assert recovery_note(staged)[0] == "checkpoint: snapshot.pt (12.3 MB, from node0) staged on node2, node3 in 0.4 s"
    had = CheckpointStaged(2, "snapshot.pt", 12_300_000, "node0", (), 0.1)
    assert recovery_note(had)[0] == "checkpoint: snapshot.pt (12.3 MB, from node0): every node of attempt 2 has it already"
    partly = CheckpointStaged(2, "snapshot.pt", 1000, "node0", ("node2",), 0.1, (("node3", "disk full"),))
    assert recovery_note(partly)[0] == ("checkpoint: snapshot.pt (1.0 kB, from node0) staged on node2, not on node3: "
                                        "disk full; attempt 2 starts anyway")
    missing = CheckpointMissing(2, "snapshot.pt found on none of node0, node1")
    assert recovery_note(missing)[0] == ("checkpoint: snapshot.pt found on none of node0, node1; attempt 2 starts "
                                         "without one")


# ------------------------------------------------------------------ the node program


def test_find_names_the_newest_match_with_its_hash(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    for step, mtime in ((10, 1000), (30, 3000), (20, 2000)):
        (tmp_path / "ckpt" / f"step-{step}.pt").write_bytes(b"x" * step)
        os.utime(tmp_path / "ckpt" / f"step-{step}.pt", (mtime, mtime))
    answer = find(tmp_path, "ckpt/step-*.pt")
    assert answer == {"path": "ckpt/step-30.pt", "kind": "file", "size": 30, "mtime": 3000.0,
                      "sha256": hashlib.sha256(b"x" * 30).hexdigest(), "files": 1}
    assert find(tmp_path, "nothing-*.pt") == {"path": None}
    assert "refused path '../escape.pt'" in str(find(tmp_path, "../escape.pt", code=1)["error"])


def test_a_file_is_relayed_down_a_chain_verified_private_and_in_place(tmp_path: Path) -> None:
    source, first, second = (tmp_path / name for name in ("node0", "node1", "node2"))
    for workdir in (source, first, second):
        workdir.mkdir()
    data = os.urandom(3_000_000)
    (source / "snapshot.pt").write_bytes(data)
    os.utime(source / "snapshot.pt", (1234.5, 1234.5))
    (second / "snapshot.pt").write_bytes(b"an older snapshot")
    expect = find(source, "snapshot.pt")
    answers = relay_chain([source, first, second], expect, stranger=True)
    assert all(answer.get("ok") for answer in answers), answers
    assert [answer["bytes"] for answer in answers] == [len(data)] * 3
    for workdir in (first, second):
        placed = workdir / "snapshot.pt"
        assert placed.read_bytes() == data
        assert placed.stat().st_mode & 0o777 == 0o600
        assert placed.stat().st_mtime == 1234.5  # the source's: the copy is not newer than the original
        assert [path.name for path in workdir.iterdir()] == ["snapshot.pt"]  # no temporary left


def test_a_directory_is_relayed_whole(tmp_path: Path) -> None:
    source, receiver = tmp_path / "node0", tmp_path / "node1"
    (source / "ckpt" / "step-7" / "shards").mkdir(parents=True)
    (source / "ckpt" / "step-7" / "meta.json").write_text("{}")
    (source / "ckpt" / "step-7" / "shards" / "0.bin").write_bytes(os.urandom(100_000))
    (receiver / "ckpt" / "step-7").mkdir(parents=True)
    (receiver / "ckpt" / "step-7" / "stale.bin").write_bytes(b"old")
    expect = find(source, "ckpt/step-*")
    assert expect["kind"] == "dir" and expect["path"] == "ckpt/step-7" and expect["files"] == 2
    answers = relay_chain([source, receiver], expect)
    assert all(answer.get("ok") for answer in answers), answers
    assert find(receiver, "ckpt/step-*")["sha256"] == expect["sha256"]
    assert sorted(path.name for path in (receiver / "ckpt" / "step-7").iterdir()) == ["meta.json", "shards"]
    assert sorted(path.name for path in (receiver / "ckpt").iterdir()) == ["step-7"]


def test_a_copy_that_differs_from_the_expected_hash_is_not_put_in_place(tmp_path: Path) -> None:
    source, receiver = tmp_path / "node0", tmp_path / "node1"
    source.mkdir()
    receiver.mkdir()
    (source / "snapshot.pt").write_bytes(b"new")
    (receiver / "snapshot.pt").write_bytes(b"kept")
    expect = {**find(source, "snapshot.pt"), "sha256": "0" * 64}
    answers = relay_chain([source, receiver], expect)
    assert "SHA-256" in str(answers[1].get("error")), answers
    assert (receiver / "snapshot.pt").read_bytes() == b"kept"
    assert [path.name for path in receiver.iterdir()] == ["snapshot.pt"]


def test_a_relay_ends_when_the_controller_goes_away(tmp_path: Path) -> None:
    (tmp_path / "snapshot.pt").write_bytes(b"x")
    expect = find(tmp_path, "snapshot.pt")
    process = node_program("relay", tmp_path, "snapshot.pt")
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write((json.dumps({"token": "t", "expect": expect, "source": True, "bind": "127.0.0.1",
                                     "downstream": True}) + "\n").encode())
    process.stdin.flush()
    assert json.loads(process.stdout.readline())["port"]
    started = time.monotonic()
    process.stdin.close()  # waiting for its receiver: it ends at once, not after its 30 s
    assert process.wait(timeout=10) == 1
    assert time.monotonic() - started < 5
