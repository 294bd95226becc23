"""What a run with retries does after a failed attempt: pure decisions, no sockets.

From an attempt's end (which node failed first or was lost, its first error line, the
exit code) and the earlier attempts: end the run (a final exit code, the same error on
another node: a bug in the job, retries used up) or triage and try again. From the
triage's check results: which nodes are excluded (a failed check, unreachable, or the
node whose ranks failed first in two attempts in a row), which spares take their
places, in order, and whether the run may shrink (``min_nodes``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Sequence

from torchherd.checks.results import CheckResult
from torchherd.inventory import Recovery

if TYPE_CHECKING:  # annotations only: engine.backend takes TRIAGE_CHECKS from here for `check`
    from torchherd.runlog import AttemptEnd, RunSummary

TRIAGE_CHECKS = frozenset({"ssh", "ping", "hostname", "port", "firewall", "python", "gpu", "xid", "ib"})
"""The fast node checks a triage runs (seconds; not the smoke job): ``gpu``, ``xid`` and
``ib`` keep out a node with a fresh ECC error or a pending remap, a GPU off the bus or
an RDMA port down."""
CROSS_NODE_CHECKS = frozenset({"ping", "port", "firewall"})
"""Checks that also fail when another node (the master) is down: not held against a node
in a round where some node could not be reached."""

_RANK_TAG = re.compile(r"^rank \d+: ")

EndReason = Literal["final exit code", "job bug", "retries exhausted", "no spare left", "no node left"]


@dataclass(frozen=True)
class Attempt:
    """How one attempt ended, as the policy needs it."""

    number: int
    nodes: tuple[str, ...]
    ended: AttemptEnd
    culprit: str | None
    """The node that failed first, or was lost."""
    error: str | None
    """The culprit's first error line ("rank 3: ValueError: ..."), or why it was lost."""
    exit_code: int | None
    """The failed rank's own exit code where torchrun reported it, else the node's."""
    lost: tuple[str, ...] = ()
    """Nodes the controller lost (nothing heard, or an unconfirmed teardown)."""
    why_lost: tuple[tuple[str, str], ...] = ()
    """(node, why the controller gave it up) for each node of ``lost``."""


def attempt_of(number: int, nodes: Sequence[str], summary: RunSummary) -> Attempt:
    """The policy's view of an attempt from its summary."""
    gone = [outcome for outcome in summary.nodes if outcome.state in ("lost", "unresponsive")]
    lost = tuple(outcome.node for outcome in gone)
    why_lost = tuple((outcome.node, _why_lost(outcome.node, outcome.first_error)) for outcome in gone)
    culprit = next((outcome for outcome in summary.nodes if outcome.node == summary.culprit), None)
    if summary.exit_code == 0:
        ended: AttemptEnd = "ok"
    elif summary.exit_code == 130:
        ended = "interrupted"
    elif culprit is not None and culprit.node in lost:
        ended = "lost"
    else:
        ended = "failed"
    if culprit is None:  # failed without a first node (none started): the first one that did not end well
        culprit = next((outcome for outcome in summary.nodes if outcome.state not in ("ok", "torn down")), None)
    if culprit is None:
        return Attempt(number, tuple(nodes), ended, None, None, None, lost, why_lost)
    code = culprit.rank_exit_code if culprit.rank_exit_code is not None else culprit.exit_code
    return Attempt(number, tuple(nodes), ended, culprit.node, culprit.first_error, code, lost, why_lost)


def _why_lost(node: str, error: str | None) -> str:
    """"vanished: nothing heard from it for 10 s": the controller's reason, without the
    node's name (the exclusion names it)."""
    text = (error or "nothing heard from it").strip()
    return text[len(node) + 1:] if text.startswith(f"{node} ") else text


@dataclass(frozen=True)
class End:
    """The run ends after this attempt."""

    reason: EndReason
    message: str


def error_key(error: str | None) -> str | None:
    """The error as two ranks of the same code print it, without the rank that said it;
    None for a line no rank printed (torchrun's own report reads the same on every node)."""
    if error is None or not _RANK_TAG.match(error.strip()):
        return None
    return _RANK_TAG.sub("", error.strip(), count=1)


