"""A uv-locked project: the lock's hash, each node's venv in the plan, the node program
that builds it (run here with the real uv), the ``venv`` check's verdicts, bad input."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from io import StringIO
from pathlib import Path
from typing import Any

import pytest

from support.uvproject import locked_project, uv_binary
from torchherd.api import Cluster
from torchherd.checks.analysis import python as python_check
from torchherd.checks.analysis import venv as venv_check
from torchherd.checks.gather import NODE_SCRIPTS
from torchherd.checks.model import NodeFacts, Observed
from torchherd.cli import main
from torchherd.console import make_console
from torchherd.console.sync import venv_notes
from torchherd.engine.events import VenvFailed, VenvReady, VenvsDone
from torchherd.engine.prepare.venvs import _not_for, local_uv, venv_command, venv_config
from torchherd.errors import UsageError
from torchherd.inventory import parse
from torchherd.plan import NodeNetwork, RunOptions, SyncOptions, UvOptions, build_plan, uv_candidates
from torchherd.remote import argv, shipped, source
from torchherd.tree import uv_lock_hash

LOCK = "ab" * 32
LOCKED = UvOptions(LOCK)


def inventory(**defaults: Any) -> Any:
    document = {"cluster": {"nproc_per_node": 1},
                "defaults": {"python": "/opt/py/bin/python3", "workdir": "/w", **defaults},
                "hosts": [{"name": "n0"}, {"name": "n1", "python": "/usr/bin/python3"}]}
    return parse(document, Path("hosts.toml"))


def options(uv: UvOptions | None = LOCKED, sync: bool = True) -> RunOptions:
    return RunOptions(script="train.py", run_id="r1", sync=SyncOptions("/home/me/my proj") if sync else None, uv=uv)


# the lock's hash --------------------------------------------------------------------


def node_hash(project: Path) -> str | None:
    """The ``uv_lock_hash`` the facts script imports on a node: run as it ships there (its
    modules packed with it, ``-I -S``: no checkout on sys.path)."""
    probe = "import sys\nfrom torchherd.remote.uvlock import uv_lock_hash\nprint(uv_lock_hash(sys.argv[1]))\n"
    program = shipped("probe.py", probe, NODE_SCRIPTS["facts.py"])
    done = subprocess.run([sys.executable, "-I", "-S", "-c", program, str(project)], capture_output=True, text=True,
                          cwd="/", timeout=30, check=True)
    answer = done.stdout.strip()
    return None if answer == "None" else answer


def test_the_lock_hash_covers_both_files_and_the_node_computes_the_same(tmp_path: Path) -> None:
    assert uv_lock_hash(tmp_path) is None
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    assert uv_lock_hash(tmp_path) is None  # no lock: not a uv-locked project
    (tmp_path / "uv.lock").write_text("version = 1\n")
    first = uv_lock_hash(tmp_path)
    assert first is not None and len(first) == 64
    assert node_hash(tmp_path) == first
    (tmp_path / "uv.lock").write_text("version = 2\n")
    assert uv_lock_hash(tmp_path) not in (None, first)
    assert node_hash(tmp_path) == uv_lock_hash(tmp_path)


# the plan ------------------------------------------------------------------------------


def test_each_node_runs_the_venvs_python_and_keeps_its_own_for_the_sync() -> None:
    plan = build_plan(inventory(), options())
    n0, n1 = plan.nodes
    assert n0.venv is not None and n1.venv is not None
    assert n0.venv.path == f"/w/.torchherd-venvs/{n0.venv.key}" and len(n0.venv.key) == 16
    assert n0.argv[0] == f"{n0.venv.path}/bin/python" == n0.host.python
    assert n0.base_python == "/opt/py/bin/python3" and n1.base_python == "/usr/bin/python3"
    assert n0.venv.key != n1.venv.key  # another python: another venv, even in a shared home
    assert n0.venv.project == "/w" and n0.venv.marker == f"{n0.venv.path}/.torchherd-venv"
    assert n0.notes[-1] == (f"python {n0.venv.path}/bin/python: the venv uv sync --frozen builds from uv.lock "
                            f"(sha256 {LOCK[:12]}) with /opt/py/bin/python3; kept while the lock is unchanged")
    # the preflight rebuilds the plan with the networks it found: the venvs stay as they were
    assert plan.with_networks({"n0": NodeNetwork("10.0.0.5")}).nodes[0].venv == n0.venv


def test_the_key_follows_the_lock_and_the_kind_of_venv_only() -> None:
    key = build_plan(inventory(), options()).nodes[0].venv.key  # type: ignore[union-attr]
    assert build_plan(inventory(), options()).nodes[0].venv.key == key  # type: ignore[union-attr]
    other_lock = build_plan(inventory(), options(UvOptions("cd" * 32))).nodes[0].venv
    shared = build_plan(inventory(), options(UvOptions(LOCK, system_site_packages=True))).nodes[0].venv
    assert other_lock is not None and shared is not None
    assert len({key, other_lock.key, shared.key}) == 3 and shared.system_site_packages


def test_without_uv_nothing_changes() -> None:
    plan = build_plan(inventory(), options(uv=None))
    assert all(node.venv is None for node in plan.nodes)
    assert plan.nodes[0].argv[0] == "/opt/py/bin/python3" == plan.nodes[0].base_python


def test_uv_without_a_sync_is_refused() -> None:
    with pytest.raises(UsageError) as raised:
        build_plan(inventory(), options(sync=False))
    assert str(raised.value) == "--uv: the locked environment is built from the synced project's uv.lock"


def test_where_uv_is_looked_for() -> None:
    hosts = inventory().hosts
    assert uv_candidates(hosts[0]) == ("/opt/py/bin/uv", "uv", "~/.local/bin/uv", "~/.cargo/bin/uv")
    configured = inventory(uv="/opt/tools/uv", venv_dir="/scratch/venvs")
    assert uv_candidates(configured.hosts[0]) == ("/opt/tools/uv",)
    venv = build_plan(configured, options()).nodes[0].venv
    assert venv is not None and venv.path.startswith("/scratch/venvs/my-proj-")
    bare = parse({"hosts": [{"name": "n0"}]}, Path("h.toml")).hosts[0]
    assert uv_candidates(bare) == ("uv", "~/.local/bin/uv", "~/.cargo/bin/uv")  # python3 on PATH: no directory


def test_the_build_command_carries_no_environment_and_the_config_does() -> None:
    plan = build_plan(inventory(env={"UV_INDEX_URL": "https://user:secret@example.invalid/simple"}), options())
    node = plan.nodes[0]
    command = venv_command(node)
    assert command.startswith("/opt/py/bin/python3 -I -S -u -c ") and "secret" not in command
    config = venv_config(node)
    assert config["env"]["UV_INDEX_URL"] == "https://user:secret@example.invalid/simple"  # type: ignore[index]
    assert {key: config[key] for key in ("path", "key", "project", "uv", "system_site_packages")} == {
        "path": node.venv.path, "key": node.venv.key, "project": "/w",  # type: ignore[union-attr]
        "uv": ["/opt/py/bin/uv", "uv", "~/.local/bin/uv", "~/.cargo/bin/uv"], "system_site_packages": False}


# the api and the command line ------------------------------------------------------------


def test_a_locked_project_turns_uv_on_by_itself_and_no_uv_turns_it_off(tmp_path: Path) -> None:
    project = tmp_path / "proj"
    project.mkdir()
    (project / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    cluster = Cluster(hosts=["n0"], python="/usr/bin/python3")
    assert cluster.plan("train.py", sync=project).nodes[0].venv is None  # no uv.lock: as before
    (project / "uv.lock").write_text("version = 1\n")
    venv = cluster.plan("train.py", sync=project).nodes[0].venv
    assert venv is not None and venv.lock_hash == uv_lock_hash(project)
    assert cluster.plan("train.py", sync=project, uv=False).nodes[0].venv is None
    assert cluster.plan("train.py", sync=False).nodes[0].venv is None


def run_cli(command: str, *args: str) -> tuple[int, str]:
    out = StringIO()
    code = main([command, "-H", "192.0.2.1", *args], console=make_console(out, width=300))
    return code, out.getvalue()


@pytest.mark.parametrize(("flags", "message"), [
    (["--uv"], "error: --uv: {project} has no uv.lock"),
    (["--uv-system-site-packages"], "error: --uv-system-site-packages: {project} has no uv.lock"),
    (["--uv", "--no-sync"], "error: --uv: the venv is built from the synced project's uv.lock, and nothing is synced"),
    (["--no-uv", "--uv-system-site-packages"], "error: --uv-system-site-packages: not with --no-uv"),
])
def test_bad_uv_flags_exit_2_with_one_line(tmp_path: Path, flags: list[str], message: str) -> None:
    project = tmp_path / "proj"
    project.mkdir()
    (project / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    sync = [] if "--no-sync" in flags else ["--sync", str(project)]
    code, out = run_cli("run", "--dry-run", *sync, *flags, "--", "train.py")
    assert code == 2, out
    lines = [line for line in out.splitlines() if not line.startswith("  hint:")]
    assert lines == [message.format(project=project)], out
    assert "Traceback" not in out


def test_dry_run_shows_the_venvs_python(tmp_path: Path) -> None:
    project = tmp_path / "proj"
    project.mkdir()
    (project / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (project / "uv.lock").write_text("version = 1\n")
    plan = Cluster(hosts=["192.0.2.1"], python="/usr/bin/python3").plan("train.py", sync=project)
    venv = plan.nodes[0].venv
    assert venv is not None
    from torchherd.console.run import render_description

    out = StringIO()
    render_description(make_console(out, width=400), plan)
    assert f"{venv.path}/bin/python -m torch.distributed.run" in out.getvalue()
    assert "the venv uv sync --frozen builds from uv.lock" in out.getvalue()


# the node program, with the real uv -------------------------------------------------------


def build_here(config: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, *argv("venv.py")], input=(json.dumps(config) + "\n").encode(),
                          capture_output=True, check=True, timeout=120)
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def counting_uv(tmp_path: Path) -> tuple[Path, Path]:
    """A uv that notes each call in a log, then runs the real one."""
    log = tmp_path / "uv-calls"
    wrapper = tmp_path / "bin" / "uv"
    wrapper.parent.mkdir()
    wrapper.write_text(f"#!/bin/sh\necho \"$*\" >> {log}\nexec {uv_binary()} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper, log


@pytest.mark.timeout(180)
def test_the_node_program_builds_once_then_finds_the_marker_and_runs_no_uv(tmp_path: Path) -> None:
    project = locked_project(tmp_path / "proj")
    wrapper, log = counting_uv(tmp_path)
    config = {"path": str(tmp_path / "venvs" / "v1"), "key": "k1", "project": str(project),
              "uv": ["/nowhere/uv", str(wrapper)], "system_site_packages": False, "env": {"UV_OFFLINE": "1"}}
    first = build_here(config)
    assert first["built"] is True and first["uv"] == str(wrapper)
    assert log.read_text().splitlines() == [f"sync --frozen --python {sys.executable}"]
    python = tmp_path / "venvs" / "v1" / "bin" / "python"
    shown = subprocess.run([str(python), "-c", "import sys, thdemo; print(thdemo.VALUE, sys.prefix)"],
                           capture_output=True, text=True, check=True).stdout
    assert shown == f"from the lock {tmp_path / 'venvs' / 'v1'}\n"
    marker = json.loads((tmp_path / "venvs" / "v1" / ".torchherd-venv").read_text())
    assert marker == {"key": "k1", "uv": str(wrapper), "python": sys.executable}
    assert build_here(config) == {"cached": True}
    assert len(log.read_text().splitlines()) == 1  # uv was not run again
    assert build_here({**config, "key": "k2"})["built"] is True  # another key: uv syncs again
    assert len(log.read_text().splitlines()) == 2


@pytest.mark.timeout(180)
def test_the_node_program_with_system_site_packages_sees_this_pythons_packages(tmp_path: Path) -> None:
    project = locked_project(tmp_path / "proj")
    config = {"path": str(tmp_path / "v"), "key": "k", "project": str(project), "uv": [uv_binary()],
              "system_site_packages": True, "env": {"UV_OFFLINE": "1"}}
    assert build_here(config)["built"] is True
    assert "include-system-site-packages = true" in (tmp_path / "v" / "pyvenv.cfg").read_text()
    subprocess.run([str(tmp_path / "v" / "bin" / "python"), "-c", "import thdemo, pytest"], check=True)


def test_the_node_program_without_uv_says_where_it_looked(tmp_path: Path) -> None:
    config = {"path": str(tmp_path / "v"), "key": "k", "project": str(tmp_path), "uv": ["/nowhere/uv", "no-such-uv"],
              "system_site_packages": False, "env": {}}
    answer = build_here({**config, "env": {"PATH": str(tmp_path)}})
    assert answer == {"error": "uv not found (looked for /nowhere/uv, no-such-uv)", "uv_missing": True,
                      "system": platform.system(), "machine": platform.machine(), "libc": platform.libc_ver()[0],
                      "libc_version": platform.libc_ver()[1]}


def test_this_machines_uv_is_found_and_judged_against_the_nodes_platform() -> None:
    local = local_uv()
    assert local is not None and local.path.read_bytes()[:4] == b"\x7fELF"
    same = {"system": local.system, "machine": local.machine, "libc": local.libc}
    assert _not_for(local, same) == ""
    assert _not_for(local, {**same, "machine": "aarch64"}) == (
        f"this machine's uv is for {local.system} {local.machine} {local.libc or 'no glibc'}, the node is "
        f"{local.system} aarch64 {local.libc or 'no glibc'}")
    assert _not_for(None, same) == "this machine has no uv binary to send"


def test_a_failed_sync_gives_uvs_last_lines(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\nversion = '0'\n")
    config = {"path": str(tmp_path / "v"), "key": "k", "project": str(tmp_path), "uv": [uv_binary()],
              "system_site_packages": False, "env": {"UV_OFFLINE": "1"}}
    answer = build_here(config)
    # uv's own words (they may change with its version), on one line: its wrapped hint joined
    assert answer["error"].startswith("uv sync --frozen failed (exit 1): error: Unable to find lockfile")
    assert "\n" not in answer["error"] and " |" not in answer["error"]
    assert not (tmp_path / "v" / ".torchherd-venv").exists()


# the venv check ----------------------------------------------------------------------------------


def observed_with(state: dict[str, Any] | None, python_error: str = "") -> Observed:
    plan = build_plan(inventory(), options())
    seen = Observed(inventory=plan.inventory, master_target="n0",
                    venvs={node.host.name: node.venv for node in plan.nodes if node.venv is not None})
    for host in plan.inventory.hosts:
        seen.facts[host.name] = NodeFacts(raw={"venv": state, "torch": {"version": "2.13.0"},
                                               "python": {"version": "3.11.7"}}, sent=0.0, received=0.0,
                                          python_error=python_error)
    return seen


MARKER = {"key": "k", "uv": "/opt/py/bin/uv", "python": "/opt/py/bin/python3"}


def test_a_venv_as_the_lock_made_it_passes() -> None:
    results = venv_check.analyse(observed_with({"lock_hash": LOCK, "marker": MARKER, "check": {"code": 0}}))
    assert [result.status for result in results] == ["pass", "pass"]
    assert results[0].summary.endswith(f"matches uv.lock (sha256 {LOCK[:12]}; /opt/py/bin/uv sync --check)")


def test_a_venv_changed_by_hand_is_named_with_what_changed() -> None:
    lines = ["Would use project environment at: /v", "Would uninstall 1 package", "Would install 1 package",
             "- extra==0.1.0 (from file:///x/extra-0.1.0-py3-none-any.whl)", "+ thdemo==0.1.0 (from file:///w/x)",
             "error: The environment is outdated; run `uv sync` to update the environment"]
    seen = observed_with({"lock_hash": LOCK, "marker": MARKER, "check": {"code": 0}})
    seen.facts["n1"] = NodeFacts(raw={"venv": {"lock_hash": LOCK, "marker": MARKER, "check": {"code": 1, "lines": lines}}},
                                 sent=0.0, received=0.0)
    n0, n1 = venv_check.analyse(seen)
    assert n0.status == "pass" and n1.status == "fail"
    assert n1.summary == ("the venv on n1 differs from uv.lock (changed since it was built): a sync would "
                          "remove extra==0.1.0, install thdemo==0.1.0")
    venv = seen.venvs["n1"]
    assert n1.fix == (f"make it the lock's again on n1: cd /w && UV_PROJECT_ENVIRONMENT={venv.path} "
                      f"/opt/py/bin/uv sync --frozen (or remove {venv.path} there: the next run builds it)")


def test_uv_putting_back_the_same_local_package_is_a_warning_not_a_failure() -> None:
    # What uv says after a path wheel of the project was merely touched on the node (tried).
    lines = ["Would use project environment at: /v", "Would download 1 package", "Would uninstall 1 package",
             "Would install 1 package", "- thdemo==0.1.0 (from file:///w/wheels/thdemo-0.1.0-py3-none-any.whl)",
             "+ thdemo @ file:///w/wheels/thdemo-0.1.0-py3-none-any.whl",
             "error: The environment is outdated; run `uv sync` to update the environment"]
    seen = observed_with({"lock_hash": LOCK, "marker": MARKER, "check": {"code": 1, "lines": lines}})
    result = venv_check.analyse(seen)[0]
    assert result.status == "warn"
    assert result.summary == ("the venv on n0 has the lock's packages, but uv would reinstall thdemo from the "
                              "project's own files (changed on the node, or their timestamps, since it was built)")
    another = [*lines[:4], "- thdemo==0.1.0 (from file:///w/x)", "+ thdemo==0.2.0 (from file:///w/x)"]
    seen = observed_with({"lock_hash": LOCK, "marker": MARKER, "check": {"code": 1, "lines": another}})
    result = venv_check.analyse(seen)[0]
    assert result.status == "fail" and result.summary.endswith("remove thdemo==0.1.0, install thdemo==0.2.0")


def test_a_venv_not_built_yet_is_no_failure_of_the_venv_or_python_check() -> None:
    seen = observed_with({"lock_hash": LOCK, "marker": None}, python_error="No such file or directory")
    assert [result.status for result in venv_check.analyse(seen)] == ["skip", "skip"]
    results = python_check.analyse(seen)
    assert [result.status for result in results] == ["skip", "skip"]
    assert "is not built yet: run builds it (check --sync too)" in results[0].summary


def test_another_lock_on_the_node_fails() -> None:
    results = venv_check.analyse(observed_with({"lock_hash": "ef" * 32, "marker": None}))
    assert results[0].status == "fail"
    assert results[0].summary == "the project on n0 (/w) has another uv.lock or pyproject.toml than this machine's"


def test_without_a_uv_project_the_check_reports_nothing() -> None:
    plan = build_plan(inventory(), options(uv=None))
    assert venv_check.analyse(Observed(inventory=plan.inventory, master_target="n0")) == []


def test_the_venv_notes() -> None:
    done = VenvsDone((VenvReady("n0", "/v", True, 2.04, "/u", shipped=True), VenvReady("n1", "/v", False),
                      VenvFailed("n2", "uv not found (looked for uv)", "install uv on n2")), 2.1)
    assert [text for text, _ in venv_notes(done)] == [
        "n0: had no uv: this machine's sent (/u)",
        "n2: venv not built: uv not found (looked for uv)", "n2: fix: install uv on n2",
        "n0: venv /v built from uv.lock by uv sync --frozen (2.0 s)", "n1: venv /v as uv.lock made it (cached)"]


def test_uv_is_installed_for_the_tests() -> None:
    assert os.access(uv_binary(), os.X_OK)
    assert "venv.py" in source("__init__.py")


# a shared venv_dir: what another user planted there is refused, never used ---------------------


def logging_uv(tmp_path: Path) -> tuple[Path, Path]:
    """A uv that only notes that it ran (a planted wheelhouse must never reach it)."""
    log = tmp_path / "uv-ran"
    uv = tmp_path / "bin" / "uv"
    uv.parent.mkdir()
    uv.write_text(f"#!/bin/sh\necho \"$*\" >> {log}\nexit 1\n")
    uv.chmod(0o755)
    return uv, log


def planted(path: Path, mode: int, other: bool = False) -> Path:
    """``path`` with mode ``mode``, another user's (uid 65534) with ``other``."""
    path.chmod(mode)
    if other:
        os.chown(path, 65534, 65534)
    return path


