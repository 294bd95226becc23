"""Everything the user sees goes through one injected rich ``Console``.

What it shows depends on where it goes: on a terminal, coloured lines as ``node:rank │
text`` and boxed tables; anywhere else (a pipe, a file), plain ASCII that grep and cut
read, as pdsh writes it: ``node:rank: text``, tables as spaced columns, no line wrapped
or cut. The console says which (``console.is_terminal``), never global state.

Tests build the console with ``make_console(StringIO())`` (what a pipe gets), or with
``terminal=True`` (what a terminal shows, without colour), and compare exact text.
"""

from __future__ import annotations

import re
from typing import IO

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from torchherd.errors import TorchherdError

STATUS_STYLES = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}
NODE_COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "bright_cyan", "bright_magenta",
                "bright_green", "bright_yellow", "bright_blue")


PIPE_WIDTH = 10_000
"""Columns of a console that is not a terminal: rich would take 80, and fold a table's
cells and wrap its title there; a pipe has no width, so nothing is cut or wrapped."""


def make_console(file: IO[str] | None = None, *, width: int | None = None, stderr: bool = False,
                 terminal: bool = False) -> Console:
    """The console for the user's terminal (or pipe), or a plain one writing to ``file``
    (for tests): as a pipe gets it, or with ``terminal`` as a terminal shows it, uncoloured."""
    if file is None:
        console = Console(stderr=stderr, highlight=False)
        if console.is_terminal:
            return console
        return Console(stderr=stderr, highlight=False, width=PIPE_WIDTH)
    return Console(file=file, width=width or 100, force_terminal=terminal, color_system=None,
                   highlight=False, soft_wrap=False)


def print_table(console: Console, table: Table) -> None:
    """``table`` boxed on a terminal; elsewhere plain text that grep and cut read: its
    title a line of its own, then the columns two spaces apart, each line starting
    with its first cell, no box-drawing character, every cell whole on one line
    whatever the console's width."""
    if console.is_terminal:
        console.print(table)
        return
    title = table.title
    if title is not None:
        console.print(title if isinstance(title, Text) else Text(str(title)), soft_wrap=True)
    table.title = None
    table.box = None
    table.pad_edge = False
    table.padding = (0, 1)
    table.collapse_padding = False
    table.show_edge = False
    for column in table.columns:
        column.overflow = "ignore"
        column.no_wrap = True
    lines = [Text.assemble(*((segment.text, segment.style or "") for segment in line))
             for line in console.render_lines(table, console.options.update_width(PIPE_WIDTH), pad=False)]
    for line in lines:
        line.rstrip()  # without the spaces that pad the last column: a line ends where its text does
    console.print(Text("\n").join(lines), soft_wrap=True)


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
