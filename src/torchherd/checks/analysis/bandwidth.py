"""``bandwidth`` and ``mtu``: what the measured links say, node by node.

A link's figure is the best of its measurements (the burst's, and the one measured again
alone when the burst's was slow): a slow figure must hold when nothing else competes.
A slow link is one below the floor (``--min-bandwidth``: fail) or below ``slow_ratio`` of
the cluster's median (warn), measured alone, and not limited by a busy CPU at either end
(then it says little about the link). The node common to several slow links is named,
once, instead of both ends of every slow pair; a slow link no other explains is named
as the pair it is.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any, Literal, Mapping, Sequence

from torchherd.checks.model import MtuProbe, Observed, Transfer
from torchherd.checks.results import CLUSTER, CheckResult, CheckStatus

CHECK = "bandwidth"
MTU_CHECK = "mtu"
Link = tuple[str, str]
Level = Literal["warn", "fail"]


def best_transfers(observed: Observed) -> dict[Link, Transfer]:
    """Per measured link, its fastest transfer (one that failed only when none worked)."""
    best: dict[Link, Transfer] = {}
    for transfer in observed.transfers:
        known = best.get(transfer.link)
        if known is None or (transfer.bits_per_second or -1.0) > (known.bits_per_second or -1.0):
            best[transfer.link] = transfer
    return best


def median_bps(best: Mapping[Link, Transfer]) -> float | None:
    """The cluster's figure: the median of the nodes' own (each node's slower way, at its
    best). Not the links' median: in a ring of four, half the links touch one slow node."""
    figures = [min(rate["in"], rate["out"]) for rate in node_rates(best).values()
               if rate["in"] is not None and rate["out"] is not None]
    return statistics.median(figures) if figures else None


def limit_bps(observed: Observed, median: float | None) -> float:
    """Below this a link is slow: the floor, or the share of the median, whichever is higher."""
    return max(observed.min_bandwidth or 0.0, observed.slow_ratio * (median or 0.0))


def candidates(observed: Observed) -> list[Link]:
    """The links to measure again alone: slow or failed in the burst, not yet measured alone."""
    best = best_transfers(observed)
    limit = limit_bps(observed, median_bps(best))
    alone = {transfer.link for transfer in observed.transfers if transfer.alone}
    return [link for link, transfer in best.items()
            if link not in alone and (transfer.bits_per_second or 0.0) < limit]


def _level(observed: Observed, transfer: Transfer) -> Level:
    floor = observed.min_bandwidth
    failed = transfer.bits_per_second is None or (floor is not None and transfer.bits_per_second < floor)
    return "fail" if failed else "warn"


def slow_links(observed: Observed) -> dict[Link, Level]:
    """The links that are slow by a verdict that holds: slow at their best, measured again
    alone, and not limited by a busy CPU."""
    best = best_transfers(observed)
    limit = limit_bps(observed, median_bps(best))
    alone = {transfer.link for transfer in observed.transfers if transfer.alone}
    return {link: _level(observed, transfer) for link, transfer in best.items()
            if link in alone and not transfer.cpu_bound and (transfer.bits_per_second or 0.0) < limit}


def common_nodes(links: Sequence[Link], order: Mapping[str, int]) -> tuple[list[str], list[Link]]:
    """The nodes that explain the links (each common to at least two of those not yet
    explained, the one with the most first), and the links no such node explains."""
    left = list(links)
    named: list[str] = []
    total = Counter(node for link in links for node in link)
    while left:
        counts = Counter(node for link in left for node in link)
        node, count = min(counts.items(), key=lambda item: (-item[1], -total[item[0]], order.get(item[0], 0)))
        if count < 2:
            break
        named.append(node)
        left = [link for link in left if node not in link]
    return named, left


def node_rates(best: Mapping[Link, Transfer]) -> dict[str, dict[str, float | None]]:
    """Per node, its best outgoing and incoming figure (bits per second)."""
    rates: dict[str, dict[str, float | None]] = {}
    for (sender, receiver), transfer in best.items():
        for node, way in ((sender, "out"), (receiver, "in")):
            entry = rates.setdefault(node, {"in": None, "out": None})
            figure = transfer.bits_per_second
            if figure is not None and (entry[way] is None or figure > (entry[way] or 0.0)):
                entry[way] = figure
    return rates


