"""The probes without SSH: the plan (checks/probes.plan_probes), pure, so its promises
are properties; then the node script's listener and connector (checks/remote/facts.py),
run here as a plain subprocess against listeners on 127.0.0.1.

For any node count and any assignment of nodes to subnets: nobody probes itself or a
stranger, every node is probed by several others, every ordered pair of subnets is
covered, and beyond the full-mesh threshold each node's share stays bounded.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.processes import plant
from torchherd.checks.analysis import port
from torchherd.checks.gather import LineReader, facts_command, node_program
from torchherd.checks.model import Observed, ProbePlan
from torchherd.checks.probes import FULL_MESH_MAX, SAMPLED_PROBERS, listen_config, plan_probes
from torchherd.inventory import parse


def names(count: int) -> list[str]:
    return [f"n{index}" for index in range(count)]


@st.composite
def clusters(draw: st.DrawFn, most_subnets: int = 12) -> tuple[list[str], dict[str, str]]:
    """2..512 nodes, each in one of up to ``most_subnets`` subnets (some clusters have one)."""
    count = draw(st.integers(2, 512))
    subnets = draw(st.integers(1, most_subnets))
    assignment = draw(st.lists(st.integers(0, subnets - 1), min_size=count, max_size=count))
    nodes = names(count)
    return nodes, {node: f"10.{group}.0.0/24" for node, group in zip(nodes, assignment)}


def check_coverage(plan: ProbePlan, nodes: list[str], subnets: dict[str, str]) -> None:
    assert set(plan.peers) == set(nodes)
    for node, peers in plan.peers.items():
        assert node not in peers
        assert len(set(peers)) == len(peers)
        assert set(peers) <= set(nodes)
    probers = plan.probers()
    assert min(len(probers[node]) for node in nodes) >= min(3, len(nodes) - 1)
    covered = {(subnets[node], subnets[peer]) for node, peers in plan.peers.items() for peer in peers}
    present = set(subnets.values())
    assert {(a, b) for a in present for b in present if a != b} <= covered
    assert plan.subnets == len(present)


@settings(max_examples=100, deadline=None)
@given(clusters())
def test_every_plan_covers_every_node_and_every_subnet_pair(cluster: tuple[list[str], dict[str, str]]) -> None:
    nodes, subnets = cluster
    plan = plan_probes(nodes, subnets)
    check_coverage(plan, nodes, subnets)
    if len(nodes) <= FULL_MESH_MAX:
        assert plan.mode == "full"
        assert all(len(peers) == len(nodes) - 1 for peers in plan.peers.values())
        return
    assert plan.mode == "sampled"
    sizes = Counter(subnets.values())
    bound = SAMPLED_PROBERS + math.ceil((len(sizes) - 1) / min(sizes.values()))
    assert max(len(peers) for peers in plan.peers.values()) <= bound
    assert max(len(probers) for probers in plan.probers().values()) <= bound


@settings(max_examples=40, deadline=None)
@given(clusters(most_subnets=4))
def test_a_few_subnets_keep_every_node_near_four_probes(cluster: tuple[list[str], dict[str, str]]) -> None:
    nodes, subnets = cluster
    plan = plan_probes(nodes, subnets)
    if plan.mode == "sampled":
        assert max(len(peers) for peers in plan.peers.values()) <= SAMPLED_PROBERS + 3
        assert sum(len(peers) for peers in plan.peers.values()) <= SAMPLED_PROBERS * len(nodes) + 12


@settings(max_examples=60, deadline=None)
@given(clusters())
def test_the_plan_is_deterministic(cluster: tuple[list[str], dict[str, str]]) -> None:
    nodes, subnets = cluster
    reordered = dict(reversed(list(subnets.items())))
    assert plan_probes(nodes, subnets) == plan_probes(list(nodes), reordered)


def test_full_mesh_can_be_forced_at_any_size() -> None:
    nodes = names(300)
    plan = plan_probes(nodes, {node: "10.0.0.0/24" for node in nodes}, mesh="full")
    assert plan.mode == "full"
    assert all(len(peers) == 299 for peers in plan.peers.values())
    # Each node starts with the one after it, so the bursts do not all reach n0 first.
    assert plan.peers["n0"][0] == "n1" and plan.peers["n7"][:2] == ("n8", "n9") and plan.peers["n299"][0] == "n0"


def test_threshold_and_sampled_shape_on_one_subnet() -> None:
    at = plan_probes(names(FULL_MESH_MAX), {})
    assert at.mode == "full"
    above = plan_probes(names(256), {})
    assert above.mode == "sampled" and above.subnets == 1
    # A neighbour and three quarter turns: n0 probes n1, n64, n128, n192 and is probed by as many.
    assert above.peers["n0"] == ("n1", "n64", "n128", "n192")
    assert sorted(above.probers()["n0"]) == ["n128", "n192", "n255", "n64"]


def test_every_node_on_its_own_subnet_needs_every_pair() -> None:
    nodes = names(40)
    plan = plan_probes(nodes, {node: node for node in nodes})
    check_coverage(plan, nodes, {node: node for node in nodes})
    assert all(len(peers) == 39 for peers in plan.peers.values())


def test_a_lone_node_on_a_second_subnet_probes_and_is_probed_both_ways() -> None:
    nodes = names(100)
    subnets = {node: "10.0.0.0/24" for node in nodes} | {"n57": "10.9.0.0/24"}
    plan = plan_probes(nodes, subnets)
    check_coverage(plan, nodes, subnets)
    assert plan.describe() == ("sampled: each node probed 4 of the 99 others, each was probed by at least 4, both "
                               "ways between each pair of the 2 subnets (--mesh full probes every pair)")


def test_subnets_the_ring_misses_get_a_probe_each_way() -> None:
    nodes = names(64)
    # Subnets by residue mod 8: the ring's steps (1, 16, 32, 48) never join 0 to 2, say.
    subnets = {node: f"10.{index % 8}.0.0/24" for index, node in enumerate(nodes)}
    plan = plan_probes(nodes, subnets)
    check_coverage(plan, nodes, subnets)
    assert max(len(peers) for peers in plan.peers.values()) == SAMPLED_PROBERS + 1


def test_listeners_are_sized_for_their_peers_and_outlive_the_facts() -> None:
    """256 nodes are connected 24 at a time (11 rounds of ssh_timeout), the last one's facts
    take up to ssh_timeout + 20 s, then they are probed: the first listeners must still be up."""
    inventory = parse({"cluster": {"ssh_timeout": 10}, "hosts": [{"name": name} for name in names(256)]},
                      Path("hosts.toml"))
    seen = Observed(inventory=inventory, master_target="n0")
    master, worker = listen_config(seen, inventory.hosts[0]), listen_config(seen, inventory.hosts[1])
    assert master["ports"] == {"e1": 0, "e2": 0, "master": 29500} and worker["ports"] == {"e1": 0, "e2": 0}
    assert master["backlog"] == 255
    assert master["seconds"] == 11 * 10 + (10 + 20) + 10 + 5
    few = parse({"hosts": [{"name": name} for name in names(3)]}, Path("hosts.toml"))
    assert listen_config(Observed(inventory=few, master_target="n0"), few.hosts[0])["seconds"] == 120


class Node:
    """remote/facts.py as a node runs it: the facts, then a listener taking connect requests."""

    def __init__(self, backlog: int) -> None:
        source = node_program("facts.py")  # as the nodes get it: with the modules it imports
        config = {"port": 1, "resolve": [], "route_to": ["127.0.0.1"], "script": None, "workdir": "~",
                  "torch": False, "listen": {"ports": {"e1": 0, "e2": 0}, "seconds": 60, "backlog": backlog}}
        self.process = subprocess.Popen([sys.executable, "-S", "-c", source, json.dumps(config)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.process.stdin is not None and self.process.stdout is not None
        self.stdin: IO[bytes] = self.process.stdin
        self.stdout: IO[bytes] = self.process.stdout
        json.loads(self.stdout.readline())  # the facts
        self.listened = json.loads(self.stdout.readline())

    def ask(self, targets: list[tuple[str, int]], **request: Any) -> tuple[dict[str, Any], float]:
        """Connects to every (label, port) on 127.0.0.1; the answer and how long it took."""
        request["targets"] = [[label, "127.0.0.1", port_number] for label, port_number in targets]
        started = time.monotonic()
        self.stdin.write(json.dumps(request).encode() + b"\n")
        self.stdin.flush()
        answer = json.loads(self.stdout.readline())
        return answer, time.monotonic() - started

    def stop(self) -> None:
        self.stdin.close()
        assert self.process.wait(timeout=10) == 0


@pytest.fixture
def node() -> Iterator[Node]:
    started = Node(backlog=500)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port bound but not listening: a connect is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.fixture
def full_port() -> Iterator[int]:
    """A listener whose queue is full and never accepted: the kernel drops every further
    SYN, as a DROP rule would, so a connect times out (no root, no firewall needed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(0)
        filler = socket.create_connection(sock.getsockname(), timeout=2)
        try:
            yield sock.getsockname()[1]
        finally:
            filler.close()


def test_the_connector_says_ok_refused_and_timed_out_twice(node: Node, closed_port: int, full_port: int) -> None:
    bound = node.listened["bound"]
    answer, _ = node.ask([("me:e1", bound["e1"]), ("me:e2", bound["e2"]), ("shut:e1", closed_port),
                          ("full:e1", full_port)], timeout=0.3, retry_timeout=0.6, budget=5, ping=None, resolve=[])
    assert node.listened["backlog"] == 500
    assert [answer["me:e1"]["result"], answer["me:e2"]["result"]] == ["ok", "ok"]
    assert len(answer["me:e1"]["attempts"]) == 1 and answer["me:e1"]["source"] == "127.0.0.1"
    assert [attempt["result"] for attempt in answer["shut:e1"]["attempts"]] == ["refused", "refused"]
    timed_out = answer["full:e1"]
    assert [(attempt["result"], attempt["timeout"]) for attempt in timed_out["attempts"]] == [
        ("timeout", 0.3), ("timeout", 0.6)]
    assert port.verdict(timed_out) == "fail" and port.verdict(answer["shut:e1"]) == "fail"
    assert port.meaning(timed_out) == "timed out: packets dropped; timed out twice: 0.3 s in the burst, then 0.6 s alone"
    assert port.meaning(answer["shut:e1"]) == "connection refused: nothing listening, or a REJECT rule; refused twice"


def test_a_burst_is_bounded_and_the_retries_run_together(node: Node, full_port: int) -> None:
    """12 dropped targets, 4 at once: the burst takes three waves (>= 1.5 s); then all 12
    retries together (1 s), not in waves of 4 (which would take 3 s more)."""
    answer, took = node.ask([(f"p{index}:e1", full_port) for index in range(12)], timeout=0.5, retry_timeout=1.0,
                            budget=20, concurrency=4, ping=None, resolve=[])
    assert all(len(answer[f"p{index}:e1"]["attempts"]) == 2 for index in range(12))
    assert 1.5 + 1.0 <= took < 4.5, took


def test_the_budget_stops_new_connects_and_says_which(node: Node, full_port: int) -> None:
    answer, took = node.ask([(f"p{index}:e1", full_port) for index in range(12)], timeout=0.5, retry_timeout=1.0,
                            budget=1.2, concurrency=4, ping=None, resolve=[])
    # Two waves of 0.5 s fit in 1.2 s (one, on a slow machine); the rest are not started.
    results = Counter(answer[f"p{index}:e1"]["result"] for index in range(12))
    assert set(results) == {"timeout", "untried"} and results["timeout"] in (4, 8)
    assert {port.verdict(answer[f"p{index}:e1"]) for index in range(12)} == {"unsure"}
    # Nothing after the budget: each connect made was the burst's (0.5 s, waited in full), and
    # none was retried (1 s would not fit). Not the answer's time on the test's clock: beside
    # the serial tests, which weigh ten times as much, it once took 3.1 s, the scheduler's.
    made = [attempt for index in range(12) for attempt in answer[f"p{index}:e1"]["attempts"]]
    assert len(made) == results["timeout"], answer
    assert all(attempt["timeout"] == 0.5 and attempt["seconds"] >= 0.5 for attempt in made), made
    assert took >= 0.5


def test_a_listener_takes_a_crowd_of_connects(node: Node) -> None:
    """400 connects at once, 32 in flight, into one listener: each is accepted, none is lost."""
    bound = node.listened["bound"]
    answer, _ = node.ask([(f"p{index}:e{1 + index % 2}", bound[f"e{1 + index % 2}"]) for index in range(400)],
                         timeout=2.0, ping=None, resolve=[])
    assert {answer[f"p{index}:e{1 + index % 2}"]["result"] for index in range(400)} == {"ok"}


class Answered:
    """A node's stdout whose whole answer had arrived before the controller read it."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def read(self, timeout: float) -> bytes | None:
        data, self.data = self.data, b""
        return data or None


def test_an_answer_read_after_its_deadline_still_counts() -> None:
    # The controller reads the nodes' facts one after the other: by the time it reaches a
    # node its deadline may have passed, though the answer came in time.
    reader = LineReader(Answered(b'{"facts": 1}\n{"bound": {}}\n'))  # type: ignore[arg-type]
    past = time.monotonic() - 1
    assert reader.line(past) == b'{"facts": 1}' and reader.line(past) == b'{"bound": {}}'
    assert reader.line(past) is None


def test_the_shell_startup_is_timed_on_the_node() -> None:
    # The login shell execs the facts script: the time since that process started is the
    # shell's startup, whenever the controller gets to read the answer.
    config = {"port": 1, "resolve": [], "route_to": ["127.0.0.1"], "script": None, "workdir": "~", "torch": False,
              "listen": None}
    done = subprocess.run(["sh", "-c", f"sleep 0.5; {facts_command(sys.executable, config)}"], capture_output=True,
                          check=True, timeout=60)
    assert 0.5 <= json.loads(done.stdout)["shell_seconds"] < 10


def test_the_facts_ignore_modules_planted_in_the_directory_they_start_in(tmp_path: Path) -> None:
    """Without torch, the facts start isolated as the node programs do: a ``json.py`` in
    the directory the login shell starts in is not the standard module."""
    plant(tmp_path)
    config = {"port": 1, "resolve": [], "route_to": ["127.0.0.1"], "script": None, "workdir": "~", "torch": False,
              "listen": None}
    done = subprocess.run(["sh", "-c", facts_command(sys.executable, config)], capture_output=True, cwd=tmp_path,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["shell_seconds"] >= 0
