"""What reaches a node's shell from the inventory and the command line: one quoting rule for ``check`` and ``run``, the setup snippet kept out of the
record stream and on lines of its own, nothing read as an option. Run through real shells
(``sh -c``), on the local transport."""

from __future__ import annotations

import subprocess
import sys
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from support.processes import run_supervisor
from torchherd.api import Cluster
from torchherd.engine.events import Collector
from torchherd.engine.run import LaunchOptions
from torchherd.engine.ssh.launch import launch
from torchherd.plan import Plan
from torchherd.remote import wire
from torchherd.runlog import OutputLine, parse_status
from torchherd.transport.local import LocalConnector

PY = sys.executable
FAKE = str(Path(__file__).parent / "fakes" / "fake_torchrun.py")


def one_node(tmp_path: Path, home: Path | None = None, **keys: object) -> Cluster:
    env = {"*": {"HOME": str(home)}} if home else {}
    return Cluster([{"name": "n0", "address": "127.0.0.1"}], connector=LocalConnector(env=env),
                   **{"python": PY, "workdir": str(tmp_path), **keys})  # type: ignore[arg-type]


def faked(plan: Plan, python: str = PY, *spec: str) -> Plan:
    """The plan with torchrun replaced by the stand-in, run by ``python``."""
    node = plan.nodes[0]
    return replace(plan, nodes=(replace(node, argv=(python, FAKE, "ranks=0", *(spec or ("lines=2",))),
                                        remote_log_dir=f"/tmp/torchherd-test-{uuid.uuid4().hex}"),))


def run(plan: Plan, tmp_path: Path, connector: LocalConnector) -> tuple[int, list[OutputLine]]:
    events = Collector()
    summary = launch(plan, LaunchOptions(check=False, log_dir=tmp_path / "logs", grace=1.0), connector,
                     events).wait(timeout=60)
    return summary.exit_code, list(events.lines.get("n0", []))


