"""Everything the user sees goes through one injected rich ``Console``.

Tests build the console with ``make_console(StringIO())`` and compare exact text.
"""

from __future__ import annotations

import re
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


_UNPRINTABLE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\ud800-\udfff]")
_UNPRINTABLE_BUT_NEWLINES = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def printable(text: str, lines: bool = False) -> str:
    """``text`` safe for the terminal: every control character (ESC, so every escape
    sequence, C1 codes, NUL, ...) and undecodable byte shown as its Python escape
    (``\\x1b``), never acted on. Text from the nodes, the job and the inventory goes
    through this before it is printed; tabs stay, newlines only with ``lines``."""
    pattern = _UNPRINTABLE_BUT_NEWLINES if lines else _UNPRINTABLE
    if pattern.search(text) is None:
        return text
    return pattern.sub(lambda match: repr(match.group())[1:-1], text)


def node_colour(index: int) -> str:
    return NODE_COLOURS[index % len(NODE_COLOURS)]


def render_error(console: Console, error: TorchherdError) -> None:
    """One line that says what is wrong, then the next step when there is one."""
    console.print(f"[bold red]error:[/] {escape(printable(str(error)))}", soft_wrap=True)
    if error.hint:
        console.print(f"  [dim]hint:[/] {escape(printable(error.hint))}", soft_wrap=True)
