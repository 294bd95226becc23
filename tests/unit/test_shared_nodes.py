"""Nodes shared with other users: another local user must gain nothing.

The node scripts run here as the controller runs them over SSH (``python -c PROGRAM``,
pipes); the engine runs on the local transport. Attacks that need a second user create
one (``useradd``, as root) and are skipped, saying why, when this is not root."""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from support.processes import run_supervisor
from torchherd.api import Cluster
from torchherd.engine.events import Collector, NodeNotStarted
from torchherd.engine.run import LaunchOptions
from torchherd.engine.ssh.launch import launch
from torchherd.remote import argv, wire
from torchherd.transport.local import LocalConnector

PY = sys.executable
FAKE = str(Path(__file__).parent / "fakes" / "fake_torchrun.py")


def supervise(config: wire.SupervisorConfig, timeout: float = 30) -> list[bytes]:
    """The supervisor's records, run to the end with its stdin open (the controller's way)."""
    return run_supervisor(config, timeout)[1].splitlines()


def status(records: list[bytes], event: str) -> dict[str, object]:
    return next(json.loads(record[1:]) for record in records if record.startswith(b'S{"event":"%s"' % event.encode()))


def as_user(user: str, command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["runuser", "-u", user, "--", "sh", "-c", command], capture_output=True, text=True,
                          timeout=30, cwd="/")


# item 1: torchrun's log directory ------------------------------------------------------


def test_the_log_directory_is_made_private_by_the_supervisor_and_removed(tmp_path: Path) -> None:
    log_dir = tmp_path / "torchherd-t1-n0"
    code = "import os, sys; print(oct(os.stat(sys.argv[1]).st_mode & 0o777), sys.argv[1])"
    records = supervise(wire.SupervisorConfig(run_id="t1", argv=(PY, "-c", code, str(log_dir)), heartbeat=0,
                                              cleanup_dir=str(log_dir)))
    said = next(record for record in records if record.startswith(b"O0o"))
    used = said.split()[1].decode()
    assert said.startswith(b"O0o700 ") and used.startswith(f"{log_dir}-"), said  # a fresh name of its own
    assert status(records, "done")["code"] == 0
    assert not Path(used).exists() and not log_dir.exists()


def test_a_log_directory_made_first_by_someone_else_is_never_used_nor_refused(tmp_path: Path) -> None:
    """The name an attempt's log directory would have is public (the run id is in every
    process list): made first by someone else, it is neither used (their planted files
    never reach the output) nor a reason to refuse the attempt; each attempt makes a fresh
    private directory of its own (``mkdtemp``)."""
    log_dir = tmp_path / "torchherd-t2-n0"
    planted = log_dir / "none_x" / "attempt_0" / "0"
    planted.mkdir(parents=True)
    (planted / "stdout.log").write_text("I am rank 0, trust me\n")
    ran = tmp_path / "ran"
    code = f"import sys; open({str(ran)!r}, 'w').write(sys.argv[2])"
    for _ in range(2):  # a retried attempt too
        records = supervise(wire.SupervisorConfig(run_id="t2", argv=(PY, "-c", code, "--log-dir", str(log_dir)),
                                                  heartbeat=0, cleanup_dir=str(log_dir), rank_logs=str(log_dir)))
        assert status(records, "done")["code"] == 0, records
        assert ran.read_text().startswith(f"{log_dir}-"), "torchrun's --log-dir: the fresh directory"
        assert not any(b"trust me" in record for record in records)
        assert (planted / "stdout.log").exists(), "not ours: never removed"
        assert [path.name for path in tmp_path.iterdir() if path.name.startswith("torchherd-")] == [log_dir.name]


def test_every_node_has_its_own_log_directory() -> None:
    cluster = Cluster(["a", "b"], python="python3")
    plan = cluster.plan("train.py", run_id="t3")
    dirs = [node.remote_log_dir for node in plan.nodes]
    assert dirs == ["/tmp/torchherd-t3-a", "/tmp/torchherd-t3-b"]
    assert all(node.argv[node.argv.index("--log-dir") + 1] == node.remote_log_dir for node in plan.nodes)


