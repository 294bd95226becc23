"""The pull step (``--pull missing|always``) as the user sees it: one progress bar per node
while the images come in (a rich ``Live`` on a terminal), then one line per outcome, the
nodes folded as a nodeset (``node[0-63]``): a pull on 256 nodes is a few lines, not 256."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Union

from rich.console import Console
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from torchherd.console import printable
from torchherd.engine.events import NodePulled, PullFailed, PullProgress, PullsDone, PullStarted
from torchherd.inventory.nodeset import fold_names
from torchherd.words import count

PullEvent = Union[PullStarted, PullProgress, NodePulled, PullFailed, PullsDone]
BAR_WIDTH = 30
SHOWN = 16
"""Bars shown at most while pulling; the others are counted in one row."""


@dataclass
class NodeBar:
    """What one node's bar shows."""

    node: str
    done: int = 0
    layers: int = 0
    status: str = "waiting"
    ended: str = ""
    """"pulled", "there" or "failed" once the node is done."""


def pull_notes(event: PullStarted | PullsDone) -> Iterator[tuple[str, str]]:
    """The notes (text, style) for the step's start and end; alike outcomes on one line."""
    if isinstance(event, PullStarted):
        images = sorted({image for _, image in event.nodes})
        yield (f"pull: {', '.join(map(printable, images))} on {count(len(event.nodes), 'node')} "
               f"(pull {event.policy}), all at once", "bold")
        return
    groups: dict[tuple[str, str, str], list[str]] = {}
    for node in event.nodes:
        if isinstance(node, NodePulled):
            key = ("pulled", node.image, str(node.layers)) if node.pulled else ("there", node.image, "")
        else:
            key = ("failed", node.image, node.message)
        groups.setdefault(key, []).append(node.node)
    seconds = {node.node: node.seconds for node in event.nodes if isinstance(node, NodePulled)}
    for (outcome, image, detail), nodes in groups.items():
        where = printable(fold_names(nodes))
        if outcome == "pulled":
            slowest = max(seconds[node] for node in nodes)
            yield f"{where}: {printable(image)} pulled ({count(int(detail), 'layer')}, {slowest:.1f} s)", "dim"
        elif outcome == "there":
            yield f"{where}: {printable(image)} there already", "dim"
        else:
            yield f"pull: {printable(image)} could not be pulled on {where}: {printable(detail)}", "bold red"
    good = sum(isinstance(node, NodePulled) for node in event.nodes)
    yield (f"pull: {good} of {count(len(event.nodes), 'node')} have the image ({event.seconds:.1f} s)",
           "green" if not event.failed else "bold red")


def bars(states: list[NodeBar], width: int = BAR_WIDTH) -> Table:
    """One row per node: its name, its bar (layers in), the count and what it is doing."""
    table = Table.grid(padding=(0, 1))
    for _ in range(4):
        table.add_column()
    for state in states[:SHOWN]:
        if state.ended == "failed":
            bar: ProgressBar | Text = Text("failed".ljust(width), style="bold red")
        elif state.layers or state.ended:
            total = max(state.layers, 1)
            bar = ProgressBar(total=total, completed=total if state.ended else state.done, width=width,
                              complete_style="green" if state.ended else "cyan", finished_style="green")
        else:
            bar = Text("·" * width, style="dim")  # no layer named yet: no bar to fill
        counted = f"{state.done}/{state.layers} layers" if state.layers else ""
        table.add_row(Text(printable(state.node)), bar, Text(counted), Text(printable(state.status), style="dim"))
    if len(states) > SHOWN:
        ended = sum(1 for state in states if state.ended)
        table.add_row(Text(f"+{len(states) - SHOWN}"), Text(f"{ended} of {len(states)} nodes done", style="dim"),
                      Text(""), Text(""))
    return table


class PullView:
    """The pull step's events, rendered: the bars in a ``Live`` (``live``: a terminal, not
    ``--plain``), the notes through ``note``."""

    def __init__(self, console: Console, live: bool) -> None:
        self.console = console
        self.live_wanted = live
        self.states: dict[str, NodeBar] = {}
        self.live: Live | None = None

    def observe(self, event: PullEvent) -> Iterator[tuple[str, str]]:
        """Takes one event; yields the notes to print (after the bars are gone)."""
        if isinstance(event, PullStarted):
            self.states = {node: NodeBar(node) for node, _ in event.nodes}
            yield from pull_notes(event)
            if self.live_wanted:
                self.live = Live(bars(list(self.states.values())), console=self.console, transient=True,
                                 refresh_per_second=8)
                self.live.start()
            return
        if isinstance(event, PullsDone):
            self.close()
            yield from pull_notes(event)
            return
        state = self.states.setdefault(event.node, NodeBar(event.node))
        if isinstance(event, PullProgress):
            state.done, state.layers, state.status = event.done, event.layers, event.status
        elif isinstance(event, NodePulled):
            state.ended, state.done, state.status = ("pulled" if event.pulled else "there"), state.layers, "done"
        else:
            state.ended, state.status = "failed", event.message
        if self.live is not None:
            self.live.update(bars(list(self.states.values())))

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
