"""The public Python API against the local cluster: the example in docs/api.md runs as
written, a run through the API never imports rich, and the checks verify the plan that
is launched (its master address and processes per node), not the inventory's, and a run's
preflight reads torch from its files where a check imported that install."""

from __future__ import annotations

import re
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from localcluster import LocalCluster

import torchherd
from support.cluster_topologies import ALLREDUCE_DEMO
from torchherd.cli import main
from torchherd.console import make_console
from torchherd.engine.events import Event, PreflightDone

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]


def _api_example() -> str:
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    return re.findall(r"```python\n(.*?)```", text, re.S)[0]


def _inventory_in_repo(cluster: LocalCluster, directory: Path) -> Path:
    """The cluster's inventory with the checkout as every node's workdir (as scripts/demo does)."""
    text = cluster.inventory.read_text(encoding="utf-8")
    text = re.sub(r'(?m)^workdir = .*$', f'workdir = "{ROOT}"', text)
    text = re.sub(r'(?m)^ssh_config = .*$', f'ssh_config = "{cluster.ssh_config}"', text)
    path = directory / "hosts.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_the_documented_example_runs_as_written(cluster: LocalCluster, tmp_path: Path) -> None:
    _inventory_in_repo(cluster, tmp_path)
    done = subprocess.run([sys.executable, "-c", _api_example()], cwd=tmp_path, env=cluster.env(),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"all 3 nodes finished \(exit 0\)", done.stdout), done.stdout
    assert re.search(r"(?m)^node0:0 ", done.stdout), done.stdout
    assert [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("node") and " ok " in line] == \
        [["ok", "0"]] * 3
    assert "rich" not in done.stderr
    run_dirs = list((tmp_path / "logs").iterdir())
    assert len(run_dirs) == 1 and sorted(path.name for path in run_dirs[0].iterdir()) == [
        "events.jsonl", "node0.log", "node1.log", "node2.log"]  # the run's history (docs/run.md, "The report")


def test_a_run_through_the_api_never_imports_rich(cluster: LocalCluster, tmp_path: Path) -> None:
    script = f"""
import sys, torchherd
cluster = torchherd.Cluster.from_toml({str(cluster.inventory)!r})
plan = cluster.plan({ALLREDUCE_DEMO!r}, "--steps", "2", nproc_per_node=1)
summary = cluster.launch(plan, log_dir={str(tmp_path / 'logs')!r}, check=False).wait()
print("exit", summary.exit_code, "rich" in sys.modules, sorted(m for m in sys.modules if m.startswith("rich")))
"""
    done = subprocess.run([sys.executable, "-c", script], env=cluster.env(), capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "exit 0 False []"


def test_the_preflight_checks_the_master_address_and_nproc_of_the_command_line(
        cluster: LocalCluster, tmp_path: Path) -> None:
    """Before, the checks verified the inventory's master address and were then told
    nothing of --master-addr: this run passed its preflight and hung at the rendezvous."""
    out = StringIO()
    code = main(["-i", str(cluster.inventory), "run", "--log-dir", str(tmp_path), "--master-addr", "10.254.254.254",
                 "--", str(ROOT / "examples" / "ddp_demo.py")], console=make_console(out, width=200))
    text = out.getvalue()
    assert code == 1, text
    assert "10.254.254.254" in text, text
    assert not (tmp_path / "logs").exists() and not any(tmp_path.iterdir()), "nothing was launched"


def test_a_runs_preflight_reads_torch_from_its_files_where_a_check_imported_that_install(
        cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A check imports torch on every node and keeps, on this machine, which install it
    imported there; a run's preflight then reads that install's versions from its files
    (its torchrun imports it moments later), and the job runs."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    herd = torchherd.Cluster.from_toml(str(cluster.inventory))
    checked = herd.check(only=("ssh", "python"))
    assert checked.ok and [result.summary for result in checked.results if "read from its files" in result.summary] == []
    events: list[Event] = []
    run = herd.launch(herd.plan(ALLREDUCE_DEMO, "--steps", "2", nproc_per_node=1), log_dir=tmp_path / "logs", on_event=events.append,
                      only=("ssh", "python"))
    assert run.wait().exit_code == 0
    (done,) = [event for event in events if isinstance(event, PreflightDone)]
    python = {result.node: result.summary for result in done.report.results if result.check == "python"}
    assert sorted(python) == ["node0", "node1", "node2"], python
    for summary in python.values():
        assert re.fullmatch(r"python \S+, torch \S+, CUDA - \(read from its files: a check \d+ s ago imported it\)",
                            summary), summary
