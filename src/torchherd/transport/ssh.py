"""The SSH implementation of the transport seam (``transport.base``): the one place that speaks SSH.

One ``Connection`` per node (paramiko underneath), opened with the node's resolved
OpenSSH settings: ``~/.ssh/config`` (or the inventory's ``ssh_config``) aliases,
User, Port, IdentityFile, UserKnownHostsFile and ProxyJump/ProxyCommand are
honoured, and the inventory's own keys win over the config, as a command-line
``-l``/``-p``/``-i`` would. Host keys are verified: an unknown key is refused
unless the user asked to accept new keys, a changed key is always refused.

``SshConnector`` opens them for the engine and the checks; every paramiko or socket
error is turned into a ``TransportError`` here, where it arises.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from torchherd.errors import TransportError
from torchherd.inventory import Host
from torchherd.transport.base import CommandResult, Session
from torchherd.transport.base import connect_all as _connect_all

if TYPE_CHECKING:  # paramiko is imported lazily: `torchherd --help` must stay fast.
    import paramiko

DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"
READ_SIZE = 1 << 22
"""Above paramiko's channel window (2 MiB): a read takes all it holds, since a partial read
moves the rest of its buffer to the front, costing a copy of up to the window each time."""


@dataclass(frozen=True)
class SshTarget:
    """Where and how to connect to one node, after ssh_config and the inventory are merged."""

    node: str
    hostname: str
    port: int
    user: str
    key_files: tuple[str, ...]
    known_hosts: tuple[str, ...]
    proxy_jump: str | None
    proxy_command: str | None
    identities_only: bool

    def describe(self) -> str:
        port = f":{self.port}" if self.port != 22 else ""
        via = f" via {self.proxy_jump}" if self.proxy_jump else ""
        return f"{self.user}@{self.hostname}{port}{via}"


def _ssh_config_lookup(alias: str, ssh_config: Path | None) -> dict[str, Any]:
    import paramiko

    path = ssh_config if ssh_config is not None else Path("~/.ssh/config").expanduser()
    if not path.exists():
        return {"hostname": alias}
    return dict(paramiko.SSHConfig.from_path(str(path)).lookup(alias))


def resolve_target(host: Host, ssh_config: Path | None) -> SshTarget:
    """Merges the node's ssh_config entry with the inventory (the inventory wins)."""
    found = _ssh_config_lookup(host.address, ssh_config)
    key_files = [host.identity_file] if host.identity_file else list(found.get("identityfile", []))
    known = str(found.get("userknownhostsfile", DEFAULT_KNOWN_HOSTS)).split()
    return SshTarget(
        node=host.name,
        hostname=str(found.get("hostname", host.address)),
        port=host.ssh_port or int(found.get("port", 22)),
        user=host.user or str(found.get("user") or _local_user()),
        key_files=tuple(os.path.expanduser(path) for path in key_files),
        known_hosts=tuple(os.path.expanduser(path) for path in known),
        proxy_jump=found.get("proxyjump"),
        proxy_command=found.get("proxycommand"),
        identities_only=str(found.get("identitiesonly", "no")).lower() == "yes",
    )


def _local_user() -> str:
    import getpass

    return getpass.getuser()


class _HostKeyPolicy:
    """Refuses unknown host keys with a message that says how to accept them,
    or accepts and records them when the user asked for that."""

    def __init__(self, target: SshTarget, accept_new: bool) -> None:
        self.target = target
        self.accept_new = accept_new

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        fingerprint = key.fingerprint
        if not self.accept_new:
            port = f" -p {self.target.port}" if self.target.port != 22 else ""
            raise TransportError(
                self.target.node, "host-key-unknown",
                f"{self.target.node}: unknown SSH host key for {hostname} ({key.get_name()} {fingerprint})",
                f"check the fingerprint, then trust it with `ssh{port} {self.target.user}@{self.target.hostname}` "
                f"once, or rerun with --accept-new-host-keys",
            )
        client.get_host_keys().add(hostname, key.get_name(), key)
        known_hosts = Path(self.target.known_hosts[0])
        known_hosts.parent.mkdir(parents=True, exist_ok=True)
        with known_hosts.open("a") as file:
            file.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


