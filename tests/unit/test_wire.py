"""Both sides of the wire agree: the real supervisor, coordinator and stop programs, as
shipped to the nodes, fed with what the controller's helpers build and read back with
the controller's own parsers (``runlog``, the ``wire`` reply types).

The programs run in subprocesses, most of them under ``python -S -I`` from ``/`` with an
empty environment: no torchherd on ``sys.path``, as on a node where nothing is installed.
"""

from __future__ import annotations

import ast
import json
import os
import socket
import string
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from support.processes import killed_after, plant, wait_until
from torchherd import runlog
from torchherd.checks.gather import NODE_SCRIPTS, node_program, remote_source
from torchherd.engine.prepare.sync import frame
from torchherd.engine.records import parse_node_state
from torchherd.remote import DROP_START_DIRECTORY, PROGRAMS, SCRIPTS, argv, program, source, wire
from torchherd.runlog import OutputLine, Status, parse_records, parse_status

PY = sys.executable
BARE = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
"""The environment of a node's program: nothing that could point at the checkout."""


def bare_python(python: str = PY) -> list[str]:
    """An interpreter that sees only the standard library (no site, no PYTHON*, no cwd)."""
    return [python, "-S", "-I"]


def run_program(name: str, *args: str, stdin: bytes = b"", python: str = PY, timeout: float = 30,
                cwd: Path = Path("/")) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([python, *argv(name), *args], input=stdin, capture_output=True, cwd=cwd, env=BARE,
                          timeout=timeout)


def supervise(config: wire.SupervisorConfig, python: str = PY, cwd: Path = Path("/")) -> tuple[int, bytes, bytes]:
    """Runs the supervisor program as the controller does: the config line on stdin, which
    stays open (its EOF would mean the controller is gone) until the "done" record.
    Its exit status, stdout and stderr."""
    proc = subprocess.Popen([python, *argv("supervisor.py"), "-", config.run_id],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                            env=BARE)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out = b""
    try:
        proc.stdin.write(config.to_line())
        proc.stdin.flush()
        for line in proc.stdout:
            out += line
            if line.startswith(wire.status_head(wire.EVENT_DONE)):
                break
        proc.stdin.close()
        out += proc.stdout.read()
        return proc.wait(timeout=20), out, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def records(stdout: bytes) -> list[runlog.OutputLine | Status]:
    return parse_records("n0", [record for record in stdout.split(b"\n") if record])


def statuses(stdout: bytes) -> list[Status]:
    return [event for event in records(stdout) if isinstance(event, Status)]


@pytest.fixture
def run_id() -> Iterator[str]:
    yield from killed_after("wire-")


def job(code: str) -> tuple[str, ...]:
    return (PY, "-c", code)


# ------------------------------------------------------------ the constants


def test_controller_tags_are_the_supervisors_bytes() -> None:
    pairs = [(runlog.TAG_STDOUT, wire.TAG_STDOUT), (runlog.TAG_STDERR, wire.TAG_STDERR),
             (runlog.TAG_HEARTBEAT, wire.TAG_HEARTBEAT), (runlog.TAG_STATUS, wire.TAG_STATUS)]
    assert [(code, tag) for code, tag in pairs] == [(tag[0], tag) for _code, tag in pairs]
    assert [tag for _code, tag in pairs] == [b"O", b"E", b"H", b"S"]
    assert wire.HEARTBEAT_RECORD == b"H\n" and wire.CONTROLLER_HEARTBEAT == b"\n"
    assert runlog.OUT_HEAD == b"\nO[torchherd-rank " and runlog.ERR_HEAD == b"\nE[torchherd-rank "


def test_rank_prefix_is_unchanged_and_parses_back() -> None:
    assert wire.RANK_PREFIX_TEMPLATE == "[torchherd-rank ${rank}] "
    assert wire.RANK_PREFIX_HEAD == b"[torchherd-rank "
    assert wire.RANK_PREFIX_TEMPLATE == wire.RANK_PREFIX_HEAD.decode() + "${rank}" + wire.RANK_PREFIX_END.decode()
    # torchrun fills the template with string.Template
    line = string.Template(wire.RANK_PREFIX_TEMPLATE).safe_substitute(rank=17) + "hello"
    assert runlog.parse_output("n", runlog.STDOUT, line.encode()) == OutputLine("n", 17, runlog.STDOUT, "hello")


