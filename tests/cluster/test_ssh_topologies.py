"""SSH as real clusters are reached: through a bastion that keeps sshd's stock limits,
through a chain of two jump hosts, and by aliases that an ``Include``d file defines.

In each topology ``torchherd check`` is clean and a 3-node x 2-rank data-parallel run is correct
(``ALLREDUCE_DEMO``: the DDP demo's training, its gradients all-reduced by hand).
The bastion (``jump0``) keeps ``MaxStartups 10:30:100``; the nodes behind it drop SSH
from anyone but the hop in front of them. Its sshd log shows what torchherd did: one
login per command (the shared jump connection), and no connection dropped past
MaxStartups while at most 4 handshakes at once go to one sshd.

Each test prints how long its cluster took to build and each step to run.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from io import StringIO
from pathlib import Path

import pytest
from localcluster import LocalCluster, make_room_for_neighbours

from support.cluster_runs import SKIP_TORCH
from support.cluster_topologies import ALLREDUCE_DEMO, assert_clean
from torchherd.cli import main
from torchherd.console import make_console
from torchherd.errors import TransportError
from torchherd.inventory import load
from torchherd.transport.ssh import SshConnector

pytestmark = pytest.mark.cluster


def sshd_log(cluster: LocalCluster, name: str) -> str:
    return (cluster.log_dir / f"{name}-sshd.log").read_text(errors="replace")


def logins(cluster: LocalCluster, name: str) -> int:
    return sshd_log(cluster, name).count("Accepted publickey for root")


def dropped(cluster: LocalCluster, name: str) -> int:
    return len(re.findall(r"past MaxStartups", sshd_log(cluster, name)))


def check(inventory: Path, capsys: pytest.CaptureFixture[str], *options: str) -> tuple[dict[str, object], float]:
    started = time.monotonic()
    code = main(["check", "-i", str(inventory), "--json", *options])
    took = time.monotonic() - started
    document = json.loads(capsys.readouterr().out)
    assert document["ok"] is (code == 0)
    return document, took


def first_nodes(cluster: LocalCluster, count: int, path: Path) -> Path:
    """An inventory of the cluster's first ``count`` nodes (same ssh_config)."""
    text = cluster.inventory.read_text()
    head, *blocks = text.split("\n[[hosts]]\n")
    head = head.replace('ssh_config = "ssh_config"', f'ssh_config = "{cluster.ssh_config}"')
    path.write_text(head + "".join("\n[[hosts]]\n" + block for block in blocks[:count]))
    return path


def run_ddp(inventory: Path, log_dir: Path) -> tuple[float, str]:
    """A 3x2 data-parallel run through whatever the ssh_config says; asserts every rank's loss fell
    to the same value on all ranks."""
    out = StringIO()
    started = time.monotonic()
    code = main(["-i", str(inventory), "run", "--no-check", "--log-dir", str(log_dir), "--nproc-per-node", "2",
                 "--", ALLREDUCE_DEMO], console=make_console(out, width=200))
    took = time.monotonic() - started
    text = out.getvalue()
    assert code == 0, text
    losses: dict[int, list[float]] = {}
    for line in text.splitlines():
        match = re.match(r"node(\d+):(\d+): .*step \d+ loss ([0-9.]+)", line)  # piped: node:rank: text
        if match:
            assert int(match.group(2)) // 2 == int(match.group(1)), line
            losses.setdefault(int(match.group(2)), []).append(float(match.group(3)))
    assert sorted(losses) == list(range(6)), text
    assert all(values[-1] < values[0] for values in losses.values()), losses
    assert len({round(values[-1], 4) for values in losses.values()}) == 1, losses
    assert "all 3 nodes finished (exit 0)" in text
    return took, text


def report(name: str, timings: dict[str, float], capsys: pytest.CaptureFixture[str]) -> None:
    with capsys.disabled():
        print(f"\n{name}: " + ", ".join(f"{step} {seconds:.1f} s" for step, seconds in timings.items()))


def bastion_topology(make_cluster: Callable[..., LocalCluster], tmp_path: Path,
                     capsys: pytest.CaptureFixture[str], nodes: int, *options: str) -> dict[str, float]:
    started = time.monotonic()
    cluster = make_cluster(nodes, jump_hosts=1)
    timings = {"build": time.monotonic() - started}
    before = logins(cluster, "jump0")
    # Every check but those whose facts import torch (python, gpu): a dozen imports at about
    # 2 s of CPU each on this 2-core machine, and nothing of the bastion's limits in them. The
    # facts program itself, with each node's session, goes through the bastion as in a full
    # check; test_two_hop_chain checks in full through jump hosts.
    document, timings["check"] = check(cluster.inventory, capsys, *SKIP_TORCH, *options)
    assert_clean(document, cluster.names)
    assert logins(cluster, "jump0") == before + 1, "every node's session should share one login to the bastion"
    assert dropped(cluster, "jump0") == 0
    # The nodes' facts scripts may outlive `check` a moment (their session is gone before
    # they end); the run's first heartbeats should not share the CPU with them. Real nodes
    # each have their own CPUs: wait them out here.
    started = time.monotonic()
    for name in cluster.names:
        cluster.wait_no_processes(name, timeout=120)
    timings["check's node processes gone"] = time.monotonic() - started
    timings["3x2 run"], _ = run_ddp(first_nodes(cluster, 3, tmp_path / "three.toml"), tmp_path / "logs")
    assert logins(cluster, "jump0") == before + 2
    for name in cluster.names:
        assert cluster.wait_no_processes(name, timeout=10) == [], f"processes left on {name}"
    started = time.monotonic()
    cluster.down()
    timings["teardown"] = time.monotonic() - started
    return timings


