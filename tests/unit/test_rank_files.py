"""The supervisor reads the ranks' own files (torchrun --redirects 3), so a progress bar's
``\\r`` survives: run locally as the node runs it, with a stand-in torchrun whose workers
write those files as torch's do."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from support.processes import run_supervisor
from torchherd.engine.ssh.job import redirected, supervisor_config
from torchherd.engine.ssh.warm import warmed
from torchherd.inventory import parse
from torchherd.plan import RunOptions, build_plan
from torchherd.remote import wire
from torchherd.remote.ranks import compact_redraws, visible_now
from torchherd.runlog import OutputLine, OutputParser, RankLines, Status, progress_of

FAKE = Path(__file__).parent / "fakes" / "fake_redirects.py"


def supervise(tmp_path: Path, *spec: str, run_id: str = "rf-test", rank_base: int | None = None,
              ) -> tuple[list[bytes], list[OutputLine | Status]]:
    """Runs the real supervisor on the stand-in; its records, and what the controller
    makes of them."""
    log_dir = tmp_path / "torchherd-ranks"
    config = wire.SupervisorConfig(run_id=run_id, argv=(sys.executable, str(FAKE), str(log_dir), *spec),
                                   heartbeat=0, rank_logs=str(log_dir), cleanup_dir=str(log_dir),
                                   rank_base=rank_base)
    code, out = run_supervisor(config)
    assert code == 0, out[-2000:]
    parser = OutputParser("node1")
    parsed: list[OutputLine | Status] = []
    for chunk in parser.feed(out) + parser.finish():
        parsed.extend(chunk.lines() if isinstance(chunk, RankLines) else [chunk])
    assert not log_dir.exists(), "the rank files are removed at the end"
    return out.split(b"\n"), parsed


def test_every_line_of_every_rank_arrives_with_its_global_rank_and_a_bar_its_final_state(tmp_path: Path) -> None:
    records, parsed = supervise(tmp_path, "base=4", "nproc=2", "lines=3", "bar=5")
    lines = [item for item in parsed if isinstance(item, OutputLine)]
    for rank in (4, 5):
        out = [line.text for line in lines if line.rank == rank and line.stream == "out"]
        assert out == [f"line {index} from rank {rank}" for index in range(3)] + [
            f"no newline at the end from rank {rank}"]
        assert [line.text for line in lines if line.rank == rank and line.stream == "err"] == [
            f"rank {rank} 100%|#####"]
    # one line for the whole bar, holding only its last redraw, never a line per redraw
    bar = [record for record in records if record.startswith(b"E[torchherd-rank 4] ")]
    assert bar == [b"E[torchherd-rank 4] \rrank 4 100%|#####"]
    progress = [progress_of(item) for item in parsed if isinstance(item, Status) and item.event == "progress"]
    assert progress and all(rank in (4, 5) and text.startswith(f"rank {rank} ") for rank, text in progress)
    events = [item.event for item in parsed if isinstance(item, Status)]
    assert events[0] == "started" and events[-2:] == ["exit", "done"]
    exit_at = records.index(next(record for record in records if record.startswith(b'S{"event":"exit"')))
    assert all(not record.startswith(b"O[torchherd-rank") for record in records[exit_at:])


def test_many_lines_stay_whole_and_complete(tmp_path: Path) -> None:
    _, parsed = supervise(tmp_path, "base=0", "nproc=2", "lines=20000", "linger=0.2")
    for rank in (0, 1):
        texts = [line.text for line in parsed if isinstance(line, OutputLine) and line.rank == rank]
        assert texts[:-1] == [f"line {index} from rank {rank}" for index in range(20000)]


def test_a_rank_never_seen_alive_keeps_its_lines_under_its_local_rank(tmp_path: Path) -> None:
    _, parsed = supervise(tmp_path, "nproc=1", "lines=2", "anonymous=1", "linger=0")
    texts = [line.text for line in parsed if isinstance(line, OutputLine)]
    assert "[local rank 0] line 0 from rank ?" in texts and "[local rank 0] line 1 from rank ?" in texts
    assert all(line.rank is None for line in parsed if isinstance(line, OutputLine))


def test_a_rank_gone_before_it_was_seen_is_named_by_the_controllers_base(tmp_path: Path) -> None:
    # anonymous: no worker environment to learn from, as when a short rank has ended
    # before the supervisor looked; a static rendezvous fixes the base beforehand.
    _, parsed = supervise(tmp_path, "nproc=2", "lines=2", "anonymous=1", "linger=0", rank_base=6)
    lines = [line for line in parsed if isinstance(line, OutputLine)]
    assert [(line.rank, line.text) for line in lines if line.rank == 7][:2] == [
        (7, "line 0 from rank ?"), (7, "line 1 from rank ?")]
    assert {line.rank for line in lines if "from rank" in line.text} == {6, 7}


@pytest.mark.parametrize(("backend", "nproc", "node", "base"), [
    ("static", 4, 2, 8), ("static", "gpu", 1, None), ("c10d", 2, 1, None)])
def test_the_rank_base_is_given_where_torchruns_options_fix_it(backend: str, nproc: object, node: int,
                                                               base: int | None) -> None:
    inventory = parse({"cluster": {"nproc_per_node": nproc, "rdzv_backend": backend},
                       "defaults": {"python": "python3"},
                       "hosts": [{"name": f"node{index}"} for index in range(3)]}, Path("hosts.toml"))
    plan = build_plan(inventory, RunOptions(script="train.py", script_args=("--node-rank", "9"), run_id="r1"))
    config = supervisor_config(plan.nodes[node], "r1", 10.0)
    assert config.rank_base == base
    assert wire.SupervisorConfig.from_json(config.to_json()).rank_base == base


def test_redraws_are_compacted_to_what_a_terminal_shows() -> None:
    assert compact_redraws(b"\r 10%\r 20%\r 30%") == b"\r 30%"
    assert compact_redraws(b"loading\r") == b"loading\r"
    assert compact_redraws(b"a\r b\r") == b"\r b\r"
    assert visible_now(b"\r 10%\r 20%\r") == b" 20%"


def test_the_ssh_launch_redirects_where_the_plan_tees() -> None:
    inventory = parse({"cluster": {"nproc_per_node": 2}, "defaults": {"python": "python3"},
                       "hosts": [{"name": "node0"}, {"name": "node1"}]}, Path("hosts.toml"))
    plan = build_plan(inventory, RunOptions(script="train.py", script_args=("--tee", "3"), run_id="r1"))
    node = plan.nodes[1]
    assert node.argv.count("--tee") == 2  # torchrun's, and the script's own argument
    config = supervisor_config(node, "r1", 10.0)
    assert config.argv == redirected(node)
    tee = node.argv.index("--tee")
    assert config.argv[tee:tee + 2] == ("--redirects", "3") and config.argv[-2:] == ("--tee", "3")
    assert config.rank_logs == node.remote_log_dir and json.loads(config.to_json())["rank_logs"] == node.remote_log_dir
    assert config.gpu_every > 0


def test_a_node_forking_from_its_warm_python_redirects_too() -> None:
    """Its torchrun is started by the warm Python's client; its ranks' files are read as
    every run's are (torchrun's tee would turn each \\r of a progress bar into a line break)."""
    inventory = parse({"defaults": {"python": "python3"}, "hosts": [{"name": "node0"}]}, Path("hosts.toml"))
    plan = build_plan(inventory, RunOptions(script="train.py", run_id="r1"))
    (node,) = warmed(plan, {"node0": "/tmp/tmpabc"})[0].nodes
    assert node.argv[0] == "/tmp/tmpabc/python"
    config = supervisor_config(node, "r1", 10.0)
    assert config.argv[0] == "/tmp/tmpabc/python" and "--redirects" in config.argv and "--tee" not in config.argv
    assert config.rank_logs == node.remote_log_dir


@pytest.mark.parametrize("argv", [("torchrun", "x.py"), ("python", "-m", "torch.distributed.run", "--tee", "2")])
def test_a_command_without_tee_3_is_left_as_it_is(argv: tuple[str, ...]) -> None:
    inventory = parse({"defaults": {"python": "python3"}, "hosts": [{"name": "node0"}]}, Path("hosts.toml"))
    node = build_plan(inventory, RunOptions(script="train.py", run_id="r1")).nodes[0]
    assert redirected(replace(node, argv=argv)) == argv