def test_stop_levels_are_ordered_and_only_term_and_kill_are_sent() -> None:
    term, kill, give_up = wire.StopLevel.TERM, wire.StopLevel.KILL, wire.StopLevel.GIVE_UP
    assert [level.value for level in wire.StopLevel] == ["TERM", "KILL", "GIVE UP"]
    assert term < kill < give_up and give_up > term and kill >= kill and sorted([give_up, term, kill]) == [
        term, kill, give_up]
    assert wire.control_line(term) == b"TERM\n" and wire.control_line(kill) == b"KILL\n"
    with pytest.raises(ValueError):
        wire.control_line(give_up)
    assert [wire.parse_control(wire.control_line(level)) for level in (term, kill)] == [term, kill]
    assert wire.parse_control(wire.CONTROLLER_HEARTBEAT) is None
    assert wire.parse_control(b"GIVE UP\n") is None and wire.parse_control(b" KILL \n") is kill


def test_every_status_builder_is_read_back_by_the_controller() -> None:
    built: dict[wire.StatusEvent, bytes] = {wire.EVENT_STARTED: wire.started_record(10, 10, 9), wire.EVENT_ERROR: wire.error_record("no"),
             wire.EVENT_STOPPING: wire.stopping_record("why", wire.MODE_KILL), wire.EVENT_EXIT: wire.exit_record(3),
             wire.EVENT_TEARDOWN: wire.teardown_record("why", {5, 4}, []), wire.EVENT_DONE: wire.done_record(3, 1),
             wire.EVENT_GPU: wire.gpu_record([(0, 87.0, 1024.0, 81920.0)]),
             wire.EVENT_PROGRESS: wire.progress_record(3, " 45%|####5     | 45/100"),
             wire.EVENT_BUSY: wire.busy_record(20, 7),
             wire.EVENT_CHECKPOINT: wire.checkpoint_record("snapshot.pt", 1024, 1700000000.25)}
    assert tuple(built) == wire.STATUS_EVENTS == ("started", "error", "stopping", "exit", "teardown", "done", "gpu",
                                                  "progress", "busy", "checkpoint")
    for event, record in built.items():
        assert record.startswith(wire.status_head(event)) and record.count(b"\n") == 1
        assert [record[0]] == [runlog.TAG_STATUS]
        assert parse_status("n", record[1:-1]).event == event
    assert parse_status("n", built["teardown"][1:-1]).fields == {
        "event": "teardown", "reason": "why", "signalled": [4, 5], "killed": []}
    assert parse_status("n", b'{"event":"nonsense"}').event == "garbled"
    assert parse_status("n", b"not json").event == "garbled"


SUPERVISOR_KEYS = {"run_id", "argv", "env", "cwd", "grace", "heartbeat", "watchdog", "cleanup_dir", "rank_marker",
                   "log_file", "state_file", "node", "coordinator", "rank_logs", "gpu_every", "rank_base",
                   "busy_every", "persist", "log_head", "container", "checkpoint", "warm_start"}


def test_supervisor_config_round_trips_with_todays_keys() -> None:
    config = wire.SupervisorConfig(
        run_id="r", argv=("python", "-c", "x"), env={"A": "b c"}, cwd="~/w", grace=2.5, heartbeat=1.0, watchdog=10.0,
        cleanup_dir="/tmp/torchherd-x", rank_marker=wire.RANK_PREFIX_HEAD.decode(), log_file="~/l.log",
        state_file="~/s.json", node="n0", coordinator=wire.CoordinatorAddress("10.0.0.1", 4000, "tok"), busy_every=2.0,
        warm_start="import sys")
    line = config.to_line()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert set(json.loads(line)) == SUPERVISOR_KEYS
    assert json.loads(line)["coordinator"] == {"host": "10.0.0.1", "port": 4000, "token": "tok"}
    assert wire.SupervisorConfig.from_json(line.decode()) == config
    attached = wire.SupervisorConfig(run_id="r", argv=("a",))
    assert wire.SupervisorConfig.from_json(attached.to_json()) == attached
    assert wire.SupervisorConfig.from_json('{"run_id": "r", "argv": ["a"]}') == attached
    persist = attached._replace(persist=True, log_file="~/l.log", log_head="==== torchherd: attempt 2 ====")
    assert wire.SupervisorConfig.from_json(persist.to_json()) == persist


