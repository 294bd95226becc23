"""``torchherd report`` of a real run on the local cluster: a run with retries whose node2
is killed mid-run (its link down, every process of its namespace killed) and replaced by
the spare node3. Its history (``events.jsonl``, private) is read back; the report's
embedded figure JSON is checked for each node's row, both attempts and the spare's mark,
then the page is opened in a real headless Chromium (Debian's, scripts/install-deps) with
no network at all (its own network namespace: no request can leave the page): a
screenshot is taken and the DOM it drew is checked for the same; the text form names both
attempts and the recovery."""

from __future__ import annotations

import json
import re
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from localcluster import LocalCluster

from support.cluster_recovery import RESUMABLE, kill_node
from support.cluster_runs import Controller

pytestmark = pytest.mark.cluster


def figures_of(text: str) -> dict[str, dict[str, Any]]:
    found = re.findall(r'<script type="application/json" data-figure="figure-(\w+)">(.*?)</script>', text)
    return {name: json.loads(data) for name, data in found}


def torchherd(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torchherd", *args], capture_output=True, text=True, timeout=120,
                          env={**cluster.env(), "COLUMNS": "200"})


def wait_sample(logs: Path, kind: str, node: str, timeout: float) -> None:
    """Until the run's history (``logs/<run id>/events.jsonl``) holds a ``kind`` sample of ``node``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for history in logs.glob("*/events.jsonl"):
            records = [json.loads(line) for line in history.read_text().splitlines() if line.endswith("}")]
            if any(record.get("sample") == kind and record.get("node") == node for record in records):
                return
        time.sleep(0.2)
    pytest.fail(f"no {kind} sample of {node} in the history after {timeout:.0f} s")


def browsed(page: Path, directory: Path) -> str:
    """The DOM headless Chromium drew from ``page`` with no network (``unshare -n``), after
    its screenshot (``directory/report.png``)."""
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("chromium is not installed (scripts/install-deps installs Debian's)")
    argv = ["unshare", "-n", chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            f"--user-data-dir={directory / 'chromium'}", "--window-size=1400,1400", "--virtual-time-budget=30000"]
    subprocess.run([*argv, f"--screenshot={directory / 'report.png'}", page.as_uri()], capture_output=True,
                   timeout=120, check=True)
    assert (directory / "report.png").stat().st_size > 20_000
    print(f"screenshot: {directory / 'report.png'}")
    return subprocess.run([*argv, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120,
                          check=True).stdout


@pytest.mark.timeout(300)
def test_the_report_of_a_run_recovered_on_a_spare(make_cluster: Callable[..., LocalCluster], tmp_path: Path,
                                                  controllers: Callable[..., Controller], state_home: Path) -> None:
    cluster = make_cluster(4, nproc_per_node=1)
    logs = tmp_path / "logs"
    controller = controllers(cluster, logs, "--spares", "node3", "--retries", "2", "--plain", "--",
                             RESUMABLE, "--steps", "40", "--step-seconds", "0.15")
    controller.wait_for(r"step 12 loss", timeout=90)
    # node2's row of the progress figure is its busy share (only rank 0 prints steps), which
    # its supervisor sends every 2 s: it dies once one is in the history (a warm attempt 1
    # reaches step 12 sooner than that)
    wait_sample(logs, "busy", "node2", timeout=60)
    kill_node(cluster, "node2")
    try:
        controller.wait_for(r"attempt 2 of 3 on 3 nodes: node0, node1, node3", timeout=90)
        assert controller.wait(timeout=120) == 0, controller.output
    finally:
        cluster.restore_network("node2")
    (run_dir,) = [path for path in logs.iterdir() if path.is_dir()]
    run_id = run_dir.name
    history = run_dir / "events.jsonl"
    assert stat.S_IMODE(history.stat().st_mode) == 0o600 and stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert controller.lines[-1] == f"report: torchherd report {run_id} (--text: in a few lines)"

    done = torchherd(cluster, "report", run_id, "-o", str(tmp_path / "report.html"))
    assert (done.returncode, done.stdout, done.stderr) == (0, f"report: {tmp_path / 'report.html'}\n", "")
    figures = figures_of((tmp_path / "report.html").read_text())
    timeline = figures["timeline"]
    assert timeline["layout"]["yaxis"]["categoryarray"] == ["node0", "node1", "node2", "node3"]
    rows = {name: set() for name in ("node0", "node1", "node2", "node3")}
    for trace in timeline["data"]:
        for node in trace["y"]:
            rows[node].add(trace["name"])
    assert {"starting", "running"} <= rows["node0"] and {"starting", "running"} <= rows["node3"]
    assert "lost" in rows["node2"] and "running" in rows["node2"]
    assert [shape["name"] for shape in timeline["layout"]["shapes"]] == [
        "attempt 1", "attempt 2", "recovery after attempt 1"]
    spare = [trace for trace in timeline["data"] if trace["name"] == "spare"]
    assert len(spare) == 1 and spare[0]["y"] == ["node3"]
    assert spare[0]["hovertext"][0].endswith("spare, in place of node2")
    excluded = [trace for trace in timeline["data"] if trace["name"] == "excluded"]
    assert excluded and excluded[0]["y"] == ["node2"]
    assert sorted(figures) == ["progress", "timeline"]
    progress = figures["progress"]
    assert {trace["name"] for trace in progress["data"]} >= {"node0", "node1", "node2", "node3"}

    dom = browsed(tmp_path / "report.html", tmp_path)
    drawn_in = re.search(r'<body data-plotted="(\d+)" data-drawn-ms="(\d+)">', dom)
    assert drawn_in is not None and drawn_in.group(1) == "2", dom[-2000:]  # both drawn, offline (no GPU here)
    print(f"drawn {drawn_in.group(2)} ms after the page's start")
    assert "<h2>GPUs: node:index over time</h2>\n<p class=\"note\">no samples of this kind" in dom
    drawn = dom[dom.index('id="figure-timeline"'):dom.index('id="figure-progress"')]
    assert [name for name in re.findall(r'class="ytick"><text[^>]*data-unformatted="([^"]+)"', drawn)] == [
        "node3", "node2", "node1", "node0"]  # one row per node (drawn bottom up)
    assert re.findall(r'class="annotation-text"[^>]*>(attempt \d)<', drawn) == ["attempt 1", "attempt 2"]
    legend = re.findall(r'class="legendtext"[^>]*data-unformatted="([^"]+)"', drawn)
    assert "spare" in legend and "excluded" in legend and "lost" in legend, legend

    done = torchherd(cluster, "report", run_id, "--text")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert re.fullmatch(rf"run {run_id}, exit 0: .*; \d\d:\d\d:\d\d to \d\d:\d\d:\d\d UTC \(.*\)", lines[0]), lines
    assert re.fullmatch(r"attempt 1 on node0, node1, node2: \d\d:\d\d:\d\d, .*, node2 .*", lines[1]), lines
    assert re.fullmatch(r"recovery after attempt 1: [\d.]+ s to ranks running again \(.*\)", lines[2]), lines
    assert "node2 excluded; " in lines[2] and "node3 in place of node2" in lines[2], lines
    assert re.fullmatch(r"attempt 2 on node0, node1, node3: .*", lines[3]), lines

    done = torchherd(cluster, "logs", run_id, "--events")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == len(history.read_text().splitlines())
    assert re.search(r"^\d\d:\d\d:\d\d\.\d{3} SpareTaken \{\"spare\":\"node3\",\"replacing\":\"node2\"\}$",
                     done.stdout, re.MULTILINE), done.stdout[-2000:]
