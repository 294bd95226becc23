"""Checkpoint replication (``[recovery] replicate``): the pure parts (a checkpoint complete
once settled, the ring, the pace of the copy, the bandwidth cap as written, where the newest
checkpoint is, the notes), the supervisor's watch on a real directory and a real process
writing, the relay paced and keeping a newer copy (the node program over 127.0.0.1), and the
recovering run handing each new checkpoint to the copier with the attempt's ring."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import pytest

from support.cli import assert_one_line, run_cli
from support.recovery import FakeBackend, ended, plan_of, recover
from support.staging import find, relay_chain
from torchherd.console.recovery import recovery_note
from torchherd.engine.events import CheckpointReplicated, CheckpointSaved, Collector
from torchherd.engine.recovery.replication import Holdings, Replicator, ring
from torchherd.engine.recovery.runner import RecoveringRun
from torchherd.engine.run import LaunchOptions
from torchherd.inventory import Bandwidth, Recovery, parse_bandwidth
from torchherd.inventory.options import recovery_problem
from torchherd.plan import Plan
from torchherd.remote import wire
from torchherd.remote.checkpoint import BURST_SECONDS, Pace, rates_of
from torchherd.remote.savewatch import CheckpointWatch, Settle, look, open_for_writing

HOSTS = '[[hosts]]\nname = "a"\naddress = "192.0.2.1"\n[[hosts]]\nname = "b"\naddress = "192.0.2.2"\n'
WALL = 1_700_000_000.0


def at(clock: str) -> float:
    """Seconds since the epoch of today's ``clock`` (HH:MM:SS), local time: what the notes print."""
    hours, minutes, seconds = (int(part) for part in clock.split(":"))
    return time.mktime(time.localtime()[:3] + (hours, minutes, seconds, 0, 0, -1))


# ------------------------------------------------------------------ complete, once settled


def never(_: str) -> bool:
    return False


def test_a_checkpoint_counts_once_its_size_and_mtime_stayed_the_same_for_the_settle_time() -> None:
    settle = Settle(2.0)
    state = ("snapshot.pt", 100, WALL)
    assert settle.seen(state, 0.0, WALL + 5, never) is None  # first seen
    assert settle.seen(state, 1.0, WALL + 6, never) is None  # not long enough
    assert settle.seen(state, 2.0, WALL + 7, never) == state
    assert settle.seen(state, 3.0, WALL + 8, never) is None  # reported once


def test_a_checkpoint_still_growing_is_not_complete() -> None:
    settle = Settle(2.0)
    for second in range(6):  # written a little more every second
        assert settle.seen(("snapshot.pt", 100 * second, WALL + second), float(second), WALL + second, never) is None
    assert settle.seen(("snapshot.pt", 500, WALL + 5), 7.0, WALL + 7, never) == ("snapshot.pt", 500, WALL + 5)


def test_a_checkpoint_renamed_into_place_with_an_old_mtime_waits_the_settle_time_only() -> None:
    settle = Settle(2.0)
    state = ("step-2.pt", 100, WALL - 3600)  # written aside an hour ago, renamed now
    assert settle.seen(state, 0.0, WALL, never) is None
    assert settle.seen(state, 2.0, WALL + 2, never) == state


def test_a_fresh_mtime_waits_even_when_looked_at_long_apart() -> None:
    settle = Settle(2.0)
    state = ("snapshot.pt", 100, WALL)
    assert settle.seen(state, 0.0, WALL + 0.5, never) is None
    assert settle.seen(state, 5.0, WALL + 1.0, never) is None  # the wall clock says it is 1 s old


def test_a_checkpoint_open_for_writing_is_complete_a_settle_time_after_it_is_closed() -> None:
    settle = Settle(2.0)
    state = ("snapshot.pt", 100, WALL)
    writing = {"open": True}
    assert settle.seen(state, 0.0, WALL + 5, lambda _: writing["open"]) is None
    assert settle.seen(state, 2.0, WALL + 7, lambda _: writing["open"]) is None
    writing["open"] = False
    assert settle.seen(state, 3.0, WALL + 8, lambda _: writing["open"]) is None
    assert settle.seen(state, 4.0, WALL + 9, lambda _: writing["open"]) == state


def test_only_a_newer_checkpoint_than_the_last_reported_counts() -> None:
    settle = Settle(1.0)
    newer, older = ("step-2.pt", 10, WALL + 10), ("step-1.pt", 10, WALL)
    assert settle.seen(newer, 0.0, WALL + 20, never) is None
    assert settle.seen(newer, 1.0, WALL + 21, never) == newer
    assert settle.seen(older, 2.0, WALL + 22, never) is None  # step-2 removed: step-1 is the glob's newest again
    assert settle.seen(older, 4.0, WALL + 24, never) is None
    assert settle.seen(None, 5.0, WALL + 25, never) is None