@pytest.mark.parametrize(("config", "named"), [
    pytest.param({"persist": True}, "'persist' needs a 'log_file'", id="persist-without-log"),
    pytest.param({"persist": "yes", "log_file": "~/l"}, "'persist' must be true or false", id="persist-not-bool"),
    pytest.param({"log_head": "a\nb", "log_file": "~/l"}, "'log_head' must be one line", id="head-two-lines"),
])
def test_a_persist_config_is_checked(config: dict[str, object], named: str) -> None:
    with pytest.raises(wire.ConfigError, match=named):
        wire.SupervisorConfig.from_json(json.dumps({"run_id": "r", "argv": ["a"], **config}))


def test_other_configs_and_replies_round_trip() -> None:
    coordinator = wire.CoordinatorConfig("r", {"a": "a" * 32, "b": "b" * 32}, "10.0.0.1", "~/c.json", 120.0)
    assert set(json.loads(coordinator.to_json())) == {"run_id", "tokens", "host", "state_file", "wait"}
    assert coordinator.nodes == ("a", "b") and coordinator.to_line().count(b"\n") == 1
    assert wire.CoordinatorConfig.from_json(coordinator.to_json()) == coordinator
    reply = wire.CoordinatorReply(4000, 77)
    assert json.loads(reply.to_json()) == {"port": 4000, "pid": 77}
    assert wire.CoordinatorReply.from_json(reply.to_json()) == reply
    stopped = wire.StopReply(True, ("python -c x",))
    assert json.loads(stopped.to_json()) == {"was_running": True, "left": ["python -c x"]}
    assert wire.StopReply.from_json(stopped.to_json()) == stopped
    for bad in ("[]", "{", '{"port": "1", "pid": 2}'):
        with pytest.raises(ValueError):
            wire.CoordinatorReply.from_json(bad)


def test_coordinator_words() -> None:
    assert wire.hello_line("tok", "n0") == b"HELLO tok n0\n"
    assert wire.exit_line("n0", 3) == b"EXIT n0 3\n"
    assert wire.stop_line("n1 exited with code 3") == b"STOP n1 exited with code 3\n"
    assert wire.parse_stop(wire.stop_line("why").decode().strip()) == "why"
    assert wire.parse_stop("STOP") == "" and wire.parse_stop("HELLO x y") is None


# ----------------------------------------------------- the shipped programs


def test_node_programs_cannot_see_the_checkout() -> None:
    done = subprocess.run([*bare_python(), "-c", "import torchherd"], capture_output=True, cwd="/", env=BARE)
    assert done.returncode != 0 and b"ModuleNotFoundError" in done.stderr
    assert set(SCRIPTS) == {"supervisor.py", "coordinator.py", "stop.py", "hangprobe.py", "receive.py", "venv.py",
                            "checkpoint.py", "image.py", "zygote.py"}
    with pytest.raises(ValueError):
        program("wire.py")
    for name in SCRIPTS:
        text = program(name)
        assert "'" not in text and "\\" not in text  # shlex.quote only wraps it


def imports_of(file: str, text: str | None = None) -> set[str]:
    """The node modules a file of torchherd.remote (or ``text``) imports (``from torchherd.remote
    import wire``, ``from torchherd.remote.framing import X``), as file names."""
    found = set()
    for node in ast.walk(ast.parse(source(file) if text is None else text)):
        if isinstance(node, ast.ImportFrom) and node.module == "torchherd.remote":
            found |= {alias.name + ".py" for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchherd."):
            found.add((node.module or "").rsplit(".", 1)[-1] + ".py")
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("torchherd")}
    return found


