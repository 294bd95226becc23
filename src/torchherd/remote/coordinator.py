"""torchherd run coordinator: fail fast for a detached run, with no controller.

Standard library and ``wire`` only, Python >= 3.8. The controller starts it on
the master node over SSH as ``PYTHON -I -S -u -c PROGRAM - RUN_ID`` (``torchherd.remote.command``)
with its config (``wire.CoordinatorConfig``) as the first line of stdin: the config
holds every node's secret, and a command line is readable by every user of the master.
It listens on the master address, prints one JSON line (``wire.CoordinatorReply``) and
detaches (own session, stdio on /dev/null). Nodes never need SSH to each other: every
node's supervisor connects to it instead. A bad config is one line on stderr and exit
status 2.

Protocol (``wire``), one line each way:
  node -> coordinator   HELLO <token> <node>     EXIT <node> <code>
  coordinator -> node   STOP <reason>
A HELLO counts only with that node's own token (``hmac.compare_digest``), for a node
of the run, once. The first node that exits non-zero, or whose connection drops
before it said EXIT (its supervisor was killed), makes the coordinator send STOP to
every other node. It exits once every node that connected has ended, and the nodes
that never connected have had ``wait`` seconds to do so.

Anyone on the network can connect: a connection that has not said a valid HELLO
within HELLO_TIMEOUT is closed, at most MAX_PENDING wait at once (the oldest goes
first), and every socket is non-blocking: a peer that does not read is dropped, never
waited for.
"""

from __future__ import annotations

import errno
import hmac
import json
import os
import selectors
import socket
import sys
import time
from typing import Dict, List, Optional, Set, Tuple

# On a node this is the stand-in module the shipped program registered; see
# torchherd/remote/__init__.py.
from torchherd.remote import wire

READ_SIZE = 4096
EXIT_BAD_CONFIG = 2
HELLO_TIMEOUT = 5.0
"""Seconds a connection has to say a valid HELLO."""
MAX_PENDING = 64
"""Connections waiting for their HELLO at once; beyond, the oldest is closed."""
TICK = 0.5