def test_the_watch_finds_the_newest_match_and_a_writer_holds_it_back(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    for step, mtime in ((1, WALL), (2, WALL + 10)):
        (tmp_path / "ckpt" / f"step-{step}.pt").write_bytes(b"x" * step)
        os.utime(tmp_path / "ckpt" / f"step-{step}.pt", (mtime, mtime))
    assert look(str(tmp_path), "ckpt/step-*.pt") == ("ckpt/step-2.pt", 2, WALL + 10)
    assert look(str(tmp_path), "nothing-*.pt") is None
    path = tmp_path / "ckpt" / "step-2.pt"
    with open(path, "ab"):
        assert open_for_writing([str(path)], [os.getpid()])
        watch = CheckpointWatch(str(tmp_path), "ckpt/step-*.pt", lambda: [os.getpid()], settle=0.0)
        assert watch.poll(0.0) is None  # first seen
        assert watch.poll(1.0) is None  # open for writing by a process of the job
    with open(path, "rb"):
        assert not open_for_writing([str(path)], [os.getpid()])
    assert watch.poll(2.0) == ("ckpt/step-2.pt", 2, WALL + 10)
    assert watch.poll(2.5) is None  # not due yet


# ------------------------------------------------------------------ the ring


def test_the_ring_takes_the_next_nodes_in_node_rank_order_and_wraps() -> None:
    nodes = ["node0", "node1", "node2", "node3"]
    assert ring(nodes, "node0", 1) == ("node1",)
    assert ring(nodes, "node2", 2) == ("node3", "node0")
    assert ring(nodes, "node3", 1) == ("node0",)
    assert ring(nodes, "node1", 9) == ("node2", "node3", "node0")  # at most every other node
    assert ring(nodes, "node1", 0) == ()
    assert ring(["node0"], "node0", 1) == ()
    assert ring(nodes, "node9", 1) == ()  # a node that left the run


# ------------------------------------------------------------------ the pace


def test_the_pace_never_runs_ahead_of_its_rate() -> None:
    rate = 10e6
    pace = Pace(rate, 0.0)
    now, sent = 0.0, 0
    while sent < 100e6:
        now += pace.take(1 << 20, now)
        sent += 1 << 20
        assert sent <= rate * now + rate * BURST_SECONDS + (1 << 20)
    assert now == pytest.approx(sent / rate - BURST_SECONDS, rel=0.01)
    assert Pace(0.0, 0.0).take(1 << 30, 0.0) == 0.0  # no cap


def test_a_pace_gives_back_the_time_the_sender_was_idle_only_up_to_a_burst() -> None:
    pace = Pace(1e6, 0.0)
    assert pace.take(50_000, 0.0) == 0.0  # the burst
    assert pace.take(1_000_000, 100.0) == pytest.approx(1.0 - BURST_SECONDS)  # an idle minute saves nothing up


# ------------------------------------------------------------------ the cap as written


@pytest.mark.parametrize(("text", "cap"), [
    ("auto", Bandwidth(share=0.25, per_core=5e6)),
    ("25%", Bandwidth(share=0.25)), ("100%", Bandwidth(share=1.0)), ("200MB/s", Bandwidth(bytes_per_second=200e6)),
    ("1.5GB/s", Bandwidth(bytes_per_second=1.5e9)), ("800Mbit/s", Bandwidth(bytes_per_second=100e6)),
    ("500 kB/s", Bandwidth(bytes_per_second=500e3)),
])
def test_a_cap_is_a_share_of_the_link_or_a_rate(text: str, cap: Bandwidth) -> None:
    assert parse_bandwidth(text) == cap


@pytest.mark.parametrize("text", ["0%", "150%", "fast", "200", "200MB", "-5%", "0MB/s"])
def test_anything_else_is_no_cap(text: str) -> None:
    assert parse_bandwidth(text) is None


def test_the_cap_goes_to_the_node_program_as_a_share_or_bytes() -> None:
    assert Bandwidth(share=0.25).wire() == {"share": 0.25} and str(Bandwidth(share=0.25)) == "25% of the link"
    assert Bandwidth(bytes_per_second=2e8).wire() == {"bytes": 2e8} and str(Bandwidth(bytes_per_second=2e8)) == "200 MB/s"
    default = Recovery(checkpoint="snapshot.pt").replicate_bandwidth
    assert default.wire() == {"share": 0.25, "per_core": 5e6}
    assert str(default) == "25% of the link and 5 MB/s per CPU core"


@pytest.mark.parametrize(("cores", "rate"), [({0}, 5e6), (set(range(4)), 20e6), (set(range(64)), 31.25e6)])
def test_the_default_cap_is_the_smaller_of_the_links_share_and_the_cores_rate(
        monkeypatch: pytest.MonkeyPatch, cores: set[int], rate: float) -> None:
    import socket

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cores)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # lo states no speed: 1 Gb/s assumed, a quarter is 31.25 MB/s
        assert rates_of({"share": 0.25, "per_core": 5e6}, sock) == (rate, 31.25e6)  # the link's share: the ceiling
        assert rates_of({"share": 0.25}, sock) == (31.25e6, 31.25e6)  # a share given alone: no core's cap
        # the link as check --bandwidth measured it (80 MB/s) instead of the stated speed
        assert rates_of({"share": 0.25, "per_core": 5e6, "link": 80e6}, sock) == (min(rate, 20e6), 20e6)
        assert rates_of({"bytes": 2e8, "link": 80e6}, sock) == (2e8, 2e8)  # a rate given: the user's own