def gbit(bits: float | None) -> str:
    if bits is None:
        return "none"
    value = bits / 1e9
    return f"{value:.3g} Gbit/s" if value >= 0.1 else f"{bits / 1e6:.3g} Mbit/s"


def _peers(node: str, links: Sequence[Link]) -> list[str]:
    return list(dict.fromkeys(other for link in links if node in link for other in link if other != node))


def analyse(observed: Observed) -> list[CheckResult]:
    if observed.link_plan is None or not observed.transfers:
        why = "; ".join(sorted(set(observed.bandwidth_errors.values()))) or "fewer than two nodes to measure"
        return [CheckResult(host.name, CHECK, "skip", f"not measured: {why}") for host in observed.inventory.hosts]
    best = best_transfers(observed)
    median = median_bps(best)
    slow = slow_links(observed)
    order = {host.name: index for index, host in enumerate(observed.inventory.hosts)}
    named, pairs = common_nodes(sorted(slow, key=lambda link: (order.get(link[0], 0), order.get(link[1], 0))), order)
    rates = node_rates(best)
    results: list[CheckResult] = []
    for host in observed.inventory.hosts:
        name = host.name
        if name in named:
            results.append(_slow_node(observed, name, slow, rates, median))
        elif name in observed.bandwidth_errors:
            results.append(CheckResult(name, CHECK, "skip", f"not measured: {observed.bandwidth_errors[name]}"))
        elif name not in rates:
            holes = any(probe.black_hole and name in (probe.first, probe.second)
                        for probe in observed.mtu_probes.values())
            why = "its links lose full-size packets (see mtu)" if holes else "no link of the plan reached it"
            results.append(CheckResult(name, CHECK, "skip", f"not measured: {why}"))
        else:
            results.append(_node_pass(name, rates[name], best))
        for link in pairs:
            if link[0] == name:
                results.append(_slow_pair(observed, link, slow[link], best[link], rates, median))
    results.append(_cluster(observed, best, median))
    return results


def _slow_node(observed: Observed, name: str, slow: Mapping[Link, Level], rates: Mapping[str, Mapping[str, float | None]],
               median: float | None) -> CheckResult:
    mine = [link for link in slow if name in link]
    status: CheckStatus = "fail" if any(slow[link] == "fail" for link in mine) else "warn"
    rate = rates.get(name, {})
    ways = [way for way, links in (("from", [link for link in mine if link[1] == name]),
                                   ("to", [link for link in mine if link[0] == name])) if links]
    against = _against(observed, status, median)
    summary = (f"{name} is slow: {len(mine)} of its links are {against} (best in {gbit(rate.get('in'))}, "
               f"out {gbit(rate.get('out'))}; {' and '.join(ways)} {', '.join(_peers(name, mine))}; "
               f"measured again alone)")
    fix = (f"look at {name}'s network interface: its speed and duplex (ethtool IFACE), errors "
           f"(ip -s link show IFACE), a rate limit (tc qdisc show dev IFACE), its cable and switch port, "
           f"and that the job's address on {name} is on the fast network")
    return CheckResult(name, CHECK, status, summary, fix)


def _against(observed: Observed, level: CheckStatus, median: float | None) -> str:
    """What a slow link fell short of: the floor (a fail) or the share of the median (a warn)."""
    if level == "fail":
        return f"below the floor of {gbit(observed.min_bandwidth)}"
    return f"under {observed.slow_ratio:.0%} of the cluster's median {gbit(median)}"


