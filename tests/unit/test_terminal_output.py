"""Nothing a node, the job or the inventory says acts on the terminal (issue 11, item 8):
control characters and escape sequences are shown escaped, rich markup is text."""

from __future__ import annotations

from io import StringIO
from pathlib import Path

from torchherd.cli import main
from torchherd.console import make_console, printable, render_error
from torchherd.console.detach import render_status
from torchherd.console.run import LiveRenderer, render_summary
from torchherd.errors import TorchherdError
from torchherd.runlog import NodeOutcome, OutputLine, OutputParser, RankLines, RunSummary
from torchherd.runrecord import NodeRecord, NodeState, RunRecord

ESCAPES = "\x1b]52;c;ZXZpbA==\x1b\\ \x1b[2J \x9b31m \x07 \x00"
"""An OSC 52 clipboard write, a screen clear, a C1 CSI, a bell, a NUL."""


def cli(tmp_path: Path, inventory: str, *args: str) -> tuple[int, str]:
    path = tmp_path / "hosts.toml"
    path.write_text(inventory)
    out = StringIO()
    code = main(["-i", str(path), *args], console=make_console(out, width=400))
    return code, out.getvalue()


def raw(text: str) -> bool:
    return any(char in text for char in "\x1b\x9b\x07\x00")


def test_printable_escapes_every_control_character_and_keeps_the_rest() -> None:
    assert printable("tab\tok ünïcode │") == "tab\tok ünïcode │"
    assert printable(ESCAPES) == "\\x1b]52;c;ZXZpbA==\\x1b\\ \\x1b[2J \\x9b31m \\x07 \\x00"
    assert printable("a\nb") == "a\\nb" and printable("a\nb", lines=True) == "a\nb"
    assert printable("bad \udcff byte") == "bad \\udcff byte"


def test_hosts_shows_markup_in_the_inventory_as_text(tmp_path: Path) -> None:
    code, out = cli(tmp_path, '[defaults]\nworkdir = "~/p[/]"\npython = "[conceal]secret"\n'
                              '[[hosts]]\nname = "a"\naddress = "192.0.2.1"\n', "hosts")
    assert code == 0, out
    assert "~/p[/]" in out and "[conceal]secret" in out


def test_dry_run_escapes_what_the_inventory_and_flags_hold(tmp_path: Path) -> None:
    setup = "".join(f"\\u{ord(char):04x}" for char in "echo hi " + ESCAPES.replace("\0", ""))  # a TOML string
    inventory = f'[defaults]\nsetup = "{setup}"\n[[hosts]]\nname = "a"\naddress = "192.0.2.1"\n'
    code, out = cli(tmp_path, inventory, "run", "--dry-run", "--env", f"BANNER={ESCAPES[:-2]}", "--", "train.py")
    assert code == 0, out
    assert not raw(out), repr(out)
    assert "\\x1b]52;c;ZXZpbA==" in out and "\\x1b[2J" in out


def test_job_lines_never_reach_the_terminal_raw() -> None:
    renderer = LiveRenderer(make_console(out := StringIO(), width=200), ["n0"], 3)
    parser = OutputParser("n0")
    chunks = parser.feed(f"O[torchherd-rank 1] {ESCAPES}\nO[torchherd-rank 2] plain\nOtorchrun {ESCAPES}\n".encode())
    block = parser.feed(f"O[torchherd-rank 1] {ESCAPES}\nO[torchherd-rank 2] plain\n".encode())
    assert any(isinstance(chunk, RankLines) for chunk in block), "the bulk path is tested too"
    renderer.render(chunks + block)
    renderer.render([OutputLine("n0", 3, "err", ESCAPES)])
    text = out.getvalue()
    assert not raw(text), repr(text)
    assert text.count("\\x1b]52;c;ZXZpbA==") == 4 and "n0:2 │ plain" in text


def test_errors_summaries_and_status_stay_one_escaped_line() -> None:
    out = StringIO()
    console = make_console(out, width=300)
    render_error(console, TorchherdError(f"n0: refused\n{ESCAPES}", "try\nagain"))
    outcome = NodeOutcome("n0", 0, "failed", 1, 1.0, f"rank 0: {ESCAPES}", 0, (f"last {ESCAPES}",))
    render_summary(console, RunSummary("r", 1, f"n0 failed first: {ESCAPES}", (outcome,), "logs"))
    node = NodeRecord("n0", "a", None, None, None, "python3", "~", "~/l", "~/s")
    record = RunRecord("r", "/h.toml", 1.0, ("t.py",), (node,), 1, 1.0)
    render_status(console, record, [NodeState("n0", "unreachable", detail=f"ssh said {ESCAPES}")])
    text = out.getvalue()
    assert not raw(text), repr(text)
    assert text.splitlines()[0].startswith("error: n0: refused\\n\\x1b]52")
    assert text.splitlines()[1] == "  hint: try\\nagain"
