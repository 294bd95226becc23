"""What the engine and the checks need from a node, whatever carries it.

``Session`` is one node reached and authenticated; ``Process`` is one command
running there with its three streams. ``Connector`` opens sessions. The SSH
implementation (``transport.ssh``) and the in-process one (``transport.local``:
plain ``sh -c`` subprocesses on this machine) both fulfil these, so the engine,
the detached runs and the checks' gathering run under unit tests without root.

Every failure of the carrier itself (a dropped connection, a channel that cannot
open, a timeout) surfaces as ``TransportError``; callers never see paramiko's or
the OS's own exceptions.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Protocol, Sequence, TypeVar

from torchherd.errors import TransportError
from torchherd.inventory import Host

MAX_PARALLEL = 64
"""The one bound on work fanned out over nodes: threads that each wait on a node, not
CPUs. A few hundred nodes take a few rounds; no run ever holds hundreds of threads."""

T = TypeVar("T")
U = TypeVar("U")


@dataclass(frozen=True)
class CommandResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    seconds: float


class Process(Protocol):
    """A command running on a node: stdin to write, stdout and stderr to read."""

    @property
    def node(self) -> str: ...

    def send(self, data: bytes) -> bool:
        """Writes to the command's stdin; False when it is already gone."""

    def close_stdin(self) -> None:
        """EOF on the command's stdin (the node scripts take it as "the controller left")."""

    def read(self, timeout: float) -> bytes | None:
        """The next stdout bytes; ``b""`` at EOF; None when nothing came within ``timeout``."""

    def read_stderr(self) -> bytes:
        """Whatever stderr holds now, without waiting."""

    def pump(self, on_stdout: Callable[[bytes], None], on_stderr: Callable[[bytes], None],
             deadline: float | None = None) -> None:
        """Reads both streams until the command closes them (or the deadline passes)."""

    def exit_code(self, timeout: float | None = None) -> int | None:
        """The exit status, or None when it ended without one (node lost) or not in time."""

    def close(self) -> None:
        """Lets go of the streams; the command sees EOF and broken pipes, not a signal."""


class Session(Protocol):
    """One node, reached: run commands, start streamed ones, put files."""

    @property
    def node(self) -> str: ...

    def run(self, command: str, stdin: bytes = b"", timeout: float = 30.0) -> CommandResult:
        """Runs ``command`` in the node's shell, feeds ``stdin`` then EOF, collects all output."""

    def start(self, command: str) -> Process:
        """Starts ``command`` in the node's shell without a terminal (stdout and stderr apart)."""

    def put(self, path: str, data: bytes, mode: int = 0o600) -> None:
        """Writes ``data`` to a new file ``path`` on the node (refused if it exists)."""

    def peer_address(self) -> str | None:
        """The node's address as the controller reached it, when reached directly."""

    def is_alive(self) -> bool: ...

    def close(self) -> None: ...


class Connector(Protocol):
    """Opens sessions: ``connect`` raises TransportError saying what went wrong."""

    def connect(self, host: Host) -> Session: ...


def fan_out(items: Sequence[T], work: Callable[[T], U], limit: int = MAX_PARALLEL) -> list[U]:
    """``work`` on every item at once (at most ``limit`` at a time), results in item order.
    ``work`` reports its own per-item failures in what it returns: one node's failure
    must never hide another's."""
    if not items:
        return []
    if len(items) == 1:
        return [work(items[0])]
    with ThreadPoolExecutor(max_workers=max(1, min(limit, len(items))), thread_name_prefix="torchherd") as pool:
        return list(pool.map(work, items))


def connect_all(connector: Connector, hosts: Iterable[Host]) -> Mapping[str, Session | TransportError]:
    """Connects to every host in parallel; each entry is the session or why it failed."""
    host_list = list(hosts)

    def attempt(host: Host) -> Session | TransportError:
        try:
            return connector.connect(host)
        except TransportError as error:
            return error

    return {host.name: result for host, result in zip(host_list, fan_out(host_list, attempt))}


def close_all(sessions: Iterable[Session | TransportError]) -> None:
    for session in sessions:
        if not isinstance(session, TransportError):
            session.close()