def _slow_pair(observed: Observed, link: Link, level: Level, transfer: Transfer,
               rates: Mapping[str, Mapping[str, float | None]], median: float | None) -> CheckResult:
    sender, receiver = link
    if transfer.bits_per_second is None:
        summary = f"{sender} could not send to {receiver}: {transfer.error} (measured again alone)"
        return CheckResult(sender, CHECK, "fail", summary,
                           f"let {sender} open TCP connections to {receiver} (see the port and firewall checks)")
    against = _against(observed, level, median)
    summary = (f"{sender} -> {receiver}: {gbit(transfer.bits_per_second)}, {against}, measured again alone "
               f"({sender} sends at {gbit(rates.get(sender, {}).get('out'))} at best, {receiver} receives at "
               f"{gbit(rates.get(receiver, {}).get('in'))})")
    fix = (f"look at the path from {sender} to {receiver}: a route through another network "
           f"(ip route get <{receiver}'s address> on {sender}), a bad cable or switch port, a rate limit")
    return CheckResult(sender, CHECK, level, summary, fix)


def _node_pass(name: str, rate: Mapping[str, float | None], best: Mapping[Link, Transfer]) -> CheckResult:
    mine = [transfer for link, transfer in best.items() if name in link]
    lower_bound = any(transfer.cpu_bound for transfer in mine)
    note = " (the CPU limited some transfers: the links may be faster)" if lower_bound else ""
    return CheckResult(name, CHECK, "pass",
                       f"best in {gbit(rate.get('in'))}, out {gbit(rate.get('out'))} over {len(mine)} links{note}")


def _cluster(observed: Observed, best: Mapping[Link, Transfer], median: float | None) -> CheckResult:
    assert observed.link_plan is not None
    again = len({transfer.link for transfer in observed.transfers if transfer.alone})
    floor = f", floor {gbit(observed.min_bandwidth)}" if observed.min_bandwidth else ""
    summary = (f"median {gbit(median)} over {len(best)} links ({observed.link_plan.describe()}); "
               f"{again} measured again alone{floor}")
    return CheckResult(CLUSTER, CHECK, "pass", summary)


# the path MTU ------------------------------------------------------------------------


def _mtu_words(probe: MtuProbe) -> str:
    ways = []
    if probe.out is not True:
        ways.append(f"{probe.first} -> {probe.second}")
    if probe.back is not True:
        ways.append(f"{probe.second} -> {probe.first}")
    return " and ".join(ways) or "both ways"


def analyse_mtu(observed: Observed) -> list[CheckResult]:
    if observed.link_plan is None and observed.mtu_pairs is None:
        why = "; ".join(sorted(set(observed.bandwidth_errors.values()))) or "fewer than two nodes to probe"
        return [CheckResult(host.name, MTU_CHECK, "skip", f"not probed: {why}") for host in observed.inventory.hosts]
    probes = list(observed.mtu_probes.values())
    holes = [probe for probe in probes if probe.black_hole and probe.confirmed]
    order = {host.name: index for index, host in enumerate(observed.inventory.hosts)}
    by_pair = {(probe.first, probe.second): probe for probe in holes}
    named, pairs = common_nodes(list(by_pair), order)
    results: list[CheckResult] = []
    for host in observed.inventory.hosts:
        name = host.name
        mine = [probe for probe in probes if name in (probe.first, probe.second)]
        if name in named:
            results.append(_mtu_node(name, [probe for probe in holes if name in (probe.first, probe.second)]))
        elif not mine:
            results.append(CheckResult(name, MTU_CHECK, "skip", "not probed: no pair of the plan reached it"))
        else:
            results.append(_mtu_pass(name, mine))
        results += [_mtu_pair(by_pair[pair]) for pair in pairs if pair[0] == name]
    return results


def _mtu_node(name: str, holes: Sequence[MtuProbe]) -> CheckResult:
    size = max(probe.size for probe in holes)
    largest = max((probe.largest for probe in holes if probe.largest is not None), default=None)
    peers = ", ".join(probe.second if probe.first == name else probe.first for probe in holes)
    passed = f"the largest that passed both ways: {largest} bytes" if largest else "no size found that passes"
    summary = (f"{name}: {size}-byte packets with don't-fragment set vanish between {name} and {peers} "
               f"(small ones pass; {passed}): a path MTU black hole")
    fix = (f"make every hop between {name} and the others carry {size}-byte frames (the switch port, bridge "
           f"or router on {name}'s path: ip link set dev PORT mtu {size}), or set the interfaces' MTU to "
           f"{largest or 1500} on every node")
    return CheckResult(name, MTU_CHECK, "fail", summary, fix)


