"""The engine's events, rendered: the one observer that writes to the user's terminal.

Every line the engine reports goes through ``LiveRenderer`` (batched, one write per
batch); torchherd's own notes are prefixed ``torchherd │``; the summary table ends
the run. The exact texts are the public face of ``torchherd run``; tests compare them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from rich.console import Console
from rich.text import Text

from torchherd.console import printable, render_error
from torchherd.console.checks import render_report
from torchherd.console.detach import status_note
from torchherd.console.images import ArchiveBars, ArchiveEvent, archive_notes
from torchherd.console.pull import PullView
from torchherd.console.recovery import RecoveryEvent, recovery_note, render_attempts
from torchherd.console.run import LiveRenderer, render_report_line, render_summary
from torchherd.console.sync import (
    SYNC_EVENTS,
    WheelBars,
    WheelsEvent,
    sync_notes,
    wheels_note,
    wheels_started_note,
)
from torchherd.console.view import TerminalView, ViewOptions
from torchherd.engine.events import (
    ARCHIVE_EVENTS,
    PULL_EVENTS,
    RECOVERY_EVENTS,
    WHEELS_EVENTS,
    ArchiveDone,
    AttemptFailed,
    ConnectFailed,
    Event,
    EventsNotKept,
    HistoryNotKept,
    Interrupted,
    JobQueued,
    LinesDropped,
    NodeExited,
    NodeLost,
    NodeNotStarted,
    NodeSilent,
    NodeStarted,
    NodeStatus,
    Output,
    PreflightDone,
    ProcessesLeft,
    RanksRunning,
    RunFinished,
    RunStarted,
    WheelsRelayed,
    WheelsStarted,
)
from torchherd.runlog import OutputLine, RankLines
from torchherd.words import count

C10D_NO_NAME = "[c10d] The hostname of the client socket cannot be retrieved"
C10D_BYTES = C10D_NO_NAME.encode()
C10D_EXPLAINED = ("torch's c10d says it cannot name a peer (\"The hostname of the client socket cannot be retrieved\"): "
                  "harmless; its store sees the nodes as ::ffff:a.b.c.d, which /etc/hosts does not name "
                  "(torchherd check says which lines silence it); shown once, every one is in the logs")


def silent_note(event: NodeSilent) -> tuple[str, str]:
    """A node whose supervisor went silent while its sshd answers, and when it speaks again."""
    node = printable(event.node)
    if event.heard:
        return f"{node}: its supervisor speaks again, after {event.seconds:.1f} s of silence", "dim"
    return (f"{node}: its supervisor has sent nothing for {event.seconds:.1f} s, though its sshd answers: the node "
            f"is overloaded, or the supervisor stuck (lost after {event.lost_after:.0f} s of silence)", "yellow")


@dataclass
class Silence:
    """A node's supervisor silences while its sshd answered (``NodeSilent``), for the summary."""

    times: int = 0
    longest: float = 0.0
    open: bool = False
    """The last one had not ended when the run did (the supervisor never spoke again)."""
    lost: bool = False
    """The node was lost after it: the summary's table says so, with why."""

    def saw(self, event: NodeSilent) -> None:
        if event.heard:
            self.open = False
        else:
            self.times += 1
            self.open = True
        self.longest = max(self.longest, event.seconds)


def silence_lines(silences: Mapping[str, Silence]) -> list[str]:
    """The summary's word on each node whose supervisor went silent while its sshd answered
    (and that was not lost for it: the table says that)."""
    lines = []
    for node, silence in silences.items():
        if silence.lost:
            continue
        longest = f"{silence.longest:.1f} s" + (" or more" if silence.open else "")
        length = f"for {longest}" if silence.times == 1 else f"{silence.times} times, {longest} at the longest,"
        lines.append(f"{printable(node)}: its supervisor was silent {length} while its sshd answered (the node "
                     "overloaded, or the supervisor stuck)")
    return lines


