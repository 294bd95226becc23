"""The lock's wheels for nodes without an index (engine.prepare.wheelhouse, remote/venv.py with a
``wheelhouse``): the requirements ``uv export`` writes, what is missing by hash, pip's
download for a node platform, one download per platform; and for real, offline, with the
real uv: a lock whose package comes from PyPI, which ``uv sync --frozen --offline
--find-links`` cannot install from a local wheel and the wheelhouse build can, the
``venv`` check's own ``uv sync --check`` then finding it in sync."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from support.uvproject import registry_project, uv_binary, wheel
from torchherd.engine.prepare.uvwheels import NodePlatform
from torchherd.engine.prepare.wheelhouse import (
    REQUIREMENTS,
    Requirement,
    dir_hashes,
    download_argv,
    export_argv,
    missing,
    parse_requirements,
    pip_fetching,
    platforms,
)
from torchherd.remote import argv

EXPORTED = """\
numpy==2.1.3 \\
    --hash=sha256:{a} \\
    --hash=sha256:{b}
    # via demo
nvidia-nccl-cu12==2.21.5 ; platform_machine == 'x86_64' and sys_platform == 'linux' \\
    --hash=sha256:{c}
    # via torch
Torch[opt-einsum]==2.5.1 \\
    --hash=sha256:{d}
