"""What runs and checks look like on the real local cluster: on a terminal the live panel
with a moving bar per node, torchrun's banner once, lines many ranks print shown once,
and complete logs; piped, every line and no escape code; a check with one DROP rule
draws the probe matrix with the failing cell where it belongs."""

from __future__ import annotations

import re
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from localcluster import LocalCluster
from rich.console import Console

from support.cluster_straggler import ESCAPE, TQDM_DEMO, assert_named_the_straggler, compute_job, less_cpu
from torchherd.cli import main
from torchherd.console import make_console

# serial: it measures time or CPU (tests/conftest.py)
pytestmark = [pytest.mark.cluster, pytest.mark.serial]


def run_log(log_dir: Path, node: str) -> list[str]:
    (run_dir,) = [path for path in log_dir.iterdir() if path.is_dir()]
    return (run_dir / f"{node}.log").read_text(encoding="utf-8").splitlines()


def bar_states(text: str, rank: int, epoch: int) -> set[int]:
    """The percentages a rank's bar showed in the panel."""
    return {int(value) for value in re.findall(rf"\[{rank}\] rank {rank} epoch {epoch}:\s+(\d+)%", text)}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tqdm_job_on_four_nodes_on_a_terminal(make_cluster: object, tmp_path: Path) -> None:
    cluster: LocalCluster = make_cluster(4)  # type: ignore[operator]
    out = StringIO()
    console = Console(file=out, width=140, height=40, force_terminal=True, color_system="standard", highlight=False)
    logs = tmp_path / "logs"
    code = main(["-i", str(cluster.inventory), "run", "--no-check", "--log-dir", str(logs), "--nproc-per-node", "2",
                 "--", TQDM_DEMO, "--epochs", "2", "--steps", "40", "--delay", "0.1"], console=console)
    raw = out.getvalue()
    text = ESCAPE.sub("", raw)
    assert code == 0, text[-3000:]
    # the panel, one row per node, each with its lowest rank's bar, moving
    assert "lines/s" in text and raw.count("\x1b[1A") > 10
    for index, node in enumerate(cluster.names):
        assert len(bar_states(text, 2 * index, 1)) >= 2, f"{node}'s bar did not move:\n{text[-3000:]}"
    # torchrun's banner once, and the epoch line every rank prints alike once
    assert text.count("Setting OMP_NUM_THREADS") == 1
    assert re.search(r"node\[0-3\]:\* │ epoch 1/2: mean loss [0-9.]+ \(x8\)", text), text[-3000:]
    # the logs: every line, each bar once in its final state, no line per redraw
    for index, node in enumerate(cluster.names):
        lines = run_log(logs, node)
        assert sum("OMP_NUM_THREADS" in line for line in lines) == 1
        for rank in (2 * index, 2 * index + 1):
            for epoch in (1, 2):
                assert sum(line.startswith(f"[rank {rank}] epoch {epoch}/2: mean loss") for line in lines) == 1
                bars = [line for line in lines if line.startswith(f"[rank {rank} stderr] rank {rank} epoch {epoch}:")]
                assert len(bars) == 1 and "100%" in bars[0] and "40/40" in bars[0], bars


@pytest.mark.timeout(240)
def test_piped_output_has_every_line_and_no_panel(cluster: LocalCluster, tmp_path: Path) -> None:
    """Not a terminal: plain lines (every rank's own, bars in their final state only), as
    pdsh writes them (``node:rank: text``, ASCII), none cut at rich's default 80 columns."""
    logs = tmp_path / ("logs-in-a-folder-whose-name-makes-the-run-note-longer-than-eighty-columns")
    done = subprocess.run([sys.executable, "-m", "torchherd", "-i", str(cluster.inventory), "run", "--no-check",
                           "--include", "node0,node1", "--log-dir", str(logs), "--nproc-per-node", "1",
                           "--", TQDM_DEMO, "--epochs", "1", "--steps", "20"],
                          capture_output=True, text=True, timeout=220, env=cluster.env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "\x1b" not in done.stdout and "lines/s" not in done.stdout
    assert "│" not in done.stdout and "━" not in done.stdout
    for rank, node in enumerate(("node0", "node1")):
        assert f"{node}:{rank}: epoch 1/1: mean loss" in done.stdout
        bars = [line for line in done.stdout.splitlines() if line.startswith(f"{node}:{rank}: rank {rank} epoch 1:")]
        assert len(bars) == 1 and "100%" in bars[0], done.stdout[-3000:]
        # grep '^node1:' | cut -d: -f2: the node's own lines, each naming its rank (or none: torchrun's)
        fields = [line.split(":", 2)[1] for line in done.stdout.splitlines() if line.startswith(f"{node}:")]
        assert fields and {field for field in fields if field.isdigit()} == {str(rank)}, done.stdout[-3000:]
    (note,) = [line for line in done.stdout.splitlines() if line.startswith("torchherd: run th-")]
    assert len(note) > 80 and note.endswith(str(logs / note.split()[2].rstrip(":"))), note


@pytest.mark.timeout(180)
def test_a_drop_rule_shows_in_the_matrix_on_its_row_and_column(cluster: LocalCluster) -> None:
    """node2 drops new TCP connections from node1 only: the one failing cell is row node1,
    column node2."""
    rule = ["INPUT", "-p", "tcp", "--syn", "-s", cluster.node("node1").ip, "-j", "DROP"]
    cluster.netns_exec("node2", ["iptables", "-I", *rule])
    try:
        out = StringIO()
        main(["-i", str(cluster.inventory), "check", "--only", "ssh,ping,hostname,port,firewall"],
             console=make_console(out, width=200))
    finally:
        cluster.netns_exec("node2", ["iptables", "-D", *rule])
    text = out.getvalue()
    assert "connections: rows connected to columns" in text, text
    header = next(line for line in text.splitlines() if line.startswith("from \\ to"))
    assert header.split() == ["from", "\\", "to", "node0", "node1", "node2", "node0:29500"]
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()
            if line.split() and line.split()[0] in cluster.names}
    assert rows["node0"] == ["-", "ok", "ok", "-"], text
    assert rows["node1"] == ["ok", "-", "timed", "out", "ok"], text
    assert rows["node2"] == ["ok", "ok", "-", "ok"], text


@pytest.mark.timeout(600)
def test_a_node_with_less_cpu_is_named_the_straggler_and_a_healthy_run_names_none(make_cluster: object,
                                                                                   tmp_path: Path) -> None:
    """A synchronous job moves at its slowest node's pace everywhere (every bar shows the
    same rate): the node the others wait for is named by how busy its ranks are."""
    cluster: LocalCluster = make_cluster(4)  # type: ignore[operator]
    code, text = compute_job(cluster, tmp_path / "healthy")
    assert code == 0, text[-3000:]
    assert "slowest node: node" not in text and "slow 1." not in text, text[-3000:]
    with less_cpu(cluster, "node2"):
        code, text = compute_job(cluster, tmp_path / "throttled")
    assert_named_the_straggler(code, text, "node2")
    for node in cluster.names:
        assert cluster.wait_no_processes(node) == []