class ConsoleObserver:
    """Renders a run's events on ``console``; ``renderer`` is given when following a
    detached run (its nodes are known before any event), else made at ``RunStarted``."""

    def __init__(self, console: Console, renderer: LiveRenderer | None = None,
                 view: ViewOptions | None = None) -> None:
        self.console = console
        self.renderer = renderer
        self.view = view or ViewOptions()
        """The panel, collapsed duplicates, a rank filter (``run``); none by default."""
        self.c10d_noted = False
        """Whether c10d's "cannot name a peer" warning was explained already (once a run)."""
        self.silences: dict[str, Silence] = {}
        """Per node, its supervisor's silences while its sshd answered (every attempt's)."""
        self.pulls = PullView(console, live=self.view.panel)  # a terminal, not --plain
        self.bars = ArchiveBars(console)
        """``--image-archive``'s bars, one per node, while the archive travels."""
        self.wheel_bars = WheelBars(console)
        """``--uv-offline``'s bars, one per node, while the lock's wheels travel."""

    def __call__(self, event: Event) -> None:
        if isinstance(self.renderer, TerminalView):
            self.renderer.observe(event)
        if isinstance(event, WHEELS_EVENTS):
            self._wheels(event)
            return
        if isinstance(event, SYNC_EVENTS):
            for message, style in sync_notes(event):
                self._note(message, style)
            return
        if isinstance(event, PULL_EVENTS):
            for message, style in self.pulls.observe(event):
                self._note(message, style)
            return
        if isinstance(event, ARCHIVE_EVENTS):
            self._archive(event)
            return
        if isinstance(event, RECOVERY_EVENTS):
            self._recovery(event)
        elif isinstance(event, Output):
            self._renderer().render(self._without_c10d_names(event.lines))
        elif isinstance(event, RunStarted):
            self.renderer = self._start_view(event)
            self._note(f"run {event.run_id}: {count(len(event.nodes), 'node')}, master {event.master} at "
                       f"{event.master_addr}:{event.port}; logs in {event.log_dir}", "bold")
        elif isinstance(event, PreflightDone):
            self._preflight(event)
        elif isinstance(event, ConnectFailed):
            render_error(self.console, event.error)
        elif isinstance(event, RunFinished):
            self.close()
            render_summary(self.console, event.summary)
            straggler = event.summary.straggler
            if straggler is not None:
                self.console.print(Text(printable(straggler), style="bold magenta" if "x slower" in straggler else "dim"),
                                   soft_wrap=True)
            for line in silence_lines(self.silences):
                self.console.print(Text(line, style="yellow"), soft_wrap=True)
            if event.summary.checkpoint is not None:
                self.console.print(Text(printable(event.summary.checkpoint), style="bold"), soft_wrap=True)
            render_attempts(self.console, event.summary.attempts)
            render_report_line(self.console, event.summary)
        elif isinstance(event, NodeStatus):
            status_note(self._renderer(), event.status)
        elif isinstance(event, JobQueued):
            reason = f" ({event.reason})" if event.reason else ""
            self._note(f"SLURM job {event.job_id}: {event.state.lower()}{reason}", "dim")
        else:
            self._node_note(event)

    def _without_c10d_names(self, batch: Sequence[OutputLine | RankLines]) -> Sequence[OutputLine | RankLines]:
        """torch's c10d warns, once per peer and rank, that it cannot name a peer's address
        (its store sees IPv4-mapped IPv6 addresses that /etc/hosts does not name): harmless,
        so one torchherd note a run stands for all of them on screen (the logs keep each)."""
        if not any(C10D_NO_NAME in item.text if isinstance(item, OutputLine) else C10D_BYTES in item.records
                   for item in batch):
            return batch  # the common case: a bytes search per chunk, no line parsed
        kept: list[OutputLine | RankLines] = []
        for item in batch:
            if isinstance(item, RankLines) and C10D_BYTES not in item.records:
                kept.append(item)
                continue
            kept += [line for line in (item.lines() if isinstance(item, RankLines) else [item])
                     if C10D_NO_NAME not in line.text]
        if not self.c10d_noted:
            self.c10d_noted = True
            self._note(C10D_EXPLAINED, "dim")
        return kept

    def _node_note(self, event: Event) -> None:
        if isinstance(event, LinesDropped):
            self._note(f"{event.count} lines not shown: the terminal fell behind (every line is in the log files)",
                       "yellow")
        elif isinstance(event, EventsNotKept):
            self._note(f"the run's history is not kept (torchherd report will lack the rest): {event.reason}", "yellow")
        elif isinstance(event, HistoryNotKept):
            self._note(f"not in the run history (torchherd status will not list this run): {event.reason}", "yellow")
        elif isinstance(event, RanksRunning):
            self._note(f"{event.node}: ranks running (through the rendezvous)", "dim")
        elif isinstance(event, NodeStarted):
            pid = f" (pid {event.pid})" if event.pid is not None else ""
            self._note(f"{event.node}: torchrun started{pid}", "dim")
        elif isinstance(event, NodeNotStarted):
            self._note(f"{event.node}: {event.message}", "bold red")
        elif isinstance(event, NodeExited) and event.code == 0:
            self._note(f"{event.node}: finished (exit 0)", "green")
        elif isinstance(event, NodeExited) and not event.expected:
            self._note(f"{event.node}: exited with code {event.code}", "bold red")
        elif isinstance(event, NodeLost):
            if event.node in self.silences and self.silences[event.node].open:
                self.silences[event.node].lost = True
            self._note(event.reason, "bold red")
        elif isinstance(event, NodeSilent):
            self.silences.setdefault(event.node, Silence()).saw(event)
            self._note(*silent_note(event))
        elif isinstance(event, ProcessesLeft):
            self._note(f"{event.node}: {event.count} processes of the job could not be killed", "bold red")
        elif isinstance(event, Interrupted) and not event.again:
            self._note("interrupted: stopping every node (interrupt again to kill at once)", "bold yellow")

    def _recovery(self, event: RecoveryEvent) -> None:
        if isinstance(event, AttemptFailed):
            # The attempt's panel goes; the next attempt's RunStarted makes another.
            self.close()
            self.renderer = LiveRenderer(self.console, [], 0)
        message, style = recovery_note(event)
        self._note(message, style)

    def _preflight(self, event: PreflightDone) -> None:
        report = event.report
        if not report.ok:
            render_report(self.console, report)
            return
        warnings = [result for result in report.results if result.status == "warn"]
        self.console.print(Text(f"preflight: {len(report.results)} checks passed"
                                + (f", {len(warnings)} warnings (torchherd check shows them)" if warnings else ""),
                                style="dim"), soft_wrap=True)

    def _start_view(self, event: RunStarted) -> LiveRenderer:
        if self.view.plain:
            return LiveRenderer(self.console, event.nodes, event.max_rank)
        view = TerminalView(self.console, event.nodes, event.max_rank, self.view)
        view.start()
        return view

    def close(self) -> None:
        """Shows what the view still holds and takes the panel away (the run ended, or
        the command is leaving); harmless when there is nothing to close."""
        self.pulls.close()
        self.bars.close()
        self.wheel_bars.close()
        if isinstance(self.renderer, TerminalView):
            self.renderer.close()

    def _archive(self, event: ArchiveEvent) -> None:
        """The notes around the bars: what goes where first, what failed after them."""
        if isinstance(event, ArchiveDone):
            self.bars(event)
        for message, style in archive_notes(event):
            self._note(message, style)
        if not isinstance(event, ArchiveDone):
            self.bars(event)

    def _wheels(self, event: WheelsEvent) -> None:
        """The note before the bars, and the summary after them (which closes them)."""
        if isinstance(event, WheelsRelayed):
            self.wheel_bars(event)
            self._note(*wheels_note(event))
            return
        if isinstance(event, WheelsStarted):
            self._note(*wheels_started_note(event))
        self.wheel_bars(event)

    def _renderer(self) -> LiveRenderer:
        if self.renderer is None:
            self.renderer = LiveRenderer(self.console, [], 0)
        return self.renderer

    def _note(self, message: str, style: str) -> None:
        self._renderer().note(message, style)
