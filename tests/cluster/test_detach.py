"""Detached runs on the local cluster: ``run --detach``, ``status``, ``logs [-f]``,
``stop``, fail fast with no controller. Real sshd, real torchrun.

Every test points ``$XDG_STATE_HOME`` at its own directory (the run records), and
the ``runs`` fixture stops every run a test started and removes its files on the
nodes, pass or fail. Jobs are ``examples/ticker.py``: numbered lines, no
collectives, so a count of exact lines proves nothing was lost or doubled.
"""

from __future__ import annotations

import io
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from localcluster import LocalCluster

from support.cluster_build import Runs
from support.cluster_detach import all_exited, wait_states
from support.cluster_runs import Controller, assert_clean
from support.processes import default_signals
from torchherd.cli import main
from torchherd.console import make_console
from torchherd.console.observer import ConsoleObserver
from torchherd.console.run import LiveRenderer
from torchherd.engine.records import load
from torchherd.engine.run import Follow
from torchherd.engine.ssh.detach import NodeFollower, follow_logs, node_states

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("state_home")]

TICKER = str(Path(__file__).resolve().parents[2] / "examples" / "ticker.py")
PRELOADED = str(Path(__file__).resolve().parent / "jobs" / "preloaded.py")


def cli(cluster: LocalCluster, *args: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(["-i", str(cluster.inventory), *args], console=make_console(out, width=200))
    return code, out.getvalue()


def ticks(out: str, node: str, rank: int) -> list[int]:
    return [int(match) for match in re.findall(rf"^{node}:{rank}: tick {rank} (\d+)$", out, re.M)]


def run_processes(cluster: LocalCluster, name: str, run_id: str) -> list[str]:
    """Processes on the node whose environment or command line holds the run id."""
    script = (f"for p in /proc/[0-9]*; do grep -qa -- {shlex.quote(run_id)} $p/environ $p/cmdline 2>/dev/null "
              f"&& [ $p != /proc/$$ ] && echo $p; done")
    found = cluster.node_exec(name, ["sh", "-c", script], check=False).stdout.split()
    return [pid for pid in found if pid != "/proc/self"]


@pytest.mark.timeout(120)
def test_detached_run_completes_with_no_controller(cluster: LocalCluster, runs: Runs) -> None:
    run_id, seconds = runs.detach(cluster, "--", TICKER, "30", "0.2")
    print(f"run --detach returned in {seconds:.1f} s")
    assert seconds < 15
    # The command has exited: no controller is left, and the job runs on.
    code, out = cli(cluster, "status", run_id)
    assert code == 0, out
    assert all(re.search(rf"^{name}\s+running ", out, re.M) for name in cluster.names), out
    assert all(cluster.processes(name) for name in cluster.names)
    states = wait_states(run_id, all_exited, timeout=60)
    assert [(state.state, state.code) for state in states] == [("exited", 0)] * 3, states
    code, out = cli(cluster, "status", run_id)
    assert all(re.search(rf"^{name}\s+exited \(0\) ", out, re.M) for name in cluster.names), out
    code, listing = cli(cluster, "status")
    assert run_id in listing and "ok" in listing, listing
    code, out = cli(cluster, "logs", run_id)
    assert code == 0, out
    for rank, name in enumerate(cluster.names):
        assert ticks(out, name, rank) == list(range(30)), out
        # torchrun's per-rank tee directory is gone once the job is over
        assert cluster.ssh(name, f"test -e /tmp/torchherd-{run_id}-{name}").returncode == 1
    code, only = cli(cluster, "logs", "--node", "node1", "--rank", "1", run_id)
    assert ticks(only, "node1", 1) == list(range(30)) and "node0:0" not in only
    assert_clean(cluster)


@pytest.mark.timeout(150)
def test_a_detached_runs_ranks_fork_from_a_torchrun_that_imported_torch_and_no_warm_starts_them_cold(
        cluster: LocalCluster, runs: Runs) -> None:
    """No controller stays to own a warm Python: each node's supervisor starts torchrun
    warm itself (it imports torch, then its ranks fork from it: one import per node).
    ``--no-warm`` starts every process cold. Nothing is left: no process, no private directory."""
    for flags, preloaded in (((), True), (("--no-warm",), False)):
        run_id, _ = runs.detach(cluster, *flags, "--", PRELOADED)
        states = wait_states(run_id, all_exited, timeout=60)
        assert [(state.state, state.code) for state in states] == [("exited", 0)] * 3, states
        code, out = cli(cluster, "logs", run_id)
        assert code == 0, out
        said = sorted(re.findall(r"rank (\d) torch imported before the script: (\w+)", out))
        assert said == [(str(rank), str(preloaded)) for rank in range(3)], out
        assert "started cold" not in out, out
        assert_clean(cluster)
        for name in cluster.names:
            assert cluster.ssh(name, "ls -d /tmp/torchherd-warm-* 2>/dev/null").stdout == "", name


@pytest.mark.timeout(150)
def test_logs_follow_survives_a_cut_connection(cluster: LocalCluster, runs: Runs) -> None:
    count = 120
    run_id, _ = runs.detach(cluster, "--", TICKER, str(count), "0.1")
    out = io.StringIO()
    renderer = LiveRenderer(make_console(out, width=200), cluster.names, 2)
    followers: dict[str, NodeFollower] = {}

    def follow() -> None:
        followers.update(follow_logs(load(run_id), ConsoleObserver(renderer.console, renderer), Follow(follow=True)))

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not ticks(out.getvalue(), "node1", 1)[10:] and time.monotonic() < deadline:
        time.sleep(0.1)
    cluster.cut_network("node1")
    try:
        time.sleep(7)
    finally:
        cluster.restore_network("node1")
    thread.join(timeout=90)
    assert not thread.is_alive(), "logs -f did not end with the run"
    text = out.getvalue()
    for rank, name in enumerate(cluster.names):
        assert ticks(text, name, rank) == list(range(count)), f"{name}: lines lost or doubled"
    assert followers["node1"].reconnects >= 1
    print(f"node1 follower reconnected {followers['node1'].reconnects} times")
    assert_clean(cluster, timeout=15)


@pytest.fixture
def other_port_inventory(cluster: LocalCluster) -> Iterator[Path]:
    """The cluster's inventory with another master port (beside it: relative paths stay valid)."""
    path = cluster.inventory.with_name("other-port.toml")
    text = cluster.inventory.read_text()
    path.write_text(re.sub(r"(?m)^port = \d+$", f"port = {cluster.master_port + 17}", text, count=1))
    try:
        yield path
    finally:
        path.unlink()


@pytest.mark.timeout(150)
def test_stop_leaves_nothing_and_spares_another_run(cluster: LocalCluster, runs: Runs,
                                                    other_port_inventory: Path) -> None:
    first, _ = runs.detach(cluster, "--", TICKER, "1000", "0.2")
    second, _ = runs.detach(cluster, "--", TICKER, "1000", "0.2",
                            inventory=other_port_inventory)
    for run_id in (first, second):
        states = wait_states(run_id, lambda states: all(s.state == "running" for s in states), timeout=30)
        assert all(state.state == "running" for state in states), states
    started = time.monotonic()
    code, out = cli(cluster, "stop", first)
    print(f"stop took {time.monotonic() - started:.1f} s")
    assert code == 0, out
    assert f"run {first}: stopped" in out
    for name in cluster.names:
        assert run_processes(cluster, name, first) == [], f"{first} left on {name}"
        assert run_processes(cluster, name, second), f"{second} was touched on {name}"
    assert all(state.state == "running" for state in node_states(load(second)))
    states = node_states(load(first))
    assert all(state.state == "exited" and state.code != 0 for state in states), states
    code, out = cli(cluster, "stop", second)
    assert code == 0, out
    assert_clean(cluster, timeout=1)


PLANTED = ("base64", "binascii", "json", "marshal", "re", "select", "selectors", "shutil", "signal", "socket",
           "struct", "subprocess", "types", "typing", "zlib")
"""Standard modules the node programs import, as a project's own files could name them."""
PASS_THROUGH = """\
import importlib, os, sys
if sys.argv[:1] == ["-c"]:  # a node program (python -c): it must never get here
    raise SystemExit("the project's {name}.py ran in a node program")
# The job (torchrun, started with -m from the workdir) imports it too: it gets the real one.
here, saved = os.path.dirname(os.path.abspath(__file__)), list(sys.path)
sys.path[:] = [path for path in sys.path if os.path.abspath(path or ".") != here]
del sys.modules[__name__]
try:
    sys.modules[__name__] = importlib.import_module(__name__)
finally:
    sys.path[:] = saved
"""


@pytest.fixture
def planted_inventory(cluster: LocalCluster) -> Iterator[Path]:
    """The cluster's inventory with a workdir of its own (in each node's private /tmp) that
    holds a ``json.py``, a ``base64.py``... (a node program that imported one would stop
    with its message)."""
    workdir = f"/tmp/planted-{cluster.prefix}"
    archive = io.BytesIO()  # one SSH command a node, not one a file (45 of them took 16 s)
    with tarfile.open(fileobj=archive, mode="w") as tar:
        for name in PLANTED:
            data = PASS_THROUGH.format(name=name).encode()
            member = tarfile.TarInfo(f"{name}.py")
            member.size, member.mode = len(data), 0o644
            tar.addfile(member, io.BytesIO(data))
    for node in cluster.names:
        unpack = f"mkdir -p {shlex.quote(workdir)} && tar -x -C {shlex.quote(workdir)}"
        done = subprocess.run(cluster.ssh_argv(node, unpack), input=archive.getvalue(), capture_output=True, timeout=60)
        assert done.returncode == 0, done.stderr
    path = cluster.inventory.with_name("planted.toml")
    path.write_text(re.sub(r'(?m)^workdir = .*$', f"workdir = {workdir!r}", cluster.inventory.read_text()))
    try:
        yield path
    finally:
        path.unlink()
        for node in cluster.names:
            cluster.ssh(node, f"rm -rf {shlex.quote(workdir)}")


@pytest.mark.timeout(150)
def test_node_programs_ignore_the_projects_modules_named_as_standard_ones(
        cluster: LocalCluster, runs: Runs, planted_inventory: Path, tmp_path: Path) -> None:
    """Supervisor, coordinator and stop start in the workdir: its ``json.py`` is the job's."""
    run_id, _ = runs.detach(cluster, "--", TICKER, "1000", "0.2", inventory=planted_inventory)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # every rank ticks: the supervisors and the job run
        code, out = cli(cluster, "logs", run_id)
        if all(ticks(out, name, rank)[:1] == [0] for rank, name in enumerate(cluster.names)):
            break
        time.sleep(1)
    assert all(ticks(out, name, rank)[:1] == [0] for rank, name in enumerate(cluster.names)), out
    code, out = cli(cluster, "stop", run_id)
    assert code == 0 and f"run {run_id}: stopped" in out, out
    code, out = cli(cluster, "logs", run_id)
    assert "ran in a node program" not in out, out
    attached = io.StringIO()
    code = main(["-i", str(planted_inventory), "run", "--no-check", "--nproc-per-node", "1", "--log-dir",
                 str(tmp_path / "logs"), "--", TICKER, "3", "0.1"], console=make_console(attached, width=200))
    assert code == 0 and "ran in a node program" not in attached.getvalue(), attached.getvalue()
    assert ticks(attached.getvalue(), "node2", 2) == [0, 1, 2], attached.getvalue()
    assert_clean(cluster)


@pytest.mark.timeout(120)
def test_fail_fast_while_detached(cluster: LocalCluster, runs: Runs) -> None:
    run_id, _ = runs.detach(cluster, "--", TICKER, "1000", "0.2", "--exit-rank", "1", "--exit-at", "10")
    states = wait_states(run_id, all_exited, timeout=60)
    assert all_exited(states), states
    by_node = {state.node: state for state in states}
    assert by_node["node1"].code not in (0, None)
    failed_at = by_node["node1"].since
    assert failed_at is not None
    spread = max(state.since or 0.0 for state in states) - failed_at
    print(f"the other nodes ended {spread:.1f} s after node1")
    assert spread < 8
    for name in ("node0", "node2"):
        assert by_node[name].code != 0
    code, out = cli(cluster, "logs", "--node", "node1", run_id)
    assert "node1:1: rank 1 exits with code 3 on purpose" in out, out
    assert_clean(cluster)


@pytest.mark.timeout(60)
def test_attached_run_removes_its_tee_dir(cluster: LocalCluster, tmp_path: Path) -> None:
    code, out = cli(cluster, "run", "--no-check", "--log-dir", str(tmp_path / "logs"), "--nproc-per-node", "1",
                    "--", TICKER, "2", "0")
    assert code == 0, out
    (run_dir,) = (tmp_path / "logs").iterdir()
    for name in cluster.names:  # each attempt's directory has a random end (mkdtemp): none is left
        left = cluster.ssh(name, f"ls -d /tmp/torchherd-{run_dir.name}-{name}*")
        assert left.returncode != 0, left
    assert_clean(cluster)


@pytest.mark.timeout(90)
def test_attach_shows_the_run_live_and_ctrl_c_only_detaches(cluster: LocalCluster, runs: Runs) -> None:
    run_id, _ = runs.detach(cluster, "--", TICKER, "1000", "0.2")
    attach = subprocess.Popen([sys.executable, "-m", "torchherd", "attach", run_id[-6:]], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                              env={**cluster.env(), "XDG_STATE_HOME": str(runs.state_home), "COLUMNS": "200"},
                              preexec_fn=default_signals(signal.SIGINT))
    try:
        assert attach.stdout is not None
        for line in attach.stdout:
            if re.match(r"node2:2: tick 2 3$", line):
                break
        attach.send_signal(signal.SIGINT)
        rest = attach.communicate(timeout=20)[0]
    finally:
        if attach.poll() is None:
            attach.kill()
            attach.wait()
    assert attach.returncode == 0, rest
    assert f"detached; the run goes on (torchherd stop {run_id[-6:]} stops it)" in rest
    assert all(state.state == "running" for state in node_states(load(run_id)))
    code, out = cli(cluster, "stop", run_id)
    assert code == 0, out
    assert_clean(cluster, timeout=1)


@pytest.mark.timeout(120)
def test_an_attached_run_is_in_the_history(cluster: LocalCluster, tmp_path: Path,
                                           controllers: Callable[..., Controller]) -> None:
    """An attached run: ``status`` lists it (finished), ``status`` and ``logs`` take a
    prefix of its id; a controller killed with -9 mid-run leaves a record that ``status``
    calls ended (controller gone), never running, and nothing on the nodes."""
    code, out = cli(cluster, "run", "--no-check", "--log-dir", str(tmp_path / "logs"), "--nproc-per-node", "1",
                    "--", TICKER, "5", "0")
    assert code == 0, out
    (run_dir,) = (tmp_path / "logs").iterdir()
    run_id, prefix = run_dir.name, run_dir.name[:-2]
    code, listing = cli(cluster, "status")
    assert code == 0 and re.search(rf"^{run_id}\s+finished\s", listing, re.M), listing  # piped: plain columns
    code, out = cli(cluster, "status", prefix)
    assert code == 0 and f"run {run_id} (finished)" in out, out
    assert all(re.search(rf"^{name}\s+exited \(0\)\s", out, re.M) for name in cluster.names), out
    assert f"logs in {run_dir}" in out, out
    code, out = cli(cluster, "logs", prefix)
    assert code == 0, out
    for rank, name in enumerate(cluster.names):
        assert ticks(out, name, rank) == list(range(5)), out
        assert f"torchherd: {name}: finished (exit 0)" in out, out

    killed = controllers(cluster, tmp_path / "killed", "--nproc-per-node", "1", "--", TICKER, "600", "0.1")
    killed.wait_for(r"tick 0 3$", timeout=60)
    (killed_dir,) = (tmp_path / "killed").iterdir()
    code, out = cli(cluster, "status", killed_dir.name)
    assert f"run {killed_dir.name} (running)" in out, out
    killed.process.send_signal(signal.SIGKILL)
    killed.wait(timeout=10)
    code, out = cli(cluster, "status", killed_dir.name)
    assert code == 0 and f"run {killed_dir.name} (ended (controller gone))" in out, out
    assert_clean(cluster, timeout=15)
