"""What a pipe gets from the real console (stdout not a terminal): pdsh's ``node:rank: text``,
tables as plain columns, and no line cut or wrapped at rich's default 80 columns."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchherd.cli import main
from torchherd.console import PIPE_WIDTH, make_console
from torchherd.console.run import LiveRenderer, render_summary
from torchherd.runlog import NodeOutcome, OutputLine, RankLines, RunSummary

BOX = set("│┃━─┏┓┗┛┡┩└┘┳┻╇┴┬├┤┼")


def test_the_console_of_a_pipe_is_as_wide_as_its_lines(capsys: pytest.CaptureFixture[str]) -> None:
    console = make_console()
    assert not console.is_terminal and console.width == PIPE_WIDTH
    line = "".join(str(index % 10) for index in range(150))
    renderer = LiveRenderer(console, ["node0", "node1"], 3)
    renderer.render([OutputLine("node0", 0, "out", line), RankLines("node1", b"\nE[torchherd-rank 3] " + line.encode() + b"\n")])
    error = f"rank 3: RuntimeError: {line}"
    render_summary(console, RunSummary("r1", 1, f"node1 rank 3 failed first with exit code 1: {error}", (
        NodeOutcome("node0", 0, "torn down", 143, 3.25, None, None, ()),
        NodeOutcome("node1", 1, "failed", 1, 2.0, error, 3, ()),
    ), "logs/r1"))
    out = capsys.readouterr().out
    assert out == (f"node0:0: {line}\n"
                   f"node1:3: {line}\n"
                   "run r1\n"
                   "node   state            exit  time  first error\n"
                   "node0  torn down        143   3.2s\n"
                   f"node1  failed (rank 3)  1     2.0s  {error}\n"
                   f"node1 rank 3 failed first with exit code 1: {error}\n"
                   "logs: logs/r1\n")


def test_hosts_piped_keeps_its_header_and_paths_whole(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Once cut at 80 columns: the title wrapped inside the table, the paths shortened, a column left out."""
    folder = tmp_path / ("a-folder-with-a-long-name-" * 3)
    folder.mkdir()
    path = folder / "hosts.toml"
    python = "/home/someone/projects/a-long-project-name/.venv/bin/python"
    path.write_text(f'[defaults]\npython = "{python}"\nworkdir = "~/projects/a-long-project-name/work"\n'
                    'user = "demo"\n[[hosts]]\nname = "hn1"\naddress = "10.213.7.11"\n[[hosts]]\nname = "hn2"\n')
    assert main(["-i", str(path), "hosts"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{path}: 2 hosts, master hn1:29500, rendezvous static"
    assert len(lines[0]) > 80
    assert lines[1].split() == ["name", "SSH", "target", "node_rank", "nproc", "python", "workdir"]
    assert lines[2].split() == ["hn1", "(master)", "demo@10.213.7.11", "0", "1", python, "~/projects/a-long-project-name/work"]
    assert lines[3].split()[0] == "hn2" and len(lines) == 4
    assert not BOX & set("".join(lines))


def test_a_piped_error_is_one_whole_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / ("x" * 120 + ".toml")
    assert main(["-i", str(path), "hosts"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: ") and str(path) in err[0]
