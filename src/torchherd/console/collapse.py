"""What the terminal shows of many ranks saying the same thing: said once, with who said it.

``Collapser`` holds every line for a short window (``WINDOW``); lines with the same
text from different ranks (or, for torchrun's own lines, different nodes) within it
are shown once as ``node[0-3]:* │ text (x8)``. A line that differs stays its own
line, so a difference between nodes is always visible. Each rank's lines keep their
order: a line joins an earlier line's group only when that rank has shown nothing
after that group. torchrun's ``OMP_NUM_THREADS`` banner is shown once per run.

Only the terminal collapses: the log files keep every line. A chunk of rank lines
whose texts are all new (the common case of a chatty job: every line holds its rank
or step) stays one bytes object from arrival to the screen, as in ``LiveRenderer``.
"""

from __future__ import annotations

import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence, Union

from torchherd.errors import UsageError
from torchherd.inventory.nodeset import fold_names, fold_numbers
from torchherd.remote.wire import RANK_PREFIX_HEAD
from torchherd.runlog import STDERR, OutputLine, RankLines

if TYPE_CHECKING:  # `check` folds node names with this module and never renders a run
    from torchherd.console.run import LiveRenderer

WINDOW = 0.5
"""Seconds a line waits for the same text from other ranks before it is shown."""

_ANY_RANK = re.compile(rb"\n[OE]" + re.escape(RANK_PREFIX_HEAD) + rb"(\d+)\] ")
# torch's C++ warnings start with their own time (glog: "[W1123 12:18:13.870269108 socket.cpp:207]");
# the same warning from many ranks differs only there, so it is compared without it. Looked
# for first with a pattern that starts with a plain "[" (fast), replaced only where found.
_GLOG_PROBE = re.compile(rb"\[[IWEF]\d{4} \d\d:\d\d:\d\d\.")
_GLOG_TIME = re.compile(rb"(?<=\n[OEoe]\[[IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ ")
_BANNER_RULE = re.compile(r"^\*{20,}\s*$")
_BANNER_TEXT = "Setting OMP_NUM_THREADS environment variable for each process"

Source = tuple[str, Union[int, None]]
Order = tuple[int, int]
"""Where an item stands in the queue: (arrival, position within a chunk taken apart)."""


# ------------------------------------------------------------------ names and ranks


def parse_ranks(text: str) -> frozenset[int]:
    """``--ranks 0,8-15`` -> the global ranks it names."""
    ranks: set[int] = set()
    for item in text.split(","):
        low, dash, high = item.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or (dash and int(high) < int(low)):
            raise UsageError(f"--ranks {text!r}: {item.strip()!r} is not a rank or a range like 8-15",
                             "for example --ranks 0,8-15")
        ranks.update(range(int(low), int(high or low) + 1))
    return frozenset(ranks)


class RankFilter:
    """Keeps only the lines of the given global ranks (torchrun's own lines always stay)."""

    def __init__(self, ranks: frozenset[int]) -> None:
        self.ranks = ranks
        wanted = b"|".join(str(rank).encode() for rank in sorted(ranks))
        # One regular expression drops every record of an unwanted rank from a chunk.
        self._unwanted = re.compile(rb"\n[OE]" + re.escape(RANK_PREFIX_HEAD) + rb"(?!(?:" + wanted + rb")\] )\d+\] [^\n]*")

    def __call__(self, lines: Sequence[OutputLine | RankLines]) -> list[OutputLine | RankLines]:
        kept: list[OutputLine | RankLines] = []
        for line in lines:
            if isinstance(line, RankLines):
                records = self._unwanted.sub(b"", line.records)
                if len(records) > 1:
                    kept.append(line if len(records) == len(line.records) else RankLines(line.node, records))
            elif line.rank is None or line.rank in self.ranks:
                kept.append(line)
        return kept


def is_banner(line: OutputLine) -> bool:
    """torchrun's warning that it set OMP_NUM_THREADS, the rules of stars around it, and
    the empty line it starts with."""
    return line.rank is None and (line.text.startswith(_BANNER_TEXT) or _BANNER_RULE.match(line.text) is not None
                                  or not line.text.strip())


# ------------------------------------------------------------------ the held lines


