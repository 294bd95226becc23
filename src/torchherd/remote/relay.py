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
- a receiver then gets ``{"upstream": [HOST, PORT]}`` and connects there, or
  ``{"upstream": null}``: the controller sends the stream itself on stdin, right after
  that line;
- the token never travels between nodes: each end proves it knows it (``handshake``). The
  listener sends ``torchherd-relay 1 NONCE_L``; the receiver answers ``NONCE_C
  HMAC(token, "receiver" NONCE_L NONCE_C)``; the listener, once that is right, answers
  ``HMAC(token, "sender" NONCE_L NONCE_C)``, which the receiver checks. A stranger (or a
  receiver that is wrong) is closed; the listener judges every pending connection at once,
  each within ``HANDSHAKE_SECONDS`` in all, so a stranger that sends a byte now and then
  holds no one up. Both then sign the stream's lines with ``HMAC(token, "stream" NONCE_L
  NONCE_C)`` (that connection's own key: a line recorded on another is worth nothing);
- the listener then sends the stream: a header line ``{"files": [[PATH, SIZE, MTIME],
  ...]}`` and the files' bytes, one after another; with ``"trailer": true`` (a copy whose
  hash the controller does not know: replication's, which would otherwise read the whole
  checkpoint once more, at full speed, before its paced copy) the source hashes as it sends
  and one line follows the bytes, ``{"sha256": HEX}`` or ``{"error": TEXT}``, passed on
  down the chain: each receiver checks its copy against it. Between nodes both lines end in
  a tab and their MAC (``Peer.send_signed``): the hash, the sizes and mtimes are the source's
  own, never an on-path attacker's. The bytes are not encrypted (as torch's own traffic
  between the nodes is not); a receiver checks them against the controller's hash, or the
  signed trailer's;
- with ``"progress": true`` a receiver prints ``{"progress": BYTES}`` about twice a second
  while it receives, and once more when every byte is in (before its check); its last line is ``{"ok": true, ...}`` or ``{"error": TEXT}``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import selectors
import socket
import stat
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO, Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

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
HANDSHAKE_SECONDS = 5.0
"""The most one connection may take to prove it knows the token, in all (not per read)."""
PENDING = 32
"""Connections judged at once by a listener at most (the oldest is dropped for a newer one)."""
GREETING = b"torchherd-relay 1 "
NONCE_BYTES = 16
LINE_LIMIT = 1 << 24
"""The longest signed line (a header listing many files) a receiver reads."""


