"""The cross-node probes: real listeners on every node, then real connects from every
node to the master port and to its peers' ephemeral ports, as the probe plan says.

Every node's facts process is already listening (see gather.py); here each one gets a
connect request on its stdin. The requests all go out first and the answers are read
after, one node after the other: every node probes at the same time, and the
controller holds no thread per node.
"""

from __future__ import annotations

import ipaddress
import json
import time
from collections import Counter
from typing import Mapping, Sequence

from torchherd.checks.gather import NODES_AT_ONCE, FactsSession
from torchherd.checks.model import Mesh, Observed, ProbePlan
from torchherd.inventory import Host

CONNECT_TIMEOUT = 2.0
"""Long enough for a LAN handshake, short enough that a DROP rule costs little."""
RETRY_TIMEOUT = 4.0
"""A connect that failed in the burst is tried again, alone, for this long: the kernel
resends the SYN at 1 s and 3 s, so a loaded peer gets two more chances where the
burst's 2 s gave it one. A DROP rule fails both: 6 s per dropped probe."""
PROBE_BUDGET = 10.0
"""Every node answers its request within this (the node script stops starting connects
that would not end in time). A node whose every probe is dropped, at the full-mesh
threshold (63 targets, 32 at once: two waves of 2 s), still gets its 4 s retries in."""
ANSWER_MARGIN = 5.0
"""How much longer than the budget the controller waits for an answer: SSH on a busy
controller, and the ping that runs beside the connects."""
LISTEN_SECONDS = 120.0
"""The least the listener waits by itself, should the controller vanish without the
channel closing (it stops at EOF otherwise). It must outlive every node's facts and the
probes: a listener that gave up early would make its peers see 'refused' (at 64 nodes on
a loaded machine the facts took over 30 s, the old limit)."""
FACTS_ALLOWANCE = 20.0
"""What one node's facts may take on top of ssh_timeout (the runner's FACTS_EXTRA_SECONDS)."""
EPHEMERAL_LABELS = ("e1", "e2")

FULL_MESH_MAX = 32
"""Up to this many nodes, every node probes every other. At 32 that is 2 x 31 ephemeral
connects out of each node and into each node, about 2,000 in all, which the bounded
connectors (32 at once) and the listeners (a queue per peer, drained in a loop) take in a
second. Beyond it the mesh grows as 2n(n-1) (130,560 connects at 256 nodes, 510 into every
listener) and what the extra connects can find is a fault between one particular pair of
nodes: the firewall check already evaluates every node's rules for every peer's address,
and ``--mesh full`` probes every pair when that is wanted. A node that drops or refuses its
peers is found by each of its several probers, one that cannot connect out by its own
probes, and a blocked path between subnets by the pairs every plan covers."""
SAMPLED_PROBERS = 4
"""Beyond the threshold, each node is probed by this many others (and probes as many),
before the subnet pairs are added: two failing probers make a verdict about the target
(see analysis/port.py), and four leave room for one prober that is itself broken."""


def run_probes(observed: Observed, sessions: Mapping[str, FactsSession], mesh: Mesh = "auto") -> None:
    """Every node connects, from its running facts session, to the master port and to the
    peers the plan gives it; records the plan, each node's answer, or why there is none."""
    live = [host for host in observed.inventory.hosts if host.name in sessions]
    nodes = probed_nodes(observed, live)
    plan = plan_probes(nodes, {node: subnet_of(observed, node) for node in nodes}, mesh)
    observed.probe_plan = plan
    asked = [host for host in live if _ask(observed, host, sessions[host.name], plan)]
    deadline = time.monotonic() + PROBE_BUDGET + ANSWER_MARGIN
    for host in asked:
        _collect(observed, host.name, sessions[host.name], deadline)


