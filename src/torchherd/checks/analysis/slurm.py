"""SLURM's own view of a job, for ``check``: the partition, each node it may run on,
and GPUs against the processes per node, judged from ``sinfo``'s rows. Pure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Protocol, Sequence

from torchherd.checks.results import CLUSTER, CheckResult, CheckStatus
from torchherd.inventory.nodeset import NodesetError
from torchherd.inventory.nodeset import expand as expand_nodeset


class Where(Protocol):
    """Which nodes the job asks SLURM for (the batch script's ``Placement``)."""

    @property
    def nodes(self) -> int | None: ...

    @property
    def nodelist(self) -> str | None: ...


class Asked(Protocol):
    """What the job asks of the partition (the ``[slurm]`` settings, ``engine.slurm.settings``)."""

    @property
    def partition(self) -> str | None: ...

    @property
    def gpus_per_node(self) -> int | None: ...


SINFO_FORMAT = "%N|%P|%a|%T|%c|%G|%E"


@dataclass(frozen=True)
class NodeInfo:
    """One node of one partition, as ``sinfo -N -o SINFO_FORMAT`` lists it."""

    node: str
    partition: str
    default: bool
    available: str
    state: str
    cpus: int | None
    gpus: int
    reason: str


def parse_sinfo(stdout: str) -> list[NodeInfo]:
    rows = []
    for line in stdout.split("\n"):
        fields = line.strip().split("|", 6)
        if len(fields) != 7 or not fields[0]:
            continue
        node, partition, available, state, cpus, gres, reason = fields
        rows.append(NodeInfo(node, partition.rstrip("*"), partition.endswith("*"), available, state,
                             int(cpus) if cpus.isascii() and cpus.isdigit() else None, gres_gpus(gres),
                             "" if reason in ("none", "(null)") else reason))
    return rows


def gres_gpus(gres: str) -> int:
    """GPUs in a GRES string: ``gpu:4``, ``gpu:a100:4(S:0-1)``, ``gpu:2,mps:100``, ``(null)``."""
    total = 0
    for item in re.split(r",(?![^(]*\))", gres):
        parts = re.sub(r"\(.*\)$", "", item.strip()).split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isascii() and parts[-1].isdigit():
            total += int(parts[-1])
    return total


BAD_STATES = ("down", "drain", "fail", "maint", "inval", "not_responding", "future", "unknown", "power")


BUSY_STATES = ("alloc", "mixed", "completing", "reserved", "planned")


def node_condition(state: str) -> Literal["usable", "busy", "bad"]:
    """``idle``: usable; allocated or mixed: busy (the job queues); drained, down, ...: bad."""
    word = state.lower()
    if word.endswith("*") or any(bad in word for bad in BAD_STATES):
        return "bad"
    return "busy" if any(busy in word for busy in BUSY_STATES) else "usable"


def slurm_view(rows: Sequence[NodeInfo], settings: Asked, where: Where,
               nproc: int | str) -> list[CheckResult]:
    """SLURM's own view of the job: the partition, each node it may run on, and GPUs
    against the processes per node. Pure: the rows are ``sinfo``'s."""
    partition = settings.partition or next((row.partition for row in rows if row.default), None)
    if partition is None:
        return [CheckResult(CLUSTER, "slurm", "fail", "no partition given and SLURM has no default one",
                            "set partition in [slurm] (sinfo lists them)")]
    in_partition = [row for row in rows if row.partition == partition]
    if not in_partition:
        known = sorted({row.partition for row in rows})
        return [CheckResult(CLUSTER, "slurm", "fail", f"partition {partition!r} does not exist",
                            f"known partitions: {', '.join(known) or 'none'}")]
    results = [_partition_result(partition, in_partition)]
    wanted = _wanted(where, in_partition, results)
    results += [_node_result(row, wanted is not None) for row in in_partition
                if wanted is None or row.node in wanted]
    results += _count_result(where, in_partition)
    results += _gres_results(in_partition if wanted is None else [row for row in in_partition if row.node in wanted],
                             settings, nproc)
    return results


def _partition_result(partition: str, rows: Sequence[NodeInfo]) -> CheckResult:
    if rows[0].available != "up":
        return CheckResult(CLUSTER, "slurm", "fail", f"partition {partition} is {rows[0].available}",
                           "ask the cluster's admins, or pick another partition")
    counts: dict[str, int] = {}
    for row in rows:
        counts[node_condition(row.state)] = counts.get(node_condition(row.state), 0) + 1
    shown = ", ".join(f"{count} {word}" for word, count in sorted(counts.items()))
    return CheckResult(CLUSTER, "slurm", "pass", f"partition {partition} is up: {len(rows)} nodes ({shown})")


def _wanted(where: Where, rows: Sequence[NodeInfo], results: list[CheckResult]) -> set[str] | None:
    if where.nodelist is None:
        return None
    try:
        names = set(expand_nodeset(where.nodelist))
    except NodesetError as error:
        results.append(CheckResult(CLUSTER, "slurm", "fail", f"nodelist {where.nodelist!r}: {error}"))
        return set()
    known = {row.node for row in rows}
    for name in sorted(names - known):
        results.append(CheckResult(name, "slurm-node", "fail", f"{name} is not in the partition",
                                   "check the nodelist (sinfo -N lists the nodes)"))
    return names


def _node_result(row: NodeInfo, named: bool) -> CheckResult:
    condition = node_condition(row.state)
    reason = f" ({row.reason})" if row.reason else ""
    if condition == "usable":
        return CheckResult(row.node, "slurm-node", "pass", f"{row.node} is {row.state}")
    if condition == "busy":
        return CheckResult(row.node, "slurm-node", "warn" if named else "pass",
                           f"{row.node} is {row.state}" + (": the job waits for it" if named else ""))
    status: CheckStatus = "fail" if named else "warn"
    return CheckResult(row.node, "slurm-node", status, f"{row.node} is {row.state}{reason}",
                       "the job cannot start until an admin resumes it (scontrol update nodename=... state=resume)"
                       if named else "SLURM will not place the job there")


def _count_result(where: Where, rows: Sequence[NodeInfo]) -> list[CheckResult]:
    if where.nodes is None:
        return []
    fit = [row for row in rows if node_condition(row.state) != "bad"]
    if len(fit) < where.nodes:
        return [CheckResult(CLUSTER, "slurm", "fail",
                            f"the job needs {where.nodes} nodes; {len(fit)} of the partition can take it",
                            "resume the drained or down nodes, or ask for fewer")]
    return []


def _gres_results(rows: Sequence[NodeInfo], settings: Asked, nproc: int | str) -> list[CheckResult]:
    results = []
    for row in rows:
        asked = settings.gpus_per_node
        if asked is not None and row.gpus < asked:
            results.append(CheckResult(row.node, "gres", "fail", f"{row.node} has {row.gpus} GPUs; "
                                       f"gpus_per_node is {asked}", "lower gpus_per_node, or pick other nodes"))
        elif nproc == "gpu" and row.gpus == 0:
            results.append(CheckResult(row.node, "gres", "fail", f"{row.node} has no GPU in its GRES; "
                                       "nproc_per_node is \"gpu\"", "set nproc_per_node to a number"))
        elif isinstance(nproc, int) and row.gpus and nproc > row.gpus:
            results.append(CheckResult(row.node, "gres", "warn", f"{row.node} has {row.gpus} GPUs for "
                                       f"{nproc} processes: ranks would share GPUs"))
        elif isinstance(nproc, int) and row.cpus is not None and nproc > row.cpus:
            results.append(CheckResult(row.node, "gres", "fail", f"{row.node} has {row.cpus} CPUs for "
                                       f"{nproc} processes", "lower nproc_per_node"))
        else:
            have = f"{row.gpus} GPUs" if row.gpus else "no GPUs"
            results.append(CheckResult(row.node, "gres", "pass", f"{row.node}: {have}, {row.cpus} CPUs "
                                       f"for {nproc} processes"))
    return results
