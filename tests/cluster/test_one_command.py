"""One command from a laptop, on the local cluster (each node keeps a private /tmp):
--sync of a project that exists only on the controller, -H with nodesets and no
inventory file, a DeepSpeed hostfile with uneven process counts."""

from __future__ import annotations

import re
import sys
from io import StringIO
from pathlib import Path

import pytest
from localcluster import LocalCluster

from torchherd.api import Cluster
from torchherd.cli import main
from torchherd.console import make_console
from torchherd.engine.events import Collector, NodeSynced
from torchherd.transport import sshconfig

pytestmark = pytest.mark.cluster

TRAIN = """\
import os

import torch
import torch.distributed as dist

from helper import GREETING

dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} local {os.environ['LOCAL_RANK']} "
      f"sum {int(total.item())} {GREETING}", flush=True)
dist.destroy_process_group()
"""


def project(root: Path, greeting: str = "v1") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.py").write_text(TRAIN)
    (root / "helper.py").write_text(f"GREETING = {greeting!r}\n")
    (root / ".gitignore").write_text("*.log\n")
    (root / "noise.log").write_text("never sent\n")
    (root / ".git").mkdir(exist_ok=True)
    return root


def cli(*args: str) -> tuple[int, str]:
    out = StringIO()
    code = main(list(args), console=make_console(out, width=250))
    return code, out.getvalue()


def ranks(out: str) -> dict[str, list[tuple[int, int, int, int, str]]]:
    """Per node, (rank, world, local rank, all_reduce sum, greeting) of each line."""
    found: dict[str, list[tuple[int, int, int, int, str]]] = {}
    for match in re.finditer(r"^(node\d+):\d+: rank (\d+) of (\d+) local (\d+) sum (\d+) (\w+)$", out, re.M):
        node, *numbers, greeting = match.groups()
        rank, world, local, total = map(int, numbers)
        found.setdefault(node, []).append((rank, world, local, total, greeting))
    return found


