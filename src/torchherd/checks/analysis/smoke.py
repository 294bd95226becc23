"""``smoke``: judges what the tiny real job printed (remote/smoke.py's marks) and how
each node's part ended, and names the node(s) at fault.

Blame, first rule that names anyone: nodes whose job could not start or that
vanished; when the first failure was a timeout (someone waited for a peer), the nodes
that failed only say a peer went away, or the whole job timed out: the nodes whose
ranks never started (they never got through the rendezvous), else those whose ranks
never joined the process group; else the node that failed first by itself; else every
node that did not finish.
"""

from __future__ import annotations

import math
import re
import statistics
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Sequence

from torchherd.checks.results import CLUSTER, CheckResult
from torchherd.inventory import Inventory

if TYPE_CHECKING:  # the smoke job's summary, in annotations only: `check` without it never loads a run's
    from torchherd.runlog import NodeOutcome, OutputLine, RunSummary

CHECK = "smoke"
_MARK = re.compile(r"torchherd-smoke (start|joined|gathered|nccl|error|ok|busbw|pair|rdma) (\d+) ?(.*)")
_NCCL_VIA = re.compile(r"NCCL INFO .*\bvia (NET/[A-Za-z]+|P2P/[A-Za-z]+|SHM|P2P)")
"""NCCL_DEBUG=INFO's channel lines: "Channel 00/0 : 0[0] -> 1[1] via NET/IB/0" (or NET/Socket;
NET/IBext for HPC-X's plugin, NET/Libfabric or NET/OFI for AWS's)."""
_NCCL_RANKS = re.compile(r"\b(\d+)\[[0-9a-fA-F]*\] -> (\d+)\[[0-9a-fA-F]*\]")
"""The two ranks a channel line connects: "15[7] -> 6[6]" (rank[device or bus id])."""
_TIMEOUT_WORDS = re.compile(r"timed? ?out", re.IGNORECASE)
_GONE = ("lost", "not started", "unresponsive")


@dataclass(frozen=True)
class SmokeContext:
    inventory: Inventory
    hostnames: Mapping[str, str]
    """Each node's hostname, from the facts: its zlib.crc32 is what the ranks gather."""
    backends: tuple[str, ...]
    timeout: float
    seconds: float


@dataclass
class NodeMarks:
    """What one node's ranks printed."""

    started: set[int] = field(default_factory=set)
    joined: set[int] = field(default_factory=set)
    ok: set[int] = field(default_factory=set)
    nccl: set[int] = field(default_factory=set)
    gathered: list[int] | None = None
    errors: dict[int, str] = field(default_factory=dict)
    busbw: list[tuple[str, int, float]] = field(default_factory=list)
    """(backend, bytes, Gbit/s) of each all_reduce size (rank 0's node)."""
    pairs: list[tuple[int, int, float]] = field(default_factory=list)
    """(from node rank, to node rank, Gbit/s), said by the receiving node."""
    rdma: int = 0
    rdma_active: int | None = None
    """Ports of those devices that are ACTIVE; None from a smoke script that did not say."""
    transports: set[str] = field(default_factory=set)
    """What NCCL_DEBUG=INFO says the channels go through (NET/IB, NET/Socket, P2P/IPC, SHM)."""
    socket_ranks: set[tuple[int, int]] = field(default_factory=set)
    """The (from, to) global ranks of the channels that went through NET/Socket."""


def parse_marks(lines: Sequence[OutputLine]) -> NodeMarks:
    marks = NodeMarks()
    for line in lines:
        via = _NCCL_VIA.search(line.text)
        if via is not None:
            marks.transports.add(via.group(1))
            ranks = _NCCL_RANKS.search(line.text)
            if via.group(1) == "NET/Socket" and ranks is not None:
                marks.socket_ranks.add((int(ranks.group(1)), int(ranks.group(2))))
        match = _MARK.search(line.text)
        if match is None:
            continue
        step, rank, rest = match.group(1), int(match.group(2)), match.group(3).strip()
        if step in ("busbw", "pair", "rdma"):
            _figure(marks, step, rest.split())
        elif step == "gathered":
            marks.gathered = [int(value) for value in rest.split(",") if value.isascii() and value.isdigit()]
        elif step == "error":
            marks.errors.setdefault(rank, rest)
        else:
            {"start": marks.started, "joined": marks.joined, "ok": marks.ok, "nccl": marks.nccl}[step].add(rank)
    return marks