class Connection:
    """An authenticated SSH session to one node; run commands or start streamed ones."""

    def __init__(self, target: SshTarget, client: paramiko.SSHClient, jump: Connection | None = None,
                 timeout: float = 10.0) -> None:
        self.target = target
        self.client = client
        self.timeout = timeout
        self._jump = jump

    @property
    def node(self) -> str:
        return self.target.node

    def run(self, command: str, stdin: bytes = b"", timeout: float = 30.0) -> CommandResult:
        """Runs ``command`` in the node's shell, feeds ``stdin``, and collects all output."""
        started = time.monotonic()
        process = self.start(command)
        with _as_transport_error(self.node, "run"):
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
        with _as_transport_error(self.node, "start"):
            channel = transport.open_session(timeout=self.timeout)
            channel.exec_command(command)
        return RemoteProcess(self.node, channel)

    def put(self, path: str, data: bytes, mode: int = 0o600) -> None:
        """Writes a new file over SFTP, created with ``mode`` (exclusive: an existing path is refused)."""
        with _as_transport_error(self.node, f"write {path}"):
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

    def close(self) -> None:
        self.client.close()
        if self._jump is not None:
            self._jump.close()


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
        with self._send_lock, _as_transport_error(self.node, "close stdin"):
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
        if timeout is not None and not self.channel.status_event.wait(timeout):
            return None
        if not self.channel.exit_status_ready():
            return None
        code = self.channel.recv_exit_status()
        return None if code == -1 else code


def connect(host: Host, ssh_config: Path | None, timeout: float, accept_new: bool = False) -> Connection:
    """Opens and authenticates one connection; raises TransportError saying what went wrong."""
    target = resolve_target(host, ssh_config)
    jump = _open_jump(target, host, ssh_config, timeout, accept_new)
    try:
        client = _open_client(target, timeout, accept_new, jump)
    except BaseException:
        if jump is not None:
            jump.close()
        raise
    return Connection(target, client, jump, timeout)


def _open_jump(target: SshTarget, host: Host, ssh_config: Path | None, timeout: float,
               accept_new: bool) -> Connection | None:
    if not target.proxy_jump or target.proxy_jump.lower() == "none":
        return None
    first_hop = target.proxy_jump.split(",")[0]
    user, _, rest = first_hop.rpartition("@")
    address, _, port = rest.partition(":")
    jump_host = Host(name=f"{host.name} (jump {address})", address=address, user=user or None,
                     ssh_port=int(port) if port else None, identity_file=None, python="", workdir="",
                     env={}, setup="", local_addr=None)
    return connect(jump_host, ssh_config, timeout, accept_new)


def _quiet_paramiko() -> None:
    """paramiko logs its own tracebacks for failures we report in one line; keep them
    off the user's terminal (Python's last-resort handler would print them)."""
    import logging

    logger = logging.getLogger("paramiko")
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())


def _open_client(target: SshTarget, timeout: float, accept_new: bool, jump: Connection | None) -> paramiko.SSHClient:
    import paramiko

    _quiet_paramiko()

    client = paramiko.SSHClient()
    for path in target.known_hosts:
        if os.path.exists(path):
            client.load_host_keys(path)
    client.set_missing_host_key_policy(_HostKeyPolicy(target, accept_new))
    sock: Any = None
    if jump is not None:
        jump_transport = jump.client.get_transport()
        sock = jump_transport.open_channel("direct-tcpip", (target.hostname, target.port), ("127.0.0.1", 0),
                                           timeout=timeout)
    elif target.proxy_command:
        sock = paramiko.ProxyCommand(target.proxy_command.replace("%h", target.hostname)
                                     .replace("%p", str(target.port)).replace("%r", target.user))
    try:
        client.connect(target.hostname, port=target.port, username=target.user,
                       key_filename=list(target.key_files) or None, timeout=timeout,
                       banner_timeout=timeout, auth_timeout=timeout, channel_timeout=timeout,
                       allow_agent=not target.identities_only, look_for_keys=not target.identities_only,
                       sock=sock)
    except BaseException as error:
        client.close()
        raise _explain(target, error) from None
    transport = client.get_transport()
    if transport is not None:
        transport.set_keepalive(5)
    return client


