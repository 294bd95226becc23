"""``check``'s probes as a node x node matrix: exact text, grouping, and the probe results
``Cluster.check`` hands over with its report."""

from __future__ import annotations

from io import StringIO
from pathlib import Path

from torchherd.checks import PreflightOutcome
from torchherd.checks.model import Observed
from torchherd.checks.results import CheckReport, ProbeResult
from torchherd.console import make_console
from torchherd.console.matrix import failed, render_matrix
from torchherd.engine.ssh.preflight import with_probes as _with_probes
from torchherd.inventory import parse

LEGEND = ("each node's two ephemeral ports under its name; node0:29500 is the master port. ok: connected; refused: "
          "nothing listening, or a REJECT rule; timed out: packets dropped; ?: not a verdict (one timeout, or no "
          "time left); ·: not probed\n")


def mesh(nodes: list[str], result_into: dict[str, str], master_port: str = "ok") -> list[ProbeResult]:
    """Every node probes every other's two ephemeral ports; the workers the master port."""
    probes = []
    for prober in nodes:
        for peer in nodes:
            if peer != prober:
                result = result_into.get(peer, "ok")
                probes += [ProbeResult(prober, peer, port, result, result != "ok") for port in ("e1", "e2")]
        if prober != nodes[0]:
            probes.append(ProbeResult(prober, nodes[0], "master", master_port, master_port != "ok"))
    return probes


def render(probes: list[ProbeResult], nodes: list[str], terminal: bool = True) -> str:
    out = StringIO()
    render_matrix(make_console(out, width=400, terminal=terminal), probes, nodes, nodes[0], 29500)
    return out.getvalue()


def test_a_node_that_drops_its_peers_shows_in_its_column() -> None:
    nodes = ["node0", "node1", "node2", "node3"]
    probes = mesh(nodes, {"node2": "timeout"})
    assert failed(probes)
    assert render(probes, nodes) == (
        "connections: rows connected to columns                     \n"
        "from \\ to   node0   node1     node2     node3   node0:29500\n"
        "───────────────────────────────────────────────────────────\n"
        "node0         -      ok     timed out    ok          -     \n"
        "node1        ok       -     timed out    ok         ok     \n"
        "node2        ok      ok         -        ok         ok     \n"
        "node3        ok      ok     timed out     -         ok     \n" + LEGEND)


def test_piped_the_matrix_is_plain_columns() -> None:
    nodes = ["node0", "node1", "node2", "node3"]
    assert render(mesh(nodes, {"node2": "timeout"}), nodes, terminal=False) == (
        "connections: rows connected to columns\n"
        "from \\ to  node0  node1  node2      node3  node0:29500\n"
        "node0      -      ok     timed out  ok     -\n"
        "node1      ok     -      timed out  ok     ok\n"
        "node2      ok     ok     -          ok     ok\n"
        "node3      ok     ok     timed out  -      ok\n" + LEGEND)


def test_the_master_port_has_its_own_column_and_a_lone_timeout_is_no_verdict() -> None:
    nodes = ["node0", "node1", "node2"]
    probes = mesh(nodes, {}, master_port="refused")
    probes.append(ProbeResult("node1", "node2", "e1", "timeout", False))
    text = render(probes, nodes)
    assert "\nnode1        ok       -       ?       refused  \n" in text
    assert "\nnode2        ok      ok       -       refused  \n" in text
    assert not failed(mesh(nodes, {})) and not failed([ProbeResult("a", "b", "e1", "timeout", False)])


def test_a_large_cluster_folds_the_nodes_that_agree() -> None:
    nodes = [f"node{index}" for index in range(20)]
    text = render(mesh(nodes, {"node7": "refused"}), nodes)
    lines = text.splitlines()
    assert lines[1].split() == ["from", "\\", "to", "node[0-6,8-19]", "node7", "node0:29500"]
    assert lines[3].split() == ["node[0-6,8-19]", "ok", "refused", "ok"]
    assert lines[4].split() == ["node7", "ok", "-", "ok"]


def test_unprobed_pairs_show_a_dot() -> None:
    nodes = ["node0", "node1", "node2"]
    probes = [ProbeResult("node1", "node2", "e1", "ok", False), ProbeResult("node1", "node0", "master", "ok", False)]
    assert "\nnode1         ·       -      ok         ok     \n" in render(probes, nodes)


def test_the_check_report_carries_every_probe_without_changing_its_json() -> None:
    inventory = parse({"hosts": [{"name": "node0"}, {"name": "node1"}]}, Path("hosts.toml"))
    observed = Observed(inventory, "node0", connected={
        "node1": {"node0:master": {"result": "ok"}, "node0:e1": {"result": "timeout", "attempts": [
            {"result": "timeout"}, {"result": "timeout"}]}, "garbage": 3}})
    report = CheckReport(())
    with_probes = _with_probes(PreflightOutcome(report, observed=observed))
    assert with_probes.probes == (ProbeResult("node1", "node0", "master", "ok", False),
                                  ProbeResult("node1", "node0", "e1", "timeout", True))
    assert with_probes == report and with_probes.as_json() == report.as_json()
    assert _with_probes(PreflightOutcome(report)) is report
