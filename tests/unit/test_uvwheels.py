"""uv for a node of another platform (engine.prepare.uvwheels): the wheel that fits the node's
machine and libc, picked among uv's real wheel names; its binary taken out; the one-line
fix when none is at hand; and, for real, a node without uv that gets the binary of a
wheel (this machine's own uv, packed as the wheel for this machine's tag) and builds its
venv with it. No network: every wheel is made here."""

from __future__ import annotations

import os
import platform
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from support.uvproject import locked_project, uv_binary
from torchherd.console.sync import venv_notes
from torchherd.engine.events import VenvFailed, VenvReady, VenvsDone
from torchherd.engine.prepare import venvs
from torchherd.engine.prepare.uvwheels import (
    NodePlatform,
    WheelError,
    extract_uv,
    find_wheel,
    missing_wheel,
    parse_wheel,
    tag_fits,
    wheel_dirs,
)
from torchherd.errors import InventoryError
from torchherd.inventory import parse
from torchherd.plan import RunOptions, SyncOptions, UvOptions, build_plan
from torchherd.remote.venv import libc_of
from torchherd.transport.local import LocalSession

# uv 0.5.4's wheels on PyPI, as named there (and an older release's, and its sdist)
RELEASED = [
    "uv-0.5.4-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
    "uv-0.5.4-py3-none-manylinux_2_17_aarch64.manylinux2014_aarch64.whl",
    "uv-0.5.4-py3-none-manylinux_2_17_armv7l.manylinux2014_armv7l.whl",
    "uv-0.5.4-py3-none-manylinux_2_17_i686.manylinux2014_i686.whl",
    "uv-0.5.4-py3-none-manylinux_2_17_ppc64le.manylinux2014_ppc64le.whl",
    "uv-0.5.4-py3-none-manylinux_2_17_s390x.manylinux2014_s390x.whl",
    "uv-0.5.4-py3-none-musllinux_1_1_x86_64.whl",
    "uv-0.5.4-py3-none-musllinux_1_1_aarch64.whl",
    "uv-0.5.4-py3-none-musllinux_1_1_armv7l.whl",
    "uv-0.5.4-py3-none-macosx_11_0_arm64.whl",
    "uv-0.5.4-py3-none-macosx_10_12_x86_64.whl",
    "uv-0.5.4-py3-none-win_amd64.whl",
    "uv-0.4.30-py3-none-manylinux_2_17_aarch64.manylinux2014_aarch64.whl",
    "uv-0.4.30-py3-none-manylinux_2_28_aarch64.whl",
    "uv-0.5.4.tar.gz",
    "ruff-0.8.0-py3-none-manylinux_2_17_aarch64.manylinux2014_aarch64.whl",
]

GRACE = NodePlatform("Linux", "aarch64", "glibc", "2.35")
ALPINE = NodePlatform("Linux", "x86_64", "musl", "1.2.4")
CENTOS6 = NodePlatform("Linux", "x86_64", "glibc", "2.12")
POWER = NodePlatform("Linux", "ppc64le", "glibc", "2.28")


def released(directory: Path, names: list[str] = RELEASED) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / name).write_bytes(b"")
    return directory


def test_tags_fit_by_machine_libc_and_its_version() -> None:
    assert tag_fits("manylinux_2_17_aarch64", GRACE) == (2, 17)
    assert tag_fits("manylinux2014_aarch64", GRACE) == (2, 17)
    assert tag_fits("manylinux_2_28_aarch64", GRACE) == (2, 28)
    assert tag_fits("manylinux_2_39_aarch64", GRACE) is None  # newer glibc than the node's
    assert tag_fits("manylinux_2_17_x86_64", GRACE) is None  # another machine
    assert tag_fits("musllinux_1_1_aarch64", GRACE) is None  # another libc
    assert tag_fits("musllinux_1_1_x86_64", ALPINE) == (1, 1)
    assert tag_fits("manylinux_2_17_x86_64", ALPINE) is None
    assert tag_fits("manylinux_2_17_x86_64", CENTOS6) is None
    assert tag_fits("manylinux2010_x86_64", CENTOS6) == (2, 12)
    assert tag_fits("macosx_11_0_arm64", NodePlatform("Darwin", "arm64", "", "")) is None  # nodes are Linux
    assert tag_fits("manylinux_2_17_x86_64", NodePlatform("Linux", "x86_64", "glibc", "")) is None  # unknown glibc
    assert tag_fits("musllinux_1_1_x86_64", NodePlatform("Linux", "x86_64", "musl", "")) == (1, 1)