def test_one_replica_by_default_with_a_checkpoint_and_none_without() -> None:
    assert Recovery(checkpoint="snapshot.pt").replicas == 1
    assert Recovery(checkpoint="snapshot.pt", replicate=0).replicas == 0
    assert Recovery(checkpoint="snapshot.pt", replicate=2).replicas == 2
    assert Recovery().replicas == 0


@pytest.mark.parametrize(("table", "named"), [
    ('checkpoint = "s.pt"\nreplicate = -1', "[recovery].replicate"),
    ('checkpoint = "s.pt"\nreplicate = "two"', "[recovery].replicate"),
    ('checkpoint = "s.pt"\nreplicate = true', "[recovery].replicate"),
    ('checkpoint = "s.pt"\nreplicate_bandwidth = "fast"', "[recovery].replicate_bandwidth"),
    ('checkpoint = "s.pt"\nreplicate_bandwidth = 50', "[recovery].replicate_bandwidth"),
    ("replicate = 2", "[recovery].replicate: replication copies the checkpoint, and [recovery].checkpoint names none"),
    ('replicate_bandwidth = "25%"', "[recovery].replicate_bandwidth"),
])
def test_a_bad_replication_key_is_one_line_naming_it(tmp_path: Path, table: str, named: str) -> None:
    code, out = run_cli(tmp_path, f"[recovery]\n{table}\n" + HOSTS, ["hosts"])
    assert_one_line(code, out, named)


@pytest.mark.parametrize(("flags", "named"), [
    (["--replicate", "x"], "--replicate"), (["--replicate", "65"], "--replicate"),
    (["--replicate-bandwidth", "lots"], "--replicate-bandwidth"),
    (["--replicate", "1"], "--replicate: replication copies the checkpoint, and none is named"),
])
def test_a_bad_replication_flag_is_one_line_naming_it(tmp_path: Path, flags: list[str], named: str) -> None:
    code, out = run_cli(tmp_path, HOSTS, ["run", "--retries", "1", *flags, "--", "t.py"])
    assert_one_line(code, out, named)


@pytest.mark.parametrize(("flags", "named"), [
    (["--checkpoint", "snapshot.pt"], "--checkpoint: it is staged before a new attempt, and without retries there is "
                                      "none"),
    (["--replicate", "1"], "--replicate: a replica is there for a new attempt, and without retries there is none"),
    (["--replicate-bandwidth", "25%"], "--replicate-bandwidth: a replica is there for a new attempt, and without "
                                       "retries there is none"),
])
def test_replication_without_retries_is_refused_attached(tmp_path: Path, flags: list[str], named: str) -> None:
    """An attached run without retries has no new attempt to stage a checkpoint for: the
    flag is refused before any node is reached (the inventory's checkpoint stands in for
    the flag's where the flag is not --checkpoint)."""
    code, out = run_cli(tmp_path, '[recovery]\ncheckpoint = "snapshot.pt"\n' + HOSTS, ["run", *flags, "--", "t.py"])
    assert_one_line(code, out, named)
    assert "hint: add --retries N (or retries in [recovery])" in out, out


