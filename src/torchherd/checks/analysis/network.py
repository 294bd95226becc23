"""``network``: which address and interface each node takes part in the job with.

The master's address is the one the workers are told (resolved on the master and
owned by it); every other node's is the source address of its route to the master
(what its real connection to the master came from, when the probe ran). ``run``
turns these into --local-addr and GLOO/NCCL_SOCKET_IFNAME.
"""

from __future__ import annotations

from collections import Counter

from torchherd.checks.analysis.common import is_loopback, per_node, resolved
from torchherd.checks.model import NodeFacts, Observed
from torchherd.checks.results import CheckResult
from torchherd.inventory import Host
from torchherd.plan import NodeNetwork
from torchherd.plan import is_ip_address as is_ip

CHECK = "network"
VIRTUAL_PREFIXES = ("docker", "virbr", "br-", "cni", "flannel", "podman")
IFNAME_VARIABLES = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def _network(facts: NodeFacts, address: str, reason: str) -> NodeNetwork:
    interface = facts.interface_of(address)
    return NodeNetwork(address=address, interface=str(interface["name"]) if interface else None, reason=reason)


def master_network(observed: Observed, facts: NodeFacts) -> NodeNetwork | None:
    master = observed.master
    own = facts.own_addresses()
    target = observed.master_target
    candidates: list[tuple[str, str]] = []
    if master.local_addr:
        candidates.append((master.local_addr, "the master's local_addr"))
    answer = [target] if is_ip(target) else resolved(facts, target)
    if isinstance(answer, list):
        candidates += [(address, f"{target} resolves to it on the master") for address in answer]
    ssh_address = observed.ssh_addresses.get(master.name)
    if ssh_address:
        candidates.append((ssh_address, "the controller reaches the master there"))
    gloo = (facts.get("gloo") or {}).get("address")
    if isinstance(gloo, str):
        candidates.append((gloo, "the master's hostname resolves to it"))
    for address, reason in candidates:
        if address in own and not is_loopback(address):
            return _network(facts, address, reason)
    return None


def worker_network(observed: Observed, host: Host, facts: NodeFacts) -> NodeNetwork | None:
    if host.local_addr:
        return _network(facts, host.local_addr, "the node's local_addr")
    probe = (observed.connected.get(host.name) or {}).get(f"{observed.master.name}:master") or {}
    if isinstance(probe.get("source"), str):
        return _network(facts, probe["source"], "source address of its connection to the master")
    route = facts.get("route") or {}
    if isinstance(route.get("source"), str) and not is_loopback(route["source"]):
        return _network(facts, route["source"], f"source address of its route to {route.get('target')}")
    return None


def compute_networks(observed: Observed) -> dict[str, NodeNetwork]:
    networks: dict[str, NodeNetwork] = {}
    for host in observed.inventory.hosts:
        facts = observed.facts.get(host.name)
        if facts is None:
            continue
        found = (master_network(observed, facts) if host.name == observed.master.name
                 else worker_network(observed, host, facts))
        if found is not None:
            networks[host.name] = found
    return networks


def analyse(observed: Observed) -> list[CheckResult]:
    return per_node(observed, CHECK, _node)


def _node(observed: Observed, host: Host, facts: NodeFacts) -> CheckResult:
    network = observed.networks.get(host.name)
    if network is None:
        return CheckResult(host.name, CHECK, "fail",
                           f"{host.name}: no non-loopback address that routes to the master {observed.master_target}",
                           f"check {host.name}'s interfaces and routes, or set local_addr for it in the inventory")
    for problem in (_duplicate, _ifname_variables, _virtual, _mtu, _gloo_loopback):
        result = problem(observed, host, facts, network)
        if result is not None:
            return result
    interface = facts.interface_of(network.address) or {}
    mtu = f", mtu {interface['mtu']}" if "mtu" in interface else ""
    return CheckResult(host.name, CHECK, "pass",
                       f"{network.address} on {network.interface or '?'}{mtu}: {network.reason}")


def _duplicate(observed: Observed, host: Host, facts: NodeFacts, network: NodeNetwork) -> CheckResult | None:
    others = [name for name, other in observed.networks.items()
              if name != host.name and other.address == network.address]
    if not others:
        return None
    return CheckResult(host.name, CHECK, "fail",
                       f"{host.name} and {', '.join(others)} both use {network.address}",
                       "each node needs its own address: set local_addr per node, or fix the duplicate")


def ifname_matches(spec: str, names: list[str]) -> list[str]:
    """The interfaces NCCL's NCCL_SOCKET_IFNAME syntax selects (prefixes, ^ excludes, = exact)."""
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    items = [item for item in spec.lstrip("=").split(",") if item]
    hit = [name for name in names if any(name == item if exact else name.startswith(item) for item in items)]
    return [name for name in names if name not in hit] if exclude else hit


def _ifname_variables(observed: Observed, host: Host, facts: NodeFacts,
                      network: NodeNetwork) -> CheckResult | None:
    env = {**(facts.get("env") or {}), **observed.env_of(host)}
    names = [str(item.get("name")) for item in facts.get("interfaces") or [] if isinstance(item, dict)]
    for variable in IFNAME_VARIABLES:
        if variable not in env:
            continue
        chosen = ifname_matches(str(env[variable]), names)
        if not chosen:
            return CheckResult(host.name, CHECK, "fail",
                               f"{variable}={env[variable]} matches no interface on {host.name} "
                               f"(it has {', '.join(names)})",
                               f"set {variable}={network.interface} for {host.name} (env in the inventory)")
    return None


def _virtual(observed: Observed, host: Host, facts: NodeFacts, network: NodeNetwork) -> CheckResult | None:
    name = network.interface or ""
    if not name.startswith(VIRTUAL_PREFIXES) and not network.address.startswith("172.17."):
        return None
    return CheckResult(host.name, CHECK, "warn",
                       f"{host.name} reaches the master through {name or network.address}, a container bridge: "
                       f"other hosts usually cannot reach {network.address}",
                       "run the container with host networking (--network=host)")


def _mtu(observed: Observed, host: Host, facts: NodeFacts, network: NodeNetwork) -> CheckResult | None:
    mtus: Counter[int] = Counter()
    for name, other in observed.networks.items():
        other_facts = observed.facts.get(name)
        interface = other_facts.interface_of(other.address) if other_facts else None
        if interface and "mtu" in interface:
            mtus[int(interface["mtu"])] += 1
    own = (facts.interface_of(network.address) or {}).get("mtu")
    if len(mtus) < 2 or own is None or own == mtus.most_common(1)[0][0]:
        return None
    common = mtus.most_common(1)[0][0]
    return CheckResult(host.name, CHECK, "warn",
                       f"{host.name}'s {network.interface} has mtu {own}, most nodes have {common}",
                       f"set the same MTU on every node (ip link set {network.interface} mtu {common})")


def _gloo_loopback(observed: Observed, host: Host, facts: NodeFacts,
                   network: NodeNetwork) -> CheckResult | None:
    gloo = (facts.get("gloo") or {}).get("address")
    if not isinstance(gloo, str) or not is_loopback(gloo):
        return None
    return CheckResult(host.name, CHECK, "warn",
                       f"gloo would bind {gloo} (the hostname's address, loopback); torchherd run pins "
                       f"GLOO_SOCKET_IFNAME={network.interface} and --local-addr {network.address} instead",
                       "fix /etc/hosts (see hostname) so a plain torchrun works too")
