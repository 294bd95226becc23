"""``torchherd docs [TOPIC]``: the documentation a pip user has (shipped in the package),
exact text; and no hint or help pointing to a file only a checkout has."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console

from torchherd import manual
from torchherd.cli import main
from torchherd.console import make_console

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "torchherd"


def cli(*args: str) -> tuple[int, str]:
    out = StringIO()
    code = main(list(args), console=make_console(out, width=200))
    return code, out.getvalue()


def test_the_topics_are_the_documentation_pages() -> None:
    assert manual.topics() == tuple(sorted(path.stem for path in (ROOT / "docs").glob("*.md")))
    assert "checks" in manual.topics() and "troubleshooting" in manual.topics()


def test_docs_without_a_topic_lists_them() -> None:
    code, out = cli("docs")
    lines = out.splitlines()
    assert code == 0
    assert lines[0] == "torchherd docs TOPIC prints one of these (rich on a terminal, Markdown when piped):"
    assert "  checks           torchherd check: the preflight checks" in lines
    assert "  troubleshooting  Troubleshooting: the symptom, the check that finds it, the fix" in lines
    assert len(lines) == 1 + len(manual.topics())


def test_a_topic_piped_is_the_markdown_as_written() -> None:
    assert cli("docs", "checks") == (0, (ROOT / "docs" / "checks.md").read_text(encoding="utf-8"))


def test_a_topic_on_a_terminal_is_rendered() -> None:
    from torchherd.console.manual import render_page

    out = StringIO()
    render_page(Console(file=out, force_terminal=True, width=80, color_system=None), "# Title\n\nSome `code`.\n")
    text = out.getvalue()
    assert "Title" in text and "Some code." in text and "# Title" not in text


def test_an_unknown_topic_is_one_line_with_did_you_mean() -> None:
    assert cli("docs", "chekcs") == (2, (
        "error: torchherd docs: argument TOPIC: invalid choice 'chekcs'; did you mean 'checks'? (choose from "
        + ", ".join(manual.topics()) + ")\n  hint: torchherd docs --help lists the options\n"))
    assert cli("docs", "../README")[0] == 2  # never a path


def test_completion_offers_the_topics() -> None:
    out = StringIO()
    sys.stdout, saved = out, sys.stdout
    try:
        assert main(["completion", "bash"]) == 0
    finally:
        sys.stdout = saved
    assert 'docs) opts=' in out.getvalue() and "choices=\"" + " ".join(manual.topics()) + "\"" in out.getvalue()


def test_nothing_points_to_a_file_a_pip_user_lacks() -> None:
    """Hints, help and docstrings (``help(torchherd)``) say ``torchherd docs TOPIC``, never a
    path of the repository (a pip install has no docs/ and no hosts.example.toml beside it)."""
    found = [f"{path.relative_to(SRC)}:{number}: {line.strip()}"
             for path in SRC.rglob("*.py") if path.name != "manual.py"
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"docs/|hosts\.example\.toml", line) and "joinpath" not in line]
    assert found == []


def test_the_wheel_carries_the_documentation(tmp_path: Path) -> None:
    """What pip installs: the built wheel holds every page (src/torchherd/docs is a link to docs/)."""
    made = [path for path in (ROOT / "build", ROOT / "src" / "torchherd.egg-info") if not path.exists()]
    try:
        _wheel_has_the_docs(tmp_path)
    finally:  # what the build leaves in the checkout, when it was not there before
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


def _wheel_has_the_docs(tmp_path: Path) -> None:
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path), "-q"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    if built.returncode != 0 and "No module named" in built.stderr:
        pytest.skip(f"cannot build a wheel here: {built.stderr.strip()[-200:]}")
    assert built.returncode == 0, built.stderr
    import zipfile

    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"torchherd/docs/{topic}.md" for topic in manual.topics()} <= names
