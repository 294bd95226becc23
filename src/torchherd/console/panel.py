"""The live panel under a run's scrolling lines: the cluster at a glance.

One row per node (or, when they do not fit, per group of nodes in the same state):
its state, the ranks that have printed, lines per second, how long since it last
printed (a node that goes quiet while the others print is how a hang looks), GPU
use where its supervisor samples ``nvidia-smi``, and its last line or, while a rank
redraws a progress bar, that bar as it stands.

``PanelModel`` is fed the run's events and knows nothing of the screen;
``render_panel`` turns it into a rich table. Both take the time as an argument, so
tests render exact text.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Sequence

from rich import box
from rich.table import Table
from rich.text import Text

from torchherd.console import node_colour, printable
from torchherd.engine.watch.straggler import Progress, rate_text
from torchherd.inventory.nodeset import fold_names
from torchherd.runlog import ERR_HEAD, STDERR, GpuUsage, OutputLine, RankLines

RATE_WINDOW = 3.0
"""Seconds over which lines per second are counted."""
QUIET_AFTER = 30.0
"""A running node silent this long, while another printed lately, is shown as quiet."""
BAR_FRESH = 10.0
"""A progress bar not redrawn for this long gives its place back to the last line."""
STATE_STYLES = {"connecting": "dim", "rendezvous": "yellow", "running": "green", "quiet": "bold yellow",
                "stopping": "yellow", "finished": "green", "exited": "bold red", "lost": "bold red",
                "not started": "bold red", "slow": "bold magenta", "silent": "bold yellow"}


@dataclass
class NodeView:
    """What the panel knows of one node."""

    name: str
    index: int
    state: str = "connecting"
    code: int | None = None
    ranks: set[int] = field(default_factory=set)
    lines: int = 0
    counts: deque[tuple[float, int]] = field(default_factory=deque)
    """(time, lines) per chunk of the last ``RATE_WINDOW`` seconds, for lines per second."""
    first_output: float | None = None
    last_output: float | None = None
    last_line: str = ""
    bar: str = ""
    bar_rank: int | None = None
    bar_at: float = 0.0
    gpus: tuple[GpuUsage, ...] = ()
    before_silent: str = ""
    """Its state before its supervisor went silent (``silent``), given back when it speaks."""

    def printed(self, count: int, now: float) -> None:
        self.lines += count
        self.counts.append((now, count))
        self.first_output = self.first_output if self.first_output is not None else now
        self.last_output = now

    def rate(self, now: float) -> float:
        """Lines per second over the last ``RATE_WINDOW`` seconds (or since the first line)."""
        while self.counts and now - self.counts[0][0] > RATE_WINDOW:
            self.counts.popleft()
        if self.first_output is None:
            return 0.0
        return sum(count for _at, count in self.counts) / max(1.0, min(RATE_WINDOW, now - self.first_output))

    def state_text(self) -> str:
        if self.state == "exited" and self.code == 0:
            return "finished"
        if self.state == "exited":
            return f"exited {self.code}"
        return self.state

    def shown_line(self, now: float) -> str:
        if self.bar and now - self.bar_at < BAR_FRESH:
            return self.bar if self.bar_rank is None else f"[{self.bar_rank}] {self.bar}"
        return self.last_line


class PanelModel:
    """Every node's view, kept up to date from the run's events (``ConsoleObserver``)."""

    def __init__(self, nodes: Sequence[str]) -> None:
        self.nodes = {name: NodeView(name, index) for index, name in enumerate(nodes)}

    def node(self, name: str) -> NodeView:
        view = self.nodes.get(name)
        if view is None:
            view = self.nodes[name] = NodeView(name, len(self.nodes))
        return view

    def lines(self, chunks: Sequence[OutputLine | RankLines], now: float) -> None:
        for chunk in chunks:
            view = self.node(chunk.node)
            if isinstance(chunk, RankLines):
                view.printed(chunk.records.count(b"\n") - 1, now)
                last = chunk.tail(1)
                if last:
                    view.last_line = last[0].text
                    if last[0].rank is not None:
                        view.ranks.add(last[0].rank)
                if view.bar and ERR_HEAD + b"%d] " % (view.bar_rank or 0) in chunk.records:
                    view.bar = ""  # its line ended: the bar's last state scrolls with the lines
            else:
                view.printed(1, now)
                view.last_line = chunk.text
                if chunk.rank is not None:
                    view.ranks.add(chunk.rank)
                if view.bar and chunk.stream == STDERR and chunk.rank == view.bar_rank:
                    view.bar = ""

    def state(self, name: str, state: str, code: int | None = None) -> None:
        view = self.node(name)
        if view.state in ("exited", "lost", "not started") and state == "stopping":
            return
        view.state, view.code = state, code

    def silent(self, name: str, heard: bool) -> None:
        """The node's supervisor went silent while its sshd answers (``NodeSilent``): shown
        as ``silent`` until it speaks again (``heard``: as it was) or the node's end is known."""
        view = self.node(name)
        if heard:
            if view.state == "silent":
                view.state = view.before_silent
        elif view.state in ("connecting", "rendezvous", "running"):
            view.before_silent, view.state = view.state, "silent"

    def bar(self, name: str, rank: int | None, text: str, now: float) -> None:
        """A rank's progress bar as it stands; the node shows its lowest rank's bar."""
        view = self.node(name)
        if view.bar_rank is None or rank is None or rank <= view.bar_rank or now - view.bar_at >= BAR_FRESH:
            view.bar, view.bar_rank, view.bar_at = text, rank, now
        view.last_output = now

    def gpus(self, name: str, gpus: tuple[GpuUsage, ...]) -> None:
        self.node(name).gpus = gpus


