"""The Layout section (the README's, or a page's in docs/: wherever it lives) names the
tree as it is: every path it names exists, every module it names beside a directory is in
that directory, and every top-level module and package of ``src/torchherd`` is named."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULE = re.compile(r"(?<![\w./-])((?:[a-z_]+/)*[a-z_]+\.py)\b")
"""A module named in an entry's text, relative to the entry's directory: relay.py, analysis/slurm.py."""
FOLDER = re.compile(r"(?<![\w./-])([a-z_]+/)(?=[\s,;:)]|$)")
"""A folder named in an entry's text, relative to the entry's directory: remote/."""
HEADING = re.compile(r"^#+ Layout\s*$", re.MULTILINE)


def layout_blocks() -> list[str]:
    """The first fenced block after each "Layout" heading, in README.md and the pages of docs/."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    blocks = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        blocks += [text[found.end():].split("```", 2)[1] for found in HEADING.finditer(text)]
    return blocks


def entries() -> list[tuple[str, str]]:
    """(path, text) of each entry of the Layout block: a line starting with a path, and the
    indented lines after it."""
    found: list[tuple[str, str]] = []
    for line in "\n".join(layout_blocks()).splitlines():
        if line.startswith("src/"):
            path, _, rest = line.partition(" ")
            found.append((path, rest))
        elif line.strip() and found:
            found[-1] = (found[-1][0], found[-1][1] + " " + line.strip())
    return found


def test_every_path_the_layout_names_exists() -> None:
    missing = []
    for path, text in entries():
        if not (ROOT / path).exists():
            missing.append(path)
        elif path.endswith("/"):
            missing += [path + name for name in MODULE.findall(text) + FOLDER.findall(text)
                        if not (ROOT / path / name).exists()]
    assert entries() and not missing, missing


def test_every_top_level_module_and_package_is_named() -> None:
    named = {path.rstrip("/") for path, _ in entries()}
    package = ROOT / "src" / "torchherd"
    tops = {f"src/torchherd/{item.name}" for item in package.iterdir()
            if (item.suffix == ".py" and not item.name.startswith("__")) or (item / "__init__.py").is_file()}
    assert sorted(tops - named) == []
