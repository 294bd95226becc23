"""``torchherd docs``: the list of topics, and a page: rich Markdown on a terminal, the
raw Markdown anywhere else (a pipe, a file: ``grep`` and ``less`` read it as written)."""

from __future__ import annotations

import os
import re
from typing import Sequence

from rich.console import Console
from rich.markdown import Markdown
from rich.text import Text


def render_topics(console: Console, rows: Sequence[tuple[str, str]]) -> None:
    """One line per topic, its name then its title; what prints one first."""
    console.print("torchherd docs TOPIC prints one of these (rich on a terminal, Markdown when piped):",
                  markup=False, highlight=False, soft_wrap=True)
    width = max((len(name) for name, _ in rows), default=0)
    for name, title in rows:
        console.print(Text(f"  {name.ljust(width)}  {title}"), soft_wrap=True)


def render_page(console: Console, text: str, topics: Sequence[str] = (), page: bool = False) -> None:
    """On a terminal: rendered, a page's ``docs/cli.md`` as the command that shows it
    (``torchherd docs cli``: a pip user has no docs/), through ``$PAGER`` when ``page``
    (as git help: less, told to keep the colours and to quit when it fits); elsewhere the
    Markdown as written."""
    if console.is_terminal:
        shown = re.sub(r"\bdocs/([\w-]+)\.md\b",
                       lambda ref: f"torchherd docs {ref.group(1)}" if ref.group(1) in topics else ref.group(0), text)
        if not page:
            console.print(Markdown(shown))
            return
        os.environ.setdefault("LESS", "FRX")
        with console.pager(styles=True):
            console.print(Markdown(shown))
    else:
        console.file.write(text)
        console.file.flush()
