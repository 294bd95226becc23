"""``--image-archive`` as the user sees it: a note as it starts (what goes where, which
nodes have the image already), one progress bar per node while the archive travels and
loads, and a note per node that failed and one at the end."""

from __future__ import annotations

from typing import Iterator, Union

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn

from torchherd.console import printable
from torchherd.console.sync import names
from torchherd.engine.events import ArchiveDone, ArchiveProgress, ArchiveStarted
from torchherd.words import count, size

ArchiveEvent = Union[ArchiveStarted, ArchiveProgress, ArchiveDone]


def short(image_id: str) -> str:
    return image_id[:12]


def archive_notes(event: ArchiveEvent) -> Iterator[tuple[str, str]]:
    """The notes (text, style) for an archive event; progress is the bars' (none here)."""
    if isinstance(event, ArchiveStarted):
        what = f"image {printable(event.image)} {short(event.image_id)}"
        if event.loading:
            route = " -> ".join(printable(node) for node in event.loading)
            yield (f"image archive: sending {printable(event.archive)} ({size(event.size)}, {what}) once, "
                   f"relayed node to node: this machine -> {route}", "bold")
        if event.having:
            yield f"{names(event.having)}: {what} there already: nothing sent", "dim"
    elif isinstance(event, ArchiveDone):
        for node, why in event.failed:
            yield f"{printable(node)}: image not loaded: {printable(why)}", "bold red"
        if event.loaded or event.failed:
            total = len(event.loaded) + len(event.failed)
            yield (f"image archive: {printable(event.image)} loaded on {len(event.loaded)} of "
                   f"{count(total, 'node')} ({event.seconds:.1f} s; {size(event.sent)} sent from this machine)",
                   "green" if event.ok else "bold red")


class ArchiveBars:
    """One bar per node that loads the archive: bytes received, then "loading", then
    "loaded" or "failed". Rich's live display keeps them in place on a terminal; elsewhere
    (a log, a pipe) only their last state is printed, once."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress: Progress | None = None
        self.tasks: dict[str, TaskID] = {}

    def __call__(self, event: ArchiveEvent) -> None:
        if isinstance(event, ArchiveStarted):
            self._start(event)
        elif isinstance(event, ArchiveProgress) and self.progress is not None and event.node in self.tasks:
            state = "loading" if event.phase == "loading" else "receiving"
            self.progress.update(self.tasks[event.node], completed=event.done, state=state,
                                 amount=f"{size(event.done)} / {size(event.total)}")
        elif isinstance(event, ArchiveDone) and self.progress is not None:
            failed = dict(event.failed)
            for node, task in self.tasks.items():
                total = self.progress.tasks[task].total or 0
                if node in failed:
                    self.progress.update(task, state="failed")
                else:
                    self.progress.update(task, completed=total, state="loaded",
                                         amount=f"{size(int(total))} / {size(int(total))}")
            self.close()

    def _start(self, event: ArchiveStarted) -> None:
        self.close()
        if not event.loading:
            return
        width = max(len(printable(node)) for node in event.loading)
        self.progress = Progress(TextColumn("  {task.description}"), BarColumn(bar_width=30),
                                 TextColumn("{task.fields[amount]}"), TextColumn("{task.fields[state]}"),
                                 console=self.console, auto_refresh=self.console.is_terminal)
        for node in event.loading:
            self.tasks[node] = self.progress.add_task(printable(node).ljust(width), total=event.size,
                                                      amount=f"0 B / {size(event.size)}", state="waiting")
        self.progress.start()

    def close(self) -> None:
        """Stops the bars (harmless when none are shown)."""
        if self.progress is not None:
            self.progress.stop()
        self.progress = None
        self.tasks = {}
