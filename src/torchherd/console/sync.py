"""``--sync`` as the user sees it: one note as it starts, one per node, one at the end;
``--dry-run`` lists per node what would be sent and deleted (nodes that would get the
same are listed once). File names and what the nodes say are shown through
``printable``: a file named with an escape sequence never acts on the terminal."""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence, Union

from rich.console import Console
from rich.text import Text

from torchherd.console import printable
from torchherd.console.bars import NodeBars
from torchherd.engine.events import (
    NodeSynced,
    SyncDone,
    SyncFailed,
    SyncStarted,
    VenvFailed,
    VenvReady,
    VenvsDone,
    WheelFetched,
    WheelsDownloading,
    WheelsProgress,
    WheelsRelayed,
    WheelsStarted,
)
from torchherd.words import count, size

SYNC_EVENTS = (SyncStarted, NodeSynced, SyncFailed, SyncDone, VenvsDone, WheelsDownloading, WheelFetched,
               WheelsStarted, WheelsRelayed)
WheelsEvent = Union[WheelsStarted, WheelsProgress, WheelsRelayed]
LISTED = 40
"""Paths listed per group of nodes on a dry run; the rest are counted."""


def files(number: int) -> str:
    return count(number, "file")


def sync_notes(event: SyncStarted | NodeSynced | SyncFailed | SyncDone | VenvsDone | WheelsDownloading | WheelFetched
               | WheelsStarted | WheelsRelayed) -> Iterator[tuple[str, str]]:
    """The notes (text, style) a live run shows for a sync event. Nodes in sync are told
    at the end, alike nodes on one line (a run on 256 nodes is not 256 lines of it)."""
    if isinstance(event, SyncStarted):
        doing = "comparing" if event.dry_run else "sending"
        yield (f"sync: {doing} {printable(event.source)} ({files(event.files)}, {size(event.bytes)}) with "
               + count(len(event.nodes), "node"), "bold")
        for skipped in event.skipped[:5]:
            yield f"sync: left out {printable(skipped)}", "yellow"
        if len(event.skipped) > 5:
            yield f"sync: {len(event.skipped) - 5} more left out", "yellow"
        if event.private:
            yield private_note(event.private), ""
    elif isinstance(event, SyncFailed):
        yield f"{printable(event.node)}: not in sync: {printable(event.message)}", "bold red"
        for path, why in event.files[3:10]:
            yield f"{printable(event.node)}: {printable(path)}: {printable(why)}", "red"
    elif isinstance(event, SyncDone) and not event.dry_run:
        yield from _in_sync(event)
        good = sum(isinstance(node, NodeSynced) for node in event.nodes)
        yield (f"sync: {good} of {count(len(event.nodes), 'node')} in sync ({event.seconds:.1f} s)",
               "green" if event.ok else "bold red")
    elif isinstance(event, VenvsDone):
        yield from venv_notes(event)
    elif isinstance(event, (WheelsDownloading, WheelFetched)):
        yield wheels_download_note(event)
    elif isinstance(event, WheelsStarted):
        yield wheels_started_note(event)
    elif isinstance(event, WheelsRelayed):
        yield wheels_note(event)


def wheels_download_note(event: WheelsDownloading | WheelFetched) -> tuple[str, str]:
    """``--uv-offline``: the wheels pip fetches here, before the wheelhouse goes out (a
    download of gigabytes is minutes), and each file as pip begins it."""
    if isinstance(event, WheelFetched):
        where = "from pip's cache" if event.cached else "downloading"
        return f"wheels: pip: {where} {printable(event.file)}" + (f" ({printable(event.size)})" if event.size
                                                                   else ""), "dim"
    shown = ", ".join(printable(name) for name in event.names[:5])
    more = f" and {len(event.names) - 5} more" if len(event.names) > 5 else ""
    what = ("the project's build backend, with its dependencies," if event.backend
            else f"{count(len(event.names), 'wheel')} of uv.lock")
    return (f"wheels: downloading {what} for {printable(event.tag)} python {printable(event.python)} with pip, in "
            f"none of {printable(event.looked)}: {shown}{more}", "")


def wheels_started_note(event: WheelsStarted) -> tuple[str, str]:
    """``--uv-offline``: the lock's wheels for one platform, as their copy starts: what goes
    where (the bars, or on a pipe the end's note, say how it went)."""
    times = "once" if len(event.chains) == 1 else f"once per chain ({len(event.chains)} chains)"
    return (f"wheels: sending uv.lock's {files(event.files)} for {printable(event.tag)} python {printable(event.python)} "
            f"({size(event.size)}; {printable(event.path)}) {times}, relayed node to node: {routes(event.chains)}",
            "bold")


def routes(chains: tuple[tuple[str, ...], ...]) -> str:
    """Each chain from this machine, one after the other."""
    return ", then ".join("this machine -> " + " -> ".join(printable(node) for node in chain) for chain in chains)


class WheelBars:
    """One bar per node the lock's wheels go to (``NodeBars``): bytes received, "received"
    once every byte is in (the node checks the copy's hash then), and at the end "verified"
    (in place beside its venvs) or "failed"."""

    def __init__(self, console: Console) -> None:
        self.bars = NodeBars(console)

    def __call__(self, event: WheelsEvent) -> None:
        if isinstance(event, WheelsStarted):
            self.bars.start(event.nodes, event.size)
        elif isinstance(event, WheelsProgress):
            self.bars.update(event.node, event.done, event.total,
                             "received" if event.done >= event.total else "receiving")
        elif isinstance(event, WheelsRelayed):
            self.bars.finish({node for node, _ in event.failed}, "verified")

    def close(self) -> None:
        """Stops the bars (harmless when none are shown)."""
        self.bars.close()


