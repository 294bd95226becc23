"""``--sync``: the local project made identical on every node, before the launch, over
the sessions the run already has (no rsync, nothing installed on a node).

Per node, one command runs the receiver (``remote/receive.py``) and talks to it over its
stdin and stdout. The controller sends the project's listing (names, sizes, mtimes:
``tree.walk``); each node answers what it has (its manifest of content hashes); the
controller hashes the few small files a node has without the manifest vouching for
them, then streams what each node lacks. Every file needed anywhere is read once, by
one producer, and its chunks go to the queue of every node that needs it (a sender
thread per node, bounded queues: a slow node slows the producer, memory stays small).
The nodes verify every file written by its SHA-256 and report; the observer is told
``SyncStarted``, then per node ``NodeSynced`` or ``SyncFailed``, then ``SyncDone``.
"""

from __future__ import annotations

import hashlib
import json
import marshal
import queue
import shlex
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, Union, cast

from torchherd import tree
from torchherd.checks.gather import LineBuffer
from torchherd.engine.events import NodeSynced, Observer, SyncDone, SyncFailed, SyncStarted
from torchherd.errors import TransportError
from torchherd.plan import NodePlan, Plan
from torchherd.remote import command
from torchherd.remote.receive import CHUNK, DIGEST, HEADER, MARSHAL_VERSION
from torchherd.shell import quote_path
from torchherd.transport import Connector, Process, Session, connect_all, fan_out

BATCH = 256 * 1024
"""Bytes handed to a node's sender at once: few sends, and small files travel together."""
QUEUE_DEPTH = 8
ANSWER_SECONDS = 60.0
"""On top of ssh_timeout: the receiver's start, and its hashing of small files to compare."""
REFUSAL_SECONDS = 5.0
"""A receiver whose stdin closed: how long its last reply may take to arrive (it has ended)."""
RESULT_SECONDS = 120.0
"""After the last byte: the node's verification of what it received (plus 1 s per 20 MB)."""
NO_DIGEST = bytes(DIGEST)
"""Sent for a symbolic link (checked by its target) and for a file that could not be read here."""

Batch = Union[list[bytes], None]


def frame(message: Mapping[str, Any]) -> bytes:
    """A message to a receiver: its length, then marshal (the receiver imports no json)."""
    data = marshal.dumps(dict(message), MARSHAL_VERSION)
    return HEADER.pack(len(data)) + data


def receiver_command(node: NodePlan, dest: str, within: str) -> str:
    """The receiver with the node's configured python (a uv project's venv does not exist
    yet); a ``~`` in the destination is the node's home, expanded there (by the receiver,
    not the shell)."""
    return (f"{quote_path(node.base_python)} {command('receive.py')} "
            f"{shlex.quote(dest)} {shlex.quote(within)}")


class Lines:
    """Whole lines out of a process's stdout (the sync's receivers, the checkpoint relays),
    held in the checks' ``LineBuffer``: a line past its cap (8 MiB) without a newline is
    no line, and the node is given up (not held in memory until the timeout)."""

    def __init__(self, process: Process) -> None:
        self.process = process
        self.lines = LineBuffer()

    def line(self, timeout: float, stopping: Callable[[], bool] | None = None,
             poll: float = 0.5) -> bytes | None:
        """The next line; None at EOF, past ``timeout``, once ``stopping()`` (asked every
        ``poll`` seconds: only a reader that may be stopped reads in short slices), or
        once a line passes the cap."""
        deadline = time.monotonic() + timeout
        while (found := self.lines.take()) is None:
            left = deadline - time.monotonic()
            if self.lines.broken or left <= 0 or (stopping is not None and stopping()):
                return None
            # One long read, not short polls: over SSH the channel keeps the last read's
            # timeout, and the sends that follow (the files) time out by it too; a node's
            # receiver stalled a second on a busy machine must not read as gone.
            data = self.process.read(left if stopping is None else min(left, poll))
            if data is None:
                continue
            if not data:
                return None
            self.lines.add(data)
        return found


