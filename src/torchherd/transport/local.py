"""The in-process implementation of the transport seam: every "node" is this machine,
every command a ``sh -c`` subprocess in its own session, with pipes for its streams.

It behaves as an SSH channel without a PTY does: stdout and stderr apart, stdin
kept open until closed, and closing lets go of the pipes without signalling the
command (the node scripts see EOF and tear their job down themselves). The engine,
the detached runs and the checks' gathering run on it in unit tests, without root.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Callable, Mapping

from torchherd.errors import TransportError
from torchherd.inventory import Host
from torchherd.transport.base import Closing, CommandResult

READ_SIZE = 1 << 16
DRAIN_SECONDS = 2.0
"""How long an ended command's output may take to reach its readers before its status is given."""


class LocalProcess:
    """``sh -c command`` with its three pipes; a reader thread per output stream, so a
    read with a timeout never blocks on the other stream."""

    def __init__(self, node: str, command: str, env: Mapping[str, str] | None) -> None:
        self.node = node
        try:
            self.popen = subprocess.Popen(["sh", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, start_new_session=True,
                                          env=None if env is None else {**os.environ, **env})
        except OSError as error:
            raise TransportError(node, "start", f"{node}: cannot start sh: {error}") from error
        self._send_lock = threading.Lock()
        self._stdout: queue.Queue[bytes] = queue.Queue()
        self._stderr: queue.Queue[bytes] = queue.Queue()
        self._stdout_eof = False
        self._drained = False
        self._let_go = threading.Event()
        assert self.popen.stdout is not None and self.popen.stderr is not None
        self._readers = [self._reader(self.popen.stdout, self._stdout), self._reader(self.popen.stderr, self._stderr)]

    def _reader(self, stream: IO[bytes], into: queue.Queue[bytes]) -> threading.Thread:
        # This thread alone closes its stream, once let go of. Were close() to close it
        # between this thread's fileno() and its read, the number could go to the pipe of a
        # process started at that moment, and this read would take that process's output.
        def read() -> None:
            try:
                while not self._let_go.is_set():
                    data = os.read(stream.fileno(), READ_SIZE)
                    into.put(data)
                    if not data:
                        return
            except OSError:
                into.put(b"")
            finally:
                stream.close()

        thread = threading.Thread(target=read, name=f"torchherd-local-{self.node}", daemon=True)
        thread.start()
        return thread

    def send(self, data: bytes) -> bool:
        with self._send_lock:
            stdin = self.popen.stdin
            if stdin is None or stdin.closed:
                return False
            try:
                stdin.write(data)
                stdin.flush()
            except (OSError, ValueError):
                return False
        return True

    def close_stdin(self) -> None:
        with self._send_lock:
            if self.popen.stdin is not None and not self.popen.stdin.closed:
                try:
                    self.popen.stdin.close()
                except OSError:
                    pass

    def read(self, timeout: float) -> bytes | None:
        if self._stdout_eof:
            return b""
        try:
            data = self._stdout.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None
        while data and len(data) < READ_SIZE * 16:
            try:
                more = self._stdout.get_nowait()
            except queue.Empty:
                break
            if not more:
                self._stdout.put(b"")
                break
            data += more
        if not data:
            self._stdout_eof = True
        return data

    def read_stderr(self) -> bytes:
        chunks = []
        while True:
            try:
                chunk = self._stderr.get_nowait()
            except queue.Empty:
                break
            if not chunk:
                self._stderr.put(b"")
                break
            chunks.append(chunk)
        return b"".join(chunks)

    def pump(self, on_stdout: Callable[[bytes], None], on_stderr: Callable[[bytes], None],
             deadline: float | None = None) -> None:
        while True:
            if deadline is not None and time.monotonic() > deadline:
                return
            err = self.read_stderr()
            if err:
                on_stderr(err)
            data = self.read(0.1)
            if data is None:
                continue
            if data:
                on_stdout(data)
                continue
            self._readers[1].join(timeout=1.0)
            rest = self.read_stderr()
            if rest:
                on_stderr(rest)
            return

    def exit_code(self, timeout: float | None = None) -> int | None:
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        if not self._drained:
            # As over SSH, where the exit status follows the output: what the shell wrote
            # before it ended is read before its status is given (a reader starved of CPU
            # on a loaded machine may not have read it yet). Bounded, and once: a background
            # child of the shell may hold the pipes open long after it.
            self._drained = True
            for reader in self._readers:
                reader.join(timeout=DRAIN_SECONDS)
        # A shell killed by a signal has no exit status over SSH either.
        return None if code < 0 else code

    def close(self) -> None:
        """Lets go of the pipes: stdin closed now, the output's readers close theirs at their
        next read (the command's next write fails then), and this side reads no more."""
        self.close_stdin()
        self._let_go.set()
        self._stdout.put(b"")
        self._stderr.put(b"")

    def kill(self) -> None:
        """The whole session the shell started (for a ``run`` past its timeout)."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except OSError:
            pass


@dataclass
class LocalSession(Closing):
    """A "node" that is this machine; ``env`` is added to every command's environment
    (the tests give each node its own HOME, say)."""

    node: str
    env: Mapping[str, str] | None = None
    closed: bool = False
    processes: list[LocalProcess] = field(default_factory=list)

    def start(self, command: str) -> LocalProcess:
        if self.closed:
            raise TransportError(self.node, "closed", f"{self.node}: the session is closed")
        process = LocalProcess(self.node, command, self.env)
        self.processes.append(process)
        return process

    def run(self, command: str, stdin: bytes = b"", timeout: float = 30.0) -> CommandResult:
        started = time.monotonic()
        process = self.start(command)
        if stdin:
            process.send(stdin)
        process.close_stdin()
        stdout, stderr = bytearray(), bytearray()
        process.pump(stdout.extend, stderr.extend, deadline=started + timeout)
        code = process.exit_code(max(0.0, started + timeout - time.monotonic()))
        if code is None:
            process.kill()
            process.close()
            raise TransportError(self.node, "timeout", f"{self.node}: remote command did not finish within {timeout:g} s")
        return CommandResult(code, bytes(stdout), bytes(stderr), time.monotonic() - started)

    def put(self, path: str, data: bytes, mode: int = 0o600) -> None:
        target = os.path.expanduser(path)
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        except OSError as error:
            raise TransportError(self.node, "put", f"{self.node}: cannot write {path}: {error.strerror}") from error
        with os.fdopen(fd, "wb") as file:
            file.write(data)

    def peer_address(self) -> str | None:
        return None

    def is_alive(self) -> bool:
        return not self.closed

    def link_quiet(self, every: float) -> float | None:
        return None  # no link between this machine and itself

    def close(self) -> None:
        self.closed = True
        for process in self.processes:
            process.close()


@dataclass(frozen=True)
class LocalConnector:
    """Sessions on this machine; ``env`` per node name (or for all under ``"*"``);
    ``unreachable`` nodes fail to connect as an SSH timeout would."""

    env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    unreachable: frozenset[str] = frozenset()

    def connect(self, host: Host) -> LocalSession:
        if host.name in self.unreachable:
            raise TransportError(host.name, "timeout", f"{host.name}: no answer from {host.address} (timed out)",
                                 "the node is down, or a firewall drops SSH")
        env = {**self.env.get("*", {}), **self.env.get(host.name, {})}
        return LocalSession(host.name, env or None)
