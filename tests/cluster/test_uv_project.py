"""A uv-locked project on the local cluster (nodes without internet; the lock's one
dependency is a wheel in the project): the job runs in a venv built from the lock on every
node, a second run reuses it without running uv, and a venv changed by hand on one node
is named by ``check``."""

from __future__ import annotations

import json
import re
import shlex
import sys
from io import StringIO
from pathlib import Path

import pytest
from localcluster import REPO_ROOT, LocalCluster

from support.uvproject import backend_wheels, locked_project, package_project, registry_project, uv_binary, wheel
from torchherd.api import Cluster
from torchherd.cli import main
from torchherd.console import make_console
from torchherd.engine.prepare.venvs import local_uv

pytestmark = pytest.mark.cluster

TRAIN = """\
import sys

import torch
import torch.distributed as dist

import thdemo

dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
print(f"rank {dist.get_rank()} sum {int(total.item())} prefix {sys.prefix} value {thdemo.VALUE}", flush=True)
dist.destroy_process_group()
"""


def cli(*args: str) -> tuple[int, str]:
    out = StringIO()
    code = main(list(args), console=make_console(out, width=300))
    return code, out.getvalue()


def counting_uv(shared: Path) -> tuple[Path, Path]:
    """A uv (where every node sees it) that notes each call, with the node's name, then runs the real one."""
    log = shared / "uv-calls"
    wrapper = shared / "uv"
    wrapper.write_text(f"#!/bin/sh\necho \"$(hostname) $*\" >> {log}\nexec {uv_binary()} \"$@\"\n")
    wrapper.chmod(0o755)
    log.touch()
    return wrapper, log


def builds(log: Path) -> list[str]:
    """The nodes that ran uv sync to build (not the checks' ``--check``), in order."""
    return [line.split()[0] for line in log.read_text().splitlines() if "sync --frozen" in line
            and "--check" not in line]


