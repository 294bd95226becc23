"""``report RUN``: the story and the figures built from recorded histories (a clean run, a
run recovered on a spare, a hang, a straggler, the real H200 GPU samples); the text form's
exact text; the page's embedded figure JSON; the CLI and API around them. No browser: the
figures are checked as the page carries them (plotly's JSON)."""

from __future__ import annotations

import base64
import gzip
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import histories
import pytest

from torchherd.cli import main
from torchherd.console import make_console
from torchherd.engine.eventlog import HISTORY_FILE, Recorded
from torchherd.runreport.html import gpu_figure, page, progress_figure, timeline_figure
from torchherd.runreport.story import Story, story_of
from torchherd.runreport.text import story_text


def told(build: Callable[[Path], list[Recorded]], directory: Path) -> Story:
    return story_of("r1", build(directory))


def traces(figure: dict[str, Any]) -> list[tuple[str, str, list[str]]]:
    return [(trace["type"], trace["name"], trace["y"]) for trace in figure["data"]]


def test_a_clean_run(tmp_path: Path) -> None:
    story = told(histories.clean, tmp_path)
    assert story_text(story) == (
        "run r1, exit 0: every node finished (exit 0) in 64.0 s; 08:00:00 to 08:01:07 UTC (1 min 7 s)\n"
        "GPU use (mean utilisation; 08:00:10 to 08:01:00 UTC, 1 character = 8.3 s):\n"
        "  node1  ██████   90 % (2 GPUs)\n"
        "  node2  ██████   90 % (2 GPUs)\n")
    timeline = timeline_figure(story)
    assert traces(timeline) == [("bar", "starting", ["node1", "node2"]), ("bar", "running", ["node1", "node2"]),
                                ("bar", "finished", ["node1", "node2"])]
    assert timeline["data"][1]["base"] == ["2027-01-15 08:00:06.000"] * 2
    assert timeline["data"][1]["x"] == [60_000, 60_000]
    assert [shape["name"] for shape in timeline["layout"]["shapes"]] == ["attempt 1"]
    assert timeline["layout"]["yaxis"]["categoryarray"] == ["node1", "node2"]
    progress = progress_figure(story)
    assert progress is not None
    assert [(trace["name"], trace["yaxis"]) for trace in progress["data"]] == [
        ("node1", "y"), ("node2", "y"), ("node1", "y2"), ("node2", "y2")]
    assert progress["layout"]["annotations"][0]["text"] == "progress (lines/s)"
    busy = progress["data"][2]["y"]
    assert (busy[0], {value for value in busy if value is not None}) == (0.3, {0.3})  # 3 of 10 looks found one busy


def test_a_run_recovered_on_a_spare(tmp_path: Path) -> None:
    story = told(histories.recovered, tmp_path)
    assert story_text(story) == (
        "run r1, exit 0: every node finished (exit 0) after 2 attempts; 08:00:00 to 08:01:41 UTC (1 min 41 s)\n"
        "attempt 1 on node1, node2: 08:00:00, 45 s, node2 was lost (ssh: the connection went silent)\n"
        "recovery after attempt 1: 12 s to ranks running again (triage of 2 nodes 3.0 s, 1 failed; node2 excluded; "
        "spare1 in place of node2; checkpoint staged on 1 node in 1.5 s)\n"
        "attempt 2 on node1, spare1: 08:00:50, 51 s, every node finished (exit 0) after 2 attempts\n"
        "GPU use (mean utilisation; 08:00:10 to 08:01:30 UTC, 1 character = 11 s):\n"
        "  node1   ██  ███   90 % (2 GPUs)\n"
        "  node2   ██        90 % (2 GPUs)\n"
        "  spare1      ███   90 % (2 GPUs)\n"
        "checkpoint: newest checkpoint: ckpt/last.pt on node1, spare1\n")
    timeline = timeline_figure(story)
    assert traces(timeline) == [
        ("bar", "starting", ["node1", "node2", "node1", "spare1"]),
        ("bar", "running", ["node2", "node1", "node1", "spare1"]),
        ("bar", "lost", ["node2"]), ("bar", "torn down", ["node1"]), ("bar", "finished", ["node1", "spare1"]),
        ("scatter", "triage", ["node2"]), ("scatter", "excluded", ["node2"]), ("scatter", "spare", ["spare1"]),
        ("scatter", "checkpoint", ["node1"]), ("scatter", "staged", ["spare1"])]
    spare = timeline["data"][7]
    assert (spare["x"], spare["hovertext"]) == (["2027-01-15 08:00:48.000"],
                                                ["spare1 08:00:48 UTC: spare, in place of node2"])
    assert [(shape["name"], shape["x0"], shape["x1"]) for shape in timeline["layout"]["shapes"]] == [
        ("attempt 1", "2027-01-15 08:00:00.000", "2027-01-15 08:00:45.000"),
        ("attempt 2", "2027-01-15 08:00:50.000", "2027-01-15 08:01:41.000"),
        ("recovery after attempt 1", "2027-01-15 08:00:45.000", "2027-01-15 08:00:57.000")]
    assert [note["text"] for note in timeline["layout"]["annotations"]] == ["attempt 1", "attempt 2"]
    assert timeline["layout"]["yaxis"]["categoryarray"] == ["node1", "node2", "spare1"]
    gpus = gpu_figure(story)
    assert gpus is not None
    assert [(trace["name"], trace["y"]) for trace in gpus["data"]] == [
        (name, ["node1:0", "node1:1", "node2:0", "node2:1", "spare1:0", "spare1:1"])
        for name in ("GPU utilisation (%)", "SM clock (% of its maximum)", "power (W)",
                     "clock throttle reason (the worst)")]
    # node2's GPUs end with attempt 1, spare1's begin with attempt 2 (a sample every 10 s)
    assert gpus["data"][0]["z"][2] == [90, 90, 90, None, None, None, None, None, None]
    assert gpus["data"][0]["z"][4] == [None, None, None, None, None, 90, 90, 90, 90]


