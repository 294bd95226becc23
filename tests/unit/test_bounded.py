"""Nothing grows without bound on the controller or a node: a paused
terminal does not stall fail-fast, following many nodes takes a bounded number of threads,
a line without end is cut, a torn rank is not held for ever."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from support.engine import faked
from torchherd.api import Cluster
from torchherd.engine import events
from torchherd.engine.events import Collector, Event, LinesDropped, Output
from torchherd.engine.records import NodeRecord, RunRecord
from torchherd.engine.run import Follow, LaunchOptions
from torchherd.engine.ssh import detach
from torchherd.engine.ssh.launch import launch
from torchherd.inventory import Host
from torchherd.remote import wire
from torchherd.remote.framing import MAX_LINE, RankMender
from torchherd.runlog import RecordSplitter
from torchherd.transport.base import MAX_PARALLEL, CommandResult


class PausedTerminal(Collector):
    """An observer that stops at its first lines until released, as a terminal on Ctrl-S."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def __call__(self, event: Event) -> None:
        if isinstance(event, Output):
            self.release.wait()
        super().__call__(event)


def test_a_paused_terminal_does_not_stall_fail_fast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events, "MAX_PENDING_LINES", 200)
    hosts = [{"name": f"n{index}", "address": "127.0.0.1"} for index in range(2)]
    cluster = Cluster(hosts, python=sys.executable, workdir=str(tmp_path), nproc_per_node=2)
    plan = faked(cluster.plan("train.py", run_id="tb-paused"), n0="lines=2000 sleep=60", n1="sleep=2 exit=3")
    terminal = PausedTerminal()
    from torchherd.transport.local import LocalConnector

    run = launch(plan, LaunchOptions(check=False, log_dir=tmp_path / "logs", grace=1.0), LocalConnector(), terminal)
    deadline = time.monotonic() + 30
    while not run.done and time.monotonic() < deadline:
        time.sleep(0.2)
    assert run.done, "fail-fast waited for the terminal"
    terminal.release.set()
    summary = run.wait(timeout=30)
    assert summary.exit_code == 1 and summary.headline.startswith("n1")
    dropped = [event.count for event in terminal.of(LinesDropped)]
    assert dropped and sum(dropped) + len(terminal.lines.get("n0", [])) >= 4000
    log = (tmp_path / "logs" / "tb-paused" / "n0.log").read_text()
    assert log.count("line 1999 from rank") == 2, "every line is in the log file"


class Instant:
    """A node whose log holds one finished run: every fetch answers at once."""

    node = "x"

    def __init__(self, seen: list[int]) -> None:
        self.seen = seen

    def run(self, command: str, stdin: bytes = b"", timeout: float = 30.0) -> CommandResult:
        self.seen.append(threading.active_count())
        time.sleep(0.2)  # a round trip: the followers overlap
        return CommandResult(0, wire.done_record(0, 0), b"", 0.2)

    def close(self) -> None:
        pass


class InstantConnector:
    def __init__(self) -> None:
        self.seen: list[int] = []

    def connect(self, host: Host) -> Instant:
        return Instant(self.seen)


def test_following_many_nodes_takes_a_bounded_number_of_threads() -> None:
    nodes = tuple(NodeRecord(f"n{index}", "10.0.0.1", None, None, None, "python3", "~", "~/l", "~/s")
                  for index in range(300))
    record = RunRecord("tb-follow", "/h.toml", 1.0, ("t.py",), nodes, 599, 1.0)
    connector = InstantConnector()
    before = threading.active_count()
    followers = detach.follow_logs(record, Collector(), Follow(follow=True), connector)  # type: ignore[arg-type]
    assert all(follower.finished for follower in followers.values()) and len(connector.seen) == 300
    assert max(connector.seen) <= before + MAX_PARALLEL + 2


class Refusing:
    """A node whose sshd is not there: every connect fails at once."""

    def connect(self, host: Host) -> Instant:
        from torchherd.errors import TransportError

        raise TransportError(host.name, "refused", f"{host.name}: connection refused by {host.address}")


def test_logs_of_a_node_that_cannot_be_reached_say_so_and_end() -> None:
    """`logs RUN` with one node refusing SSH printed nothing and never returned; now the
    node is named with why, the other node's log is read, and a plain logs ends."""
    class OneRefusing(InstantConnector):
        def connect(self, host: Host) -> Instant:
            return Refusing().connect(host) if host.name == "n1" else super().connect(host)

    nodes = tuple(NodeRecord(f"n{index}", "10.0.0.1", None, None, None, "python3", "~", f"~/l{index}", "~/s")
                  for index in range(2))
    record = RunRecord("tb-refused", "/h.toml", 1.0, ("t.py",), nodes, 599, 1.0)
    seen = Collector()
    started = time.monotonic()
    followers = detach.follow_logs(record, seen, Follow(follow=False), OneRefusing())  # type: ignore[arg-type]
    assert time.monotonic() - started < 10 and all(follower.finished for follower in followers.values())
    errors = [(event.status.node, event.status.fields["message"]) for event in seen.events
              if isinstance(event, events.NodeStatus) and event.status.event == "error"]
    assert errors == [("n1", "cannot read its log (~/l1): n1: connection refused by 10.0.0.1")]
    assert [event.status.node for event in seen.events
            if isinstance(event, events.NodeStatus) and event.status.event == "done"] == ["n0"]


def test_a_line_without_end_is_cut_and_costs_linear_time() -> None:
    splitter, chunk, records = RecordSplitter(), b"x" * 65536, []
    started = time.monotonic()
    for _ in range(320):  # 20 MiB, no newline
        records += splitter.feed(chunk)
        assert splitter._size < splitter.limit
    assert time.monotonic() - started < 3.0
    assert sum(len(record) for record in records) + splitter._size == 320 * 65536
    assert all(len(record) == splitter.limit for record in records)


def test_one_torn_rank_is_never_held_beyond_a_line() -> None:
    marker = wire.RANK_PREFIX_HEAD
    mender, out = RankMender(marker), b""
    torn = marker + b"7] " + b"y" * 65536 + marker + b"6] whole\n"
    for _ in range(320):  # rank 7 tears 20 MiB, never finishing its line
        out += mender.mend(torn)
        assert sum(mender.held.values()) <= MAX_LINE + 65536
    assert out.count(marker + b"6] whole\n") == 320
    assert out.count(marker + b"7] ") >= 19
