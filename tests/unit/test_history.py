"""The history of attached runs: the record an attached run writes when its job started
and when it ended, what ``status`` says of it (a killed controller included), ``logs``
read back from the local log files, and the bound on the history. Exact text; real
processes and locks, no sockets."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import replace
from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console

from torchherd.api import Cluster
from torchherd.cli import main
from torchherd.console import make_console
from torchherd.console.detach import ListedRun, render_runs, render_status
from torchherd.engine.records import (
    AttachedRecord,
    AttachedStatus,
    NodeEnding,
    NodeRecord,
    RecordError,
    RunRecord,
    attached_node_states,
    attached_of,
    load,
    prune,
    save,
    with_attached,
)
from torchherd.engine.records.history import History, ending_of, parse_log_line
from torchherd.plan import Plan
from torchherd.runlog import NodeOutcome, OutputLine, RunSummary

RUN = "th-20240501-120000-abcdef"
NODES = ("node0", "node1")


def record(run_id: str = RUN, created: float = 100.0, attached: AttachedRecord | None = None) -> RunRecord:
    nodes = tuple(NodeRecord(name=name, address=name, user=None, ssh_port=None, identity_file=None,
                             python="/opt/py", workdir="/w", log_file=f"/logs/{run_id}/{name}.log", state_file="")
                  for name in NODES)
    plain = RunRecord(run_id=run_id, inventory="-H", created=created, command=("train.py", "--lr", "3e-4"),
                      nodes=nodes, max_rank=3, grace=10.0)
    return with_attached(plain, attached or AttachedRecord(4242, 77, f"/logs/{run_id}"))


FINISHED = AttachedRecord(4242, 77, f"/logs/{RUN}", "finished", 0, "all 2 nodes finished (exit 0)", 160.0,
                          (NodeEnding("node0", "ok", 0), NodeEnding("node1", "ok", 0)))
FAILED = AttachedRecord(4242, 77, f"/logs/{RUN}", "failed", 1, "node1 rank 3 failed first (exit 1): boom", 160.0,
                        (NodeEnding("node0", "torn down", 143), NodeEnding("node1", "failed", 1)))


def text_of(draw: object, width: int = 160) -> str:
    """What ``draw`` renders on a terminal (tables with their box; piped, they are plain columns)."""
    console = Console(file=StringIO(), record=True, width=width, color_system=None, force_terminal=True)
    assert callable(draw)
    draw(console)
    return "".join(line.rstrip() + "\n" for line in console.export_text().splitlines())


def test_the_attached_record_round_trips() -> None:
    for attached in (AttachedRecord(4242, None, "/logs/x"), FINISHED, FAILED):
        made = record(attached=attached)
        assert attached_of(RunRecord.from_json(made.to_json())) == attached


@pytest.mark.parametrize("key,value,problem", [
    ("ending", "done", "extra.attached.ending: 'done' is not one of running, finished, failed, stopped, interrupted"),
    ("log_dir", "logs/x", "extra.attached.log_dir: 'logs/x' is not an absolute path"),
    ("pid", "1; rm -rf ~", "extra.attached.pid: expected int, got str"),
    ("nodes", [{"node": "../x", "state": "ok", "exit_code": 0}], "extra.attached.nodes[0].node: '../x' is not a host name"),
    ("nodes", [{"node": "n", "state": "fine", "exit_code": 0}],
     "extra.attached.nodes[0].state: 'fine' is not one of ok, failed, torn down, lost, interrupted, not started, "
     "unresponsive"),
])
def test_a_damaged_attached_record_is_named(key: str, value: object, problem: str) -> None:
    data = json.loads(record(attached=FINISHED).to_json())
    data["extra"]["attached"][key] = value
    with pytest.raises(RecordError) as raised:
        RunRecord.from_json(json.dumps(data), "r.json")
    assert str(raised.value) == f"r.json: {problem}"


def summary(code: int, *outcomes: NodeOutcome) -> RunSummary:
    return RunSummary(RUN, code, f"ended with {code}", outcomes, "/logs")


def outcome(name: str, state: str, code: int | None) -> NodeOutcome:
    return NodeOutcome(name, 0, state, code, 1.0, None, None, ())  # type: ignore[arg-type]


def test_how_an_attached_run_ended() -> None:
    start = AttachedRecord(1, None, "/l")
    ok = ending_of(start, summary(0, outcome("node0", "ok", 0)), None, 5.0)
    assert (ok.ending, ok.exit_code, ok.ended, ok.nodes) == ("finished", 0, 5.0, (NodeEnding("node0", "ok", 0),))
    assert ending_of(start, summary(130, outcome("node0", "interrupted", 130)), None, 5.0).ending == "interrupted"
    assert ending_of(start, summary(1), None, 5.0).ending == "failed"
    broken = ending_of(start, None, RuntimeError("bug"), 5.0)
    assert (broken.ending, broken.exit_code, broken.headline) == (
        "failed", 1, "the run's supervision failed: RuntimeError('bug')")


def test_a_node_state_per_ending() -> None:
    assert [(state.node, state.state, state.code, state.detail, state.stopped)
            for state in attached_node_states(record(), FAILED, False)] == [
        ("node0", "exited", 143, "torn down", True), ("node1", "exited", 1, "", False)]
    lost = replace(FAILED, nodes=(NodeEnding("node0", "lost", None),))
    assert [(state.node, state.state) for state in attached_node_states(record(), lost, False)] == [("node0", "lost")]


def test_log_lines_read_back_as_they_were_written() -> None:
    lines = [OutputLine("n", 3, "out", "loss 1.0"), OutputLine("n", 12, "err", "[rank 1] not a prefix"),
             OutputLine("n", None, "err", "warn"), OutputLine("n", None, "out", "torchrun: starting")]
    assert [parse_log_line("n", line.log_text()) for line in lines] == lines


def plan() -> Plan:
    return Cluster.from_hosts("node0,node1", python="/opt/py", workdir="/w").plan("train.py", nproc_per_node=2)


def state_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path / "state" / "torchherd" / "runs"


def cli(*args: str) -> tuple[int, str]:
    out = StringIO()
    code = main(list(args), console=make_console(out, width=400))
    return code, out.getvalue()


def test_the_record_is_written_at_the_start_and_at_the_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    runs = state_home(tmp_path, monkeypatch)
    made = plan()
    history = History.start(made, tmp_path / "logs", 10.0)
    path = runs / f"{made.run_id}.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(runs.stat().st_mode) == 0o700
    attached = attached_of(load(made.run_id))
    assert attached is not None
    assert attached == AttachedRecord(os.getpid(), attached.start, str(tmp_path / "logs" / made.run_id))
    assert main(["status", "--json", made.run_id[-6:]]) == 0
    document = json.loads(capsys.readouterr().out)
    assert (document["state"], document["attached"]["alive"]) == ("running", True)
    history.ended(summary(0, outcome("node0", "ok", 0), outcome("node1", "ok", 0)), None)
    assert main(["status", "--json", made.run_id[-6:]]) == 0
    document = json.loads(capsys.readouterr().out)
    assert (document["state"], document["attached"]["alive"], document["attached"]["exit_code"]) == (
        "finished", False, 0)
    assert [node["state"] for node in document["nodes"]] == ["exited", "exited"]


KILLED = """
import sys, time
from pathlib import Path
from torchherd.api import Cluster
from torchherd.engine.records.history import History
plan = Cluster.from_hosts("node0,node1", python="/opt/py", workdir="/w").plan("train.py", nproc_per_node=2)
History.start(plan, Path(sys.argv[1]), 10.0)
print(plan.run_id, flush=True)
time.sleep(60)
"""


def test_a_controller_killed_mid_run_is_not_called_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """kill -9 of the controller: its record still says running, its lock went with it:
    ``status`` says so, never running forever."""
    state_home(tmp_path, monkeypatch)
    process = subprocess.Popen([sys.executable, "-c", KILLED, str(tmp_path / "logs")], stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert process.stdout is not None
        run_id = process.stdout.readline().strip()
        assert main(["status", "--json", run_id]) == 0
        assert json.loads(capsys.readouterr().out)["state"] == "running"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert main(["status", "--json", run_id]) == 0
    document = json.loads(capsys.readouterr().out)
    assert (document["state"], [node["state"] for node in document["nodes"]]) == (
        "ended (controller gone)", ["unknown", "unknown"])
    assert document["nodes"][0]["detail"] == (f"the controller (pid {process.pid}) ended without recording how the "
                                              "run ended")


def test_status_of_one_attached_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "time", lambda: 220.0)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(100.0))
    ended = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(160.0)) + " (60s ago)"
    made = record(attached=FAILED)
    out = text_of(lambda console: render_status(console, made, attached_node_states(made, FAILED, False),
                                                attached=AttachedStatus(FAILED, False)))
    assert out == f"""\
