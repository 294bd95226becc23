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
from typing import Callable, Iterable, Iterator, Mapping, Protocol, Sequence, TypeVar, Union

from torchherd.errors import TransportError
from torchherd.inventory import Host

MAX_PARALLEL = 64
"""The one bound on work fanned out over nodes: threads that each wait on a node, not
CPUs. A few hundred nodes take a few rounds; no run ever holds hundreds of threads."""

T = TypeVar("T")
U = TypeVar("U")
S = TypeVar("S")


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

    def link_quiet(self, every: float) -> float | None:
        """Seconds since the carrier itself (SSH: sshd) last answered, probing it every
        ``every`` seconds from the first call on; None where there is nothing to probe or
        the connection is closed (the node's own heartbeats then decide alone)."""

    def close(self) -> None: ...

    def __enter__(self: S) -> S:
        """``with connector.connect(host) as session:`` closes it at the end (``Closing``)."""

    def __exit__(self, *exc: object) -> None: ...


class Closing:
    """What makes a session a context manager (Fabric's ``with Connection(...)``):
    ``close`` when the block ends, however it ends."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: S) -> S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


class Connected(Mapping[str, Union[Session, TransportError]]):
    """Per host (by name, in the hosts' order) its session or why it could not be
    reached (Fabric's ``GroupResult``): ``succeeded`` and ``failed`` split them."""

    def __init__(self, results: Mapping[str, Session | TransportError]) -> None:
        self._results = dict(results)

    def __getitem__(self, name: str) -> Session | TransportError:
        return self._results[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._results)

    def __len__(self) -> int:
        return len(self._results)

    @property
    def succeeded(self) -> dict[str, Session]:
        return {name: result for name, result in self._results.items() if not isinstance(result, TransportError)}

    @property
    def failed(self) -> dict[str, TransportError]:
        return {name: result for name, result in self._results.items() if isinstance(result, TransportError)}

    def close(self) -> None:
        """Closes every session opened."""
        close_all(self._results.values())


def connect_all(connector: Connector, hosts: Iterable[Host]) -> Connected:
    """Connects to every host in parallel; per host the session or why it failed."""
    host_list = list(hosts)

    def attempt(host: Host) -> Session | TransportError:
        try:
            return connector.connect(host)
        except TransportError as error:
            return error

    return Connected({host.name: result for host, result in zip(host_list, fan_out(host_list, attempt))})


def close_all(sessions: Iterable[Session | TransportError]) -> None:
    for session in sessions:
        if not isinstance(session, TransportError):
            session.close()