@pytest.mark.parametrize("given", [("checkpoint",), ("replicate",), ("replicate_bandwidth",)])
def test_a_detached_run_replicates_without_retries(given: tuple[str, ...]) -> None:
    """A plain ``--detach`` keeps its controller in the background for the copies: no
    attempt is needed for them (engine: ``Cluster.launch``)."""
    recovery = Recovery(checkpoint="snapshot.pt", replicate=1)
    assert recovery_problem(recovery, given, "flag", detached=True) is None
    assert recovery_problem(recovery, given, "flag") is not None


def test_a_detached_runs_resume_arguments_still_need_retries() -> None:
    recovery = Recovery(checkpoint="snapshot.pt", resume_args=("--init_from=resume",))
    problem = recovery_problem(recovery, ("checkpoint", "resume_args"), "flag", detached=True)
    assert problem is not None and str(problem).startswith("--resume-args"), problem


def test_no_replica_is_made_without_retries() -> None:
    """``hang_timeout`` alone runs the recovering run, one attempt: no watch, no copy."""
    recovery = Recovery(checkpoint="snapshot.pt", hang_timeout=30)
    assert recovery.replicas == 1
    run = RecoveringRun(ReplicatingBackend([lambda plan: ended(plan, None)]), plan_of(),
                        LaunchOptions(check=False, log_dir=Path("/nonexistent")), recovery, Collector())
    assert run.replicator is None and run.checkpoint_line() == ""


def test_the_keys_are_read(tmp_path: Path) -> None:
    from torchherd.inventory import load

    path = tmp_path / "hosts.toml"
    path.write_text('[recovery]\ncheckpoint = "s.pt"\nreplicate = 2\nreplicate_bandwidth = "200MB/s"\n' + HOSTS)
    recovery = load(path).recovery
    assert (recovery.replicas, recovery.replicate_bandwidth) == (2, Bandwidth(bytes_per_second=200e6))


# ------------------------------------------------------------------ where the newest is


def test_the_summary_says_where_the_newest_checkpoint_is() -> None:
    holdings = Holdings("snapshot.pt")
    assert holdings.line() == "newest checkpoint: none of snapshot.pt was seen complete during the run"
    holdings.saved(CheckpointSaved("node0", "snapshot.pt", 4_200_000, at("10:41:02")))
    holdings.replicated(CheckpointReplicated("snapshot.pt", 4_200_000, at("10:41:02"), "node0", ("node1",), 0.2,
                                             "25% of the link"))
    holdings.saved(CheckpointSaved("node0", "snapshot.pt", 4_200_000, at("10:41:07")))
    assert holdings.line() == "newest checkpoint: snapshot.pt (4.2 MB, saved 10:41:07 on node0) on node0"
    holdings.replicated(CheckpointReplicated("snapshot.pt", 4_200_000, at("10:41:07"), "node0", ("node1",), 0.2,
                                             "25% of the link", held=("node2",)))
    assert holdings.line({"node0"}) == ("newest checkpoint: snapshot.pt (4.2 MB, saved 10:41:07 on node0) on "
                                        "node0 (lost), node1, node2")


