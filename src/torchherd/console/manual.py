"""``torchherd docs``: the list of topics, and a page: rich Markdown on a terminal, the
raw Markdown anywhere else (a pipe, a file: ``grep`` and ``less`` read it as written)."""

from __future__ import annotations

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


def render_page(console: Console, text: str) -> None:
    if console.is_terminal:
        console.print(Markdown(text))
    else:
        console.file.write(text)
        console.file.flush()
