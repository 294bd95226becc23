"""The SSH side of the checks: run the remote scripts and parse what they print."""

from __future__ import annotations

import functools
import json
import shlex
import time
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any, Mapping

from torchherd.checks.model import Json, NodeFacts
from torchherd.errors import TransportError
from torchherd.inventory import Host
from torchherd.remote import shipped
from torchherd.shell import quote_path
from torchherd.transport import Process, Session

NODES_AT_ONCE = 24
"""Nodes the checks connect to at once (one thread each, beside paramiko's thread per
connection). A thread only connects and starts the node's facts: the facts are read
after, by one thread, while every node's script runs. The handshakes are mostly the
controller's CPU (key exchange, signatures): 24 at once overlap one's round trips with
the others' CPU even at WAN latencies, and more would only add threads."""
FALLBACK_PYTHON = "python3"
"""Used for the facts when the configured python does not run, so the other checks still report."""


NODE_SCRIPTS: dict[str, tuple[str, ...]] = {
    "facts.py": ("container.py", "wire.py", "proctable.py", "uvlock.py"),
    "bandwidth.py": (),
    "smoke.py": (),
}
"""Each node script of the checks (``torchherd.checks.remote``) and the modules of
``torchherd.remote`` it imports, in the order they are loaded: they travel as every node
program does (``remote.shipped``), so a script imports what the other end has, never a copy."""


def remote_source(name: str) -> str:
    return resources.files("torchherd.checks.remote").joinpath(name).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=None)
def node_program(script: str) -> str:
    """The self-contained ``python -c`` program that runs the checks' node script ``script``
    (one of NODE_SCRIPTS); its first line drops the start directory from sys.path
    (``remote.DROP_START_DIRECTORY``)."""
    return shipped(script, remote_source(script), NODE_SCRIPTS[script])


def python_command(python: str, script: str, config: Mapping[str, Any], stdlib_only: bool = True) -> str:
    # The python by the one rule ``run`` follows too: a path (or a name on PATH), quoted,
    # a leading ~/ expanded; never shell text (a ";" in it must not run during the check).
    # -S skips site-packages (.pth files can cost 100+ ms of CPU per start), which a
    # standard-library script never needs; it matters with hundreds of nodes per core.
    # -I keeps the directory it starts in and PYTHON* variables out of its imports, as for
    # every node program (torchherd.remote.FLAGS); not with torch, which a user's
    # PYTHONPATH or site-packages may be what finds.
    # Without -I the start directory (the home directory) would come first on sys.path: the
    # program's first line drops it before anything is imported.
    flags = "-I -S " if stdlib_only else ""
    return f"{quote_path(python)} {flags}-c {shlex.quote(node_program(script))} {shlex.quote(json.dumps(config))}"


@dataclass
class FactsSession:
    """What one node's facts round trip gave: the facts, how long its shell took to
    start, and (when asked) the probes' listener, still running until ``stop``."""

    facts_node: str
    facts: NodeFacts
    shell_seconds: float | None
    listener: Process | None = None
    reader: LineReader | None = None
    bound: Json | None = None

    def stop(self) -> None:
        if self.listener is not None:
            stop_listener(self.listener)


@dataclass
class _Failed:
    exit_code: int | None
    stderr: str


MAX_LINE = 8 << 20
"""The longest line a node's script may answer (a facts document of a large cluster's
/etc/hosts is well under): beyond, the node is given up, not held in memory."""
LATE = 1.0
"""How long a read past its deadline goes on taking what is already there (the nodes'
answers are read one after the other, the later ones after the deadline, however long
after): a node that keeps sending without a newline is given up then."""


class LineBuffer:
    """Bytes read from a node, cut into lines: one bytearray, each byte looked at once for
    a newline (never ``bytes +=`` and a scan of it all at every read). A line that grows
    past ``cap`` without its end breaks it: nothing more is held (a node that never sends
    a newline does not fill this machine's memory). Shared by every reader of a node
    program's answers (``LineReader`` here, ``engine.prepare.sync.Lines``)."""

    def __init__(self, cap: int = MAX_LINE) -> None:
        self.cap = cap
        self.data = bytearray()
        self.scanned = 0
        self.broken = False

    def add(self, chunk: bytes) -> None:
        if not self.broken:
            self.data += chunk

    def take(self) -> bytes | None:
        """The next whole line without its newline; None while there is none (or once broken)."""
        end = self.data.find(b"\n", self.scanned)
        if end < 0:
            self.scanned = len(self.data)
            if len(self.data) > self.cap:
                self.broken = True
                self.data, self.scanned = bytearray(), 0
            return None
        line = bytes(self.data[:end])
        del self.data[:end + 1]
        self.scanned = 0
        return line


