"""``--image-archive`` as the user sees it: a note as it starts (what goes where, which
nodes have the image already), one progress bar per node while the archive travels and
loads, and a note per node that failed and one at the end."""

from __future__ import annotations

from typing import Iterator, Union

from rich.console import Console

from torchherd.console import printable
from torchherd.console.bars import NodeBars
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
    """One bar per node that loads the archive (``NodeBars``): bytes received, then
    "loading", then "loaded" or "failed"."""

    def __init__(self, console: Console) -> None:
        self.bars = NodeBars(console)

    def __call__(self, event: ArchiveEvent) -> None:
        if isinstance(event, ArchiveStarted):
            self.bars.start(event.loading, event.size)
        elif isinstance(event, ArchiveProgress):
            self.bars.update(event.node, event.done, event.total,
                             "loading" if event.phase == "loading" else "receiving")
        elif isinstance(event, ArchiveDone):
            self.bars.finish({node for node, _ in event.failed}, "loaded")

    def close(self) -> None:
        """Stops the bars (harmless when none are shown)."""
        self.bars.close()
