"""The SSH implementation of the transport seam (``transport.base``): the one place that speaks SSH.

Built on fabric: one ``fabric.Connection`` per node, and one per jump host, given to
the nodes behind it as their ``gateway``. What fabric leaves out or gets wrong for us
is done here, on the ``paramiko.SSHClient`` every fabric Connection holds:

* ssh_config is read by ``transport.sshconfig`` (Include, Match, first value wins, as
  ``ssh -G``), never by fabric (paramiko's reader has no Include); the inventory's own
  keys win over the config, as ``ssh -l/-p/-i`` would.
* host keys are checked on every hop before it opens: fabric sets paramiko's
  ``AutoAddPolicy`` and loads no known_hosts; we load what ``transport.knownhosts``
  finds for the host into ``connection.client`` and set our own policy. An unknown key
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

Every paramiko, fabric or socket error is turned into a ``TransportError`` here, where it arises.
"""

from __future__ import annotations

import errno
import os
import random
import shlex
import socket
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from torchherd.errors import TransportError
from torchherd.inventory import Host
from torchherd.transport import knownhosts, sshconfig
from torchherd.transport.base import Closing, CommandResult

if TYPE_CHECKING:  # paramiko and fabric are imported lazily: `torchherd --help` must stay fast.
    import paramiko

READ_SIZE = 1 << 22
"""Above paramiko's channel window (2 MiB): a read takes all it holds, since a partial read
moves the rest of its buffer to the front, costing a copy of up to the window each time."""
HANDSHAKES = 4
"""Unauthenticated handshakes at once towards one sshd: well under the 10 of sshd's stock
``MaxStartups 10:30:100``, past which it starts dropping new connections."""
ATTEMPTS = 5
"""Tries of one connection whose banner or handshake is dropped or reset, the first included."""
BACKOFF_SECONDS = 0.3
HANDSHAKE_GRACE_SECONDS = 1.0
"""How long a handshake's thread is given to report its own failure (paramiko reads in 0.1 s steps)."""
MAX_JUMP_DEPTH = 8
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


@dataclass(frozen=True)
class SshTarget:
    """Where and how to connect to one node (or jump host), ssh_config and inventory merged."""

    node: str
    hostname: str
    port: int
    user: str
    key_files: tuple[str, ...]
    known_hosts: tuple[str, ...]
    """The user's known_hosts files (``UserKnownHostsFile``): new keys go to the first."""
    proxy_jump: str | None
    proxy_command: str | None
    """Tokens expanded; run with the user's shell."""
    identities_only: bool
    global_known_hosts: tuple[str, ...] = ()
    host_key_name: str = ""
    """The name its key is recorded under: HostKeyAlias, ``host`` or ``[host]:port``."""
    strict: str = "ask"
    strict_where: str = ""
    hash_known_hosts: bool = False
    connect_timeout: float | None = None
    jumps: tuple[sshconfig.Jump, ...] = ()
    alias: str = ""
    revoked_host_keys: tuple[str, ...] = ()
    """``RevokedHostKeys`` files: a key they list is refused; one that cannot be read refuses the host."""

    def describe(self) -> str:
        port = f":{self.port}" if self.port != 22 else ""
        via = f" via {self.proxy_jump}" if self.proxy_jump else ""
        return f"{self.user}@{self.hostname}{port}{via}"

    @property
    def chain_key(self) -> tuple[str, str, int, str]:
        return (self.user, self.hostname, self.port, self.proxy_command or "")


def _target(node: str, found: sshconfig.HostConfig) -> SshTarget:
    strict = found.settings.get("stricthostkeychecking")
    return SshTarget(
        node=node,
        hostname=found.hostname,
        port=found.port,
        user=found.user,
        key_files=found.identity_files,
        known_hosts=found.user_known_hosts_files,
        proxy_jump=",".join(str(hop) for hop in found.proxy_jump) or None,
        proxy_command=found.proxy_command,
        identities_only=found.identities_only,
        global_known_hosts=found.global_known_hosts_files,
        host_key_name=found.host_key_name,
        strict=found.strict_host_key_checking,
        strict_where=strict.where if strict is not None else "",
        hash_known_hosts=found.hash_known_hosts,
        connect_timeout=found.connect_timeout,
        jumps=found.proxy_jump,
        alias=found.original_host,
        revoked_host_keys=found.revoked_host_keys,
    )


