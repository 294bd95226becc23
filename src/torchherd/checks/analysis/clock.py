"""``clock``: clock skew between nodes.

Each node's time.time() is bracketed by the controller's clock just before the
facts command was sent and just after it answered, which bounds the node's offset
to the controller; two nodes' skew is at least the gap between their bounds.
"""

from __future__ import annotations

from torchherd.checks.analysis.common import per_node
from torchherd.checks.model import NodeFacts, Observed
from torchherd.checks.results import CheckResult
from torchherd.inventory import Host

CHECK = "clock"
LIMIT = 2.0


def offset_bounds(facts: NodeFacts) -> tuple[float, float]:
    remote = float(facts.get("time"))
    return remote - facts.received, remote - facts.sent


def skew_at_least(first: tuple[float, float], second: tuple[float, float]) -> float:
    return max(0.0, first[0] - second[1], second[0] - first[1])


def analyse(observed: Observed) -> list[CheckResult]:
    return per_node(observed, CHECK, _node)


def _node(observed: Observed, host: Host, facts: NodeFacts) -> CheckResult:
    mine = offset_bounds(facts)
    offset = f"offset to the controller between {mine[0]:+.1f} and {mine[1]:+.1f} s"
    master = observed.facts.get(observed.master.name)
    if master is None or host.name == observed.master.name:
        return CheckResult(host.name, CHECK, "pass", f"{offset} (reference node)")
    skew = skew_at_least(mine, offset_bounds(master))
    if skew > LIMIT:
        return CheckResult(host.name, CHECK, "warn",
                           f"{host.name}'s clock is at least {skew:.1f} s off {observed.master.name}'s",
                           f"synchronise clocks (chrony or systemd-timesyncd) on {host.name}")
    return CheckResult(host.name, CHECK, "pass", f"{offset}; within {LIMIT:g} s of {observed.master.name}")
