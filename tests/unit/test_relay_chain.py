"""The controller's side of a relay chain (``engine.prepare.relay.run_chain``) as it ends:
behind the transport interface, programs that take a while to exit once told to (a
replication's relays run at the lowest CPU priority and, on a node whose CPUs are all
busy, take seconds to wake up)."""

from __future__ import annotations

import threading
import time
from typing import Callable

import pytest

from torchherd.engine.prepare import relay
from torchherd.engine.prepare.relay import Hop, run_chain


class SlowToEnd:
    """A relay program that says its port, then waits for its stdin to close and exits
    ``ending`` seconds later; what the controller did to it, in order, in ``log``."""

    def __init__(self, node: str, log: list[tuple[str, str]], ending: float) -> None:
        self.node, self.log, self.ending = node, log, ending
        self.said = False
        self.told = threading.Event()
        self.exited_at: float | None = None

    def send(self, data: bytes) -> bool:
        return True

    def close_stdin(self) -> None:
        self.log.append((self.node, "stdin closed"))
        self.told.set()

    def read(self, timeout: float) -> bytes | None:
        if not self.said:
            self.said = True
            return b'{"port": 4000}\n'
        return b"" if self.told.wait(timeout) else None

    def read_stderr(self) -> bytes:
        return b""

    def pump(self, on_stdout: Callable[[bytes], None], on_stderr: Callable[[bytes], None],
             deadline: float | None = None) -> None:
        raise AssertionError("not used by a chain")

    def exit_code(self, timeout: float | None = None) -> int | None:
        if not self.told.wait(timeout):
            return None
        wait = self.ending if timeout is None else min(self.ending, timeout)
        time.sleep(wait)
        if wait < self.ending:
            return None
        self.exited_at = time.monotonic()
        self.log.append((self.node, "exited"))
        return 1

    def close(self) -> None:
        self.log.append((self.node, "channel closed"))


class Node:
    def __init__(self, program: SlowToEnd) -> None:
        self.program = program
        self.node = program.node

    def start(self, command: str) -> SlowToEnd:
        return self.program


def chain(ending: float) -> tuple[list[Hop], list[SlowToEnd], list[tuple[str, str]]]:
    log: list[tuple[str, str]] = []
    programs = [SlowToEnd(name, log, ending) for name in ("node0", "node1")]
    hops = [Hop(program.node, Node(program), "relay", "10.0.0.1") for program in programs]  # type: ignore[arg-type]
    return hops, programs, log


def test_a_chain_given_up_returns_once_its_programs_have_ended_not_when_it_let_go_of_them() -> None:
    hops, programs, log = chain(ending=0.4)
    result = run_chain(hops, {}, 0, stopping=lambda: True)
    returned = time.monotonic()
    assert result == {"node0": "given up: the run was interrupted", "node1": "given up: the run was interrupted"}
    for program in programs:
        assert program.exited_at is not None and program.exited_at <= returned
        steps = [what for node, what in log if node == program.node]
        assert steps == ["stdin closed", "exited", "channel closed"], log


def test_programs_that_do_not_end_are_let_go_of_after_end_seconds_in_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay, "END_SECONDS", 0.5)
    hops, programs, log = chain(ending=60.0)
    started = time.monotonic()
    run_chain(hops, {}, 0, stopping=lambda: True)
    took = time.monotonic() - started
    assert 0.5 <= took < 5.0  # both waited for within the one bound, not one each
    assert [what for _, what in log] == ["stdin closed", "stdin closed", "channel closed", "channel closed"]


class Received(SlowToEnd):
    """A receiver that holds its copy: it says its port, then ok, then waits to be told to end."""

    def read(self, timeout: float) -> bytes | None:
        if not self.said:
            self.said = True
            return b'{"port": 4000}\n{"ok": true}\n'
        return b"" if self.told.wait(timeout) else None


def test_a_chain_given_up_keeps_what_its_programs_had_said() -> None:
    """The receiver said ok (its copy is in place), then the run was interrupted before the
    source's last answer: the receiver's copy stands, only the source is given up."""
    log: list[tuple[str, str]] = []
    programs = [SlowToEnd("node0", log, 0.0), Received("node1", log, 0.0)]
    hops = [Hop(program.node, Node(program), "relay", "10.0.0.1") for program in programs]  # type: ignore[arg-type]
    interrupted = time.monotonic() + 1.0
    result = run_chain(hops, {}, 0, stopping=lambda: time.monotonic() > interrupted)
    assert result == {"node0": "given up: the run was interrupted", "node1": None}
