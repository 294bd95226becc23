"""What the user sees of detached runs: the start message, ``status`` tables, and
the notes ``logs``/``attach`` print about a node's job starting and ending."""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from torchherd.console import print_table, printable
from torchherd.console.run import LiveRenderer
from torchherd.engine.records import AttachedStatus, NodeState, RecoveryStatus, RunRecord, describe_since, recovery_of
from torchherd.runlog import Status
from torchherd.words import count

STATE_STYLES = {"running": "cyan", "exited": "green", "gone": "bold red", "unreachable": "bold red",
                "unknown": "yellow", "pending": "cyan", "lost": "bold red", "unresponsive": "bold red",
                "not started": "bold red"}


def _plain(console: Console, text: str, style: str = "") -> None:
    console.print(Text(printable(text), style=style), soft_wrap=True)


def render_started(console: Console, record: RunRecord) -> None:
    job_id = record.extra.get("job_id")  # a scheduler's own id for the run (SLURM's)
    if job_id is not None:
        _plain(console, f"run {record.run_id}: submitted as SLURM job {job_id}", "bold")
    else:
        _plain(console, f"run {record.run_id}: started detached on {count(len(record.nodes), 'node')} "
                         f"({', '.join(node.name for node in record.nodes)})", "bold")
    recovery = recovery_of(record)
    if recovery is not None:
        _plain(console, f"recovering in the background: the controller is pid {recovery.pid} on this machine "
                        f"(up to {recovery.retries} {'retry' if recovery.retries == 1 else 'retries'})")
    console.print(record.run_id, markup=False, highlight=False, soft_wrap=True)
    for command in ("status", "logs -f", "attach", "stop"):
        _plain(console, f"  torchherd {command} {record.run_id}", "dim")


def state_text(state: NodeState) -> str:
    if state.state == "exited":
        return f"exited ({state.code})" if state.code is not None else "exited"
    return state.state


def run_state(states: Sequence[NodeState]) -> str:
    """One word for a whole run: pending (SLURM holds it), running, ok, failed, or unknown."""
    if any(state.state == "running" for state in states):
        return "running"
    if any(state.state == "pending" for state in states):
        return "pending"
    if states and all(state.state == "exited" and state.code == 0 for state in states):
        return "ok"
    if states and all(state.state == "exited" and (state.code == 0 or state.stopped) for state in states):
        return "stopped"
    if any(state.state in ("exited", "gone") for state in states):
        return "failed"
    return "unknown"


def render_status(console: Console, record: RunRecord, states: Sequence[NodeState],
                  recovery: RecoveryStatus | None = None, attached: AttachedStatus | None = None) -> None:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
    word = attached.state if attached is not None else run_state(states)
    table = Table(title=Text(printable(f"run {record.run_id} ({word}), started {started}: "
                                       + shlex.join(record.command))), title_justify="left")
    for column in ("node", "state", "since", "detail"):
        table.add_column(column, overflow="fold")
    for state in states:
        style = STATE_STYLES.get(state.state, "")
        if state.state == "exited" and state.code != 0:
            style = "bold red"
        table.add_row(Text(state.node), Text(state_text(state), style=style), describe_since(state.since),
                      Text(printable(state.detail)))
    print_table(console, table)
    if recovery is not None:
        render_recovery(console, recovery, states)
    if attached is not None:
        render_attached(console, attached)


def render_attached(console: Console, attached: AttachedStatus) -> None:
    """An attached run's controller, its end as recorded, and where its logs are."""
    found = attached.record
    if found.ending != "running":
        _plain(console, f"attached run, ended: exit {found.exit_code}: {found.headline}",
               "green" if found.exit_code == 0 else "bold red")
    elif attached.alive:
        _plain(console, f"attached run: its controller (pid {found.pid}) runs it", "cyan")
    else:
        _plain(console, f"attached run: its controller (pid {found.pid}) is gone without recording the end "
                        "(killed, or this machine rebooted): the run ended with it", "bold red")
    _plain(console, f"logs in {found.log_dir}", "dim")


def _controller_state(recovery: RecoveryStatus, states: Sequence[NodeState]) -> str:
    """ended, alive, gone (the job runs on without recovery), or over (gone, the job too)."""
    if recovery.record.ended:
        return "ended"
    if recovery.alive:
        return "alive"
    return "gone" if any(state.state == "running" for state in states) else "over"


def _current(recovery: RecoveryStatus) -> int:
    attempts = recovery.record.attempts
    return attempts[-1].number if attempts else 1


def controller_text(recovery: RecoveryStatus, states: Sequence[NodeState]) -> tuple[str, str]:
    """One line on a detached run's recovering controller, and its style."""
    record, current = recovery.record, _current(recovery)
    who = f"the recovering controller (pid {record.pid})"
    return {
        "ended": (f"recovery ended after attempt {current}: exit {record.exit_code}: {record.headline}",
                  "green" if record.exit_code == 0 else "bold red"),
        "alive": (f"{who} runs: attempt {current} of {record.retries + 1}", "cyan"),
        "gone": (f"{who} is gone: the job runs on without recovery", "bold red"),
        "over": (f"{who} is gone: no further attempt will be made", "bold red"),
    }[_controller_state(recovery, states)]


def controller_cell(recovery: RecoveryStatus, states: Sequence[NodeState]) -> tuple[str, str]:
    """``controller_text`` in short, for the listing of every run."""
    record, current = recovery.record, _current(recovery)
    return {
        "ended": (f"ended after attempt {current}: exit {record.exit_code}",
                  "green" if record.exit_code == 0 else "bold red"),
        "alive": (f"attempt {current} of {record.retries + 1}", "cyan"),
        "gone": ("controller gone, running without recovery", "bold red"),
        "over": ("controller gone, no further attempt", "bold red"),
    }[_controller_state(recovery, states)]


