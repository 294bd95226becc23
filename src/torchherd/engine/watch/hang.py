"""A hung job (``--hang-timeout S``): no rank printed a line and no rank used CPU for S
seconds. ``HangWatch`` finds it, over sessions to the job's nodes (an SSH run's own; on
SLURM, job steps beside the job's: ``srun --overlap``), takes ``py-spy dump`` of every
rank where the nodes have py-spy, and sends SIGABRT to every rank (the job runs with
``PYTHONFAULTHANDLER=1``: each rank prints every thread's Python stack before it dies);
``stacks_of`` and ``spy_stacks`` read those stacks and ``described`` names the rank
whose stack differs from the others'.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

from torchherd.errors import TransportError
from torchherd.plan import Plan
from torchherd.remote import command as node_program
from torchherd.runlog import OutputLine
from torchherd.shell import quote_path
from torchherd.transport import Session, fan_out

FAULTHANDLER = "PYTHONFAULTHANDLER"
_BLOCK = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-fA-F]+ \(most recent call first\):")
_FRAME = re.compile(r'^\s*File "(?P<file>.+)", line (?P<line>\d+) in (?P<function>.+)$')
_SPY_THREAD = re.compile(r'^Thread (?:0x)?[0-9a-fA-F]+ \([^)]*\)')
_SPY_FRAME = re.compile(r"^\s+(?P<function>\S.*?) \((?P<file>.+):(?P<line>\d+)\)$")
_LIBRARY = ("/site-packages/", "/dist-packages/", "/lib/python3")
IDLE_SHARE = 0.05
"""Below this share of a core per rank, the ranks use no CPU: gloo's blocked collectives
wake a few times a second (about 0.3 % of a core each, measured on the test cluster)."""
PROBE_TIMEOUT = 20.0
"""Seconds one probe may take on a node (a SLURM job step starts in about one)."""
SPY_PROBE_TIMEOUT = 60.0
"""Seconds the py-spy probe may take on a node (a second or so per rank)."""
THAW_AFTER = PROBE_TIMEOUT + SPY_PROBE_TIMEOUT + 40.0
"""Seconds after ``stop`` the probe's own guard continues the ranks it froze, should no
``abort`` come (the controller died): longer than the spy and the abort may take."""
FR_PROBE_TIMEOUT = 20.0
"""The flight recorder probe: the ranks' records are asked, and waited for 3 s on the node."""
ABORT_WAIT = 10.0
"""Seconds the ranks have to print their stacks and die before the run is stopped."""


@dataclass(frozen=True)
class RankStack:
    """Where one rank was when it was stopped: its innermost function, and the innermost
    line of the job's own code (``train.py:42``)."""

    node: str
    rank: int
    function: str
    where: str


Frame = tuple[str, int, str]
"""Where a thread is: file, line, function (innermost first in a block)."""


def stacks_of(lines: Sequence[OutputLine]) -> list[RankStack]:
    """Each rank's stack from faulthandler's output, in rank order: the first thread
    block that passes through the job's own code (else the first block)."""
    blocks: dict[int, list[list[Frame]]] = defaultdict(list)
    nodes: dict[int, str] = {}
    open_block: dict[int, bool] = {}
    for line in lines:
        if line.rank is None:
            continue
        if _BLOCK.match(line.text.strip()):
            blocks[line.rank].append([])
            nodes[line.rank] = line.node
            open_block[line.rank] = True
            continue
        frame = _FRAME.match(line.text)
        if frame and open_block.get(line.rank):
            blocks[line.rank][-1].append((frame["file"], int(frame["line"]), frame["function"]))
        else:
            open_block[line.rank] = False
    found = (_chosen(nodes[rank], rank, blocks[rank]) for rank in sorted(blocks))
    return [stack for stack in found if stack is not None]


