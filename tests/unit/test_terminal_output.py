"""Nothing a node, the job or the inventory says acts on the terminal:
control characters and escape sequences are shown escaped, rich markup is text."""

from __future__ import annotations

from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console

from torchherd.cli import main
from torchherd.console import make_console, printable, render_error
from torchherd.console.detach import render_status
from torchherd.console.run import LiveRenderer, render_summary
from torchherd.engine.records import NodeRecord, NodeState, RunRecord
from torchherd.engine.slurm.settings import settings_of
from torchherd.errors import TorchherdError
from torchherd.runlog import NodeOutcome, OutputLine, OutputParser, RankLines, RunSummary

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


@pytest.mark.parametrize("terminal,shown", [(True, "n0:2 │ plain"), (False, "n0:2: plain")])
def test_job_lines_never_reach_the_terminal_raw(terminal: bool, shown: str) -> None:
    """On a terminal and in a pipe alike (whose reader may be a terminal: ``| less -R``, ``| tee``)."""
    renderer = LiveRenderer(make_console(out := StringIO(), width=200, terminal=terminal), ["n0"], 3)
    parser = OutputParser("n0")
    chunks = parser.feed(f"O[torchherd-rank 1] {ESCAPES}\nO[torchherd-rank 2] plain\nOtorchrun {ESCAPES}\n".encode())
    block = parser.feed(f"O[torchherd-rank 1] {ESCAPES}\nO[torchherd-rank 2] plain\n".encode())
    assert any(isinstance(chunk, RankLines) for chunk in block), "the bulk path is tested too"
    renderer.render(chunks + block)
    renderer.render([OutputLine("n0", 3, "err", ESCAPES)])
    text = out.getvalue()
    assert not raw(text), repr(text)
    assert text.count("\\x1b]52;c;ZXZpbA==") == 4 and shown in text


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


def terminal() -> Console:
    """A console as on a real terminal (colours on), recording what it prints: its
    export holds what the content put there, without the console's own styling."""
    return Console(file=StringIO(), record=True, force_terminal=True, color_system="truecolor", width=300)


OSC = "\x1b]0;owned\x1b\\"
"""A title change ended by ``ESC \\`` (ST), not BEL: rich's Text drops BEL, keeps ESC."""
SHOWN = "\\x1b]0;owned\\x1b\\"


def test_sync_listings_and_failures_never_reach_the_terminal_raw() -> None:
    from torchherd.console.sync import SyncPrinter, render_sync_plan
    from torchherd.engine.events import NodeSynced, SyncDone, SyncFailed, SyncStarted

    console = terminal()
    failed = SyncFailed("n1", f"the receiver said {OSC}", 1.0,
                        tuple((f"f{index}{OSC}.py", f"why {OSC}") for index in range(5)))
    synced = NodeSynced("n0", f"/w/{OSC}", (f"a{OSC}.py",), 3, (f"gone{OSC}.py",), 1, 0.5)
    printer = SyncPrinter(console)
    printer(SyncStarted(f"/proj{OSC}", ("n0", "n1"), 1, 3, (f"sock{OSC}: a socket",)))
    printer(failed)
    printer(SyncDone("/proj", (synced, failed), 1.0))
    render_sync_plan(console, SyncDone("/proj", (synced, failed), 1.0, dry_run=True))
    text = console.export_text()
    assert "\x1b" not in text, repr(text)
    assert text.count(SHOWN) == 12, text
    assert f"  + a{SHOWN}.py" in text and f"n1: f4{SHOWN}.py: why {SHOWN}" in text


def test_a_detached_start_failure_is_shown_escaped() -> None:
    from torchherd.api import DetachedStartFailed
    from torchherd.cli.dispatch import _render_detached_failure
    from torchherd.engine.run import DetachedStart

    console = terminal()
    node = NodeRecord("n0", "a", None, None, None, "python3", "~", "~/l", "~/s")
    record = RunRecord("r", "/h.toml", 1.0, ("t.py",), (node,), 1, 1.0)
    _render_detached_failure(console, DetachedStartFailed(DetachedStart(record, (f"n0: supervisor said {OSC}",),
                                                                        {"n0": []})))
    text = console.export_text()
    assert "\x1b" not in text, repr(text)
    assert f"n0: supervisor said {SHOWN}\n" in text


def test_the_slurm_dry_run_shows_the_jobs_arguments_and_environment_escaped() -> None:
    from torchherd.api import Cluster
    from torchherd.console.run import render_description
    from torchherd.engine.slurm.batch import batch_job

    cluster = Cluster(["node0", "node1"], scheduler="slurm", python="/opt/venv/bin/python", workdir="~/proj",
                      slurm={"partition": "main"}, env={"BANNER": OSC})
    job = batch_job(cluster.plan("train.py", f"--name={OSC}", run_id="th-test"), settings_of(cluster.inventory))
    console = terminal()
    render_description(console, job)
    text = console.export_text()
    assert "\x1b" not in text, repr(text)
    assert f"'--name={SHOWN}'" in text and f"export BANNER='{SHOWN}'" in text, text


def test_the_straggler_line_is_shown_escaped() -> None:
    """The run's last line names the slowest node and what it did, from the job's output."""
    from torchherd.console.observer import ConsoleObserver
    from torchherd.engine.events import RunFinished
    from torchherd.runlog import RunSummary

    console = terminal()
    observer = ConsoleObserver(console)
    observer(RunFinished(RunSummary("r", 0, "ok", (), "/logs", straggler=f"node1{OSC} was 3.0x slower")))
    text = console.export_text()
    assert "\x1b" not in text, repr(text)
    assert f"node1{SHOWN} was 3.0x slower" in text


def test_a_slurm_node_name_from_a_file_the_job_made_is_no_node() -> None:
    """On SLURM a node's output is ``<node>.out`` in the run directory, which the job can
    write to: a file name that is not a host name names no node (nothing of it is shown)."""
    from torchherd.engine.slurm.files import split_name

    assert split_name("node0.out") == ("node0", ".out") and split_name("gpu-7.err") == ("gpu-7", ".err")
    for name in (f"n{OSC}.out", "\x1b[2J.err", "-x.exit", "a b.out", "." * 3 + ".out"):
        assert split_name(name) is None, name
