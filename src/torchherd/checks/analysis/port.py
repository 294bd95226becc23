"""``port``: the master port is free on the master, every worker opens a real TCP
connection to it, and the nodes connect to each other's ephemeral ports (gloo and NCCL
connect all ranks pairwise on random ports) as the probe plan says.

Verdicts hold: a probe fails only when its last attempt failed and it was tried again,
or failed in a way a retry would not change (refused, unreachable). A single timeout is
never a failure. A node whose ephemeral ports failed from two or more probers is where
the fault is: the fail is reported there, and its probers pass, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torchherd.checks.analysis.common import per_node
from torchherd.checks.model import Json, NodeFacts, Observed
from torchherd.checks.results import CheckResult
from torchherd.inventory import Host

CHECK = "port"
MEANING = {"refused": "connection refused: nothing listening, or a REJECT rule",
           "timeout": "timed out: packets dropped", "unreachable": "no route to host",
           "unresolved": "the name does not resolve"}
WORD = {"refused": "refused", "timeout": "timed out", "unreachable": "unreachable", "unresolved": "unresolved"}
NAMED = 6
"""Peers named in a summary; beyond, a count."""

Verdict = Literal["ok", "fail", "unsure"]


@dataclass(frozen=True)
class Probe:
    """One target of one node's connect request."""

    prober: str
    peer: str
    kind: str
    """``master`` for the master port, else the ephemeral port's label."""
    outcome: Json

    @property
    def verdict(self) -> Verdict:
        return verdict(self.outcome)


def analyse(observed: Observed) -> list[CheckResult]:
    unreachable = unreachable_peers(observed)
    return per_node(observed, CHECK, lambda seen, host, facts: _node(seen, host, facts, unreachable))


def verdict(outcome: Json) -> Verdict:
    """ok; fail when the failure holds (tried again, or refused/unreachable/unresolved);
    unsure for one timeout alone, or a target the node had no time left to try."""
    result = outcome.get("result")
    if result == "ok":
        return "ok"
    if result == "untried" or (result == "timeout" and len(_attempts(outcome)) < 2):
        return "unsure"
    return "fail"


def meaning(outcome: Json) -> str:
    """What the last attempt's result means, and what every attempt said."""
    result = str(outcome.get("result"))
    history = _history(_attempts(outcome))
    text = MEANING.get(result, result)
    return f"{text}; {history}" if history else text


def _attempts(outcome: Json) -> list[Json]:
    attempts = outcome.get("attempts")
    if not isinstance(attempts, list):
        return [outcome]  # a bare outcome: one attempt
    return [attempt for attempt in attempts if isinstance(attempt, dict)]


def _history(attempts: list[Json]) -> str:
    if len(attempts) < 2:
        return ""
    results = [str(attempt.get("result")) for attempt in attempts]
    if len(set(results)) > 1:
        return ", then ".join(WORD.get(result, result) for result in results)
    times = {2: "twice", 3: "three times"}.get(len(results), f"{len(results)} times")
    said = f"{WORD.get(results[0], results[0])} {times}"
    if results[0] == "timeout" and all(isinstance(attempt.get("timeout"), (int, float)) for attempt in attempts):
        waits = [f"{float(attempt['timeout']):g} s" for attempt in attempts]
        said += f": {waits[0]} in the burst, then {', '.join(waits[1:])} alone"
    return said


def probes_of(observed: Observed, node: str) -> list[Probe]:
    found = []
    for label, outcome in (observed.connected.get(node) or {}).items():
        peer, colon, kind = label.partition(":")
        if colon and isinstance(outcome, dict):
            found.append(Probe(node, peer, kind, outcome))
    return found


def unreachable_peers(observed: Observed) -> dict[str, list[Probe]]:
    """Per node whose ephemeral ports failed (verdicts that hold) from two or more
    probers, and from more of its probers than reached it: one failed probe per prober.
    One prober alone may be the broken one; so may a few, when most others get through
    (a node that drops the replies to its own connects fails them towards everyone)."""
    failed: dict[str, dict[str, Probe]] = {}
    reached: dict[str, set[str]] = {}
    for prober in observed.connected:
        for probe in probes_of(observed, prober):
            if probe.kind != "master" and probe.verdict == "fail":
                failed.setdefault(probe.peer, {}).setdefault(prober, probe)
            elif probe.kind != "master" and probe.verdict == "ok":
                reached.setdefault(probe.peer, set()).add(prober)
    return {peer: list(by_prober.values()) for peer, by_prober in failed.items()
            if len(by_prober) >= 2 and len(by_prober) > len(reached.get(peer, set()) - set(by_prober))}


def port_range(facts: NodeFacts) -> str:
    words = str(facts.get("port_range") or "").split()
    return f"{words[0]}-{words[1]}" if len(words) == 2 else "32768-60999"


def _node(observed: Observed, host: Host, facts: NodeFacts, unreachable: dict[str, list[Probe]]) -> CheckResult:
    if host.name in observed.probe_errors:
        return CheckResult(host.name, CHECK, "skip", f"not probed: {observed.probe_errors[host.name]}")
    if host.name == observed.master.name:
        taken = _master_taken(observed, facts)
        if taken is not None:
            return taken
    elif _master_port_taken(observed):
        return CheckResult(host.name, CHECK, "skip",
                           f"not probed: port {observed.port} is taken on {observed.master.name} (see there)")
    if host.name not in observed.connected:
        return CheckResult(host.name, CHECK, "skip", "not probed: no listener or connector ran")
    own = probes_of(observed, host.name)
    if host.name in unreachable:
        return _unreachable(host, facts, unreachable[host.name], own)
    # Probes of a node found unreachable are reported there, not on every prober.
    relevant = [probe for probe in own if probe.kind == "master" or probe.peer not in unreachable]
    failure = _first_failure(observed, host, facts, relevant)
    if failure is not None:
        return failure
    unsure = [probe for probe in relevant if probe.verdict == "unsure"]
    if unsure:
        return _unsure(host, unsure)
    return CheckResult(host.name, CHECK, "pass", _pass_summary(observed, host, own, unreachable))


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
    suggestion = (f"set port = {free} in [cluster] (or --master-port {free})" if isinstance(free, int)
                  else "choose another port ([cluster].port, or --master-port)")
    stop = f"stop it (kill {holder['pid']}) or " if holder else "stop what holds it or "
    return CheckResult(observed.master.name, CHECK, "fail",
                       f"port {observed.port} is already in use on {observed.master.name}{who}: {error}",
                       f"{stop}{suggestion}")


