"""The documentation, shipped in the package (``torchherd/docs/*.md``: the repository's
``docs/``), for ``torchherd docs [TOPIC]``: a pip user has no checkout to read it in.
Standard library only; nothing here prints."""

from __future__ import annotations

from importlib.resources import files


def topics() -> tuple[str, ...]:
    """Every topic, sorted: the file names of the documentation, without ``.md``."""
    try:
        names = [page.name for page in files("torchherd").joinpath("docs").iterdir()]
    except OSError:  # an install without its documentation: no topics
        return ()
    return tuple(sorted(name[:-len(".md")] for name in names if name.endswith(".md")))


def read(topic: str) -> str:
    """The topic's Markdown text; KeyError for a topic there is not (never a path: "../x" is none)."""
    if topic not in topics():
        raise KeyError(topic)
    text: str = files("torchherd").joinpath("docs").joinpath(f"{topic}.md").read_text(encoding="utf-8")
    return text


def title(text: str) -> str:
    """A page's first heading, without its ``#`` and backquotes (the listing's description)."""
    for line in text.splitlines():
        if line.startswith("# "):
            return line[2:].replace("`", "").strip()
    return ""