def test_a_hang_is_marked_with_each_ranks_stack(tmp_path: Path) -> None:
    story = told(histories.hung, tmp_path)
    assert story_text(story) == (
        "run r1, exit 1: hung: no rank printed a line or used CPU for 20 s; rank 3 on node2 in load at "
        "train.py:9; 08:00:00 to 08:00:45 UTC (45 s)\n"
        "hang: found at 08:00:40; rank 3 on node2 in load at train.py:9; ranks 0-2 in all_reduce at train.py:12\n"
        "GPU use (mean utilisation; 08:00:10 to 08:00:10 UTC, 1 character = 1.0 s):\n"
        "  node1  █   90 % (2 GPUs)\n"
        "  node2  █   90 % (2 GPUs)\n")
    assert traces(timeline_figure(story))[-1] == ("scatter", "hang", ["node1", "node2"])
    text = page(story)
    assert ("<h2>The hang's stacks</h2><table><tr><th>node</th><th>rank</th><th>in</th><th>at</th></tr>"
            "<tr><td>node1</td><td>0</td><td>all_reduce</td><td>train.py:12</td></tr>"
            "<tr><td>node1</td><td>1</td><td>all_reduce</td><td>train.py:12</td></tr>"
            "<tr><td>node2</td><td>2</td><td>all_reduce</td><td>train.py:12</td></tr>"
            "<tr><td>node2</td><td>3</td><td>load</td><td>train.py:9</td></tr></table>") in text


def test_the_straggler_stands_out_from_when_the_run_marked_it(tmp_path: Path) -> None:
    story = told(histories.straggling, tmp_path)
    assert story_text(story) == (
        "run r1, exit 0: every node finished (exit 0) in 61.0 s; 08:00:00 to 08:01:05 UTC (1 min 5 s)\n"
        "straggler: slowest node: node3, 3.0x slower than the median (tqdm rate), marked at 08:00:34\n")
    assert traces(timeline_figure(story))[-1] == ("scatter", "straggler", ["node3"])
    progress = progress_figure(story)
    assert progress is not None
    assert [(trace["name"], trace["line"]["width"], trace["line"]["color"]) for trace in progress["data"]] == [
        ("node1", 1, "#1f77b4"), ("node2", 1, "#ff7f0e"), ("node3 (straggler)", 3, "#d62728")] * 2
    assert progress["layout"]["annotations"][0]["text"] == "progress (tqdm iterations/s)"
    assert set(progress["data"][2]["y"]) == {2.0} and set(progress["data"][0]["y"]) == {6.0}