@dataclass(frozen=True)
class Row:
    """One line of the panel: a node, or a group of nodes in the same state."""

    label: str
    colour: str
    state: str
    ranks: int
    rate: float
    quiet: float | None
    gpu: str
    line: str


def rows(model: PanelModel, now: float, limit: int) -> list[Row]:
    """A row per node; when more than ``limit``, a row per state (nodes folded into a
    nodeset), quiet nodes apart from the others."""
    latest = max((view.last_output for view in model.nodes.values() if view.last_output is not None), default=None)
    singles = [_row([view], now, latest) for view in model.nodes.values()]
    if len(singles) <= limit:
        return singles
    groups: dict[str, list[NodeView]] = {}
    for view, row in zip(model.nodes.values(), singles):
        groups.setdefault(row.state, []).append(view)
    return [_row(views, now, latest) for views in groups.values()][:limit]


def _row(views: list[NodeView], now: float, latest: float | None) -> Row:
    first = views[0]
    state = first.state_text()
    quiet = [now - view.last_output for view in views if view.last_output is not None]
    silent = max(quiet) if quiet else None
    if (state.startswith(("running", "slow ")) and silent is not None and silent >= QUIET_AFTER
            and latest is not None and now - latest < QUIET_AFTER):
        state = "quiet"
    newest = max(views, key=lambda view: max(view.last_output or 0.0, view.bar_at))
    label = first.name if len(views) == 1 else f"{fold_names([view.name for view in views])} ({len(views)})"
    return Row(label, node_colour(first.index), state, sum(len(view.ranks) for view in views),
               sum(view.rate(now) for view in views), silent, _gpu_text([gpu for view in views for gpu in view.gpus]),
               newest.shown_line(now))


def _marked(model: PanelModel, progress: Progress | None) -> PanelModel:
    """The model as the panel shows it, a running node marked slow in its state
    (``slow 1.8x``): a copy, the model itself stays as the events left it."""
    if progress is None or not progress.marked:
        return model
    shown = PanelModel([])
    for name, view in model.nodes.items():
        ratio = progress.marked.get(name)
        shown.nodes[name] = view if ratio is None or view.state != "running" else replace(view, state=f"slow {ratio:.1f}x")
    return shown


def _gpu_text(gpus: list[GpuUsage]) -> str:
    if not gpus:
        return ""
    utilisation = sum(gpu.utilisation for gpu in gpus) / len(gpus)
    used = sum(gpu.memory_used for gpu in gpus) / 1024
    total = sum(gpu.memory_total for gpu in gpus) / 1024
    return f"{utilisation:.0f}% {used:.1f}/{total:.0f}G"


def _rate_text(rate: float) -> str:
    if rate >= 1000:
        return f"{rate / 1000:.1f}k"
    return f"{rate:.0f}" if rate >= 1 or rate == 0 else f"{rate:.1f}"


def _quiet_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.0f}s"
    return f"{seconds // 60:.0f}m{seconds % 60:02.0f}s"


_NUMBERS = ("ranks", "lines/s", "it/s", "quiet")


def render_panel(model: PanelModel, now: float, limit: int = 16, progress: Progress | None = None) -> Table:
    """The panel as a table (``limit``: the most rows before nodes are grouped). With
    ``progress`` (``StragglerTracker``): a marked node's state says how slow it is, and
    tqdm's rates get a column of their own."""
    shown = rows(_marked(model, progress), now, limit)
    cells = [[Text(row.label, style=row.colour), Text(row.state, style=STATE_STYLES.get(row.state.split()[0], "")),
              Text(str(row.ranks)), Text(_rate_text(row.rate)), Text(_quiet_text(row.quiet)), Text(row.gpu)]
             for row in shown]
    headers = ["node", "state", "ranks", "lines/s", "quiet", "gpu"]
    if not any(row.gpu for row in shown):
        headers.pop()
    if progress is not None and progress.signal == "tqdm rate":
        # A group's rate would be a sum of unlike bars: only a node's own row shows one.
        rates = progress.rates
        for shown_row, cell in zip(shown, cells):
            cell.insert(4, Text(rate_text(rates[shown_row.label]) if shown_row.label in rates else "-"))
        headers.insert(4, "it/s")
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1), pad_edge=False)
    for index, header in enumerate(headers):
        # Every column but the last line keeps its width: only that one gives way.
        width = max([len(header)] + [len(row[index]) for row in cells])
        table.add_column(Text(header), no_wrap=True, min_width=width, justify="right" if header in _NUMBERS else "left")
    table.add_column(Text("last line"), overflow="ellipsis")
    for row, line in zip(cells, shown):
        table.add_row(*row[:len(headers)], Text(printable(line.line), overflow="ellipsis", no_wrap=True))
    return table