def test_a_replica_seen_by_its_nodes_watch_is_still_the_original_nodes_save() -> None:
    """node1's supervisor watches the path too: the replica, complete there, comes back as
    node1's save (the original's mtime). It was said to be "saved on node1", and copied on
    round the ring (replicate = 1 became every node)."""
    copies: list[tuple[str, tuple[str, ...]]] = []

    def copier(event: CheckpointSaved, targets: tuple[str, ...], _: Callable[[], bool]) -> CheckpointReplicated:
        copies.append((event.node, targets))
        return CheckpointReplicated(event.path, event.size, event.mtime, event.node, targets, 0.1, "25% of the link")

    holdings, events = Holdings("snapshot.pt"), Collector()
    replicator = Replicator(copier, 1, events, holdings)
    replicator.attempt(("node0", "node1", "node2"))
    assert replicator.saved(CheckpointSaved("node0", "snapshot.pt", 2000, at("10:41:07")))
    deadline = time.monotonic() + 10
    while not events.of(CheckpointReplicated) and time.monotonic() < deadline:
        time.sleep(0.01)
    # the replica, as node1 sees it: not a save to copy (nor one the recovering run passes on)
    assert not replicator.saved(CheckpointSaved("node1", "snapshot.pt", 2000, at("10:41:07")))
    deadline = time.monotonic() + 1.0  # time enough for a copy from node1, were one started
    while len(events.of(CheckpointReplicated)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    replicator.close()
    assert copies == [("node0", ("node1",))]
    assert holdings.line() == "newest checkpoint: snapshot.pt (2.0 kB, saved 10:41:07 on node0) on node0, node1"
    holdings.saved(CheckpointSaved("node2", "snapshot.pt", 2000, at("10:41:07")))  # before its copy was told
    assert holdings.line().endswith("saved 10:41:07 on node0) on node0, node1, node2")


def test_a_note_says_what_was_copied_where_and_under_which_cap() -> None:
    done = CheckpointReplicated("snapshot.pt", 12_300_000, at("10:41:07"), "node0", ("node1",), 0.44,
                                "25% of the link")
    assert recovery_note(done) == ("checkpoint: snapshot.pt (12.3 MB, saved 10:41:07 on node0) replicated to node1 "
                                   "in 0.4 s (at most 25% of the link)", "dim")
    mixed = CheckpointReplicated("snapshot.pt", 1000, at("09:00:00"), "node2", (), 0.1, "200 MB/s", held=("node3",),
                                 failed=(("node0", "not reached: timed out"),), kept=("node1",))
    assert recovery_note(mixed) == ("checkpoint: snapshot.pt (1.0 kB, saved 09:00:00 on node2) already on node3, "
                                    "node1 kept a newer copy of its own, not on node0: not reached: timed out",
                                    "bold yellow")


# ------------------------------------------------------------------ the node program, paced


def test_a_paced_copy_takes_at_least_its_size_over_its_rate(tmp_path: Path) -> None:
    source, receiver = tmp_path / "node0", tmp_path / "node1"
    source.mkdir()
    receiver.mkdir()
    (source / "snapshot.pt").write_bytes(os.urandom(3_000_000))
    expect = find(source, "snapshot.pt")
    started = time.monotonic()
    answers = relay_chain([source, receiver], expect, extra={"rate": {"bytes": 2e6}, "keep_newer": True})
    assert all(answer.get("ok") for answer in answers), answers
    assert time.monotonic() - started >= 1.4  # 3 MB at 2 MB/s, less the first burst
    assert find(receiver, "snapshot.pt")["sha256"] == expect["sha256"]


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_a_replica_is_checked_against_the_hash_the_source_sends_after_the_bytes(tmp_path: Path, kind: str) -> None:
    # No hash beforehand (``look``): the source hashes as it sends, the receiver checks its copy.
    source, receiver = tmp_path / "node0", tmp_path / "node1"
    receiver.mkdir()
    path = "snapshot.pt" if kind == "file" else "ckpt"
    if kind == "file":
        source.mkdir()
        (source / path).write_bytes(os.urandom(300_000))
    else:
        (source / path / "shard").mkdir(parents=True)
        (source / path / "model.bin").write_bytes(os.urandom(200_000))
        (source / path / "shard" / "0.bin").write_bytes(os.urandom(100_000))
    hashed = find(source, path)
    expect = {**hashed, "sha256": None}
    answers = relay_chain([source, receiver], expect, extra={"trailer": True, "keep_newer": True,
                                                            "rate": {"bytes": 50e6}})
    assert all(answer.get("ok") for answer in answers), answers
    assert answers[0]["sha256"] == hashed["sha256"]  # the source's hash of what it sent: find's
    assert find(receiver, path)["sha256"] == hashed["sha256"]


def _copy_begun(receiver: Path) -> bool:
    for path in receiver.iterdir():
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_size > 0:
                return True
    return False


def test_a_checkpoint_that_changes_while_it_is_sent_is_kept_by_no_receiver(tmp_path: Path) -> None:
    source, receiver = tmp_path / "node0", tmp_path / "node1"
    source.mkdir()
    receiver.mkdir()
    (source / "snapshot.pt").write_bytes(os.urandom(2_000_000))
    expect = {**find(source, "snapshot.pt"), "sha256": None}

    def save_again() -> None:  # the job writes its next snapshot in place while the copy is paced
        # Once the receiver holds part of the copy (a fixed wait lost the race on a loaded
        # machine, where the copy began after the write): at 1 MB/s, 2 MB take 2 s more.
        deadline = time.monotonic() + 60
        while not _copy_begun(receiver) and time.monotonic() < deadline:
            time.sleep(0.01)
        with open(source / "snapshot.pt", "r+b") as file:
            file.write(b"epoch 6")

    writer = threading.Thread(target=save_again)
    writer.start()
    answers = relay_chain([source, receiver], expect, extra={"trailer": True, "rate": {"bytes": 1e6}})
    writer.join()
    assert answers == [{"error": "snapshot.pt changed while it was sent"},
                       {"error": "the source gave up: snapshot.pt changed while it was sent"}], answers
    assert list(receiver.iterdir()) == []  # nothing kept, not even the temporary copy


def test_a_receiver_refuses_bytes_that_are_not_what_the_sources_trailer_says(tmp_path: Path) -> None:
    import socket

    from support.staging import node_program
    from torchherd.remote.relay import accept

    receiver = tmp_path / "node1"
    receiver.mkdir()
    with socket.socket() as listener:  # a source that sends one thing and names the hash of another
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        process = node_program("relay", receiver, "snapshot.pt")
        assert process.stdin is not None and process.stdout is not None
        expect = {"path": "snapshot.pt", "kind": "file", "size": 5, "sha256": None}
        process.stdin.write((json.dumps({"token": "t0ken", "expect": expect, "source": False, "bind": None,
                                         "downstream": False, "trailer": True}) + "\n").encode())
        process.stdin.write((json.dumps({"upstream": ["127.0.0.1", listener.getsockname()[1]]}) + "\n").encode())
        process.stdin.flush()
        assert json.loads(process.stdout.readline()) == {"port": None}
        peer = accept(listener, b"t0ken")  # a source that knows the token: its lines are signed
        try:
            peer.send_signed(b"header", json.dumps({"files": [["", 5, WALL]]}).encode())
            peer.sendall(b"hello")
            peer.send_signed(b"trailer", json.dumps({"sha256": "0" * 64}).encode())
            answer = json.loads(process.stdout.readline())
        finally:
            peer.close()
        process.stdin.close()
        process.wait(timeout=30)
    assert answer["error"].startswith("the copy received has SHA-256 2cf24dba5fb0..., not the 000000000000..."), answer
    assert list(receiver.iterdir()) == []


def test_a_receiver_with_a_newer_copy_of_its_own_keeps_it(tmp_path: Path) -> None:
    source, receiver = tmp_path / "node0", tmp_path / "node1"
    source.mkdir()
    receiver.mkdir()
    (source / "snapshot.pt").write_bytes(b"epoch 5")
    os.utime(source / "snapshot.pt", (WALL, WALL))
    (receiver / "snapshot.pt").write_bytes(b"epoch 10")
    os.utime(receiver / "snapshot.pt", (WALL + 60, WALL + 60))
    answers = relay_chain([source, receiver], find(source, "snapshot.pt"), extra={"keep_newer": True})
    assert answers[1] == {**answers[1], "ok": True, "kept": "a newer copy is here"}, answers
    assert (receiver / "snapshot.pt").read_bytes() == b"epoch 10"
    assert [path.name for path in receiver.iterdir()] == ["snapshot.pt"]


def test_a_directory_replica_keeps_the_originals_mtime(tmp_path: Path) -> None:
    source, receiver = tmp_path / "node0", tmp_path / "node1"
    (source / "ckpt" / "step-3").mkdir(parents=True)
    (source / "ckpt" / "step-3" / "model.bin").write_bytes(b"m" * 1000)
    os.utime(source / "ckpt" / "step-3" / "model.bin", (WALL, WALL))
    os.utime(source / "ckpt" / "step-3", (WALL, WALL))
    receiver.mkdir()
    answers = relay_chain([source, receiver], find(source, "ckpt/step-*"), extra={"keep_newer": True})
    assert all(answer.get("ok") for answer in answers), answers
    assert find(receiver, "ckpt/step-*")["mtime"] == WALL  # never newer than the original


# ------------------------------------------------------------------ the recovering run


@dataclass
class ReplicatingBackend(FakeBackend):
    """The recovery tests' backend, whose replication is recorded."""

    copies: list[tuple[tuple[str, ...], str, tuple[str, ...], str]] = field(default_factory=list)

    def replicate_checkpoint(self, plan: Plan, saved: CheckpointSaved, targets: Sequence[str], bandwidth: Bandwidth,
                             stopping: Callable[[], bool] = lambda: False) -> CheckpointReplicated:
        self.copies.append((tuple(node.host.name for node in plan.nodes), saved.node, tuple(targets), str(bandwidth)))
        return CheckpointReplicated(saved.path, saved.size, saved.mtime, saved.node, tuple(targets), 0.1,
                                    str(bandwidth))


def test_the_recovering_run_watches_the_checkpoint_and_replicates_each_new_one_on_its_ring() -> None:
    backend = ReplicatingBackend([lambda plan: ended(plan, None)], hold=True)
    events = Collector()
    recovery = Recovery(retries=1, checkpoint="snapshot.pt", replicate=2,
                        replicate_bandwidth=Bandwidth(bytes_per_second=5e7))
    run = RecoveringRun(backend, plan_of(), LaunchOptions(check=False, log_dir=Path("/nonexistent")), recovery,
                        events).start()
    saved = CheckpointSaved("node2", "snapshot.pt", 10, at("11:00:00"))
    run._relay(saved)  # as the attempt's Job emits it on the node's checkpoint record
    deadline = time.monotonic() + 10
    while not events.of(CheckpointReplicated) and time.monotonic() < deadline:
        time.sleep(0.01)
    backend.jobs[0].release.set()
    summary = run.wait(timeout=20)
    assert backend.copies == [(("node0", "node1", "node2"), "node2", ("node0", "node1"), "50 MB/s")]
    assert saved in events.events  # a node's own save goes on (a detached run's record says it; not rendered)
    assert summary.checkpoint == ("newest checkpoint: snapshot.pt (10 B, saved 11:00:00 on node2) on node2, node0, "
                                  "node1")


def test_the_supervisor_is_told_to_watch_the_checkpoint_only_with_replication() -> None:
    seen: list[str | None] = []

    @dataclass
    class Watching(ReplicatingBackend):
        def launch(self, plan: Plan, options: object, observer: object = None) -> object:  # type: ignore[override]
            seen.append(options.watch_checkpoint)
            return super().launch(plan, options, observer)  # type: ignore[arg-type]

    recover(Watching([lambda plan: ended(plan, None)]), plan_of(), Recovery(retries=1, checkpoint="snapshot.pt"))
    recover(Watching([lambda plan: ended(plan, None)]), plan_of(),
            Recovery(retries=1, checkpoint="snapshot.pt", replicate=0))
    assert seen == ["snapshot.pt", None]


def test_the_replicator_gives_up_the_copy_under_way_between_two_attempts() -> None:
    started, stopped = threading.Event(), threading.Event()

    def copier(saved: CheckpointSaved, targets: tuple[str, ...], cancelled: Callable[[], bool]) -> CheckpointReplicated:
        started.set()
        while not cancelled():
            time.sleep(0.01)
        stopped.set()
        return CheckpointReplicated(saved.path, saved.size, saved.mtime, saved.node, (), 0.0, "")

    emitted: list[object] = []
    replicator = Replicator(copier, 1, emitted.append, Holdings("snapshot.pt"))
    replicator.attempt(["node0", "node1"])
    replicator.saved(CheckpointSaved("node0", "snapshot.pt", 10, WALL))
    assert started.wait(10)
    replicator.pause(timeout=10)
    assert stopped.is_set() and emitted == []  # given up: nothing claimed
    replicator.close()  # the run is over: its thread ends
    assert replicator._thread is not None
    replicator._thread.join(timeout=10)
    assert not replicator._thread.is_alive()


def test_a_copy_that_reached_its_node_as_the_attempt_ended_is_still_told() -> None:
    """The job waited for its replica and ended the attempt the moment it landed, before the
    chain's last answer: the copy is given up, but the node it reached holds it, and says so
    before ``close`` returns (the run's summary comes after)."""
    started, release = threading.Event(), threading.Event()

    def copier(saved: CheckpointSaved, targets: tuple[str, ...], cancelled: Callable[[], bool]) -> CheckpointReplicated:
        started.set()
        assert release.wait(10)
        return CheckpointReplicated(saved.path, saved.size, saved.mtime, saved.node, targets, 1.5, "1%",
                                    failed=(("node2", "given up: the run was interrupted"),))

    emitted: list[object] = []
    holdings = Holdings("snapshot.pt")
    replicator = Replicator(copier, 1, emitted.append, holdings)
    replicator.attempt(["node0", "node1"])
    saved = CheckpointSaved("node0", "snapshot.pt", 10, WALL)
    replicator.saved(saved)
    assert started.wait(10)
    threading.Timer(0.2, release.set).start()
    replicator.close()
    assert emitted == [CheckpointReplicated("snapshot.pt", 10, WALL, "node0", ("node1",), 1.5, "1%")]
    assert holdings.copy_of(CheckpointSaved("node1", "snapshot.pt", 10, WALL)) is not None


def test_the_record_reaches_the_controller_as_it_was_sent() -> None:
    from torchherd.runlog import parse_status

    status = parse_status("node0", wire.checkpoint_record("ckpt/step-3.pt", 123, WALL + 0.5)[1:-1])
    assert (status.event, status.fields) == ("checkpoint", {"event": "checkpoint", "path": "ckpt/step-3.pt",
                                                            "size": 123, "mtime": WALL + 0.5})


# ------------------------------------------------------------------ the controller's side, on this machine


def test_a_replica_goes_to_the_ring_nodes_that_lack_it_and_a_newer_copy_stays(tmp_path: Path) -> None:
    """``replicate`` over the in-process transport: n1 has an older copy (replaced), n2 the
    same one (left alone: its look matched and its hash confirmed it), n3 a newer one of its
    own (kept), n4 is not reached."""
    from support.staging import nodes_in
    from torchherd.engine.prepare.staging import replicate
    from torchherd.transport.local import LocalConnector

    nodes = nodes_in(tmp_path, 5)
    data = os.urandom(300_000)
    for name, content, mtime in (("n0", data, WALL), ("n1", b"epoch 0", WALL - 60), ("n2", data, WALL),
                                 ("n3", b"epoch 10", WALL + 60)):
        (tmp_path / name / "snapshot.pt").write_bytes(content)
        os.utime(tmp_path / name / "snapshot.pt", (mtime, mtime))
    untouched = (tmp_path / "n2" / "snapshot.pt").stat().st_ino
    saved = CheckpointSaved("n0", "snapshot.pt", len(data), WALL)
    event = replicate(LocalConnector(unreachable=frozenset({"n4"})), nodes, saved, ["n1", "n2", "n3", "n4"],
                      {"bytes": 50e6}, "50 MB/s")
    assert (event.source, event.nodes, event.held, event.kept) == ("n0", ("n1",), ("n2",), ("n3",)), event
    assert [node for node, _ in event.failed] == ["n4"] and "not reached" in event.failed[0][1]
    assert (tmp_path / "n1" / "snapshot.pt").read_bytes() == data
    assert (tmp_path / "n1" / "snapshot.pt").stat().st_mtime == WALL  # the original's: never newer
    assert (tmp_path / "n2" / "snapshot.pt").stat().st_ino == untouched
    assert (tmp_path / "n3" / "snapshot.pt").read_bytes() == b"epoch 10"


def test_look_names_the_newest_copy_without_hashing_it(tmp_path: Path) -> None:
    from support.staging import node_program

    (tmp_path / "snapshot.pt").write_bytes(b"x" * 10)
    os.utime(tmp_path / "snapshot.pt", (WALL, WALL))
    process = node_program("look", tmp_path, "snapshot.pt")
    out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert json.loads(out) == {"path": "snapshot.pt", "kind": "file", "size": 10, "mtime": WALL, "sha256": None,
                               "files": 1}


def test_the_sources_account_of_its_governed_rate_is_told_in_words() -> None:
    from torchherd.engine.prepare.staging import governed

    said = {"governed": {"start": 10e6, "rate": 12.5e6, "ceiling": 40e6, "slowed": 1, "raised": 14,
                         "baseline": [101.2, 1.1], "link": "measured"}}
    assert governed([{"progress": 5}, said]) == ("kept to the job's pace (101 lines/s, 1.10 CPU): 10 MB/s at first, 12.5 MB/s at the end "
                                                 "(at most 40 MB/s, a share of the link as measured), cut 1 time, "
                                                 "raised 14 times")
    quiet = {"governed": {**said["governed"], "baseline": None, "link": "stated"}}
    assert governed([quiet]) == "at 10 MB/s: the job's pace too slight to keep to"
    assert governed([{"governed": {"start": "fast"}}]) == "" and governed([]) == ""
    assert governed([{"governed": {**said["governed"], "baseline": [1]}}]) == ""


def test_the_source_is_told_whose_pace_to_keep_to_and_the_link_as_measured(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from support.recovery import plan_of
    from torchherd.engine.prepare.staging import replication_rate
    from torchherd.engine.records.links import keep_links

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    plan = plan_of(nodes=3)
    saved = CheckpointSaved("node1", "snapshot.pt", 10, 1.0)
    auto = Recovery(checkpoint="snapshot.pt").replicate_bandwidth
    assert replication_rate(plan, saved, ["node2"], auto) == {"share": 0.25, "per_core": 5e6,
                                                              "pace": ["th-test", "node1"]}
    keep_links({"links": [{"from": "node1", "to": "node2", "gbit": 0.8}]}, {"node1": "node1", "node2": "node2"})
    assert replication_rate(plan, saved, ["node2", "node0"], auto)["link"] == 100e6  # to the first of the chain
    assert "link" not in replication_rate(plan, saved, ["node0"], auto)