def verdict(attempt: Attempt, earlier: Sequence[Attempt], recovery: Recovery) -> End | None:
    """Whether the run ends after the failed ``attempt`` (before any triage); None: triage
    and try again. ``earlier``: the attempts before it, oldest first."""
    if attempt.exit_code is not None and attempt.exit_code in recovery.final_exit_codes and attempt.ended == "failed":
        return End("final exit code", f"{attempt.culprit} exited with {attempt.exit_code}, an exit code marked "
                                      "final: no retry")
    previous = earlier[-1] if earlier else None
    key = error_key(attempt.error)
    if (previous is not None and attempt.ended == previous.ended == "failed" and key is not None
            and key == error_key(previous.error) and attempt.exit_code == previous.exit_code
            and attempt.culprit != previous.culprit):
        return End("job bug", f"the same error on {previous.culprit} (attempt {previous.number}) and on "
                              f"{attempt.culprit} (attempt {attempt.number}): a bug in the job, not a bad node: {key}")
    if attempt.number > recovery.retries:
        tries = "retry" if recovery.retries == 1 else "retries"
        return End("retries exhausted", f"{recovery.retries} {tries} used up: the run failed {attempt.number} times")
    return None


def cooldown(attempt: Attempt, earlier: Sequence[Attempt]) -> str | None:
    """The node excluded even when its checks pass: its ranks failed first in this attempt
    and in the one before."""
    previous = earlier[-1] if earlier else None
    if (previous is not None and attempt.culprit is not None and attempt.culprit == previous.culprit
            and attempt.ended == previous.ended == "failed"):
        return attempt.culprit
    return None


def known_lost(attempt: Attempt, excluded: Sequence[str], spares: Sequence[str],
               recovery: Recovery) -> dict[str, str]:
    """The nodes the attempt lost, each with why, to exclude without a check: connecting
    to a node already known gone only waits for the SSH timeout. Only where the run can go
    on without them (a spare each, or ``min_nodes``); else none: the triage checks them,
    and a node back after a blip keeps the run going rather than ending it."""
    lost = [node for node in attempt.lost if node not in excluded]
    if not lost or isinstance(next_nodes(attempt.nodes, [*excluded, *lost], spares, attempt.nodes[0], recovery), End):
        return {}
    why = dict(attempt.why_lost)
    return {node: f"lost in attempt {attempt.number}: {why.get(node, 'nothing heard from it')}" for node in lost}


def triage_failures(results: Sequence[CheckResult], nodes: Sequence[str]) -> dict[str, str]:
    """Per node of ``nodes`` that failed the triage: why (its first failed check). In a
    round where a node could not be reached, the others' cross-node checks (which need
    that node, when it is the master) do not count: the next round checks them again."""
    failed = [result for result in results if result.status == "fail" and result.node in nodes]
    unreachable = {result.node for result in failed if result.check == "ssh"}
    reasons: dict[str, str] = {}
    for result in failed:
        if unreachable and result.node not in unreachable and result.check in CROSS_NODE_CHECKS:
            continue
        reasons.setdefault(result.node, f"{result.check}: {result.summary}")
    return reasons


def doubtful(results: Sequence[CheckResult], nodes: Sequence[str]) -> bool:
    """Whether a round left cross-node failures uncounted (another round must check them)."""
    failed = [result for result in results if result.status == "fail" and result.node in nodes]
    unreachable = {result.node for result in failed if result.check == "ssh"}
    return any(result.node not in unreachable and result.check in CROSS_NODE_CHECKS for result in failed) and bool(
        unreachable)


@dataclass(frozen=True)
class NextNodes:
    """The nodes of the next attempt (node-rank order: its master first)."""

    nodes: tuple[str, ...]
    master: str
    taken: tuple[tuple[str, str], ...]
    """(spare, the excluded node whose place it takes), in the order taken."""
    shrunk: bool
    """Fewer nodes than the attempt before (``min_nodes``)."""


def next_nodes(current: Sequence[str], excluded: Sequence[str], spares: Sequence[str], master: str,
               recovery: Recovery) -> NextNodes | End:
    """The next attempt's nodes: ``current`` less ``excluded``, each excluded node's place
    taken by the next spare in order; without enough spares, fewer nodes down to
    ``recovery.min_nodes``, else the end. The master stays unless excluded; then the
    first node left is, as in a normal run (spares come after the nodes that stay)."""
    out = [node for node in current if node in excluded]
    kept = [node for node in current if node not in excluded]
    usable = [spare for spare in spares if spare not in excluded and spare not in current]
    taken = tuple(zip(usable, out))
    nodes = kept + [spare for spare, _ in taken]
    missing = out[len(taken):]
    if missing:
        floor = recovery.min_nodes
        if floor is None or len(nodes) < floor:
            lost = ", ".join(missing)
            needed = "" if floor is None else f" and {len(nodes)} nodes are fewer than --min-nodes {floor}"
            return End("no spare left", f"{lost} excluded, no spare left{needed}")
    if not nodes:
        return End("no node left", "every node was excluded")
    head = master if master in nodes else nodes[0]
    ordered = (head,) + tuple(node for node in nodes if node != head)
    return NextNodes(ordered, head, taken, bool(missing))
