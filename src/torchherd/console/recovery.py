"""A run with retries, rendered: one note per recovery event, and the attempts table
under the summary (``run --retries``)."""

from __future__ import annotations

import time
from typing import Union

from rich.console import Console
from rich.table import Table
from rich.text import Text

from torchherd.console import print_table, printable
from torchherd.engine.events import (
    AttemptFailed,
    AttemptStarted,
    AttemptWarm,
    CheckpointMissing,
    CheckpointReplicated,
    CheckpointStaged,
    HangFound,
    LostContainers,
    NodeExcluded,
    RecoveryEnded,
    RunShrunk,
    SpareTaken,
    TriageDone,
    WarmReady,
)
from torchherd.runlog import AttemptRecord
from torchherd.words import count, size

RecoveryEvent = Union[AttemptStarted, AttemptWarm, WarmReady, AttemptFailed, TriageDone, NodeExcluded, SpareTaken, RunShrunk, RecoveryEnded,
                      HangFound, CheckpointStaged, CheckpointMissing, LostContainers, CheckpointReplicated]
ENDED_STYLES = {"ok": "green", "failed": "bold red", "lost": "bold red", "hung": "bold red", "interrupted": "yellow"}


def recovery_note(event: RecoveryEvent) -> tuple[str, str]:
    """The note for one recovery event, and its style."""
    if isinstance(event, AttemptStarted):
        if not event.nodes:
            return f"attempt {event.number} of {event.of} on {event.picking}", "bold"
        return f"attempt {event.number} of {event.of} on {count(len(event.nodes), 'node')}: {', '.join(event.nodes)}", "bold"
    if isinstance(event, AttemptWarm):
        return warm_note(event), "dim"
    if isinstance(event, WarmReady):
        parts = ([f"warm Python ready on {', '.join(event.nodes)} in {event.seconds:.1f} s (torch imported)"]
                 if event.nodes else [])
        parts += [f"no warm Python on {node}: {printable(why)}" for node, why in event.failed]
        return "; ".join(parts), "bold yellow" if event.failed else "dim"
    if isinstance(event, AttemptFailed):
        return f"attempt {event.number} failed after {event.seconds:.1f} s: {event.headline}", "bold red"
    if isinstance(event, TriageDone):
        if not event.failed:
            return f"triage: {count(len(event.nodes), 'node')} passed the checks in {event.seconds:.1f} s", "dim"
        failed = ", ".join(node for node, _ in event.failed)
        return f"triage: {failed} failed the checks ({count(len(event.nodes), 'node')}, {event.seconds:.1f} s)", "bold yellow"
    if isinstance(event, NodeExcluded):
        return f"{event.node} excluded: {event.reason}", "bold yellow"
    if isinstance(event, SpareTaken):
        return f"spare {event.spare} takes the place of {event.replacing}", "bold"
    if isinstance(event, HangFound):
        return (f"hung: no rank printed a line or used CPU for {event.seconds:.0f} s; every rank is asked for its "
                "stack (SIGABRT)", "bold red")
    if isinstance(event, CheckpointStaged):
        return checkpoint_note(event)
    if isinstance(event, CheckpointMissing):
        return f"checkpoint: {event.message}; attempt {event.attempt} starts without one", "bold yellow"
    if isinstance(event, LostContainers):
        return lost_containers_note(event)
    if isinstance(event, CheckpointReplicated):
        return replica_note(event)
    if isinstance(event, RunShrunk):
        return f"no spare left: the run goes on with {event.nodes} nodes instead of {event.was}", "bold yellow"
    return f"no further attempt: {event.message}", "bold red"


def checkpoint_note(event: CheckpointStaged) -> tuple[str, str]:
    """"checkpoint: snapshot.pt (12.3 MB, from node0) staged on node2 in 0.4 s"."""
    what = f"checkpoint: {printable(event.path)} ({size(event.size)}, from {event.source})"
    if event.failed:
        why = "; ".join(f"{node}: {printable(reason)}" for node, reason in event.failed)
        done = f"staged on {', '.join(event.nodes)}, " if event.nodes else ""
        return f"{what} {done}not on {why}; attempt {event.attempt} starts anyway", "bold yellow"
    if not event.nodes:
        return f"{what}: every node of attempt {event.attempt} has it already", "dim"
    return f"{what} staged on {', '.join(event.nodes)} in {event.seconds:.1f} s", "bold"


def lost_containers_note(event: LostContainers) -> tuple[str, str]:
    """"the run's container removed from node2, lost in an attempt" and, for a node not
    reached, the container it may still hold and the command that removes it there."""
    notes = []
    if event.removed:
        notes.append(f"the run's container removed from {', '.join(event.removed)}, lost in an attempt")
    for node, name, runtime, why in event.left:
        commands = " or ".join(f"{word} rm -f {name}" for word in runtime.split(" or "))
        notes.append(f"{node} may still hold the run's container {name} ({printable(why)}): once it is back, "
                     f"run {commands} there")
    return "; ".join(notes), "bold yellow" if event.left else "dim"


def replica_note(event: CheckpointReplicated) -> tuple[str, str]:
    """"checkpoint: snapshot.pt (12.3 MB, saved 10:41:07 on node0) replicated to node1 in 0.4 s
    (at most 25% of the link)"; what did not go where, and why."""
    saved = time.strftime("%H:%M:%S", time.localtime(event.mtime))
    what = f"checkpoint: {printable(event.path)} ({size(event.size)}, saved {saved} on {event.source})"
    parts = []
    if event.nodes:
        kept = f"; {event.pace}" if event.pace else ""
        parts.append(f"replicated to {', '.join(event.nodes)} in {event.seconds:.1f} s (at most {event.cap}{kept})")
    if event.held:
        parts.append(f"already on {', '.join(event.held)}")
    if event.kept:
        parts.append(f"{', '.join(event.kept)} kept a newer copy of its own")
    if event.failed:
        parts.append("not on " + "; ".join(f"{node}: {printable(reason)}" for node, reason in event.failed))
    if not parts:
        parts.append("no other node to replicate it to")
    return f"{what} {', '.join(parts)}", "bold yellow" if event.failed else "dim"


def warm_note(event: AttemptWarm) -> str:
    """``attempt 2 starts warm on node0, node1 (torch imported beforehand); cold on node4: ...``."""
    parts = []
    if event.nodes:
        parts.append(f"attempt {event.number} starts warm on {', '.join(event.nodes)} (torch imported beforehand)")
    if event.cold:
        why = dict(event.why)
        cold = ", ".join(f"{node} ({printable(why[node])})" if node in why else node for node in event.cold)
        parts.append(f"cold on {cold}" if event.nodes else f"attempt {event.number} starts cold on {cold}")
    return "; ".join(parts)


def render_attempts(console: Console, attempts: tuple[AttemptRecord, ...]) -> None:
    """The attempts as a short table (nothing for a run without retries)."""
    if not attempts:
        return
    table = Table(title=Text("attempts"), title_justify="left")
    for column in ("#", "nodes", "start", "ended", "time", "triage", "then"):
        table.add_column(column, overflow="fold")
    for attempt in attempts:
        table.add_row(str(attempt.number), Text(",".join(attempt.nodes)), Text(attempt.start),
                      Text(attempt.ended, style=ENDED_STYLES.get(attempt.ended, "")), f"{attempt.seconds:.1f}s",
                      Text(printable("; ".join(attempt.triage) or "-")), Text(printable(attempt.next or "-")))
    print_table(console, table)
