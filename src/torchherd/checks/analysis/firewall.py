"""``firewall``: the node's packet filter lets the master port and the other nodes'
traffic in; names the rule that drops or rejects it.

iptables rules are evaluated in order for the packets the job will send (see
iptables.py); native nftables tables are scanned for drop/reject rules on the port
or the peers; ufw and firewalld state is reported as evidence.
"""

from __future__ import annotations

import re
from dataclasses import replace

from torchherd.checks.analysis import frontends, iptables
from torchherd.checks.analysis.common import per_node
from torchherd.checks.analysis.port import port_range
from torchherd.checks.model import Json, NodeFacts, Observed
from torchherd.checks.results import CheckResult
from torchherd.inventory import Host

CHECK = "firewall"


def analyse(observed: Observed) -> list[CheckResult]:
    return per_node(observed, CHECK, _node)


def _tool(facts: NodeFacts, name: str) -> Json | None:
    tools = (facts.get("firewall") or {}).get("tools") or {}
    found = tools.get(name)
    return found if isinstance(found, dict) else None


def packets(observed: Observed, host: Host, facts: NodeFacts) -> list[tuple[str, iptables.Packet]]:
    """(what it is, packet) for every new connection the job opens towards ``host``."""
    own = observed.networks.get(host.name)
    destination = own.address if own else ""
    interface = own.interface if own else None
    ports = port_range(facts)  # once per node: this runs for every pair of nodes
    ephemeral = int(ports.split("-")[0])
    found = []
    for peer in observed.inventory.hosts:
        network = observed.networks.get(peer.name)
        if peer.name == host.name or network is None:
            continue
        if host.name == observed.master.name:
            found.append((f"TCP {observed.port} from {peer.name} ({network.address})",
                          iptables.Packet(network.address, destination, observed.port, interface)))
        found.append((f"TCP {ports} from {peer.name} ({network.address})",
                      iptables.Packet(network.address, destination, ephemeral, interface)))
    return found


def _node(observed: Observed, host: Host, facts: NodeFacts) -> CheckResult:
    rules = _tool(facts, "iptables")
    readable = rules is not None and rules.get("code") == 0
    evidence: list[str] = []
    if readable and rules is not None:
        blocked = _iptables_block(observed, host, facts, str(rules.get("out", "")))
        if blocked is not None:
            return _with_frontends(blocked, _frontends(observed, host, facts))
        evidence.append("iptables")
    nft = _tool(facts, "nft")
    if nft is not None and nft.get("code") == 0:
        blocked = _nft_block(observed, host, str(nft.get("out", "")))
        if blocked is not None:
            return _with_frontends(blocked, _frontends(observed, host, facts))
        evidence.append("nftables")
    evidence += _frontends(observed, host, facts)
    if not evidence:
        return CheckResult(host.name, CHECK, "skip", _unreadable_reason(facts))
    return CheckResult(host.name, CHECK, "pass",
                       f"{', '.join(evidence)}: nothing drops or rejects the job's traffic from the other nodes")


def _iptables_block(observed: Observed, host: Host, facts: NodeFacts, text: str) -> CheckResult | None:
    ruleset = iptables.parse(text)
    # Every peer's packets differ only by their source: with no rule naming a source, one
    # verdict per port holds for every peer (the pairs were O(nodes^2) evaluations a run).
    by_source = any("-s" in rule.options for rules in ruleset.chains.values() for rule in rules)
    verdicts: dict[tuple[object, ...], iptables.Verdict | None] = {}
    for what, packet in packets(observed, host, facts):
        key = (packet.source if by_source else None, packet.destination, packet.port, packet.interface)
        if key not in verdicts:
            verdicts[key] = iptables.evaluate(ruleset, packet)
        verdict = verdicts[key]
        if verdict is None or verdict.action == "ACCEPT":
            continue
        if verdict.rule is None:
            return CheckResult(host.name, CHECK, "fail",
                               f"iptables INPUT policy {verdict.action} on {host.name} drops {what}",
                               f"on {host.name}: iptables -I INPUT -s {packet.source} -j ACCEPT "
                               f"(or accept the nodes' whole subnet)")
        verb = "rejects" if verdict.action == "REJECT" else "drops"
        delete = verdict.rule.replace("-A ", "-D ", 1)
        return CheckResult(host.name, CHECK, "fail",
                           f"iptables rule `{verdict.rule}` on {host.name} {verb} {what}",
                           f"on {host.name}: `iptables {delete}`, or accept the nodes first: "
                           f"`iptables -I INPUT -s {packet.source} -j ACCEPT`")
    return None


def _nft_block(observed: Observed, host: Host, text: str) -> CheckResult | None:
    peers = [network.address for name, network in observed.networks.items() if name != host.name]
    table = ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("table "):
            table = stripped.rstrip("{ ").strip()
        # iptables-nft shows its rules here too; they were evaluated above, in order.
        if table in ("table ip filter", "table ip6 filter") or not re.search(r"\b(drop|reject)\b", stripped):
            continue
        port_hit = host.name == observed.master.name and re.search(rf"dport\s+{observed.port}\b", stripped)
        peer_hit = any(re.search(rf"saddr\s+{re.escape(peer)}\b", stripped) for peer in peers)
        if port_hit or peer_hit:
            return CheckResult(host.name, CHECK, "fail",
                               f"nftables rule `{stripped}` in `{table}` on {host.name} blocks the job's traffic",
                               f"on {host.name}: delete it (`nft -a list ruleset` shows its handle, then "
                               f"`nft delete rule ... handle N`) or accept the nodes' addresses before it")
    return None


def _frontends(observed: Observed, host: Host, facts: NodeFacts) -> list[str]:
    """ufw's and firewalld's own view, with the rules that concern the job (evidence only)."""
    notes = []
    port = observed.port if host.name == observed.master.name else None
    peers = [network.address for name, network in observed.networks.items() if name != host.name]
    ufw = _tool(facts, "ufw")
    if ufw is not None and ufw.get("code") == 0:
        notes.append(frontends.describe_ufw(str(ufw.get("out", "")), port, peers))
    firewalld = _tool(facts, "firewalld")
    if firewalld is not None and firewalld.get("code") == 0:
        notes.append(frontends.describe_firewalld(str(firewalld.get("out", ""))))
    return notes


def _with_frontends(result: CheckResult, notes: list[str]) -> CheckResult:
    return replace(result, summary=f"{result.summary} ({'; '.join(notes)})") if notes else result


def _unreadable_reason(facts: NodeFacts) -> str:
    tools = (facts.get("firewall") or {}).get("tools") or {}
    present = [name for name, result in tools.items() if isinstance(result, dict)]
    if not present:
        return "no iptables, nft, ufw or firewall-cmd on the node; the port probe is the evidence"
    return (f"{', '.join(present)} present but not readable (needs root or sudo); "
            f"the port probe is the evidence")
