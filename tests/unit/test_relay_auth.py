"""The node-to-node relay (``remote/relay.py``) authenticates both ends without sending its
token, signs the stream's header and trailer with that connection's key, and a receiver
refuses a stream that is not the copy it expects: a forged one on a socket pair (an
on-path attacker's: unsigned, signed with another key, a total that is not the copy's, a
date in the future), a listener that does not know the token, and strangers that dribble
bytes at a listener while the real next node waits."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from torchherd.remote import checkpoint
from torchherd.remote import relay as chain

TOKEN = b"0123456789abcdef0123456789abcdef"
WALL = 1_700_000_000.0
BODY = b"a pickle that runs code at torch.load"
EXPECT = {"path": "snapshot.pt", "kind": "file", "size": len(BODY), "sha256": None}


def listening() -> socket.socket:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    return listener


def in_thread(work: Any) -> tuple[threading.Thread, list[Any]]:
    """``work()`` in a thread: its result (or exception) in the list once it ends."""
    found: list[Any] = []

    def run() -> None:
        try:
            found.append(work())
        except Exception as error:  # handed to the test, which asserts on it
            found.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, found


def receive(upstream: chain.Link, workdir: Path, expect: dict[str, Any] = EXPECT) -> dict[str, Any] | Exception:
    """The receiver's side (``checkpoint.receive``, a replication's: no hash beforehand, the
    trailer's) of what ``upstream`` sends; its answer, or what it raised."""
    try:
        return checkpoint.receive(str(workdir), "snapshot.pt", expect, upstream, None, TOKEN, time.monotonic(),
                                  keep_newer=True)
    except (ValueError, EOFError, OSError) as error:
        return error


def stream(body: bytes = BODY, size: int | None = None, mtime: float = WALL, sha256: str | None = None) -> \
        tuple[bytes, bytes, bytes]:
    import hashlib

    header = json.dumps({"files": [["", len(body) if size is None else size, mtime]]}).encode()
    trailer = json.dumps({"sha256": sha256 or hashlib.sha256(body).hexdigest()}).encode()
    return header, body, trailer


def signed(key: bytes, label: bytes, text: bytes) -> bytes:
    return text + b"\t" + chain.mac(key, label, text) + b"\n"


KEY = chain.stream_key(TOKEN, b"L" * 32 + b"C" * 32)


def test_a_forged_stream_on_a_socket_without_a_handshake_is_refused(tmp_path: Path) -> None:
    """The review's repro: header, body and trailer written on a socket pair by whoever
    reaches the receiver, a 2100 date, no token. Nothing is put in place."""
    ours, theirs = socket.socketpair()
    header, body, trailer = stream(mtime=4_102_444_800.0)  # 2100-01-01
    theirs.sendall(header + b"\n" + body + trailer + b"\n")
    theirs.close()
    answer = receive(chain.Link(ours), tmp_path)
    assert isinstance(answer, ValueError), answer
    assert str(answer) == ("the upstream's header is not signed with the chain's token: refused (another machine "
                           "on the network?)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("forge, message", [
    pytest.param(lambda h, b, t: signed(b"another key", b"header", h) + b + signed(KEY, b"trailer", t),
                 "the upstream's header is not signed with the chain's token", id="header-another-key"),
    pytest.param(lambda h, b, t: signed(KEY, b"trailer", h) + b + signed(KEY, b"trailer", t),
                 "the upstream's header is not signed with the chain's token", id="trailer-mac-on-the-header"),
    pytest.param(lambda h, b, t: signed(KEY, b"header", h) + b + signed(b"another key", b"trailer", t),
                 "the upstream's trailer is not signed with the chain's token", id="trailer-another-key"),
    pytest.param(lambda h, b, t: signed(KEY, b"header", h) + b + h + b"\n",
                 "the upstream's trailer is not signed with the chain's token", id="trailer-unsigned"),
])
def test_a_line_not_signed_with_the_connections_key_is_refused(tmp_path: Path, forge: Any, message: str) -> None:
    ours, theirs = socket.socketpair()
    theirs.sendall(forge(*stream()))
    theirs.close()
    answer = receive(chain.Link(ours, KEY), tmp_path)
    assert isinstance(answer, ValueError) and str(answer).startswith(message), answer
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("header, message", [
    pytest.param(stream(size=6)[0], f"the upstream sends 6 bytes, the copy is {len(BODY)}",
                 id="total-short-of-the-copy"),
    pytest.param(stream(size=123)[0], f"the upstream sends 123 bytes, the copy is {len(BODY)}",
                 id="total-past-the-copy"),
    pytest.param(stream(mtime=4_102_444_800.0)[0], "the upstream dates the copy 2100-01-01, in the future: refused",
                 id="dated-2100"),
    pytest.param(b'{"files": [["", -1, 0]]}', "the upstream's header is malformed: a size or an mtime that is not one",
                 id="negative-size"),
    pytest.param(b'{"files": [["", 36, NaN]]}',
                 "the upstream's header is malformed: a size or an mtime that is not one", id="mtime-nan"),
    pytest.param(b'{"files": "all"}', "the upstream's header is malformed", id="files-not-a-list"),
])
def test_a_signed_header_that_is_not_the_copy_is_refused(tmp_path: Path, header: bytes, message: str) -> None:
    """Signed by a node that knows the token (one of the chain, gone wrong): still held to
    the controller's size, and to this node's clock."""
    ours, theirs = socket.socketpair()
    _, body, trailer = stream()
    theirs.sendall(signed(KEY, b"header", header) + body + signed(KEY, b"trailer", trailer))
    theirs.close()
    answer = receive(chain.Link(ours, KEY), tmp_path)
    assert isinstance(answer, ValueError) and str(answer) == message, answer
    assert list(tmp_path.iterdir()) == []