def _explain(target: SshTarget, error: BaseException) -> BaseException:
    """Turns a connect failure into one line that says which kind it is and what to do."""
    import paramiko

    node, where = target.node, target.describe()
    if isinstance(error, TransportError):
        return error
    if isinstance(error, socket.gaierror):
        return TransportError(node, "dns", f"{node}: cannot resolve {target.hostname!r} ({error.strerror})",
                              "fix the address in the inventory or ~/.ssh/config, or the controller's DNS")
    if isinstance(error, paramiko.BadHostKeyException):
        return TransportError(
            node, "host-key-changed",
            f"{node}: SSH host key of {target.hostname} CHANGED (now {error.key.get_name()} "
            f"{error.key.fingerprint}); refusing to connect",
            "if the node was reinstalled, remove the old key with "
            f"`ssh-keygen -R {target.hostname}` and connect once to check the new one; otherwise investigate",
        )
    if isinstance(error, paramiko.AuthenticationException):
        keys = ", ".join(target.key_files) or "the ssh agent and ~/.ssh/id_*"
        return TransportError(node, "auth", f"{node}: authentication failed for {where} (tried {keys})",
                              f"install your public key on the node: ssh-copy-id -p {target.port} "
                              f"{target.user}@{target.hostname}; or set identity_file in the inventory")
    if isinstance(error, ConnectionRefusedError) or (
            isinstance(error, paramiko.ssh_exception.NoValidConnectionsError)):
        return TransportError(node, "refused", f"{node}: connection refused by {where}",
                              "is sshd running on the node and listening on that port?")
    if isinstance(error, (socket.timeout, TimeoutError)):
        return TransportError(node, "timeout", f"{node}: no answer from {where} (timed out)",
                              "the node is down, or a firewall drops SSH; check the address and that port 22 "
                              "is open")
    if isinstance(error, OSError) and error.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return TransportError(node, "unreachable", f"{node}: no route to {where} ({error.strerror})",
                              "check the address and the controller's network (VPN?)")
    if isinstance(error, paramiko.SSHException):
        return TransportError(node, "ssh", f"{node}: SSH failed with {where}: {error}",
                              "try `ssh -v` to the node to see the same failure in detail")
    if isinstance(error, OSError):
        return TransportError(node, "network", f"{node}: cannot connect to {where}: {error.strerror or error}")
    return error


@dataclass(frozen=True)
class SshConnector:
    """Opens SSH sessions with one inventory's settings (``transport.base.Connector``)."""

    ssh_config: Path | None = None
    timeout: float = 10.0
    accept_new: bool = False

    def connect(self, host: Host) -> Connection:
        return connect(host, self.ssh_config, self.timeout, self.accept_new)


def connect_all(hosts: Iterable[Host], ssh_config: Path | None, timeout: float,
                accept_new: bool = False) -> Mapping[str, Session | TransportError]:
    """Connects to every host in parallel; each entry is the connection or why it failed."""
    return _connect_all(SshConnector(ssh_config, timeout, accept_new), hosts)


class _as_transport_error:
    """paramiko's and the socket's errors on an open connection, as one TransportError."""

    def __init__(self, node: str, doing: str) -> None:
        self.node, self.doing = node, doing

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        if error is None or isinstance(error, (TransportError, KeyboardInterrupt, SystemExit)):
            return
        if isinstance(error, (OSError, EOFError)) or type(error).__module__.startswith("paramiko"):
            raise TransportError(self.node, "ssh", f"{self.node}: cannot {self.doing}: {error or type(error).__name__}") \
                from error