def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``parts`` (each length-prefixed: no two splits give one MAC), in hex."""
    message = b"".join(b"%d:%s" % (len(part), part) for part in parts)
    return hmac.new(key, message, hashlib.sha256).hexdigest().encode("ascii")


def stream_key(token: bytes, nonces: bytes) -> bytes:
    return hmac.new(token, b"stream" + nonces, hashlib.sha256).digest()


def emit(message: Dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


class Link:
    """Bytes from upstream (a socket, or the controller on stdin: ``Link(None)``, read
    unbuffered, so that no line read ahead of a stream that follows it), a line or a block
    at a time. ``key``: the connection's stream key (``handshake``): its header and trailer
    lines must carry their MAC. A socket without one is refused those lines."""

    def __init__(self, sock: Optional[socket.socket], key: Optional[bytes] = None) -> None:
        self.sock = sock
        self.key = key
        self.buffer = b""

    def _recv(self, most: int) -> bytes:
        return self.sock.recv(most) if self.sock is not None else os.read(0, most)

    def line(self, limit: int = 1 << 24, deadline: Optional[float] = None) -> bytes:
        """The next line; with ``deadline`` (a socket's), given up then, however the bytes come."""
        while b"\n" not in self.buffer:
            if deadline is not None and self.sock is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the other node took too long to answer")
                self.sock.settimeout(left)
            data = self._recv(CHUNK)
            if not data:
                raise EOFError("the upstream closed the connection")
            self.buffer += data
            if b"\n" not in self.buffer and len(self.buffer) > limit:
                raise ValueError("a line too long from the upstream")
        line, _, self.buffer = self.buffer.partition(b"\n")
        if len(line) > limit:  # what follows it came in the same read (the stream after a handshake)
            raise ValueError("a line too long from the upstream")
        return line

    def signed_line(self, label: bytes, limit: int = LINE_LIMIT) -> bytes:
        """The next line (the stream's header or trailer), its MAC checked and taken off
        when it comes from another node; the controller's (stdin, over SSH) has none."""
        line = self.line(limit)
        if self.sock is None:
            return line
        text, tab, said = line.rpartition(b"\t")
        if self.key is None or not tab or not hmac.compare_digest(said, mac(self.key, label, text)):
            raise ValueError(f"the upstream's {label.decode()} is not signed with the chain's token: refused "
                             "(another machine on the network?)")
        return text

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


class Peer:
    """The next node, once it proved it knows the token: its socket and the stream key."""

    def __init__(self, sock: socket.socket, key: bytes) -> None:
        self.sock = sock
        self.key = key

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_signed(self, label: bytes, text: bytes) -> None:
        """One line of the stream (``text``: JSON, no tab or newline in it) with its MAC."""
        self.sock.sendall(text + b"\t" + mac(self.key, label, text) + b"\n")

    def close(self) -> None:
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


class Pending:
    """A connection a listener has not judged yet: what it sent so far, and its deadline."""

    def __init__(self, sock: socket.socket, nonce: bytes) -> None:
        self.sock = sock
        self.nonce = nonce
        self.buffer = b""
        self.deadline = time.monotonic() + HANDSHAKE_SECONDS


def accept(listener: socket.socket, token: bytes) -> Peer:
    """The one connection that proves it knows the token (module doc); others are closed.
    Every pending connection is judged at once, each within ``HANDSHAKE_SECONDS`` in all."""
    deadline = time.monotonic() + CONNECT_SECONDS
    selector = selectors.DefaultSelector()
    pending: Dict[socket.socket, Pending] = {}

    def drop(sock: socket.socket) -> None:
        selector.unregister(sock)
        pending.pop(sock, None)
        sock.close()

    listener.setblocking(False)
    selector.register(listener, selectors.EVENT_READ, None)
    try:
        while True:
            now = time.monotonic()
            for sock in [sock for sock, state in pending.items() if state.deadline <= now]:
                drop(sock)
            if now >= deadline:
                raise TimeoutError("the next node never connected")
            wait = min([deadline] + [state.deadline for state in pending.values()]) - now
            for ready, _ in selector.select(max(wait, 0.01)):
                state = ready.data
                if state is None:
                    _greet(listener, selector, pending, drop)
                    continue
                if state.sock not in pending:
                    continue  # dropped in this round for a newer one
                found = _judge(state, token)
                if found is None:
                    continue
                selector.unregister(state.sock)
                del pending[state.sock]
                if isinstance(found, Peer):
                    return found
                state.sock.close()
    finally:
        for sock in list(pending):
            drop(sock)
        selector.close()
        listener.setblocking(True)


def _greet(listener: socket.socket, selector: selectors.BaseSelector, pending: Dict[socket.socket, Pending],
           drop: Callable[[socket.socket], None]) -> None:
    """A new connection: sent the listener's nonce, and judged from now on."""
    try:
        sock, _ = listener.accept()
    except (BlockingIOError, InterruptedError):
        return
    if len(pending) >= PENDING:
        drop(min(pending, key=lambda other: pending[other].deadline))
    nonce = os.urandom(NONCE_BYTES).hex().encode("ascii")
    try:
        sock.setblocking(True)
        sock.settimeout(1.0)
        sock.sendall(GREETING + nonce + b"\n")  # a few bytes into a new connection's empty buffer
        sock.setblocking(False)
    except OSError:
        sock.close()
        return
    pending[sock] = Pending(sock, nonce)
    selector.register(sock, selectors.EVENT_READ, pending[sock])


def _judge(state: Pending, token: bytes) -> Union[Peer, bool, None]:
    """What a pending connection sent: None (more to come), False (a stranger), or the Peer
    that answered the nonce right (then told the listener's own proof)."""
    try:
        data = state.sock.recv(256)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return False
    state.buffer += data
    if not data or len(state.buffer) > 256:
        return False
    if b"\n" not in state.buffer:
        return None
    answer = state.buffer.partition(b"\n")[0]
    theirs, _, proof = answer.partition(b" ")
    if len(theirs) != 2 * NONCE_BYTES or not hmac.compare_digest(proof, mac(token, b"receiver", state.nonce, theirs)):
        return False
    try:
        state.sock.setblocking(True)
        state.sock.settimeout(STALL_SECONDS)
        state.sock.sendall(mac(token, b"sender", state.nonce, theirs) + b"\n")
    except OSError:
        return False
    return Peer(state.sock, stream_key(token, state.nonce + theirs))


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
    return connect(str(host), int(port), token)


def connect(host: str, port: int, token: bytes) -> Link:
    """The connection to the upstream node, once both proved they know the token (module doc)."""
    sock = socket.create_connection((host, port), timeout=CONNECT_SECONDS)
    try:
        link = Link(sock)
        deadline = time.monotonic() + HANDSHAKE_SECONDS
        greeting = link.line(limit=256, deadline=deadline)
        theirs = greeting[len(GREETING):]
        if not greeting.startswith(GREETING) or len(theirs) != 2 * NONCE_BYTES:
            raise ValueError(f"{host}:{port} is no torchherd relay (it greeted with {greeting[:40]!r})")
        nonce = os.urandom(NONCE_BYTES).hex().encode("ascii")
        sock.sendall(nonce + b" " + mac(token, b"receiver", theirs, nonce) + b"\n")
        proof = link.line(limit=256, deadline=deadline)
        if not hmac.compare_digest(proof, mac(token, b"sender", theirs, nonce)):
            raise ValueError(f"{host}:{port} does not know the chain's token: refused (another machine on the "
                             "network?)")
    except BaseException:
        sock.close()
        raise
    sock.settimeout(STALL_SECONDS)
    link.key = stream_key(token, theirs + nonce)
    return link


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


def send(downstream: Peer, files: List[Tuple[str, int, float]], full: Callable[[str], str],
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
        downstream.send_signed(b"header", json.dumps(header).encode("utf-8"))
        for path, _, _ in files:
            digest = hashlib.sha256()
            with open_own(full(path)) as file:
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
            downstream.send_signed(b"trailer", json.dumps(trailer(digests, changed)).encode("utf-8"))
        finish(downstream)
    finally:
        downstream.close()
    return sent


def open_own(path: str) -> IO[bytes]:
    """``path`` opened for reading, never through a link, and only when it is a file of
    this user's: what is sent is what the opened descriptor reads (a file swapped for
    another user's, or for a link, since it was listed is refused: ValueError)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0))
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)
        raise ValueError(f"{path} is no longer a file of yours: not sent")
    return os.fdopen(fd, "rb")


def finish(downstream: Peer) -> None:
    """Waits until the next node has read everything (it closes then)."""
    downstream.sock.shutdown(socket.SHUT_WR)
    downstream.sock.recv(1)


def pass_on(link: Link, downstream: Optional[Peer], header_line: bytes,
            files: Iterable[Tuple[str, int, float, IO[bytes]]], progress: bool,
            trailer: bool = False) -> Tuple[List[Tuple[str, int, str]], int, Optional[Dict[str, Any]]]:
    """A receiver's side: each of ``files`` (path, size, mtime, where to write it) read from
    ``link``, written, hashed and passed on downstream as it comes; (path, size, SHA-256)
    per file, the bytes received, and with ``trailer`` the source's line after the files
    (``send``'s), passed on too."""
    if downstream is not None:
        downstream.send_signed(b"header", header_line)
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
        line = link.signed_line(b"trailer", limit=1 << 16)
        if downstream is not None:
            downstream.send_signed(b"trailer", line)
        end = json.loads(line)
    if downstream is not None:
        finish(downstream)
    return hashes, received, end


def write_file(path: str) -> IO[bytes]:
    """A new private file (0600), never through a link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(path, flags, 0o600), "wb")
