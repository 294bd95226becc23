"""A detached run with retries, as data: the record of its background controller and
its attempts (round trip, damage named), whether that controller still runs, what the
controller's observer records from the events, and what ``status`` and ``stop`` say
about it. No sockets."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from dataclasses import replace
from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console

from torchherd.cli import main
from torchherd.console import make_console
from torchherd.console.detach import ListedRun, render_recovery, render_runs, render_stopped
from torchherd.engine.events import (
    AttemptFailed,
    AttemptStarted,
    CheckpointReplicated,
    CheckpointSaved,
    CheckpointStaged,
    NodeStarted,
    RunFinished,
)
from torchherd.engine.records import (
    AttemptState,
    NodeRecord,
    NodeState,
    RecordError,
    RecoveryRecord,
    RecoveryStatus,
    RunRecord,
    controller_alive,
    hold_controller_lock,
    load,
    recovery_of,
    remote_log_file,
    remote_state_file,
    with_recovery,
)
from torchherd.engine.recovery import background
from torchherd.engine.recovery.background import Recorder
from torchherd.inventory import Host
from torchherd.remote.wire import process_start
from torchherd.runlog import AttemptRecord, RunSummary

RUN = "th-20240501-120000-abcdef"


def node(name: str) -> NodeRecord:
    return NodeRecord(name=name, address=name, user=None, ssh_port=None, identity_file=None, python="/opt/py",
                      workdir="~/w", log_file=remote_log_file(RUN, name), state_file=remote_state_file(RUN, name))


def record(*names: str) -> RunRecord:
    return RunRecord(run_id=RUN, inventory="/x/hosts.toml", created=100.0, command=("train.py",),
                     nodes=tuple(node(name) for name in names or ("node0", "node1")), max_rank=1, grace=5.0)


def summary(code: int, headline: str, *attempts: AttemptRecord) -> RunSummary:
    return RunSummary(RUN, code, headline, (), "/logs", attempts=attempts)


TWO = ("node0", "node1")
ENDED = RecoveryRecord(4242, 77, 2).started(1, TWO).failed(1, "node1 rank 1 failed first (exit 1)").started(2, TWO)


# the record --------------------------------------------------------------------------------


def test_the_record_of_attempts_round_trips() -> None:
    recovery = ENDED.finished(0, "all 2 nodes finished (exit 0) (attempt 2)",
                              (AttemptState(1, TWO, "failed", "node1 rank 1 failed first"),
                               AttemptState(2, TWO, "ok", "all 2 nodes finished")))
    text = with_recovery(record(), recovery).to_json()
    again = recovery_of(RunRecord.from_json(text))
    assert again == recovery
    assert [(attempt.number, attempt.ended) for attempt in recovery.attempts] == [(1, "failed"), (2, "ok")]
    assert recovery.exit_code == 0 and recovery.ended


def test_attempts_as_they_go() -> None:
    assert [(attempt.number, attempt.ended, attempt.headline) for attempt in ENDED.attempts] == [
        (1, "failed", "node1 rank 1 failed first (exit 1)"), (2, "running", "")]
    assert not ENDED.ended
    assert recovery_of(record()) is None


@pytest.mark.parametrize(("damage", "named"), [
    pytest.param({"pid": "12"}, "extra.recovery.pid", id="pid"),
    pytest.param({"attempts": [{"number": 1, "nodes": ["../x"], "ended": "ok", "headline": ""}]},
                 "extra.recovery.attempts[0].nodes", id="node-name"),
    pytest.param({"attempts": [{"number": 1, "nodes": ["n"], "ended": "maybe", "headline": ""}]},
                 "extra.recovery.attempts[0].ended", id="ended"),
    pytest.param({"exit_code": 300}, "extra.recovery.exit_code", id="exit-code"),
])
def test_a_damaged_recovery_record_is_named_at_load(damage: dict[str, object], named: str) -> None:
    data = {**ENDED.to_json_object(), **damage}
    text = replace(record(), extra={"recovery": data}).to_json()
    with pytest.raises(RecordError, match=named.replace("[", r"\[").replace("]", r"\]")):
        RunRecord.from_json(text)


# the controller, alive or gone -------------------------------------------------------------


def test_a_controller_is_its_lock_pid_and_start_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    me = os.getpid()
    assert not controller_alive(RecoveryRecord(me, process_start(me), 1), RUN)  # no lock held
    fd = hold_controller_lock(RUN)
    try:
        assert controller_alive(RecoveryRecord(me, process_start(me), 1), RUN)
        assert controller_alive(RecoveryRecord(me, None, 1), RUN)
        assert not controller_alive(RecoveryRecord(me, (process_start(me) or 0) + 1, 1), RUN)  # a reused pid
        assert not controller_alive(RecoveryRecord(me + 1, None, 1), RUN)  # not the pid that holds it
        assert not controller_alive(RecoveryRecord(me, None, 1), "th-other")
    finally:
        os.close(fd)
    assert not controller_alive(RecoveryRecord(me, process_start(me), 1), RUN)


CONTROLLER = """
import sys, time
from torchherd.engine.records import hold_controller_lock
hold_controller_lock(sys.argv[1])
print("locked", flush=True)
time.sleep(60)
"""


def test_an_ended_controller_is_gone_even_unreaped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", CONTROLLER, RUN], stdout=subprocess.PIPE)
    assert child.stdout is not None and child.stdout.readline() == b"locked\n"
    start = process_start(child.pid)
    try:
        assert controller_alive(RecoveryRecord(child.pid, start, 1), RUN)
        child.kill()
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped: a zombie
        assert not controller_alive(RecoveryRecord(child.pid, start, 1), RUN)
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert not controller_alive(RecoveryRecord(child.pid, start, 1), RUN)


def test_stop_goes_on_when_the_controller_cannot_be_signalled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user's process (PermissionError), or one gone since: ``stop_controller``
    says the controller was not stopped, raises nothing, and ``stop`` goes on to the nodes."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    fd = hold_controller_lock(RUN)

    def refused(pid: int, signum: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", refused)
    try:
        assert not background.stop_controller(RecoveryRecord(os.getpid(), None, 1), RUN, 0.0)
    finally:
        os.close(fd)


PLANTED = ("secrets", "logging", "queue", "json", "pickle", "subprocess", "threading")


def test_the_background_controller_never_imports_from_its_start_directory(tmp_path: Path) -> None:
    """A project directory (or a shared one) with a ``secrets.py``: the background
    controller started there (as ``run --detach --retries`` starts it) never runs it."""
    hits = tmp_path / "hits"
    hits.mkdir()
    for name in PLANTED:
        (tmp_path / f"{name}.py").write_text(f"open({str(hits / name)!r}, 'w').close()\n")
    started = subprocess.run(background.command(RUN), cwd=tmp_path, input=pickle.dumps("not an order"),
                             capture_output=True, timeout=60)
    assert sorted(os.listdir(hits)) == []
    # it got as far as reading its order: every import of the controller was done
    assert started.returncode == 2, started.stderr.decode()
    assert b"takes its run id, and its order on stdin" in started.stderr


def test_stop_never_signals_a_process_that_only_has_the_controllers_pid(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """After a reboot or a crash the recorded pid is another process's (here a ``sleep``;
    a record without a start time, as on macOS where there is no /proc): ``stop`` finds
    no controller and leaves it alone."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        recovery = RecoveryRecord(stranger.pid, None, 1)
        assert not controller_alive(recovery, RUN)
        assert not background.stop_controller(recovery, RUN, 0.0)
        time.sleep(0.3)
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


