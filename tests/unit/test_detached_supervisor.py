"""The supervisor's detached mode and the run coordinator, run locally (no SSH).

Every job carries a unique TORCHHERD_RUN_ID; the fixture SIGKILLs whatever still
carries one at the end, pass or fail.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from support.processes import killed_after, pids_with, wait_until
from torchherd.remote import argv, command, wire
from torchherd.remote import supervisor as sv

SUPERVISOR = argv("supervisor.py")
COORDINATOR = argv("coordinator.py")
PY = sys.executable


@pytest.fixture
def run_id() -> Iterator[str]:
    yield from killed_after("test-")


def start(run_id: str, tmp_path: Path, code: str, **extra: object) -> subprocess.CompletedProcess[bytes]:
    config = {"run_id": run_id, "argv": [PY, "-c", code], "grace": 2, "heartbeat": 0, "node": "n0",
              "log_file": str(tmp_path / "runs" / "n0.log"), "state_file": str(tmp_path / "runs" / "n0.state.json"),
              **extra}
    return subprocess.run([PY, *SUPERVISOR, json.dumps(config)], stdin=subprocess.PIPE,
                          capture_output=True, timeout=20)


def state(tmp_path: Path) -> dict[str, object]:
    try:
        return dict(json.loads((tmp_path / "runs" / "n0.state.json").read_text()))
    except (OSError, ValueError):
        return {}


@pytest.mark.timeout(30)
def test_detached_supervisor_returns_at_once_and_the_job_runs_on(run_id: str, tmp_path: Path) -> None:
    tee = tmp_path / "torchherd-tee"  # the supervisor makes it, and removes it at the end
    started = time.monotonic()
    # stdin is a pipe that closes right away: in detached mode that must not stop the job
    done = start(run_id, tmp_path, "import time\nfor i in range(5):\n print('line', i); time.sleep(0.2)",
                 cleanup_dir=str(tee))
    assert time.monotonic() - started < 5
    assert done.returncode == 0, done
    first = json.loads(done.stdout[1:])
    assert done.stdout.startswith(b"S") and first["event"] == "started"
    assert state(tmp_path)["state"] == "running"
    assert state(tmp_path)["supervisor"] == first["supervisor"]
    assert wait_until(lambda: state(tmp_path).get("state") == "exited", 15)
    assert state(tmp_path)["code"] == 0
    records = (tmp_path / "runs" / "n0.log").read_bytes().splitlines()
    assert [r for r in records if r.startswith(b"O")] == [b"Oline %d" % i for i in range(5)]
    assert json.loads(records[-1][1:]) == {"event": "done", "code": 0, "left": 0}
    assert not tee.exists()
    assert wait_until(lambda: not pids_with(run_id.encode()), 5)


@pytest.mark.timeout(30)
def test_detached_start_failure_is_reported_by_the_parent(run_id: str, tmp_path: Path) -> None:
    config = {"run_id": run_id, "argv": ["/nonexistent/torchherd-nothing"], "node": "n0",
              "log_file": str(tmp_path / "n0.log")}
    done = subprocess.run([PY, *SUPERVISOR, json.dumps(config)], capture_output=True, timeout=20)
    assert done.returncode == 1
    assert json.loads(done.stdout[1:])["event"] == "error"


@pytest.mark.timeout(30)
def test_tee_dir_with_another_name_is_never_removed(tmp_path: Path) -> None:
    keep = tmp_path / "precious"
    keep.mkdir()
    sv.remove_tee_dir(str(keep))
    assert keep.exists()
    gone = tmp_path / "torchherd-run"
    gone.mkdir()
    sv.remove_tee_dir(str(gone) + "/")
    assert not gone.exists()


def token(node: str) -> str:
    return f"secret-of-{node}-0123456789"


def start_coordinator(run_id: str, tmp_path: Path, nodes: list[str]) -> dict[str, int]:
    config = wire.CoordinatorConfig(run_id, {node: token(node) for node in nodes}, "127.0.0.1",
                                    str(tmp_path / "c" / "coord.json"), 10)
    done = subprocess.run([PY, *COORDINATOR, "-", run_id], input=config.to_line(), capture_output=True,
                          timeout=20)
    assert done.returncode == 0, done
    return dict(json.loads(done.stdout))


def hello(port: int, node: str, secret: str | None = None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(f"HELLO {secret or token(node)} {node}\n".encode())
    return sock


@pytest.mark.timeout(30)
def test_coordinator_stops_the_others_when_one_fails(run_id: str, tmp_path: Path) -> None:
    reply = start_coordinator(run_id, tmp_path, ["a", "b", "c"])
    a, b, c = (hello(reply["port"], node) for node in "abc")
    intruder = hello(reply["port"], "x", "wrong")
    assert intruder.recv(100) == b""
    b.sendall(b"EXIT b 3\n")
    assert a.recv(100) == b"STOP b exited with code 3\n"
    assert c.recv(100) == b"STOP b exited with code 3\n"
    assert json.loads((tmp_path / "c" / "coord.json").read_text())["culprit"] == "b"
    for sock, name in ((a, "a"), (c, "c")):
        sock.sendall(f"EXIT {name} 143\n".encode())
    for sock in (a, b, c):
        sock.close()
    assert wait_until(lambda: not pids_with(run_id.encode()), 5), "the coordinator did not exit"
    assert json.loads((tmp_path / "c" / "coord.json").read_text())["state"] == "exited"


@pytest.mark.timeout(30)
def test_coordinator_treats_a_vanished_supervisor_as_a_failure(run_id: str, tmp_path: Path) -> None:
    reply = start_coordinator(run_id, tmp_path, ["a", "b"])
    a, b = hello(reply["port"], "a"), hello(reply["port"], "b")
    time.sleep(0.2)
    b.close()
    assert a.recv(100) == b"STOP b vanished (its supervisor is gone)\n"
    a.close()
    assert wait_until(lambda: not pids_with(run_id.encode()), 5)


@pytest.mark.timeout(40)
def test_detached_supervisor_tears_down_on_stop_from_the_coordinator(run_id: str, tmp_path: Path) -> None:
    reply = start_coordinator(run_id, tmp_path, ["n0", "other"])
    other = hello(reply["port"], "other")
    done = start(run_id, tmp_path, "import time\nwhile True: time.sleep(1)",
                 coordinator={"host": "127.0.0.1", "port": reply["port"], "token": token("n0")})
    assert done.returncode == 0, done
    time.sleep(1.0)
    other.sendall(b"EXIT other 1\n")
    assert wait_until(lambda: state(tmp_path).get("state") == "exited", 15)
    assert state(tmp_path)["code"] == 143
    log = (tmp_path / "runs" / "n0.log").read_text()
    assert "coordinator: other exited with code 1" in log
    other.close()


# ------------------------------------------------------------------ stop

STOP = argv("stop.py")
CHILD = "import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint(os.getpid(), flush=True)\n" \
        "time.sleep(600)"
PARENT = f"""
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], start_new_session=True, stdout=subprocess.PIPE)
print(os.getpid(), child.stdout.readline().decode().strip(), flush=True)
time.sleep(600)
"""


def tree(run_id: str, token: str | None = None) -> tuple[subprocess.Popen[bytes], list[int]]:
    """A job's process tree, started outside any supervisor: a parent and, in a session of
    its own, a child that ignores SIGTERM; both carry TORCHHERD_RUN_ID=run_id, and with a
    ``token`` TORCHHERD_SUPERVISOR=token, as a job's processes that left their supervisor's tree do."""
    env = {**os.environ, wire.RUN_ID_ENV: run_id, **({wire.SUPERVISOR_ENV: token} if token else {})}
    proc = subprocess.Popen([PY, "-c", PARENT], env=env, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    return proc, [int(pid) for pid in proc.stdout.readline().split()]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rfind(b")") + 2:].split()[0] not in (b"Z", b"X")


def stop(run_id: str, state_file: Path, grace: float) -> wire.StopReply:
    done = subprocess.run([PY, *STOP, run_id, str(grace), str(state_file)],
                          capture_output=True, cwd="/", env={"PATH": os.environ["PATH"]}, timeout=30)
    assert done.returncode == 0, done.stderr
    return wire.StopReply.from_json(done.stdout.decode())


@pytest.mark.timeout(40)
def test_stop_kills_exactly_the_runs_processes(run_id: str, tmp_path: Path) -> None:
    state_file = tmp_path / "n0.state.json"  # its supervisor gone, its job's processes left
    state_file.write_text(json.dumps({"run_id": run_id, "supervisor": 1, "start": -1, "token": "t0ken"}))
    mine, mine_pids = tree(run_id, "t0ken")
    other_id = "test-" + uuid.uuid4().hex
    other, other_pids = tree(other_id, "t0ken")
    same_run, same_run_pids = tree(run_id)  # the run id alone is a name, not a token
    try:
        assert all(alive(pid) for pid in mine_pids + other_pids + same_run_pids)
        reply = stop(run_id, state_file, 1.0)
        assert reply == wire.StopReply(was_running=False, left=())
        assert mine.wait(timeout=5) == -signal.SIGTERM
        assert wait_until(lambda: not any(alive(pid) for pid in mine_pids), 5)
        assert all(alive(pid) for pid in other_pids), "stop touched another run"
        assert all(alive(pid) for pid in same_run_pids), "stop touched a process without the token"
        assert alive(1), "pid 1 did not start at the recorded time: not the supervisor"
    finally:
        for pid in pids_with(other_id.encode()) + same_run_pids:
            os.kill(pid, signal.SIGKILL)
        for proc in (mine, other, same_run):
            proc.kill()
            proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()


@pytest.mark.timeout(60)
def test_stop_ends_a_detached_supervisor_and_its_job(run_id: str, tmp_path: Path) -> None:
    done = start(run_id, tmp_path, "import time\nwhile True: time.sleep(1)")
    assert done.returncode == 0, done
    supervisor = int(json.loads(done.stdout[1:])["supervisor"])
    token = str(state(tmp_path)["token"])
    stray, stray_pids = tree(run_id, token)  # outside the supervisor's tree, yet carries its token
    try:
        reply = stop(run_id, tmp_path / "runs" / "n0.state.json", 2.0)
        assert reply == wire.StopReply(was_running=True, left=())
        assert not alive(supervisor) and not any(alive(pid) for pid in stray_pids)
        assert not [pid for pid in pids_with(run_id.encode()) if alive(pid)]
        assert state(tmp_path)["state"] == "exited" and state(tmp_path)["code"] == 143
        assert state(tmp_path)["stopped"] == "signal SIGTERM"
    finally:
        stray.kill()
        stray.wait()
        assert stray.stdout is not None
        stray.stdout.close()


@pytest.mark.timeout(60)
def test_stops_of_nodes_sharing_a_process_table_do_not_kill_each_other(run_id: str, tmp_path: Path) -> None:
    """Two nodes of one run on one machine, stopped at once: each stop's command line holds
    the run id, yet neither stop (nor its shell) is taken for a process of the run."""
    supervisors = []
    for node in ("n0", "n1"):
        done = start(run_id, tmp_path, "import time\nwhile True: time.sleep(1)", node=node,
                     log_file=str(tmp_path / f"{node}.log"), state_file=str(tmp_path / f"{node}.json"))
        assert done.returncode == 0, done
        supervisors.append(int(json.loads(done.stdout[1:])["supervisor"]))
    line = "{} {} {} 2 {}"  # no exec: the shell's command line holds the run id too
    stops = [subprocess.Popen(["sh", "-c", line.format(PY, command("stop.py"), run_id, tmp_path / f"{node}.json")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for node in ("n0", "n1")]
    replies = [stop.communicate(timeout=40) for stop in stops]
    assert [stop.returncode for stop in stops] == [0, 0], replies
    assert [wire.StopReply.from_json(out.decode()).left for out, _err in replies] == [(), ()]
    assert not [pid for pid in pids_with(run_id.encode()) if alive(pid)]


@pytest.mark.timeout(40)
def test_a_persist_supervisor_runs_on_when_its_controller_is_gone(run_id: str, tmp_path: Path) -> None:
    """Persist mode (a detached run with retries): the records go to the channel and the
    node's log (after the attempt's marker); the channel's end and SIGHUP leave the job
    running, SIGTERM (``stop``) tears it down."""
    log = tmp_path / "runs" / "n0.log"
    supervisor = persist_supervisor(run_id, tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(60)",
                                    read_on=False, log_head="==== attempt 2 ====")
    assert supervisor.stdin is not None and supervisor.stdout is not None
    assert wait_until(lambda: b"Oup\n" in log.read_bytes(), 10)
    supervisor.stdin.close()  # the controller is gone: its channel ends both ways
    supervisor.stdout.close()
    supervisor.send_signal(signal.SIGHUP)
    time.sleep(1.5)
    assert supervisor.poll() is None and state(tmp_path)["state"] == "running"
    records = log.read_bytes().splitlines()
    assert records[:2] == [b"O==== attempt 2 ====", b"S" + json.dumps(
        {"event": "started", "pid": state(tmp_path)["pid"], "pgid": state(tmp_path)["pgid"],
         "supervisor": supervisor.pid}, separators=(",", ":")).encode()]
    assert b"H" not in records  # heartbeats are for a live controller only
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(15) == 143
    assert state(tmp_path)["state"] == "exited" and state(tmp_path)["code"] == 143
    assert json.loads(log.read_bytes().splitlines()[-1][1:]) == {"event": "done", "code": 143, "left": 0}
    assert wait_until(lambda: not pids_with(run_id.encode()), 5)
    assert oct(log.stat().st_mode & 0o777) == "0o600" and oct(log.parent.stat().st_mode & 0o777) == "0o700"


def persist_supervisor(run_id: str, tmp_path: Path, job: str = "import time\nwhile True: time.sleep(1)",
                       read_on: bool = True, **extra: object) -> subprocess.Popen[bytes]:
    """A persist supervisor (a detached run with retries) of node n0, its job (Python
    source) running; with ``read_on``, a thread reads its channel on, as a controller does."""
    config = {"run_id": run_id, "argv": [PY, "-c", job], "grace": 2,
              "heartbeat": 0.2, "node": "n0", "persist": True, "log_file": str(tmp_path / "runs" / "n0.log"),
              "state_file": str(tmp_path / "runs" / "n0.state.json"), **extra}
    supervisor = subprocess.Popen([PY, *SUPERVISOR, "-", run_id], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL)
    assert supervisor.stdin is not None and supervisor.stdout is not None
    supervisor.stdin.write(json.dumps(config).encode() + b"\n")
    supervisor.stdin.flush()
    assert supervisor.stdout.readline().startswith(b'S{"event":"started"')
    if read_on:
        threading.Thread(target=supervisor.stdout.read, daemon=True).start()  # the controller reads on
    return supervisor


@pytest.mark.timeout(40)
def test_a_persist_supervisor_obeys_the_coordinator_once_its_controller_is_gone(run_id: str,
                                                                                tmp_path: Path) -> None:
    """While the controller lives (its heartbeats come), it recovers: the coordinator's
    STOP is held. Once its channel ends, the held STOP tears the job down."""
    reply = start_coordinator(run_id, tmp_path, ["n0", "other"])
    other = hello(reply["port"], "other")
    supervisor = persist_supervisor(run_id, tmp_path,
                                    coordinator={"host": "127.0.0.1", "port": reply["port"], "token": token("n0")})
    assert supervisor.stdin is not None
    time.sleep(1.0)  # n0 has said HELLO
    other.sendall(b"EXIT other 1\n")
    for _ in range(8):  # 2 s of heartbeats: the controller lives, the job runs on
        supervisor.stdin.write(wire.CONTROLLER_HEARTBEAT)
        supervisor.stdin.flush()
        time.sleep(0.25)
    assert supervisor.poll() is None and state(tmp_path)["state"] == "running"
    supervisor.stdin.close()  # the controller is gone
    assert supervisor.wait(15) == 143
    log = (tmp_path / "runs" / "n0.log").read_text()
    assert "coordinator: other exited with code 1 (the controller is gone)" in log, log
    assert state(tmp_path)["code"] == 143
    other.close()
    assert wait_until(lambda: not pids_with(run_id.encode()), 5)


@pytest.mark.timeout(40)
def test_a_persist_supervisor_takes_a_silent_controller_for_gone(run_id: str, tmp_path: Path) -> None:
    """A controller whose machine went away closes no channel: the watchdog's silence
    counts as gone, for a held STOP only (a silent controller alone stops nothing)."""
    reply = start_coordinator(run_id, tmp_path, ["n0", "other"])
    other = hello(reply["port"], "other")
    supervisor = persist_supervisor(run_id, tmp_path, watchdog=2.0,
                                    coordinator={"host": "127.0.0.1", "port": reply["port"], "token": token("n0")})
    time.sleep(3.0)  # silent past the watchdog, nothing held: the job runs on
    assert supervisor.poll() is None and state(tmp_path)["state"] == "running"
    other.sendall(b"EXIT other 1\n")
    assert supervisor.wait(15) == 143
    assert "(the controller is gone)" in (tmp_path / "runs" / "n0.log").read_text()
    other.close()
    assert wait_until(lambda: not pids_with(run_id.encode()), 5)