run {RUN} (failed), started {started}:
train.py --lr 3e-4
┏━━━━━━━┳━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━┓
┃ node  ┃ state        ┃ since                         ┃ detail    ┃
┡━━━━━━━╇━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━┩
│ node0 │ exited (143) │ {ended} │ torn down │
│ node1 │ exited (1)   │ {ended} │           │
└───────┴──────────────┴───────────────────────────────┴───────────┘
attached run, ended: exit 1: node1 rank 3 failed first (exit 1): boom
logs in /logs/{RUN}
"""
    running = AttachedRecord(4242, 77, f"/logs/{RUN}")
    gone = text_of(lambda console: render_status(console, record(), attached_node_states(record(), running, False),
                                                 attached=AttachedStatus(running, False)))
    assert gone.splitlines()[:2] == [f"run {RUN} (ended (controller gone)), started {started}: train.py",
                                     "--lr 3e-4"]
    assert gone.splitlines()[-2:] == [
        "attached run: its controller (pid 4242) is gone without recording the end (killed, or this machine "
        "rebooted): the run ended with it", f"logs in /logs/{RUN}"]


def test_the_listing_has_attached_and_detached_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "time", lambda: 160.0)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(100.0)) + " (60s ago)"
    running = AttachedRecord(4242, 77, f"/logs/{RUN}")

    def row(run_id: str, attached: AttachedRecord, alive: bool) -> ListedRun:
        made = record(run_id, attached=attached)
        return ListedRun(made, attached_node_states(made, attached, alive), None, AttachedStatus(attached, alive))

    rows = [row("th-a", running, True), row("th-b", running, False), row("th-c", FINISHED, False),
            row("th-d", FAILED, False)]
    assert text_of(lambda console: render_runs(console, rows)) == f"""\
