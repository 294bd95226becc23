"""``hostname``: the node's own name resolves to an address peers can reach, and the
master's name resolves on every node to the master's real address.

gloo binds the first bindable getaddrinfo(gethostname()) result, loopback included,
and then tells the peers that address: a 127.0.1.1 line in /etc/hosts hangs the job.
"""

from __future__ import annotations

import functools
import ipaddress

from torchherd.checks.analysis.common import is_loopback, one_machine, per_node, resolved
from torchherd.checks.model import NodeFacts, Observed
from torchherd.checks.results import CheckResult
from torchherd.inventory import Host
from torchherd.plan import is_ip_address as is_ip

CHECK = "hostname"


def analyse(observed: Observed) -> list[CheckResult]:
    return per_node(observed, CHECK, _node)


def _node(observed: Observed, host: Host, facts: NodeFacts) -> CheckResult:
    for problem in (_own_name, _master_name, _master_fqdn, _peers_on_master):
        result = problem(observed, host, facts)
        if result is not None:
            return result
    name = facts.get("hostname")
    own = (facts.get("gloo") or {}).get("address")
    master_part = ""
    if not is_ip(observed.master_target) and host.name != observed.master.name:
        master_part = f"; {observed.master_target} -> {', '.join(resolved(facts, observed.master_target))}"
    if host.name == observed.master.name and _answers_on_master(observed):
        master_part = "; every node's hostname resolves here to that node"
    summary = f"{name} -> {own} (an address of this node){master_part}"
    if isinstance(own, str) and is_loopback(own):
        summary = f"{name} -> {own} (loopback: {ONE_MACHINE})"
    mapped = mapped_lines(observed, host, facts)
    if not mapped:
        return CheckResult(host.name, CHECK, "pass", summary)
    # A note on a pass, never a warning: DNS may still answer these (it maps them to in-addr.arpa).
    return CheckResult(host.name, CHECK, "pass", f"{summary}; {C10D_NOTE}",
                       f"to silence it, add to /etc/hosts on {host.name}: "
                       + "; ".join(f"`{line}`" for line in mapped))


ONE_MACHINE = "fine on one machine, where no other node needs to reach it"

C10D_NOTE = ("torch's c10d may log 'The hostname of the client socket cannot be retrieved. err=-3' (harmless): "
             "its store listens on IPv6, sees peers as ::ffff:a.b.c.d, and /etc/hosts names them only as IPv4")


def mapped_lines(observed: Observed, host: Host, facts: NodeFacts) -> list[str]:
    """The ``::ffff:a.b.c.d name`` lines this node's /etc/hosts lacks for the addresses
    c10d looks up there (its own and the master's; on the master every node's): glibc's
    files backend answers a reverse lookup of an IPv4-mapped address only from such a
    line. Only for addresses /etc/hosts names as IPv4: where it does not, DNS decides."""
    names, mapped = _hosts_addresses(str(facts.get("etc_hosts") or ""))
    peers = observed.inventory.hosts if host.name == observed.master.name else (host, observed.master)
    wanted = [network.address for peer in peers if (network := observed.networks.get(peer.name)) is not None]
    return [f"::ffff:{address} {' '.join(names[address])}" for address in dict.fromkeys(wanted)
            if address in names and address not in mapped]


@functools.lru_cache(maxsize=8)
def _hosts_addresses(text: str) -> tuple[dict[str, list[str]], frozenset[str]]:
    """/etc/hosts's IPv4 addresses (each with its names) and the IPv4 addresses it names
    as ``::ffff:`` ones. Cached by the file's text: nodes mostly share one /etc/hosts, and
    parsing every line's address cost ~20 ms per node against one of a few thousand lines
    (the callers only read the result)."""
    names: dict[str, list[str]] = {}
    mapped: set[str] = set()
    for line in text.splitlines():
        words = line.split("#")[0].split()
        try:
            address = ipaddress.ip_address(words[0]) if len(words) > 1 else None
        except ValueError:
            continue
        if isinstance(address, ipaddress.IPv4Address):
            names.setdefault(str(address), words[1:])
        elif isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            mapped.add(str(address.ipv4_mapped))
    return names, frozenset(mapped)


def hosts_lines_for(facts: NodeFacts, name: str) -> list[str]:
    lines = []
    for line in str(facts.get("etc_hosts") or "").splitlines():
        words = line.split("#")[0].split()
        if len(words) > 1 and name in words[1:]:
            lines.append(" ".join(words))
    return lines


def _suggested_line(observed: Observed, host: Host, facts: NodeFacts) -> str:
    network = observed.networks.get(host.name)
    address = network.address if network else "<this node's LAN address>"
    name = str(facts.get("hostname"))
    fqdn = facts.get("fqdn")
    names = f"{fqdn} {name}" if isinstance(fqdn, str) and fqdn != name and "." in fqdn else name
    return f"{address} {names}"