@pytest.mark.timeout(900)
def test_twelve_nodes_behind_a_stock_limits_bastion(make_cluster: Callable[..., LocalCluster], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """12 nodes: more than MaxStartups' 10, so one jump connection per node would be dropped."""
    report("12 nodes behind a bastion", bastion_topology(make_cluster, tmp_path, capsys, 12), capsys)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_forty_eight_nodes_behind_a_stock_limits_bastion(make_cluster: Callable[..., LocalCluster],
                                                          tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raised = make_room_for_neighbours(49)
    timings = bastion_topology(make_cluster, tmp_path, capsys, 48)
    report("48 nodes behind a bastion" + (f"; neighbour table raised: {', '.join(raised)}" if raised else ""),
           timings, capsys)


@pytest.mark.timeout(600)
def test_two_hop_chain(make_cluster: Callable[..., LocalCluster], tmp_path: Path,
                       capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    cluster = make_cluster(3, jump_hosts=2)
    timings = {"build": time.monotonic() - started}
    assert "ProxyJump jump0,jump1" in cluster.ssh_config.read_text()
    document, timings["check"] = check(cluster.inventory, capsys)
    assert_clean(document, cluster.names)
    assert (logins(cluster, "jump0"), logins(cluster, "jump1")) == (1, 1)
    timings["3x2 run"], _ = run_ddp(cluster.inventory, tmp_path / "logs")
    report("two-hop chain, 3 nodes", timings, capsys)


@pytest.mark.timeout(600)
def test_aliases_from_an_included_file(make_cluster: Callable[..., LocalCluster], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    cluster = make_cluster(3, include_aliases=True)
    timings = {"build": time.monotonic() - started}
    assert "Include " in cluster.ssh_config.read_text() and "Host node0" not in cluster.ssh_config.read_text()
    assert cluster.known_hosts.read_text().startswith("|1|")
    assert main(["-i", str(cluster.inventory), "hosts", "--json"], console=make_console(StringIO())) == 0
    hosts = json.loads(capsys.readouterr().out)["hosts"]
    assert [host["ssh"] for host in hosts] == [f"root@{cluster.node(name).ip}" for name in cluster.names]
    document, timings["check"] = check(cluster.inventory, capsys)
    assert_clean(document, cluster.names)
    timings["3x2 run"], _ = run_ddp(cluster.inventory, tmp_path / "logs")
    report("aliases from an Included file, 3 nodes", timings, capsys)


@pytest.mark.timeout(300)
def test_one_sshd_sees_at_most_four_handshakes_and_dropped_banners_are_retried(
        make_cluster: Callable[..., LocalCluster]) -> None:
    """Twelve sessions to the bastion itself: through one connector (the gate holds them
    to 4 handshakes at once, so sshd drops none), then through twelve connectors at once
    (no gate between them: sshd drops some past MaxStartups, and the retries get them in)."""
    cluster = make_cluster(1, jump_hosts=1)
    inventory = load(cluster.inventory)
    bastion = replace(inventory.hosts[0], address="jump0")
    hosts = [replace(bastion, name=f"b{index}") for index in range(12)]

    connector = SshConnector(inventory.cluster.ssh_config, 10.0)
    sessions = _connect_at_once([connector] * len(hosts), hosts)
    assert all(not isinstance(session, Exception) for session in sessions), sessions
    for session in sessions:
        session.close()  # type: ignore[union-attr]
    assert dropped(cluster, "jump0") == 0

    separate = [SshConnector(inventory.cluster.ssh_config, 10.0) for _ in hosts]
    for _ in range(3):
        sessions = _connect_at_once(separate, hosts)
        assert all(not isinstance(session, Exception) for session in sessions), sessions
        for session in sessions:
            session.close()  # type: ignore[union-attr]
    print(f"\n12 logins at once x3, no gate: {dropped(cluster, 'jump0')} dropped past MaxStartups, all retried")


def _connect_at_once(connectors: list[SshConnector], hosts: list[object]) -> list[object]:
    results: list[object] = [None] * len(hosts)
    barrier = threading.Barrier(len(hosts))

    def one(index: int) -> None:
        barrier.wait()
        try:
            results[index] = connectors[index].connect(hosts[index])  # type: ignore[arg-type]
        except TransportError as error:
            results[index] = error

    threads = [threading.Thread(target=one, args=(index,)) for index in range(len(hosts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results
