"""ufw and firewalld, read as evidence for ``firewall``: ``ufw status verbose`` and
``firewall-cmd --list-all`` parsed into the few lines that matter for the job (the
default incoming policy, rules on the master port or naming the peers, the zone's
target, ports, services, sources and rich rules). Their packets are decided by the
iptables/nftables rules they write, which firewall.py evaluates."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

from torchherd.plan import is_ip_address

_UFW_RULE = re.compile(r"^(?P<to>.+?)\s{2,}(?P<action>(?:ALLOW|DENY|REJECT|LIMIT)(?: (?:IN|OUT|FWD))?)\s+(?P<src>.+)$")


@dataclass(frozen=True)
class UfwRule:
    to: str
    action: str
    source: str

    def text(self) -> str:
        return f"{self.to} {self.action} {self.source}"


@dataclass
class Ufw:
    active: bool = False
    default: str = ""
    rules: list[UfwRule] = field(default_factory=list)


def parse_ufw(text: str) -> Ufw:
    state = Ufw()
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("Status:"):
            state.active = stripped.split(":", 1)[1].strip() == "active"
        elif stripped.startswith("Default:"):
            state.default = stripped.split(":", 1)[1].strip()
        elif not stripped.startswith(("To ", "--")):
            match = _UFW_RULE.match(stripped)
            if match:
                state.rules.append(UfwRule(match["to"].strip(), match["action"], match["src"].strip()))
    return state


def _digits(text: str) -> bool:
    """ASCII digits only: ``'²'.isdigit()`` is True, and ``int('²')`` raises."""
    return text.isascii() and text.isdigit()


def _covers_port(spec: str, port: int) -> bool:
    for part in re.split(r"[,\s]", spec.split("/")[0]):
        low, _, high = part.partition(":")
        if _digits(low) and int(low) <= port <= int(high if _digits(high) else low):
            return True
    return False


def _covers_address(spec: str, peers: list[str]) -> bool:
    try:
        network = ipaddress.ip_network(spec.split()[0], strict=False)
    except ValueError:
        return False
    return any(ipaddress.ip_address(peer) in network for peer in peers if is_ip_address(peer))


def relevant_ufw_rules(state: Ufw, port: int | None, peers: list[str]) -> list[UfwRule]:
    """Incoming rules on the master port (``port`` None: any port) or from a peer's address."""
    return [rule for rule in state.rules if "OUT" not in rule.action and (
        (port is not None and _covers_port(rule.to, port)) or _covers_address(rule.source, peers))]


def describe_ufw(text: str, port: int | None, peers: list[str]) -> str:
    state = parse_ufw(text)
    if not state.active:
        return "ufw inactive"
    rules = relevant_ufw_rules(state, port, peers)
    shown = "; ".join(f"`{rule.text()}`" for rule in rules) if rules else "none on the job's port or peers"
    return f"ufw active (default: {state.default or 'unknown'}; rules: {shown})"


@dataclass
class Zone:
    name: str
    active: bool
    settings: dict[str, str] = field(default_factory=dict)
    rich_rules: list[str] = field(default_factory=list)


def parse_firewalld(text: str) -> list[Zone]:
    zones: list[Zone] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not line[0].isspace():
            zones.append(Zone(stripped.split()[0], "active" in stripped))
        elif zones and stripped.startswith("rule "):
            zones[-1].rich_rules.append(stripped)
        elif zones and ":" in stripped:
            key, _, value = stripped.partition(":")
            zones[-1].settings[key.strip()] = value.strip()
    return zones


def describe_firewalld(text: str) -> str:
    parts = []
    for zone in parse_firewalld(text):
        keys = ("target", "interfaces", "sources", "services", "ports")
        shown = [f"{key} {zone.settings[key]}" for key in keys if zone.settings.get(key)]
        shown += [f"rich rule `{rule}`" for rule in zone.rich_rules]
        parts.append(f"zone {zone.name}{' (active)' if zone.active else ''}: " + ", ".join(shown))
    return "firewalld " + ("; ".join(parts) if parts else "running")