def _own_name(observed: Observed, host: Host, facts: NodeFacts) -> CheckResult | None:
    name = str(facts.get("hostname"))
    gloo = facts.get("gloo") or {}
    line = _suggested_line(observed, host, facts)
    if "error" in gloo:
        return CheckResult(host.name, CHECK, "fail",
                           f"{host.name}: its hostname {name} does not resolve ({gloo['error']})",
                           f"add this line to /etc/hosts on {host.name}: {line}")
    address = str(gloo.get("address"))
    if is_loopback(address) and one_machine(observed):
        return None  # gloo listens on loopback, where every rank of this machine reaches it
    if is_loopback(address):
        culprits = [entry for entry in hosts_lines_for(facts, name) if is_loopback(entry.split()[0])]
        where = f" (/etc/hosts: `{culprits[0]}`)" if culprits else ""
        drop = f"remove `{culprits[0]}` and " if culprits else ""
        return CheckResult(host.name, CHECK, "fail",
                           f"{host.name}: hostname {name} resolves to loopback {address}{where}; gloo would "
                           f"listen there and the other nodes could not reach it",
                           f"in /etc/hosts on {host.name}, {drop}write: {line} (a plain torchrun hangs on it; "
                           "torchherd run pins the address and interface, and runs with --skip hostname)")
    if address not in facts.own_addresses():
        return CheckResult(host.name, CHECK, "fail",
                           f"{host.name}: hostname {name} resolves to {address}, not an address of this node",
                           f"fix DNS or /etc/hosts on {host.name}: {line}")
    return None


def _master_name(observed: Observed, host: Host, facts: NodeFacts) -> CheckResult | None:
    target = observed.master_target
    if is_ip(target) or host.name == observed.master.name:
        return None
    answer = resolved(facts, target)
    master_facts = observed.facts.get(observed.master.name)
    master_ip = observed.networks.get(observed.master.name)
    line = f"{master_ip.address if master_ip else '<master address>'} {target}"
    alias_of = _alias_hostname(observed, target)
    if isinstance(answer, str) and alias_of is not None:
        return CheckResult(host.name, CHECK, "fail",
                           f"{host.name} cannot resolve the master's name {target} ({answer}): it is an ssh_config "
                           f"alias, which only the controller knows",
                           f"give its HostName instead: master_addr = \"{alias_of}\" in [cluster] "
                           f"(or --master-addr {alias_of}), or leave master_addr out")
    if isinstance(answer, str):
        return CheckResult(host.name, CHECK, "fail",
                           f"{host.name} cannot resolve the master's name {target} ({answer})",
                           f"add this line to /etc/hosts on {host.name}: {line} (or set master_addr "
                           f"in [cluster] to an IP)")
    if master_facts is not None and not set(answer) & master_facts.own_addresses():
        return CheckResult(host.name, CHECK, "fail",
                           f"{host.name} resolves the master's name {target} to {', '.join(answer)}, "
                           f"which is not an address of {observed.master.name}",
                           f"fix DNS or /etc/hosts on {host.name}: {line}")
    return None


def _alias_hostname(observed: Observed, target: str) -> str | None:
    """The HostName when ``target`` is a host's ssh_config alias (the controller's name
    for it) and not also the master's own host name, which /etc/hosts may well give."""
    master = observed.facts.get(observed.master.name)
    if master is not None and target.lower() in (str(master.get("hostname")).lower(), str(master.get("fqdn")).lower()):
        return None
    for host in observed.inventory.hosts:
        hostname = observed.ssh_hostnames.get(host.name)
        if hostname is not None and host.address.lower() == target.lower():
            return hostname
    return None


def _master_fqdn(observed: Observed, host: Host, facts: NodeFacts) -> CheckResult | None:
    # c10d publishes the master's FQDN unless --local-addr is given: a warning, not a hang with torchherd.
    if host.name == observed.master.name:
        return None
    answers = (observed.connected.get(host.name) or {}).get("resolve") or {}
    for name, answer in answers.items():
        if "error" in answer:
            return CheckResult(host.name, CHECK, "warn",
                               f"{host.name} cannot resolve {name} ({answer['error']}); a c10d rendezvous "
                               f"without --local-addr would publish that name",
                               f"add `<address> {name}` to /etc/hosts on {host.name}, or keep torchherd's "
                               f"--local-addr")
    return None


def _answers_on_master(observed: Observed) -> dict[str, object]:
    return dict((observed.connected.get(observed.master.name) or {}).get("resolve") or {})


def _peers_on_master(observed: Observed, host: Host, facts: NodeFacts) -> CheckResult | None:
    """On the master: every other node's hostname resolves there, to one of that node's
    addresses (on one machine, every node is the master's machine)."""
    if host.name != observed.master.name or one_machine(observed):
        return None
    answers = _answers_on_master(observed)
    problems: list[str] = []
    lines: list[str] = []
    for peer in observed.inventory.hosts:
        problem = _peer_problem(observed, peer, answers)
        if problem is not None:
            problems.append(problem[0])
            lines.append(problem[1])
    if not problems:
        return None
    return CheckResult(host.name, CHECK, "fail", f"{host.name} (the master): " + "; ".join(problems),
                       f"add to /etc/hosts on {host.name}: " + "; ".join(f"`{line}`" for line in lines)
                       + " (or fix DNS)")


def _peer_problem(observed: Observed, peer: Host, answers: dict[str, object]) -> tuple[str, str] | None:
    peer_facts = observed.facts.get(peer.name)
    name = str(peer_facts.get("hostname")) if peer_facts is not None else ""
    answer = answers.get(name)
    if peer.name == observed.master.name or peer_facts is None or not isinstance(answer, dict):
        return None
    network = observed.networks.get(peer.name)
    line = f"{network.address if network else '<' + peer.name + ' address>'} {name}"
    if "error" in answer:
        return f"cannot resolve {peer.name}'s hostname {name} ({answer['error']})", line
    addresses = [str(address) for address in answer.get("addresses") or []]
    if not set(addresses) & peer_facts.own_addresses():
        return (f"resolves {peer.name}'s hostname {name} to {', '.join(addresses)}, not an address of "
                f"{peer.name}"), line
    return None