def test_every_program_ships_each_module_it_imports_before_it() -> None:
    """On a node nothing but the payload is there: a module a program needs that is missing
    from it, or loaded after the module that imports it, would fail there only."""
    for name, modules in PROGRAMS.items():
        loaded: set[str] = set()
        for file in (*modules, name):
            assert imports_of(file) <= loaded, (name, file, imports_of(file) - loaded)
            loaded.add(file)
    assert imports_of("supervisor.py") == {"container.py", "wire.py", "framing.py", "proctable.py", "ranks.py",
                                            "flight.py", "savewatch.py", "pace.py"}
    assert imports_of("stop.py") == {"container.py", "wire.py", "proctable.py"}


def test_the_checks_node_scripts_ship_as_every_node_program_does() -> None:
    """The checks' scripts import the node modules (never a copy of them): each travels with
    what it imports, loaded before it, and starts by dropping the start directory."""
    for name, modules in NODE_SCRIPTS.items():
        loaded: set[str] = set()
        for file in modules:
            assert imports_of(file) <= loaded, (name, file, imports_of(file) - loaded)
            loaded.add(file)
        assert imports_of(name, remote_source(name)) <= loaded, name
        text = node_program(name)
        assert text.startswith(DROP_START_DIRECTORY) and "'" not in text and "\\" not in text
    assert imports_of("facts.py", remote_source("facts.py")) == {"proctable.py", "uvlock.py"}


@pytest.mark.timeout(60)
def test_node_programs_ignore_modules_planted_in_the_directory_they_start_in(tmp_path: Path, run_id: str) -> None:
    """Every node program starts in the job's workdir or the user's home: a ``json.py`` or
    ``base64.py`` there must not replace the standard module (the job's own imports are
    the job's business: it is a child, with the environment as it was)."""
    plant(tmp_path)
    config = wire.SupervisorConfig(run_id=run_id, argv=(PY, "-c", "print('ran')"), env={}, cwd=None, grace=2.0,
                                   heartbeat=0.0, watchdog=0.0)
    code, out, err = supervise(config, cwd=tmp_path)
    assert code == 0, err
    assert b"Oran\n" in out
    stop = run_program("stop.py", run_id, "1", "/nonexistent/s.json", cwd=tmp_path)
    assert stop.returncode == 0, stop.stderr
    assert wire.StopReply.from_json(stop.stdout.decode()) == wire.StopReply(False, ())
    coordinator = run_program("coordinator.py", "-", run_id, stdin=b"{}\n", cwd=tmp_path)
    assert coordinator.returncode == 2 and b"planted" not in coordinator.stderr, coordinator.stderr
    receive = run_program("receive.py", str(tmp_path / "dest"), str(tmp_path), stdin=frame({"want": {}}),
                          cwd=tmp_path)
    assert receive.returncode == 0, receive.stderr
    assert json.loads(receive.stdout)["dest"] == str(tmp_path / "dest")
    probe = run_program("hangprobe.py", run_id, "cpu", cwd=tmp_path)
    assert probe.returncode == 0 and json.loads(probe.stdout)["ranks"] == [], probe.stderr
    # and should a program ever be started without -I, its loader drops the start directory
    bare = subprocess.run([PY, "-c", program("stop.py"), run_id, "1", "/nonexistent/s.json"], capture_output=True,
                          cwd=tmp_path, env=BARE, timeout=30)
    assert bare.returncode == 0 and b"planted" not in bare.stderr, bare.stderr