# item 6: the python, by one rule ------------------------------------------------------------


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A home whose ~/venv/bin/python is this interpreter."""
    home = tmp_path / "home"
    (home / "venv" / "bin").mkdir(parents=True)
    (home / "venv" / "bin" / "python").symlink_to(PY)
    return home


def test_a_python_under_home_runs_in_check_and_in_run(tmp_path: Path, home: Path) -> None:
    cluster = one_node(tmp_path, home, python="~/venv/bin/python")
    report = cluster.check(only={"python"})
    assert [result.status for result in report.results if result.check == "python"] == ["pass"], report.results
    plan = faked(cluster.plan("train.py", run_id="tpy-home"), "~/venv/bin/python")
    code, lines = run(plan, tmp_path, cluster.connector)  # type: ignore[arg-type]
    assert code == 0, lines
    assert [line.text for line in lines if line.rank == 0] == ["line 0 from rank 0", "line 1 from rank 0"]


def test_shell_text_in_python_never_runs_during_check(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    cluster = one_node(tmp_path, python=f"python3; touch {marker}")
    report = cluster.check(only={"python"})
    assert not marker.exists(), "the check ran the shell text in python"
    assert [result.status for result in report.results if result.check == "python"] == ["fail"]


# item 7: the setup's output is not the supervisor's record stream --------------------------


def test_setup_output_is_shown_as_it_was_written_and_never_parsed(tmp_path: Path) -> None:
    setup = "echo Sourcing conda; echo Hello; echo OK; echo 'S{\"event\":\"exit\",\"code\":\"x\"}'"
    cluster = one_node(tmp_path, setup=setup)
    code, lines = run(faked(cluster.plan("train.py", run_id="tsetup")), tmp_path, cluster.connector)  # type: ignore[arg-type]
    assert code == 0
    shown = [line.text for line in lines if line.rank is None]
    assert shown[:4] == ["Sourcing conda", "Hello", "OK", 'S{"event":"exit","code":"x"}'], shown


def test_a_status_record_with_the_wrong_types_is_garbled_not_a_crash() -> None:
    assert parse_status("n0", b'{"event":"exit","code":"x"}').event == "garbled"
    assert parse_status("n0", b'{"event":"done","code":0,"left":"many"}').event == "garbled"
    assert parse_status("n0", b"[" * 100_000).event == "garbled"
    assert parse_status("n0", wire.exit_record(3)[1:-1]).event == "exit"


# item 8: the setup snippet on lines of its own --------------------------------------------


def test_a_comment_in_setup_never_comments_out_the_launch(tmp_path: Path) -> None:
    cluster = one_node(tmp_path, setup="true # load the environment")
    node = cluster.plan("train.py", run_id="tcomment").nodes[0]
    line = replace(node, argv=("echo", "launched"), env={}).shell_line()
    done = subprocess.run(["sh", "-c", line], capture_output=True, text=True, timeout=30)
    assert done.stdout == "launched\n", (line, done.stderr)


def test_dry_run_masks_secrets_by_shape_too(tmp_path: Path) -> None:
    cluster = one_node(tmp_path)
    plan = cluster.plan("train.py", run_id="tmask", env={
        "DATABASE_URL": "postgres://alice:hunter2@db/prod", "MODEL_REPO": "hf_abcdefghijklmnopqrstuvwxyz12",
        "NCCL_DEBUG": "INFO"})
    shown = plan.nodes[0].shell_line(hide_secrets=True)
    assert "hunter2" not in shown
    assert "DATABASE_URL='postgres://alice:***@db/prod'" in shown
    assert "hf_abc" not in shown and "MODEL_REPO=***" in shown and "NCCL_DEBUG=INFO" in shown


# item 11: nothing is read as an option ----------------------------------------------------


def test_a_workdir_starting_with_a_dash_is_a_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "-dash").mkdir()
    monkeypatch.chdir(tmp_path)  # the local "node" starts where the test runs, as ssh starts in HOME
    cluster = one_node(tmp_path, workdir="-dash", setup="pwd")
    code, lines = run(faked(cluster.plan("train.py", run_id="tdash")), tmp_path, cluster.connector)  # type: ignore[arg-type]
    assert code == 0, lines
    assert str(tmp_path / "-dash") in [line.text for line in lines]


def test_a_script_starting_with_a_dash_is_torchruns_script(tmp_path: Path) -> None:
    node = one_node(tmp_path).plan("-weird.py", "--lr", "1", run_id="tscript").nodes[0]
    at = node.argv.index("-weird.py")
    assert node.argv[at - 1] == "--" and node.argv[at + 1:] == ("--lr", "1")
    torchrun = pytest.importorskip("torch.distributed.run")
    parsed = torchrun.get_args_parser().parse_args(list(node.argv[3:]))
    assert (parsed.training_script, parsed.training_script_args) == ("-weird.py", ["--lr", "1"])
    module = one_node(tmp_path).plan("-mod", run_id="tmod", module=True).nodes[0]
    parsed = torchrun.get_args_parser().parse_args(list(module.argv[3:]))
    assert (parsed.module, parsed.training_script) == (True, "-mod")



# item 9: only a marker at the start of a line names a rank --------------------------------


def test_a_marker_in_the_middle_of_a_line_is_text(tmp_path: Path) -> None:
    from torchherd.engine.ssh.job import supervisor_config
    from torchherd.runlog import OutputParser, RankLines

    node = one_node(tmp_path).plan("train.py", run_id="tmid").nodes[0]
    said = "agent: rank 0 wrote [torchherd-rank 9] hello"
    config = supervisor_config(node, "tmid", 1.0)._replace(
        argv=(PY, "-c", f"print({said!r})"), heartbeat=0.0, watchdog=0.0, gpu_every=0.0,
        cleanup_dir=str(tmp_path / "torchherd-mid"), rank_logs=str(tmp_path / "torchherd-mid"))
    _, out = run_supervisor(config)
    parser = OutputParser("n0")
    lines = [line for chunk in parser.feed(out) + parser.finish()
             for line in (chunk.lines() if isinstance(chunk, RankLines) else [chunk]) if isinstance(line, OutputLine)]
    assert [(line.rank, line.text) for line in lines] == [(None, said)]
