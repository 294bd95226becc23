"""``check --bandwidth``: real transfers between the nodes, on the addresses the job uses.

Every node runs remote/bandwidth.py over its open session (a receiver, a UDP echo, and
requests on stdin, as the probes' listener does). Then, with no thread per node on the
controller (each request is written, the answers are read after):

1. the path MTU of every measured pair: datagrams of the interfaces' MTU with
   don't-fragment, both ways, all pairs at once; a pair that failed is probed again with
   longer waits, and the largest size that passes is searched;
2. the plan's links (links.plan_links), round after round, the links of a round sharing
   no node, each transfer MEASURE_SECONDS long;
3. every link slow or failed in the burst measured again, alone, one after the other: a
   busy CPU slows a burst of transfers on a small machine, and a slow verdict must hold
   when nothing else competes.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import math
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from torchherd.checks.analysis.bandwidth import candidates
from torchherd.checks.gather import FALLBACK_PYTHON, LineReader, python_command
from torchherd.checks.links import Link, pairs, plan_links, preflight_pairs
from torchherd.checks.model import Mesh, MtuProbe, Observed, Transfer
from torchherd.checks.probes import subnet_of
from torchherd.errors import TransportError
from torchherd.inventory import Host
from torchherd.transport import Process, Session

MEASURE_SECONDS = 0.3
"""One transfer: a LAN's TCP ramps up within a few ms, and a few hundred ms of steady
sending gives a figure within a few per cent of iperf3's (torchherd docs performance)."""
DRAIN_SECONDS = 1.0
"""What a receiver keeps counting after that (remote/bandwidth.py DRAIN): a slow link's queue."""
ANSWER_MARGIN = 10.0
"""On top of a request's own time: SSH and a busy node or controller."""
START_EXTRA = 20.0
"""On top of ssh_timeout for a node's script to start and bind (a loaded node)."""
SCRIPT_SECONDS = 600.0
"""The longest a node's script lives by itself, should the controller vanish without EOF."""
MTU_TIMEOUT, MTU_ATTEMPTS = 0.5, 2
AGAIN_TIMEOUT, AGAIN_ATTEMPTS = 1.0, 2
"""A pair whose full-size datagrams got no answer in the burst is probed again with these."""
BISECT_TIMEOUT = 0.4
"""Each size of the search for the largest that passes (a dozen sizes at most, one try each:
a lost answer only makes the figure smaller)."""
SMALL = {4: 576, 6: 1280}
"""Bytes of the small datagram that shows the path itself works (IPv4's and IPv6's minimum)."""
ECHO_RATE = 500
"""A node's echo answers a second at most, unless asked for more (remote/bandwidth.py)."""
ALONE_AT_MOST = 32
"""Links measured again alone, one after the other, at most: beyond, a slow link stays unconfirmed."""


@dataclass
class Endpoint:
    """One node's running script."""

    name: str
    process: Process
    reader: LineReader
    address: str = ""
    tcp: int = 0
    udp: int = 0
    answers: dict[int, Mapping[str, Any]] = field(default_factory=dict)


def measure(observed: Observed, sessions: Mapping[str, Session], mesh: Mesh = "auto") -> None:
    """Runs the three steps on every node with a session and a network; records the plan,
    every transfer and every MTU probe in ``observed``."""
    hosts = [host for host in observed.inventory.hosts if host.name in sessions and host.name in observed.networks]
    endpoints = _start(observed, hosts, sessions)
    try:
        nodes = [host.name for host in hosts if host.name in endpoints]
        if len(nodes) < 2:
            return
        plan = plan_links(nodes, {node: subnet_of(observed, node) for node in nodes}, mesh)
        observed.link_plan = plan
        ids = itertools.count(1)
        _probe_mtu(observed, endpoints, pairs(plan.links), ids)
        holes = {frozenset(pair) for pair, probe in observed.mtu_probes.items() if probe.black_hole}
        for links in plan.rounds:
            # A full-size TCP segment would vanish there too: the transfer would only stall.
            _transfers(observed, endpoints, [link for link in links if frozenset(link) not in holes], ids, alone=False)
        for link in candidates(observed)[:ALONE_AT_MOST]:
            _transfers(observed, endpoints, [link], ids, alone=True)
    finally:
        _stop(list(endpoints.values()))