def test_another_user_who_made_the_log_directory_first_gets_nothing(other_user: str, tmp_path: Path) -> None:
    run_id = "t4-" + uuid.uuid4().hex[:8]
    log_dir = f"/tmp/torchherd-{run_id}-n0"
    made = as_user(other_user, f"mkdir -m 777 {log_dir} && mkdir -p {log_dir}/x/attempt_0/0 && "
                               f"echo planted > {log_dir}/x/attempt_0/0/stdout.log")
    assert made.returncode == 0, made.stderr
    try:
        cluster = Cluster([{"name": "n0", "address": "127.0.0.1"}], python=PY, workdir=str(tmp_path),
                          connector=LocalConnector())
        plan = cluster.plan("train.py", run_id=run_id)
        node = plan.nodes[0]
        from dataclasses import replace

        plan = replace(plan, nodes=(replace(node, argv=(PY, FAKE, "ranks=0", "lines=1")),))
        events = Collector()
        summary = launch(plan, LaunchOptions(check=False, log_dir=tmp_path / "logs", grace=1.0), LocalConnector(),
                         events).wait(timeout=60)
        assert summary.exit_code == 0, "the attempt runs, in a fresh directory of its own"
        assert not events.of(NodeNotStarted)
        assert any(line.text for line in events.lines.get("n0", []))
        assert not any("planted" in line.text for line in events.lines.get("n0", []))
        assert pwd.getpwuid(os.stat(log_dir).st_uid).pw_name == other_user, "theirs, left as it was"
    finally:
        subprocess.run(["rm", "-rf", log_dir], check=False)


# items 2 and 3: the detached run's coordinator --------------------------------------------

COORDINATOR = argv("coordinator.py")
TOKENS = {"a": "a" * 32, "b": "b" * 32, "c": "c" * 32}


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[int]:
    """A coordinator for nodes a, b, c on 127.0.0.1; its port. Killed afterwards."""
    run_id = "tc-" + uuid.uuid4().hex[:8]
    config = wire.CoordinatorConfig(run_id, TOKENS, "127.0.0.1", str(tmp_path / "coordinator.json"), 30.0)
    done = subprocess.run([PY, *COORDINATOR, "-", run_id], input=config.to_line(), capture_output=True,
                          timeout=30)
    assert done.returncode == 0, done
    reply = wire.CoordinatorReply.from_json(done.stdout.decode())
    try:
        yield reply.port
    finally:
        try:
            os.kill(reply.pid, 9)
        except OSError:
            pass