def _figure(marks: NodeMarks, step: str, words: list[str]) -> None:
    try:
        if step == "busbw":
            marks.busbw.append((words[0], int(words[1]), float(words[2])))
        elif step == "pair":
            marks.pairs.append((int(words[0]), int(words[1]), float(words[2])))
        else:
            marks.rdma = int(words[0])
            marks.rdma_active = int(words[1]) if len(words) > 1 else None
    except (IndexError, ValueError):  # a line cut short: the figure is missing, not the verdict
        pass


@dataclass(frozen=True)
class SmokeRun:
    """What run_quietly returned, reduced to what the verdict reads."""

    summary: RunSummary
    lines: Mapping[str, tuple[OutputLine, ...]]
    timed_out: bool


def smoke_verdicts(context: SmokeContext, ran: SmokeRun) -> list[CheckResult]:
    names = [host.name for host in context.inventory.hosts]
    outcomes = {outcome.node: outcome for outcome in ran.summary.nodes}
    marks = {name: parse_marks(ran.lines.get(name, ())) for name in names}
    finished = [name for name in names if _finished(outcomes.get(name), marks[name])]
    if len(finished) == len(names):
        blamed = _not_gathered(context, marks)
        if not blamed:
            return [_passed(context, name, marks) for name in names] + _collective(context, names, marks)
    else:
        blamed = _blame(names, outcomes, marks, ran.timed_out, context.timeout)
    first = ", ".join(blamed)
    return [_failed(context, name, blamed[name], outcomes.get(name), marks[name]) if name in blamed
            else _passed(context, name, marks) if name in finished
            else CheckResult(name, CHECK, "skip", f"{name}: not at fault as far as the smoke job shows "
                             f"({_progress(marks[name])}); the job failed on {first}")
            for name in names]


def _finished(outcome: NodeOutcome | None, marks: NodeMarks) -> bool:
    return outcome is not None and outcome.state == "ok" and bool(marks.started) and marks.ok >= marks.started


def crc(hostname: str) -> int:
    return zlib.crc32(hostname.encode("utf-8"))


def _not_gathered(context: SmokeContext, marks: Mapping[str, NodeMarks]) -> dict[str, str]:
    gathered = next((mark.gathered for mark in marks.values() if mark.gathered is not None), None)
    if gathered is None:
        return {name: "no rank reported the all_gather of hostnames" for name in marks}
    return {name: f"its hostname {context.hostnames[name]!r} (crc32 {crc(context.hostnames[name])}) is not among "
                  f"the ones the ranks gathered ({', '.join(map(str, gathered))}): it never joined"
            for name in marks if name in context.hostnames and crc(context.hostnames[name]) not in gathered}


