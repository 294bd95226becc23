"""Helpers shared by the analysis modules."""

from __future__ import annotations

import ipaddress
from typing import Any, Callable

from torchherd.checks.model import NodeFacts, Observed
from torchherd.inventory import Host
from torchherd.results import CheckResult

NodeAnalysis = Callable[[Observed, Host, NodeFacts], CheckResult]


def per_node(observed: Observed, check: str, analyse: NodeAnalysis) -> list[CheckResult]:
    """``analyse`` for every node that has facts; a skip saying why for the others."""
    results = []
    for host in observed.inventory.hosts:
        missing = observed.missing(host.name)
        if missing is not None:
            results.append(CheckResult(host.name, check, "skip", missing))
        else:
            results.append(analyse(observed, host, observed.facts[host.name]))
    return results


def mapping(value: object) -> dict[str, Any]:
    """``value`` when it is a JSON object, else an empty one: a node's facts are read as
    they come, and a field of another shape (an old script, a hostile node) is absent."""
    return value if isinstance(value, dict) else {}


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def resolved(facts: NodeFacts, name: str) -> list[str] | str:
    """The addresses ``name`` resolves to on the node, or the resolver's error text."""
    answer = (facts.get("resolve") or {}).get(name) or {}
    if "addresses" in answer:
        return list(answer["addresses"])
    return str(answer.get("error", "not resolved"))
