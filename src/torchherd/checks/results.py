"""Result types shared by the layers that produce them and the console that shows them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, get_args

CheckStatus = Literal["pass", "warn", "fail", "skip"]
STATUSES: tuple[CheckStatus, ...] = get_args(CheckStatus)
CLUSTER = "cluster"
"""The ``node`` of a check about the whole set of nodes rather than one of them."""


@dataclass(frozen=True)
class CheckResult:
    node: str
    check: str
    status: CheckStatus
    summary: str
    fix: str = ""

    def __post_init__(self) -> None:
        # The type says it to mypy; a status read from JSON or built from a string must be checked.
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    def as_json(self) -> dict[str, str]:
        return {"node": self.node, "check": self.check, "status": self.status,
                "summary": self.summary, "fix": self.fix}


@dataclass(frozen=True)
class ProbeResult:
    """One real TCP connect of the preflight between two nodes (``check`` draws them as a
    matrix): ``prober`` connected to ``peer``'s ``port``, ``master`` for the master port,
    else one of its ephemeral ports (``e1``, ``e2``)."""

    prober: str
    peer: str
    port: str
    result: str
    """ok, refused, timeout, unreachable, unresolved, or untried (no time was left)."""
    holds: bool
    """Whether a failure is a verdict: retried, or one a retry would not change."""


@dataclass(frozen=True)
class CheckReport:
    results: tuple[CheckResult, ...]
    probes: tuple[ProbeResult, ...] = field(default=(), compare=False)
    """The cross-node connects behind ``port`` (``Cluster.check``); not in ``as_json``."""
    bandwidth: Mapping[str, Any] | None = field(default=None, compare=False)
    """Every figure of ``check --bandwidth`` (links, nodes, MTU probes); None when it did not run."""

    @property
    def ok(self) -> bool:
        return not any(result.status == "fail" for result in self.results)

    def as_json(self) -> dict[str, object]:
        document: dict[str, object] = {"ok": self.ok, "checks": [result.as_json() for result in self.results]}
        if self.bandwidth is not None:
            document["bandwidth"] = dict(self.bandwidth)
        return document
