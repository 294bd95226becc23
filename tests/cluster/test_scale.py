"""``torchherd check`` at 32 and 64 nodes on the local cluster: a healthy cluster is
reported clean, and a real DROP rule on one node's ephemeral ports fails on that node only.

One cluster serves each test (the machine has 2 cores, shared with other tests); its
build and teardown times are printed.
At 32 nodes the full mesh runs (32 is its threshold, its heaviest plan), then the sampled
plan on the same nodes, with the threshold lowered. At 64 nodes the sampled plan runs as
it does for users past the threshold (each node probed by 4 others).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest
from localcluster import LocalCluster, make_room_for_neighbours

from torchherd.checks import probes
from torchherd.cli import main

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.serial]  # serial: timed (tests/conftest.py)
NODES = 32
ONLY = "ssh,ping,hostname,port,firewall"
DROPPED = "node29"
EPHEMERAL_DROP = ["INPUT", "-p", "tcp", "--dport", "32768:60999", "-j", "DROP"]
def check(cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[tuple[str, str], dict[str, str]], float]:
    """Exit code, every result by (node, check), and the wall time of one check --json."""
    started = time.monotonic()
    code = main(["check", "-i", str(cluster.inventory), "--only", ONLY, "--json"])
    took = time.monotonic() - started
    document = json.loads(capsys.readouterr().out)
    assert document["ok"] is (code == 0)
    return code, {(entry["node"], entry["check"]): entry for entry in document["checks"]}, took


def failed(results: dict[tuple[str, str], dict[str, str]]) -> set[tuple[str, str]]:
    return {key for key, entry in results.items() if entry["status"] == "fail"}


def assert_clean(cluster: LocalCluster, capsys: pytest.CaptureFixture[str], plan: str) -> float:
    code, results, took = check(cluster, capsys)
    assert failed(results) == set(), [results[key]["summary"] for key in failed(results)]
    assert code == 0
    assert {entry["status"] for (node, name), entry in results.items() if name == "port"} == {"pass"}
    assert f"probe plan: {plan}" in results[("node0", "port")]["summary"]
    return took


def assert_drop_caught(cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> float:
    cluster.netns_exec(DROPPED, ["iptables", "-I", *EPHEMERAL_DROP])
    try:
        code, results, took = check(cluster, capsys)
    finally:
        cluster.netns_exec(DROPPED, ["iptables", "-D", *EPHEMERAL_DROP])
    assert code == 1
    assert {node for node, _ in failed(results)} == {DROPPED}, [results[key]["summary"] for key in failed(results)]
    port = results[(DROPPED, "port")]
    assert port["status"] == "fail"
    assert port["summary"].startswith(f"{DROPPED}'s ephemeral ports (32768-60999) are unreachable from ")
    assert "timed out twice" in port["summary"]
    assert f"on {DROPPED}, allow TCP from the other nodes on 32768-60999" in port["fix"]
    return took


@pytest.mark.timeout(1200)
def test_32_nodes_clean_and_a_dropped_node_caught_on_that_node(
        make_cluster: Callable[..., LocalCluster], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    raised = make_room_for_neighbours(NODES)
    started = time.monotonic()
    cluster = make_cluster(NODES)
    built = time.monotonic() - started
    assert probes.FULL_MESH_MAX == NODES
    timings = {"full, healthy": assert_clean(cluster, capsys, "full mesh"),
               "full, one node dropping": assert_drop_caught(cluster, capsys)}
    monkeypatch.setattr(probes, "FULL_MESH_MAX", 8)
    timings["sampled, healthy"] = assert_clean(cluster, capsys, "sampled")
    timings["sampled, one node dropping"] = assert_drop_caught(cluster, capsys)
    report(cluster, built, timings, raised, capsys)


@pytest.mark.timeout(1800)
def test_64_nodes_clean_and_a_dropped_node_caught_on_that_node(
        make_cluster: Callable[..., LocalCluster], capsys: pytest.CaptureFixture[str]) -> None:
    raised = make_room_for_neighbours(64)
    started = time.monotonic()
    # Starting 64 sshds while other tests load the 2 cores can take longer than 15 s.
    cluster = make_cluster(64, ready_timeout=120)
    built = time.monotonic() - started
    assert probes.FULL_MESH_MAX < 64
    timings = {"sampled, healthy": assert_clean(cluster, capsys, "sampled"),
               "sampled, one node dropping": assert_drop_caught(cluster, capsys)}
    report(cluster, built, timings, raised, capsys)


def report(cluster: LocalCluster, built: float, timings: dict[str, float], raised: list[str],
           capsys: pytest.CaptureFixture[str]) -> None:
    """Tears the cluster down, timed, and prints what the cluster and each check took."""
    nodes = cluster.n
    started = time.monotonic()
    cluster.down()
    torn_down = time.monotonic() - started
    with capsys.disabled():
        print(f"\n{nodes}-node cluster: built in {built:.1f} s, torn down in {torn_down:.1f} s; check --only {ONLY}: "
              + ", ".join(f"{name} {took:.1f} s" for name, took in timings.items())
              + (f"; neighbour table raised: {', '.join(raised)}" if raised else ""))