def _lookup(node: str, alias: str, ssh_config: Path | None, local: sshconfig.Local, *, user: str | None = None,
            port: int | None = None, jump: str | None = None) -> sshconfig.HostConfig:
    try:
        return sshconfig.lookup(alias, ssh_config, local, user=user, port=port, jump=jump)
    except sshconfig.SshConfigError as error:
        raise TransportError(node, "ssh-config", f"{node}: cannot read the ssh configuration: {error}",
                             "fix the line named (`ssh -G " + shlex.quote(alias) + "` shows how ssh reads it)") \
            from None


def resolve_target(host: Host, ssh_config: Path | None, local: sshconfig.Local | None = None) -> SshTarget:
    """The node's ssh_config entry merged with the inventory (the inventory wins; its
    ``identity_file`` replaces the config's IdentityFiles). Without ``ssh_config``:
    ``~/.ssh/config``, then ``/etc/ssh/ssh_config``, as ``ssh`` reads them."""
    local = local or sshconfig.Local.of_this_machine()
    target = _target(host.name, _lookup(host.name, host.address, ssh_config, local, user=host.user,
                                        port=host.ssh_port))
    if host.identity_file:
        target = replace(target, key_files=(os.path.expanduser(host.identity_file),))
    return target


def ssh_hostnames(hosts: Iterable[Host], ssh_config: Path | None,
                  local: sshconfig.Local | None = None) -> dict[str, str]:
    """Per host whose address the ssh_config resolves to another HostName (an alias), that
    HostName, as ``ssh -G`` prints it. A host whose config cannot be read is left out: its
    connection says why."""
    local = local or sshconfig.Local.of_this_machine()
    found: dict[str, str] = {}
    for host in hosts:
        try:
            hostname = resolve_target(host, ssh_config, local).hostname
        except TransportError:
            continue
        if hostname != host.address.lower():
            found[host.name] = hostname
    return found


def jump_chain(target: SshTarget, ssh_config: Path | None, local: sshconfig.Local,
               depth: int = 0) -> list[SshTarget]:
    """The jump hosts in front of ``target``, first to last, each resolved as ``ssh -J`` does:
    the first with its own ssh_config entry (its own ProxyJump or ProxyCommand included),
    every later one reached through the hops before it."""
    hops = target.jumps
    if not hops or _is_itself(hops[0], target):
        return []
    if depth >= MAX_JUMP_DEPTH:
        raise TransportError(target.node, "ssh-config", f"{target.node}: ProxyJump goes {MAX_JUMP_DEPTH} hops deep "
                             f"(a loop through {hops[0]}?)",
                             "give the jump host `ProxyJump none` in its own Host block")
    chain: list[SshTarget] = []
    for index, hop in enumerate(hops):
        name = f"jump host {hop.host}"
        before = ",".join(str(earlier) for earlier in hops[:index]) or None
        found = _target(name, _lookup(name, hop.host, ssh_config, local, user=hop.user, port=hop.port, jump=before))
        if index == 0:
            chain += jump_chain(found, ssh_config, local, depth + 1)
        chain.append(found)
    return chain


def _is_itself(hop: sshconfig.Jump, target: SshTarget) -> bool:
    # `Host * ProxyJump bastion` also matches the bastion itself; as fabric does, a host
    # whose first hop is itself is reached directly rather than through an endless loop.
    return hop.host in (target.alias, target.hostname) and (hop.port is None or hop.port == target.port)


