"""Each node's part of a run as the controller sees it, and the run's summary: which
node failed first (and which rank), which were torn down, lost or interrupted.

``OutputTrack`` is what every backend keeps of a node; ``NodeRun`` is an SSH node's
(updated by the supervising thread only). ``summarise`` is pure, and the one place
that words a run's headline, for every backend.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar

from torchherd.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK
from torchherd.plan import NodePlan
from torchherd.remote.wire import StopLevel
from torchherd.runlog import (
    NodeOutcome,
    OutputLine,
    RankLines,
    RunSummary,
    is_error_line,
    is_peer_error,
    root_cause_exit,
    root_cause_rank,
)
from torchherd.transport import Process

if TYPE_CHECKING:
    from torchherd.runlog import OutcomeState

TAIL_LINES = 8


class OutputTrack:
    """What a run's summary needs of one node: when it started and ended, its exit code,
    whether it was lost, and of its output whether a rank has printed, the first error
    line, the failed rank, the last lines. Shared by SSH and SLURM runs."""

    def __init__(self, name: str, rank: int, log_path: Path) -> None:
        self.name = name
        self.rank = rank
        """The node's rank (``node_rank``)."""
        self.log_path = log_path
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self.exit_code: int | None = None
        self.lost: str | None = None
        """Why the node was given up (it vanished, or never confirmed its teardown)."""
        self.left = 0
        """Processes the node's teardown could not kill."""
        self.ranks_running = False
        """A rank has printed: the node got through the rendezvous."""
        self.rank_error: OutputLine | None = None
        self.rank_error_at: float | None = None
        """When the controller read ``rank_error`` (monotonic)."""
        self.other_error: OutputLine | None = None
        self.failed_rank: int | None = None
        self.rank_exit_code: int | None = None
        """The root-cause rank's exit code in torchrun's failure report."""
        self._root_cause = False
        self.rank_tail: deque[OutputLine] = deque(maxlen=TAIL_LINES)
        self.other_tail: deque[OutputLine] = deque(maxlen=TAIL_LINES)

    def take(self, item: OutputLine | RankLines) -> bool:
        """Tracks a line or block; True when it is the first a rank printed on this node."""
        first = not self.ranks_running and (isinstance(item, RankLines) or item.rank is not None)
        self.ranks_running = self.ranks_running or first
        if isinstance(item, RankLines):
            self.track_block(item)
        else:
            self.track(item)
        return first

    def track(self, line: OutputLine) -> None:
        """Keeps what the summary needs: the first error line, the failed rank, the tail."""
        (self.rank_tail if line.rank is not None else self.other_tail).append(line)
        if line.rank is None:
            # torchrun's report lists every failure ("Failures:", a rank SIGTERMed by its
            # own agent among them) before the one it saw first ("Root Cause ..."): only
            # the latter names the failed rank and its exit code.
            self._root_cause = self._root_cause or line.text.strip().startswith("Root Cause")
        rank = root_cause_rank(line) if self._root_cause else None
        if rank is not None and self.failed_rank is None and self.rank_error is None:
            self.failed_rank = rank
        if self._root_cause and self.rank_exit_code is None:
            self.rank_exit_code = root_cause_exit(line)
        self._track_error(line)

    def track_block(self, block: RankLines) -> None:
        """``track`` for every line of the block: only its last lines can be in the tail,
        only its stderr lines can be errors, and none is torchrun's root-cause report."""
        self.rank_tail.extend(block.tail(TAIL_LINES))
        if self.rank_error is None:
            for line in block.error_candidates():
                self._track_error(line)

    def _track_error(self, line: OutputLine) -> None:
        if is_error_line(line):
            if line.rank is not None and self.rank_error is None:
                self.rank_error, self.rank_error_at = line, time.monotonic()
                # The rank that raised first is the one to name; torchrun's own report
                # may call a peer that died of the same crash the root cause.
                self.failed_rank = line.rank
            elif line.rank is None and self.other_error is None:
                self.other_error = line

    def error_line(self) -> str | None:
        line = self.rank_error or self.other_error
        return None if line is None else line.described()

    def first_error(self) -> str | None:
        """The error the summary names: the first error line, else what the backend knows."""
        return self.error_line() or self.lost


class NodeRun(OutputTrack):
    """The controller's view of one node during the run."""

    def __init__(self, plan: NodePlan, log_path: Path) -> None:
        super().__init__(plan.host.name, plan.node_rank, log_path)
        self.plan = plan
        self.process: Process | None = None
        self.last_seen = time.monotonic()
        self.silent_from: float | None = None
        """``last_seen`` when the user was told that its supervisor is silent while its sshd
        answers (``NodeSilent``); None: not silent so."""
        self.done = False
        self.closed = False
        self.reader_done = False
        """Set by the reader thread when the channel ended; its Closed event may still be queued."""
        self.start_error: str | None = None
        self.supervisor: int | None = None
        """The pid of the node's supervisor, once its ``started`` record said it."""
        self.stop_sent: StopLevel | None = None
        self.stop_at = 0.0

    @property
    def finished(self) -> bool:
        return self.closed or self.lost is not None or (self.process is None and self.start_error is not None)

    @property
    def running(self) -> bool:
        return self.process is not None and not self.finished

    def first_error(self) -> str | None:
        return self.error_line() or self.lost or self.start_error


