"""The smoke verdict: hand-made job outcomes and rank lines in, CheckResults out."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest

from torchherd.checks.analysis.smoke import SmokeContext, SmokeRun, parse_marks, smoke_verdicts
from torchherd.checks.results import CheckResult
from torchherd.inventory import parse
from torchherd.runlog import NodeOutcome, OutputLine, RunSummary

NAMES = ("node0", "node1", "node2")
INVENTORY = parse({"cluster": {"port": 29500}, "hosts": [{"name": name} for name in NAMES]}, Path("hosts.toml"))
CONTEXT = SmokeContext(INVENTORY, {name: name for name in NAMES}, ("gloo",), 60.0, 8.0)
CRCS = ",".join(str(zlib.crc32(name.encode())) for name in NAMES for _ in range(2))


def mark(node: str, rank: int, text: str) -> OutputLine:
    return OutputLine(node, rank, "out", f"torchherd-smoke {text}")


def healthy_lines(node: str, first: int) -> list[OutputLine]:
    lines = []
    for rank in (first, first + 1):
        lines += [mark(node, rank, f"start {rank} {node}"), mark(node, rank, f"joined {rank}"),
                  mark(node, rank, f"gathered {rank} {CRCS}"), mark(node, rank, f"ok {rank}")]
    return lines


def outcome(node: str, state: str = "ok", code: int | None = 0, error: str | None = None) -> NodeOutcome:
    return NodeOutcome(node, NAMES.index(node), state, code, 5.0, error, None, ())


def verdicts(outcomes: list[NodeOutcome], lines: dict[str, list[OutputLine]],
             timed_out: bool = False) -> dict[str, CheckResult]:
    summary = RunSummary("smoke", 0, "", tuple(outcomes), "")
    ran = SmokeRun(summary, {name: tuple(found) for name, found in lines.items()}, timed_out)
    return {result.node: result for result in smoke_verdicts(CONTEXT, ran)}


def test_parse_marks_reads_every_step() -> None:
    marks = parse_marks(healthy_lines("node1", 2) + [mark("node1", 3, "error 3 RuntimeError: boom")])
    assert marks.started == marks.joined == marks.ok == {2, 3}
    assert marks.gathered is not None and len(marks.gathered) == 6
    assert marks.errors == {3: "RuntimeError: boom"}


def test_healthy_job_passes_every_node() -> None:
    results = verdicts([outcome(name) for name in NAMES],
                       {name: healthy_lines(name, 2 * index) for index, name in enumerate(NAMES)})
    assert {result.status for result in results.values()} == {"pass"}
    assert "2 ranks joined the 6-rank job" in results["node1"].summary


def test_a_hostname_missing_from_the_gather_fails_that_node() -> None:
    lines = {name: healthy_lines(name, 2 * index) for index, name in enumerate(NAMES)}
    context_crcs = CRCS.replace(str(zlib.crc32(b"node2")), "7")
    lines = {name: [OutputLine(line.node, line.rank, line.stream, line.text.replace(CRCS, context_crcs))
                    for line in found] for name, found in lines.items()}
    results = verdicts([outcome(name) for name in NAMES], lines)
    assert results["node2"].status == "fail" and "never joined" in results["node2"].summary
    assert results["node0"].status == "pass"


def test_the_node_that_fails_by_itself_is_named() -> None:
    lines = {"node0": [mark("node0", 0, "start 0 node0")], "node1": [mark("node1", 2, "start 2 node1")],
             "node2": [mark("node2", 4, "start 4 node2"), mark("node2", 4, "error 4 RuntimeError: no device")]}
    outcomes = [outcome("node0", "torn down", 143), outcome("node1", "torn down", 143),
                outcome("node2", "failed", 1, "rank 4: RuntimeError: no device")]
    results = verdicts(outcomes, lines)
    assert {name for name, result in results.items() if result.status == "fail"} == {"node2"}
    assert "RuntimeError: no device" in results["node2"].summary
    assert results["node0"].status == "skip" and "node2" in results["node0"].summary


def test_a_timeout_blames_the_nodes_that_never_joined_not_the_first_to_time_out() -> None:
    lines = {"node0": [mark("node0", 0, "start 0 node0"), mark("node0", 0, "joined 0"),
                       mark("node0", 0, "error 0 RuntimeError: Timed out waiting 30000ms for recv")],
             "node1": [mark("node1", 2, "start 2 node1")], "node2": [mark("node2", 4, "start 4 node2")]}
    outcomes = [outcome("node0", "failed", 1), outcome("node1", "torn down", 143), outcome("node2", "torn down", 143)]
    results = verdicts(outcomes, lines)
    assert {name for name, result in results.items() if result.status == "fail"} == {"node1", "node2"}
    assert "never joined the process group" in results["node1"].summary
    assert "ip_local_port_range" in results["node1"].fix


def test_a_peer_gone_first_blames_the_nodes_that_never_joined_not_the_node_that_said_it() -> None:
    """node1's and node2's ranks cannot connect to each other: node0's joined, the others never
    did. The first to end at its timeout closed its connections, and node0's ranks, waiting in
    the all_reduce, said their peer went away; node0's torchrun reported first (a race a loaded
    machine loses: CI's run 30), so the others were torn down."""
    closed = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.128.0.3]:41000"
    lines = {"node0": [mark("node0", 0, "start 0 node0"), mark("node0", 0, "joined 0"), mark("node0", 1, "start 1 node0"),
                       mark("node0", 1, "joined 1"), mark("node0", 0, f"error 0 {closed}")],
             "node1": [mark("node1", 2, "start 2 node1"), mark("node1", 3, "start 3 node1"), mark("node1", 2, "joined 2")],
             "node2": [mark("node2", 4, "start 4 node2"), mark("node2", 5, "start 5 node2")]}
    outcomes = [outcome("node0", "failed", 1), outcome("node1", "torn down", 143), outcome("node2", "torn down", 143)]
    results = verdicts(outcomes, lines)
    assert {name for name, result in results.items() if result.status == "fail"} == {"node1", "node2"}
    assert "never joined the process group" in results["node2"].summary
    assert results["node0"].status == "skip" and "node1, node2" in results["node0"].summary