def other_pythons() -> list[str]:
    """The oldest Python a node may have (3.8) and the newest, where this machine has
    them (pyenv's); nodes run whatever Python has their torch."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = []
    for pattern in ("3.8*/bin/python3.8", "3.13*/bin/python3.13"):
        for python in sorted(root.glob(pattern)):
            if subprocess.run([str(python), "-c", "pass"], capture_output=True, env=BARE).returncode == 0:
                found.append(str(python))
                break
    return found


PYTHONS = [PY, *other_pythons()]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("python", PYTHONS)
def test_supervisor_program_answers_a_bad_config_with_its_error_record(python: str) -> None:
    done = run_program("supervisor.py", json.dumps({"run_id": "x", "argv": "not-a-list"}), python=python)
    assert done.returncode == 2, done.stderr
    events = statuses(done.stdout)
    assert [event.event for event in events] == ["error", "done"]
    assert "argv" in events[0].fields["message"]
    assert events[1].fields == {"event": "done", "code": 2, "left": 0}
    done = run_program("supervisor.py", "-", "r", stdin=b"[]\n", python=python)
    assert done.returncode == 2 and [event.event for event in statuses(done.stdout)] == ["error", "done"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("python", PYTHONS)
def test_supervisor_program_runs_a_job_from_the_controllers_config(python: str, run_id: str) -> None:
    """The controller's config line on stdin, as it sends it; every record read by runlog."""
    code = ("import sys\n"
            "print('[torchherd-rank 3] out line')\n"
            "print('[torchherd-rank 1] err line', file=sys.stderr)\n"
            "print('plain')\n"
            "sys.exit(4)\n")
    config = wire.SupervisorConfig(run_id=run_id, argv=job(code), heartbeat=0.0, grace=2.0,
                                   rank_marker=wire.RANK_PREFIX_HEAD.decode())
    status, out, err = supervise(config, python)
    assert status == 4, out
    assert err == b""  # the controller shows a supervisor's stderr as the node's own lines
    events = records(out)
    # stdout and stderr are two pipes: their lines may come in either order
    lines = {event for event in events if isinstance(event, OutputLine)}
    assert lines == {OutputLine("n0", 1, "err", "err line"), OutputLine("n0", 3, "out", "out line"),
                     OutputLine("n0", None, "out", "plain")}
    names = [event.event for event in events if isinstance(event, Status)]
    assert names[0] == "started" and names[-2:] == ["exit", "done"]
    started, done_event = statuses(out)[0].fields, statuses(out)[-1].fields
    assert {type(started[key]) for key in ("pid", "pgid", "supervisor")} == {int}
    assert done_event == {"event": "done", "code": 4, "left": 0}


@pytest.mark.timeout(60)
def test_control_words_and_heartbeats_between_controller_and_supervisor(run_id: str) -> None:
    """The controller's heartbeat keeps the watchdog quiet; its TERM and KILL lines are the
    supervisor's stop levels; the supervisor's heartbeats come back as H records."""
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(60)"
    config = wire.SupervisorConfig(run_id=run_id, argv=job(code), heartbeat=0.2, watchdog=1.0, grace=30.0)
    proc = subprocess.Popen([PY, *argv("supervisor.py"), "-", run_id],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd="/", env=BARE)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(config.to_line())
        proc.stdin.flush()
        assert proc.stdout.readline().startswith(wire.status_head(wire.EVENT_STARTED))
        for _ in range(8):  # well past the watchdog
            proc.stdin.write(wire.CONTROLLER_HEARTBEAT)
            proc.stdin.flush()
            time.sleep(0.25)
        assert proc.poll() is None
        proc.stdin.write(wire.control_line(wire.StopLevel.TERM))
        proc.stdin.flush()
        time.sleep(0.5)
        proc.stdin.write(wire.control_line(wire.StopLevel.KILL))
        proc.stdin.flush()
        out = proc.stdout.read()
        assert proc.wait(timeout=20) == 137
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    found = statuses(out)
    assert [event.fields for event in found if event.event == "stopping"] == [
        {"event": "stopping", "reason": "control TERM", "mode": wire.MODE_TERM}]
    [teardown] = [event for event in found if event.event == "teardown"]
    assert teardown.fields["reason"] == "control TERM" and teardown.fields["killed"]
    assert out.count(b"\n" + wire.HEARTBEAT_RECORD) >= 3
    assert not [event for event in records(out) if isinstance(event, Status) and event.event == "garbled"]


def start_coordinator(config: wire.CoordinatorConfig) -> wire.CoordinatorReply:
    done = run_program("coordinator.py", "-", config.run_id, stdin=config.to_line())
    assert done.returncode == 0, done.stderr
    return wire.CoordinatorReply.from_json(done.stdout.decode().strip().splitlines()[-1])


