"""``check --bandwidth`` on the real local cluster: a healthy cluster has no finding; one
node's link rate-limited with ``tc`` (on its controller-side veth and inside its
namespace) is named, and only it; jumbo frames everywhere but one node's bridge port is a
path-MTU failure naming that node.

The machine has 2 cores shared with other tests: every transfer in a burst is limited by
the CPU, which is what the check must not mistake for a slow link.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from localcluster import LocalCluster, veth_name

from torchherd.cli import main

pytestmark = pytest.mark.cluster
ONLY = "ssh,network,port,bandwidth,mtu"
SLOW = "node2"


def check(cluster: LocalCluster, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict[str, Any], float]:
    started = time.monotonic()
    code = main(["check", "-i", str(cluster.inventory), "--bandwidth", "--only", ONLY, "--json", *extra])
    took = time.monotonic() - started
    document = json.loads(capsys.readouterr().out)
    assert document["ok"] is (code == 0)
    return code, document, took


def findings(document: dict[str, Any], check_id: str) -> dict[str, str]:
    """Per node, the status of each warn or fail of ``check_id``."""
    return {entry["node"]: entry["status"] for entry in document["checks"]
            if entry["check"] == check_id and entry["status"] in ("warn", "fail")}


def summaries(document: dict[str, Any]) -> str:
    """The bandwidth and MTU results, and every figure: what a failed assertion shows."""
    lines = [f"{entry['node']} {entry['check']} {entry['status']}: {entry['summary']}"
             for entry in document["checks"] if entry["check"] in ("bandwidth", "mtu")]
    return "\n".join(lines + [json.dumps(document.get("bandwidth"))])


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextmanager
def rate_limited(cluster: LocalCluster, name: str) -> Iterator[None]:
    """``name``'s link at 50 Mbit/s both ways: tbf on the controller-side veth (traffic to
    the node) and on the node's own eth0 (traffic from it)."""
    port = veth_name(cluster.prefix, cluster.names.index(name))
    tbf = ["root", "tbf", "rate", "50mbit", "burst", "32kbit", "latency", "400ms"]
    subprocess.run(["tc", "qdisc", "add", "dev", port, *tbf], check=True, capture_output=True)
    try:
        cluster.netns_exec(name, ["tc", "qdisc", "add", "dev", "eth0", *tbf])
        yield
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", port, "root"], capture_output=True)
        cluster.netns_exec(name, ["tc", "qdisc", "del", "dev", "eth0", "root"], check=False)


def set_mtu(cluster: LocalCluster, mtu: int, except_port_of: str | None = None) -> None:
    """Every interface of the cluster (the bridge, both ends of every veth) at ``mtu``,
    but the controller-side veth of ``except_port_of`` left at 1500. The controller's own
    route to that node says 1500, so its SSH session (which a real controller's path would
    not share) is not cut by the black hole the nodes are meant to find."""
    for index, name in enumerate(cluster.names):
        port = veth_name(cluster.prefix, index)
        ip("link", "set", "dev", port, "mtu", str(1500 if name == except_port_of else mtu))
        cluster.netns_exec(name, ["ip", "link", "set", "dev", "eth0", "mtu", str(mtu)])
    ip("link", "set", "dev", cluster.bridge, "mtu", str(mtu))
    for name in cluster.names:
        address = cluster.node(name).ip
        if name == except_port_of:
            ip("route", "replace", f"{address}/32", "dev", cluster.bridge, "mtu", "lock", "1500")
        else:
            subprocess.run(["ip", "route", "del", f"{address}/32", "dev", cluster.bridge], capture_output=True)


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    from conftest import _start

    made = _start(4, tmp_path_factory.mktemp("bandwidth4"))
    try:
        yield made
    finally:
        made.down()


@pytest.mark.timeout(120)
def test_healthy_four_nodes_have_no_finding(four: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    code, document, took = check(four, capsys)
    print(f"healthy 4 nodes: {took:.1f} s", file=sys.stderr)
    assert code == 0, summaries(document)
    assert findings(document, "bandwidth") == {} and findings(document, "mtu") == {}, summaries(document)
    figures = document["bandwidth"]
    assert set(figures["nodes"]) == {"node0", "node1", "node2", "node3"}
    assert figures["median_gbit"] > 0.2, figures["median_gbit"]
    # Each node sends to and receives from both neighbours of the ring.
    links = {(link["from"], link["to"]) for link in figures["links"]}
    assert all(sum(sender == node for sender, _ in links) >= 2 for node in figures["nodes"])
    assert all(sum(receiver == node for _, receiver in links) >= 2 for node in figures["nodes"])
    assert all(probe["full"] is True and probe["size"] == 1500 for probe in figures["mtu"]), figures["mtu"]


@pytest.mark.timeout(180)
def test_rate_limited_node_is_named_and_only_it(four: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    with rate_limited(four, SLOW):
        code, document, took = check(four, capsys)
        print(f"one node at 50 Mbit/s, 4 nodes: {took:.1f} s", file=sys.stderr)
        assert findings(document, "bandwidth") == {SLOW: "warn"}, summaries(document)
        assert code == 0
        slow = next(entry for entry in document["checks"] if entry["node"] == SLOW and entry["check"] == "bandwidth")
        assert "Mbit/s" in slow["summary"] and "measured again alone" in slow["summary"], slow
        rate = document["bandwidth"]["nodes"][SLOW]
        assert 0.03 < rate["in_gbit"] < 0.07 and 0.03 < rate["out_gbit"] < 0.07, rate
        code, document, _ = check(four, capsys, "--min-bandwidth", "1Gbit", "--smoke", "--only", ONLY + ",python,smoke")
        assert findings(document, "bandwidth") == {SLOW: "fail"}, summaries(document)
        assert code == 1
        # A slow link still carries the job: the smoke job runs and measures the collective.
        smoke = [entry for entry in document["checks"] if entry["check"] == "smoke"]
        assert smoke and all(entry["status"] == "pass" for entry in smoke), smoke


@pytest.mark.timeout(180)
def test_path_mtu_black_hole_names_the_node(four: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        set_mtu(four, 9000)
        code, document, _ = check(four, capsys)
        assert findings(document, "mtu") == {}, summaries(document)
        assert all(probe["full"] is True and probe["size"] == 9000 for probe in document["bandwidth"]["mtu"])
        set_mtu(four, 9000, except_port_of=SLOW)
        code, document, took = check(four, capsys)
        print(f"black hole, 4 nodes: {took:.1f} s", file=sys.stderr)
        assert findings(document, "mtu") == {SLOW: "fail"}, summaries(document)
        assert code == 1
        hole = next(entry for entry in document["checks"] if entry["node"] == SLOW and entry["check"] == "mtu")
        assert "9000-byte packets" in hole["summary"] and "1500 bytes" in hole["summary"], hole
    finally:
        set_mtu(four, 1500)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_healthy_sixteen_nodes_have_no_finding(make_cluster: Callable[..., LocalCluster],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    sixteen = make_cluster(16)
    code, document, took = check(sixteen, capsys)
    print(f"healthy 16 nodes: {took:.1f} s, {document['bandwidth']['plan']}", file=sys.stderr)
    assert findings(document, "bandwidth") == {} and findings(document, "mtu") == {}, summaries(document)
    assert code == 0
    assert len(document["bandwidth"]["nodes"]) == 16