def test_a_peer_gone_where_every_rank_joined_still_names_the_node_that_failed() -> None:
    """Every rank joined: no node is the one that never did, and the node that failed first is
    named as before (its error says what it saw)."""
    closed = "RuntimeError: Connection reset by peer"
    lines = {name: [mark(name, 2 * index, f"start {2 * index} {name}"), mark(name, 2 * index, f"joined {2 * index}")]
             for index, name in enumerate(NAMES)}
    lines["node1"].append(mark("node1", 2, f"error 2 {closed}"))
    outcomes = [outcome("node0", "torn down", 143), outcome("node1", "failed", 1), outcome("node2", "torn down", 143)]
    results = verdicts(outcomes, lines)
    assert {name for name, result in results.items() if result.status == "fail"} == {"node1"}
    assert "it failed first" in results["node1"].summary and closed in results["node1"].summary


def test_a_node_whose_ranks_never_started_is_the_one_named_after_a_timeout() -> None:
    lines = {"node0": [mark("node0", 0, "start 0 node0")], "node1": [mark("node1", 1, "start 1 node1")],
             "node2": []}
    outcomes = [outcome("node0", "torn down", 143), outcome("node1", "torn down", 143),
                outcome("node2", "torn down", 143)]
    results = verdicts(outcomes, lines, timed_out=True)
    assert {name for name, result in results.items() if result.status == "fail"} == {"node2"}
    assert "never got through the rendezvous" in results["node2"].summary


def test_a_node_that_could_not_start_is_named_first() -> None:
    outcomes = [outcome("node0", "torn down", 143), outcome("node1", "not started", None, "cannot start the job"),
                outcome("node2", "torn down", 143)]
    results = verdicts(outcomes, {"node0": [], "node1": [], "node2": []})
    assert {name for name, result in results.items() if result.status == "fail"} == {"node1"}
    assert "cannot start the job" in results["node1"].summary


def test_collective_figures_and_nccl_falling_back_to_sockets() -> None:
    lines = {name: healthy_lines(name, 2 * index) for index, name in enumerate(NAMES)}
    lines["node0"] += [mark("node0", 0, "busbw 0 gloo 1048576 0.8"), mark("node0", 0, "busbw 0 gloo 8388608 2.5"),
                       mark("node0", 0, "rdma 0 1")]
    lines["node1"] += [mark("node1", 2, "pair 2 0 1 3.5")]
    lines["node2"] += [mark("node2", 4, "pair 4 1 2 0.4"), mark("node2", 4, "busbw 4 gloo cut")]
    lines["node0"].append(mark("node0", 0, "pair 0 2 0 3.1"))
    results = verdicts([outcome(name) for name in NAMES], lines)
    cluster = results["cluster"]
    assert cluster.status == "pass"
    assert "gloo all_reduce bus bandwidth (Gbit/s): 1 MiB 0.8, 8 MiB 2.5" in cluster.summary
    assert "slowest node pair node1 -> node2 0.4 Gbit/s (of 3, median 3.1)" in cluster.summary
    nccl = SmokeContext(INVENTORY, {name: name for name in NAMES}, ("gloo", "nccl"), 60.0, 8.0)
    lines["node1"].append(OutputLine("node1", 2, "out", "node1:1:1 [0] NCCL INFO Channel 00/0 : 2[0] -> 4[0] "
                                                        "via NET/Socket/0"))
    ran = SmokeRun(RunSummary("smoke", 0, "", tuple(outcome(name) for name in NAMES), ""),
                   {name: tuple(found) for name, found in lines.items()}, False)
    warned = [result for result in smoke_verdicts(nccl, ran) if result.status == "warn"]
    assert len(warned) == 1 and "NET/Socket" in warned[0].summary and "node0" in warned[0].summary


