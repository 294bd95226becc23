"""``--uv-offline`` with a package project (`torchherd docs environments`, "Nodes without
internet"): ``uv sync`` installs such a project editable, built by its backend, and so does
the offline build. The pure parts (which project is a package, the build system's key in the
wheelhouse's name, the wheels that fit, the node's command line), the backend's download
for the node's platform (a fake pip: no index in the tests), and for real: two nodes (this
machine, as LocalSessions) build from one relayed wheelhouse that holds setuptools, the
ranks import the project's own package from the venv, the venv check finds it in sync, an
edit of the sources needs no reinstall, and a second build costs nothing."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version

from support.uvproject import backend_wheels, package_project, registry_project, uv_binary, wheel
from torchherd.console.sync import wheels_download_note
from torchherd.engine.events import VenvReady, VenvsDone, WheelFetched, WheelsDownloading, WheelsRelayed
from torchherd.engine.prepare import offline, venvs
from torchherd.engine.prepare.offline import (
    build_wheels,
    export_requirements,
    gather_build,
    make_wheelhouse,
    project_build,
)
from torchherd.engine.prepare.uvwheels import NodePlatform
from torchherd.engine.prepare.wheelhouse import (
    LEGACY_BACKEND,
    REQUIREMENTS,
    BuildSystem,
    build_download_argv,
    build_system,
    cache_name,
    fitting_wheel,
    marker_environment,
    node_dir,
    requires_dist,
)
from torchherd.inventory import parse
from torchherd.plan import RunOptions, SyncOptions, UvOptions, build_plan
from torchherd.remote import argv
from torchherd.remote.venv import editable_argv, libc_of
from torchherd.transport.local import LocalSession

GRACE = NodePlatform("Linux", "aarch64", "glibc", "2.35")
LOCK = "cd" * 32
PYTHON = "%d.%d.%d" % sys.version_info[:3]
SETUPTOOLS = BuildSystem(("setuptools>=61",), "setuptools.build_meta")


def here() -> NodePlatform:
    libc, version = libc_of(platform.libc_ver())
    return NodePlatform(platform.system(), platform.machine(), libc, version)


@pytest.mark.parametrize(("pyproject", "expected"), [
    ({"project": {"name": "a"}}, None),  # no [build-system]: uv sync installs its dependencies only
    ({"build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"}},
     BuildSystem(("hatchling",), "hatchling.build")),
    ({"build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"},
      "tool": {"uv": {"package": False}}}, None),
    ({"tool": {"uv": {"package": True}}}, BuildSystem(("setuptools>=40.8.0",), LEGACY_BACKEND)),
    ({"build-system": {"requires": ["setuptools"]}}, BuildSystem(("setuptools",), LEGACY_BACKEND)),
    ({"build-system": {"requires": [], "build-backend": "backend", "backend-path": ["_build"]}},
     BuildSystem((), "backend", ("_build",))),
])
def test_the_project_is_a_package_exactly_when_uv_sync_installs_it(pyproject: dict[str, Any],
                                                                   expected: BuildSystem | None) -> None:
    assert build_system(pyproject) == expected


def test_the_wheelhouse_is_named_by_the_build_system_too() -> None:
    plain = cache_name(LOCK, GRACE, "3.11.7")
    assert plain == f"{LOCK[:16]}-manylinux_2_35_aarch64-3.11"  # a project that is no package: as before
    named = cache_name(LOCK, GRACE, "3.11.7", SETUPTOOLS)
    assert named == f"{plain}-b{SETUPTOOLS.key}" and len(SETUPTOOLS.key) == 8
    assert cache_name(LOCK, GRACE, "3.11.7", replace(SETUPTOOLS, requires=("setuptools>=70",))) != named
    assert cache_name(LOCK, GRACE, "3.11.7", replace(SETUPTOOLS, backend="setuptools.build_meta:__legacy__")) != named


def test_only_wheels_for_any_platform_and_the_nodes_python_are_taken_from_local_directories() -> None:
    assert fitting_wheel("setuptools-65.5.0-py3-none-any.whl", "3.11.7") == ("setuptools", Version("65.5.0"))
    assert fitting_wheel("Flit_Core-3.9.0-py2.py3-none-any.whl", "3.11.7") == ("flit-core", Version("3.9.0"))
    assert fitting_wheel("x-1.0-cp311-none-any.whl", "3.11.7") is not None
    assert fitting_wheel("x-1.0-cp312-none-any.whl", "3.11.7") is None
    assert fitting_wheel("maturin-1.7.0-py3-none-manylinux_2_17_x86_64.whl", "3.11.7") is None
    assert fitting_wheel("requirements.txt", "3.11.7") is None
    metadata = ("Metadata-Version: 2.1\nName: wheel\nRequires-Dist: packaging>=24.0\n"
                "Requires-Dist: pytest>=6; extra == 'test'\nRequires-Dist: tomli; python_version < '3.11'\n"
                "Requires-Dist: pywin32; sys_platform == 'win32'\n\nbody\n")
    assert requires_dist(metadata, marker_environment(GRACE, "3.11.7")) == ["packaging>=24.0"]
    assert requires_dist(metadata, marker_environment(GRACE, "3.10.2")) == ["packaging>=24.0",
                                                                            'tomli; python_version < "3.11"']


def test_the_node_installs_the_project_editable_without_its_dependencies_and_without_an_index() -> None:
    assert editable_argv("/u/uv", "/v/wheelhouse-k/build", "/w/my proj", "/v/k/bin/python") == [
        "/u/uv", "pip", "install", "--offline", "--no-index", "--find-links", "/v/wheelhouse-k/build", "--no-deps",
        "--editable", "/w/my proj", "--python", "/v/k/bin/python"]
    assert build_download_argv("/py", ["setuptools>=61", "wheel"], "/d", GRACE, "3.11.7") == [
        "/py", "-m", "pip", "download", "--only-binary=:all:", "--progress-bar", "off", "--platform",
        "manylinux_2_35_aarch64", "--python-version", "3.11", "--implementation", "cp", "-d", "/d",
        "setuptools>=61", "wheel"]


def test_a_backends_dependencies_are_gathered_with_it_read_from_its_wheel(tmp_path: Path) -> None:
    local = tmp_path / "local"
    wheel(local, "backend", "1.0")
    wheel(local, "backend", "2.0")
    wheel(local, "helper", "0.5")
    newest = local / "backend-2.0-py3-none-any.whl"
    # backend 2.0 depends on helper: its METADATA says so
    with zipfile.ZipFile(newest) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    members["backend-2.0.dist-info/METADATA"] += b"Requires-Dist: helper>=0.5\nRequires-Dist: nope; sys_platform == 'win32'\n"
    newest.unlink()
    with zipfile.ZipFile(newest, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    into = tmp_path / "into"
    into.mkdir()
    gather_build(["backend>=1"], [local], into, marker_environment(here(), PYTHON))
    assert sorted(path.name for path in into.iterdir()) == ["backend-2.0-py3-none-any.whl", "helper-0.5-py3-none-any.whl"]
    again = tmp_path / "again"
    again.mkdir()
    gather_build(["backend<2"], [local], again, marker_environment(here(), PYTHON))
    assert sorted(path.name for path in again.iterdir()) == ["backend-1.0-py3-none-any.whl"]


def fake_pip(directory: Path, source: Path | None) -> Path:
    """A python whose ``-m pip download`` notes its arguments, then copies from ``source``
    into ``-d`` the wheel of the one requirement named last, and those of its dependencies
    (``wheel`` needs ``packaging``): a download that worked; or fails as pip does without an index."""
    script = directory / "python"
    action = ('name=$(echo "$a" | sed "s/[<>=].*//"); [ "$name" = wheel ] && name="wheel packaging"\n'
              f'for n in $name; do for f in {source}/$n-*.whl; do echo "  Downloading $(basename $f) (1 kB)"; '
              'cp "$f" "$dest"; done; done'
              if source is not None else
              'echo "ERROR: Could not find a version that satisfies the requirement setuptools>=61" >&2; exit 1')
    script.write_text(f'#!/bin/sh\necho "$*" >> {directory}/pip-calls\ndest=""; prev=""\nfor a in "$@"; do\n'
                      f'  [ "$prev" = "-d" ] && dest="$a"; prev="$a"\ndone\n{action}\n')
    script.chmod(0o755)
    return script


@pytest.mark.timeout(180)
def test_a_backend_missing_here_is_downloaded_for_the_node_with_its_dependencies(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    remote = tmp_path / "index"
    if not backend_wheels(remote):
        pytest.skip("pip reaches no index for wheel (the backend setuptools asks for)")
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    project, _ = package_project(tmp_path / "proj")
    build = project_build(project)
    assert build == SETUPTOOLS
    failing = fake_pip(tmp_path, None)
    with pytest.raises(offline.WheelhouseError) as raised:
        build_wheels(SETUPTOOLS, project, here(), PYTHON, [tmp_path / "empty"], tmp_path / "b0", str(tmp_path / "w"),
                     pip_python=str(failing), uv=uv_binary())
    tag = here().download_tag()
    assert str(raised.value).startswith(f"the project's build backend for {tag} python {PYTHON[:4]}: setuptools>=61 "
                                        f"not in {tmp_path / 'w'} and pip download failed (exit 1): ERROR: ")
    assert raised.value.hint == (f"{failing} -m pip download --only-binary=:all: --progress-bar off --platform {tag} "
                                 f"--python-version {PYTHON[:4]} --implementation cp -d {tmp_path / 'w'} "
                                 "'setuptools>=61'")
    (tmp_path / "pip-calls").unlink()

    events: list[Any] = []
    fetched = build_wheels(SETUPTOOLS, project, here(), PYTHON, [tmp_path / "made", tmp_path / "empty"],
                           tmp_path / "b1", None,
                           pip_python=str(fake_pip(tmp_path, remote)), uv=uv_binary(), observer=events.append)
    # setuptools first; then what this setuptools asks for an editable build (wheel), in its own download
    assert fetched == ("setuptools>=61", "wheel")
    calls = (tmp_path / "pip-calls").read_text().splitlines()
    assert [call.split()[-1] for call in calls] == ["setuptools>=61", "wheel"]
    assert all("--no-deps" not in call and "--only-binary=:all:" in call and f"--platform {tag}" in call
               for call in calls)
    assert [type(event) for event in events][:2] == [WheelsDownloading, WheelFetched]
    assert wheels_download_note(events[0]) == (
        f"wheels: downloading the project's build backend, with its dependencies, for {tag} python {PYTHON[:4]} with "
        f"pip, in none of {tmp_path / 'empty'}: setuptools>=61", "")
    held = sorted(path.name for path in (tmp_path / "b1").iterdir())
    assert "requires.txt" in held and any(name.startswith("setuptools-") for name in held)
    assert (tmp_path / "b1" / "requires.txt").read_text() == (
        "# build-backend = setuptools.build_meta\nsetuptools>=61\nwheel  # asked by the backend\n")

    # the same wheels in a local directory: nothing downloaded
    (tmp_path / "pip-calls").unlink()
    local = build_wheels(SETUPTOOLS, project, here(), PYTHON, [remote], tmp_path / "b2", None,
                         pip_python=str(failing), uv=uv_binary())
    assert local == () and not (tmp_path / "pip-calls").exists()
    assert sorted(path.name for path in (tmp_path / "b2").iterdir()) == sorted(
        [path.name for path in remote.glob("*.whl")] + ["requires.txt"])


@pytest.mark.timeout(300)
def test_two_nodes_without_an_index_install_the_package_project_editable_then_cost_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not platform.libc_ver()[0]:
        pytest.skip("this machine has no glibc")
    wheels = tmp_path / "wheels"
    if not backend_wheels(wheels):
        pytest.skip("pip reaches no index for wheel (the backend setuptools asks for)")
    project, built = package_project(tmp_path / "proj")
    built.rename(wheels / built.name)
    monkeypatch.setattr(offline, "WHEELHOUSES", tmp_path / "houses")
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache-here"))
    env = {"UV_OFFLINE": "1", "UV_CACHE_DIR": str(tmp_path / "uv-cache"), "UV_NO_INDEX": "1"}
    inventory = parse({"cluster": {"nproc_per_node": 1}, "uv": {"wheels": str(wheels)},
                       "defaults": {"python": sys.executable, "workdir": str(tmp_path), "uv": uv_binary(),
                                    "env": env},
                       "hosts": [{"name": "n0", "address": "127.0.0.1", "venv_dir": str(tmp_path / "v0")},
                                 {"name": "n1", "address": "127.0.0.1", "venv_dir": str(tmp_path / "v1")}]},
                      Path("h.toml"))
    plan = build_plan(inventory, RunOptions(script="train.py", run_id="r1", sync=SyncOptions(str(project)),
                                            uv=UvOptions(LOCK, offline=True)))
    # each node its own copy of the project, as --sync leaves it
    copies = {name: tmp_path / name / "proj" for name in ("n0", "n1")}
    for copy in copies.values():
        shutil.copytree(project, copy)
    plan = replace(plan, nodes=tuple(replace(node, venv=replace(node.venv, project=str(copies[node.host.name])))  # type: ignore[arg-type]
                                     for node in plan.nodes))
    events: list[Any] = []
    sessions = {"n0": LocalSession("n0"), "n1": LocalSession("n1")}

    done = venvs.build_venvs(plan, sessions, events.append)
    assert done.ok, done
    [relayed] = [event for event in events if isinstance(event, WheelsRelayed)]
    assert relayed.failed == () and relayed.downloaded == ()
    house = tmp_path / "houses" / cache_name(LOCK, here(), PYTHON, SETUPTOOLS)
    assert any(path.name.startswith("setuptools-") for path in (house / "build").iterdir())
    assert relayed.sent == sum(path.stat().st_size for path in house.rglob("*") if path.is_file())
    for node in plan.nodes:
        assert node.venv is not None
        copy = copies[node.host.name]
        ready = [result for result in done.nodes if result.node == node.host.name][0]
        assert isinstance(ready, VenvReady) and ready.built and ready.offline
        said = subprocess.run([node.venv.python_path, "-c", "import mypkg; print(mypkg.VALUE, mypkg.DEP, mypkg.__file__)"],
                              cwd=tmp_path, capture_output=True, text=True, check=False)
        assert said.stdout == f"mine from the wheelhouse {copy / 'src' / 'mypkg' / '__init__.py'}\n", said.stderr
        # the venv check's own command: the project is installed as uv sync installs it
        check = subprocess.run([uv_binary(), "sync", "--frozen", "--offline", "--check", "--python", sys.executable],
                               cwd=copy, env={**os.environ, **env, "UV_PROJECT_ENVIRONMENT": node.venv.path},
                               capture_output=True, text=True, check=False)
        assert check.returncode == 0, check.stdout + check.stderr
        assert not Path(node_dir(node.venv.path, node.venv.key)).exists()  # removed once built

    # editable: an edit of the sources is what the ranks import, nothing reinstalled
    (copies["n0"] / "src" / "mypkg" / "__init__.py").write_text("VALUE = 'edited'\nDEP = ''\n")
    events.clear()
    again = venvs.build_venvs(plan, sessions, events.append)
    assert [type(event) for event in events] == [VenvsDone]  # nothing made, nothing relayed
    assert all(isinstance(result, VenvReady) and not result.built for result in again.nodes)
    n0 = plan.nodes[0].venv
    assert n0 is not None
    assert os.popen(f"{n0.python_path} -c 'import mypkg; print(mypkg.VALUE)'").read() == "edited\n"


def test_a_project_that_is_no_package_gets_no_build_directory(tmp_path: Path) -> None:
    project, built = registry_project(tmp_path / "proj")
    assert project_build(project) is None
    house = make_wheelhouse(export_requirements(project, uv_binary()), LOCK, here(), PYTHON, str(built.parent),
                            root=tmp_path / "houses", build=project_build(project), project=project)
    assert [name for name, _ in house.files] == ["requirements.txt", built.name]
    assert house.path.name == cache_name(LOCK, here(), PYTHON)


@pytest.mark.timeout(120)
def test_a_backend_the_node_cannot_build_with_fails_its_venv_in_one_line_unmarked(tmp_path: Path) -> None:
    project, built = package_project(tmp_path / "proj")
    house = tmp_path / "house"
    (house / "build").mkdir(parents=True)
    (house / REQUIREMENTS).write_text(export_requirements(project, uv_binary()))
    shutil.copyfile(built, house / built.name)
    (house / "build" / "requires.txt").write_text("setuptools>=61\n")  # and no wheel of it
    venv = tmp_path / "venv"
    config = {"path": str(venv), "key": "k1", "project": str(project), "uv": [uv_binary()],
              "system_site_packages": False, "env": {"UV_CACHE_DIR": str(tmp_path / "node-cache"), "UV_OFFLINE": "1"},
              "wheelhouse": str(house)}
    done = subprocess.run([sys.executable, *argv("venv.py")], input=json.dumps(config) + "\n", capture_output=True,
                          text=True, check=False, timeout=120)
    answer = json.loads(done.stdout)
    assert answer["error"].startswith(f"uv pip install --editable {project} with the build backend from "
                                      f"{house / 'build'} failed (exit 1): "), answer
    assert "setuptools" in answer["error"] and "\n" not in answer["error"]
    assert not (venv / ".torchherd-venv").exists() and not house.exists()  # not marked built; the wheelhouse gone
    plan = build_plan(parse({"cluster": {"nproc_per_node": 1}, "hosts": [{"name": "n0"}]}, Path("h.toml")),
                      RunOptions(script="t.py", run_id="r", sync=SyncOptions("/p"), uv=UvOptions(LOCK, offline=True)))
    failed = venvs._outcome(plan.nodes[0], answer, offline=True)
    assert not isinstance(failed, VenvReady)
    assert failed.hint.startswith("the project's build backend was sent in the wheelhouse (build/requires.txt there "
                                  "names it), from [uv] wheels")