runs
┏━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━┓
┃ run  ┃ state                   ┃ started                       ┃ nodes                                ┃ command            ┃
┡━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━┩
│ th-a │ running                 │ {started} │ node0 running, node1 running         │ train.py --lr 3e-4 │
│ th-b │ ended (controller gone) │ {started} │ node0 unknown, node1 unknown         │ train.py --lr 3e-4 │
│ th-c │ finished                │ {started} │ node0 exited (0), node1 exited (0)   │ train.py --lr 3e-4 │
│ th-d │ failed                  │ {started} │ node0 exited (143), node1 exited (1) │ train.py --lr 3e-4 │
└──────┴─────────────────────────┴───────────────────────────────┴──────────────────────────────────────┴────────────────────┘
"""


def test_logs_of_an_attached_run_by_a_unique_prefix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state_home(tmp_path, monkeypatch)
    run_dir = tmp_path / "logs" / RUN
    run_dir.mkdir(parents=True)
    (run_dir / "node0.log").write_text("torchrun: starting\n[rank 0] loss 1.0\n[rank 1 stderr] warning: x\n")
    (run_dir / "node1.log").write_text("[rank 2] loss 1.1\n[rank 3] Traceback: boom\n[stderr] torchrun: failed\n")
    save(record(attached=replace(FAILED, log_dir=str(run_dir))))
    save(record("th-20240501-130000-999999"))  # another run: the prefix must still name one
    code, out = cli("logs", "abcdef")
    assert (code, out) == (1, """\
