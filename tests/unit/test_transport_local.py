"""The transport seam's in-process implementation behaves as an SSH channel without a
PTY does: streams apart, stdin open until closed, exit status or None, errors as
TransportError; and ``fan_out`` keeps order and its bound."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from torchherd.errors import TransportError
from torchherd.inventory import Host
from torchherd.transport import connect_all, fan_out
from torchherd.transport.local import LocalConnector, LocalSession


def host(name: str) -> Host:
    return Host(name=name, address="127.0.0.1", user=None, ssh_port=None, identity_file=None, python="python3",
                workdir="~", env={}, setup="", local_addr=None)


def test_run_keeps_stdout_stderr_and_the_exit_status_apart() -> None:
    result = LocalSession("n0").run("cat; echo oops >&2; exit 3", stdin=b"fed\n")
    assert (result.exit_code, result.stdout, result.stderr) == (3, b"fed\n", b"oops\n")


def test_a_command_past_its_timeout_is_an_error_and_is_killed(tmp_path: Path) -> None:
    marker = tmp_path / "late"
    began = time.monotonic()
    with pytest.raises(TransportError) as raised:
        LocalSession("n0").run(f"sleep 5; touch {marker}", timeout=0.5)
    assert raised.value.kind == "timeout" and "within 0.5 s" in str(raised.value)
    assert time.monotonic() - began < 3
    time.sleep(5.5)
    assert not marker.exists(), "the timed-out command went on running"


def test_a_started_process_reads_writes_and_ends_on_eof() -> None:
    process = LocalSession("n0").start("while read line; do echo got $line; done; echo bye >&2")
    assert process.read(0.05) is None, "nothing printed yet: None, not EOF"
    assert process.send(b"one\n")
    assert process.read(5.0) == b"got one\n"
    process.close_stdin()
    assert process.read(5.0) == b""
    assert process.exit_code(timeout=5) == 0
    assert process.read_stderr() == b"bye\n"
    assert not process.send(b"late\n")


def test_a_shell_killed_by_a_signal_has_no_exit_status() -> None:
    process = LocalSession("n0").start("kill -9 $$")
    assert process.exit_code(timeout=5) is None


def test_put_writes_a_private_new_file_and_refuses_an_existing_one(tmp_path: Path) -> None:
    session = LocalSession("n0")
    target = tmp_path / "config.json"
    session.put(str(target), b"{}", mode=0o600)
    assert target.read_bytes() == b"{}" and (os.stat(target).st_mode & 0o777) == 0o600
    with pytest.raises(TransportError):
        session.put(str(target), b"again")


def test_connect_all_reports_each_node_and_a_closed_session_refuses_work() -> None:
    results = connect_all(LocalConnector(unreachable=frozenset({"n1"})), [host("n0"), host("n1"), host("n2")])
    assert [type(result).__name__ for result in results.values()] == ["LocalSession", "TransportError", "LocalSession"]
    session = results["n0"]
    assert not isinstance(session, TransportError)
    session.close()
    with pytest.raises(TransportError):
        session.start("true")


def test_the_fan_out_says_which_nodes_succeeded_and_which_failed_and_closes_them() -> None:
    results = connect_all(LocalConnector(unreachable=frozenset({"n1"})), [host("n0"), host("n1"), host("n2")])
    assert list(results) == ["n0", "n1", "n2"]
    assert list(results.succeeded) == ["n0", "n2"]
    assert list(results.failed) == ["n1"] and results.failed["n1"].kind == "timeout"
    results.close()
    assert not any(session.is_alive() for session in results.succeeded.values())


def test_a_session_is_a_context_manager_that_closes_it() -> None:
    with LocalConnector().connect(host("n0")) as session:
        assert session.run("echo hi").stdout == b"hi\n"
    assert not session.is_alive()
    with pytest.raises(TransportError):
        session.start("true")


def test_fan_out_keeps_order_and_never_exceeds_its_bound() -> None:
    running, most, lock = [0], [0], threading.Lock()

    def work(item: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.01)
        with lock:
            running[0] -= 1
        return item * 2

    assert fan_out(list(range(50)), work, limit=4) == [item * 2 for item in range(50)]
    assert 1 < most[0] <= 4
    assert fan_out([], work) == []


def test_a_session_closed_while_its_command_writes_never_takes_another_commands_output() -> None:
    """Sessions closed while their commands still write, beside commands that start at that
    moment: each command's answer reaches its own caller. (Closing the pipes under the
    reader threads let a freed descriptor's number go to a new command's pipe, and an old
    reader took that command's output: 15 of 1,500 answers lost, an empty stdout with exit 0.)"""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # a thread switch at every chance, so the window is found
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            session = LocalSession("chatty")
            session.start("yes hello")
            session.start("yes hello >&2")
            time.sleep(0.002)
            session.close()

    churners = [threading.Thread(target=churn, daemon=True) for _ in range(4)]
    try:
        for thread in churners:
            thread.start()
        answers = fan_out(list(range(600)), lambda _: LocalSession("asked").run("echo answer", timeout=10).stdout,
                          limit=4)
    finally:
        stop.set()
        for thread in churners:
            thread.join()
        sys.setswitchinterval(interval)
    assert [answer for answer in answers if answer != b"answer\n"] == []
