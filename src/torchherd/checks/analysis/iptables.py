"""A small evaluator for ``iptables -S``: which rule decides a new TCP packet.

Only what decides reachability between nodes is modelled (protocol, source,
destination, input interface, destination ports, conntrack state, jumps to user
chains). A rule with a match it does not understand is treated as not matching,
so the evaluator never blames a rule it cannot read; the live probe stays the proof.
"""

from __future__ import annotations

import ipaddress
import shlex
from dataclasses import dataclass, field

TERMINAL = ("ACCEPT", "DROP", "REJECT")
IGNORED_MATCHES = ("tcp", "comment", "multiport", "state", "conntrack")
MODELLED = ("-p", "-s", "-d", "-i", "--dport", "--dports", "--state", "--ctstate")
VALUED = MODELLED + ("-j", "-g", "-m", "--comment", "-o")


@dataclass(frozen=True)
class Packet:
    source: str
    destination: str
    port: int
    interface: str | None


@dataclass(frozen=True)
class Rule:
    text: str
    options: dict[str, tuple[bool, str]]
    """option -> (negated, value)."""
    target: str
    understood: bool


@dataclass
class Ruleset:
    policies: dict[str, str] = field(default_factory=dict)
    chains: dict[str, list[Rule]] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    action: str
    """ACCEPT, DROP or REJECT."""
    rule: str | None
    """The ``-A`` line that decided, or None when the chain policy did."""


def parse(text: str) -> Ruleset:
    ruleset = Ruleset()
    for line in text.splitlines():
        try:
            words = shlex.split(line)
        except ValueError:
            continue
        if len(words) >= 3 and words[0] == "-P":
            ruleset.policies[words[1]] = words[2]
            ruleset.chains.setdefault(words[1], [])
        elif len(words) >= 2 and words[0] == "-N":
            ruleset.chains.setdefault(words[1], [])
        elif len(words) >= 2 and words[0] == "-A":
            ruleset.chains.setdefault(words[1], []).append(_rule(line, words[2:]))
    return ruleset


def _rule(line: str, words: list[str]) -> Rule:
    options: dict[str, tuple[bool, str]] = {}
    target, understood, negate = "", True, False
    queue = list(words)
    while queue:
        word = queue.pop(0)
        if word == "!":
            negate = True
            continue
        value = queue.pop(0) if queue and (not queue[0].startswith("-") or word in VALUED) else ""
        if target:
            continue  # after -j come the target's own options (--reject-with ...)
        if word in ("-j", "-g"):
            target = value
        elif word == "-m":
            understood = understood and value in IGNORED_MATCHES
        elif word in MODELLED:
            options[word] = (negate, value)
        elif word not in ("--comment", "-o"):
            understood = False
        negate = False
    return Rule(line.strip(), options, target, understood)


def _port_matches(spec: str, port: int) -> bool:
    for part in spec.split(","):
        low, sep, high = part.partition(":")
        if not all(side.isascii() and side.isdigit() for side in (low, high) if side) or not (low or high):
            continue
        first = int(low) if low else 0
        last = int(high) if high else (65535 if sep else first)
        if first <= port <= last:
            return True
    return False


def _address_matches(spec: str, address: str) -> bool:
    try:
        return ipaddress.ip_address(address) in ipaddress.ip_network(spec, strict=False)
    except ValueError:
        return False


def _option_matches(option: str, value: str, packet: Packet) -> bool:
    if option == "-p":
        return value in ("tcp", "all", "6")
    if option == "-s":
        return _address_matches(value, packet.source)
    if option == "-d":
        return _address_matches(value, packet.destination)
    if option == "-i":
        return packet.interface is not None and (value == packet.interface or
                                                 (value.endswith("+") and packet.interface.startswith(value[:-1])))
    if option in ("--dport", "--dports"):
        return _port_matches(value, packet.port)
    return "NEW" in value.split(",")


def matches(rule: Rule, packet: Packet) -> bool:
    if not rule.understood:
        return False
    return all(_option_matches(option, value, packet) != negated
               for option, (negated, value) in rule.options.items())


def evaluate(ruleset: Ruleset, packet: Packet, chain: str = "INPUT", depth: int = 0) -> Verdict | None:
    """The verdict of ``chain`` for a new TCP ``packet``; None when a user chain returns."""
    for rule in ruleset.chains.get(chain, []):
        if not matches(rule, packet):
            continue
        if rule.target in TERMINAL:
            return Verdict(rule.target, rule.text)
        if rule.target == "RETURN":
            return None
        if rule.target in ruleset.chains and depth < 8:
            verdict = evaluate(ruleset, packet, rule.target, depth + 1)
            if verdict is not None:
                return verdict
    if chain in ruleset.policies:
        return Verdict(ruleset.policies[chain], None)
    return None
