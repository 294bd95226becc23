"""One progress bar per node of a relay (``engine.prepare.relay``: an image archive, a venv's
wheelhouse), fed by a small adapter per kind of relay (``console.images.ArchiveBars``,
``console.sync.WheelBars``) that turns its events into ``start``, ``update`` and ``finish``."""

from __future__ import annotations

from typing import Collection, Sequence

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn

from torchherd.console import printable
from torchherd.words import size


class NodeBars:
    """One bar per node: bytes received of the total, and a word for where the node is
    ("waiting", "receiving", then the adapter's own). Rich's live display keeps them in
    place on a terminal; elsewhere (a log, a pipe) only their last state is printed, once."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress: Progress | None = None
        self.tasks: dict[str, TaskID] = {}

    def start(self, nodes: Sequence[str], total: int) -> None:
        """A bar per node of ``nodes``, each "waiting" at 0 of ``total`` bytes (none shown
        for no node); bars still shown from before are stopped first."""
        self.close()
        if not nodes:
            return
        width = max(len(printable(node)) for node in nodes)
        self.progress = Progress(TextColumn("  {task.description}"), BarColumn(bar_width=30),
                                 TextColumn("{task.fields[amount]}"), TextColumn("{task.fields[state]}"),
                                 console=self.console, auto_refresh=self.console.is_terminal)
        for node in nodes:
            self.tasks[node] = self.progress.add_task(printable(node).ljust(width), total=total,
                                                      amount=f"0 B / {size(total)}", state="waiting")
        self.progress.start()

    def update(self, node: str, done: int, total: int, state: str) -> None:
        """``node`` is at ``done`` of ``total`` bytes, in ``state`` (a node without a bar: nothing)."""
        if self.progress is not None and node in self.tasks:
            self.progress.update(self.tasks[node], completed=done, state=state, amount=f"{size(done)} / {size(total)}")

    def finish(self, failed: Collection[str], state: str) -> None:
        """The end: the nodes of ``failed`` say "failed" where their bar stopped, every
        other bar is full and says ``state``; then the bars are stopped."""
        if self.progress is None:
            return
        for node, task in self.tasks.items():
            total = self.progress.tasks[task].total or 0
            if node in failed:
                self.progress.update(task, state="failed")
            else:
                self.progress.update(task, completed=total, state=state,
                                     amount=f"{size(int(total))} / {size(int(total))}")
        self.close()

    def close(self) -> None:
        """Stops the bars (harmless when none are shown)."""
        if self.progress is not None:
            self.progress.stop()
        self.progress = None
        self.tasks = {}