def test_the_h200_samples_as_heatmaps(tmp_path: Path) -> None:
    story = told(histories.h200, tmp_path)
    assert story_text(story) == (
        "run r1, exit 0: the node finished (exit 0) in 49.2 s; 08:00:00 to 08:00:49 UTC (49 s)\n"
        "GPU use (mean utilisation; 08:00:20 to 08:00:35 UTC, 1 character = 3.8 s):\n"
        "  192.0.2.2  ████  100 % (1 GPU; power cap)\n")
    gpus = gpu_figure(story)
    assert gpus is not None
    assert [(trace["y"], trace["z"], trace["x0"], trace["dx"]) for trace in gpus["data"]] == [
        (["192.0.2.2:0"], [[100, 99, 100, 99]], "2027-01-15 08:00:22.500", 5000.0),
        (["192.0.2.2:0"], [[73, 73, 73, 73]], "2027-01-15 08:00:22.500", 5000.0),  # 1,440-1,455 of 1,980 MHz
        (["192.0.2.2:0"], [[693, 695, 692, 692]], "2027-01-15 08:00:22.500", 5000.0),
        (["192.0.2.2:0"], [[1, 1, 1, 1]], "2027-01-15 08:00:22.500", 5000.0)]  # the SW power cap, throughout
    assert gpus["data"][3]["colorbar"]["ticktext"] == ["none", "power cap", "hardware slowdown",
                                                       "thermal slowdown (driver)", "thermal slowdown", "power brake"]
    assert progress_figure(story) is None


def figures_of(text: str) -> dict[str, dict[str, Any]]:
    found = re.findall(r'<script type="application/json" data-figure="figure-(\w+)">(.*?)</script>', text)
    return {name: json.loads(data) for name, data in found}


def test_the_page_is_one_file_with_plotly_inside_and_no_address_outside(tmp_path: Path) -> None:
    story = told(histories.recovered, tmp_path)
    text = page(story)
    assert sorted(figures_of(text)) == ["gpus", "progress", "timeline"]
    assert figures_of(text)["timeline"] == timeline_figure(story)
    packed = re.search(r'<script id="plotly-js" type="application/octet-stream">([A-Za-z0-9+/=]+)</script>', text)
    assert packed is not None
    plotly_js = gzip.decompress(base64.b64decode(packed.group(1))).decode()
    assert plotly_js.startswith("/**\n* plotly.js v")
    outside = text.replace(packed.group(0), "")
    assert not re.search(r'(src|href)="(https?:)?//', outside)  # nothing fetched from elsewhere
    assert "<th>node</th><th>ssh</th><th>gpu</th><th>port</th>" in text  # the preflight's grid
    assert '<td class="pass" title="ssh fine">pass</td>' in text
    assert len(text.encode()) < 2_500_000


def record_run(home: Path, build: Callable[[Path], list[Recorded]], run_id: str) -> Path:
    """An attached run's record in the state directory, its history in its log directory."""
    from torchherd.engine.records import AttachedRecord, NodeRecord, RunRecord, save, with_attached

    run_dir = home / "logs" / run_id
    build(run_dir)
    node = NodeRecord(name="node1", address="node1", user=None, ssh_port=None, identity_file=None, python="/opt/py",
                      workdir="/w", log_file=str(run_dir / "node1.log"), state_file="")
    plain = RunRecord(run_id=run_id, inventory="-H", created=histories.T0, command=("train.py",), nodes=(node,),
                      max_rank=1, grace=10.0)
    save(with_attached(plain, AttachedRecord(4242, 77, str(run_dir), "finished", 0, "done", histories.T0 + 60)))
    return run_dir


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def cli(*args: str) -> tuple[int, str]:
    from io import StringIO

    out = StringIO()
    code = main(list(args), make_console(out, width=200))
    return code, out.getvalue()


def test_the_command_writes_the_page_private_beside_the_history(home: Path) -> None:
    run_dir = record_run(home, histories.recovered, "th-20270115-080000-aaaaa1")
    assert cli("report", "th-20270115-080000-aaaaa1") == (0, f"report: {run_dir / 'report.html'}\n")
    assert stat.S_IMODE((run_dir / "report.html").stat().st_mode) == 0o600
    assert sorted(figures_of((run_dir / "report.html").read_text())) == ["gpus", "progress", "timeline"]
    assert cli("report", "th-20270115-080000-aaaaa1", "-o", "here.html") == (0, "report: here.html\n")
    assert (home / "here.html").is_file()