def spy_stacks(dumps: Mapping[tuple[str, int], str]) -> list[RankStack]:
    """Each rank's stack from ``py-spy dump``'s text (per node and rank), in rank order,
    chosen as from faulthandler's."""
    stacks = []
    for (node, rank), text in sorted(dumps.items(), key=lambda item: item[0][1]):
        blocks: list[list[Frame]] = []
        for line in text.splitlines():
            if _SPY_THREAD.match(line):
                blocks.append([])
                continue
            frame = _SPY_FRAME.match(line)
            if frame and blocks:
                blocks[-1].append((frame["file"], int(frame["line"]), frame["function"]))
        stack = _chosen(node, rank, blocks)
        if stack is not None:
            stacks.append(stack)
    return stacks


def merged(first: Sequence[RankStack], then: Sequence[RankStack]) -> list[RankStack]:
    """``first``'s stacks, and ``then``'s for the ranks ``first`` has none of; in rank order."""
    by_rank = {stack.rank: stack for stack in then}
    by_rank.update({stack.rank: stack for stack in first})
    return [by_rank[rank] for rank in sorted(by_rank)]


def _chosen(node: str, rank: int, blocks: Sequence[Sequence[Frame]]) -> RankStack | None:
    """The rank's stack: its first thread that passes through the job's own code (else its
    first thread), named by the innermost function and the innermost line of own code."""
    frames = next((block for block in blocks if any(_own(path) for path, _, _ in block)),
                  blocks[0] if blocks else ())
    if not frames:
        return None
    own = next(((path, number) for path, number, _ in frames if _own(path)), frames[0][:2])
    return RankStack(node, rank, frames[0][2], f"{posixpath.basename(own[0])}:{own[1]}")


def _own(path: str) -> bool:
    return not any(part in path for part in _LIBRARY) and not path.startswith("<")


def described(stacks: Sequence[RankStack]) -> str:
    """"rank 5 on node2 in main at train.py:40; ranks 0-4, 6-7 in all_reduce at
    train.py:42": the ranks whose stack differs from the most common one's first."""
    if not stacks:
        return "no rank printed its stack"
    groups: dict[tuple[str, str], list[RankStack]] = defaultdict(list)
    for stack in stacks:
        groups[(stack.function, stack.where)].append(stack)
    ordered = sorted(groups.values(), key=lambda group: (len(group), group[0].rank))
    parts = []
    for group in ordered:
        ranks = [stack.rank for stack in group]
        nodes = sorted({stack.node for stack in group})
        on = f" on {nodes[0]}" if len(nodes) == 1 and len(ordered) > 1 else ""
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranges(ranks)}"
        parts.append(f"{who}{on} in {group[0].function} at {group[0].where}")
    return "; ".join(parts)


def _ranges(ranks: Sequence[int]) -> str:
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(low) if low == high else f"{low}-{high}" for low, high in spans)


@dataclass(frozen=True)
class Issued:
    """What a rank's flight record says of one process group: the last collective it issued."""

    node: str
    rank: int
    seq: int
    """torch's ``collective_seq_id`` (0: none issued yet)."""
    name: str
    """``gloo:all_reduce``, ``nccl:all_gather``..."""


def flight_issued(records: Mapping[tuple[str, int], Mapping[str, Any]], group: str = "default_pg") -> list[Issued]:
    """Per rank with a record (node, rank), the last collective of ``group`` it issued."""
    issued = []
    for (node, rank), record in records.items():
        groups = record.get("groups")
        entries = groups.get(group) if isinstance(groups, dict) else None
        if not isinstance(entries, list):
            continue
        collectives = [entry for entry in entries if isinstance(entry, dict) and not entry.get("p2p")
                       and isinstance(entry.get("seq"), int) and not isinstance(entry.get("seq"), bool)]
        last = max(collectives, key=lambda entry: entry["seq"], default=None)
        issued.append(Issued(node, rank, last["seq"] if last else 0, str(last["name"]) if last else "none"))
    return sorted(issued, key=lambda one: one.rank)


