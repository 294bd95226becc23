"""The source Layout section (docs/contributing.md, moved there from the README) names the tree as it is: every path it names exists, every
module it names beside a directory is in that directory, and every top-level module and
package of ``src/torchherd`` is named."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULE = re.compile(r"(?<![\w./-])((?:[a-z_]+/)*[a-z_]+\.py)\b")
"""A module named in an entry's text, relative to the entry's directory: relay.py, analysis/slurm.py."""
FOLDER = re.compile(r"(?<![\w./-])([a-z_]+/)(?=[\s,;:)]|$)")
"""A folder named in an entry's text, relative to the entry's directory: remote/."""


def entries() -> list[tuple[str, str]]:
    """(path, text) of each entry of the Layout block: a line starting with a path, and the
    indented lines after it."""
    text = (ROOT / "docs" / "contributing.md").read_text(encoding="utf-8")
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    found: list[tuple[str, str]] = []
    for line in block.splitlines():
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