@dataclass(frozen=True)
class Ending:
    """What the backend knows of the run's end beyond its nodes."""

    interrupted: str | None = None
    """The run was stopped by its user: how (SSH: every node was told to stop)."""
    lost: str | None = None
    """The run as a whole went out of sight (SLURM: the submit host stopped answering)."""
    otherwise: str | None = None
    """The headline when not every node ended well and none is to blame (None: the
    nodes that did not are named)."""
    why_failed: str | None = None
    """A failed node's error when its output names none."""


Node = TypeVar("Node", bound=OutputTrack)


def first_cause(culprit: Node | None, nodes: Sequence[Node]) -> Node | None:
    """The node to blame for a failed run: the first to fail (``culprit``), unless its ranks'
    error only says that a peer went away (``is_peer_error``) while another node's ranks
    raised an error of their own: then the first such node. When one rank crashes, its peers
    on other nodes raise "Connection closed by peer" at once, and which node's torchrun
    reports its failure first is a race."""
    if culprit is None or culprit.lost is not None or culprit.rank_error is None or not is_peer_error(culprit.rank_error):
        return culprit
    own = [node for node in nodes if node is not culprit and node.lost is None and node.rank_error is not None
           and not is_peer_error(node.rank_error)]
    return min(own, key=lambda node: node.rank_error_at or 0.0, default=culprit)


def summarise(run_id: str, nodes: Sequence[Node], state_of: Callable[[Node], OutcomeState],
              culprit: Node | None, ending: Ending, seconds: float, log_dir: str) -> RunSummary:
    """The run's exit code, its one-sentence headline, and every node's outcome (its state
    as the backend judges it: ``state_of``)."""
    outcomes = tuple(_outcome(node, state_of(node), ending) for node in nodes)
    if ending.interrupted is not None:
        code, headline = EXIT_INTERRUPTED, f"interrupted: {ending.interrupted}"
    elif ending.lost is not None:
        code, headline = EXIT_FAILED, f"lost track of {ending.lost}"
    elif culprit is not None:
        code, headline = EXIT_FAILED, _blame(culprit)
    elif outcomes and all(outcome.state == "ok" for outcome in outcomes):
        code, headline = EXIT_OK, (f"all {len(outcomes)} nodes" if len(outcomes) > 1 else "the node") + f" finished (exit 0) in {seconds:.1f} s"
    else:
        code, headline = EXIT_FAILED, ending.otherwise or "the job failed on " + ", ".join(
            outcome.node for outcome in outcomes if outcome.state != "ok")
    left = sum(outcome.left for outcome in outcomes)
    if left:
        headline += f"; {left} processes could not be killed (see the table)"
    return RunSummary(run_id, code, headline, outcomes, log_dir, culprit.name if culprit is not None else None)


def _blame(node: OutputTrack) -> str:
    if node.lost is not None:
        return f"{node.lost}; the other nodes were torn down"
    rank = f" rank {node.failed_rank}" if node.failed_rank is not None else ""
    code = f" with exit code {node.exit_code}" if node.exit_code is not None else ""
    error = node.first_error()
    return f"{node.name}{rank} failed first{code}" + (f": {error}" if error else "")


def _outcome(node: OutputTrack, state: OutcomeState, ending: Ending) -> NodeOutcome:
    seconds = None if node.started_at is None else (node.ended_at or time.monotonic()) - node.started_at
    tail = tuple(line.log_text() for line in node.rank_tail or node.other_tail)
    error = node.first_error() if state != "ok" else None
    if state == "failed" and error is None:
        error = ending.why_failed
    return NodeOutcome(node.name, node.rank, state, node.exit_code, seconds, error,
                       node.failed_rank if state == "failed" else None, tail, node.left,
                       node.rank_exit_code if state == "failed" else None)


def ssh_state(node: NodeRun, culprit: OutputTrack | None, interrupted: bool) -> OutcomeState:
    """An SSH node's outcome: lost, never started, ok, stopped by the run, or failed."""
    if node.lost is not None:
        return "unresponsive" if node.stop_sent is StopLevel.GIVE_UP else "lost"
    if node.process is None:
        return "not started"
    if node.exit_code == 0:
        return "ok"
    if node.stop_sent is not None and node is not culprit:
        return "interrupted" if interrupted else "torn down"
    return "failed"
