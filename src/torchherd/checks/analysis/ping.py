"""``ping``: ICMP from the controller to each node and from each node to the master.

ICMP alone being blocked is a warning: the job only needs TCP, which ssh and the
port probe prove separately.
"""

from __future__ import annotations

from torchherd.checks.analysis.common import per_node
from torchherd.checks.model import NodeFacts, Observed
from torchherd.checks.results import CheckResult
from torchherd.inventory import Host

CHECK = "ping"


def analyse(observed: Observed) -> list[CheckResult]:
    return per_node(observed, CHECK, _node)


def _node(observed: Observed, host: Host, facts: NodeFacts) -> CheckResult:
    parts: list[str] = []
    silent: list[str] = []
    unknown: list[str] = []
    controller = observed.controller_ping.get(host.name, "unavailable: not tried")
    _sort("controller -> node", controller, parts, silent, unknown)
    if host.name != observed.master.name:
        probe = (observed.connected.get(host.name) or {}).get("ping") or {}
        result = str(probe.get("result", "unavailable: not tried"))
        result = "unavailable: no ping on the node" if result == "no-ping" else result
        _sort(f"node -> {observed.master.name}", result, parts, silent, unknown)
    if silent:
        return CheckResult(host.name, CHECK, "warn",
                           f"no ICMP echo reply for {', '.join(silent)} (TCP is checked by ssh and port)",
                           "allow ICMP echo between the nodes if you want ping to diagnose them; the job "
                           "itself needs only TCP")
    if not parts:
        return CheckResult(host.name, CHECK, "skip", "; ".join(unknown))
    summary = f"echo reply for {', '.join(parts)}" + (f"; {'; '.join(unknown)}" if unknown else "")
    return CheckResult(host.name, CHECK, "pass", summary)


def _sort(what: str, result: str, parts: list[str], silent: list[str], unknown: list[str]) -> None:
    if result == "ok":
        parts.append(what)
    elif result.startswith("unavailable"):
        unknown.append(f"{what} {result}")
    else:
        silent.append(what)