@dataclass
class _Group:
    """Lines with one text from distinct sources, shown as one."""

    order: Order
    key: bytes
    first: OutputLine
    since: float
    expected: int
    sources: list[Source] = field(default_factory=list)


@dataclass
class _Chunk:
    """A chunk of rank lines none of whose texts is held anywhere else: kept whole."""

    order: Order
    block: RankLines
    keys: frozenset[bytes]
    since: float


@dataclass
class _Note:
    """Text shown as it is, in its place among the lines (torchherd's own notes)."""

    order: Order
    text: str


_Held = Union[_Group, _Chunk, _Note]


class Collapser:
    """Holds lines for ``window`` seconds and gives back the terminal text of those whose
    time has come (``take``), duplicates folded. ``world``: the job's ranks, ``nodes``:
    its nodes; a group that every rank (or node) joined is shown at once."""

    def __init__(self, renderer: LiveRenderer, nodes: Sequence[str], world: int | None,
                 window: float = WINDOW, clock: Callable[[], float] = time.monotonic) -> None:
        self.renderer = renderer
        self.node_count = max(1, len(nodes))
        self.world = world
        self.window = window
        self.clock = clock
        self.held: deque[_Held] = deque()
        self._arrivals = 0
        self._open: dict[bytes, _Group] = {}
        """Per text, the newest group that may still take lines."""
        self._chunk_keys: set[bytes] = set()
        """Every text of the held chunks (disjoint from each other and from the groups')."""
        self._last: dict[Source, Order] = {}
        self._node_floor: dict[str, Order] = {}
        """A node's ranks cannot join a group older than its newest chunk."""
        self._ranks: dict[str, set[int]] = {}
        self._banner_from: str | None = None

    def _next(self) -> Order:
        self._arrivals += 1
        return (self._arrivals, 0)

    def add(self, lines: Sequence[OutputLine | RankLines]) -> None:
        now = self.clock()
        for line in lines:
            if isinstance(line, RankLines):
                self._add_chunk(line, now)
            elif not is_banner(line) or self._banner(line.node):
                self._add_line(line, self._next(), now)

    def note(self, text: str) -> None:
        self.held.append(_Note(self._next(), text))

    def _banner(self, node: str) -> bool:
        """Whether a banner line of ``node`` is shown: only the first node's."""
        self._banner_from = self._banner_from or node
        return node == self._banner_from

    def _chunk_texts(self, block: RankLines) -> list[bytes]:
        """Each record of the chunk as ``_key`` makes it: its rank taken off with one bytes
        replace per rank of the node (a regular expression would cost a call per line)."""
        ranks = self._ranks.setdefault(block.node, set())
        data = block.records
        for rank in ranks:
            head = RANK_PREFIX_HEAD + b"%d] " % rank
            data = data.replace(b"\nO" + head, b"\nO")
            if b"\nE" + head in data:
                data = data.replace(b"\nE" + head, b"\nE")
        if RANK_PREFIX_HEAD in data:  # ranks not seen on this node before: found once, then known
            new = {int(rank) for rank in set(_ANY_RANK.findall(data))} - ranks
            if new:  # (else a line's own text holds the head)
                ranks.update(new)
                return self._chunk_texts(block)
        if _GLOG_PROBE.search(data):
            data = _GLOG_TIME.sub(b"", data)
        return data[1:-1].split(b"\n")

    def _add_chunk(self, block: RankLines, now: float) -> None:
        keys = self._chunk_texts(block)
        unique = frozenset(keys)
        if len(unique) == len(keys) and self._chunk_keys.isdisjoint(unique) and self._open.keys().isdisjoint(unique):
            order = self._next()
            self.held.append(_Chunk(order, block, unique, now))
            self._chunk_keys |= unique
            self._node_floor[block.node] = order
            return
        order = self._next()
        for index, line in enumerate(block.lines()):
            self._add_line(line, (order[0], index), now)

    def _add_line(self, line: OutputLine, order: Order, now: float) -> None:
        key = _key(line)
        if key in self._chunk_keys:
            self._take_apart(key)
        source: Source = (line.node, line.rank)
        if line.rank is not None:
            self._ranks.setdefault(line.node, set()).add(line.rank)
        group = self._open.get(key)
        floor = max(self._last.get(source, (0, 0)), self._node_floor.get(line.node, (0, 0)))
        if group is None or now - group.since >= self.window or group.order <= floor \
                or len(group.sources) >= group.expected:
            expected = self.node_count if line.rank is None else (self.world or 1 << 30)
            group = _Group(order, key, line, now, expected)
            self._insert(group)
            self._open[key] = group
        group.sources.append(source)
        self._last[source] = max(self._last.get(source, (0, 0)), group.order)

    def _insert(self, group: _Group) -> None:
        """Groups of a chunk taken apart go where the chunk was; new ones at the end."""
        if not self.held or self.held[-1].order < group.order:
            self.held.append(group)
            return
        index = len(self.held)
        while index > 0 and self.held[index - 1].order > group.order:
            index -= 1
        self.held.insert(index, group)

    def _take_apart(self, key: bytes) -> None:
        """A held chunk holds ``key``, which another rank now says too: its lines become
        groups in its place, so they can take the other ranks' lines."""
        chunk = next(item for item in self.held if isinstance(item, _Chunk) and key in item.keys)
        self.held.remove(chunk)
        self._chunk_keys -= chunk.keys
        for index, line in enumerate(chunk.block.lines()):
            order = (chunk.order[0], index)
            group = _Group(order, _key(line), line, chunk.since,
                           self.node_count if line.rank is None else (self.world or 1 << 30), [(line.node, line.rank)])
            self._insert(group)
            if line.rank is not None:
                self._ranks.setdefault(line.node, set()).add(line.rank)
            current = self._open.get(group.key)
            if current is None or current.order < order:
                self._open[group.key] = group
            source = (line.node, line.rank)
            self._last[source] = max(self._last.get(source, (0, 0)), order)

    def take(self, force: bool = False) -> str:
        """The text of every held item whose time has come, in order (``force``: all)."""
        now = self.clock()
        parts: list[str] = []
        while self.held and (force or self._ready(self.held[0], now)):
            item = self.held.popleft()
            if isinstance(item, _Note):
                parts.append(item.text)
            elif isinstance(item, _Chunk):
                self._chunk_keys -= item.keys
                parts.append(self.renderer.block_text(item.block))
            else:
                if self._open.get(item.key) is item:
                    del self._open[item.key]
                parts.append(self._group_text(item))
        return "".join(parts)

    def _ready(self, item: _Held, now: float) -> bool:
        if isinstance(item, _Note):
            return True
        if isinstance(item, _Group) and len(item.sources) >= item.expected:
            return True
        return now - item.since >= self.window

    def _group_text(self, group: _Group) -> str:
        if len(group.sources) == 1:
            return self.renderer.format(group.first) + "\n"
        return self.renderer.collapsed(self.label(group.sources), group.first.stream, group.first.text,
                                       len(group.sources), group.first.node) + "\n"

    def label(self, sources: Sequence[Source]) -> str:
        """``node[0-3]:*`` (every rank of the job; when their number is not known, every
        rank those nodes have shown), ``node[0-1]:[0,2]``, or ``node[0-3]`` for torchrun's
        own lines."""
        nodes = list(dict.fromkeys(node for node, _rank in sources))
        ranks = sorted(rank for _node, rank in sources if rank is not None)
        if not ranks:
            return fold_names(nodes)
        known = set().union(*(self._ranks.get(node, set()) for node in nodes))
        if len(ranks) == self.world or (self.world is None and known <= set(ranks)):
            return f"{fold_names(nodes)}:*"
        folded = fold_numbers(ranks)
        return f"{fold_names(nodes)}:{folded if len(ranks) == 1 else '[' + folded + ']'}"


def _key(line: OutputLine) -> bytes:
    """What makes two lines the same: the text and stream, and whether a rank said it
    (the tag letters of the records: a rank's lines compare with a chunk's texts)."""
    tag = b"E" if line.stream == STDERR else b"O"
    key = b"\n" + (tag if line.rank is not None else tag.lower()) + line.text.encode("utf-8", "replace")
    return _GLOG_TIME.sub(b"", key)[1:]