class Coordinator:
    def __init__(self, config: wire.CoordinatorConfig, server: socket.socket) -> None:
        self.tokens = dict(config.tokens)
        self.state_file = config.state_file
        self.deadline = time.monotonic() + config.wait
        self.server = server
        self.server.setblocking(False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(server, selectors.EVENT_READ, None)
        self.partial: Dict[socket.socket, bytes] = {}
        self.pending: Dict[socket.socket, float] = {}
        """Connections that have not said HELLO yet, and when they came (oldest first)."""
        self.names: Dict[socket.socket, str] = {}
        self.connected: Set[str] = set()
        self.ended: Set[str] = set()
        self.culprit: Optional[str] = None
        self.reason: Optional[str] = None
        self.save()

    def save(self) -> None:
        if self.state_file is None:
            return
        fields: wire.CoordinatorStateFile = {
            "pid": os.getpid(), "start": wire.process_start(os.getpid()), "port": self.server.getsockname()[1],
            "state": wire.STATE_RUNNING, "culprit": self.culprit, "reason": self.reason}
        try:
            wire.write_json_atomic(self.state_file, fields)
        except OSError:
            pass

    def stop(self, culprit: str, reason: str) -> None:
        if self.culprit is not None:
            return
        self.culprit, self.reason = culprit, reason
        self.save()
        for sock, name in list(self.names.items()):
            if name != culprit:
                self.send(sock, wire.stop_line(reason))

    def send(self, sock: socket.socket, line: bytes) -> None:
        """One short line, never blocking: a peer whose buffer cannot take it is dropped."""
        try:
            sent = sock.send(line)
        except OSError:
            sent = -1
        if sent != len(line) and sock in self.partial:
            self.drop(sock)

    def on_line(self, sock: socket.socket, words: List[str]) -> None:
        if sock in self.pending:
            self.on_hello(sock, words)
        elif words[:1] == [wire.EXIT] and len(words) == 3:
            node = self.names[sock]
            self.ended.add(node)
            if words[2] != "0":
                self.stop(node, "%s exited with code %s" % (node, words[2]))

    def on_hello(self, sock: socket.socket, words: List[str]) -> None:
        """A node of the run, with its own token, not seen before; anything else is dropped."""
        node = words[2] if len(words) == 3 and words[0] == wire.HELLO else None
        token = self.tokens.get(node) if node is not None else None
        if (node is None or token is None or node in self.connected
                or not hmac.compare_digest(words[1].encode(), token.encode())):
            self.drop(sock)
            return
        del self.pending[sock]
        self.names[sock] = node
        self.connected.add(node)
        if self.reason is not None and node != self.culprit:
            self.send(sock, wire.stop_line(self.reason))

    def drop(self, sock: socket.socket) -> None:
        if sock not in self.partial:
            return
        node = self.names.pop(sock, None)
        self.partial.pop(sock, None)
        self.pending.pop(sock, None)
        self.sel.unregister(sock)
        sock.close()
        if node is not None and node not in self.ended:
            self.ended.add(node)
            self.stop(node, "%s vanished (its supervisor is gone)" % node)

    def read(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.drop(sock)
            return
        lines = (self.partial.get(sock, b"") + data).split(b"\n")
        self.partial[sock] = lines.pop()[-READ_SIZE:]
        for line in lines:
            if sock in self.partial:
                self.on_line(sock, line.decode("utf-8", "replace").split())

    def accept(self) -> None:
        try:
            sock, _addr = self.server.accept()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE) and self.pending:
                self.drop(next(iter(self.pending)))  # make room: the oldest stranger goes
            return
        if len(self.pending) >= MAX_PENDING:
            self.drop(next(iter(self.pending)))
        sock.setblocking(False)
        self.partial[sock] = b""
        self.pending[sock] = time.monotonic()
        self.sel.register(sock, selectors.EVENT_READ, "node")

    def expire(self, now: float) -> None:
        for sock, since in list(self.pending.items()):
            if now - since > HELLO_TIMEOUT:
                self.drop(sock)

    def finished(self) -> bool:
        if not self.connected <= self.ended:
            return False
        return set(self.tokens) <= self.connected or time.monotonic() > self.deadline

    def run(self) -> None:
        while not self.finished():
            for key, _mask in self.sel.select(TICK):
                if key.data is None:
                    self.accept()
                else:
                    self.read(key.fileobj)  # type: ignore[arg-type]
            self.expire(time.monotonic())
        self.state_file_done()

    def state_file_done(self) -> None:
        if self.state_file is not None:
            path = os.path.expanduser(self.state_file)
            try:
                with open(path) as f:
                    fields = json.load(f)
                fields["state"] = wire.STATE_EXITED
                wire.write_json_atomic(path, fields)
            except (OSError, ValueError):
                pass


def listen(host: str) -> Tuple[Optional[socket.socket], str]:
    """A listening socket on ``host`` (every interface when empty), or None and why."""
    try:
        infos = socket.getaddrinfo(host or None, 0, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        return None, "cannot resolve %r: %s" % (host, exc)
    why = "no address"
    for family, kind, proto, _name, address in sorted(infos, key=lambda info: info[0] != socket.AF_INET):
        server = socket.socket(family, kind, proto)
        try:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(address[:2])
            server.listen(64)
        except OSError as exc:
            server.close()
            why = "cannot listen on %s: %s" % (address[0], exc.strerror)
            continue
        return server, ""
    return None, why


def read_config_line() -> str:
    data = b""
    while b"\n" not in data and len(data) < 1 << 20:
        chunk = os.read(0, READ_SIZE)
        if not chunk:
            break
        data += chunk
    return data.partition(b"\n")[0].decode("utf-8", "replace")


def main(args: List[str]) -> int:
    os.umask(0o077)  # the state file and its directory: this user's only
    try:
        if len(args) != 2 or args[0] != "-":
            raise wire.ConfigError("usage: coordinator.py - RUN_ID  (the config on stdin)")
        config = wire.CoordinatorConfig.from_json(read_config_line())
    except wire.ConfigError as exc:
        sys.stderr.write("torchherd coordinator: %s\n" % exc)
        return EXIT_BAD_CONFIG
    if config.state_file is not None:
        os.makedirs(os.path.dirname(os.path.expanduser(config.state_file)) or ".", exist_ok=True)
    server, why = listen(config.host)
    if server is None:
        sys.stderr.write("torchherd coordinator: %s\n" % why)
        return 1
    pid = os.fork()
    if pid > 0:
        sys.stdout.write(wire.CoordinatorReply(server.getsockname()[1], pid).to_json() + "\n")
        sys.stdout.flush()
        return 0
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    try:
        Coordinator(config, server).run()
    finally:
        os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