def _blame(names: list[str], outcomes: Mapping[str, NodeOutcome], marks: Mapping[str, NodeMarks],
           timed_out: bool, timeout: float) -> dict[str, str]:
    gone = {name: f"its part of the job {outcomes[name].state}" for name in names
            if name in outcomes and outcomes[name].state in _GONE}
    if gone:
        return gone
    failed = [name for name in names if name in outcomes and outcomes[name].state == "failed"]
    errors = [_first_error(outcomes[name], marks[name]) for name in failed]
    # The failure came from elsewhere: a rank waited for a peer until its timeout, or every
    # node that failed only says a peer went away (a rank that never joined ended at its
    # timeout and closed its connections: which node's torchrun reports first is a race,
    # lost by the waiting nodes on a loaded machine).
    waited = (timed_out or any(_TIMEOUT_WORDS.search(error) for error in errors)
              or (bool(errors) and all(_peer_gone(error) for error in errors)))
    if waited:
        silent = {name: "its ranks never started: it never got through the rendezvous" for name in names
                  if not marks[name].started and (failed or timed_out)}
        if silent and len(silent) < len(names):
            return silent
        unjoined = {name: "its ranks never joined the process group" for name in names
                    if marks[name].started - marks[name].joined}
        if unjoined and len(unjoined) < len(names):
            return unjoined
    if failed:
        return {name: "it failed first" for name in failed}
    if timed_out:
        return {name: f"the job did not finish within {timeout:.0f} s" for name in names
                if not _finished(outcomes.get(name), marks[name])}
    return {name: "its part of the job did not finish" for name in names
            if not _finished(outcomes.get(name), marks[name])}


def _peer_gone(error: str) -> bool:
    from torchherd.runlog import says_peer_gone  # only a failed smoke job needs a run's words

    return says_peer_gone(error)


def _first_error(outcome: NodeOutcome | None, marks: NodeMarks) -> str:
    if marks.errors:
        rank = min(marks.errors)
        return f"rank {rank}: {marks.errors[rank]}"
    if outcome is not None and outcome.first_error:
        return outcome.first_error
    if outcome is not None and outcome.last_lines:
        return outcome.last_lines[-1]
    return ""


def _progress(marks: NodeMarks) -> str:
    if not marks.started:
        return "no rank started"
    return f"{len(marks.started)} ranks started, {len(marks.joined)} joined, {len(marks.ok)} finished"


def _collective(context: SmokeContext, names: list[str], marks: Mapping[str, NodeMarks]) -> list[CheckResult]:
    """The collective's figures on ``cluster``: each size's bus bandwidth, the slowest node
    pair, NCCL's transport (warn: sockets on nodes with an RDMA device)."""
    busbw = [figure for mark in marks.values() for figure in mark.busbw]
    # the job's output names pairs by node index: one out of range, or no finite figure, is left out
    pairs = [figure for mark in marks.values() for figure in mark.pairs
             if 0 <= figure[0] < len(names) and 0 <= figure[1] < len(names) and math.isfinite(figure[2])]
    if not busbw and not pairs:
        return []
    words = []
    for backend in context.backends:
        sizes = [f"{size >> 20} MiB {gbit:.3g}" for name, size, gbit in busbw if name == backend]
        if sizes:
            words.append(f"{backend} all_reduce bus bandwidth (Gbit/s): {', '.join(sizes)}")
    if pairs:
        low = min(pairs, key=lambda pair: pair[2])
        words.append(f"slowest node pair {names[low[0]]} -> {names[low[1]]} {low[2]:.3g} Gbit/s "
                     f"(of {len(pairs)}, median {statistics.median(pair[2] for pair in pairs):.3g})")
    results = [CheckResult(CLUSTER, CHECK, "pass", "; ".join(words))]
    if "nccl" in context.backends:
        results.append(_transport(names, marks, busbw))
    return results


