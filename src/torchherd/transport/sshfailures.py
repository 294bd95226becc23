"""A failed SSH connection told in one line: which kind of failure it is (DNS, refused,
timed out, silent, dropped, a host key, authentication) and what to do about it; and
which failures are worth another try."""

from __future__ import annotations

import errno
import os
import socket
from typing import TYPE_CHECKING

from torchherd.errors import TransportError
from torchherd.transport import knownhosts
from torchherd.transport.hostkeys import HostKeyCheck
from torchherd.transport.sshtarget import SshTarget

if TYPE_CHECKING:  # paramiko is imported lazily: `torchherd --help` must stay fast.
    import paramiko

ATTEMPTS = 5
"""Tries of one connection whose banner or handshake is dropped or reset, the first included."""


HANDSHAKE_GRACE_SECONDS = 1.0
"""How long a handshake's thread is given to report its own failure (paramiko reads in 0.1 s steps)."""


def handshake_failure(client: paramiko.SSHClient, error: BaseException) -> BaseException:
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


def silent(error: BaseException) -> bool:
    """An sshd that took the connection and never sent its banner within the timeout (out
    of memory, a hung sshd, a kernel stuck in D-state). paramiko reports it as the same
    "Error reading SSH protocol banner" as a dropped banner; the socket timeout it raised
    from is what tells them apart."""
    import paramiko

    return (isinstance(error, paramiko.SSHException) and "banner" in str(error).lower()
            and isinstance(error.__context__, TimeoutError))


def dropped_early(error: BaseException) -> bool:
    """An sshd that drops or resets a connection before authentication (``MaxStartups``):
    worth another try. A refusal, a timeout (a silent banner included: another try would
    wait as long again), a key or an authentication failure is not."""
    import paramiko

    if isinstance(error, (EOFError, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
        return True
    if silent(error):
        return False
    if isinstance(error, paramiko.SSHException) and not isinstance(
            error, (paramiko.AuthenticationException, paramiko.BadHostKeyException, paramiko.ChannelException)):
        text = str(error).lower()
        return "banner" in text or "reset" in text or "eof" in text
    return False


def explain(target: SshTarget, error: BaseException, check: HostKeyCheck | None = None) -> BaseException:
    """Turns a connect failure into one line that says which kind it is and what to do."""
    import paramiko

    node, where = target.node, target.describe()
    if isinstance(error, TransportError):
        return error
    if isinstance(error, socket.gaierror):
        return TransportError(node, "dns", f"{node}: cannot resolve {target.hostname!r} ({error.strerror})",
                              "fix the address (in -H or the inventory) or ~/.ssh/config, or the controller's DNS")
    if isinstance(error, paramiko.BadHostKeyException):
        check = check or HostKeyCheck(target, False, "")
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
            return explain(target, errors[0], check)
    if isinstance(error, (ConnectionRefusedError, paramiko.ssh_exception.NoValidConnectionsError)):
        return TransportError(node, "refused", f"{node}: connection refused by {target.describe(port_always=True)}",
                              "is sshd running on the node and listening on that port?")
    if isinstance(error, (socket.timeout, TimeoutError)):
        return TransportError(node, "timeout", f"{node}: no answer from {where} (timed out)",
                              "the node is down, or a firewall drops SSH; check the address and that port "
                              f"{target.port} is open")
    if isinstance(error, OSError) and error.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return TransportError(node, "unreachable", f"{node}: no route to {where} ({error.strerror})",
                              "check the address and the controller's network (VPN?)")
    if silent(error):
        return TransportError(node, "silent",
                              f"{node}: sshd on {where} accepted the connection but never answered: the node may be "
                              "overloaded or hung",
                              "log in on its console, or look at its memory and load; a node that accepts TCP "
                              "but sends no SSH banner in ssh_timeout is not usable")
    if dropped_early(error):
        return TransportError(node, "dropped",
                              f"{node}: {where} dropped the connection before login, {ATTEMPTS} times ({error})",
                              "sshd's MaxStartups may be turning connections away: too many at once to one "
                              f"host (a bastion?), or it is overloaded; or something on port {target.port} closes "
                              "the connection before SSH starts (not sshd? a proxy or load balancer?)")
    if isinstance(error, paramiko.SSHException):
        return TransportError(node, "ssh", f"{node}: SSH failed with {where}: {error}",
                              "try `ssh -v` to the node to see the same failure in detail")
    if isinstance(error, OSError):
        return TransportError(node, "network", f"{node}: cannot connect to {where}: {error.strerror or error}")
    return error


class as_transport_error:
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