NCCL_LOGS = Path(__file__).parent / "data" / "gpu" / "nccl"


def nccl_log(name: str, node: str = "node0") -> list[OutputLine]:
    return [OutputLine(node, None, "out", text) for text in (NCCL_LOGS / name).read_text().splitlines()]


@pytest.mark.parametrize("name,transports,socket_ranks", [
    ("nccl-1232-socket-two-nodes.txt", {"NET/Socket", "SHM"}, {(0, 1), (2, 1), (1, 0)}),
    ("nccl-687-ib-gdrdma.txt", {"NET/IB", "P2P/IPC"}, set()),
    ("nccl-1814-ibext-plugin.txt", {"NET/IBext"}, set()),
    ("nccl-952-socket-beside-p2p.txt", {"P2P/IPC", "NET/Socket"}, {(15, 6)}),
    ("horovod-3658-socket-mpirun-prefix.txt", {"NET/Socket"}, {(4, 5), (3, 4)}),
])
def test_real_nccl_logs_say_their_transport(name: str, transports: set[str],
                                            socket_ranks: set[tuple[int, int]]) -> None:
    marks = parse_marks(nccl_log(name))
    assert (marks.transports, marks.socket_ranks) == (transports, socket_ranks)


def _socket_job(active: int) -> CheckResult:
    """NVIDIA/nccl#1232's two nodes (ranks 0, 2 on the first, 1, 3 on the second) as a
    smoke job whose nodes have two RDMA devices each, ``active`` ports of them up."""
    names = ("node0", "node1")
    inventory = parse({"cluster": {"port": 29500}, "hosts": [{"name": name} for name in names]}, Path("hosts.toml"))
    context = SmokeContext(inventory, {name: name for name in names}, ("gloo", "nccl"), 60.0, 8.0)
    log = nccl_log("nccl-1232-socket-two-nodes.txt")
    crcs = ",".join(str(zlib.crc32(name.encode())) for name in ("node0", "node1", "node0", "node1"))

    def ranks(node: str, mine: tuple[int, int]) -> list[OutputLine]:
        return [mark(node, rank, f"{step} {rank}{rest}") for rank in mine
                for step, rest in (("start", f" {node}"), ("joined", ""), ("gathered", f" {crcs}"), ("ok", ""))]

    lines = {"node0": ranks("node0", (0, 2))
             + [mark("node0", 0, f"rdma 0 2 {active}"), mark("node0", 0, "busbw 0 nccl 1048576 0.9")]
             + [line._replace(node="node0") for line in log if " node0:" in line.text],
             "node1": ranks("node1", (1, 3)) + [mark("node1", 1, f"rdma 1 2 {active}")]
             + [line._replace(node="node1") for line in log if " node2:" in line.text]}
    ran = SmokeRun(RunSummary("smoke", 0, "", tuple(NodeOutcome(name, index, "ok", 0, 5.0, None, None, ())
                                                    for index, name in enumerate(names)), ""),
                   {name: tuple(found) for name, found in lines.items()}, False)
    (transport,) = [result for result in smoke_verdicts(context, ran)
                    if result.node == "cluster" and result.summary.startswith("NCCL")]
    return transport


def test_sockets_beside_active_rdma_ports_fail_naming_the_pair_and_the_bandwidth() -> None:
    result = _socket_job(active=2)
    assert (result.status, result.summary) == (
        "fail", "NCCL chose sockets (NET/Socket) between node0 and node1, while node0, node1 have active RDMA ports: "
                "NCCL fell back from InfiniBand/RoCE (often 4-5x slower); NCCL all_reduce bus bandwidth (Gbit/s): "
                "1 MiB 0.9")
    assert result.fix.startswith("run with --env NCCL_DEBUG=INFO and read why NCCL skipped the IB transport")


def test_sockets_beside_rdma_devices_without_a_link_only_warn() -> None:
    result = _socket_job(active=0)
    assert result.status == "warn" and result.summary.startswith("NCCL chose sockets (NET/Socket) between nodes, "
                                                                 "while node0, node1 have an RDMA device")
