"""The cross-node probes: real listeners on every node, then real connects from
every node to the master port and to every other node's ephemeral ports."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping, TypeVar

from torchherd.checks.gather import FactsSession, run_connector
from torchherd.checks.model import Observed
from torchherd.errors import TransportError
from torchherd.inventory import Host

CONNECT_TIMEOUT = 2.0
"""Long enough for a LAN handshake, short enough that a DROP rule costs little."""
LISTEN_SECONDS = 30.0
"""The listener's own limit, should the controller vanish before it sends EOF."""
EPHEMERAL_LABELS = ("e1", "e2")

T = TypeVar("T")


def parallel(hosts: list[Host], work: Callable[[Host], T]) -> dict[str, T | TransportError]:
    def attempt(host: Host) -> T | TransportError:
        try:
            return work(host)
        except TransportError as error:
            return error

    with ThreadPoolExecutor(max_workers=max(1, len(hosts))) as pool:
        return dict(zip((host.name for host in hosts), pool.map(attempt, hosts)))


def run_probes(observed: Observed, sessions: Mapping[str, FactsSession]) -> None:
    """Every node connects, from its running facts session, to the others' listeners."""
    live = [host for host in observed.inventory.hosts if host.name in sessions]
    probed = parallel(live, lambda host: run_connector(
        sessions[host.name], targets(observed, host), _ping_target(observed, host), CONNECT_TIMEOUT,
        _names_to_resolve(observed, host)))
    for name, result in probed.items():
        if isinstance(result, TransportError):
            observed.probe_errors.setdefault(name, str(result))
        else:
            observed.connected[name] = result


def listen_config(observed: Observed, host: Host) -> dict[str, object]:
    """The listener each node's facts script starts: two ephemeral ports, and the master port on the master."""
    ports = {label: 0 for label in EPHEMERAL_LABELS}
    if host.name == observed.master.name:
        ports["master"] = observed.port
    return {"ports": ports, "seconds": LISTEN_SECONDS}


def master_address(observed: Observed) -> str:
    network = observed.networks.get(observed.master.name)
    return network.address if network else observed.master_target


def targets(observed: Observed, host: Host) -> list[tuple[str, str, int]]:
    """(label, address, port) for every connection ``host`` must be able to open."""
    found: list[tuple[str, str, int]] = []
    master = observed.master.name
    if host.name != master and master in observed.listened:
        found.append((f"{master}:master", master_address(observed), observed.port))
    for peer, listened in observed.listened.items():
        network = observed.networks.get(peer)
        if peer == host.name or network is None:
            continue
        for label in EPHEMERAL_LABELS:
            port = (listened.get("bound") or {}).get(label)
            if isinstance(port, int):
                found.append((f"{peer}:{label}", network.address, port))
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