REMOVE = "refused, another user could have put it there (remove it and run again)"


def test_a_venv_dir_others_can_write_is_refused_in_one_line(tmp_path: Path) -> None:
    """A 1777 /scratch as the venv_dir itself: anyone may put a venv there."""
    uv, log = logging_uv(tmp_path)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    scratch.chmod(0o1777)
    config = {"path": str(scratch / "proj-k1"), "key": "k1", "project": str(tmp_path), "uv": [str(uv)],
              "system_site_packages": False, "env": {}}
    assert build_here(config) == {"error": f"{scratch} cannot hold venvs: it is writable by group or others "
                                           f"(chmod go-w {scratch}) (mode 1777); another user could swap or redirect "
                                           "what is built and run there (use a venv_dir only you can write)"}
    assert not log.exists()
    # its own directory inside: made 0700, and trusted
    config = {**config, "path": str(scratch / "mine" / "proj-k1")}
    assert build_here(config)["error"].startswith("uv sync --frozen failed (exit 1)")
    assert (scratch / "mine").stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("other", [False, True], ids=["group-writable", "another-users"])
def test_a_planted_venv_wheelhouse_or_uv_is_refused_and_never_run(tmp_path: Path, other: bool) -> None:
    if other and os.geteuid() != 0:
        pytest.skip("making a file another user's takes root (the cluster tests plant as another user)")
    uv, log = logging_uv(tmp_path)
    venvs = tmp_path / "venvs"
    venvs.mkdir(mode=0o755)
    config = {"path": str(venvs / "proj-k1"), "key": "k1", "project": str(tmp_path), "uv": [str(uv)],
              "system_site_packages": False, "env": {}}
    why = "not yours (mode 0755)" if other else "writable by group or others (mode 0777)"

    # a venv whose marker holds the key, which was taken as cached
    venv = venvs / "proj-k1"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\necho planted\n")
    (venv / ".torchherd-venv").write_text(json.dumps({"key": "k1"}))
    planted(venv, 0o755 if other else 0o777, other)
    assert build_here(config) == {"error": f"{venv} is {why}: {REMOVE}"}

    # a wheelhouse whose requirements went straight to uv
    house = venvs / "wheelhouse-k1"
    house.mkdir()
    (house / "requirements.txt").write_text("evil==1.0\n")
    planted(house, 0o755 if other else 0o777, other)
    config = {**config, "path": str(venvs / "proj-k2"), "key": "k2", "wheelhouse": str(house)}
    assert build_here(config) == {"error": f"{house} is {why}: {REMOVE}"}
    assert (house / "requirements.txt").read_text() == "evil==1.0\n"  # refused, not removed: not ours

    # a uv "sent" beside the venvs
    shipped = venvs / "uv-0123456789abcdef"
    shutil.copy(uv, shipped)
    planted(shipped, 0o755 if other else 0o777, other)
    config = {**config, "path": str(venvs / "proj-k3"), "key": "k3", "uv": [str(shipped)]}
    config.pop("wheelhouse")
    file_why = why if other else "writable by group or others (mode 0777)"
    assert build_here(config) == {"error": f"{shipped} is {file_why}: {REMOVE}"}
    assert not log.exists()


