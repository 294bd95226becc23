"""The README starts with a first success (issue 41, item 9): install, then this machine,
then two, then the features; every command it shows can be pasted as it is (torchherd's
own parser accepts each torchherd line); the two commands a developer needs are there."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from torchherd.cli.parser import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCK = re.compile(r"^```(sh|console)\n(.*?)^```", re.S | re.M)


def commands() -> list[str]:
    """Every command line the README shows: each line of a sh block, each ``$`` line of a
    console block."""
    found = []
    for kind, body in BLOCK.findall(README):
        for line in body.splitlines():
            if kind == "sh" and line.strip():
                found.append(line)
            elif kind == "console" and line.startswith("$ "):
                found.append(line[2:])
    return found


def test_the_sections_come_in_a_newcomer_s_order() -> None:
    headings = re.findall(r"(?m)^## (.+)$", README)
    assert headings[:5] == ["Install", "Quick start on this machine", "Quick start on two machines",
                            "Developing torchherd: two commands", "What it does"], headings
    assert "## Layout" not in README  # the source layout is a contributor's: docs/contributing.md
    assert README.index("pipx install torchherd") < README.index("## Quick start")


@pytest.mark.parametrize("line", commands())
def test_every_command_shown_can_be_pasted_as_it_is(line: str) -> None:
    assert not re.search(r"\s/\s|\bRUN\b|\.\.\.|#", line), line  # no alternatives, placeholders or comments
    argv = shlex.split(line)
    assert argv[0] in ("pipx", "python3", "bash", "torchherd", "~/.venvs/torchherd/bin/pip",
                       "~/.venvs/torchherd/bin/torchherd"), line
    if argv[0].endswith("torchherd") and argv[1:] != ["--version"]:
        build_parser().parse_args(argv[1:])  # a UsageError (exit 2) fails the test


def test_the_one_box_start_is_three_commands_from_an_empty_directory() -> None:
    assert commands()[commands().index("torchherd init --example-script"):][:3] == [
        "torchherd init --example-script", "torchherd check -H localhost -- train.py",
        "torchherd run -H localhost --nproc-per-node 2 -- train.py --steps 20"]


def test_a_developer_s_two_commands_are_near_the_top_and_are_what_ci_runs() -> None:
    lines = README.splitlines()
    assert {"bash scripts/demo", "bash scripts/test"} <= set(lines[:120])
    assert (ROOT / "scripts" / "demo").is_file() and (ROOT / "scripts" / "test").is_file()
    assert "\nbash scripts/test\n" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_it_says_what_a_run_puts_on_the_nodes() -> None:
    said = README.split("**What torchherd puts on the nodes.**", 1)[1].split("\n\n", 1)[0]
    for thing in ("Nothing is installed there", "`<project>/.torchherd-venvs/`", "`--image-archive`",
                  "`~/.cache/torchherd/archives/`", "`~/.torchherd/runs/<run id>/`"):
        assert thing in said, thing