node0: torchrun: starting
node0:0: loss 1.0
node0:1: warning: x
node1:2: loss 1.1
node1:3: Traceback: boom
node1: torchrun: failed
torchherd: node0: stopped (torn down; exit code 143)
torchherd: node1: exited with code 1
""")  # piped: pdsh's node:rank: text
    code, out = cli("logs", "--node", "node0", "--rank", "1", "th-20240501-12")
    assert (code, out) == (1, """\
node0:1: warning: x
torchherd: node0: stopped (torn down; exit code 143)
""")


def test_logs_whose_files_are_gone_say_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state_home(tmp_path, monkeypatch)
    save(record(attached=replace(FINISHED, log_dir=str(tmp_path / "moved"))))
    code, out = cli("logs", RUN)
    assert (code, out) == (1, f"""\
torchherd: node0: cannot read its log ({tmp_path}/moved/node0.log): No such file or directory
torchherd: node1: cannot read its log ({tmp_path}/moved/node1.log): No such file or directory
""")


def test_stop_of_an_attached_run_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state_home(tmp_path, monkeypatch)
    save(record(attached=FINISHED))
    assert cli("stop", RUN) == (2, f"""\
error: run {RUN} is an attached run: torchherd stop stops detached runs
  hint: it has ended: torchherd status {RUN} says how
""")


def test_the_history_keeps_the_newest_attached_runs(tmp_path: Path) -> None:
    """Pruned oldest first, attached runs only: a detached run's record is the way back to
    its job, and a damaged record is shown by status, never removed."""
    for index in range(5):
        save(record(f"th-20240501-12000{index}-aaaaaa", float(index), FINISHED), tmp_path)
    detached = RunRecord.from_json(record("th-20240501-110000-dddddd", 0.0).to_json().replace(
        '"attached"', '"other"'))
    save(detached, tmp_path)
    (tmp_path / "th-20240501-100000-eeeeee.json").write_text("{")
    assert prune(tmp_path, keep=2) == ["th-20240501-120000-aaaaaa", "th-20240501-120001-aaaaaa",
                                       "th-20240501-120002-aaaaaa"]
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "th-20240501-100000-eeeeee.json", "th-20240501-110000-dddddd.json", "th-20240501-120003-aaaaaa.json",
        "th-20240501-120004-aaaaaa.json"]


def test_endings_tell_each_once_and_a_late_one_at_once() -> None:
    """A run's end is told to each ``when_done`` callback once; one added after the end is
    told at once; a callback's failure becomes what ``wait`` raises, and the others are
    still told."""
    import threading

    from torchherd.engine.run import Endings

    done = threading.Event()
    endings = Endings(done)
    told: list[tuple[str, object, object]] = []

    def failing(summary: object, error: object) -> None:
        told.append(("failing", summary, error))
        raise RuntimeError("recorder broke")

    endings.add(lambda summary, error: told.append(("first", summary, error)))
    endings.add(failing)
    endings.add(lambda summary, error: told.append(("third", summary, error)))
    raised = endings.end(None, None)
    assert done.is_set() and isinstance(raised, RuntimeError) and str(raised) == "recorder broke"
    assert [name for name, _, _ in told] == ["first", "failing", "third"]
    endings.add(lambda summary, error: told.append(("late", summary, error)))
    assert told[-1] == ("late", None, raised)
