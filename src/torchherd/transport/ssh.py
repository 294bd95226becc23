"""The SSH implementation of the transport seam (``transport.base``): the one place that speaks SSH.

Built on fabric: one ``fabric.Connection`` per node, and one per jump host, given to
the nodes behind it as their ``gateway``. What fabric leaves out or gets wrong for us
is done here, on the ``paramiko.SSHClient`` every fabric Connection holds:

* ssh_config is read by ``transport.sshconfig`` (Include, Match, first value wins, as
  ``ssh -G``), never by fabric (paramiko's reader has no Include); the inventory's own
  keys win over the config, as ``ssh -l/-p/-i`` would.
* host keys are checked on every hop before it opens: fabric sets paramiko's
  ``AutoAddPolicy`` and loads no known_hosts; we load what ``transport.knownhosts``
  finds for the host into ``connection.client`` and set our own policy (``transport.hostkeys``). An unknown key
  is refused unless the user (``--accept-new-host-keys``, or ``StrictHostKeyChecking
  accept-new``/``no`` in their own config) accepts new ones; a changed or revoked key
  is always refused.
* all nodes behind the same jump chain (same ``user@host:port`` hops) share one
  authenticated connection per hop, opened once, before any node uses it, and closed
  when the last node's session closes (or ``SshConnector.close``). A bastion with
  sshd's stock ``MaxStartups 10:30:100`` then sees one handshake, not one per node.
* at most ``handshakes`` unauthenticated handshakes at once towards one sshd, and a
  banner dropped or reset (sshd's ``MaxStartups`` at work) is retried with backoff and
  jitter before it is reported.
* commands run on raw paramiko channels (``RemoteProcess``): stdout and stderr apart,
  no PTY, stdin open as a control line; fabric's runners merge or buffer what we stream.

Every paramiko, fabric or socket error is turned into a ``TransportError`` where it arises
(``transport.sshfailures`` says which kind it is); ``transport.sshtarget`` resolves where a node is.
"""

from __future__ import annotations

import os
import random
import shlex
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from torchherd.errors import TransportError
from torchherd.inventory import Host
from torchherd.transport import sshconfig
from torchherd.transport.base import Closing, CommandResult
from torchherd.transport.hostkeys import HostKeyCheck
from torchherd.transport.local import LocalSession
from torchherd.transport.sshfailures import ATTEMPTS, as_transport_error, dropped_early, explain, handshake_failure

# Where a node is, as ``transport.ssh``'s own names: what its callers import from here.
from torchherd.transport.sshtarget import SshTarget as SshTarget
from torchherd.transport.sshtarget import jump_chain as jump_chain
from torchherd.transport.sshtarget import resolve_target as resolve_target
from torchherd.transport.sshtarget import ssh_hostnames as ssh_hostnames

if TYPE_CHECKING:  # paramiko and fabric are imported lazily: `torchherd --help` must stay fast.
    import paramiko

READ_SIZE = 1 << 22
"""Above paramiko's channel window (2 MiB): a read takes all it holds, since a partial read
moves the rest of its buffer to the front, costing a copy of up to the window each time."""
HANDSHAKES = 4
"""Unauthenticated handshakes at once towards one sshd: well under the 10 of sshd's stock
``MaxStartups 10:30:100``, past which it starts dropping new connections."""
BACKOFF_SECONDS = 0.3
KEEPALIVE_SECONDS = 5
TCP_KEEPALIVE = (2, 1, 5)
"""The session's socket: TCP keepalive probes after 2 s idle, every 1 s, 5 unanswered and the
kernel drops the connection: a link gone while nothing was being sent ends in about 7 s,
not the system default's two hours."""
TCP_USER_TIMEOUT_MS = 60_000
"""Linux: data sent and unacknowledged this long ends the connection (the default retries
for about 15 minutes). Only a backstop that frees the connection: the engine has named the
node lost long before (its heartbeats and keepalive requests). Not shorter: a receiver that
stops reading (a node's disk stalled under a sync) leaves a zero window, which the kernel
also bounds by this timeout, though the node is well."""
LINK_PROBE = "keepalive@openssh.com"
"""The global request ``ssh``'s ServerAliveInterval sends: sshd answers it itself (with a
failure, the request being unknown), whatever the processes it runs are doing."""