def wheels_note(event: WheelsRelayed) -> tuple[str, str]:
    """``--uv-offline``: the lock's wheels for one platform, where they came from, and what this machine sent."""
    fetched = f"{len(event.downloaded)} downloaded now" if event.downloaded else "none downloaded"
    reached = len(event.nodes) - len(event.failed)
    text = (f"wheels: uv.lock's {files(event.files)} for {printable(event.tag)} python {printable(event.python)} "
            f"({size(event.size)}, {fetched}; {printable(event.path)}) relayed node to node: {routes(event.chains)}: "
            f"on {reached} of {count(len(event.nodes), 'node')} ({event.seconds:.1f} s; {size(event.sent)} sent "
            "from this machine)")
    for node, why in event.failed[:3]:
        text += f"; {printable(node)}: {printable(why)}"
    return text, "dim" if not event.failed else "bold red"


def venv_notes(done: VenvsDone) -> Iterator[tuple[str, str]]:
    """A uv-locked project's venvs: the nodes that built theirs, that found theirs built
    (uv not run), and each failure with its fix."""
    groups: dict[tuple[str, bool], list[VenvReady]] = {}
    for node in done.nodes:
        if isinstance(node, VenvReady):
            groups.setdefault((node.path, node.built), []).append(node)
            if node.shipped:
                whose = f"the one of {printable(node.wheel)}" if node.wheel else "this machine's"
                yield f"{printable(node.node)}: had no uv: {whose} sent ({printable(node.uv)})", "yellow"
        elif isinstance(node, VenvFailed):
            yield f"{printable(node.node)}: venv not built: {printable(node.message)}", "bold red"
            if node.hint:
                yield f"{printable(node.node)}: fix: {printable(node.hint)}", "red"
    for (path, built), nodes in groups.items():
        if built:
            slowest = max(node.seconds for node in nodes)
            how = ("uv pip sync --offline from the lock's wheels" if any(node.offline for node in nodes)
                   else "uv sync --frozen")
            yield (f"{names(node.node for node in nodes)}: venv {printable(path)} built from uv.lock by {how} "
                   f"({slowest:.1f} s)", "dim")
        else:
            yield f"{names(node.node for node in nodes)}: venv {printable(path)} as uv.lock made it (cached)", "dim"


def _in_sync(done: SyncDone) -> Iterator[tuple[str, str]]:
    groups: dict[str, list[NodeSynced]] = {}
    for node in done.nodes:
        if isinstance(node, NodeSynced):
            what = (f"in sync at {printable(node.dest)}: {files(len(node.sent))} sent ({size(node.sent_bytes)}), "
                    f"{len(node.deleted)} deleted, {node.unchanged} unchanged")
            groups.setdefault(what, []).append(node)
    for what, nodes in groups.items():
        slowest = max(node.seconds for node in nodes)
        yield f"{names(node.node for node in nodes)}: {what} ({slowest:.1f} s)", "dim"


def private_note(paths: Sequence[str], shown: int = 5) -> str:
    """What the private defaults left out, and how to send one of them on purpose."""
    listed = ", ".join(paths[:shown]) + (f" and {len(paths) - shown} more" if len(paths) > shown else "")
    return printable(f"sync: left out as private: {listed} (--sync-include PATTERN sends it)")


def names(nodes: Iterable[str], shown: int = 6) -> str:
    listed = list(nodes)
    if len(listed) <= shown:
        return printable(", ".join(listed))
    return printable(f"{', '.join(listed[:shown - 1])}, ... {listed[-1]} ({len(listed)} nodes)")


def render_sync_plan(console: Console, done: SyncDone) -> None:
    """``--dry-run``: per node (nodes alike grouped), the files that would be sent and deleted."""
    groups: dict[tuple[tuple[str, ...], tuple[str, ...], str], list[NodeSynced]] = {}
    for node in done.nodes:
        if isinstance(node, NodeSynced):
            groups.setdefault((node.sent, node.deleted, node.dest), []).append(node)
    for (sent, deleted, dest), nodes in groups.items():
        first = nodes[0]
        console.print(Text(f"sync to {names(node.node for node in nodes)} ({printable(dest)}): would send {files(len(sent))} ({size(first.sent_bytes)}), "
                           f"delete {len(deleted)}, {first.unchanged} unchanged", style="bold"), soft_wrap=True)
        _paths(console, "+", sent)
        _paths(console, "-", deleted)
    for failed in done.failed:
        console.print(Text(f"sync to {printable(failed.node)}: {printable(failed.message)}", style="bold red"),
                      soft_wrap=True)
    if done.private:
        console.print(Text(private_note(done.private)), soft_wrap=True)
    if done.failed:  # why a dry run exits 1: the run itself would stop at this sync
        lacks = "it lacks" if len(done.failed) == 1 else "they lack"
        console.print(Text(f"{count(len(done.failed), 'node')} could not be asked what {lacks}: the run would stop "
                           "there (exit 1; the dry run changed nothing)", style="bold red"), soft_wrap=True)


def _paths(console: Console, mark: str, paths: Sequence[str]) -> None:
    for path in paths[:LISTED]:
        console.print(Text(f"  {mark} {printable(path)}"), soft_wrap=True)
    if len(paths) > LISTED:
        console.print(Text(f"  {mark} ... {len(paths) - LISTED} more", style="dim"), soft_wrap=True)


class SyncPrinter:
    """An observer that prints the sync's notes and nothing else (``check --sync``;
    rich's console.print keeps a live grid intact)."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def __call__(self, event: object) -> None:
        if isinstance(event, SYNC_EVENTS):
            for message, style in sync_notes(event):
                self.console.print(Text(message, style=style), soft_wrap=True)
