"""A run as the terminal shows it: the lines (filtered by rank, duplicates collapsed)
scrolling above a live panel of the nodes.

``TerminalView`` is a ``LiveRenderer`` with more between the lines and the screen.
Without a panel (stdout is not a terminal, or ``--plain``) it writes what the lines
give. With one, every write is one ``file.write``: the codes that take the cursor
back to the panel's first line and clear it, the new lines, then the panel again
(rendered by rich at most every ``REDRAW`` seconds, and reused in between, so a
chatty job pays a string join per batch, not a table render). A thread redraws the
panel and lets held lines out while the job is silent.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from rich.console import Console
from rich.live_render import LiveRender

from torchherd.console.collapse import Collapser, RankFilter
from torchherd.console.panel import PanelModel, render_panel
from torchherd.console.run import LiveRenderer
from torchherd.engine.events import (
    Event,
    NodeExited,
    NodeLost,
    NodeNotStarted,
    NodeSilent,
    NodeStarted,
    NodeStatus,
    RanksRunning,
    StopSent,
)
from torchherd.engine.watch.straggler import StragglerWatch
from torchherd.runlog import OutputLine, RankLines, gpu_usage, progress_of

REDRAW = 0.5
"""Seconds between two renders of the panel (about 4 ms each: twice a second is enough
for a person, and leaves the cores to the job)."""
TICK = 0.1
"""How often the view's thread looks for held lines whose time has come."""
UNKNOWN_RANKS = 99
"""``RunStarted.max_rank`` when the ranks depend on the nodes' GPUs."""
HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"


@dataclass(frozen=True)
class ViewOptions:
    """How the terminal shows a run: the panel, collapsed duplicates, a rank filter."""

    panel: bool = False
    collapse: bool = False
    ranks: frozenset[int] | None = None
    straggler_window: float | None = None
    """The panel's straggler window, the run's own (``--straggler-window``; None: the default)."""

    @classmethod
    def choose(cls, console: Console, plain: bool = False, collapse: bool | None = None,
               ranks: frozenset[int] | None = None, straggler_window: float | None = None) -> ViewOptions:
        """The panel on a terminal unless ``plain``; duplicates collapsed where the panel
        is, unless ``collapse`` says otherwise. Plain output stays every line, as before."""
        panel = console.is_terminal and not plain
        return cls(panel=panel, collapse=panel if collapse is None else collapse, ranks=ranks,
                   straggler_window=straggler_window)

    @property
    def plain(self) -> bool:
        """Nothing beyond the lines as they come (``LiveRenderer`` alone)."""
        return not (self.panel or self.collapse or self.ranks is not None)


class TerminalView(LiveRenderer):
    """The run's lines and notes through the rank filter and the collapser, and the panel
    under them. Thread-safe: the engine's thread and the view's own both write."""

    def __init__(self, console: Console, nodes: Sequence[str], max_rank: int, options: ViewOptions,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(console, nodes, max_rank)
        self.options = options
        self.clock = clock
        self.filter = RankFilter(options.ranks) if options.ranks is not None else None
        world = max_rank + 1 if max_rank < UNKNOWN_RANKS else None
        self.collapser = Collapser(self, nodes, world, clock=clock) if options.collapse else None
        self.model = PanelModel(nodes) if options.panel else None
        self.watch = StragglerWatch(clock, options.straggler_window) if options.panel else None
        """The panel's marks; the run's summary names the slowest node from the engine's own."""
        self.lock = threading.RLock()
        self._live = LiveRender("")
        self._panel = ""
        self._drawn_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.closed = False

    # what the observer hands over -----------------------------------------------------
    def render(self, lines: Sequence[OutputLine | RankLines]) -> None:
        with self.lock:
            if self.model is not None:
                self.model.lines(lines, self.clock())
            shown = self.filter(lines) if self.filter is not None else lines
            if self.collapser is None:
                self.write(self.text(shown))
                return
            self.collapser.add(shown)
            self.write(self.collapser.take())

    def note(self, message: str, style: str = "bold") -> None:
        with self.lock:
            text = self.note_text(message, style)
            if self.collapser is not None:
                # In its place among the held lines: "exited" after the traceback, not before.
                self.collapser.note(text)
                text = self.collapser.take()
            self.write(text)

    def observe(self, event: Event) -> None:
        """Node events as the panel shows them (the observer prints its notes besides)."""
        model = self.model
        if model is None:
            return
        with self.lock:
            if self.watch is not None:
                self.watch.observe(event)
            if isinstance(event, NodeStarted):
                model.state(event.node, "rendezvous")
            elif isinstance(event, RanksRunning):
                model.state(event.node, "running")
            elif isinstance(event, NodeExited):
                model.state(event.node, "exited", event.code)
            elif isinstance(event, NodeLost):
                model.state(event.node, "lost")
            elif isinstance(event, NodeSilent):
                model.silent(event.node, event.heard)
            elif isinstance(event, NodeNotStarted):
                model.state(event.node, "not started")
            elif isinstance(event, StopSent):
                for node in event.nodes:
                    model.state(node, "stopping")
            elif isinstance(event, NodeStatus):
                self._status(model, event)

    def _status(self, model: PanelModel, event: NodeStatus) -> None:
        status = event.status
        if status.event == "gpu":
            model.gpus(status.node, gpu_usage(status))
            return
        bar = progress_of(status)
        if bar is not None:
            model.bar(status.node, bar[0], bar[1], self.clock())

    # the screen --------------------------------------------------------------------
    def start(self) -> None:
        """Draws the panel and starts the thread that keeps it (and held lines) moving."""
        if self.model is not None:
            super().write(HIDE_CURSOR)
        if self.model is not None or self.collapser is not None:
            self._thread = threading.Thread(target=self._run, name="torchherd-view", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(TICK):
            with self.lock:
                if not self.closed:
                    self.write(self.collapser.take() if self.collapser is not None else "")

    def close(self) -> None:
        """Everything held is shown, the panel is cleared and the cursor back: what the
        summary prints next goes where the panel was."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        with self.lock:
            if self.closed:
                return
            text = self.collapser.take(force=True) if self.collapser is not None else ""
            self.closed = True
            if self.model is not None:
                text = self._erase() + text + SHOW_CURSOR
            super().write(text)

    def write(self, text: str) -> None:
        if self.model is None or self.closed:
            super().write(text)
            return
        now = self.clock()
        if self._drawn_at is not None and now - self._drawn_at < REDRAW:
            if text:
                super().write(self._erase() + text + self._panel)
            return
        erase = self._erase()
        self._panel = self._draw(now)
        self._drawn_at = now
        super().write(erase + text + self._panel)

    def _draw(self, now: float) -> str:
        """The panel as terminal text, without its last newline: the cursor stays on its
        last line, where ``_erase`` starts."""
        assert self.model is not None
        limit = max(1, min(24, self.console.height // 2 - 3))
        progress = self.watch.progress(now) if self.watch is not None else None
        self._live.set_renderable(render_panel(self.model, now, limit, progress))
        with self.console.capture() as capture:
            self.console.print(self._live)
        return capture.get().rstrip("\n")

    def _erase(self) -> str:
        """Back to the start of the panel drawn last, clearing it ("" when none is)."""
        if not self._panel:
            return ""
        height = self._live.last_render_height
        return "\r\x1b[2K" + "\x1b[1A\x1b[2K" * (height - 1)