class Connection(Closing):
    """An authenticated SSH session to one node; run commands or start streamed ones.

    ``fabric`` is the node's fabric Connection; ``client`` its paramiko client, whose
    transport carries the raw channels. ``release`` lets go of the shared jump chain."""

    def __init__(self, target: SshTarget, fabric: Any, release: Callable[[], None] | None = None,
                 timeout: float = 10.0, host_key_note: str | None = None) -> None:
        self.target = target
        self.fabric = fabric
        self.client: paramiko.SSHClient = fabric.client
        self.timeout = timeout
        self.host_key_note = host_key_note
        """Said by ``check`` when the host key was not verified against a key on record."""
        self._release = release
        self._closed = threading.Lock()
        self._answered: float | None = None
        self._probing = threading.Lock()

    @property
    def node(self) -> str:
        return self.target.node

    def run(self, command: str, stdin: bytes = b"", timeout: float = 30.0) -> CommandResult:
        """Runs ``command`` in the node's shell, feeds ``stdin``, and collects all output."""
        started = time.monotonic()
        process = self.start(command)
        with as_transport_error(self.node, "run"):
            if stdin:
                process.channel.sendall(stdin)
            process.channel.shutdown_write()
            stdout, stderr = bytearray(), bytearray()
            process.pump(stdout.extend, stderr.extend, deadline=started + timeout)
            # The exit status may arrive a moment after the streams close.
            process.channel.status_event.wait(max(0.0, started + timeout - time.monotonic()))
            if not process.channel.exit_status_ready():
                process.channel.close()
                raise TransportError(self.node, "timeout",
                                     f"{self.node}: remote command did not finish within {timeout:g} s")
            return CommandResult(process.channel.recv_exit_status(), bytes(stdout), bytes(stderr),
                                 time.monotonic() - started)

    def start(self, command: str) -> RemoteProcess:
        """Starts ``command`` without a PTY (stdout and stderr stay apart)."""
        transport = self.client.get_transport()
        if transport is None or not transport.is_active():
            raise TransportError(self.node, "closed", f"{self.node}: SSH connection is closed")
        with as_transport_error(self.node, "start"):
            channel = transport.open_session(timeout=self.timeout)
            channel.exec_command(command)
        return RemoteProcess(self.node, channel)

    def put(self, path: str, data: bytes, mode: int = 0o600) -> None:
        """Writes a new file over SFTP, created with ``mode`` (exclusive: an existing path is refused)."""
        with as_transport_error(self.node, f"write {path}"):
            sftp = self.client.open_sftp()
            try:
                with sftp.open(path, "wx") as remote:
                    sftp.chmod(path, mode)
                    remote.write(data)
            finally:
                sftp.close()

    def peer_address(self) -> str | None:
        """The address sshd answered on, when the node was reached directly (not through a jump)."""
        transport = self.client.get_transport()
        if transport is None or self.target.proxy_jump or self.target.proxy_command:
            return None
        try:
            return str(transport.getpeername()[0])
        except OSError:
            return None

    def is_alive(self) -> bool:
        transport = self.client.get_transport()
        return transport is not None and transport.is_active()

    def link_quiet(self, every: float) -> float | None:
        """Seconds since sshd last answered a keepalive request on this connection, probing
        every ``every`` seconds from the first call on; None when the connection is closed.
        A node whose supervisor is silent while sshd answers is slow, not gone."""
        transport = self.client.get_transport()
        if transport is None or not transport.is_active():
            return None
        with self._probing:
            if self._answered is None:
                self._answered = time.monotonic()
                threading.Thread(target=self._probe, args=(transport, every), name=f"torchherd-probe-{self.node}",
                                 daemon=True).start()
            return time.monotonic() - self._answered

    def _probe(self, transport: Any, every: float) -> None:
        """One request at a time, each waited on (paramiko ends the wait when the connection
        ends): an answer that does not come leaves ``_answered`` to age."""
        while transport.is_active():
            sent = time.monotonic()
            try:
                transport.global_request(LINK_PROBE, wait=True)
            except Exception:  # the connection broke under the request: no more answers
                return
            if not transport.is_active():
                return
            self._answered = time.monotonic()
            time.sleep(max(0.0, sent + every - time.monotonic()))

    def close(self) -> None:
        if not self._closed.acquire(blocking=False):
            return  # closed already: the shared chain is released once
        try:
            self.fabric.close()
        finally:
            if self._release is not None:
                self._release()


