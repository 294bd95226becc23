"""torchherd's node-to-node relay, on a node: one link of a chain that carries files from
where they are to the nodes that lack them, each receiver passing the bytes on to the next
as it writes them (N nodes take about the time of one copy).

Standard library only, Python >= 3.8. Shared by ``checkpoint.py`` (a checkpoint, from the
node that has it) and ``image.py`` (an image archive, fed by the controller on the first
receiver's stdin). The protocol, for every link:

- the controller sends one JSON line on stdin: ``{"token": HEX, "bind": ADDRESS or null,
  "downstream": BOOL, ...}`` (the program's own keys beside these); with ``downstream``
  the program listens on ADDRESS (the node's job address; a free port) and prints
  ``{"port": P}``, else ``{"port": null}``;
- a receiver then gets ``{"upstream": [HOST, PORT]}``, connects there and sends the token
  as its first line, or ``{"upstream": null}``: the controller sends the stream itself on
  stdin, right after that line;
- a listener serves only the one connection whose first line is the token (a stranger's
  is closed), then sends the stream: a header line ``{"files": [[PATH, SIZE, MTIME],
  ...]}`` and the files' bytes, one after another; with ``"trailer": true`` (a copy whose
  hash the controller does not know: replication's, which would otherwise read the whole
  checkpoint once more, at full speed, before its paced copy) the source hashes as it sends
  and one line follows the bytes, ``{"sha256": HEX}`` or ``{"error": TEXT}``, passed on
  down the chain: each receiver checks its copy against it;
- with ``"progress": true`` a receiver prints ``{"progress": BYTES}`` about twice a second
  while it receives, and once more when every byte is in (before its check); its last line is ``{"ok": true, ...}`` or ``{"error": TEXT}``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO, Any, Callable, Dict, Iterable, List, Optional, Tuple

CHUNK = 1 << 20
PACED_CHUNK = 1 << 16
"""A paced sender's block: each ``sendall`` of it is over in well under a millisecond, so
the job's own packets never wait behind a megabyte of the copy's."""
CONNECT_SECONDS = 30.0
"""The longest a receiver waits to connect to its upstream, and a listener for its receiver."""
STALL_SECONDS = 120.0
"""A link that moves no byte for this long is broken."""
PROGRESS_SECONDS = 0.5
"""How often a receiver says how far it is (``"progress": true``)."""


def emit(message: Dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


class Link:
    """Bytes from upstream (a socket, or the controller on stdin: ``Link(None)``, read
    unbuffered, so that no line read ahead of a stream that follows it), a line or a block
    at a time."""

    def __init__(self, sock: Optional[socket.socket]) -> None:
        self.sock = sock
        self.buffer = b""

    def _recv(self, most: int) -> bytes:
        return self.sock.recv(most) if self.sock is not None else os.read(0, most)

    def line(self, limit: int = 1 << 24) -> bytes:
        while b"\n" not in self.buffer:
            data = self._recv(CHUNK)
            if not data:
                raise EOFError("the upstream closed the connection")
            self.buffer += data
            if len(self.buffer) > limit:
                raise ValueError("a line too long from the upstream")
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line

    def block(self, most: int) -> bytes:
        if self.buffer:
            data, self.buffer = self.buffer[:most], self.buffer[most:]
            return data
        data = self._recv(min(most, CHUNK))
        if not data:
            raise EOFError("the upstream closed the connection")
        return data

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


def serve(work: Callable[[Dict[str, Any], Link], Dict[str, Any]]) -> int:
    """A relay program's link: its order, one JSON line on stdin, given to ``work`` with
    stdin (the stream may follow it there); what ``work`` answers, one line. The exit status."""
    stdin = Link(None)
    try:
        line = stdin.line()
    except EOFError:
        return 1
    emit(work(json.loads(line), stdin))
    return 0


def accept(listener: socket.socket, token: bytes) -> socket.socket:
    """The one connection that sends the token first; others are closed."""
    deadline = time.monotonic() + CONNECT_SECONDS
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the next node never connected")
        listener.settimeout(left)
        sock, _ = listener.accept()
        sock.settimeout(5.0)
        try:
            first = Link(sock).line(limit=256)
        except (OSError, EOFError, ValueError):
            sock.close()
            continue
        if hmac.compare_digest(first, token):
            sock.settimeout(STALL_SECONDS)
            return sock
        sock.close()


def listen(config: Dict[str, Any]) -> Optional[socket.socket]:
    """The listener for the next node (``downstream``), its port said on stdout."""
    if not config["downstream"]:
        emit({"port": None})
        return None
    bind = config.get("bind") or ""
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind((bind, 0))
    listener.listen(4)
    emit({"port": listener.getsockname()[1]})
    return listener


def upstream(token: bytes, stdin: Link) -> Link:
    """The receiver's upstream, as the controller's second line on ``stdin`` names it."""
    where = json.loads(stdin.line())["upstream"]
    if where is None:
        return stdin  # the controller is the upstream: the stream follows on stdin
    host, port = where
    sock = socket.create_connection((host, int(port)), timeout=CONNECT_SECONDS)
    sock.settimeout(STALL_SECONDS)
    sock.sendall(token + b"\n")
    return Link(sock)


def watch_controller(cleanup: Callable[[], None]) -> None:
    """Ends this program when the controller closes its stdin (it gave up, or is gone): a
    relay never outlives what started it. ``cleanup`` removes what was being received; it
    stays behind under its hidden name only if the process is killed outright."""
    import threading

    def wait() -> None:
        while os.read(0, 4096):
            pass
        cleanup()
        os._exit(1)

    threading.Thread(target=wait, daemon=True).start()


def send(downstream: socket.socket, files: List[Tuple[str, int, float]], full: Callable[[str], str],
         pace: Optional[Callable[[int], float]] = None,
         trailer: Optional[Callable[[List[str], Optional[str]], Dict[str, Any]]] = None) -> int:
    """The source's side: the header and every file's bytes (``full(path)``: where it is
    here); ``pace(size)``: the seconds to wait before a block of ``size`` bytes goes (a
    replication's cap: then blocks of ``PACED_CHUNK``, so that no long burst goes at once).
    With ``trailer`` the files are hashed as they are read, and one more line follows them:
    ``trailer(their SHA-256s, the first file that changed while it was read or None)``."""
    header = {"files": [[path, size, mtime] for path, size, mtime in files]}
    sent = 0
    chunk = PACED_CHUNK if pace is not None else CHUNK
    digests: List[str] = []
    changed: Optional[str] = None
    try:
        downstream.sendall((json.dumps(header) + "\n").encode("utf-8"))
        for path, _, _ in files:
            digest = hashlib.sha256()
            with open(full(path), "rb") as file:
                before = os.fstat(file.fileno())
                while True:
                    block = file.read(chunk)
                    if not block:
                        break
                    wait = pace(len(block)) if pace is not None else 0.0
                    if wait > 0:
                        time.sleep(wait)
                    if trailer is not None:
                        digest.update(block)
                    downstream.sendall(block)
                    sent += len(block)
                after = os.fstat(file.fileno())
            if changed is None and (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
                changed = path
            digests.append(digest.hexdigest())
        if trailer is not None:
            downstream.sendall((json.dumps(trailer(digests, changed)) + "\n").encode("utf-8"))
        finish(downstream)
    finally:
        downstream.close()
    return sent


def finish(downstream: socket.socket) -> None:
    """Waits until the next node has read everything (it closes then)."""
    downstream.shutdown(socket.SHUT_WR)
    downstream.recv(1)


def pass_on(link: Link, downstream: Optional[socket.socket], header_line: bytes,
            files: Iterable[Tuple[str, int, float, IO[bytes]]], progress: bool,
            trailer: bool = False) -> Tuple[List[Tuple[str, int, str]], int, Optional[Dict[str, Any]]]:
    """A receiver's side: each of ``files`` (path, size, mtime, where to write it) read from
    ``link``, written, hashed and passed on downstream as it comes; (path, size, SHA-256)
    per file, the bytes received, and with ``trailer`` the source's line after the files
    (``send``'s), passed on too."""
    if downstream is not None:
        downstream.sendall(header_line + b"\n")
    received = 0
    said, told = time.monotonic(), -1
    hashes = []
    for path, size, _, output in files:
        digest = hashlib.sha256()
        left = int(size)
        while left:
            block = link.block(left)
            left -= len(block)
            received += len(block)
            if downstream is not None:
                downstream.sendall(block)
            digest.update(block)
            output.write(block)
            if progress and time.monotonic() - said >= PROGRESS_SECONDS:
                said, told = time.monotonic(), received
                emit({"progress": received})
        output.flush()
        os.fsync(output.fileno())
        hashes.append((path, int(size), digest.hexdigest()))
    if progress and told != received:  # a copy shorter than PROGRESS_SECONDS, and a bar's last stretch, reach the total
        emit({"progress": received})
    end: Optional[Dict[str, Any]] = None
    if trailer:
        line = link.line(limit=1 << 16)
        if downstream is not None:
            downstream.sendall(line + b"\n")
        end = json.loads(line)
    if downstream is not None:
        finish(downstream)
    return hashes, received, end


def write_file(path: str) -> IO[bytes]:
    """A new private file (0600), never through a link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(path, flags, 0o600), "wb")