def _unreachable(host: Host, facts: NodeFacts, failed: list[Probe], own: list[Probe]) -> CheckResult:
    probers = [probe.prober for probe in failed]
    own_failed = [probe for probe in own if probe.verdict == "fail"]
    also = f"; {len(own_failed)} of its own {len(own)} connects failed too" if own_failed else ""
    ports = port_range(facts)
    return CheckResult(host.name, CHECK, "fail",
                       f"{host.name}'s ephemeral ports ({ports}) are unreachable from {_names(probers)} "
                       f"({meaning(failed[0].outcome)}){also}; gloo/NCCL connect every pair of nodes on random ports",
                       f"on {host.name}, allow TCP from the other nodes on {ports} (ip_local_port_range; the "
                       f"replies to {host.name}'s own connections arrive there too), e.g. accept everything from "
                       f"the nodes' subnet (see firewall on {host.name})")


def _first_failure(observed: Observed, host: Host, facts: NodeFacts, probes: list[Probe]) -> CheckResult | None:
    for probe in probes:
        if probe.verdict != "fail":
            continue
        # A name that did not resolve has no address: the master's is the one the probe was given.
        address = probe.outcome.get("address") or (observed.master_target if probe.kind == "master" else "?")
        if probe.kind == "master":
            fix = (f"{host.name} cannot resolve {address}: see hostname on {host.name}"
                   if probe.outcome.get("result") == "unresolved" else _master_fix(observed, probe.peer, address))
            return CheckResult(host.name, CHECK, "fail",
                               f"{host.name} cannot connect to {probe.peer} {address}:{observed.port} "
                               f"({meaning(probe.outcome)})", fix)
        return CheckResult(host.name, CHECK, "fail",
                           f"{host.name} cannot connect to {probe.peer} {address}:{probe.outcome.get('port', '?')}, "
                           f"an ephemeral port ({meaning(probe.outcome)}); gloo/NCCL connect every pair of nodes "
                           f"on random ports",
                           f"allow TCP between all nodes on {port_range(facts)} (ip_local_port_range), "
                           f"e.g. accept everything from the nodes' subnet on {probe.peer}")
    return None


def _master_fix(observed: Observed, master: str, address: str) -> str:
    facts = observed.facts.get(master)
    own = sorted(facts.own_addresses()) if facts is not None else []
    if observed.master_given is not None and own and address not in own:
        # The user's address is not the master's own: the usual cause is a typo or a
        # stale address, not a firewall (a NAT that forwards it would have connected).
        return (f"{address} (from {observed.master_given}) is not an address of {master} "
                f"(it has {', '.join(own)}): give one of those, or leave it out and torchherd finds it")
    return (f"open TCP {observed.port} on {master} to the other nodes (see firewall on {master}), "
            f"and check that nothing between them filters it")


def _unsure(host: Host, unsure: list[Probe]) -> CheckResult:
    first = unsure[0]
    target = f"{first.peer} {first.outcome.get('address') or '?'}:{first.outcome.get('port', '?')}"
    what = ("not tried: no time left" if first.outcome.get("result") == "untried"
            else "timed out once, no time left to try again")
    return CheckResult(host.name, CHECK, "warn",
                       f"{host.name}: {len(unsure)} probe(s) not concluded in time (first: {target}, {what}); "
                       f"no failure held",
                       "run the check again; a node this slow to probe is likely overloaded")


def _pass_summary(observed: Observed, host: Host, own: list[Probe], unreachable: dict[str, list[Probe]]) -> str:
    peers = list(dict.fromkeys(probe.peer for probe in own if probe.kind != "master"))
    reachable = [peer for peer in peers if peer not in unreachable]
    excused = [peer for peer in peers if peer in unreachable]
    pairs = f"; ephemeral ports on {_names(reachable)} reachable" if reachable else ""
    if excused:
        pairs += f", not on {_names(excused)} (see there)"
    retried = sum(1 for probe in own if probe.verdict == "ok" and len(_attempts(probe.outcome)) > 1)
    pairs += f"; {retried} connect(s) went through only on the second try" if retried else ""
    if host.name == observed.master.name and len(observed.inventory.hosts) == 1:  # no worker, no probe plan
        return f"port {observed.port} is free: a real listener took it (one node: no worker to probe it)"
    if host.name == observed.master.name:
        plan = f"; probe plan: {observed.probe_plan.describe()}" if observed.probe_plan is not None else ""
        return f"port {observed.port} is free; a real listener on it served the workers' probes{pairs}{plan}"
    outcome = next((probe.outcome for probe in own if probe.kind == "master"), {})
    return f"connected to {observed.master.name} {outcome.get('address')}:{observed.port}{pairs}"


def _names(nodes: list[str]) -> str:
    if len(nodes) <= NAMED:
        return ", ".join(nodes)
    return f"{', '.join(nodes[:NAMED - 1])} and {len(nodes) - NAMED + 1} more"