class Launched:
    """The bandwidth scripts being started in a thread of their own (each start is an SSH
    round trip: one after the other, they would hold up the probes), and the networks they
    are started for: the preflight starts them while the cross-node probes run."""

    def __init__(self, observed: Observed, hosts: Sequence[Host], sessions: Mapping[str, Session]) -> None:
        self.networks = _networks(observed, hosts)
        self._endpoints: dict[str, Endpoint] = {}
        self._errors: dict[str, str] = {}
        # Into a copy: the probes' thread writes the observations meanwhile.
        work = replace(observed, bandwidth_errors=self._errors)

        def launch() -> None:
            # The master echoes for every worker: at 2 answers each (small, full), its rate limit must not drop them.
            self._endpoints.update(_launch(work, hosts, sessions, echo_rate=max(ECHO_RATE, 4 * len(hosts))))

        self._thread = threading.Thread(target=launch, name="torchherd-mtu-start", daemon=True)
        self._thread.start()

    def endpoints(self, observed: Observed) -> dict[str, Endpoint]:
        """Once every start returned: the scripts started (their failures into ``observed``)."""
        self._thread.join()
        observed.bandwidth_errors.update(self._errors)
        return self._endpoints


def start_paths(observed: Observed, sessions: Mapping[str, Session]) -> Launched | None:
    """Starts the preflight path-MTU probe's scripts, on the networks known so far, while
    the cross-node probes run (they take longer than the scripts' start, so the probe then
    costs its datagrams' few ms); None with fewer than two nodes."""
    hosts = _probed_hosts(observed, sessions)
    return Launched(observed, hosts, sessions) if len(hosts) >= 2 else None


def probe_paths(observed: Observed, sessions: Mapping[str, Session], launched: Launched | None = None) -> None:
    """The preflight's path-MTU probe (no transfers): the bandwidth script on every node
    with a session and a network (``launched`` by ``start_paths``, unless the probes found
    other networks since), then step 1 alone, on ``links.preflight_pairs``: a datagram of
    the interface MTU each way per pair, a pair that failed probed again (longer waits, the
    largest size that passes searched) before anything is said."""
    hosts = _probed_hosts(observed, sessions)
    if launched is not None and launched.networks != _networks(observed, hosts):
        _stop(list(launched.endpoints(observed).values()))  # bound to another address: started again
        launched = None
    if launched is None:
        if len(hosts) < 2:
            return
        started = _launch(observed, hosts, sessions, echo_rate=max(ECHO_RATE, 4 * len(hosts)))
    else:
        started = launched.endpoints(observed)
    endpoints = _ready(observed, started)
    try:
        nodes = [host.name for host in hosts if host.name in endpoints]
        if len(nodes) < 2:
            return
        master = observed.master.name if observed.master.name in nodes else nodes[0]
        links = preflight_pairs(nodes, master)
        observed.mtu_pairs = tuple(links)
        _probe_mtu(observed, endpoints, links, itertools.count(1))
    finally:
        _stop(list(endpoints.values()))


def stop_paths(observed: Observed, launched: Launched) -> None:
    """The scripts ``start_paths`` started, stopped (the preflight ended before the probe)."""
    _stop(list(launched.endpoints(observed).values()))


def _probed_hosts(observed: Observed, sessions: Mapping[str, Session]) -> list[Host]:
    return [host for host in observed.inventory.hosts if host.name in sessions and host.name in observed.networks]


def _networks(observed: Observed, hosts: Sequence[Host]) -> dict[str, tuple[str, bool]]:
    """What a node's script is started with: the job's address, and whether it is its own."""
    return {host.name: (observed.networks[host.name].address, observed.networks[host.name].interface is not None)
            for host in hosts}


def _start(observed: Observed, hosts: Sequence[Host], sessions: Mapping[str, Session],
           echo_rate: int | None = None) -> dict[str, Endpoint]:
    return _ready(observed, _launch(observed, hosts, sessions, echo_rate))


def _launch(observed: Observed, hosts: Sequence[Host], sessions: Mapping[str, Session],
            echo_rate: int | None = None) -> dict[str, Endpoint]:
    """Every node's script started and given the key; ``_ready`` reads that each bound."""
    started: dict[str, Endpoint] = {}
    # The scripts serve only what carries this key (no stranger can make them send
    # datagrams or count bytes); it goes on stdin, never on a command line.
    key = secrets.token_hex(8)
    # The scripts bind the job's address, where it is one of the node's own (an interface
    # has it), and the echo answers those addresses only; where some node's is not its own
    # (its packets leave from another), the echo answers any sender of a valid request.
    own = {host.name: observed.networks[host.name].interface is not None for host in hosts}
    peers = sorted({observed.networks[host.name].address for host in hosts}) if all(own.values()) else []
    for host in hosts:
        address = observed.networks[host.name].address
        facts = observed.facts.get(host.name)
        python = FALLBACK_PYTHON if facts is not None and facts.python_error else host.python
        # the job's address only: another user on the node reaches no other
        config = {"family": _family(address), "seconds": SCRIPT_SECONDS, "address": address if own[host.name] else "",
                  "echo_rate": echo_rate}
        try:
            process = sessions[host.name].start("exec " + python_command(python, "bandwidth.py", config))
        except TransportError as error:
            observed.bandwidth_errors[host.name] = f"the bandwidth script did not start: {error}"
            continue
        endpoint = Endpoint(host.name, process, LineReader(process), address)
        if _ask(endpoint, {"key": key, "peers": peers}):
            started[host.name] = endpoint
        else:
            observed.bandwidth_errors[host.name] = "the bandwidth script did not start: its session closed"
            _stop([endpoint])
    return started