class RemoteProcess:
    """A command running on a node, with its stdin, stdout and stderr."""

    def __init__(self, node: str, channel: paramiko.Channel) -> None:
        self.node = node
        self.channel = channel
        self._send_lock = threading.Lock()

    def send(self, data: bytes) -> bool:
        """Writes to the remote stdin; False when the channel is already gone."""
        with self._send_lock:
            try:
                self.channel.sendall(data)
            except Exception:  # paramiko raises several kinds once the peer is gone
                return False
        return True

    def close_stdin(self) -> None:
        with self._send_lock, as_transport_error(self.node, "close stdin"):
            self.channel.shutdown_write()

    def read(self, timeout: float) -> bytes | None:
        self.channel.settimeout(timeout)
        try:
            return bytes(self.channel.recv(READ_SIZE))
        except socket.timeout:
            return None
        except Exception as error:  # a channel torn down under us reads as EOF, said once
            if isinstance(error, OSError) or type(error).__module__.startswith("paramiko"):
                return b""
            raise

    def read_stderr(self) -> bytes:
        data = bytearray()
        while self.channel.recv_stderr_ready():
            data += self.channel.recv_stderr(READ_SIZE)
        return bytes(data)

    def close(self) -> None:
        self.channel.close()

    def pump(self, on_stdout: Callable[[bytes], None], on_stderr: Callable[[bytes], None],
             deadline: float | None = None) -> None:
        """Reads both streams until the remote side closes them (or the deadline passes)."""
        channel = self.channel
        channel.settimeout(0.2)
        while True:
            if deadline is not None and time.monotonic() > deadline:
                return
            got = False
            if channel.recv_stderr_ready():
                on_stderr(channel.recv_stderr(READ_SIZE))
                got = True
            try:
                data = channel.recv(READ_SIZE)
            except socket.timeout:
                continue
            if data:
                on_stdout(data)
                continue
            if not got:
                while channel.recv_stderr_ready():
                    on_stderr(channel.recv_stderr(READ_SIZE))
                return

    def exit_code(self, timeout: float | None = None) -> int | None:
        """The remote exit status, or None when the channel closed without one (node lost)."""
        if timeout is not None:
            # The status follows the streams' end on a live connection; on a dead one it
            # never comes, and waiting for it would only delay the node's loss.
            deadline = time.monotonic() + timeout
            transport = self.channel.get_transport()
            while not self.channel.status_event.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline or transport is None or not transport.is_active():
                    return None
        if not self.channel.exit_status_ready():
            return None
        code = self.channel.recv_exit_status()
        return None if code == -1 else code


def _fabric_class() -> Any:
    """``fabric.Connection`` whose gateway torchherd opens itself (imported on first use)."""
    global _FABRIC_CLASS
    if _FABRIC_CLASS is None:
        import fabric
        import paramiko

        class GatewayedConnection(fabric.Connection):  # type: ignore[misc]
            """fabric's own ``open_gateway`` would open a gateway that is not connected (from
            every node's thread at once: many logins to one bastion) and waits on its channel
            without a timeout, and re-expands ProxyCommand tokens. Here the gateway is already
            open (``SshConnector`` opened it once), the channel has a timeout, and a
            ProxyCommand arrives expanded, to run in the user's shell as ssh runs it."""

            def open_gateway(self) -> Any:
                if isinstance(self.gateway, str):
                    return paramiko.ProxyCommand(self.gateway)
                if not self.gateway.is_connected:
                    raise EOFError("the jump host's connection is closed")
                return self.gateway.transport.open_channel(
                    "direct-tcpip", (self.host, int(self.port)), ("127.0.0.1", 0),
                    timeout=self.connect_kwargs.get("timeout"))

        _FABRIC_CLASS = GatewayedConnection
    return _FABRIC_CLASS


