"""Checkpoint replication (``[recovery] replicate = K``): each new checkpoint, once complete,
copied while the job runs to the next K nodes in the ring of node ranks, so that losing the
node that wrote it loses nothing.

1. Each node's supervisor watches the checkpoint's path (``remote/savewatch.py``) and says
   when a new one is complete: a ``checkpoint`` record, ``CheckpointSaved`` here.
2. The ``Replicator`` (a thread of the recovering run) copies it from that node to
   ``ring(nodes, node, K)`` with ``engine.staging.replicate``: the staging's chain of relays
   (node to node, each connection opened with a random token the controller hands every
   program on its stdin, each copy checked by SHA-256 and renamed into place), at the lowest
   CPU and I/O priority, paced to ``replicate_bandwidth``. A newer save from the same node
   while a copy runs replaces the one waiting (only the newest matters).
3. ``Holdings`` keeps which node holds which checkpoint: the run's summary says where the
   newest is (``Holdings.line``), and staging before the next attempt finds the replica on
   a node still there when the node that wrote it is gone.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Collection, Sequence

from torchherd.engine.events import CheckpointReplicated, CheckpointSaved, CheckpointStaged, Observer
from torchherd.words import size

Copier = Callable[[CheckpointSaved, tuple[str, ...], Callable[[], bool]], CheckpointReplicated]
"""Copies a saved checkpoint to the nodes given, giving up once the callable says so."""


def ring(nodes: Sequence[str], source: str, replicas: int) -> tuple[str, ...]:
    """The ``replicas`` nodes after ``source`` in ``nodes`` (node-rank order), wrapping
    around; never ``source`` itself, at most every other node. A source not in ``nodes``
    (it left the run): none."""
    if source not in nodes or replicas <= 0:
        return ()
    start = nodes.index(source)
    others = [nodes[(start + step) % len(nodes)] for step in range(1, len(nodes))]
    return tuple(others[:replicas])


@dataclass(frozen=True)
class Held:
    """A checkpoint as a node holds it: the same path and mtime is the same checkpoint (a
    replica keeps the original's mtime)."""

    path: str
    mtime: float
    size: int
    origin: str
    """The node that saved it."""


class Holdings:
    """Which node holds which checkpoint, from the run's events."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.held: dict[str, Held] = {}

    def saved(self, event: CheckpointSaved) -> bool:
        """A node's watch found a complete checkpoint: one the node saved (True), or a copy
        of one another node did (False: its watch sees a replica or a staged copy appear too)."""
        copy = self.copy_of(event)
        self.held[event.node] = copy or Held(event.path, event.mtime, event.size, event.node)
        return copy is None

    def copy_of(self, event: CheckpointSaved) -> Held | None:
        """The checkpoint another node saved that ``event`` is a copy of (a copy keeps the
        original's mtime); None: ``event``'s node saved it."""
        for held in list(self.held.values()):
            if (held.path, held.mtime) == (event.path, event.mtime) and held.origin != event.node:
                return held
        return None

    def replicated(self, event: CheckpointReplicated) -> None:
        origin = self.held.get(event.source)
        copy = Held(event.path, event.mtime, event.size,
                    origin.origin if origin is not None and (origin.path, origin.mtime) == (event.path, event.mtime)
                    else event.source)
        for node in (event.source, *event.nodes, *event.held):
            self.held[node] = copy

    def staged(self, event: CheckpointStaged) -> None:
        """A staging copies the source's newest: each node staged holds what the source does,
        when it is known here (a checkpoint of an earlier run is not)."""
        copy = self.held.get(event.source)
        if copy is not None and copy.path == event.path:
            for node in event.nodes:
                self.held[node] = copy

    def newest(self) -> Held | None:
        return self._newest(dict(self.held))

    @staticmethod
    def _newest(holdings: dict[str, Held]) -> Held | None:
        best: Held | None = None
        for held in holdings.values():
            if best is None or held.mtime > best.mtime:
                best = held
        return best

    def line(self, lost: Collection[str] = ()) -> str:
        """The summary's line: "newest checkpoint: snapshot.pt (4.2 MB, saved 10:41:07 on
        node0) on node0 (lost), node1"."""
        holdings = dict(self.held)  # a copy made at once: a detached run's controller reads it while saves come in
        best = self._newest(holdings)
        if best is None:
            return f"newest checkpoint: none of {self.path} was seen complete during the run"
        holders = [node + (" (lost)" if node in lost else "") for node, held in holdings.items()
                   if (held.path, held.mtime) == (best.path, best.mtime)]
        saved = time.strftime("%H:%M:%S", time.localtime(best.mtime))
        return (f"newest checkpoint: {best.path} ({size(best.size)}, saved {saved} on {best.origin}) "
                f"on {', '.join(holders)}")


CLOSE_SECONDS = 12.0
"""How long the run's end waits for a copy given up to end: its programs get
``engine.prepare.relay.END_SECONDS`` to exit once told, and the copy's thread a margin to see it."""


class Replicator:
    """Copies each new checkpoint to the next nodes in the ring, one copy at a time, in a
    thread of its own; ``pause`` between two attempts (the copy under way given up)."""

    def __init__(self, copier: Copier, replicas: int, observer: Observer, holdings: Holdings) -> None:
        self.copier = copier
        self.replicas = replicas
        self.emit = observer
        self.holdings = holdings
        self.nodes: tuple[str, ...] = ()
        self._pending: dict[str, CheckpointSaved] = {}
        self._busy = False
        self._generation = 0
        """Raised by each ``pause``: a copy started before it is given up, and of its outcome
        (late, from an attempt that ended) only the nodes it reached are told."""
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def attempt(self, nodes: Sequence[str]) -> None:
        """The nodes of the attempt now running, in node-rank order: the ring."""
        with self._changed:
            self.nodes = tuple(nodes)

    def close(self) -> None:
        """The run is over: the copy under way is given up, and the thread ends; returns
        once its programs have ended (``CLOSE_SECONDS`` at most), so that none outlives the run."""
        self.pause(CLOSE_SECONDS)
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def saved(self, event: CheckpointSaved) -> bool:
        """Takes a node's save to copy; False: not one to copy (a replica or a staged copy
        the run made, or the run is over)."""
        with self._changed:
            if self._closed:
                return False
            if not self.holdings.saved(event):
                return False  # a replica (or a staged copy) the run made: copying it on would pass it round the ring
            self._pending[event.node] = event  # a newer save replaces one still waiting
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="torchherd-replicate", daemon=True)
                self._thread.start()
            self._changed.notify_all()
            return True

    def pause(self, timeout: float = 2.0) -> None:
        """Drops what waits and gives up the copy under way (its relays end and remove their
        temporary copies); returns once it has ended, or after ``timeout``: the recovery
        never waits long on it (a copy still ending then cannot put an older checkpoint
        over the one staged next: a receiver keeps a newer copy)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            self._pending.clear()
            self._generation += 1
            while self._busy and (left := deadline - time.monotonic()) > 0:
                self._changed.wait(left)

    def _given_up(self, generation: int) -> Callable[[], bool]:
        """Whether a copy started in ``generation`` is given up (a ``pause`` came since)."""
        return lambda: self._generation != generation

    def _work(self) -> None:
        while True:
            with self._changed:
                while not self._pending and not self._closed:
                    self._changed.wait()
                if self._closed:
                    return
                node = next(iter(self._pending))
                event = self._pending.pop(node)
                targets = ring(self.nodes, node, self.replicas)
                if not targets:
                    continue
                self._busy = True
                generation = self._generation
            try:
                result = self.copier(event, targets, self._given_up(generation))
            except Exception as error:  # noqa: BLE001 - a copy that fails never ends the run
                result = CheckpointReplicated(event.path, event.size, event.mtime, node, (), 0.0, "",
                                              failed=tuple((target, str(error)) for target in targets))
            told: CheckpointReplicated | None = result
            with self._changed:
                if self._generation != generation:
                    # Given up: what failed, failed for that. The nodes it reached hold the copy
                    # all the same (a job that waits for its replica ends its attempt the moment
                    # the copy lands, before the chain's last answer).
                    told = replace(result, failed=()) if result.nodes else None
                if told is not None:
                    self.holdings.replicated(told)
            if told is not None:
                self.emit(told)
            with self._changed:  # after the emit: a pause or close returns once the copy is told
                self._busy = False
                self._changed.notify_all()