def _ready(observed: Observed, started: Mapping[str, Endpoint]) -> dict[str, Endpoint]:
    """The started scripts that said which ports they bound; the others stopped, and why named."""
    deadline = time.monotonic() + observed.inventory.cluster.ssh_timeout + START_EXTRA
    ready: dict[str, Endpoint] = {}
    for name, endpoint in started.items():
        bound = _json(endpoint.reader.line(deadline))
        if all(isinstance(bound.get(kind), int) and not isinstance(bound.get(kind), bool)
               and 1 <= bound[kind] <= 65535 for kind in ("tcp", "udp")):
            endpoint.tcp, endpoint.udp = bound["tcp"], bound["udp"]
            ready[name] = endpoint
            continue
        why = bound.get("error") or endpoint.process.read_stderr().decode("utf-8", "replace").strip()[-200:]
        observed.bandwidth_errors[name] = f"the bandwidth script did not start: {why or 'no answer'}"
        _stop([endpoint])
    return ready


def _family(address: str) -> int:
    try:
        return ipaddress.ip_address(address.split("%")[0]).version
    except ValueError:
        return 4


def _json(line: bytes | None) -> dict[str, Any]:
    try:
        found = json.loads((line or b"").decode("utf-8", "replace"))
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def _ask(endpoint: Endpoint, request: dict[str, Any]) -> bool:
    try:
        return endpoint.process.send(json.dumps(request).encode("utf-8") + b"\n")
    except TransportError:
        return False


def _answers(asked: Mapping[int, Endpoint], deadline: float) -> dict[int, Mapping[str, Any]]:
    """The answer to every request asked, read node after node (the nodes work meanwhile);
    a request left without one by the deadline is missing from the result."""
    found: dict[int, Mapping[str, Any]] = {}
    for request_id, endpoint in asked.items():
        while request_id not in endpoint.answers:
            line = endpoint.reader.line(deadline)
            if line is None:
                break
            answer = _json(line)
            if isinstance(answer.get("id"), int):
                endpoint.answers[answer["id"]] = answer
        if request_id in endpoint.answers:
            found[request_id] = endpoint.answers.pop(request_id)
    return found


def _mtu_of(observed: Observed, node: str, address: str) -> int | None:
    facts = observed.facts.get(node)
    interface = facts.interface_of(address) if facts is not None else None
    value = (interface or {}).get("mtu")
    return value if isinstance(value, int) and value > 0 else None


def _probe_mtu(observed: Observed, endpoints: Mapping[str, Endpoint], links: Sequence[Link],
               ids: itertools.count[int]) -> None:
    sizes = {link: _pair_size(observed, endpoints, link) for link in links}
    sized = [link for link in links if sizes[link] is not None]
    _mtu_round(observed, endpoints, sized, sizes, ids, again=False)
    failed = [link for link in sized if observed.mtu_probes[link].full is False]
    if failed:
        _mtu_round(observed, endpoints, failed, sizes, ids, again=True)


def _pair_size(observed: Observed, endpoints: Mapping[str, Endpoint], link: Link) -> int | None:
    mtus = [_mtu_of(observed, node, endpoints[node].address) for node in link]
    known = [mtu for mtu in mtus if mtu is not None]
    return min(known) if len(known) == len(mtus) else None