def _transport(names: list[str], marks: Mapping[str, NodeMarks],
               busbw: list[tuple[str, int, float]] | None = None) -> CheckResult:
    """NCCL's transport between the nodes: a fail when it chose sockets while nodes have
    active RDMA ports (the job runs, 4-5x slower), a warn where the RDMA devices have no
    active port or did not say."""
    transports = sorted({via for mark in marks.values() for via in mark.transports})
    rdma = [name for name in names if marks[name].rdma]
    if "NET/Socket" in transports and rdma:
        active = [name for name in names if marks[name].rdma_active]
        pairs = _socket_pairs(names, marks)
        between = f" between {', '.join(pairs[:3])}" + (f" and {len(pairs) - 3} more pairs" if len(pairs) > 3 else "")
        nccl = [f"{size >> 20} MiB {gbit:.3g}" for backend, size, gbit in busbw or [] if backend == "nccl"]
        figures = f"; NCCL all_reduce bus bandwidth (Gbit/s): {', '.join(nccl)}" if nccl else ""
        fix = ("run with --env NCCL_DEBUG=INFO and read why NCCL skipped the IB transport: "
               "NCCL_IB_DISABLE, NCCL_IB_HCA, the rdma-core/libibverbs install, GID index for RoCE "
               "(NCCL_IB_GID_INDEX), or the container's access to /dev/infiniband")
        if active:
            return CheckResult(CLUSTER, CHECK, "fail",
                               f"NCCL chose sockets (NET/Socket){between if pairs else ' between nodes'}, while "
                               f"{', '.join(active)} have active RDMA ports: NCCL fell back from InfiniBand/RoCE "
                               f"(often 4-5x slower){figures}", fix)
        return CheckResult(CLUSTER, CHECK, "warn",
                           f"NCCL chose sockets (NET/Socket) between nodes, while {', '.join(rdma)} have an RDMA "
                           f"device: NCCL fell back from InfiniBand/RoCE (often 4-5x slower){figures}", fix)
    said = ", ".join(transports) if transports else "not said (no NCCL_DEBUG=INFO channel line)"
    return CheckResult(CLUSTER, CHECK, "pass", f"NCCL transport: {said}")


def _socket_pairs(names: list[str], marks: Mapping[str, NodeMarks]) -> list[str]:
    """The node pairs whose channels went through sockets, by the ranks each node started."""
    node_of = {rank: name for name in names for rank in marks[name].started}
    pairs = {tuple(sorted((node_of[one], node_of[two]), key=names.index))
             for mark in marks.values() for one, two in mark.socket_ranks
             if one in node_of and two in node_of and node_of[one] != node_of[two]}
    return [f"{one} and {two}" for one, two in sorted(pairs, key=lambda pair: (names.index(pair[0]),
                                                                             names.index(pair[1])))]


def _passed(context: SmokeContext, name: str, marks: Mapping[str, NodeMarks]) -> CheckResult:
    mine = marks[name]
    world = sum(len(mark.started) for mark in marks.values())
    nccl = "; NCCL all_reduce right" if "nccl" in context.backends else ""
    return CheckResult(name, CHECK, "pass",
                       f"{len(mine.started)} ranks joined the {world}-rank job; gloo all_reduce sum right; "
                       f"all_gather saw every node's hostname{nccl} ({context.seconds:.1f} s for the whole job)")


def _failed(context: SmokeContext, name: str, reason: str, outcome: NodeOutcome | None,
            marks: NodeMarks) -> CheckResult:
    exit_part = ""
    if outcome is not None and outcome.exit_code is not None:
        exit_part = f", exit {outcome.exit_code}"
    error = _first_error(outcome, marks)
    summary = (f"{name}: {reason} ({_progress(marks)}{exit_part})" + (f": {error}" if error else ""))
    return CheckResult(name, CHECK, "fail", summary, _fix(context, name, marks))


def _fix(context: SmokeContext, name: str, marks: NodeMarks) -> str:
    master = context.inventory.hosts[0].name
    if not marks.started:
        return (f"{name}'s torchrun did not get through the rendezvous with {master}:"
                f"{context.inventory.cluster.port}: check its setup snippet, python and the master address "
                f"it is given (torchherd run --dry-run shows the command), and its output above")
    if marks.started - marks.joined:
        return (f"the process group could not form on {name}: check GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME in its "
                f"inventory env and setup snippet, and that every node reaches every other on the whole "
                f"ip_local_port_range (gloo and NCCL connect all ranks pairwise on random ports)")
    if "nccl" in context.backends and marks.joined - marks.nccl:
        return (f"NCCL failed on {name}: rerun with --env NCCL_DEBUG=INFO via torchherd run, and compare the "
                f"interface NCCL picks with the network check's")
    return f"look at {name}'s output: torchherd run of a small script shows it in full"