@pytest.mark.timeout(600)
def test_a_locked_project_runs_in_its_venv_everywhere_reuses_it_and_check_names_a_changed_one(
        make_cluster: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    cluster: LocalCluster = make_cluster(2, shared_paths=(str(REPO_ROOT), sys.prefix, str(shared)))  # type: ignore[operator]
    wrapper, log = counting_uv(shared)
    # The uv that counts; the venvs in the synced project (/tmp/work: each node's own).
    inventory = cluster.inventory.with_name("uv.toml")
    inventory.write_text(cluster.inventory.read_text().replace('workdir = "/tmp"', f'workdir = "/tmp"\nuv = "{wrapper}"'))
    project = locked_project(tmp_path / "proj", TRAIN)
    venv = Cluster.from_toml(inventory).override(workdir="/tmp/work").plan(
        "train.py", sync=project, uv_system_site_packages=True).nodes[0].venv
    assert venv is not None and venv.path == f"/tmp/work/.torchherd-venvs/{venv.key}"
    run = ("-i", str(inventory), "run", "--nproc-per-node", "1", "--log-dir", str(tmp_path / "logs"),
           "--workdir", "/tmp/work", "--sync", str(project), "--uv-system-site-packages", "--", "train.py")

    code, out = cli(*run)
    assert code == 0, out
    assert sorted(builds(log)) == ["node0", "node1"], log.read_text()
    assert "node0, node1: venv " + venv.path + " built from uv.lock by uv sync --frozen" in out, out
    ranks = re.findall(r"^(node\d):\d: rank (\d) sum 2 prefix (\S+) value from the lock$", out, re.M)
    assert sorted(ranks) == [("node0", "0", venv.path), ("node1", "1", venv.path)], out

    code, out = cli(*run)
    assert code == 0, out
    assert sorted(builds(log)) == ["node0", "node1"], log.read_text()  # no uv sync ran: the marker matched
    assert "node0, node1: venv " + venv.path + " as uv.lock made it (cached)" in out, out
    assert len(re.findall(r"^node\d:\d: rank \d sum 2 prefix \S+ value from the lock$", out, re.M)) == 2, out

    # By hand on node1 only: a package the lock does not have.
    extra = wheel(shared, "extra")
    changed = cluster.ssh("node1", f"{uv_binary()} pip install --offline --quiet --python {venv.path}/bin/python {extra}")
    assert changed.returncode == 0, changed
    capsys.readouterr()
    code, _ = cli("-i", str(inventory), "check", "--json", "--only", "venv", "--workdir", "/tmp/work", "--sync",
                  str(project), "--uv-system-site-packages")
    out = capsys.readouterr().out  # the JSON document, printed on stdout itself
    assert code == 1, out
    report = json.loads(out)
    verdicts = {result["node"]: (result["status"], result["summary"]) for result in report["checks"]}
    assert verdicts == {
        "node0": ("pass", f"{venv.path} matches uv.lock (sha256 {venv.lock_hash[:12]}; {wrapper} sync --check)"),
        "node1": ("fail", "the venv on node1 differs from uv.lock (changed since it was built): a sync would "
                          "remove extra==0.1.0"),
    }, out
    assert sorted(builds(log)) == ["node0", "node1"]  # check built nothing: the marker still matched

    # A node without uv (its venv in a place of its own, so it must build): the run stops
    # before the preflight, naming the node and the fix; nothing starts.
    missing = inventory.with_name("nouv.toml")
    missing.write_text(inventory.read_text().replace(
        'name = "node1"', 'name = "node1"\nuv = "/nowhere/uv"\nvenv_dir = "/tmp/venvs"'))
    code, out = cli("-i", str(missing), *run[2:])
    assert code == 1, out
    assert "node1: venv not built: uv not found (looked for /nowhere/uv)" in out, out
    assert ("node1: fix: install uv on node1 (" + cluster.python + " -m pip install --user uv, or uv's own "
            'installer), or set uv = "/path/to/uv" for node1 in the inventory') in out, out
    assert "rank 0" not in out

    # A node without uv, none configured (its python a link where no uv lies beside, a PATH
    # without one): this machine's own uv is sent there, beside its venvs, and builds.
    pybin = shared / "pybin"
    pybin.mkdir()
    (pybin / "python3").symlink_to(cluster.python)
    bare = inventory.with_name("bare.toml")
    bare.write_text(cluster.inventory.read_text().replace(
        'name = "node1"', f'name = "node1"\npython = "{pybin / "python3"}"\nenv = {{ PATH = "/usr/bin:/bin" }}'))
    shipped = Cluster.from_toml(bare).override(workdir="/tmp/work").plan(
        "train.py", sync=project, uv_system_site_packages=True).nodes[1].venv
    assert shipped is not None and shipped.key != venv.key  # another python: a venv of its own
    code, out = cli("-i", str(bare), *run[2:])
    assert code == 0, out
    local = local_uv()
    assert local is not None
    sent = f"/tmp/work/.torchherd-venvs/uv-{local.digest[:16]}"
    assert f"node1: had no uv: this machine's sent ({sent})" in out, out
    assert "node0: venv " + venv.path + " as uv.lock made it (cached)" in out, out
    assert f"node1:1: rank 1 sum 2 prefix {shipped.path} value from the lock" in out, out
    assert cluster.ssh("node1", f"test -x {sent}").returncode == 0
    assert cluster.ssh("node0", f"test -e {sent}").returncode != 0  # node0 had its own: nothing sent there


@pytest.mark.timeout(300)
def test_a_venv_dir_another_user_made_is_refused_and_their_venv_never_runs(
        make_cluster: object, tmp_path: Path, other_user: str) -> None:
    """node1: another user made the venv_dir first, with a venv under the name the lock's key
    gives (computable from the synced uv.lock), marked as built, whose python leaves a trace.
    node1 is refused in one line naming the directory; node0 (its venv_dir its own) builds."""
    shared = tmp_path / "shared"
    shared.mkdir()
    cluster: LocalCluster = make_cluster(2, shared_paths=(str(REPO_ROOT), sys.prefix, str(shared)))  # type: ignore[operator]
    wrapper, log = counting_uv(shared)
    inventory = cluster.inventory.with_name("uv.toml")
    inventory.write_text(cluster.inventory.read_text().replace(
        'workdir = "/tmp"', f'workdir = "/tmp"\nuv = "{wrapper}"\nvenv_dir = "/tmp/venvs"'))
    project = locked_project(tmp_path / "proj", TRAIN)
    venv = Cluster.from_toml(inventory).override(workdir="/tmp/work").plan(
        "train.py", sync=project, uv_system_site_packages=True).nodes[1].venv
    assert venv is not None and venv.path.startswith("/tmp/venvs/")
    plant = (f"mkdir -m 755 /tmp/venvs && mkdir -p -m 755 {venv.path}/bin && "
             f"printf '#!/bin/sh\\ntouch /tmp/planted-ran\\n' > {venv.path}/bin/python && "
             f"chmod 755 {venv.path}/bin/python && "
             f"echo '{{\"key\": \"{venv.key}\"}}' > {venv.path}/.torchherd-venv")
    done = cluster.ssh("node1", f"runuser -u {other_user} -- sh -c {shlex.quote(plant)}")
    assert done.returncode == 0, done.stderr
    code, out = cli("-i", str(inventory), "run", "--nproc-per-node", "1", "--log-dir", str(tmp_path / "logs"),
                    "--workdir", "/tmp/work", "--sync", str(project), "--uv-system-site-packages", "--", "train.py")
    assert code == 1, out
    assert (f"node1: venv not built: /tmp/venvs cannot hold venvs: it is {other_user}'s, not yours (mode 0755); "
            "another user could swap or redirect what is built and run there (use a venv_dir only you can write)"
            in out), out
    assert builds(log) == ["node0"], log.read_text()
    assert "rank 0" not in out
    assert cluster.ssh("node1", "test -e /tmp/planted-ran").returncode != 0


@pytest.mark.timeout(600)
def test_nodes_without_an_index_get_the_locks_wheels_relayed_once_then_find_their_venvs_cached(
        make_cluster: object, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from torchherd.engine.prepare import offline
    from torchherd.engine.prepare.offline import project_build
    from torchherd.engine.prepare.uvwheels import NodePlatform
    from torchherd.engine.prepare.wheelhouse import cache_name
    from torchherd.remote.venv import libc_of
    from torchherd.words import size

    cluster: LocalCluster = make_cluster(3, shared_paths=(str(REPO_ROOT), sys.prefix))  # type: ignore[operator]
    # The lock takes thdemo from PyPI (its URL there, its hash); no node reaches an index, and
    # no node has the wheel: only this machine's [uv] wheels directory does. The project is a
    # src-layout package (mypkg, setuptools), installed editable as uv sync installs it, its
    # backend's wheels in [uv] wheels too; where pip reaches no index for them, a project
    # that is no package.
    wheels = tmp_path / "wheels"
    packaged = backend_wheels(wheels)
    script = TRAIN.replace("from the lock", "from the wheelhouse")
    if packaged:
        script = script.replace("import thdemo\n", "import mypkg\nimport thdemo\n").replace(
            "value {thdemo.VALUE}", "value {thdemo.VALUE} mine {mypkg.VALUE} at {mypkg.__file__}")
        project, built = package_project(tmp_path / "proj")
        (project / "train.py").write_text(script)
    else:
        project, built = registry_project(tmp_path / "proj", script)
    wheels.mkdir(exist_ok=True)
    built.rename(wheels / built.name)
    (project / "downloads").rmdir()
    monkeypatch.setattr(offline, "WHEELHOUSES", tmp_path / "wheelhouses")  # this machine's cache, the test's own
    inventory = cluster.inventory.with_name("offline.toml")
    inventory.write_text(cluster.inventory.read_text().replace('workdir = "/tmp"', f'workdir = "/tmp"\nuv = "{uv_binary()}"')
                         + f'\n[uv]\nwheels = "{wheels}"\n')
    venv = Cluster.from_toml(inventory).override(workdir="/tmp/work").plan(
        "train.py", sync=project, uv_system_site_packages=True, uv_offline=True).nodes[0].venv
    assert venv is not None
    run = ("-i", str(inventory), "run", "--nproc-per-node", "1", "--log-dir", str(tmp_path / "logs"),
           "--workdir", "/tmp/work", "--sync", str(project), "--uv-system-site-packages", "--uv-offline", "--",
           "train.py")

    code, out = cli(*run)
    assert code == 0, out
    glibc = libc_of(__import__("platform").libc_ver())
    here = NodePlatform("Linux", __import__("platform").machine(), glibc[0], glibc[1])
    build = project_build(project)
    assert (build is not None) == packaged
    house = tmp_path / "wheelhouses" / cache_name(venv.lock_hash, here, "%d.%d.%d" % sys.version_info[:3], build)
    held = sorted(str(path.relative_to(house)) for path in house.rglob("*") if path.is_file())
    backend = sorted(f"build/{path.name}" for path in wheels.glob("*.whl") if path.name != built.name)
    assert held == sorted(["requirements.txt", built.name, *backend, *(["build/requires.txt"] if packaged else [])])
    assert house.stat().st_mode & 0o777 == 0o700
    once = size(sum(path.stat().st_size for path in house.rglob("*") if path.is_file()))
    files = len(held)
    # This machine sent the wheelhouse once, to node0; node1 and node2 got it from the node before them.
    assert re.search(rf"wheels: uv\.lock's {files} files for \S+ python {sys.version_info[0]}\.{sys.version_info[1]} "
                     rf"\({re.escape(once)}, none downloaded; {re.escape(str(house))}\) relayed node to node: this "
                     rf"machine -> node0 -> node1 -> node2: on 3 of 3 nodes \(\d+\.\d s; {re.escape(once)} sent from "
                     r"this machine\)$", out, re.M), out
    # before it, what goes where, and one bar per node (off a terminal: their last state, once)
    assert re.search(rf"wheels: sending uv\.lock's {files} files for \S+ python {sys.version_info[0]}\.{sys.version_info[1]} "
                     rf"\({re.escape(once)}; {re.escape(str(house))}\) once, relayed node to node: this machine -> "
                     r"node0 -> node1 -> node2$", out, re.M), out
    bars = re.findall(rf"^  (node\d) ━+ {re.escape(once)} / {re.escape(once)} verified$", out, re.M)
    assert bars == ["node0", "node1", "node2"], out
    assert ("node0, node1, node2: venv " + venv.path + " built from uv.lock by uv pip sync --offline from the lock's "
            "wheels") in out, out
    mine = " mine mine at /tmp/work/src/mypkg/__init__.py" if packaged else ""  # each node's own copy, editable
    ranks = re.findall(rf"^(node\d):\d: rank (\d) sum 3 prefix (\S+) value from the wheelhouse{mine}$", out, re.M)
    assert sorted(ranks) == [(f"node{index}", str(index), venv.path) for index in range(3)], out
    for name in cluster.names:  # the wheelhouse is gone from every node once its venv is built
        assert cluster.ssh(name, f"test -e /tmp/work/.torchherd-venvs/wheelhouse-{venv.key}").returncode != 0
        assert cluster.ssh(name, f"test -f {venv.path}/.torchherd-venv").returncode == 0

    code, out = cli(*run)  # the venvs are built: nothing made, nothing sent
    assert code == 0, out
    assert "wheels:" not in out, out
    assert "node0, node1, node2: venv " + venv.path + " as uv.lock made it (cached)" in out, out
    assert len(re.findall(rf"^node\d:\d: rank \d sum 3 prefix \S+ value from the wheelhouse{mine}$", out, re.M)) == 3, out

    capsys.readouterr()
    code, _ = cli("-i", str(inventory), "check", "--json", "--only", "venv", "--workdir", "/tmp/work", "--sync",
                  str(project), "--uv-system-site-packages", "--uv-offline")
    out = capsys.readouterr().out
    assert code == 0, out
    verdicts = {result["node"]: result["status"] for result in json.loads(out)["checks"]}
    assert verdicts == {"node0": "pass", "node1": "pass", "node2": "pass"}, out
