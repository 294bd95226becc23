"""``port``: the master port is free on the master, every worker opens a real TCP
connection to it, and every pair of nodes connects both ways on ephemeral ports
(gloo and NCCL connect all ranks pairwise on random ports)."""

from __future__ import annotations

from torchherd.checks.analysis.common import per_node
from torchherd.checks.model import Json, NodeFacts, Observed
from torchherd.inventory import Host
from torchherd.results import CheckResult

CHECK = "port"
MEANING = {"refused": "connection refused: nothing listening, or a REJECT rule",
           "timeout": "timed out: packets dropped", "unreachable": "no route to host",
           "unresolved": "the name does not resolve"}


def analyse(observed: Observed) -> list[CheckResult]:
    return per_node(observed, CHECK, _node)


def port_range(facts: NodeFacts) -> str:
    words = str(facts.get("port_range") or "").split()
    return f"{words[0]}-{words[1]}" if len(words) == 2 else "32768-60999"


def _node(observed: Observed, host: Host, facts: NodeFacts) -> CheckResult:
    if host.name in observed.probe_errors:
        return CheckResult(host.name, CHECK, "skip", f"not probed: {observed.probe_errors[host.name]}")
    if host.name == observed.master.name:
        taken = _master_taken(observed, facts)
        if taken is not None:
            return taken
    elif _master_port_taken(observed):
        return CheckResult(host.name, CHECK, "skip",
                           f"not probed: port {observed.port} is taken on {observed.master.name} (see there)")
    connected = observed.connected.get(host.name)
    if connected is None:
        return CheckResult(host.name, CHECK, "skip", "not probed: no listener or connector ran")
    failure = _first_failure(observed, host, facts, connected)
    if failure is not None:
        return failure
    return CheckResult(host.name, CHECK, "pass", _pass_summary(observed, host, connected))


def _master_port_taken(observed: Observed) -> bool:
    listened = observed.listened.get(observed.master.name) or {}
    return "master" in (listened.get("errors") or {})


def _master_taken(observed: Observed, facts: NodeFacts) -> CheckResult | None:
    listened = observed.listened.get(observed.master.name) or {}
    error = (listened.get("errors") or {}).get("master")
    if error is None:
        return None
    holders = facts.get("listeners") or []
    holders = holders if isinstance(holders, list) else []
    holder = next((h for h in holders if h.get("pid")), None)
    who = f" by pid {holder['pid']} ({holder['command']})" if holder else ""
    free = facts.get("free_port")
    suggestion = f"set port = {free} in [cluster]" if isinstance(free, int) else "choose another port"
    stop = f"stop it (kill {holder['pid']}) or " if holder else "stop what holds it or "
    return CheckResult(observed.master.name, CHECK, "fail",
                       f"port {observed.port} is already in use on {observed.master.name}{who}: {error}",
                       f"{stop}{suggestion}")


def _first_failure(observed: Observed, host: Host, facts: NodeFacts, connected: Json) -> CheckResult | None:
    for label, outcome in connected.items():
        if label in ("ping", "resolve") or outcome.get("result") == "ok":
            continue
        peer, _, kind = label.partition(":")
        result = str(outcome.get("result"))
        meaning = MEANING.get(result, result)
        address = outcome.get("address") or "?"
        if kind == "master":
            return CheckResult(host.name, CHECK, "fail",
                               f"{host.name} cannot connect to {peer} {address}:{observed.port} ({meaning})",
                               f"open TCP {observed.port} on {peer} to the other nodes (see firewall on "
                               f"{peer}), and check that nothing between them filters it")
        target_port = outcome.get("port", "?")
        return CheckResult(host.name, CHECK, "fail",
                           f"{host.name} cannot connect to {peer} {address}:{target_port}, an ephemeral port "
                           f"({meaning}); gloo/NCCL connect every pair of nodes on random ports",
                           f"allow TCP between all nodes on {port_range(facts)} (ip_local_port_range), "
                           f"e.g. accept everything from the nodes' subnet on {peer}")
    return None


def _pass_summary(observed: Observed, host: Host, connected: Json) -> str:
    peers = sorted({label.partition(":")[0] for label in connected if ":" in label and
                    not label.endswith(":master")})
    pairs = f"; ephemeral ports on {', '.join(peers)} reachable" if peers else ""
    if host.name == observed.master.name:
        return f"port {observed.port} is free; a real listener on it served the workers' probes{pairs}"
    outcome = connected.get(f"{observed.master.name}:master") or {}
    return f"connected to {observed.master.name} {outcome.get('address')}:{observed.port}{pairs}"