def test_the_command_tells_the_story_and_prints_the_history(home: Path) -> None:
    run_dir = record_run(home, histories.straggling, "th-20270115-080000-aaaaa2")
    assert cli("report", "th-20270115-080000-aaaaa2", "--text") == (0, story_text(story_of("th-20270115-080000-aaaaa2", histories.straggling(home / "again"))))
    code, text = cli("logs", "th-20270115-080000-aaaaa2", "--events")
    lines = text.splitlines()
    assert code == 0
    assert len(lines) == len((run_dir / HISTORY_FILE).read_text().splitlines())
    assert lines[0] == ('08:00:00.000 RunStarted {"run_id":"r1","nodes":["node1","node2","node3"],"master":"node1",'
                        f'"master_addr":"10.0.0.1","port":29500,"log_dir":"{run_dir}","max_rank":5}}')
    assert lines[4] == ('08:00:04.000 node1 progress {"rank":0,"text":" 40%|####      | 40/100 [00:10<00:15, '
                        '6.00it/s]"}')
    assert lines[5] == '08:00:04.000 node1 busy {"samples":10,"busy":3}'


def test_a_run_without_history_and_a_missing_plotly_are_one_line_each(home: Path, tmp_path: Path) -> None:
    from torchherd.engine.records import NodeRecord, RunRecord, save

    node = NodeRecord(name="node1", address="node1", user=None, ssh_port=None, identity_file=None, python="/opt/py",
                      workdir="/w", log_file="/tmp/th/node1.log", state_file="/tmp/th/node1.state")
    save(RunRecord(run_id="th-20270115-080000-aaaaa3", inventory="-H", created=histories.T0, command=("train.py",),
                   nodes=(node,), max_rank=1, grace=10.0))  # a plain detached run
    done = subprocess.run([sys.executable, "-m", "torchherd", "report", "th-20270115-080000-aaaaa3", "--text"], capture_output=True,
                          text=True, env={**os.environ, "COLUMNS": "200"})
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("error: run th-20270115-080000-aaaaa3 keeps no history (events.jsonl)\n"
                           "  hint: a run keeps its history from this version on, attached or detached with "
                           "retries; a plain detached run has no controller left to receive its events\n")
    blocker = tmp_path / "noplotly"
    blocker.mkdir()
    (blocker / "plotly.py").write_text("raise ImportError('not here')\n")
    done = subprocess.run([sys.executable, "-m", "torchherd", "report", "th-20270115-080000-aaaaa3"], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200",
                               "PYTHONPATH": f"{blocker}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("error: report: the HTML report needs plotly, not installed here: pip install "
                           "'torchherd[report]'\n  hint: report RUN --text tells the same story in a few lines "
                           "without it\n")


def test_run_never_imports_plotly() -> None:
    done = subprocess.run([sys.executable, "-c", "import sys, torchherd.cli, torchherd.api, torchherd.console.observer;"
                           "import torchherd.engine.recovery.background;"
                           "print([name for name in sys.modules if name.startswith('plotly')])"],
                          capture_output=True, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (0, "[]\n", "")


def test_the_api_gives_the_history_as_typed_objects_and_writes_the_page(home: Path) -> None:
    import torchherd
    from torchherd.engine.events import SpareTaken

    run_dir = record_run(home, histories.recovered, "th-20270115-080000-aaaaa4")
    found = torchherd.events_of("th-20270115-080000-aaaaa4")
    assert [record.event for record in found if isinstance(record.event, SpareTaken)] == [SpareTaken("spare1", "node2")]
    assert found == sorted(found, key=lambda record: record.at)
    assert torchherd.report("th-20270115-080000-aaaaa4", home / "r.html") == home / "r.html"
    assert figures_of((home / "r.html").read_text())["timeline"] == timeline_figure(
        story_of("th-20270115-080000-aaaaa4", histories.recovered(run_dir.parent / "again")))


def test_events_with_a_filter_and_text_with_a_file_are_usage_errors(home: Path) -> None:
    record_run(home, histories.clean, "th-20270115-080000-aaaaa5")
    done = subprocess.run([sys.executable, "-m", "torchherd", "logs", "--events", "--node", "node1",
                           "th-20270115-080000-aaaaa5"], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"})
    assert (done.returncode, done.stdout, done.stderr) == (2, "", (
        "error: --events and --node: the history is printed whole, as recorded\n"
        "  hint: leave one of them out (filter with grep)\n"))
    done = subprocess.run([sys.executable, "-m", "torchherd", "report", "--text", "-o", "x.html",
                           "th-20270115-080000-aaaaa5"], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"})
    assert (done.returncode, done.stdout, done.stderr) == (2, "", (
        "error: --text and -o: the text goes to the terminal\n  hint: leave one of them out\n"))
    assert not (home / "x.html").exists()