def flight_described(issued: Sequence[Issued]) -> tuple[str, str | None]:
    """"flight recorder: ranks 0, 2 wait in collective 6 (gloo:all_reduce); rank 1 on
    node1 never issued it (its last: 5)", and the node of the rank(s) behind when they are
    on one node; ("", None) without records."""
    if not issued:
        return "", None
    front = max(one.seq for one in issued)
    ahead = [one for one in issued if one.seq == front]
    behind = [one for one in issued if one.seq < front]
    name = ahead[0].name
    if not behind:
        who = "every rank" if len(ahead) > 1 else f"rank {ahead[0].rank}"
        return f"flight recorder: {who} issued collective {front} ({name}), the last", None
    nodes = sorted({one.node for one in behind})
    on = f" on {nodes[0]}" if len(nodes) == 1 else ""
    lasts = sorted({one.seq for one in behind})
    last = f"its last: {lasts[0]}" if len(behind) == 1 else "their last: " + ", ".join(map(str, lasts))
    who = f"rank {behind[0].rank}" if len(behind) == 1 else f"ranks {_ranges([one.rank for one in behind])}"
    waiting = f"rank {ahead[0].rank} waits" if len(ahead) == 1 else f"ranks {_ranges([one.rank for one in ahead])} wait"
    return (f"flight recorder: {waiting} in collective {front} ({name}); {who}{on} never issued it ({last})",
            nodes[0] if len(nodes) == 1 else None)


@dataclass(frozen=True)
class Target:
    """One node of the job as the watch reaches it: its Python, and a session on it."""

    python: str
    session: Session
    supervisor: int | None = None
    """The pid of the node's supervisor: only its descendants are the job's ranks (0: not
    known yet, no rank). None: the environment alone (a SLURM job step, SLURM's job)."""


Targets = Mapping[str, Target]
"""Per node name."""


class Reachable(Protocol):
    """A job the watch can reach (an SSH ``Job``, a ``SlurmJob``): its nodes' targets,
    empty until they are known (SLURM: until the job has its allocation)."""

    def hang_targets(self) -> Targets: ...


def targets_of(plan: Plan, sessions: Mapping[str, Session], supervisors: Mapping[str, int | None]) -> Targets:
    """The targets of a plan's nodes, over ``sessions`` (an SSH run's own), each with its
    supervisor's pid (0 until the node said it started)."""
    return {node.host.name: Target(node.host.python, sessions[node.host.name], supervisors.get(node.host.name) or 0)
            for node in plan.nodes if node.host.name in sessions}