def render_recovery(console: Console, recovery: RecoveryStatus, states: Sequence[NodeState]) -> None:
    """The controller's line, then every attempt so far (its nodes, how it ended)."""
    text, style = controller_text(recovery, states)
    _plain(console, text, style)
    if recovery.record.checkpoint:  # the summary's line: a detached run has no terminal to print it on
        _plain(console, recovery.record.checkpoint, "bold")
    if not recovery.record.attempts:
        return
    table = Table(title=Text("attempts"), title_justify="left")
    for column in ("attempt", "nodes", "ended", "how"):
        table.add_column(column, overflow="fold")
    for attempt in recovery.record.attempts:
        style = {"ok": "green", "running": "cyan"}.get(attempt.ended, "bold red")
        table.add_row(str(attempt.number), Text(",".join(attempt.nodes)), Text(attempt.ended, style=style),
                      Text(printable(attempt.headline)))
    print_table(console, table)


@dataclass(frozen=True)
class ListedRun:
    """One row of ``status`` without a run id: the run, its nodes, its recovery if any."""

    record: RunRecord
    states: Sequence[NodeState]
    recovery: RecoveryStatus | None = None
    attached: AttachedStatus | None = None

    @property
    def state(self) -> str:
        return self.attached.state if self.attached is not None else run_state(self.states)


def run_json(row: ListedRun) -> dict[str, object]:
    """``status --json``: one run, as ``status`` shows it; ``attached`` is null for a detached run."""
    recovery, attached = row.recovery, row.attached
    return {"run_id": row.record.run_id, "state": row.state, "created": row.record.created,
            "command": list(row.record.command),
            "nodes": [{"node": state.node, "state": state.state, "code": state.code, "since": state.since,
                       "detail": state.detail, "stopped": state.stopped} for state in row.states],
            "recovery": None if recovery is None else {**recovery.record.to_json_object(), "alive": recovery.alive},
            "attached": None if attached is None else {**attached.record.to_json_object(), "alive": attached.alive}}


def render_runs(console: Console, rows: Sequence[ListedRun], damaged: Sequence[str] = ()) -> None:
    """Every known run; with a "recovery" column where one has retries; then one line per
    record that cannot be read (what is wrong with it)."""
    if not rows:
        if not damaged:
            _plain(console, "no runs")
        _render_damaged(console, damaged)
        return
    recovering = any(row.recovery is not None for row in rows)
    table = Table(title=Text("runs"), title_justify="left")
    for column in ("run", "state", "started", "nodes", *(("recovery",) if recovering else ()), "command"):
        table.add_column(column, overflow="fold")
    for row in rows:
        nodes = ", ".join(f"{state.node} {state_text(state)}" for state in row.states)
        cells = [Text(row.record.run_id), Text(row.state), Text(describe_since(row.record.created)),
                 Text(nodes)]
        if recovering:
            cells.append(Text(*controller_cell(row.recovery, row.states)) if row.recovery else Text(""))
        table.add_row(*cells, Text(printable(shlex.join(row.record.command))))
    print_table(console, table)
    _render_damaged(console, damaged)


def _render_damaged(console: Console, damaged: Sequence[str]) -> None:
    for problem in damaged:
        _plain(console, f"damaged run record: {problem}", "bold red")


def render_stopped(console: Console, record: RunRecord, left: Mapping[str, Sequence[str]],
                   recovery: RecoveryStatus | None = None) -> bool:
    """One line per node (first, for a run with retries, its controller's: as it was
    before the stop); True when nothing of the run is left anywhere."""
    if recovery is not None:
        who = f"the recovering controller (pid {recovery.record.pid})"
        _plain(console, f"{who}: stopped the run, no further attempt" if recovery.alive
               else f"{who} was gone already: the nodes were stopped directly", "green" if recovery.alive else "yellow")
    clean = True
    for node, processes in left.items():
        if processes:
            clean = False
            _plain(console, f"{node}: {len(processes)} left: " + "; ".join(processes), "bold red")
        else:
            _plain(console, f"{node}: stopped, nothing of the run is left", "green")
    _plain(console, f"run {record.run_id}: " + ("stopped" if clean else "NOT everything could be stopped"),
           "bold green" if clean else "bold red")
    return clean


def status_note(renderer: LiveRenderer, status: Status) -> None:
    """A supervisor's status record as a torchherd note, like a live run prints them."""
    fields = status.fields
    if status.event == "started":
        renderer.note(f"{status.node}: torchrun started (pid {fields.get('pid')})", "dim")
    elif status.event == "error":
        renderer.note(f"{status.node}: {fields.get('message', 'the job could not be started')}", "bold red")
    elif status.event == "stopping":
        renderer.note(f"{status.node}: stopping ({fields.get('reason', '')})", "yellow")
    elif status.event == "exit":
        code, stopped = fields.get("code"), fields.get("stopped")
        if isinstance(stopped, str):
            # torchherd signalled it first: whatever code the job chose on the way out
            # (torchrun turns SIGTERM into exit 1 in parts of its loop), it was stopped.
            renderer.note(f"{status.node}: stopped ({printable(stopped[:200])}; exit code {code})", "yellow")
        else:
            renderer.note(f"{status.node}: " + ("finished (exit 0)" if code == 0 else f"exited with code {code}"),
                          "green" if code == 0 else "bold red")