_FABRIC_CLASS: Any = None


def _transport_class() -> Any:
    """paramiko's Transport, its thread woken once a second instead of ten times: when idle
    the thread only checks whether it was closed or owes a keepalive (every 5 s), and at
    256 nodes ten wake-ups a second per connection cost the controller 0.09 s of CPU per
    second (0.02 s with one). Data is read as it arrives either way.

    It offers AES-GCM first (``AEAD_FIRST``), then paramiko's own list unchanged: a server
    that refuses GCM gets what it got before. With GCM one call into OpenSSL both decrypts
    and authenticates a packet; with paramiko's default (AES-CTR and HMAC-SHA2) each packet's
    MAC is also computed apart and compared byte by byte in Python. At 64 hosts a ``check``
    cost the controller 8 % less CPU."""
    global _TRANSPORT_CLASS
    if _TRANSPORT_CLASS is None:
        import paramiko

        class CalmTransport(paramiko.Transport):  # type: ignore[misc]
            _active_check_timeout = 1.0
            _preferred_ciphers = AEAD_FIRST + tuple(name for name in paramiko.Transport._preferred_ciphers
                                                    if name not in AEAD_FIRST)

        _TRANSPORT_CLASS = CalmTransport
    return _TRANSPORT_CLASS


_TRANSPORT_CLASS: Any = None
AEAD_FIRST = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")
"""Ciphers offered before paramiko's others: OpenSSH offers both by default, as does every
sshd since 6.2 (2013)."""


def _proxy_command_line(command: str) -> str:
    # ssh runs ProxyCommand as `exec COMMAND` in the user's shell; paramiko splits its
    # argument with shlex and runs it without one, so hand it the shell's own argv.
    return shlex.join([os.environ.get("SHELL") or "/bin/sh", "-c", f"exec {command}"])


_ChainKey = tuple[tuple[str, str, int, str], ...]
"""A chain of jump hosts, each hop as ``SshTarget.chain_key`` gives it: the nodes behind the
same chain share one connection per hop."""


@dataclass
class _Chain:
    """The jump hosts in front of some nodes: one open fabric Connection per hop, shared."""

    hops: list[SshTarget]
    connections: list[Any] = field(default_factory=list)
    users: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def is_open(self) -> bool:
        return len(self.connections) == len(self.hops) and all(c.is_connected for c in self.connections)

    def close(self) -> None:
        for connection in reversed(self.connections):
            try:
                connection.close()
            except Exception:  # a hop already gone: nothing more to close there
                pass
        self.connections = []