def connect(port: int, host: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection((host, port), timeout=10)


def said_hello(port: int, node: str, token: str | None = None) -> socket.socket:
    sock = connect(port)
    sock.sendall(wire.hello_line(token or TOKENS[node], node))
    return sock


def closed(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(100) == b""
    except (socket.timeout, ConnectionResetError):
        return False


def test_the_coordinator_tokens_never_reach_a_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from support.engine import faked

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    home = tmp_path / "home"
    home.mkdir()
    connector = LocalConnector(env={"*": {"HOME": str(home)}})
    cluster = Cluster([{"name": f"n{index}", "address": "127.0.0.1"} for index in range(2)], python=PY,
                      workdir=str(tmp_path), nproc_per_node=2, connector=connector)
    run_id = "tk-" + uuid.uuid4().hex[:8]
    run = cluster.launch(faked(cluster.plan("train.py", run_id=run_id), n0="sleep=30", n1="sleep=30"),
                         check=False, detach=True, grace=1.0)
    try:
        pid = run.record.coordinator.pid  # type: ignore[union-attr]
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert run_id.encode() in cmdline
        assert b"token" not in cmdline and not re.search(rb"[0-9a-f]{32}", cmdline)
    finally:
        run.stop()


def test_a_hello_counts_only_with_the_node_own_token_once(coordinator: int) -> None:
    a, b = said_hello(coordinator, "a"), said_hello(coordinator, "b")
    time.sleep(0.3)
    for node, token in (("a", TOKENS["a"]), ("a", TOKENS["b"]), ("x", TOKENS["a"]), ("c", TOKENS["a"])):
        impostor = said_hello(coordinator, node, token)
        assert closed(impostor, 5), f"HELLO {node} with {token[:1]}'s token was taken"
        impostor.close()  # an accepted impostor that leaves would read as "a vanished": STOP to all
    time.sleep(0.5)
    for sock in (a, b):
        sock.settimeout(0.5)
        with pytest.raises(socket.timeout):
            sock.recv(100)  # nobody was told to stop
    b.sendall(wire.exit_line("b", 3))
    a.settimeout(5)
    assert a.recv(100) == b"STOP b exited with code 3\n"


def test_the_coordinator_listens_on_the_master_address_only(coordinator: int) -> None:
    with pytest.raises(ConnectionRefusedError):
        connect(coordinator, "127.0.0.2")  # a local address, but not the master's


def test_a_silent_connection_is_closed_and_strangers_are_capped(coordinator: int) -> None:
    silent = connect(coordinator)
    assert closed(silent, 10), "a connection that never said HELLO was kept"
    crowd = [connect(coordinator) for _ in range(100)]
    assert closed(crowd[0], 5), "the oldest stranger makes room"
    a = said_hello(coordinator, "a")
    b = said_hello(coordinator, "b")
    b.sendall(wire.exit_line("b", 1))
    a.settimeout(5)
    assert a.recv(100) == b"STOP b exited with code 1\n"
    for sock in crowd:
        sock.close()


def test_a_peer_that_never_reads_cannot_freeze_the_coordinator(coordinator: int) -> None:
    a = connect(coordinator)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    a.sendall(wire.hello_line(TOKENS["a"], "a"))
    b = said_hello(coordinator, "b")
    time.sleep(0.3)
    b.sendall(wire.exit_line("b", 1))
    time.sleep(0.3)
    # a never reads, and asks again and again: each answer would be a STOP line to it
    flood = wire.hello_line(TOKENS["a"], "a") * 300000
    sender = threading.Thread(target=lambda: a.sendall(flood), daemon=True)
    sender.start()
    time.sleep(2.0)
    c = said_hello(coordinator, "c")
    c.settimeout(5)
    assert c.recv(100) == b"STOP b exited with code 1\n", "the coordinator still answers the others"


# item 4: stop ends what the run started, nothing by name ------------------------------------


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:].split()[0] not in (b"Z", b"X")


def test_stop_never_kills_a_process_that_only_names_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from support.engine import faked

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    home = tmp_path / "home"
    home.mkdir()
    cluster = Cluster([{"name": "n0", "address": "127.0.0.1"}, {"name": "n1", "address": "127.0.0.1"}], python=PY,
                      workdir=str(tmp_path), nproc_per_node=2, connector=LocalConnector(env={"*": {"HOME": str(home)}}))
    run_id = "ts-" + uuid.uuid4().hex[:8]
    run = cluster.launch(faked(cluster.plan("train.py", run_id=run_id), n0="sleep=60", n1="sleep=60"),
                         check=False, detach=True, grace=1.0)
    log = home / ".torchherd" / "runs" / run_id / "n0.log"
    bystanders = [
        subprocess.Popen(["tail", "-f", str(log)], stdout=subprocess.DEVNULL),  # someone following the log
        subprocess.Popen([PY, "-c", "import time; time.sleep(120)", f"notes-{run_id}.md"]),  # a name only
        subprocess.Popen(["sleep", "120"], env={**os.environ, wire.RUN_ID_ENV: run_id}),  # the run id, no token
    ]
    job = [int(pid) for pid in subprocess.run(["pgrep", "-f", "fake_torchrun"], capture_output=True,
                                              text=True).stdout.split()]
    try:
        assert run.stop() == {"n0": [], "n1": []}
        assert all(process.poll() is None for process in bystanders), "stop killed a bystander"
        assert not [pid for pid in job if alive(pid) and run_id.encode() in environ_of(pid)]
        coordinator = run.record.coordinator  # type: ignore[union-attr]
        assert coordinator is not None and not alive(coordinator.pid)
    finally:
        for process in bystanders:
            process.kill()
            process.wait()


def test_stop_as_root_spares_another_users_process_named_after_the_run(other_user: str, tmp_path: Path) -> None:
    run_id = "tu-" + uuid.uuid4().hex[:8]
    theirs = subprocess.Popen(["runuser", "-u", other_user, "--", "env", f"{wire.RUN_ID_ENV}={run_id}", "sh", "-c",
                               "sleep 120", f"vim notes-{run_id}.md"], cwd="/")
    try:
        time.sleep(0.5)
        state_file = tmp_path / "n0.state.json"
        state_file.write_text(json.dumps({"run_id": run_id, "supervisor": theirs.pid, "start": 1, "token": "x"}))
        done = subprocess.run([PY, *argv("stop.py"), run_id, "1", str(state_file)], capture_output=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        assert theirs.poll() is None, "stop killed another user's process"
    finally:
        theirs.kill()
        theirs.wait()


# item 5: everything a run writes is private to its user ---------------------------------------


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)  # the usual umask: files 0644, directories 0755 unless told otherwise
    try:
        yield
    finally:
        os.umask(old)


def test_a_detached_run_writes_only_private_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   umask_022: None) -> None:
    from support.engine import faked

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    (tmp_path / "state" / "torchherd" / "runs").mkdir(parents=True, mode=0o755)  # as an older version left it
    home = tmp_path / "home"
    (home / ".torchherd" / "runs").mkdir(parents=True, mode=0o755)
    run_id = "tm-" + uuid.uuid4().hex[:8]
    (home / ".torchherd" / "runs" / run_id).mkdir(mode=0o755)  # e.g. another node's, on a shared home
    cluster = Cluster([{"name": "n0", "address": "127.0.0.1"}, {"name": "n1", "address": "127.0.0.1"}], python=PY,
                      workdir=str(tmp_path), nproc_per_node=2, connector=LocalConnector(env={"*": {"HOME": str(home)}}))
    run = cluster.launch(faked(cluster.plan("train.py", run_id=run_id), n0="lines=2", n1="lines=2"), check=False,
                         detach=True, grace=1.0)
    try:
        run_dir = home / ".torchherd" / "runs" / run_id
        assert mode(run_dir) == 0o700
        for name in ("n0.log", "n0.state.json", "n1.log", "n1.state.json", "coordinator.json"):
            assert mode(run_dir / name) == 0o600, name
        records = tmp_path / "state" / "torchherd" / "runs"
        assert mode(records) == 0o700 and mode(records / f"{run_id}.json") == 0o600
    finally:
        run.stop()