def _mtu_round(observed: Observed, endpoints: Mapping[str, Endpoint], links: Sequence[Link],
               sizes: Mapping[Link, int | None], ids: itertools.count[int], again: bool) -> None:
    timeout, attempts = (AGAIN_TIMEOUT, AGAIN_ATTEMPTS) if again else (MTU_TIMEOUT, MTU_ATTEMPTS)
    asked: dict[int, Endpoint] = {}
    by_id: dict[int, Link] = {}
    for link in links:
        first, second = endpoints[link[0]], endpoints[link[1]]
        size = sizes[link] or 0
        request_id = next(ids)
        request = {"id": request_id, "mtu": [second.address, second.udp], "size": size,
                   "small": min(SMALL[_family(second.address)], size), "timeout": timeout,
                   "attempts": attempts, "bisect": BISECT_TIMEOUT if again else None}
        if _ask(first, request):
            asked[request_id], by_id[request_id] = first, link
    # small and full take at most attempts x timeout, out and back one try, the search one per size
    longest = timeout * (2 * attempts + 2) + (16 * BISECT_TIMEOUT if again else 0.0)
    found = _answers(asked, time.monotonic() + longest + ANSWER_MARGIN)
    for request_id, link in by_id.items():
        answer = found.get(request_id, {"error": "no answer"})
        observed.mtu_probes[link] = MtuProbe(
            link[0], link[1], sizes[link] or 0, _outcome(answer.get("small")), _outcome(answer.get("full")),
            _outcome(answer.get("out")) if "out" in answer else None,
            _outcome(answer.get("back")) if "back" in answer else None,
            answer.get("largest") if isinstance(answer.get("largest"), int) else None,
            again, str(answer.get("error") or ""))


def _outcome(value: object) -> bool | str:
    return value if isinstance(value, (bool, str)) else False


def _transfers(observed: Observed, endpoints: Mapping[str, Endpoint], links: Sequence[Link],
               ids: itertools.count[int], alone: bool) -> None:
    asked: dict[int, Endpoint] = {}
    by_id: dict[int, Link] = {}
    for link in links:
        sender, receiver = endpoints[link[0]], endpoints[link[1]]
        request_id = next(ids)
        request = {"id": request_id, "send": [receiver.address, receiver.tcp], "seconds": MEASURE_SECONDS}
        if _ask(sender, request):
            asked[request_id], by_id[request_id] = sender, link
        else:
            observed.transfers.append(Transfer(link[0], link[1], None, alone=alone, error="the session closed"))
    found = _answers(asked, time.monotonic() + MEASURE_SECONDS + DRAIN_SECONDS + ANSWER_MARGIN)
    for request_id, link in by_id.items():
        observed.transfers.append(_transfer(link, found.get(request_id), alone))


MAX_BYTES = 1 << 50
"""More than any link moves in a transfer of MEASURE_SECONDS (a PiB): a count beyond is a
malformed answer (and one past a float's range would raise OverflowError)."""
SIDES = ("sender", "receiver")
SHARES = ("cpu", "wait")


def _transfer(link: Link, answer: Mapping[str, Any] | None, alone: bool) -> Transfer:
    if answer is None:
        return Transfer(link[0], link[1], None, alone=alone, error="no answer in time")
    if answer.get("error"):
        return Transfer(link[0], link[1], None, alone=alone, error=str(answer.get("error")))
    count, seconds = answer.get("bytes"), answer.get("seconds")
    if count is None or seconds is None:
        return Transfer(link[0], link[1], None, alone=alone, error="nothing arrived")
    # What the node said is checked for type and range: a bad answer fails the link, never the check.
    shares = _shares(answer)
    rate = count * 8 / seconds if isinstance(count, int) and _number(count) and 0 <= count <= MAX_BYTES and \
        _number(seconds) and 0 < seconds <= MAX_BYTES else math.nan
    if shares is None or not math.isfinite(rate):
        return Transfer(link[0], link[1], None, alone=alone,
                        error="a malformed answer from the node: " + json.dumps(dict(answer))[:200])
    return Transfer(link[0], link[1], rate, float(seconds), shares, alone)


def _number(value: object) -> bool:
    """An int (any size: compared, never made a float here) or a finite float; not a bool."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or isinstance(value, float) and math.isfinite(value)


def _shares(answer: Mapping[str, Any]) -> dict[str, float | None] | None:
    """The shares of the transfer's time each side spent on a CPU and waiting for one
    (None: not measured there); None when one is not an object or not a number >= 0."""
    shares: dict[str, float | None] = {}
    for side in SIDES:
        found = answer.get(side)
        if found is not None and not isinstance(found, dict):
            return None
        for kind in SHARES:
            value = None if found is None else found.get(kind)
            if value is not None and not (_number(value) and 0 <= value <= 1000):
                return None
            shares[f"{side}_{kind}"] = None if value is None else float(value)
    return shares


def _stop(endpoints: Sequence[Endpoint]) -> None:
    """Every script told to end at once (EOF), then each waited for."""
    for endpoint in endpoints:
        try:
            endpoint.process.close_stdin()
        except TransportError:
            pass
    for endpoint in endpoints:
        try:
            endpoint.process.exit_code(timeout=2.0)
        finally:
            endpoint.process.close()
