"""torchherd run coordinator: fail fast for a detached run, with no controller.

Standard library and ``wire`` only, Python >= 3.8. The controller starts it on
the master node over SSH as ``PYTHON -c PROGRAM CONFIG`` (``torchherd.remote.program``,
``wire.CoordinatorConfig``). It listens on a free TCP port, prints one JSON line
(``wire.CoordinatorReply``) and detaches (own session, stdio on /dev/null). Nodes
never need SSH to each other: every node's supervisor connects to it instead. A
bad config is one line on stderr and exit status 2.

Protocol (``wire``), one line each way:
  node -> coordinator   HELLO <token> <node>     EXIT <node> <code>
  coordinator -> node   STOP <reason>
The first node that exits non-zero, or whose connection drops before it said
EXIT (its supervisor was killed), makes the coordinator send STOP to every
other node. It exits once every node that connected has ended, and the nodes
that never connected have had ``wait`` seconds to do so.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import sys
import time
from typing import Dict, List, Optional, Set

# On a node this is the stand-in module the shipped program registered; see
# torchherd/remote/__init__.py.
from torchherd.remote import wire

READ_SIZE = 4096
EXIT_BAD_CONFIG = 2


class Coordinator:
    def __init__(self, config: wire.CoordinatorConfig, server: socket.socket) -> None:
        self.token = config.token
        self.nodes = list(config.nodes)
        self.state_file = config.state_file
        self.deadline = time.monotonic() + config.wait
        self.server = server
        self.sel = selectors.DefaultSelector()
        self.sel.register(server, selectors.EVENT_READ, None)
        self.partial: Dict[socket.socket, bytes] = {}
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
            "pid": os.getpid(), "port": self.server.getsockname()[1], "state": wire.STATE_RUNNING,
            "culprit": self.culprit, "reason": self.reason}
        path = os.path.expanduser(self.state_file)
        try:
            with open(path + ".tmp", "w") as f:
                json.dump(fields, f)
            os.replace(path + ".tmp", path)
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
        try:
            sock.sendall(line)
        except OSError:
            pass

    def on_line(self, sock: socket.socket, words: List[str]) -> None:
        if words[:2] == [wire.HELLO, self.token] and len(words) == 3:
            self.names[sock] = words[2]
            self.connected.add(words[2])
            if self.reason is not None and words[2] != self.culprit:
                self.send(sock, wire.stop_line(self.reason))
        elif sock in self.names and words[:1] == [wire.EXIT] and len(words) == 3:
            node = self.names[sock]
            self.ended.add(node)
            if words[2] != "0":
                self.stop(node, "%s exited with code %s" % (node, words[2]))
        elif sock not in self.names:
            self.drop(sock)

    def drop(self, sock: socket.socket) -> None:
        node = self.names.pop(sock, None)
        self.partial.pop(sock, None)
        self.sel.unregister(sock)
        sock.close()
        if node is not None and node not in self.ended:
            self.ended.add(node)
            self.stop(node, "%s vanished (its supervisor is gone)" % node)

    def read(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(READ_SIZE)
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

    def finished(self) -> bool:
        if not self.connected <= self.ended:
            return False
        return set(self.nodes) <= self.connected or time.monotonic() > self.deadline

    def run(self) -> None:
        while not self.finished():
            for key, _mask in self.sel.select(1.0):
                if key.data is None:
                    try:
                        sock, _addr = self.server.accept()
                    except OSError:
                        continue
                    self.partial[sock] = b""
                    self.sel.register(sock, selectors.EVENT_READ, "node")
                else:
                    self.read(key.fileobj)  # type: ignore[arg-type]
        self.state_file_done()

    def state_file_done(self) -> None:
        if self.state_file is not None:
            path = os.path.expanduser(self.state_file)
            try:
                with open(path) as f:
                    fields = json.load(f)
                fields["state"] = wire.STATE_EXITED
                with open(path + ".tmp", "w") as f:
                    json.dump(fields, f)
                os.replace(path + ".tmp", path)
            except (OSError, ValueError):
                pass


def main(args: List[str]) -> int:
    try:
        if len(args) != 1:
            raise wire.ConfigError("usage: coordinator.py JSON_CONFIG")
        config = wire.CoordinatorConfig.from_json(args[0])
    except wire.ConfigError as exc:
        sys.stderr.write("torchherd coordinator: %s\n" % exc)
        return EXIT_BAD_CONFIG
    if config.state_file is not None:
        os.makedirs(os.path.dirname(os.path.expanduser(config.state_file)) or ".", exist_ok=True)
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("", 0))
    server.listen(64)
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