def test_a_venv_that_is_a_link_is_refused(tmp_path: Path) -> None:
    uv, log = logging_uv(tmp_path)
    venvs = tmp_path / "venvs"
    venvs.mkdir(mode=0o755)
    (tmp_path / "elsewhere").mkdir()
    (venvs / "proj-k1").symlink_to(tmp_path / "elsewhere")
    config = {"path": str(venvs / "proj-k1"), "key": "k1", "project": str(tmp_path), "uv": [str(uv)],
              "system_site_packages": False, "env": {}}
    assert build_here(config) == {"error": f"{venvs / 'proj-k1'} is a symbolic link (mode 0777): {REMOVE}"}
    assert not log.exists()


def test_a_planted_venv_fails_that_node_over_the_transport(tmp_path: Path) -> None:
    """The controller's side (engine.prepare.venvs over the in-process transport): the node's refusal
    is its failed venv, in one line."""
    from torchherd.engine.prepare import venvs as engine
    from torchherd.transport.local import LocalSession

    uv, log = logging_uv(tmp_path)
    inventory = parse({"cluster": {"nproc_per_node": 1},
                       "defaults": {"python": sys.executable, "workdir": str(tmp_path), "uv": str(uv),
                                    "venv_dir": str(tmp_path / "v")},
                       "hosts": [{"name": "n0"}]}, Path("h.toml"))
    plan = build_plan(inventory, RunOptions(script="train.py", run_id="r1", sync=SyncOptions(str(tmp_path)),
                                            uv=UvOptions("ab" * 32)))
    node = plan.nodes[0]
    assert node.venv is not None
    venv = Path(node.venv.path)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / ".torchherd-venv").write_text(json.dumps({"key": node.venv.key}))
    venv.chmod(0o777)
    failed = engine._build(node, LocalSession("n0"))
    assert isinstance(failed, VenvFailed), failed
    assert failed.message == f"{venv} is writable by group or others (mode 0777): {REMOVE}"
    assert not log.exists()