@dataclass
class _Node:
    """One node's side of the sync: its receiver, its answer, its queue and sender."""

    plan: NodePlan
    session: Session | None
    process: Process | None = None
    lines: Lines | None = None
    answer: tree.NodeHas | None = None
    transfer: tree.Transfer | None = None
    error: str | None = None
    result: Mapping[str, Any] | None = None
    started: float = field(default_factory=time.monotonic)
    queue: queue.Queue[Batch] = field(default_factory=lambda: queue.Queue(QUEUE_DEPTH))
    pending: list[bytes] = field(default_factory=list)
    pending_bytes: int = 0
    expected_bytes: int = 0

    @property
    def name(self) -> str:
        return self.plan.host.name

    def open(self) -> None:
        """Starts the receiver (it waits for the listing)."""
        if self.session is None:
            return
        try:
            self.process = self.session.start(receiver_command(self.plan, self.plan.workdir,
                                                               self.plan.sync_within or self.plan.workdir))
        except TransportError as error:
            self.error = str(error)
            return
        self.lines = Lines(self.process)

    def ask(self, want: bytes, timeout: float) -> None:
        """Sends the listing and reads what the node has."""
        if self.process is None or self.lines is None or self.error is not None:
            return
        try:
            if not self.process.send(want):
                self.error = self._refused() or self._gone("was gone before the listing was sent")
                return
            line = self.lines.line(timeout)
        except TransportError as error:
            self.error = str(error)
            return
        if line is None:
            self.error = self._gone("gave no answer")
            return
        answer = json.loads(line)
        if "error" in answer:
            self.error = str(answer["error"])
            return
        self.answer = tree.NodeHas(answer["dest"], tuple(answer["need"]), dict(answer["have"]), int(answer["same"]),
                                   tuple(answer["delete"]))

    def _refused(self) -> str | None:
        """The error the receiver replied before it ended, if it did: a receiver that refuses
        (a workdir it may not sync into) says why and exits without reading on, so the
        controller's next send can fail before it has read that reply."""
        assert self.lines is not None
        try:
            line = self.lines.line(REFUSAL_SECONDS)
            answer = json.loads(line) if line is not None else None
        except (TransportError, ValueError):
            return None
        return str(answer["error"]) if isinstance(answer, dict) and "error" in answer else None

    def _gone(self, what: str) -> str:
        stderr = self.process.read_stderr().decode("utf-8", "replace").strip() if self.process else ""
        return f"the receiver {what}" + (f": {stderr.splitlines()[-1]}" if stderr else "")

    def put(self, data: bytes) -> None:
        if self.error is not None:
            return
        self.pending.append(data)
        self.pending_bytes += len(data)
        if self.pending_bytes >= BATCH:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.queue.put(self.pending)
            self.pending, self.pending_bytes = [], 0

    def send_all(self) -> None:
        """The sender thread: every batch to the node, then the node's verdict."""
        assert self.process is not None and self.lines is not None
        while True:
            batch = self.queue.get()
            if batch is None:
                break
            # A memoryview (both transports write any buffer): paramiko's sendall slices what
            # is left after each 32 kB packet, and slicing bytes copies the rest every time.
            data = cast(bytes, memoryview(b"".join(batch)))
            if self.error is None and not self.process.send(data):
                self.error = self._refused() or self._gone("went away while files were sent")
        if self.error is not None:
            return
        line = self.lines.line(RESULT_SECONDS + self.expected_bytes / 20e6)
        if line is None:
            self.error = self._gone("gave no verdict")
            return
        self.result = json.loads(line)
        if "error" in self.result:
            self.error = str(self.result["error"])

    def close(self) -> None:
        if self.process is not None:
            self.process.close()


def sync_over(plan: Plan, connector: Connector, observer: Observer, dry_run: bool = False,
              log_dir: Path | None = None) -> SyncDone:
    """Connects to every node, syncs (or, with ``dry_run``, compares), and closes; a node
    that cannot be reached is a ``SyncFailed`` saying why."""
    results = connect_all(connector, [node.host for node in plan.nodes])
    unreachable = {name: str(error) for name, error in results.failed.items()}
    try:
        return sync_nodes(plan, results.succeeded, observer, dry_run, unreachable, log_dir)
    finally:
        results.close()


def sync_nodes(plan: Plan, sessions: Mapping[str, Session], observer: Observer, dry_run: bool = False,
               unreachable: Mapping[str, str] | None = None, log_dir: Path | None = None) -> SyncDone:
    """Makes ``plan.sync.source`` identical under every node's workdir (or, with
    ``dry_run``, only says what would travel). Never raises for one node's failure:
    the ``SyncDone`` says which nodes are in sync (a node without a session fails
    with its ``unreachable`` reason). ``log_dir``, the run's, is never sent (nor is a
    directory named ``torchherd-logs``)."""
    spec = plan.sync
    assert spec is not None
    started = time.monotonic()
    nodes = [_Node(node, sessions.get(node.host.name)) for node in plan.nodes]
    for node in nodes:
        if node.session is None:
            node.error = (unreachable or {}).get(node.name, "no SSH session")
    # The receivers start (a shell and a Python on every node) while the project is walked here.
    opening = threading.Thread(target=fan_out, args=(nodes, _Node.open), name="torchherd-sync-open", daemon=True)
    opening.start()
    try:
        try:
            listing = tree.walk(Path(spec.source), spec.exclude, spec.include,
                                leave_out=(log_dir,) if log_dir is not None else ())
        finally:
            opening.join()
        entries = listing.by_path()
        observer(SyncStarted(str(listing.root), tuple(node.host.name for node in plan.nodes), len(listing.entries),
                             listing.total_bytes, listing.skipped, dry_run, listing.private))
        want = frame({"want": [entry.want() for entry in listing.entries]})
        fan_out(nodes, lambda node: node.ask(want, plan.inventory.cluster.ssh_timeout + ANSWER_SECONDS))
        answered = [node for node in nodes if node.error is None and node.answer is not None]
        cached = _hash_small(listing.root, entries, tree.candidates(node.answer for node in answered
                                                                   if node.answer is not None))
        digests = {path: digest for path, (digest, _) in cached.items()}
        for node in answered:
            assert node.answer is not None
            node.transfer = tree.decide(node.answer, digests)
            node.expected_bytes = node.transfer.bytes(entries)
        if not dry_run:
            # A node with nothing to get is in sync already: no second round trip.
            idle = [node for node in answered if node.transfer is not None and node.transfer.empty]
            for node in idle:
                node.result = {"ok": True, "bytes": 0, "deleted": [], "failed": []}
            _stream(listing, entries, [node for node in answered if node not in idle], cached)
    finally:
        for node in nodes:
            node.close()
    results = tuple(_outcome(node, entries, dry_run) for node in nodes)
    for result in results:
        observer(result)
    done = SyncDone(str(listing.root), results, time.monotonic() - started, dry_run, listing.private)
    observer(done)
    return done