def test_the_newest_wheel_for_the_nodes_platform_is_picked(tmp_path: Path) -> None:
    found = find_wheel([released(tmp_path / "w")], GRACE)
    assert found is not None and found.path.name == RELEASED[1] and found.version == (0, 5, 4)
    assert find_wheel([tmp_path / "w"], ALPINE).path.name == RELEASED[6]  # type: ignore[union-attr]
    assert find_wheel([tmp_path / "w"], POWER).path.name == RELEASED[4]  # type: ignore[union-attr]
    assert find_wheel([tmp_path / "w"], CENTOS6) is None
    assert find_wheel([tmp_path / "w"], NodePlatform("Linux", "riscv64", "glibc", "2.39")) is None
    assert parse_wheel(tmp_path / "w" / RELEASED[-1], GRACE) is None  # not uv
    old = released(tmp_path / "old", [RELEASED[12], RELEASED[13]])
    assert find_wheel([old], GRACE).path.name == RELEASED[13]  # type: ignore[union-attr]  # the more specific
    assert find_wheel([tmp_path / "missing"], GRACE) is None


def test_pips_cache_is_searched_at_any_depth_the_wheel_dir_at_its_top(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_CACHE_DIR", str(tmp_path / "pip"))
    released(tmp_path / "pip" / "wheels" / "ab" / "cd", [RELEASED[1]])
    released(tmp_path / "mine" / "sub", [RELEASED[6]])
    dirs = wheel_dirs(str(tmp_path / "mine"))
    assert dirs == [tmp_path / "mine", tmp_path / "pip" / "wheels"]
    assert find_wheel(dirs, GRACE) is not None
    assert find_wheel(dirs, ALPINE) is None  # below the wheel dir's top: not looked at


def uv_wheel(directory: Path, name: str, binary: bytes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    version = name.split("-")[1]
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"uv-{version}.dist-info/METADATA", f"Metadata-Version: 2.3\nName: uv\nVersion: {version}\n")
        archive.writestr(zipfile.ZipInfo(f"uv-{version}.data/scripts/uv"), binary)
        archive.writestr(f"uv-{version}.data/scripts/uvx", b"\x7fELF uvx")
    return path


def test_the_binary_is_taken_out_once_under_its_hash(tmp_path: Path) -> None:
    wheel = uv_wheel(tmp_path / "w", RELEASED[1], b"\x7fELF aarch64 uv")
    path, digest = extract_uv(wheel, tmp_path / "out")
    assert path.read_bytes() == b"\x7fELF aarch64 uv" and path.name == f"uv-{digest[:16]}"
    assert path.stat().st_mode & 0o777 == 0o700
    assert extract_uv(wheel, tmp_path / "out") == (path, digest)
    assert [item.name for item in (tmp_path / "out").iterdir()] == [path.name]  # no partial file left


def test_a_wheel_without_a_linux_uv_is_refused(tmp_path: Path) -> None:
    with pytest.raises(WheelError, match="not a Linux binary"):
        extract_uv(uv_wheel(tmp_path, RELEASED[9], b"\xcf\xfa\xed\xfe mach-o"), tmp_path / "out")
    empty = tmp_path / "uv-0.5.4-py3-none-manylinux_2_17_x86_64.whl"
    with zipfile.ZipFile(empty, "w") as archive:
        archive.writestr("uv-0.5.4.dist-info/METADATA", "Name: uv\n")
    with pytest.raises(WheelError, match="holds no uv binary"):
        extract_uv(empty, tmp_path / "out")
    (tmp_path / "broken.whl").write_bytes(b"not a zip")
    with pytest.raises(WheelError, match="not a readable wheel"):
        extract_uv(tmp_path / "broken.whl", tmp_path / "out")


def test_the_fix_names_the_node_its_platform_and_the_download() -> None:
    assert missing_wheel("gpu7", GRACE, "/srv/wheels") == (
        "gpu7 is Linux aarch64 glibc 2.35 and no uv wheel for it is in /srv/wheels or pip's cache: pip download uv "
        "--no-deps --only-binary=:all: --platform manylinux_2_35_aarch64 -d /srv/wheels")
    assert missing_wheel("alp", ALPINE, None) == (
        "alp is Linux x86_64 musl 1.2.4 and no uv wheel for it is in ~/.cache/torchherd/wheels or pip's cache: "
        "pip download uv --no-deps --only-binary=:all: --platform musllinux_1_1_x86_64 -d ~/.cache/torchherd/wheels "
        "and set [uv] wheels = \"~/.cache/torchherd/wheels\" or leave it there (the default)")
    assert "\n" not in missing_wheel("n", NodePlatform("Linux", "x86_64", "", ""), None)


def test_the_node_reports_glibc_or_musl() -> None:
    assert libc_of(("glibc", "2.36")) == ("glibc", "2.36")
    found = libc_of(("", ""))  # this machine: glibc, so no musl loader is there to find
    assert found == (("musl", found[1]) if list(Path("/lib").glob("ld-musl-*.so.1")) else ("", ""))


def test_the_uv_table_names_a_directory_here(tmp_path: Path) -> None:
    document = {"hosts": [{"name": "n0"}], "uv": {"wheels": str(tmp_path)}}
    assert parse(document, Path("h.toml")).uv.wheels == str(tmp_path)
    with pytest.raises(InventoryError, match=r"^h\.toml: \[uv\]\.wheels: /nonexistent is not a directory"):
        parse({**document, "uv": {"wheels": "/nonexistent"}}, Path("h.toml"))
    with pytest.raises(InventoryError, match=r"\[uv\]\.wheel: unknown key"):
        parse({**document, "uv": {"wheel": str(tmp_path)}}, Path("h.toml"))


# for real: a node without uv gets the binary of the wheel for its platform ----------------------


def this_machines_tag() -> str:
    libc, version = platform.libc_ver()
    major, minor = version.split(".")[:2]
    return f"manylinux_{major}_{minor}_{platform.machine()}"


@pytest.mark.timeout(180)
def test_a_node_without_uv_builds_its_venv_with_the_uv_of_the_wheel_for_its_platform(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine plays the node (LocalSession) and a controller with no uv binary of
    its own (a laptop of another platform): the wheel, named by this machine's real tag
    and holding the real uv, is the only uv there is."""
    if not platform.libc_ver()[0]:
        pytest.skip("this machine has no glibc")
    project = locked_project(tmp_path / "proj")
    wheels = tmp_path / "wheels"
    uv_wheel(wheels, f"uv-9.9.9-py3-none-{this_machines_tag()}.whl", Path(uv_binary()).read_bytes())
    monkeypatch.setattr(venvs, "local_uv", lambda: None)
    monkeypatch.setattr(venvs, "EXTRACTED", tmp_path / "extracted")
    inventory = parse({"cluster": {"nproc_per_node": 1}, "uv": {"wheels": str(wheels)},
                       "defaults": {"python": sys.executable, "workdir": str(tmp_path), "venv_dir": str(tmp_path / "v"),
                                    "env": {"UV_OFFLINE": "1", "PATH": "/nonexistent"}},
                       "hosts": [{"name": "n0"}]}, Path("h.toml"))
    plan = build_plan(inventory, RunOptions(script="train.py", run_id="r1", sync=SyncOptions(str(project)),
                                            uv=UvOptions("ab" * 32)))
    node = plan.nodes[0]
    assert node.venv is not None
    node = replace(node, venv=replace(node.venv, project=str(project), uv=("/nowhere/uv",)))
    (tmp_path / "v").mkdir()
    result = venvs._build(node, LocalSession("n0"), inventory.uv.wheels)
    assert isinstance(result, VenvReady), result
    assert result.shipped and result.built and result.uv.startswith(str(tmp_path / "v" / "uv-"))
    assert result.wheel == f"uv-9.9.9-py3-none-{this_machines_tag()}.whl"
    (note, _), = [line for line in venv_notes(VenvsDone((result,), 1.0)) if "had no uv" in line[0]]
    assert note == f"n0: had no uv: the one of {result.wheel} sent ({result.uv})"
    assert Path(result.uv).read_bytes() == Path(uv_binary()).read_bytes()
    assert os.access(Path(node.venv.path) / "bin" / "python", os.X_OK)

    # no wheel for the node's platform: one line, naming it and the fix
    for wheel in wheels.iterdir():
        wheel.rename(wheels / wheel.name.replace(platform.machine(), "s390x" if platform.machine() != "s390x"
                                                 else "x86_64"))
    other = replace(node, venv=replace(node.venv, path=str(tmp_path / "v" / "other"), key="k2"))
    failed = venvs._build(other, LocalSession("n0"), str(wheels))
    assert isinstance(failed, VenvFailed)
    assert failed.hint.startswith(f"n0 is Linux {platform.machine()} glibc {platform.libc_ver()[1]} and no uv "
                                  f"wheel for it is in {wheels} or pip's cache: pip download uv --no-deps "
                                  f"--only-binary=:all: --platform {this_machines_tag()} -d {wheels}; or install uv")
    assert "\n" not in failed.hint


def test_an_extracted_uv_is_reused_by_its_hash_not_its_name(tmp_path: Path) -> None:
    """A file left under the extracted binary's name (changed since, or planted) is replaced
    by the wheel's binary, never sent to the nodes as it is; the directory is private."""
    wheel = uv_wheel(tmp_path, RELEASED[0], b"\x7fELF the real uv")
    path, digest = extract_uv(wheel, tmp_path / "out")
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o700
    path.write_bytes(b"\x7fELF something else")
    assert extract_uv(wheel, tmp_path / "out") == (path, digest)
    assert path.read_bytes() == b"\x7fELF the real uv" and path.stat().st_mode & 0o777 == 0o700
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere")
    assert extract_uv(wheel, tmp_path / "out") == (path, digest)
    assert not path.is_symlink() and path.read_bytes() == b"\x7fELF the real uv"
    assert sorted(item.name for item in (tmp_path / "out").iterdir()) == [path.name]