def home_with_ssh_config(cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """-H and hostfiles have no inventory to name an ssh_config: ~/.ssh/config is read, as ssh does,
    from the account's home (not $HOME), which the test points at a directory of its own."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(cluster.ssh_config.read_text())
    monkeypatch.setattr(sshconfig, "account_home", lambda: str(home))


@pytest.mark.timeout(240)
def test_sync_runs_a_project_only_the_controller_has_then_sends_only_the_edit(
        cluster: LocalCluster, tmp_path: Path) -> None:
    source = project(tmp_path / "proj")
    for name in cluster.names:
        assert cluster.ssh(name, "test -e /tmp/work/train.py").returncode != 0
    args = ("-i", str(cluster.inventory), "run", "--no-check", "--nproc-per-node", "1", "--workdir", "/tmp/work",
            "--log-dir", str(tmp_path / "logs"), "--sync", str(source), "--", "train.py")
    code, out = cli(*args)
    assert code == 0, out
    assert {node: [line[:4] for line in lines] for node, lines in ranks(out).items()} == {
        name: [(rank, 3, 0, 3)] for rank, name in enumerate(cluster.names)}, out
    assert "node0, node1, node2: in sync at /tmp/work: 3 files sent" in out  # train.py, helper.py, .gitignore
    for name in cluster.names:
        assert cluster.read_file(name, "/tmp/work/helper.py") == "GREETING = 'v1'\n"
        assert cluster.ssh(name, "test -e /tmp/work/noise.log").returncode != 0

    (source / "helper.py").write_text("GREETING = 'v2'\n")  # the same size: found changed by its hash
    again = Cluster.from_toml(cluster.inventory).override(workdir="/tmp/work")
    done = again.sync(source, on_event=Collector())
    assert done.ok, done.failed
    assert {(node.node, node.sent, node.sent_bytes, node.unchanged) for node in done.nodes  # type: ignore[union-attr]
            } == {(name, ("helper.py",), len("GREETING = 'v2'\n"), 2) for name in cluster.names}
    assert {cluster.read_file(name, "/tmp/work/helper.py") for name in cluster.names} == {"GREETING = 'v2'\n"}
    done = again.sync(source)
    assert done.ok and all(isinstance(node, NodeSynced) and node.sent == () for node in done.nodes)


@pytest.mark.timeout(240)
def test_check_sync_and_dry_run_list_what_would_travel(cluster: LocalCluster, tmp_path: Path) -> None:
    source = project(tmp_path / "proj2")
    base = ("-i", str(cluster.inventory))
    code, out = cli(*base, "run", "--dry-run", "--workdir", "/tmp/dry", "--sync", str(source), "--", "train.py")
    assert code == 0, out
    assert "sync to node0, node1, node2 (/tmp/dry): would send 3 files" in out
    assert "  + helper.py" in out and "noise.log" not in out
    assert all(cluster.ssh(name, "test -e /tmp/dry").returncode != 0 for name in cluster.names)
    code, out = cli(*base, "check", "--only", "script", "--workdir", "/tmp/dry", "--sync", str(source), "--",
                    "train.py")
    assert code == 0, out
    assert cluster.read_file("node2", "/tmp/dry/train.py") == TRAIN


@pytest.mark.timeout(240)
def test_sync_never_sends_keys_secrets_or_old_logs(cluster: LocalCluster, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    source = project(tmp_path / "careless")  # a git repository whose .gitignore names none of these
    for path, text in ((".ssh/id_ed25519", "-----BEGIN OPENSSH PRIVATE KEY-----\n"), (".env", "API_TOKEN=s3cret\n"),
                       ("torchherd-logs/old-run/summary.json", "{}\n")):
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        (source / path).write_text(text)
    monkeypatch.chdir(source)  # the default --log-dir, torchherd-logs, is inside the project
    code, out = cli("-i", str(cluster.inventory), "run", "--no-check", "--nproc-per-node", "1", "--workdir",
                    "/tmp/careless", "--sync", "--", "train.py")
    assert code == 0, out
    assert sorted(ranks(out)) == ["node0", "node1", "node2"], out
    assert "sync: left out as private: .env, .ssh/ (--sync-include PATTERN sends it)" in out
    for name in cluster.names:
        listed = cluster.ssh(name, "cd /tmp/careless && find . -path ./.torchherd-sync -prune -o -print | sort")
        found = [path for path in listed.stdout.split() if "__pycache__" not in path]  # the job's own
        assert found == [".", "./.gitignore", "./helper.py", "./train.py"], listed
    assert len(list((source / "torchherd-logs").iterdir())) == 2  # the old run's, and this run's


@pytest.mark.timeout(240)
def test_sync_refuses_a_workdir_another_user_made(cluster: LocalCluster, tmp_path: Path, other_user: str) -> None:
    # node1: another user made the workdir first (theirs, 0755: they could swap any file
    # synced into it); node2: theirs and open to all (0777), with a link planted where the
    # project goes. node0's workdir is the user's own. Each node's /tmp is its own (sticky).
    made = {"node1": "mkdir -m 755 /tmp/shared",
            "node2": "mkdir -m 777 /tmp/shared && ln -s /tmp/shared/bin /tmp/shared/proj && mkdir /tmp/shared/bin"}
    for name, command in made.items():
        done = cluster.ssh(name, f"runuser -u {other_user} -- sh -c '{command}'")
        assert done.returncode == 0, done.stderr
    source = project(tmp_path / "proj")
    code, out = cli("-i", str(cluster.inventory), "run", "--dry-run", "--workdir", "/tmp/shared/proj", "--sync",
                    str(source), "--", "train.py")
    assert code == 1, out
    assert "sync to node0 (/tmp/shared/proj): would send 3 files" in out
    for name in made:
        assert f"sync to {name}: /tmp/shared cannot hold a sync: it is {other_user}'s, not yours" in out, out
    done = Cluster.from_toml(cluster.inventory).override(workdir="/tmp/shared/proj").sync(source)
    assert [node.node for node in done.failed] == ["node1", "node2"]
    assert cluster.read_file("node0", "/tmp/shared/proj/helper.py") == "GREETING = 'v1'\n"
    for name in made:
        assert cluster.ssh(name, "ls -A /tmp/shared/bin 2>/dev/null; test -e /tmp/shared/proj/train.py"
                           ).stdout == "", "nothing written on a refused node"


@pytest.mark.timeout(240)
def test_hosts_given_as_a_nodeset_run_without_an_inventory_file(
        cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home_with_ssh_config(cluster, tmp_path, monkeypatch)
    monkeypatch.chdir(project(tmp_path / "proj3"))
    monkeypatch.delenv("TORCHHERD_INVENTORY", raising=False)
    code, out = cli("run", "-H", "node[0-2]", "--python", sys.executable, "--workdir", "/tmp/oneshot",
                    "--nproc-per-node", "1", "--no-check", "--log-dir", str(tmp_path / "logs"), "--sync", "--",
                    "train.py")
    assert code == 0, out
    assert sorted(ranks(out)) == ["node0", "node1", "node2"], out
    assert not (tmp_path / "proj3" / "hosts.toml").exists()


@pytest.mark.timeout(240)
def test_uneven_process_counts_from_a_hostfile(
        cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home_with_ssh_config(cluster, tmp_path, monkeypatch)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# DeepSpeed\nnode0 slots=1\nnode1 slots=3\n")
    source = project(tmp_path / "proj4")
    code, out = cli("-i", str(hostfile), "run", "--python", sys.executable, "--workdir", "/tmp/uneven", "--no-check",
                    "--log-dir", str(tmp_path / "logs"), "--sync", str(source), "--", "train.py")
    assert code == 0, out
    found = ranks(out)
    assert sorted(found) == ["node0", "node1"], out
    assert [len(found["node0"]), len(found["node1"])] == [1, 3]
    every = [line for lines in found.values() for line in lines]
    assert sorted(line[0] for line in every) == [0, 1, 2, 3]
    assert {(line[1], line[3]) for line in every} == {(4, 4)}  # world size 4, all_reduce of ones: 4
    for lines in found.values():  # each node's global ranks are contiguous, local ranks 0..n-1
        assert sorted(line[0] for line in lines) == list(range(min(line[0] for line in lines),
                                                               min(line[0] for line in lines) + len(lines)))
        assert sorted(line[2] for line in lines) == list(range(len(lines)))