class HangWatch:
    """Watches one attempt: while no rank prints, it samples the ranks' CPU time on every
    node; once neither changed for ``timeout`` seconds, it sends every rank SIGABRT and
    sets ``hung`` (the run then ends as its ranks die)."""

    def __init__(self, run_id: str, job: Reachable, timeout: float,
                 on_hang: Callable[[float], None], stop: Callable[[], None]) -> None:
        self.run_id = run_id
        self.job = job
        self.timeout = timeout
        self.on_hang = on_hang
        self.stop = stop
        """Stops the run, when its ranks outlive their SIGABRT (a rank stuck outside Python)."""
        self.every = min(5.0, max(0.5, timeout / 4))
        self.last_output = time.monotonic()
        self.hung: float | None = None
        """When the hang was found (monotonic), or None."""
        self.stopped = False
        """The watch stopped the run itself (its ranks outlived their SIGABRT)."""
        self.flight: dict[tuple[str, int], dict[str, Any]] = {}
        """Per node and rank, its flight record's summary (remote/flight.py), asked before the stop."""
        self.dumps: dict[tuple[str, int], str] = {}
        """Per node and rank, ``py-spy dump`` of it while the ranks were stopped (nodes with py-spy)."""
        self._sample: tuple[float, tuple[float, int]] | None = None
        """The last CPU sample: when, and the ranks' CPU seconds and count."""
        self._last_cpu = self.last_output
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="torchherd-hang", daemon=True)

    def start(self) -> HangWatch:
        self._thread.start()
        return self

    def saw_output(self) -> None:
        self.last_output = time.monotonic()
        self._sample = None  # CPU is sampled afresh after the next silence

    def close(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(self.every):
            if time.monotonic() - self.last_output < self.every:
                continue
            self._sample_cpu()
            silent = time.monotonic() - max(self.last_output, self._last_cpu)
            if silent >= self.timeout and not self._done.is_set():
                self.hung = time.monotonic()
                self.on_hang(silent)
                self._flight()
                self._probe("stop")
                self._spy()
                self._probe("abort")
                if not self._done.wait(ABORT_WAIT):
                    self.stopped = True
                    self.stop()
                return

    def _sample_cpu(self) -> None:
        """Marks the ranks busy now unless they used less than ``IDLE_SHARE`` of a core each
        since the last sample (a rank blocked in a collective still wakes now and then)."""
        now, sample = time.monotonic(), self._probe("cpu")
        last, self._sample = self._sample, (now, sample) if sample is not None else None
        if last is None or sample is None:
            self._last_cpu = now  # nothing to compare with yet: busy, as far as anyone knows
            return
        (then, (cpu_then, ranks_then)), (cpu_now, ranks) = last, sample
        if ranks != ranks_then or (cpu_now - cpu_then) / max(now - then, 1e-3) > IDLE_SHARE * ranks:
            self._last_cpu = now  # a rank started or ended, or the ranks computed

    def _probe(self, action: str) -> tuple[float, int] | None:
        """The ranks' CPU seconds and their count, over every node (None when a node did not
        answer); ``stop`` sends the ranks SIGSTOP, ``abort`` SIGABRT (and SIGCONT, to take it)."""
        def ask(target: Target) -> tuple[float, int] | None:
            answer = self._ask(target, action, PROBE_TIMEOUT)
            try:
                return (float(answer["cpu"]), len(answer["ranks"])) if answer is not None else None
            except (ValueError, KeyError, TypeError):
                return None

        answers = fan_out(list(self.job.hang_targets().values()), ask)
        # A node without ranks is still starting them (torch's import and the rendezvous
        # print nothing and take seconds on a busy node): a job that has not started is not hung.
        if not answers or any(answer is None or answer[1] == 0 for answer in answers):
            return None
        return (sum(answer[0] for answer in answers if answer is not None),
                sum(answer[1] for answer in answers if answer is not None))

    def _spy(self) -> None:
        """``py-spy dump`` of every rank where the node has py-spy, while the ranks are
        stopped (one moment for all); kept in ``dumps``."""
        def ask(item: tuple[str, Target]) -> dict[tuple[str, int], str]:
            name, target = item
            answer = self._ask(target, "spy", SPY_PROBE_TIMEOUT)
            dumps = answer.get("dumps") if answer is not None else None
            if not isinstance(dumps, dict):
                return {}
            return {(name, int(rank)): str(text) for rank, text in dumps.items() if str(rank).lstrip("-").isascii() and str(rank).lstrip("-").isdigit()}

        for found in fan_out(list(self.job.hang_targets().items()), ask):
            self.dumps.update(found)

    def _flight(self) -> None:
        """Every rank's flight record, while the ranks still run (their hooks write them)."""
        def ask(item: tuple[str, Target]) -> dict[tuple[str, int], dict[str, Any]]:
            name, target = item
            answer = self._ask(target, "fr", FR_PROBE_TIMEOUT)
            records = answer.get("fr") if answer is not None else None
            if not isinstance(records, dict):
                return {}
            return {(name, int(rank)): record for rank, record in records.items()
                    if isinstance(record, dict) and str(rank).lstrip("-").isascii() and str(rank).lstrip("-").isdigit()}

        for found in fan_out(list(self.job.hang_targets().items()), ask):
            self.flight.update(found)

    def _ask(self, target: Target, action: str, timeout: float) -> dict[str, Any] | None:
        """The probe's JSON answer on one node; None when it gave none."""
        supervisor = "-" if target.supervisor is None else str(target.supervisor)
        command = (f"{quote_path(target.python)} {node_program('hangprobe.py')} {shlex.quote(self.run_id)} {action} "
                   f"{supervisor} {THAW_AFTER:g}")
        try:
            result = target.session.run(command, timeout=timeout)
            answer = json.loads(result.stdout.strip().splitlines()[-1])
        except (TransportError, ValueError, IndexError):
            return None
        return answer if isinstance(answer, dict) else None
