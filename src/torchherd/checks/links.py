"""Which links ``check --bandwidth`` measures, and in which rounds.

Pure and deterministic: the same nodes in the same order with the same subnets give the
same plan. A link is directed (sender, receiver): a rate limit or a bad cable may slow
one direction only, and a node is only named when several of its links agree, so each
node sends to at least two others and receives from at least two.
"""

from __future__ import annotations

from collections import Counter
from typing import Mapping, Sequence

from torchherd.checks.model import LinkPlan, Mesh

Link = tuple[str, str]
CHORD_FROM = 6
"""From this many nodes on, each node is also measured against the one half a ring away
(often another rack): three peers each way instead of two, for the same few rounds."""


def plan_links(nodes: Sequence[str], subnets: Mapping[str, str], mesh: Mesh = "auto") -> LinkPlan:
    """``full``: every ordered pair. ``auto``: the ring both ways (every node sends to its
    two neighbours and receives from them), from CHORD_FROM nodes the chord half a ring
    away both ways, and one link each way between every two subnets the ring left apart.
    The rounds group links that share no node: a round's transfers run at once."""
    count = len({subnets.get(node, "") for node in nodes})
    size = len(nodes)
    if mesh == "full":
        links = [(node, peer) for offset in range(1, size) for index, node in enumerate(nodes)
                 for peer in (nodes[(index + offset) % size],)]
        return LinkPlan("full", tuple(links), rounds(links), count)
    offsets = [1, size - 1] + ([size // 2, size - size // 2] if size >= CHORD_FROM else [])
    chosen = list(dict.fromkeys(offset for offset in offsets if 0 < offset < size))
    links = [(node, nodes[(index + offset) % size]) for offset in chosen for index, node in enumerate(nodes)]
    links += _subnet_links(nodes, subnets, links)
    return LinkPlan("sampled", tuple(links), rounds(links), count)


def _subnet_links(nodes: Sequence[str], subnets: Mapping[str, str], links: list[Link]) -> list[Link]:
    """A link each way for every ordered pair of subnets with none yet, each between the
    members with the fewest added links so far (the extra load spreads over a subnet)."""
    order = {node: index for index, node in enumerate(nodes)}
    members: dict[str, list[str]] = {}
    for node in nodes:
        members.setdefault(subnets.get(node, ""), []).append(node)
    covered = {(subnets.get(sender, ""), subnets.get(receiver, "")) for sender, receiver in links}
    added: Counter[str] = Counter()
    found: list[Link] = []
    for source, senders in members.items():
        for target, receivers in members.items():
            if source == target or (source, target) in covered:
                continue
            sender = min(senders, key=lambda node: (added[node], order[node]))
            receiver = min(receivers, key=lambda node: (added[node], order[node]))
            found.append((sender, receiver))
            added[sender] += 1
            added[receiver] += 1
    return found


def rounds(links: Sequence[Link]) -> tuple[tuple[Link, ...], ...]:
    """The links in rounds in which no node takes part twice, each link in the first
    round with room for it (a ring of n takes two or three rounds per direction)."""
    grouped: list[list[Link]] = []
    busy: list[set[str]] = []
    for link in links:
        for index, used in enumerate(busy):
            if not used & set(link):
                grouped[index].append(link)
                used.update(link)
                break
        else:
            grouped.append([link])
            busy.append(set(link))
    return tuple(tuple(group) for group in grouped)


def pairs(links: Sequence[Link]) -> list[Link]:
    """Each unordered pair of the links once, in the order first met (the path-MTU probes:
    one both ways per pair)."""
    seen: set[frozenset[str]] = set()
    found: list[Link] = []
    for sender, receiver in links:
        key = frozenset((sender, receiver))
        if key not in seen:
            seen.add(key)
            found.append((sender, receiver))
    return found


def preflight_pairs(nodes: Sequence[str], master: str) -> list[Link]:
    """The preflight's path-MTU pairs: every worker with the master (the first large
    all_reduce goes through it), and each node with its ring neighbour (NCCL's and gloo's
    ring); the worker first (it sends, the master echoes: no node sends more than two).
    Each pair is one round trip, so each way once."""
    links = [(node, master) for node in nodes if node != master]
    if len(nodes) > 2:
        links += [(node, nodes[(index + 1) % len(nodes)]) for index, node in enumerate(nodes)]
    return pairs(links)
