"""Everything the user sees goes through one injected rich ``Console``.

Tests build the console with ``make_console(StringIO())`` and compare exact text.
"""

from __future__ import annotations

from typing import IO

from rich.console import Console
from rich.markup import escape

from torchherd.errors import TorchherdError

STATUS_STYLES = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}
NODE_COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "bright_cyan", "bright_magenta",
                "bright_green", "bright_yellow", "bright_blue")


def make_console(file: IO[str] | None = None, *, width: int | None = None, stderr: bool = False) -> Console:
    """The console for the user's terminal, or a plain one writing to ``file`` (for tests)."""
    if file is None:
        return Console(stderr=stderr, highlight=False)
    return Console(file=file, width=width or 100, force_terminal=False, color_system=None,
                   highlight=False, soft_wrap=False)


def node_colour(index: int) -> str:
    return NODE_COLOURS[index % len(NODE_COLOURS)]


def render_error(console: Console, error: TorchherdError) -> None:
    """One line that says what is wrong, then the next step when there is one."""
    console.print(f"[bold red]error:[/] {escape(str(error))}", soft_wrap=True)
    if error.hint:
        console.print(f"  [dim]hint:[/] {escape(error.hint)}", soft_wrap=True)