class _HostKeyCheck:
    """One hop's host key verification: the keys on record are loaded into paramiko (so it
    prefers their type, and compares), and this is its missing-key policy."""

    def __init__(self, target: SshTarget, accept_new: bool, home: str) -> None:
        self.target = target
        self.accept_new = accept_new
        self.home = home
        self.keys = self.on_record()
        self.revoked, self.revoked_error = self.revoked_files()
        self.off = (f"StrictHostKeyChecking no ({target.strict_where or 'your ssh config'}): a new host key "
                    "would be accepted unchecked" if target.strict == "no" else "")
        self.note: str | None = self.off or None
        """What ``check`` says when the key was not verified against one on record."""

    def on_record(self) -> knownhosts.HostKeys:
        entries = knownhosts.load(self.target.known_hosts + self.target.global_known_hosts)
        return knownhosts.for_name(entries, self.target.host_key_name or self.target.hostname)

    def revoked_files(self) -> tuple[tuple[knownhosts.RevokedKeys, ...], TransportError | None]:
        """The ``RevokedHostKeys`` files, or why one cannot be read (OpenSSH then refuses)."""
        found = []
        for path in self.target.revoked_host_keys:
            try:
                found.append(knownhosts.load_revoked(path))
            except knownhosts.RevokedKeysError as error:
                target = self.target
                return (), TransportError(
                    target.node, "host-key-revoked",
                    f"{target.node}: cannot check the host key of {target.hostname} against RevokedHostKeys "
                    f"({error}); refusing to connect, as ssh does",
                    "fix or remove that file, or the RevokedHostKeys line in your ssh config")
        return tuple(found), None

    def verdict(self, blob: bytes) -> knownhosts.Verdict:
        """What the presented key is: a RevokedHostKeys file first (as OpenSSH checks it
        before known_hosts), then known_hosts."""
        for revoked in self.revoked:
            if revoked.revokes(blob):
                return knownhosts.Verdict("revoked-file", revoked_by=revoked.path)
        return self.keys.verdict(blob)

    def install(self, client: paramiko.SSHClient) -> None:
        """Loads the keys on record and this policy into ``client``, before it connects.
        A key a RevokedHostKeys file lists is left out, so paramiko asks the policy."""
        import paramiko

        if self.revoked_error is not None:
            raise self.revoked_error
        name = self.target.hostname if self.target.port == 22 else f"[{self.target.hostname}]:{self.target.port}"
        for entry in self.keys.keys:
            if any(revoked.revokes(entry.blob) for revoked in self.revoked):
                continue
            try:
                key = paramiko.PKey.from_type_string(entry.key_type, entry.blob)
            except Exception:  # a key type paramiko cannot use (sk-*) is one it will never be shown
                continue
            client.get_host_keys().add(name, entry.key_type, key)
        client.set_missing_host_key_policy(self)

    def accepts_new(self) -> bool:
        return self.accept_new or self.target.strict in ("accept-new", "no")

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        verdict = self.verdict(key.asbytes())
        if verdict.kind != "unknown":
            raise self.refusal(verdict, key)
        if not self.accepts_new():
            target = self.target
            port = f" -p {target.port}" if target.port != 22 else ""
            raise TransportError(
                target.node, "host-key-unknown",
                f"{target.node}: unknown SSH host key for {hostname} ({key.get_name()} {key.fingerprint})",
                f"check the fingerprint, then trust it with `ssh{port} {target.user}@{target.hostname}` "
                f"once, or rerun with --accept-new-host-keys",
            )
        self.record(client, hostname, key)

    def record(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        target = self.target
        if not target.known_hosts:
            raise TransportError(target.node, "host-key-unknown",
                                 f"{target.node}: unknown SSH host key for {hostname}, and no known_hosts file to "
                                 f"record it in (UserKnownHostsFile none)",
                                 "name a UserKnownHostsFile in your ssh config, or record the key yourself")
        path = target.known_hosts[0]
        line = knownhosts.entry_line(target.host_key_name or hostname, key.asbytes(), target.hash_known_hosts)
        try:
            knownhosts.append(path, line, self.home)
        except OSError as error:
            raise TransportError(target.node, "host-key-unknown",
                                 f"{target.node}: cannot record the new host key of {hostname} in {path}: "
                                 f"{error.strerror or error}") from None
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.keys = self.on_record()  # a retry of this connection must find the key, not record it twice
        why = (f"StrictHostKeyChecking {target.strict} ({target.strict_where})" if target.strict in ("accept-new", "no")
               else "--accept-new-host-keys")
        self.note = f"new host key {key.get_name()} {key.fingerprint} accepted ({why}) and recorded in {path}"

    def refusal(self, verdict: knownhosts.Verdict, key: paramiko.PKey) -> TransportError:
        """Why a key that is not simply new is refused, whatever the flags say."""
        target, entry = self.target, verdict.entry
        node, name, now = target.node, target.host_key_name or target.hostname, f"{key.get_name()} {key.fingerprint}"
        where = f" ({entry.where})" if entry is not None else ""
        if verdict.kind == "revoked-file":
            return TransportError(
                node, "host-key-revoked",
                f"{node}: SSH host key of {target.hostname} ({now}) is revoked by file {verdict.revoked_by} "
                "(RevokedHostKeys); refusing to connect",
                "a revoked key means the node's key was compromised or retired: do not connect until "
                "the node has a new key you have checked")
        if verdict.kind == "revoked":
            return TransportError(
                node, "host-key-revoked",
                f"{node}: SSH host key of {target.hostname} is REVOKED{where} ({now}); refusing to connect",
                "a revoked key means the node's key was compromised or retired: do not connect until "
                "the node has a new key you have checked")
        if verdict.kind == "cert-authority":
            return TransportError(
                node, "host-key-cert",
                f"{node}: known_hosts trusts a certificate authority for {name}{where}, but torchherd cannot "
                f"verify SSH host certificates; refusing the host's plain key ({now})",
                f"add the host's own key to known_hosts after checking its fingerprint (`ssh-keyscan "
                f"{'-p ' + str(target.port) + ' ' if target.port != 22 else ''}{target.hostname}`)")
        recorded = f"; known_hosts has {entry.key_type} {entry.fingerprint}{where}" if entry is not None else ""
        file_hint = f" -f {shlex.quote(entry.path)}" if entry is not None else ""
        return TransportError(
            node, "host-key-changed",
            f"{node}: SSH host key of {target.hostname} CHANGED (now {now}{recorded}); refusing to connect",
            f"if the node was reinstalled, remove the old key with `ssh-keygen -R {shlex.quote(name)}{file_hint}` "
            "and connect once to check the new one; otherwise investigate",
        )


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
    second (0.02 s with one). Data is read as it arrives either way."""
    global _TRANSPORT_CLASS
    if _TRANSPORT_CLASS is None:
        import paramiko

        class CalmTransport(paramiko.Transport):  # type: ignore[misc]
            _active_check_timeout = 1.0

        _TRANSPORT_CLASS = CalmTransport
    return _TRANSPORT_CLASS


_TRANSPORT_CLASS: Any = None


def _proxy_command_line(command: str) -> str:
    # ssh runs ProxyCommand as `exec COMMAND` in the user's shell; paramiko splits its
    # argument with shlex and runs it without one, so hand it the shell's own argv.
    return shlex.join([os.environ.get("SHELL") or "/bin/sh", "-c", f"exec {command}"])


@dataclass
class _Chain:
    """The jump hosts in front of some nodes: one open fabric Connection per hop, shared."""

    hops: list[SshTarget]
    connections: list[Any] = field(default_factory=list)
    users: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    failure: tuple[float, TransportError] | None = None

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
    chains: dict[tuple[tuple[str, str, int, str], ...], _Chain] = field(default_factory=dict)
    gates: dict[tuple[object, ...], threading.BoundedSemaphore] = field(default_factory=dict)
    local: sshconfig.Local | None = None

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

    def connect(self, host: Host) -> Connection:
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

    def _acquire(self, key: tuple[tuple[str, str, int, str], ...], hops: list[SshTarget],
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

    def _open_chain(self, chain: _Chain, key: tuple[tuple[str, str, int, str], ...]) -> None:
        if chain.is_open():
            return
        if chain.failure is not None and time.monotonic() - chain.failure[0] < self.timeout:
            raise chain.failure[1]  # every node behind a dead jump host fails at once, not one by one
        chain.close()
        try:
            for index, hop in enumerate(chain.hops):
                gateway = chain.connections[-1] if chain.connections else (hop.proxy_command or False)
                opened, _ = self._open(hop, gateway, key[:index])
                chain.connections.append(opened)
        except TransportError as error:
            chain.close()
            chain.failure = (time.monotonic(), error)
            raise
        except BaseException:
            chain.close()
            raise
        chain.failure = None

    def _release(self, key: tuple[tuple[str, str, int, str], ...], chain: _Chain) -> None:
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
        check = _HostKeyCheck(target, self.accept_new, self._shared.this_machine().home)
        gate = self._shared.gate((via, target.hostname, target.port), self.handshakes)
        for attempt in range(ATTEMPTS):
            connection = self._fabric_connection(target, gateway)
            check.install(connection.client)
            with gate:
                try:
                    connection.open()
                    break
                except BaseException as failure:
                    error = _handshake_failure(connection.client, failure)
                    connection.client.close()
                    if attempt == ATTEMPTS - 1 or not _dropped_early(error):
                        raise _explain(target, error, check) from None
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


def _handshake_failure(client: paramiko.SSHClient, error: BaseException) -> BaseException:
    """What really failed when paramiko says "No existing session": its ``start_client``
    gives up at the connect timeout, the moment the banner's own timeout ends too, and
    when it wins that race the transport's thread is about to fail with the cause (a
    banner that never came, or one dropped). Read before the client is closed: closing
    makes the thread fail with EOF instead."""
    import paramiko

    if not isinstance(error, paramiko.SSHException) or "no existing session" not in str(error).lower():
        return error
    transport = client.get_transport()
    cause = None
    if transport is not None:
        transport.join(HANDSHAKE_GRACE_SECONDS)
        cause = transport.get_exception()
    return cause if isinstance(cause, BaseException) else error


def _silent(error: BaseException) -> bool:
    """An sshd that took the connection and never sent its banner within the timeout (out
    of memory, a hung sshd, a kernel stuck in D-state). paramiko reports it as the same
    "Error reading SSH protocol banner" as a dropped banner; the socket timeout it raised
    from is what tells them apart."""
    import paramiko

    return (isinstance(error, paramiko.SSHException) and "banner" in str(error).lower()
            and isinstance(error.__context__, TimeoutError))


def _dropped_early(error: BaseException) -> bool:
    """An sshd that drops or resets a connection before authentication (``MaxStartups``):
    worth another try. A refusal, a timeout (a silent banner included: another try would
    wait as long again), a key or an authentication failure is not."""
    import paramiko

    if isinstance(error, (EOFError, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
        return True
    if _silent(error):
        return False
    if isinstance(error, paramiko.SSHException) and not isinstance(
            error, (paramiko.AuthenticationException, paramiko.BadHostKeyException, paramiko.ChannelException)):
        text = str(error).lower()
        return "banner" in text or "reset" in text or "eof" in text
    return False


def _explain(target: SshTarget, error: BaseException, check: _HostKeyCheck | None = None) -> BaseException:
    """Turns a connect failure into one line that says which kind it is and what to do."""
    import paramiko

    node, where = target.node, target.describe()
    if isinstance(error, TransportError):
        return error
    if isinstance(error, socket.gaierror):
        return TransportError(node, "dns", f"{node}: cannot resolve {target.hostname!r} ({error.strerror})",
                              "fix the address in the inventory or ~/.ssh/config, or the controller's DNS")
    if isinstance(error, paramiko.BadHostKeyException):
        check = check or _HostKeyCheck(target, False, "")
        verdict = check.verdict(error.key.asbytes())
        return check.refusal(verdict if verdict.kind != "known" else knownhosts.Verdict("changed"), error.key)
    if isinstance(error, paramiko.AuthenticationException):
        keys = ", ".join(path for path in target.key_files if os.path.isfile(path)) or "the ssh agent"
        return TransportError(node, "auth", f"{node}: authentication failed for {where} (tried {keys})",
                              f"install your public key on the node: ssh-copy-id -p {target.port} "
                              f"{target.user}@{target.hostname}; or set identity_file in the inventory")
    if isinstance(error, paramiko.ChannelException):
        return TransportError(node, "unreachable",
                              f"{node}: the jump host cannot reach {target.hostname}:{target.port} ({error.text})",
                              "is the node up and its sshd running? does a firewall between the jump host and "
                              "the node drop SSH?")
    if isinstance(error, paramiko.ssh_exception.NoValidConnectionsError):
        # paramiko wraps every failed address in it, whatever the errno (no route to host
        # too): the first address's own error says which kind it is.
        errors = [item for item in getattr(error, "errors", {}).values() if isinstance(item, OSError)]
        if errors and not isinstance(errors[0], paramiko.ssh_exception.NoValidConnectionsError):
            return _explain(target, errors[0], check)
    if isinstance(error, (ConnectionRefusedError, paramiko.ssh_exception.NoValidConnectionsError)):
        return TransportError(node, "refused", f"{node}: connection refused by {where}",
                              "is sshd running on the node and listening on that port?")
    if isinstance(error, (socket.timeout, TimeoutError)):
        return TransportError(node, "timeout", f"{node}: no answer from {where} (timed out)",
                              "the node is down, or a firewall drops SSH; check the address and that port "
                              f"{target.port} is open")
    if isinstance(error, OSError) and error.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return TransportError(node, "unreachable", f"{node}: no route to {where} ({error.strerror})",
                              "check the address and the controller's network (VPN?)")
    if _silent(error):
        return TransportError(node, "silent",
                              f"{node}: sshd on {where} accepted the connection but never answered: the node may be "
                              "overloaded or hung",
                              "log in on its console, or look at its memory and load; a node that accepts TCP "
                              "but sends no SSH banner in ssh_timeout is not usable")
    if _dropped_early(error):
        return TransportError(node, "dropped",
                              f"{node}: {where} dropped the connection before login, {ATTEMPTS} times ({error})",
                              "sshd's MaxStartups may be turning connections away: too many at once to one "
                              "host (a bastion?), or it is overloaded")
    if isinstance(error, paramiko.SSHException):
        return TransportError(node, "ssh", f"{node}: SSH failed with {where}: {error}",
                              "try `ssh -v` to the node to see the same failure in detail")
    if isinstance(error, OSError):
        return TransportError(node, "network", f"{node}: cannot connect to {where}: {error.strerror or error}")
    return error


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
        if isinstance(error, UnicodeEncodeError):  # a command naming a node's file whose name is not UTF-8
            raise TransportError(self.node, "ssh", f"{self.node}: cannot {self.doing}: a command or path that is not "
                                                   "UTF-8") from error