def _ask(observed: Observed, host: Host, session: FactsSession, plan: ProbePlan) -> bool:
    request = {"targets": [list(target) for target in targets(observed, host, plan)],
               "timeout": CONNECT_TIMEOUT, "retry_timeout": RETRY_TIMEOUT, "budget": PROBE_BUDGET,
               "ping": _ping_target(observed, host), "resolve": _names_to_resolve(observed, host)}
    if session.listener is None or session.reader is None:
        observed.probe_errors.setdefault(host.name, f"{host.name}: no listener to probe from")
        return False
    if not session.listener.send(json.dumps(request).encode("utf-8") + b"\n"):
        observed.probe_errors.setdefault(host.name, f"{host.name}: the probe session closed")
        return False
    return True


def _collect(observed: Observed, name: str, session: FactsSession, deadline: float) -> None:
    line = session.reader.line(deadline) if session.reader is not None else None
    try:
        answer = json.loads((line or b"").decode("utf-8", "replace"))
    except ValueError:
        answer = None
    if isinstance(answer, dict):
        observed.connected[name] = answer
    else:
        observed.probe_errors.setdefault(name, f"{name}: the probe did not answer")


def listen_config(observed: Observed, host: Host) -> dict[str, object]:
    """The listener each node's facts script starts: two ephemeral ports, and the master
    port on the master, each with a queue for every peer that may connect to it."""
    ports = {label: 0 for label in EPHEMERAL_LABELS}
    if host.name == observed.master.name:
        ports["master"] = observed.port
    return {"ports": ports, "seconds": listen_seconds(observed), "backlog": max(1, len(observed.inventory.hosts) - 1)}