def _mtu_pair(probe: MtuProbe) -> CheckResult:
    passed = f"the largest that passed both ways: {probe.largest} bytes" if probe.largest else "no size passed"
    summary = (f"{probe.size}-byte packets with don't-fragment set vanish {_mtu_words(probe)} "
               f"(small ones pass; {passed}): a path MTU black hole")
    fix = (f"make every hop between {probe.first} and {probe.second} carry {probe.size}-byte frames, or set "
           f"the interfaces' MTU to {probe.largest or 1500} on every node")
    return CheckResult(probe.first, MTU_CHECK, "fail", summary, fix)


def _mtu_pass(name: str, mine: Sequence[MtuProbe]) -> CheckResult:
    passed = [probe for probe in mine if probe.full is True]
    smaller = [probe for probe in mine if isinstance(probe.full, str)]
    untested = [probe for probe in mine if probe.small is not True and not isinstance(probe.full, str)]
    size = max((probe.size for probe in mine), default=0)
    if smaller:
        peers = ", ".join(probe.second if probe.first == name else probe.first for probe in smaller)
        return CheckResult(name, MTU_CHECK, "warn",
                           f"{size}-byte packets to {peers} are refused at {name}: {smaller[0].full} "
                           "(a router on the path carries less, and said so)",
                           "the job still runs, in smaller packets; set the interfaces' MTU to the path's")
    if passed:
        note = f"; {len(untested)} peers not probed (UDP did not pass)" if untested else ""
        return CheckResult(name, MTU_CHECK, "pass",
                           f"{size}-byte packets pass both ways with {len(passed)} peers{note}")
    return CheckResult(name, MTU_CHECK, "skip", "not probed: UDP to the peers' echo did not pass (a firewall?)")


# every figure, for --json --------------------------------------------------------------


def figures(observed: Observed) -> dict[str, Any] | None:
    """Every measured figure: the plan, each node's and each link's rate, each measurement, the MTU probes."""
    plan = observed.link_plan
    if plan is None:
        return None
    best = best_transfers(observed)
    median = median_bps(best)
    slow = slow_links(observed)
    per_link: dict[Link, list[Transfer]] = {}
    for transfer in observed.transfers:
        per_link.setdefault(transfer.link, []).append(transfer)
    return {
        "median_gbit": _g(median), "min_gbit": _g(observed.min_bandwidth), "slow_ratio": observed.slow_ratio,
        "plan": {"mode": plan.mode, "links": len(plan.links), "rounds": len(plan.rounds), "about": plan.describe()},
        "nodes": {name: {"in_gbit": _g(rate["in"]), "out_gbit": _g(rate["out"])}
                  for name, rate in node_rates(best).items()},
        "links": [{"from": link[0], "to": link[1], "gbit": _g(best[link].bits_per_second),
                   "cpu_bound": best[link].cpu_bound, "slow": slow.get(link),
                   "measurements": [_measurement(transfer) for transfer in transfers]}
                  for link, transfers in per_link.items()],
        "mtu": [{"nodes": [probe.first, probe.second], "size": probe.size, "small": probe.small, "full": probe.full,
                 "out": probe.out, "back": probe.back, "largest": probe.largest, "confirmed": probe.confirmed,
                 "error": probe.error or None}
                for probe in observed.mtu_probes.values()],
        "errors": dict(observed.bandwidth_errors),
    }


def _g(bits: float | None) -> float | None:
    return None if bits is None else round(bits / 1e9, 4)


def _measurement(transfer: Transfer) -> dict[str, Any]:
    return {"gbit": _g(transfer.bits_per_second), "seconds": transfer.seconds, "alone": transfer.alone,
            "cpu_bound": transfer.cpu_bound, "cpu": dict(transfer.cpu), "error": transfer.error or None}
