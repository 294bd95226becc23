"""What the checks observed, in one value the pure analysis functions read.

The runner fills it over SSH; the analysis modules turn it into CheckResults without
touching the network, so unit tests build an ``Observed`` by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from torchherd.errors import TransportError
from torchherd.inventory import Host, Inventory
from torchherd.plan import NodeNetwork

CHECK_IDS = ("ssh", "ping", "hostname", "port", "firewall", "network", "env", "python", "gpu", "script",
             "clock", "smoke")
"""Every check id, in report column order; ``smoke`` only runs with --smoke."""

Json = Mapping[str, Any]


@dataclass(frozen=True)
class NodeFacts:
    """One node's facts document (remote/facts.py), and how it was obtained."""

    raw: Json
    sent: float
    """Controller time.time() just before the command was sent, and just after the answer came."""
    received: float
    python_error: str = ""
    """Why the configured python did not run, when the facts came from a fallback ``python3``."""

    def get(self, key: str) -> Any:
        return self.raw.get(key)

    def own_addresses(self) -> set[str]:
        found: set[str] = set()
        for interface in self.raw.get("interfaces") or []:
            if isinstance(interface, dict):
                found.update(interface.get("addresses", []))
        return found

    def interface_of(self, address: str) -> Json | None:
        for interface in self.raw.get("interfaces") or []:
            if isinstance(interface, dict) and address in interface.get("addresses", []):
                return interface
        return None


@dataclass
class Observed:
    """Everything gathered for one preflight run."""

    inventory: Inventory
    master_target: str
    """The address the workers are told to reach the master at (a name or an IP)."""
    script: str | None = None
    with_torch: bool = True
    """Whether the facts import torch: seconds of CPU per node, only for the checks that read it."""
    ssh_errors: dict[str, TransportError] = field(default_factory=dict)
    ssh_addresses: dict[str, str] = field(default_factory=dict)
    """The IP the controller's SSH connection reached each node at."""
    facts: dict[str, NodeFacts] = field(default_factory=dict)
    facts_errors: dict[str, str] = field(default_factory=dict)
    networks: dict[str, NodeNetwork] = field(default_factory=dict)
    listened: dict[str, Json] = field(default_factory=dict)
    connected: dict[str, Json] = field(default_factory=dict)
    probe_errors: dict[str, str] = field(default_factory=dict)
    controller_ping: dict[str, str] = field(default_factory=dict)
    """Per node: "ok", "no-reply", or "unavailable: why" (ICMP from the controller)."""
    shell_seconds: dict[str, float] = field(default_factory=dict)
    """Per node: the SSH round trip of a trivial command (session, login shell, exit)."""

    @property
    def master(self) -> Host:
        return self.inventory.hosts[0]

    @property
    def port(self) -> int:
        return self.inventory.cluster.port

    def missing(self, node: str) -> str | None:
        """Why ``node`` has no facts (for a skip), or None when it has them."""
        if node in self.ssh_errors:
            return "no SSH connection (see ssh)"
        if node in self.facts_errors:
            return f"facts not gathered: {self.facts_errors[node]}"
        if node not in self.facts:
            return "facts not gathered"
        return None