# what the controller records ---------------------------------------------------------------


def host(name: str) -> Host:
    return node(name).host()


def test_the_controller_records_attempts_nodes_and_the_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    first = with_recovery(record(), RecoveryRecord(4242, 77, 2))
    recorder = Recorder(first, {name: host(name) for name in ("node0", "node1", "node2")}, {})
    recorder(AttemptStarted(1, 3, TWO))
    recorder(NodeStarted("node1", 115, 15))
    recorder(AttemptFailed(1, "node1 rank 1 failed first", 3.0))
    recorder(AttemptStarted(2, 3, ("node0", "node2")))  # node2, a spare, took node1's place
    saved = load(RUN)
    assert [item.name for item in saved.nodes] == ["node0", "node2", "node1"]
    assert saved.node("node1").supervisor == 15 and saved.node("node1").pid == 115
    assert saved.node("node2").log_file == remote_log_file(RUN, "node2")
    recovery = recovery_of(saved)
    assert recovery is not None
    assert [(attempt.number, attempt.nodes, attempt.ended) for attempt in recovery.attempts] == [
        (1, TWO, "failed"), (2, ("node0", "node2"), "running")]
    recorder(RunFinished(summary(130, "interrupted", AttemptRecord(1, TWO, "failed", "x", 1.0),
                                 AttemptRecord(2, ("node0", "node2"), "interrupted", "y", 1.0))))
    ended = recovery_of(load(RUN))
    assert ended is not None and ended.exit_code == 130 and ended.attempts[-1].ended == "interrupted"
    assert oct((tmp_path / "torchherd" / "runs" / f"{RUN}.json").stat().st_mode & 0o777) == "0o600"