@dataclass
class _Shared:
    """What an ``SshConnector`` shares between the threads that connect through it."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    chains: dict[_ChainKey, _Chain] = field(default_factory=dict)
    failures: dict[_ChainKey, tuple[float, TransportError]] = field(default_factory=dict)
    """Per chain of jump hosts, its last failure and when: kept apart from the chain, which is
    dropped when its last user leaves, so that a node that connects after that (a loaded
    controller's threads start late) fails at once too rather than trying the dead hop again."""
    gates: dict[tuple[object, ...], threading.BoundedSemaphore] = field(default_factory=dict)
    local: sshconfig.Local | None = None
    keys: dict[str, Any] = field(default_factory=dict)
    """Identity file -> its paramiko key with its certificate, or None where it could not
    be loaded without a passphrase: read once per command, not once per host and key class."""

    def failed(self, key: _ChainKey, within: float) -> TransportError | None:
        """The chain's failure if it failed less than ``within`` seconds ago."""
        with self.lock:
            failure = self.failures.get(key)
        return failure[1] if failure is not None and time.monotonic() - failure[0] < within else None

    def remember(self, key: _ChainKey, failure: TransportError | None) -> None:
        with self.lock:
            if failure is None:
                self.failures.pop(key, None)
            else:
                self.failures[key] = (time.monotonic(), failure)

    def gate(self, key: tuple[object, ...], width: int) -> threading.BoundedSemaphore:
        with self.lock:
            if key not in self.gates:
                self.gates[key] = threading.BoundedSemaphore(width)
            return self.gates[key]

    def this_machine(self) -> sshconfig.Local:
        with self.lock:
            if self.local is None:
                self.local = sshconfig.Local.of_this_machine()
            return self.local

    def key(self, path: str) -> Any:
        with self.lock:
            if path in self.keys:
                return self.keys[path]
        import paramiko

        try:
            loaded: Any = paramiko.PKey.from_path(path)  # the key's own type, and path-cert.pub
        except Exception:  # encrypted, unknown or unreadable: paramiko's own loop tries it, as before
            loaded = None
        with self.lock:
            return self.keys.setdefault(path, loaded)

    @staticmethod
    def fabric_config() -> Any:
        """A config of its own for every fabric Connection: ``Connection.__init__`` writes
        into its config (``inline_ssh_env``), and each write re-merges it, empty for a
        moment; shared by the connecting threads, another thread's Connection then found
        no keys at all (AttributeError: 'forward_agent', seen at 256 nodes)."""
        import fabric
        import paramiko

        # An explicit, empty SSHConfig: fabric reads no ssh_config file (ours is read by
        # transport.sshconfig); lazy: no fabric/invoke config files either.
        return fabric.Config(ssh_config=paramiko.SSHConfig(), lazy=True)


@dataclass(frozen=True)
class SshConnector:
    """Opens SSH sessions with one inventory's settings (``transport.base.Connector``).

    Holds what the sessions share: the jump chains (one authenticated connection per
    hop) and the handshake gates (at most ``handshakes`` unauthenticated connections at
    once towards one sshd). A chain closes when the last session through it closes;
    ``close()`` closes whatever is left."""

    ssh_config: Path | None = None
    timeout: float = 10.0
    accept_new: bool = False
    handshakes: int = HANDSHAKES
    _shared: _Shared = field(default_factory=_Shared, init=False, repr=False, compare=False)

    def connect(self, host: Host) -> Connection | LocalSession:
        if host.transport == "local":  # this machine itself (-H localhost): no sshd, no keys
            return LocalSession(host.name)
        local = self._shared.this_machine()
        target = resolve_target(host, self.ssh_config, local)
        hops = jump_chain(target, self.ssh_config, local)
        if not hops:
            fabric, note = self._open(target, target.proxy_command or False, ())
            return Connection(target, fabric, None, self.timeout, note)
        key = tuple(hop.chain_key for hop in hops)
        chain, gateway = self._acquire(key, hops, host.name)
        try:
            fabric, note = self._open(target, gateway, key)
        except BaseException:
            self._release(key, chain)
            raise
        return Connection(target, fabric, lambda: self._release(key, chain), self.timeout, note)

    def close(self) -> None:
        """Closes every jump host connection still open (the sessions through them die with them)."""
        with self._shared.lock:
            chains = list(self._shared.chains.values())
            self._shared.chains.clear()
        for chain in chains:
            with chain.lock:
                chain.close()

    def _acquire(self, key: _ChainKey, hops: list[SshTarget],
                 node: str) -> tuple[_Chain, Any]:
        """The chain for ``key``, open, counted as used once more; and its last hop."""
        with self._shared.lock:
            chain = self._shared.chains.setdefault(key, _Chain(hops))
            chain.users += 1
        try:
            with chain.lock:  # the first node opens the chain; the others wait, then share it
                self._open_chain(chain, key)
                return chain, chain.connections[-1]
        except TransportError as error:
            self._release(key, chain)
            raise TransportError(node, error.kind, f"{node}: {error}", error.hint) from None
        except BaseException:
            self._release(key, chain)
            raise

    def _open_chain(self, chain: _Chain, key: _ChainKey) -> None:
        if chain.is_open():
            return
        failed = self._shared.failed(key, self.timeout)
        if failed is not None:
            raise failed  # every node behind a dead jump host fails at once, not one by one
        chain.close()
        try:
            for index, hop in enumerate(chain.hops):
                gateway = chain.connections[-1] if chain.connections else (hop.proxy_command or False)
                opened, _ = self._open(hop, gateway, key[:index])
                chain.connections.append(opened)
        except TransportError as error:
            chain.close()
            self._shared.remember(key, error)
            raise
        except BaseException:
            chain.close()
            raise
        self._shared.remember(key, None)

    def _release(self, key: _ChainKey, chain: _Chain) -> None:
        with self._shared.lock:
            chain.users -= 1
            if chain.users > 0:
                return
            if self._shared.chains.get(key) is chain:  # not already dropped by close()
                del self._shared.chains[key]
        with chain.lock:
            chain.close()

    def _open(self, target: SshTarget, gateway: Any, via: tuple[object, ...]) -> tuple[Any, str | None]:
        """One fabric Connection, host key checked, opened through ``gateway`` (a jump host's
        Connection, a ProxyCommand, or False), retried while sshd drops its banner."""
        check = HostKeyCheck(target, self.accept_new, self._shared.this_machine().home)
        gate = self._shared.gate((via, target.hostname, target.port), self.handshakes)
        for attempt in range(ATTEMPTS):
            connection = self._fabric_connection(target, gateway)
            check.install(connection.client)
            with gate:
                try:
                    connection.open()
                    break
                except BaseException as failure:
                    error = handshake_failure(connection.client, failure)
                    connection.client.close()
                    if attempt == ATTEMPTS - 1 or not dropped_early(error):
                        raise explain(target, error, check) from None
            # Outside the gate: the others' handshakes go on while this one waits.
            time.sleep(BACKOFF_SECONDS * (2 ** attempt) * random.uniform(0.5, 1.5))
        transport = connection.client.get_transport()
        if transport is not None:
            transport.set_keepalive(KEEPALIVE_SECONDS)
            _tcp_keepalive(transport.sock)
        return connection, check.note

    def _fabric_connection(self, target: SshTarget, gateway: Any) -> Any:
        _quiet_paramiko()
        timeout = min(self.timeout, target.connect_timeout) if target.connect_timeout else self.timeout
        keys = [path for path in target.key_files if os.path.isfile(path)]
        connect_kwargs: dict[str, Any] = {
            "allow_agent": not target.identities_only, "look_for_keys": False, "timeout": timeout,
            "banner_timeout": timeout, "auth_timeout": self.timeout, "channel_timeout": self.timeout,
            "transport_factory": _transport_class()}
        first = self._shared.key(keys[0]) if keys else None
        if first is not None:
            # paramiko tries ``pkey`` before ``key_filename``: the files' order holds.
            connect_kwargs["pkey"], keys = first, keys[1:]
        if keys:
            connect_kwargs["key_filename"] = keys
        if isinstance(gateway, str):
            gateway = _proxy_command_line(gateway)
        return _fabric_class()(target.hostname, user=target.user, port=target.port, config=self._shared.fabric_config(),
                               gateway=gateway, connect_kwargs=connect_kwargs)


def _tcp_keepalive(sock: object) -> None:
    """TCP keepalive (and on Linux a user timeout) on a session's own socket; a session
    through a jump host or a ProxyCommand has none here (its hop's socket has them)."""
    if not isinstance(sock, socket.socket):
        return
    idle, interval, count = TCP_KEEPALIVE
    # macOS names the idle time TCP_KEEPALIVE; TCP_USER_TIMEOUT is Linux's own
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for names, value in ((("TCP_KEEPIDLE", "TCP_KEEPALIVE"), idle), (("TCP_KEEPINTVL",), interval),
                         (("TCP_KEEPCNT",), count), (("TCP_USER_TIMEOUT",), TCP_USER_TIMEOUT_MS)):
        option = next((getattr(socket, name) for name in names if hasattr(socket, name)), None)
        if option is not None:
            options.append((socket.IPPROTO_TCP, option, value))
    for level, option, value in options:
        try:
            sock.setsockopt(level, option, value)
        except OSError:
            pass  # a platform without that option: the heartbeats still notice a lost node


def _quiet_paramiko() -> None:
    """paramiko logs its own tracebacks for failures we report in one line; keep them
    off the user's terminal (Python's last-resort handler would print them)."""
    import logging

    logger = logging.getLogger("paramiko")
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())