@pytest.mark.timeout(60)
def test_coordinator_program_answers_a_bad_config_and_speaks_the_words(run_id: str, tmp_path: Path) -> None:
    bad = run_program("coordinator.py", "-", run_id, stdin=json.dumps({"run_id": run_id, "nodes": ["a"]}).encode())
    assert bad.returncode == 2 and bad.stdout == b"" and b"tokens" in bad.stderr
    state_file = tmp_path / "c" / "coordinator.json"
    tokens = {"n0": "0" * 32, "n1": "1" * 32}
    reply = start_coordinator(wire.CoordinatorConfig(run_id, tokens, "127.0.0.1", str(state_file), 10.0))
    n1 = socket.create_connection(("127.0.0.1", reply.port), timeout=5)
    n1.sendall(wire.hello_line(tokens["n1"], "n1"))
    # the other node is a real detached supervisor, started with the controller's config
    config = wire.SupervisorConfig(
        run_id=run_id, argv=job("import time\nwhile True: time.sleep(1)"), heartbeat=0.0, grace=2.0,
        log_file=str(tmp_path / "n0.log"), state_file=str(tmp_path / "n0.json"), node="n0",
        coordinator=wire.CoordinatorAddress("127.0.0.1", reply.port, tokens["n0"]))
    started = run_program("supervisor.py", "-", run_id, stdin=config.to_line())
    assert started.returncode == 0, started
    assert [event.event for event in statuses(started.stdout)] == ["started"]
    time.sleep(1.0)
    n1.sendall(wire.exit_line("n1", 1))

    def state() -> wire.NodeStateFile:
        try:
            return json.loads((tmp_path / "n0.json").read_text())  # type: ignore[no-any-return]
        except (OSError, ValueError):
            return {}

    assert wait_until(lambda: state().get("state") == wire.STATE_EXITED, 15)
    assert set(state()) == set(wire.NodeStateFile.__annotations__) - {"container"}  # only for a job in a container
    node = parse_node_state("n0", (tmp_path / "n0.json").read_text(), alive=False)
    assert (node.state, node.code) == ("exited", 143)
    log = statuses((tmp_path / "n0.log").read_bytes())
    [teardown] = [event for event in log if event.event == "teardown"]
    assert teardown.fields["reason"] == "coordinator: n1 exited with code 1"
    n1.close()
    assert wait_until(lambda: json.loads(state_file.read_text())["state"] == wire.STATE_EXITED, 15)
    coordinator_state = json.loads(state_file.read_text())
    assert set(coordinator_state) == set(wire.CoordinatorStateFile.__annotations__)
    assert coordinator_state["culprit"] == "n1"


@pytest.mark.timeout(60)
def test_stop_program_answers_bad_arguments_and_replies_in_json(run_id: str) -> None:
    for args in ((), (run_id,), (run_id, "x", "/s.json"), ("", "0", "/s.json"), ("../x", "1", "/s.json"),
                 (run_id, "1", ""), (run_id, "1", "/s.json", "/c.json", "extra")):
        bad = run_program("stop.py", *args)
        assert bad.returncode == 2 and bad.stdout == b"" and b"usage" in bad.stderr, args
    done = run_program("stop.py", run_id, "1", "/nonexistent/s.json")
    assert done.returncode == 0, done.stderr
    assert wire.StopReply.from_json(done.stdout.decode()) == wire.StopReply(False, ())


def test_the_one_state_file_writer_is_private_atomic_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """One writer for every state file (run records, the supervisor's and the coordinator's):
    0600 whatever the umask, a temporary of a random name (the coordinator's was a fixed
    ``.tmp`` of the default mode), nothing left beside it, even when the write fails."""
    import os
    import stat

    from torchherd.remote.wire import write_json_atomic, write_text_atomic

    target = tmp_path / "state.json"
    (tmp_path / "state.json.tmp").symlink_to(tmp_path / "elsewhere")  # the old fixed name, planted
    old = os.umask(0)
    try:
        write_json_atomic(str(target), {"state": "running", "pid": 7})
    finally:
        os.umask(old)
    assert target.read_text() == '{"state":"running","pid":7}'
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert not (tmp_path / "elsewhere").exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["state.json", "state.json.tmp"]
    (tmp_path / "state.json.tmp").unlink()
    with pytest.raises(OSError):
        write_text_atomic(str(tmp_path / "missing-dir" / "state.json"), "x")
    with pytest.raises(UnicodeEncodeError):
        write_text_atomic(str(target), "\udcff")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["state.json"]
    assert target.read_text() == '{"state":"running","pid":7}'