NEWEST = "newest checkpoint: snapshot.pt (1.2 kB, saved 10:41:07 on node0) on node0, node1"


def test_the_controller_records_where_the_newest_checkpoint_is(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A detached run has no terminal for the summary's checkpoint line: its record keeps it,
    from each save, replica or staging while the run goes on, and the summary's at the end."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    recorder = Recorder(with_recovery(record(), RecoveryRecord(4242, 77, 2)), {name: host(name) for name in TWO}, {})
    recorder(AttemptStarted(1, 3, TWO))
    said = [NEWEST]
    recorder(CheckpointReplicated("snapshot.pt", 1200, 5.0, "node0", ("node1",), 0.1, "25% of the link"))
    before = recovery_of(load(RUN))
    assert before is not None and before.checkpoint == ""  # no line to read: nothing said
    recorder.checkpoint = lambda: said[-1]
    recorder(CheckpointReplicated("snapshot.pt", 1200, 5.0, "node0", ("node1",), 0.1, "25% of the link"))
    replicated = recovery_of(load(RUN))
    assert replicated is not None and replicated.checkpoint == NEWEST
    said.append("newest checkpoint: snapshot.pt (1.2 kB, saved 10:45:00 on node1) on node1")
    recorder(CheckpointSaved("node1", "snapshot.pt", 1200, 7.0))  # before its copy: where it is so far
    saved = recovery_of(load(RUN))
    assert saved is not None and saved.checkpoint == said[-1]
    said.append(NEWEST.replace("node0, node1", "node1, node2"))
    recorder(CheckpointStaged(2, "snapshot.pt", 1200, "node1", ("node2",), 0.1))
    staged = recovery_of(load(RUN))
    assert staged is not None and staged.checkpoint.endswith("on node1, node2")
    end = replace(summary(130, "interrupted", AttemptRecord(1, TWO, "interrupted", "x", 1.0)), checkpoint=NEWEST)
    recorder(RunFinished(end))
    ended = recovery_of(load(RUN))
    assert ended is not None and ended.checkpoint == NEWEST and ended.exit_code == 130


def test_a_record_from_before_replication_loads_without_a_checkpoint_line() -> None:
    data = ENDED.to_json_object()
    del data["checkpoint"]
    again = recovery_of(RunRecord.from_json(replace(record(), extra={"recovery": data}).to_json()))
    assert again is not None and again.checkpoint == ""


def test_status_says_where_the_newest_checkpoint_is() -> None:
    out = text_of(lambda console: render_recovery(console, RecoveryStatus(replace(ENDED, checkpoint=NEWEST), True),
                                                  RUNNING))
    assert out == f"the recovering controller (pid 4242) runs: attempt 2 of 3\n{NEWEST}\n" + ATTEMPTS


def test_the_jobs_error_line_never_makes_the_record_unreadable(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A coloured first error line of a megabyte of undecodable bytes (U+FFFD, six bytes
    of JSON each), in two failed attempts and the run's end: the record stays small and
    loads; its headlines show the colour as escapes and are cut."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    line = "\x1b[31mRuntimeError: " + "\ufffd" * (1 << 20)
    recorder = Recorder(with_recovery(record(), RecoveryRecord(4242, 77, 2)), {name: host(name) for name in TWO}, {})
    for number in (1, 2):
        recorder(AttemptStarted(number, 3, TWO))
        recorder(AttemptFailed(number, line, 3.0))
    recorder(RunFinished(summary(1, line, AttemptRecord(1, TWO, "failed", line, 1.0),
                                 AttemptRecord(2, TWO, "failed", line, 1.0))))
    assert (tmp_path / "torchherd" / "runs" / f"{RUN}.json").stat().st_size < 128 << 10
    recovery = recovery_of(load(RUN))
    assert recovery is not None and recovery.exit_code == 1
    for headline in (recovery.headline, *(attempt.headline for attempt in recovery.attempts)):
        assert headline.startswith("\\x1b[31mRuntimeError: \ufffd") and headline.endswith("has the whole line]")
        assert len(headline) < 5000


def test_status_lists_a_damaged_record_as_damaged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    runs = tmp_path / "torchherd" / "runs"
    runs.mkdir(parents=True)
    (runs / "th-broken.json").write_text('{"run_id": "th-broken"')
    out = StringIO()
    assert main(["status"], console=make_console(out, width=400)) == 0
    assert out.getvalue().splitlines() == [
        f"damaged run record: {runs / 'th-broken.json'}: not valid JSON (the run record is damaged: remove the file "
        "(torchherd status lists the other runs))"]


# what status and stop say ------------------------------------------------------------------


def text_of(draw: object, width: int = 100, terminal: bool = True) -> str:
    """What ``draw`` shows on a terminal (uncoloured), or, without ``terminal``, in a pipe."""
    console = Console(file=StringIO(), record=True, width=width, color_system=None, force_terminal=terminal)
    assert callable(draw)
    draw(console)
    return "".join(line.rstrip() + "\n" for line in console.export_text().splitlines())  # a title is padded


RUNNING = [NodeState("node0", "running"), NodeState("node1", "running")]
EXITED = [NodeState("node0", "exited", 0), NodeState("node1", "exited", 1)]
ATTEMPTS = """\
attempts
┏━━━━━━━━━┳━━━━━━━━━━━━━┳━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┓
┃ attempt ┃ nodes       ┃ ended   ┃ how                                ┃
┡━━━━━━━━━╇━━━━━━━━━━━━━╇━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┩
│ 1       │ node0,node1 │ failed  │ node1 rank 1 failed first (exit 1) │
│ 2       │ node0,node1 │ running │                                    │
└─────────┴─────────────┴─────────┴────────────────────────────────────┘
"""


def test_status_of_a_live_controller() -> None:
    out = text_of(lambda console: render_recovery(console, RecoveryStatus(ENDED, True), RUNNING))
    assert out == "the recovering controller (pid 4242) runs: attempt 2 of 3\n" + ATTEMPTS


def test_status_of_a_gone_controller_while_the_job_runs() -> None:
    out = text_of(lambda console: render_recovery(console, RecoveryStatus(ENDED, False), RUNNING))
    assert out == "the recovering controller (pid 4242) is gone: the job runs on without recovery\n" + ATTEMPTS


def test_status_of_a_gone_controller_after_the_job() -> None:
    out = text_of(lambda console: render_recovery(console, RecoveryStatus(ENDED, False), EXITED))
    assert out == "the recovering controller (pid 4242) is gone: no further attempt will be made\n" + ATTEMPTS


def test_status_of_a_run_that_ended() -> None:
    ended = replace(ENDED, exit_code=0, headline="all 2 nodes finished (exit 0) (attempt 2)")
    out = text_of(lambda console: render_recovery(console, RecoveryStatus(ended, False), EXITED))
    assert out.splitlines()[0] == "recovery ended after attempt 2: exit 0: all 2 nodes finished (exit 0) (attempt 2)"


def test_stop_says_what_became_of_the_controller() -> None:
    left = {"node0": [], "node1": []}
    live = text_of(lambda console: render_stopped(console, record(), left, RecoveryStatus(ENDED, True)))
    gone = text_of(lambda console: render_stopped(console, record(), left, RecoveryStatus(ENDED, False)))
    assert live.splitlines()[0] == "the recovering controller (pid 4242): stopped the run, no further attempt"
    assert gone.splitlines()[0] == "the recovering controller (pid 4242) was gone already: the nodes were stopped " \
                                   "directly"
    assert live.splitlines()[-1] == f"run {RUN}: stopped"


def test_the_listing_of_every_run_shows_each_controller(monkeypatch: pytest.MonkeyPatch) -> None:
    """``status`` with no run id: a run with retries says what became of its controller,
    as ``status RUN`` does; a plain detached run has nothing in that column."""
    monkeypatch.setattr(time, "time", lambda: 160.0)
    plain = ListedRun(replace(record(), run_id="th-plain"), RUNNING)
    alive = ListedRun(replace(record(), run_id="th-alive"), RUNNING, RecoveryStatus(ENDED, True))
    gone = ListedRun(replace(record(), run_id="th-gone"), RUNNING, RecoveryStatus(ENDED, False))
    over = ListedRun(replace(record(), run_id="th-over"), EXITED, RecoveryStatus(ENDED, False))
    done = [NodeState("node0", "exited", 0), NodeState("node1", "exited", 0)]
    ended = ListedRun(replace(record(), run_id="th-ended"), done,
                      RecoveryStatus(replace(ENDED, exit_code=0, headline="all 2 nodes finished"), False))
    out = text_of(lambda console: render_runs(console, [plain, alive, gone, over, ended]), 160)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(100.0)) + " (60s ago)"
    assert out == f"""\
runs
┏━━━━━━━━━━┳━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━┓
┃ run      ┃ state   ┃ started                       ┃ nodes                              ┃ recovery                                  ┃ command  ┃
┡━━━━━━━━━━╇━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━┩
│ th-plain │ running │ {started} │ node0 running, node1 running       │                                           │ train.py │
│ th-alive │ running │ {started} │ node0 running, node1 running       │ attempt 2 of 3                            │ train.py │
│ th-gone  │ running │ {started} │ node0 running, node1 running       │ controller gone, running without recovery │ train.py │
│ th-over  │ failed  │ {started} │ node0 exited (0), node1 exited (1) │ controller gone, no further attempt       │ train.py │
│ th-ended │ ok      │ {started} │ node0 exited (0), node1 exited (0) │ ended after attempt 2: exit 0             │ train.py │
└──────────┴─────────┴───────────────────────────────┴────────────────────────────────────┴───────────────────────────────────────────┴──────────┘
"""


def test_the_listing_of_plain_runs_has_no_recovery_column(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "time", lambda: 160.0)
    out = text_of(lambda console: render_runs(console, [ListedRun(record(), RUNNING)]))
    assert out.splitlines()[2].split() == ["┃", "run", "┃", "state", "┃", "started", "┃", "nodes", "┃", "command", "┃"]


def test_the_piped_listing_is_plain_columns_that_cut_and_grep_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torchherd status | grep running``: no box, every line starts with its run id, a
    long cell whole however narrow the console (nothing folded onto a second line)."""
    monkeypatch.setattr(time, "time", lambda: 160.0)
    alive = ListedRun(replace(record(), run_id="th-alive"), RUNNING, RecoveryStatus(ENDED, True))
    over = ListedRun(replace(record(), run_id="th-over"), EXITED, RecoveryStatus(ENDED, False))
    out = text_of(lambda console: render_runs(console, [alive, over]), 40, terminal=False)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(100.0)) + " (60s ago)"
    assert out == f"""\
runs
run       state    started                        nodes                               recovery                             command
th-alive  running  {started}  node0 running, node1 running        attempt 2 of 3                       train.py
th-over   failed   {started}  node0 exited (0), node1 exited (1)  controller gone, no further attempt  train.py
"""
    assert out.isascii()