class LineReader:
    """A remote process's stdout, line by line; what follows a line is kept for the next."""

    def __init__(self, process: Process) -> None:
        self.process = process
        self.lines = LineBuffer()

    @property
    def broken(self) -> bool:
        """A line longer than MAX_LINE came: nothing more is read from this process."""
        return self.lines.broken

    def line(self, deadline: float) -> bytes | None:
        """The next line without its newline, or None at EOF, when the deadline passes
        without one, or after MAX_LINE bytes without one; what has arrived by then counts
        even when it is read later (what is there is taken for up to LATE). The clock is
        looked at on every read: a node that keeps sending without a newline is given up
        in time too."""
        found = self.lines.take()
        if found is not None:
            return found
        late = max(time.monotonic(), deadline) + LATE  # reading what is there, past the deadline: this long
        while True:
            now = time.monotonic()
            left = deadline - now
            if self.lines.broken or now > late:
                return None
            chunk = self.process.read(min(0.2, max(left, 0.0)))
            if chunk is None:
                if left <= 0:
                    return None
                continue
            if not chunk:
                return None
            self.lines.add(chunk)
            found = self.lines.take()
            if found is not None:
                return found


@dataclass
class StartedFacts:
    """A node's facts command, started; ``finish_facts`` reads its answer."""

    connection: Session
    config: Mapping[str, Any]
    timeout: float
    process: Process
    reader: LineReader
    sent: float
    deadline: float


def facts_command(python: str, config: Mapping[str, Any]) -> str:
    # One SSH command does it all: the facts (the shell's startup time among them), then
    # the listener keeps running. Every extra round trip costs a login shell on each
    # node, which is what dominates.
    return "exec " + python_command(python, "facts.py", config, stdlib_only=not config.get("torch", True))


def start_facts(connection: Session, config: Mapping[str, Any], timeout: float, python: str) -> StartedFacts:
    """Starts remote/facts.py with ``python``, answering within ``timeout``; raises
    TransportError when the command cannot start. Started on every node first and read
    after, the scripts run at once and no controller thread waits on a node."""
    sent, started = time.time(), time.monotonic()
    process = connection.start(facts_command(python, config))
    return StartedFacts(connection, config, timeout, process, LineReader(process), sent, started + timeout)


def finish_facts(started: StartedFacts, host: Host) -> FactsSession:
    """The facts a started command printed (run again with python3 when the node's python
    does not run, so the other checks still report); raises TransportError when no facts
    came back."""
    outcome = _answer(started)
    python_error = ""
    if isinstance(outcome, _Failed) and outcome.exit_code in (126, 127):
        python_error = f"{host.python}: {_last_line(outcome.stderr, outcome.exit_code)}"
        outcome = _answer(start_facts(started.connection, started.config, started.timeout, FALLBACK_PYTHON))
    if isinstance(outcome, _Failed):
        reason = python_error or _last_line(outcome.stderr, outcome.exit_code)
        raise TransportError(host.name, "facts", f"{host.name}: the facts script failed: {reason}")
    if python_error:
        outcome.facts = replace(outcome.facts, python_error=python_error)
    return outcome


def _answer(started: StartedFacts) -> FactsSession | _Failed:
    connection, config, reader, process = started.connection, started.config, started.reader, started.process
    deadline, sent = started.deadline, started.sent
    facts_line, received = reader.line(deadline), time.time()
    try:
        raw = json.loads((facts_line or b"").decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        return _failure(process)
    if not isinstance(raw, dict):  # every analysis reads it as an object: anything else is this node's failure
        stop_listener(process)
        raise TransportError(connection.node, "facts",
                             f"{connection.node}: the facts script's answer is not a JSON object")
    shell = raw.get("shell_seconds")
    # a number in range only (a huge int would raise OverflowError as a float; NaN compares False)
    shell_seconds = float(shell) if isinstance(shell, (int, float)) and not isinstance(shell, bool) and \
        0 <= shell <= 3600 else None
    session = FactsSession(connection.node, NodeFacts(raw=raw, sent=sent, received=received), shell_seconds)
    if not config.get("listen"):
        stop_listener(process)
        return session
    bound_line = reader.line(deadline)
    try:
        session.bound = json.loads((bound_line or b"").decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        session.bound = None
    if not isinstance(session.bound, dict):
        stop_listener(process)
        raise TransportError(connection.node, "probe", f"{connection.node}: the listener did not start")
    session.listener, session.reader = process, reader
    return session


def _failure(process: Process) -> _Failed:
    code = process.exit_code(timeout=2.0)
    stderr = process.read_stderr()
    process.close()
    return _Failed(code, stderr.decode("utf-8", "replace"))


def _last_line(stderr: str, exit_code: int | None) -> str:
    lines = stderr.strip().splitlines()
    return lines[-1] if lines else f"exit status {exit_code}"


def stop_listeners(sessions: list[FactsSession]) -> None:
    """Every node's listener told to end at once, then each waited for: a few hundred
    nodes take one listener's exit, not one after another."""
    listeners = [session.listener for session in sessions if session.listener is not None]
    for process in listeners:
        try:
            process.close_stdin()
        except TransportError:  # already gone: nothing to stop
            pass
    for process in listeners:
        try:
            process.exit_code(timeout=2.0)
        finally:
            process.close()


def stop_listener(process: Process) -> None:
    try:
        process.close_stdin()
        process.exit_code(timeout=2.0)
    finally:
        process.close()