def _hash_small(root: Path, entries: Mapping[str, tree.Entry], paths: set[str]) -> dict[str, tuple[str, bytes]]:
    """The content and SHA-256 of small files a node has without the manifest vouching
    for them: read once, and kept to send where they differ."""
    cached: dict[str, tuple[str, bytes]] = {}
    for path in sorted(paths):
        if path not in entries or tree.is_large(entries[path]):
            continue
        try:
            data = (root / path).read_bytes()
        except OSError:
            continue  # sent as unreadable below, where a node needs it
        cached[path] = (hashlib.sha256(data).hexdigest(), data)
    return cached


def _stream(listing: tree.Listing, entries: Mapping[str, tree.Entry], nodes: Sequence[_Node],
            cached: Mapping[str, tuple[str, bytes]]) -> None:
    """Tells every node to go, then reads each file needed anywhere once and queues its
    chunks to every node that needs it; a sender thread per node does the sending."""
    senders = []
    for node in nodes:
        assert node.transfer is not None
        node.put(frame({"go": True, "files": len(node.transfer.send), "equal": list(node.transfer.equal)}))
        thread = threading.Thread(target=node.send_all, name=f"torchherd-sync-{node.name}", daemon=True)
        thread.start()
        senders.append(thread)
    try:
        for entry in listing.entries:
            targets = [node for node in nodes if node.transfer is not None and entry.path in node.transfer.send]
            if targets:
                _send_file(listing.root, entry, targets, cached.get(entry.path))
    finally:
        for node in nodes:
            node.flush()
            node.queue.put(None)
        for thread in senders:
            thread.join()


def _send_file(root: Path, entry: tree.Entry, targets: Sequence[_Node], cached: tuple[str, bytes] | None) -> None:
    """One file's frame to every node that needs it: header, content, SHA-256."""
    _to_all(targets, frame({"path": entry.path, "size": entry.size, "x": entry.executable, "link": entry.link}))
    if entry.link is not None:
        digest = NO_DIGEST  # a link has no content; the node checks its target
    elif cached is not None:
        _to_all(targets, cached[1])
        digest = bytes.fromhex(cached[0])
    else:
        digest = _read_once(root / entry.path, entry.size, targets)
    _to_all(targets, digest)


def _to_all(targets: Sequence[_Node], data: bytes) -> None:
    for node in targets:
        node.put(data)


def _read_once(path: Path, size: int, targets: Sequence[_Node]) -> bytes:
    """Streams ``size`` bytes of the file to every target as it reads them, hashing as
    it goes; a file that shrank or vanished since the walk is padded, and its digest
    made not to match, so the nodes report it."""
    digest = hashlib.sha256()
    left = size
    try:
        with path.open("rb") as file:
            while left:
                block = file.read(min(CHUNK, left))
                if not block:
                    break
                digest.update(block)
                left -= len(block)
                _to_all(targets, block)
    except OSError:
        pass
    if left:
        padding = bytes(min(left, CHUNK))
        while left:
            piece = padding[:min(left, CHUNK)]
            left -= len(piece)
            _to_all(targets, piece)
        return NO_DIGEST
    return digest.digest()


def _outcome(node: _Node, entries: Mapping[str, tree.Entry], dry_run: bool) -> NodeSynced | SyncFailed:
    seconds = time.monotonic() - node.started
    if node.error is not None or node.answer is None or node.transfer is None:
        return SyncFailed(node.name, node.error or "no answer", seconds)
    transfer, answer = node.transfer, node.answer
    sent = tuple(path for path in entries if path in transfer.send)
    if dry_run:
        return NodeSynced(node.name, answer.dest, sent, transfer.bytes(entries), transfer.delete,
                          answer.same + len(transfer.equal), seconds, dry_run=True)
    result = node.result or {}
    failed = tuple((str(path), str(why)) for path, why in result.get("failed", []))
    if failed:
        shown = "; ".join(f"{path}: {why}" for path, why in failed[:3])
        return SyncFailed(node.name, f"{len(failed)} files not in sync: {shown}", seconds, failed)
    return NodeSynced(node.name, answer.dest, sent, int(result.get("bytes", 0)), tuple(result.get("deleted", ())),
                      answer.same + len(transfer.equal), seconds)