def listen_seconds(observed: Observed) -> float:
    """Long enough for the last node's connect and facts (the nodes are connected
    NODES_AT_ONCE at a time, each within ssh_timeout; the last one's facts started then
    answer within ssh_timeout + FACTS_ALLOWANCE), then the probes."""
    rounds = -(-len(observed.inventory.hosts) // NODES_AT_ONCE)
    timeout = observed.inventory.cluster.ssh_timeout
    return max(LISTEN_SECONDS, rounds * timeout + timeout + FACTS_ALLOWANCE + PROBE_BUDGET + ANSWER_MARGIN)


def master_address(observed: Observed) -> str:
    """Where the workers connect to the master port: the address the user chose, exactly
    as the job will be told it, else the one found on the master."""
    if observed.master_given is not None:
        return observed.master_target
    network = observed.networks.get(observed.master.name)
    return network.address if network else observed.master_target


def probed_nodes(observed: Observed, live: list[Host]) -> list[str]:
    """The nodes whose ephemeral ports can be probed: a listener bound both, and an address."""
    found = []
    for host in live:
        bound = (observed.listened.get(host.name) or {}).get("bound") or {}
        if host.name in observed.networks and all(isinstance(bound.get(label), int) for label in EPHEMERAL_LABELS):
            found.append(host.name)
    return found


def subnet_of(observed: Observed, node: str) -> str:
    """The subnet of the node's address, as its interface reports it (a /24 or /64 when
    the node did not say)."""
    address = observed.networks[node].address
    facts = observed.facts.get(node)
    interface = facts.interface_of(address) if facts is not None else None
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return address  # a name: its own group
    for text in (interface or {}).get("networks") or []:
        try:
            if ip in ipaddress.ip_network(text):
                return str(text)
        except ValueError:
            continue
    return str(ipaddress.ip_network(f"{ip}/{24 if ip.version == 4 else 64}", strict=False))


def plan_probes(nodes: Sequence[str], subnets: Mapping[str, str], mesh: Mesh = "auto") -> ProbePlan:
    """Whose ephemeral ports each node probes. Pure and deterministic: the same nodes in the
    same order with the same subnets give the same plan.

    The full mesh up to FULL_MESH_MAX nodes (or when ``mesh`` is "full"). Beyond it, every
    node is probed by SAMPLED_PROBERS others (or all others when fewer), and every ordered
    pair of distinct subnets has at least one probe; a node probes at most SAMPLED_PROBERS +
    ceil((S - 1) / size of its subnet) peers, S the number of subnets."""
    count = len({subnets.get(node, "") for node in nodes})
    if mesh == "full" or len(nodes) <= FULL_MESH_MAX:
        # Each node starts after itself, so the nodes' bursts spread over the listeners
        # instead of all reaching the first node at once.
        peers = {node: tuple(nodes[index + 1:]) + tuple(nodes[:index]) for index, node in enumerate(nodes)}
        return ProbePlan("full", peers, count)
    return ProbePlan("sampled", _sampled(nodes, subnets), count)


def _sampled(nodes: Sequence[str], subnets: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    size = len(nodes)
    offsets = _offsets(size)
    chosen = {node: [nodes[(index + offset) % size] for offset in offsets] for index, node in enumerate(nodes)}
    _cover_subnet_pairs(nodes, subnets, chosen)
    return {node: tuple(peers) for node, peers in chosen.items()}


def _offsets(size: int) -> list[int]:
    """Distinct steps around the ring of nodes in rank order: the neighbour, then quarter
    turns, so a node is also probed from far-off ranks (often other racks). Distinct
    non-zero steps make a circulant graph: every node is probed by exactly as many."""
    wanted = min(SAMPLED_PROBERS, size - 1)
    spread = [1] + [size * step // SAMPLED_PROBERS for step in range(1, SAMPLED_PROBERS)]
    chosen = list(dict.fromkeys(step for step in spread if 0 < step < size))
    chosen += [step for step in range(1, size) if step not in chosen][:wanted - len(chosen)]
    return chosen[:wanted]


def _cover_subnet_pairs(nodes: Sequence[str], subnets: Mapping[str, str], chosen: dict[str, list[str]]) -> None:
    """Adds a probe for every ordered pair of subnets the ring left out (firewalls and
    routes differ by direction), each from the member of its subnet with the fewest
    added so far, to the member of the other with the fewest added: the extra load
    spreads evenly over each subnet."""
    order = {node: index for index, node in enumerate(nodes)}
    members: dict[str, list[str]] = {}
    for node in nodes:
        members.setdefault(subnets.get(node, ""), []).append(node)
    covered = {(subnets.get(node, ""), subnets.get(peer, "")) for node, peers in chosen.items() for peer in peers}
    added_out: Counter[str] = Counter()
    added_in: Counter[str] = Counter()
    for source, sources in members.items():
        for target, probed in members.items():
            if source == target or (source, target) in covered:
                continue
            prober = min(sources, key=lambda node: (added_out[node], order[node]))
            peer = min(probed, key=lambda node: (added_in[node], order[node]))
            chosen[prober].append(peer)
            added_out[prober] += 1
            added_in[peer] += 1


def targets(observed: Observed, host: Host, plan: ProbePlan) -> list[tuple[str, str, int]]:
    """(label, address, port) for every connection ``host`` opens: the master port from a
    worker, then both ephemeral ports of every peer the plan gives it."""
    found: list[tuple[str, str, int]] = []
    master = observed.master.name
    if host.name != master and master in observed.listened:
        found.append((f"{master}:master", master_address(observed), observed.port))
    for peer in plan.peers.get(host.name, ()):
        bound = (observed.listened.get(peer) or {}).get("bound") or {}
        address = observed.networks[peer].address
        found += [(f"{peer}:{label}", address, int(bound[label])) for label in EPHEMERAL_LABELS]
    return found


def _ping_target(observed: Observed, host: Host) -> str | None:
    return None if host.name == observed.master.name else master_address(observed)


def _names_to_resolve(observed: Observed, host: Host) -> list[str]:
    """On a worker, the master's own hostname and FQDN, which a c10d rendezvous may publish
    to the workers; on the master, every other node's hostname."""
    if host.name == observed.master.name:
        return sorted({str(facts.get("hostname")) for name, facts in observed.facts.items()
                       if name != host.name and facts.get("hostname")})
    facts = observed.facts.get(observed.master.name)
    if facts is None:
        return []
    names = {str(facts.get("hostname")), str(facts.get("fqdn"))} - {observed.master_target, "None"}
    return sorted(name for name in names if name)