def test_an_attached_run_writes_only_private_logs(tmp_path: Path, umask_022: None) -> None:
    from support.engine import faked

    cluster = Cluster([{"name": "n0", "address": "127.0.0.1"}], python=PY, workdir=str(tmp_path), nproc_per_node=2,
                      connector=LocalConnector())
    plan = faked(cluster.plan("train.py", run_id="ta-" + uuid.uuid4().hex[:8]), n0="lines=2")
    summary = launch(plan, LaunchOptions(check=False, log_dir=tmp_path / "logs", grace=1.0), LocalConnector(),
                     Collector()).wait(timeout=60)
    assert summary.exit_code == 0
    run_dir = tmp_path / "logs" / plan.run_id
    assert mode(run_dir) == 0o700 and mode(run_dir / "n0.log") == 0o600


def test_a_log_directory_swapped_between_attempts_gets_nothing(other_user: str, tmp_path: Path) -> None:
    """``--log-dir`` in a directory others can write (a group project): between two
    attempts another user moves the run's directory away and puts theirs in its place,
    with a world-readable ``n0.log``. The next attempt writes on in the run's own
    directory (opened once, checked: ours, 0700), never into theirs."""
    import tempfile

    from support.engine import faked

    base = Path(tempfile.mkdtemp(prefix="th-project-", dir="/tmp"))  # the other user can reach it
    try:
        base.chmod(0o755)
        logs = base / "logs"
        logs.mkdir()
        logs.chmod(0o777)  # anyone may add and rename entries here (no sticky bit)
        cluster = Cluster([{"name": "n0", "address": "127.0.0.1"}], python=PY, workdir=str(tmp_path),
                          nproc_per_node=1, connector=LocalConnector())
        plan = faked(cluster.plan("train.py", run_id="tw-" + uuid.uuid4().hex[:8]), n0="lines=2")
        options = LaunchOptions(check=False, log_dir=logs, grace=1.0)
        assert launch(plan, options, LocalConnector(), Collector()).wait(timeout=60).exit_code == 0
        ours = logs / plan.run_id
        written = (ours / "n0.log").stat().st_size
        moved = logs / "moved-away"
        theirs = as_user(other_user, f"mv {ours} {moved} && mkdir -m 777 {ours} && touch {ours}/n0.log && "
                                     f"chmod 666 {ours}/n0.log")
        assert theirs.returncode == 0, theirs.stderr
        launch(plan, options, LocalConnector(), Collector()).wait(timeout=60)
        assert (ours / "n0.log").stat().st_size == 0, "nothing of the run in their file"
        assert pwd.getpwuid((ours / "n0.log").stat().st_uid).pw_name == other_user
        assert (moved / "n0.log").stat().st_size > written, "the second attempt went on in the run's own directory"
    finally:
        shutil.rmtree(base)


def test_a_job_that_cannot_start_leaves_no_log_directory(tmp_path: Path) -> None:
    log_dir = tmp_path / "torchherd-t6-n0"
    records = supervise(wire.SupervisorConfig(run_id="t6", argv=("/nonexistent/python",), heartbeat=0,
                                              cleanup_dir=str(log_dir)))
    assert status(records, "done")["code"] == 127
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(log_dir.name)]


def environ_of(pid: int) -> bytes:
    """A process's environment; empty once it is gone (it may end between two looks)."""
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""
