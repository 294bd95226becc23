"""Real tests of the node supervisor, run locally (no SSH).

Each test starts the supervisor the way the controller does over SSH, as the
program shipped to the nodes: ``python -u -c PROGRAM JSON`` with its stdin and
stdout as pipes. Every
process a test starts carries a unique TORCHHERD_RUN_ID (or a unique marker)
and the ``harness`` fixture SIGKILLs all of them on the way out, pass or fail.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest

from torchherd.remote import argv, framing, proctable, wire
from torchherd.remote import supervisor as sv

SUPERVISOR = argv("supervisor.py")
PY = sys.executable


# ------------------------------------------------------------------ helpers


def proc_environ(pid: int) -> bytes:
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            return f.read()
    except OSError:
        return b""


def alive(pid: int) -> bool:
    """True when pid exists and is not a zombie."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read()
    except OSError:
        return False
    state = data[data.rfind(b")") + 2 :].split()[0]
    return state not in (b"Z", b"X")


def pids_with_marker(marker: bytes) -> List[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            if marker in proc_environ(int(name)).split(b"\0"):
                found.append(int(name))
    return found


def wait_until(cond: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


class Run:
    """One supervisor process and the records it wrote."""

    def __init__(self, proc: "subprocess.Popen[bytes]", run_id: str, read: bool = True) -> None:
        self.proc = proc
        self.run_id = run_id
        self.records: List[Tuple[bytes, bytes]] = []
        self.events: "queue.Queue[Tuple[bytes, bytes]]" = queue.Queue()
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, daemon=True)
        if read:
            self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            assert raw.endswith(b"\n"), raw
            rec = (raw[:1], raw[1:-1])
            with self.lock:
                self.records.append(rec)
            self.events.put(rec)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def close_stdin(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()

    def next_record(self, tag: bytes, timeout: float) -> bytes:
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError("no %r record within %ss" % (tag, timeout))
            try:
                rtag, payload = self.events.get(timeout=left)
            except queue.Empty:
                continue
            if rtag == tag:
                return payload

    def next_event(self, name: str, timeout: float) -> Dict[str, Any]:
        end = time.monotonic() + timeout
        while True:
            ev = json.loads(self.next_record(wire.TAG_STATUS, max(0.01, end - time.monotonic())))
            if ev["event"] == name:
                return dict(ev)

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout=timeout)
        if self.reader.is_alive():
            self.reader.join(timeout=10)
        return rc

    def payloads(self, tag: bytes) -> List[bytes]:
        with self.lock:
            return [p for t, p in self.records if t == tag]

    def status(self) -> List[Dict[str, Any]]:
        return [json.loads(p) for p in self.payloads(wire.TAG_STATUS)]


class Harness:
    def __init__(self) -> None:
        self.runs: List[Run] = []
        self.others: List["subprocess.Popen[bytes]"] = []
        self.markers: List[bytes] = []

    def start(
        self,
        argv: List[str],
        grace: float = 5.0,
        heartbeat: float = 30.0,
        watchdog: float = 0.0,
        env: Optional[Dict[str, str]] = None,
        cwd: Optional[str] = None,
        read: bool = True,
    ) -> Run:
        run_id = "test-" + uuid.uuid4().hex
        self.markers.append(("%s=%s" % (wire.RUN_ID_ENV, run_id)).encode())
        config = {
            "run_id": run_id,
            "argv": argv,
            "env": env or {},
            "cwd": cwd,
            "grace": grace,
            "heartbeat": heartbeat,
            "watchdog": watchdog,
        }
        proc = subprocess.Popen(
            [PY, *SUPERVISOR, json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        run = Run(proc, run_id, read=read)
        self.runs.append(run)
        return run

    def outside(self, code: str, env: Dict[str, str]) -> "subprocess.Popen[bytes]":
        """A process started by the test itself, not under any supervisor."""
        marker = "TORCHHERD_TEST_MARK=" + uuid.uuid4().hex
        self.markers.append(marker.encode())
        full = dict(os.environ)
        full.update(env)
        full["TORCHHERD_TEST_MARK"] = marker.split("=", 1)[1]
        proc = subprocess.Popen(
            [PY, "-c", code], env=full, start_new_session=True, stdout=subprocess.PIPE
        )
        self.others.append(proc)
        return proc

    def cleanup(self) -> None:
        for run in self.runs:
            if run.proc.poll() is None:
                run.proc.kill()
        for proc in self.others:
            if proc.poll() is None:
                proc.kill()
        for marker in self.markers:
            for pid in pids_with_marker(marker):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        for run in self.runs:
            try:
                run.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            for stream in (run.proc.stdin, run.proc.stdout):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass
        for proc in self.others:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    try:
        yield h
    finally:
        h.cleanup()


def py(code: str) -> List[str]:
    return [PY, "-c", textwrap.dedent(code)]


# -------------------------------------------------------------------- tests


@pytest.mark.timeout(30)
@pytest.mark.parametrize("code", [0, 3])
def test_exit_code_passthrough(harness: Harness, code: int) -> None:
    run = harness.start(py("import sys; print('hi'); sys.exit(%d)" % code))
    assert run.wait(20) == code
    events = run.status()
    assert [e["event"] for e in events] == ["started", "exit", "done"]
    assert events[0]["pid"] == events[0]["pgid"]
    assert events[1] == {"event": "exit", "code": code}
    assert events[2] == {"event": "done", "code": code, "left": 0}
    assert run.payloads(wire.TAG_STDOUT) == [b"hi"]
    assert run.records[-1][0] == wire.TAG_STATUS


@pytest.mark.timeout(30)
def test_signal_death_reports_128_plus_signal(harness: Harness) -> None:
    run = harness.start(py("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"))
    assert run.wait(20) == 137
    assert run.status()[-1] == {"event": "done", "code": 137, "left": 0}


@pytest.mark.timeout(30)
def test_stdout_stderr_separate_and_byte_exact(harness: Harness) -> None:
    out = b"plain\n\xff\xfe not utf-8 \x80\x00nul\n\ncarriage\r\ntabs\t\n" + b"last-no-newline"
    err = b"err one\n\xc3\x28 bad\n" + b"err-tail"
    code = """
        import os
        os.write(1, %r)
        os.write(2, %r)
    """ % (out, err)
    run = harness.start(py(code))
    assert run.wait(20) == 0
    assert run.payloads(wire.TAG_STDOUT) == out.split(b"\n")
    assert run.payloads(wire.TAG_STDERR) == err.split(b"\n")
    # everything the job wrote came before its exit event
    tags = [t for t, p in run.records if t != wire.TAG_HEARTBEAT]
    exit_at = [i for i, (t, p) in enumerate(run.records) if t == wire.TAG_STATUS and b'"exit"' in p]
    assert max(i for i, t in enumerate(tags) if t in (wire.TAG_STDOUT, wire.TAG_STDERR)) < exit_at[0]


@pytest.mark.timeout(120)
def test_many_lines_from_concurrent_children_all_arrive(harness: Harness) -> None:
    n_children, n_lines = 4, 50_000
    child = textwrap.dedent(
        """
        import os, sys
        c = sys.argv[1]
        batch = []
        for i in range(%d):
            batch.append("child %%s line %%d padding-padding-padding\\n" %% (c, i))
            if len(batch) == 64:
                os.write(1, "".join(batch).encode())
                batch = []
        if batch:
            os.write(1, "".join(batch).encode())
        """
        % n_lines
    )
    parent = """
        import subprocess, sys
        procs = [subprocess.Popen([sys.executable, "-c", %r, str(c)]) for c in range(%d)]
        sys.exit(max(p.wait() for p in procs))
    """ % (child, n_children)
    t0 = time.monotonic()
    run = harness.start(py(parent))
    assert run.wait(100) == 0
    elapsed = time.monotonic() - t0
    seen: Dict[str, List[int]] = {str(c): [] for c in range(n_children)}
    for payload in run.payloads(wire.TAG_STDOUT):
        parts = payload.split(b" ")
        assert (
            len(parts) == 5 and parts[0] == b"child" and parts[4] == b"padding-padding-padding"
        ), payload
        seen[parts[1].decode()].append(int(parts[3]))
    for c in seen:
        assert sorted(seen[c]) == list(range(n_lines)), "child %s lost or duplicated lines" % c
    assert run.status()[-1] == {"event": "done", "code": 0, "left": 0}
    print("\n%d lines through the supervisor in %.2fs" % (n_children * n_lines, elapsed))


TREE = """
    import os, subprocess, sys, time
    FULL = "SELF = %r\\n" % SELF + SELF
    if len(sys.argv) == 1:
        # the job: a child in its own session, which starts a grandchild in
        # yet another session
        subprocess.Popen([sys.executable, "-c", FULL, "child"], start_new_session=True)
        os.write(1, b"job %d\\n" % os.getpid())
        time.sleep(600)
    elif sys.argv[1] == "child":
        subprocess.Popen([sys.executable, "-c", FULL, "grandchild"], start_new_session=True)
        os.write(1, b"child %d\\n" % os.getpid())
        time.sleep(600)
    else:
        os.write(1, b"grandchild %d\\n" % os.getpid())
        time.sleep(600)
"""


def tree_argv() -> List[str]:
    code = "SELF = %r\n" % textwrap.dedent(TREE) + textwrap.dedent(TREE)
    return [PY, "-c", code]


def collect_pids(run: Run, names: List[str], timeout: float) -> Dict[str, int]:
    pids: Dict[str, int] = {}
    while set(names) - set(pids):
        words = run.next_record(wire.TAG_STDOUT, timeout).split()
        pids[words[0].decode()] = int(words[1])
    return pids


@pytest.mark.timeout(60)
def test_stdin_eof_kills_whole_tree_across_sessions(harness: Harness) -> None:
    run = harness.start(tree_argv(), grace=5.0)
    pids = collect_pids(run, ["job", "child", "grandchild"], 30)
    assert len({os.getsid(p) for p in pids.values()}) == 3
    assert all(alive(p) for p in pids.values())
    run.close_stdin()
    rc = run.wait(30)
    assert rc == 143
    for name, pid in pids.items():
        assert not alive(pid), "%s %d survived" % (name, pid)
    td = [e for e in run.status() if e["event"] == "teardown"]
    assert len(td) == 1 and td[0]["reason"] == "stdin closed"
    assert set(pids.values()) <= set(td[0]["signalled"])
    assert td[0]["killed"] == []
    assert run.status()[-1] == {"event": "done", "code": 143, "left": 0}


@pytest.mark.timeout(60)
def test_term_escalates_to_sigkill_after_grace(harness: Harness) -> None:
    grace = 1.5
    code = """
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("ready", os.getpid(), flush=True)
        time.sleep(600)
    """
    run = harness.start(py(code), grace=grace)
    pid = int(run.next_record(wire.TAG_STDOUT, 30).split()[1])
    t0 = time.monotonic()
    run.send("TERM")
    done = run.next_event("done", grace + 10)
    elapsed = time.monotonic() - t0
    assert grace - 0.1 <= elapsed <= grace + 2.0, elapsed
    assert done == {"event": "done", "code": 137, "left": 0}
    assert run.wait(10) == 137
    assert not alive(pid)
    td = [e for e in run.status() if e["event"] == "teardown"][0]
    assert td["reason"] == "control TERM"
    assert pid in td["signalled"] and pid in td["killed"]


@pytest.mark.timeout(60)
def test_kill_is_immediate(harness: Harness) -> None:
    code = """
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", os.getpid(), flush=True)
        time.sleep(600)
    """
    run = harness.start(py(code), grace=30.0)
    pid = int(run.next_record(wire.TAG_STDOUT, 30).split()[1])
    t0 = time.monotonic()
    run.send("KILL")
    assert run.wait(10) == 137
    assert time.monotonic() - t0 < 2.0
    assert not alive(pid)
    td = [e for e in run.status() if e["event"] == "teardown"][0]
    assert td["signalled"] == [] and pid in td["killed"]


@pytest.mark.timeout(60)
def test_graceful_term_lets_the_job_exit_cleanly(harness: Harness) -> None:
    code = """
        import signal, sys, time
        def bye(*_):
            print("cleaning up", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, bye)
        print("ready", flush=True)
        time.sleep(600)
    """
    run = harness.start(py(code), grace=10.0)
    run.next_record(wire.TAG_STDOUT, 30)
    run.send("TERM")
    assert run.wait(10) == 0
    assert run.payloads(wire.TAG_STDOUT) == [b"ready", b"cleaning up"]
    assert run.status()[-1] == {"event": "done", "code": 0, "left": 0}


@pytest.mark.timeout(60)
def test_a_job_that_dies_of_the_stop_with_its_own_code_is_recorded_as_stopped(harness: Harness) -> None:
    """torchrun's agent turns SIGTERM into SignalException and exit 1: the exit record says
    the supervisor had signalled it first, so no follower reads it as a failure."""
    code = """
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
        print("ready", flush=True)
        time.sleep(600)
    """
    run = harness.start(py(code), grace=10.0)
    run.next_record(wire.TAG_STDOUT, 30)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(10) == 1
    exits = [e for e in run.status() if e["event"] == "exit"]
    assert exits == [{"event": "exit", "code": 1, "stopped": "signal SIGTERM"}]


@pytest.mark.timeout(60)
def test_supervisor_sigterm_is_a_graceful_teardown(harness: Harness) -> None:
    run = harness.start(tree_argv(), grace=5.0)
    pids = collect_pids(run, ["job", "child", "grandchild"], 30)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(20) == 143
    assert not any(alive(p) for p in pids.values())
    td = [e for e in run.status() if e["event"] == "teardown"][0]
    assert td["reason"] == "signal SIGTERM"


@pytest.mark.timeout(60)
def test_watchdog_tears_down_when_controller_goes_quiet(harness: Harness) -> None:
    code = """
        import os, time
        print("ready", os.getpid(), flush=True)
        time.sleep(600)
    """
    watchdog = 1.0
    run = harness.start(py(code), watchdog=watchdog, grace=2.0)
    pid = int(run.next_record(wire.TAG_STDOUT, 30).split()[1])
    # controller heartbeats keep it alive well past the watchdog period
    for _ in range(8):
        run.send("")
        time.sleep(0.3)
    assert run.proc.poll() is None and alive(pid)
    t0 = time.monotonic()
    stopping = run.next_event("stopping", 10)
    assert stopping["reason"].startswith("watchdog")
    assert time.monotonic() - t0 <= watchdog + 1.0
    assert run.wait(20) == 143
    assert not alive(pid)
    td = [e for e in run.status() if e["event"] == "teardown"][0]
    assert td["reason"].startswith("watchdog") and pid in td["signalled"]


ESCAPE = """
    import os, sys, time
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.close(r)
            os.write(w, str(os.getpid()).encode())
            os.close(w)
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            time.sleep(600)
            os._exit(0)
        os._exit(0)
    os.close(w)
    pid = int(os.read(r, 100))
    os.wait()
    print("escaped", pid, flush=True)
    time.sleep(0.5)
"""


@pytest.mark.timeout(60)
def test_double_forked_escapee_is_swept_when_job_ends(harness: Harness) -> None:
    run = harness.start(py(ESCAPE), grace=5.0)
    pid = int(run.next_record(wire.TAG_STDOUT, 30).split()[1])
    assert alive(pid)
    # the subreaper keeps the escapee in the supervisor's tree
    assert wait_until(lambda: _ppid(pid) == run.proc.pid, 5)
    assert run.wait(30) == 0
    assert not alive(pid)
    events = run.status()
    td = [e for e in events if e["event"] == "teardown"][0]
    assert td["reason"] == "leftover" and pid in td["signalled"]
    assert events[-1] == {"event": "done", "code": 0, "left": 0}


def _ppid(pid: int) -> int:
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read()
    except OSError:
        return -1
    return int(data[data.rfind(b")") + 2 :].split()[1])


SLEEPER = "import time; print('up', flush=True); time.sleep(600)"


@pytest.mark.timeout(60)
def test_environ_match_outside_tree_is_killed_other_runs_are_not(harness: Harness) -> None:
    run = harness.start(py("import time; print('ready', flush=True); time.sleep(600)"), grace=3.0)
    run.next_record(wire.TAG_STDOUT, 30)
    job = next(e for e in run.status() if e["event"] == "started")["pid"]
    token = dict(entry.split(b"=", 1) for entry in proc_environ(job).split(b"\0") if b"=" in entry)[
        wire.SUPERVISOR_ENV.encode()].decode()
    # outside the supervisor's tree, yet started by its job: it carries the supervisor's token
    same = harness.outside(SLEEPER, {wire.RUN_ID_ENV: run.run_id, wire.SUPERVISOR_ENV: token})
    named = harness.outside(SLEEPER, {wire.RUN_ID_ENV: run.run_id})  # the run id alone is only a name
    other = harness.outside(SLEEPER, {wire.RUN_ID_ENV: "another-run", wire.SUPERVISOR_ENV: token})
    prefix = harness.outside(SLEEPER, {wire.RUN_ID_ENV: run.run_id + "x", wire.SUPERVISOR_ENV: token})
    sibling = harness.outside(
        SLEEPER, {wire.RUN_ID_ENV: run.run_id, wire.SUPERVISOR_ENV: "some-other-supervisor"}
    )
    for p in (same, named, other, prefix, sibling):
        assert p.stdout is not None and p.stdout.readline() == b"up\n"
    run.send("TERM")
    assert run.wait(20) == 143
    assert same.wait(5) == -signal.SIGTERM
    for spared in (named, other, prefix, sibling):
        assert spared.poll() is None and alive(spared.pid)
    td = [e for e in run.status() if e["event"] == "teardown"][0]
    assert same.pid in td["signalled"]
    assert not {named.pid, other.pid, prefix.pid, sibling.pid} & set(td["signalled"] + td["killed"])


@pytest.mark.timeout(60)
def test_stalled_channel_does_not_block_the_watchdog(harness: Harness) -> None:
    # Nobody reads the supervisor's stdout (the network is cut): the job's
    # output piles up, yet the watchdog still fires and the job is killed.
    code = """
        import os
        line = b"x" * 200 + b"\\n"
        while True:
            os.write(1, line * 100)
    """
    run = harness.start(py(code), watchdog=1.0, grace=1.0, heartbeat=0.1, read=False)
    marker = harness.markers[-1]
    assert wait_until(lambda: len(pids_with_marker(marker)) == 1, 10)
    assert run.proc.poll() is None
    assert wait_until(lambda: not pids_with_marker(marker), 15)
    # it gives up on the stalled channel and exits on its own
    assert run.proc.wait(timeout=sv.FINAL_FLUSH_STALL + 10) == 143


@pytest.mark.timeout(60)
def test_closed_output_channel_tears_down(harness: Harness) -> None:
    run = harness.start(tree_argv(), heartbeat=0.1, grace=2.0, read=False)
    marker = harness.markers[-1]
    assert wait_until(lambda: len(pids_with_marker(marker)) == 3, 20)
    pids = pids_with_marker(marker)
    assert run.proc.stdout is not None
    run.proc.stdout.close()
    assert run.proc.wait(timeout=20) == 143
    assert not any(alive(p) for p in pids)


@pytest.mark.timeout(30)
def test_heartbeats_arrive(harness: Harness) -> None:
    run = harness.start(py("import time; time.sleep(1.3)"), heartbeat=0.2)
    assert run.wait(20) == 0
    assert len(run.payloads(wire.TAG_HEARTBEAT)) >= 4
    assert all(p == b"" for p in run.payloads(wire.TAG_HEARTBEAT))


@pytest.mark.timeout(30)
def test_job_env_and_cwd(harness: Harness, tmp_path: Path) -> None:
    code = "import os; print(os.environ['FOO'], os.environ['TORCHHERD_RUN_ID'], os.getcwd())"
    run = harness.start(py(code), env={"FOO": "bar"}, cwd=str(tmp_path))
    assert run.wait(20) == 0
    assert run.payloads(wire.TAG_STDOUT) == [("bar %s %s" % (run.run_id, tmp_path)).encode()]


@pytest.mark.timeout(30)
def test_missing_command_reports_error_and_127(harness: Harness) -> None:
    run = harness.start(["/nonexistent/torchherd-no-such-command"])
    assert run.wait(20) == 127
    events = run.status()
    assert [e["event"] for e in events] == ["error", "done"]
    assert events[-1] == {"event": "done", "code": 127, "left": 0}


@pytest.mark.timeout(30)
def test_bad_config_exits_2() -> None:
    proc = subprocess.run(
        [PY, *SUPERVISOR, json.dumps({"run_id": "x", "argv": "not-a-list"})],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        timeout=20,
    )
    assert proc.returncode == 2
    lines = proc.stdout.splitlines()
    assert json.loads(lines[0][1:])["event"] == "error"
    assert json.loads(lines[-1][1:]) == {"event": "done", "code": 2, "left": 0}


# ---------------------------------------------------------------- pure parts


def test_line_framer_splits_and_flushes() -> None:
    f = framing.LineFramer(b"O", max_line=10)
    assert f.feed(b"ab") == b""
    assert f.feed(b"c\nde\n\nf") == b"Oabc\nOde\nO\n"
    assert f.feed(b"0123456789xyz") == b"Of0123456789xyz\n"
    assert f.feed(b"tail") == b""
    assert f.finish() == b"Otail\n"
    assert f.finish() == b""


def test_parse_config_defaults_and_errors() -> None:
    cfg = wire.SupervisorConfig.from_json(json.dumps({"run_id": "r", "argv": ["a"]}))
    assert (cfg.env, cfg.cwd, cfg.watchdog) == ({}, None, 0.0)
    with pytest.raises(wire.ConfigError):
        wire.SupervisorConfig.from_json("[]")
    with pytest.raises(wire.ConfigError):
        wire.SupervisorConfig.from_json(json.dumps({"run_id": "", "argv": ["a"]}))
    with pytest.raises(wire.ConfigError):
        wire.SupervisorConfig.from_json(json.dumps({"run_id": "r", "argv": ["a"], "grace": -1}))
    with pytest.raises(wire.ConfigError):
        wire.SupervisorConfig.from_json(json.dumps({"run_id": "r", "argv": ["a"], "env": {"A": 1}}))


def test_exit_code_from_status() -> None:
    assert proctable.exit_code_from_status(3 << 8) == 3
    assert proctable.exit_code_from_status(signal.SIGTERM) == 143


def test_status_record_is_one_line() -> None:
    rec = wire.status_record("exit", code=1, note="a\nb")
    assert rec.count(b"\n") == 1 and rec.startswith(wire.TAG_STATUS)


def test_rank_mender_joins_a_line_torchrun_tore_apart() -> None:
    """torchrun --tee copied rank 7's half-written line, then rank 6's whole line glued
    to it, then the rest of rank 7's line (seen in a benchmark run: one line in 800,000)."""
    mender = framing.RankMender(b"[M ")
    first = (b"[M 7] rank 7 line 51576 whole\n"
             b"[M 7] rank 7 line 51577 the qu[M 6] rank 6 line 42684 the quick brown fox\n")
    assert mender.mend(first) == b"[M 7] rank 7 line 51576 whole\n[M 6] rank 6 line 42684 the quick brown fox\n"
    assert mender.mend(b"[M 7] ick brown fox\n[M 6] next\n") == (b"[M 7] rank 7 line 51577 the quick brown fox\n"
                                                                 b"[M 6] next\n")
    assert mender.mend(b"[M 5] lo[M 5] ng[M 5] er\n") == b"[M 5] longer\n"
    assert mender.mend(b"[M 3] cut at the end[M 4] x\n") == b"[M 4] x\n"
    assert mender.finish() == b"[M 3] cut at the end\n"
    # a marker that is not followed by "N] " is a rank's own text, not a tear
    assert mender.mend(b"torchrun's own\n[M 2] plain [M not a rank\n") == b"torchrun's own\n[M 2] plain [M not a rank\n"


def test_line_framer_mends_across_chunks_and_flushes_at_the_end() -> None:
    framer = framing.LineFramer(b"O", mender=framing.RankMender(b"[M "))
    out = framer.feed(b"[M 1] a[M 0] b\n[M 1] c\n[M 0] d")
    out += framer.feed(b"e\n[M 2] held[M 0] f\n")
    out += framer.finish()
    assert out.split(b"\n")[:-1] == [b"O[M 0] b", b"O[M 1] ac", b"O[M 0] de", b"O[M 0] f", b"O[M 2] held"]