./wheels/thdemo-0.1.0-py3-none-any.whl
""".format(a="a" * 64, b="b" * 64, c="c" * 64, d="d" * 64)

GRACE = NodePlatform("Linux", "aarch64", "glibc", "2.35")
X86 = NodePlatform("Linux", "x86_64", "glibc", "2.31")


def test_uv_exports_requirements_that_are_read_with_their_hashes() -> None:
    assert parse_requirements(EXPORTED) == [
        Requirement("numpy", "2.1.3", ("a" * 64, "b" * 64)),
        Requirement("nvidia-nccl-cu12", "2.21.5", ("c" * 64,),
                    marker="platform_machine == 'x86_64' and sys_platform == 'linux'"),
        Requirement("torch", "2.5.1", ("d" * 64,)),
        Requirement("", "", (), direct="./wheels/thdemo-0.1.0-py3-none-any.whl"),
    ]
    assert export_argv("uv") == ["uv", "export", "--frozen", "--format", "requirements-txt", "--no-emit-project",
                                 "--no-header"]


def test_what_is_missing_is_judged_by_hash_not_by_name() -> None:
    wanted = parse_requirements(EXPORTED)
    assert missing(wanted, set()) == ["numpy==2.1.3", "nvidia-nccl-cu12==2.21.5", "torch==2.5.1"]
    assert missing(wanted, {"b" * 64, "c" * 64, "d" * 64}) == []  # either of numpy's hashes
    assert missing(wanted, {"e" * 64, "c" * 64, "d" * 64}) == ["numpy==2.1.3"]  # a wheel of another build


def test_pip_downloads_exactly_the_locks_files_for_the_nodes_platform() -> None:
    assert download_argv("python3", "/c/req.txt", "/c/wh", GRACE, "3.11.7") == [
        "python3", "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
        "--progress-bar", "off", "--platform", "manylinux_2_35_aarch64", "--python-version", "3.11", "--implementation", "cp",
        "-r", "/c/req.txt", "-d", "/c/wh"]


@pytest.mark.parametrize(("line", "fetching"), [
    # pip 23's own lines (pip/_internal/network/download.py): PyPI's files by name, other
    # indexes by URL (their credentials redacted by pip, and left out here with the host)
    ("  Downloading torch-2.5.1-cp311-cp311-manylinux_2_17_aarch64.whl (90.6 MB)\n",
     ("torch-2.5.1-cp311-cp311-manylinux_2_17_aarch64.whl", "90.6 MB", False)),
    ("  Downloading https://user:****@pkgs.example/simple/numpy/numpy-2.1.3-cp311-cp311-manylinux_2_17_aarch64.whl"
     "#sha256=abc (14.0 MB)", ("numpy-2.1.3-cp311-cp311-manylinux_2_17_aarch64.whl", "14.0 MB", False)),
    ("  Using cached nvidia_nccl_cu12-2.21.5-py3-none-manylinux2014_x86_64.whl (188.7 MB)",
     ("nvidia_nccl_cu12-2.21.5-py3-none-manylinux2014_x86_64.whl", "188.7 MB", True)),
    ("Downloading http://10.0.0.5:8080/thdemo-0.1.0-py3-none-any.whl", ("thdemo-0.1.0-py3-none-any.whl", "", False)),
    ("Collecting torch==2.5.1 (from -r /c/req.txt (line 3))", None),
    ("Saved ./torch-2.5.1-cp311-cp311-manylinux_2_17_aarch64.whl", None),
    ("Successfully downloaded torch", None),
])
def test_the_files_pip_begins_are_read_from_its_output(line: str, fetching: tuple[str, str, bool] | None) -> None:
    assert pip_fetching(line) == fetching


def test_one_download_per_platform_and_python_whatever_the_number_of_nodes() -> None:
    nodes = [(f"gpu{index}", GRACE, "3.11.7") for index in range(16)] + [("login", X86, "3.11.2"),
                                                                         ("old", X86, "3.10.12")]
    assert platforms(nodes) == {("manylinux_2_35_aarch64", "3.11"): [f"gpu{index}" for index in range(16)],
                                ("manylinux_2_31_x86_64", "3.11"): ["login"],
                                ("manylinux_2_31_x86_64", "3.10"): ["old"]}


# for real, offline ---------------------------------------------------------------------


def build_here(config: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, *argv("venv.py")], input=(json.dumps(config) + "\n").encode(),
                          capture_output=True, check=True, timeout=120)
    return json.loads(done.stdout)  # type: ignore[no-any-return]


@pytest.mark.timeout(180)
def test_a_node_without_an_index_builds_the_locks_venv_from_the_wheelhouse(tmp_path: Path) -> None:
    project, built = registry_project(tmp_path / "proj")
    env = {**os.environ, "UV_CACHE_DIR": str(tmp_path / "cache"), "UV_OFFLINE": "1"}
    # This machine: the lock exported with its hashes; the wheelhouse complete by hash.
    exported = subprocess.run(export_argv(uv_binary()), cwd=project, env=env, capture_output=True, text=True,
                              check=True).stdout
    house = tmp_path / "house"
    house.mkdir()
    (house / REQUIREMENTS).write_text(exported)
    assert missing(parse_requirements(exported), dir_hashes(house)) == ["thdemo==0.1.0"]
    (house / built.name).write_bytes(built.read_bytes())
    assert missing(parse_requirements(exported), dir_hashes(house)) == []

    # Why not uv sync: with the lock's PyPI URL, --find-links does not help it offline.
    venv = tmp_path / "venv"
    tried = subprocess.run([uv_binary(), "sync", "--frozen", "--offline", "--find-links", str(house)], cwd=project,
                           env={**env, "UV_PROJECT_ENVIRONMENT": str(tmp_path / "tried")}, capture_output=True,
                           text=True)
    assert tried.returncode != 0 and "files.pythonhosted.org" in tried.stderr, tried.stderr

    # The node: the venv from the wheelhouse's files alone, as the lock says.
    config = {"path": str(venv), "key": "k1", "project": str(project), "uv": [uv_binary()],
              "system_site_packages": False, "env": {"UV_CACHE_DIR": str(tmp_path / "node-cache"),
                                                     "UV_OFFLINE": "1"}, "wheelhouse": str(house)}
    answer = build_here(config)
    assert answer.get("built") is True, answer
    shown = subprocess.run([str(venv / "bin" / "python"), "-c", "import thdemo; print(thdemo.VALUE)"],
                           capture_output=True, text=True, check=True).stdout
    assert shown == "from the wheelhouse\n"
    checked = subprocess.run([uv_binary(), "sync", "--frozen", "--offline", "--check"], cwd=project,
                             env={**env, "UV_PROJECT_ENVIRONMENT": str(venv)}, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr  # the venv check finds it as the lock made it
    assert build_here(config) == {"cached": True}


@pytest.mark.timeout(180)
def test_a_wheel_whose_hash_is_not_the_locks_is_refused(tmp_path: Path) -> None:
    project, built = registry_project(tmp_path / "proj")
    env = {**os.environ, "UV_CACHE_DIR": str(tmp_path / "cache"), "UV_OFFLINE": "1"}
    exported = subprocess.run(export_argv(uv_binary()), cwd=project, env=env, capture_output=True, text=True,
                              check=True).stdout
    house = tmp_path / "house"
    other = wheel(house, "thdemo", value="planted")  # same name and version, other bytes
    (house / REQUIREMENTS).write_text(exported)
    assert other.name == built.name
    assert missing(parse_requirements(exported), dir_hashes(house)) == ["thdemo==0.1.0"]
    answer = build_here({"path": str(tmp_path / "venv"), "key": "k1", "project": str(project), "uv": [uv_binary()],
                         "system_site_packages": False, "env": {"UV_CACHE_DIR": str(tmp_path / "node-cache")},
                         "wheelhouse": str(house)})
    assert answer["error"].startswith(f"uv pip sync from {house} failed"), answer
    assert "hash" in answer["error"].lower(), answer
    assert not (tmp_path / "venv" / ".torchherd-venv").exists()
