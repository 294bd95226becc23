"""Helpers shared by the analysis modules."""

from __future__ import annotations

import ipaddress
from typing import Any, Callable

from torchherd.checks.model import NodeFacts, Observed
from torchherd.checks.results import CheckResult
from torchherd.inventory import Host

NodeAnalysis = Callable[[Observed, Host, NodeFacts], CheckResult]


MALFORMED = (AttributeError, TypeError, ValueError, IndexError, KeyError, OverflowError)
"""What reading a facts document of the wrong shape raises (a list where an object is
expected, a number no float holds, ``int('²')``)."""


def per_node(observed: Observed, check: str, analyse: NodeAnalysis) -> list[CheckResult]:
    """``analyse`` for every node that has facts; a skip saying why for the others; a
    node whose facts are not of the shape facts.py writes fails this check (``malformed``)."""
    results = []
    for host in observed.inventory.hosts:
        missing = observed.missing(host.name)
        if missing is not None:
            results.append(CheckResult(host.name, check, "skip", missing))
            continue
        try:
            results.append(analyse(observed, host, observed.facts[host.name]))
        except MALFORMED as error:
            results.append(malformed(host.name, check, error))
    return results


def mapping(value: object) -> dict[str, Any]:
    """``value`` when it is a JSON object, else an empty one: a node's facts are read as
    they come, and a field of another shape (an old script, a hostile node) is absent."""
    return value if isinstance(value, dict) else {}


def malformed(node: str, check: str, error: Exception) -> CheckResult:
    """The failed check of a node whose answer could not be read: what went wrong, cut short."""
    return CheckResult(node, check, "fail",
                       f"{node}: its answer to the {check} check is malformed ({type(error).__name__}: "
                       f"{str(error)[:200]})",
                       "the node answered what its facts script never writes: look at what runs there as the "
                       "configured python (a wrapper, or something standing in for it)")


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