def test_a_signed_stream_of_the_copy_is_put_in_place(tmp_path: Path) -> None:
    ours, theirs = socket.socketpair()
    header, body, trailer = stream()
    theirs.sendall(signed(KEY, b"header", header) + body + signed(KEY, b"trailer", trailer))
    theirs.close()
    answer = receive(chain.Link(ours, KEY), tmp_path)
    assert isinstance(answer, dict) and answer["ok"] is True, answer
    assert (tmp_path / "snapshot.pt").read_bytes() == BODY
    assert (tmp_path / "snapshot.pt").stat().st_mtime == WALL


class Recorder:
    """A TCP hop between the receiver and the listener that keeps every byte, both ways."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.front = listening()
        self.seen = bytearray()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        client, _ = self.front.accept()
        server = socket.create_connection(("127.0.0.1", self.port))
        for one, other in ((client, server), (server, client)):
            threading.Thread(target=self._pump, args=(one, other), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        while block := source.recv(65536):
            self.seen += block
            sink.sendall(block)
        sink.shutdown(socket.SHUT_WR)


def test_the_token_never_travels_and_both_ends_prove_they_know_it(tmp_path: Path) -> None:
    with listening() as listener:
        recorder = Recorder(listener.getsockname()[1])
        thread, accepted = in_thread(lambda: chain.accept(listener, TOKEN))
        link = chain.connect("127.0.0.1", recorder.front.getsockname()[1], TOKEN)
        thread.join(10)
        [peer] = accepted
        assert isinstance(peer, chain.Peer) and link.key == peer.key and link.key is not None
        header, body, trailer = stream()
        peer.send_signed(b"header", header)
        assert link.signed_line(b"header") == header
        peer.close()
        link.close()
    time.sleep(0.2)
    assert recorder.seen.startswith(b"torchherd-relay 1 ")
    assert TOKEN not in recorder.seen and TOKEN.hex().encode() not in recorder.seen
    recorder.front.close()


def test_a_listener_that_does_not_know_the_token_is_refused() -> None:
    with listening() as listener:
        port = listener.getsockname()[1]

        def impostor() -> bytes:
            sock, _ = listener.accept()
            with sock:
                sock.sendall(b"torchherd-relay 1 " + b"1" * 32 + b"\n")
                answer = sock.recv(200)
                sock.sendall(b"0" * 64 + b"\n")  # a proof it cannot make
                time.sleep(0.2)
                return answer

        thread, heard = in_thread(impostor)
        with pytest.raises(ValueError) as refused:
            chain.connect("127.0.0.1", listener.getsockname()[1], TOKEN)
        thread.join(10)
    assert str(refused.value) == f"127.0.0.1:{port} does not know the chain's token: refused (another machine on " \
                                 "the network?)"
    assert TOKEN not in heard[0]


def closed_after(stranger: socket.socket) -> bytes:
    """What ``stranger`` was told before the listener closed it: one line. The listener closes a
    stranger whose dribbled bytes it has not read, and the kernel then sends a reset, not an
    end of file: both are the close (a loaded CI run saw the reset)."""
    heard = b""
    try:
        while block := stranger.recv(100):
            heard += block
    except ConnectionResetError:
        pass
    assert heard.count(b"\n") == 1, heard
    return heard


def test_strangers_dribbling_bytes_hold_up_no_one(tmp_path: Path) -> None:
    """Several strangers, each sending a byte every half second and never a line: the real
    next node, which connects after them, is accepted at once; each stranger is closed
    within HANDSHAKE_SECONDS."""
    with listening() as listener:
        port = listener.getsockname()[1]
        stop = threading.Event()
        strangers = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]

        def dribble() -> None:
            while not stop.is_set():
                for stranger in strangers:
                    try:
                        stranger.send(b"x")
                    except OSError:
                        pass
                stop.wait(0.5)

        threading.Thread(target=dribble, daemon=True).start()
        started = time.monotonic()
        thread, accepted = in_thread(lambda: chain.accept(listener, TOKEN))
        time.sleep(1.0)
        link = chain.connect("127.0.0.1", port, TOKEN)
        thread.join(10)
        took = time.monotonic() - started
        stop.set()
        [peer] = accepted
        assert isinstance(peer, chain.Peer) and took < 3.0, (took, peer)
        peer.close()
        link.close()
        for stranger in strangers:
            stranger.settimeout(5)
            assert closed_after(stranger).startswith(b"torchherd-relay 1 ")  # greeted, then closed
            stranger.close()


def test_a_stranger_that_never_answers_is_closed_within_the_handshake_deadline(monkeypatch: pytest.MonkeyPatch) \
        -> None:
    monkeypatch.setattr(chain, "HANDSHAKE_SECONDS", 0.5)
    monkeypatch.setattr(chain, "CONNECT_SECONDS", 1.5)
    with listening() as listener:
        stranger = socket.create_connection(listener.getsockname())
        thread, accepted = in_thread(lambda: chain.accept(listener, TOKEN))
        stranger.settimeout(5)
        started = time.monotonic()
        heard = b""
        while block := stranger.recv(100):
            heard += block
        assert time.monotonic() - started < 1.2 and heard.count(b"\n") == 1
        thread.join(5)
        assert isinstance(accepted[0], TimeoutError) and str(accepted[0]) == "the next node never connected"
        stranger.close()



# what a source sends: its own checkpoint, never another user's file or a link -------------------


def test_find_passes_over_a_link_and_another_users_match(tmp_path: Path) -> None:
    """In a checkpoint directory others can write, their link (to a file of theirs, or of
    yours they want copied everywhere) or their file, dated newest, is not "the newest"."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "step-10.pt").write_bytes(b"mine")
    os.utime(ckpt / "step-10.pt", (WALL, WALL))
    (tmp_path / "secret").write_bytes(b"not a checkpoint")
    (ckpt / "step-99.pt").symlink_to(tmp_path / "secret")
    os.utime(tmp_path / "secret", (WALL + 100, WALL + 100))
    if os.geteuid() == 0:
        (ckpt / "step-98.pt").write_bytes(b"theirs")
        os.chown(ckpt / "step-98.pt", 65534, 65534)
        os.utime(ckpt / "step-98.pt", (WALL + 50, WALL + 50))
    found = checkpoint.find(str(tmp_path), "ckpt/step-*.pt")
    assert (found["path"], found["size"], found["mtime"]) == ("ckpt/step-10.pt", 4, WALL), found


@pytest.mark.timeout(30)
def test_a_file_swapped_for_a_link_after_it_was_listed_is_not_sent(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"weights")
    files = checkpoint.listing(str(tmp_path))
    (tmp_path / "model.bin").unlink()
    (tmp_path / "secret").write_bytes(b"private!")
    (tmp_path / "model.bin").symlink_to(tmp_path / "secret")
    ours, theirs = socket.socketpair()
    with pytest.raises(OSError):  # O_NOFOLLOW: ELOOP
        chain.send(chain.Peer(ours, KEY), files, lambda path: str(tmp_path / path))
    theirs.settimeout(5)
    heard = b""
    while block := theirs.recv(1 << 16):
        heard += block
    assert b"private!" not in heard
    theirs.close()
