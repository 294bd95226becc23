"""``--uv-offline``, the controller's side (engine.prepare.offline, engine.prepare.venvs): markers judged for
the nodes, this machine's wheelhouse keyed by lock, platform and python, gathered by hash
from the local wheel directories and downloaded only for what is missing, the one-line
failure with its fix, the flag and the inventory key; and for real (this machine plays two
nodes, each a LocalSession with venvs of its own): the wheelhouse relayed once through the
real chain, both venvs built from it with no index, the wheelhouse gone from the nodes,
then every venv cached and nothing sent."""

from __future__ import annotations

import os
import platform
import stat
import sys
import time
from dataclasses import replace
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from support.uvproject import registry_project, uv_binary, wheel
from torchherd.api import Cluster
from torchherd.cli import main
from torchherd.console import make_console
from torchherd.console.observer import ConsoleObserver
from torchherd.console.sync import SyncPrinter, WheelBars, wheels_note, wheels_started_note
from torchherd.engine.events import (
    VenvFailed,
    VenvReady,
    VenvsDone,
    WheelFetched,
    WheelsDownloading,
    WheelsProgress,
    WheelsRelayed,
    WheelsStarted,
)
from torchherd.engine.prepare import offline, relay, venvs
from torchherd.engine.prepare.offline import WheelhouseError, export_requirements, local_dirs, make_wheelhouse
from torchherd.engine.prepare.uvwheels import NodePlatform
from torchherd.engine.prepare.wheelhouse import (
    applies,
    cache_name,
    looks_offline,
    marker_environment,
    missing,
    node_dir,
    parse_requirements,
    wanted,
)
from torchherd.inventory import parse
from torchherd.plan import RunOptions, SyncOptions, UvOptions, build_plan
from torchherd.remote.checkpoint import combined, file_sha256, find
from torchherd.remote.venv import libc_of
from torchherd.transport.local import LocalProcess, LocalSession

GRACE = NodePlatform("Linux", "aarch64", "glibc", "2.35")
X86 = NodePlatform("Linux", "x86_64", "glibc", "2.31")
LOCK = "ab" * 32


def here() -> NodePlatform:
    libc, version = libc_of(platform.libc_ver())
    return NodePlatform(platform.system(), platform.machine(), libc, version)


PYTHON = "%d.%d.%d" % sys.version_info[:3]


def test_a_marker_is_judged_for_the_nodes_not_for_this_machine() -> None:
    grace = marker_environment(GRACE, "3.11.7")
    assert not applies("platform_machine == 'x86_64' and sys_platform == 'linux'", grace)
    assert applies("platform_machine == 'x86_64' and sys_platform == 'linux'", marker_environment(X86, "3.11.7"))
    assert not applies("sys_platform == 'darwin' or sys_platform == 'win32'", grace)
    assert applies("python_version < '3.12' and (implementation_name != 'pypy')", grace)
    assert not applies("python_version >= '3.12'", grace)
    assert applies("python_full_version >= '3.11.7'", grace) and not applies("'3.11.8' <= python_full_version", grace)
    assert applies("'linux' in sys_platform", grace)
    assert applies("python_full_version ~= '3.11.2'", grace) and not applies("python_full_version ~= '3.12.0'", grace)
    # what cannot be read counts as needed: a wheel too many costs a download, one too few a failed build
    assert applies("platform_version == 'x' and weird ~~ 'y'", grace)
    assert applies("some_unknown_variable == 'z'", grace)
    exported = parse_requirements(f"a==1 \\\n    --hash=sha256:{'a' * 64}\n"
                                  f"nccl==2 ; platform_machine == 'x86_64' \\\n    --hash=sha256:{'c' * 64}\n")
    assert missing(wanted(exported, grace), set()) == ["a==1"]
    assert missing(wanted(exported, marker_environment(X86, "3.11.7")), set()) == ["a==1", "nccl==2"]


def test_the_wheelhouse_is_keyed_by_lock_platform_and_python_and_lands_beside_the_venvs() -> None:
    assert cache_name(LOCK, GRACE, "3.11.7") == f"{LOCK[:16]}-manylinux_2_35_aarch64-3.11"
    assert cache_name(LOCK, GRACE, "3.12.1") != cache_name(LOCK, GRACE, "3.11.7")
    assert cache_name(LOCK, X86, "3.11.7") == f"{LOCK[:16]}-manylinux_2_31_x86_64-3.11"
    assert node_dir("/tmp/work/.torchherd-venvs/0123", "0123") == "/tmp/work/.torchherd-venvs/wheelhouse-0123"
    assert node_dir("~/venvs/proj-0123", "0123") == "~/venvs/wheelhouse-0123"


@pytest.mark.parametrize("said", [
    "error: Failed to fetch: `https://pypi.org/simple/thdemo/`",
    "Caused by: dns error: failed to lookup address information: Name or service not known",
    "error: Could not connect to pypi.org",
    "error: Network connectivity is disabled, but the requested data wasn't found in the cache for: `thdemo`",
])
def test_a_sync_that_reached_no_index_names_the_flag(said: str) -> None:
    plan = build_plan(parse({"cluster": {"nproc_per_node": 1}, "hosts": [{"name": "n0"}]}, Path("h.toml")),
                      RunOptions(script="t.py", run_id="r", sync=SyncOptions("/p"), uv=UvOptions(LOCK)))
    assert looks_offline(said)
    failed = venvs._outcome(plan.nodes[0], {"error": f"uv sync --frozen failed (exit 2): {said}"})
    assert isinstance(failed, VenvFailed)
    assert failed.hint.startswith("n0 reaches no package index: --uv-offline (or [uv] offline = true) sends it")
    other = venvs._outcome(plan.nodes[0], {"error": "uv sync --frozen failed (exit 2): error: No `project` table"})
    assert isinstance(other, VenvFailed) and "--uv-offline" not in other.hint


def fake_pip(directory: Path, copies: Path | None) -> Path:
    """A python whose ``-m pip download`` notes its arguments, then copies ``copies`` into
    ``-d`` (a download that worked) or fails as pip does without an index."""
    script = directory / "python"
    log = directory / "pip-calls"
    action = (f'echo "Collecting {copies.name}"; echo "  Downloading http://user:****@10.0.0.5/p/{copies.name} '
              f'(1.2 kB)"; cp {copies} "$dest"' if copies is not None else
              'echo "ERROR: Could not find a version that satisfies the requirement thdemo==0.1.0" >&2; exit 1')
    script.write_text(f'#!/bin/sh\necho "$*" >> {log}\ndest=""; prev=""\nfor a in "$@"; do\n'
                      f'  [ "$prev" = "-d" ] && dest="$a"; prev="$a"\ndone\n{action}\n')
    script.chmod(0o755)
    return script


@pytest.mark.timeout(120)
def test_the_wheelhouse_takes_the_locks_wheels_by_hash_and_downloads_only_what_is_missing(tmp_path: Path) -> None:
    project, built = registry_project(tmp_path / "proj")
    exported = export_requirements(project, uv_binary())
    root = tmp_path / "houses"
    wheels = tmp_path / "wheels"
    planted = wheel(wheels, "thdemo", value="planted")  # the name and version, not the lock's bytes
    assert planted.read_bytes() != built.read_bytes()
    failing = fake_pip(tmp_path, None)

    with pytest.raises(WheelhouseError) as raised:
        make_wheelhouse(exported, LOCK, here(), PYTHON, str(wheels), root=root, pip_python=str(failing))
    tag, version = here().download_tag(), "%d.%d" % sys.version_info[:2]
    assert str(raised.value) == (
        f"the lock's wheels for {tag} python {version}: thdemo==0.1.0 not in {wheels} and pip download failed "
        "(exit 1): ERROR: Could not find a version that satisfies the requirement thdemo==0.1.0")
    assert raised.value.hint == (f"{failing} -m pip download --no-deps --only-binary=:all: --platform {tag} "
                                 f"--python-version {version} --implementation cp -d {wheels} thdemo==0.1.0")
    called = (tmp_path / "pip-calls").read_text().split()
    assert called[:13] == ["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
                           "--progress-bar", "off", "--platform", tag, "--python-version", version, "--implementation"]
    assert [entry.name for entry in root.iterdir() if not entry.name.startswith(".download")] == []  # nothing left

    # The download path (the only one with an index): pip fetches the missing wheel, and
    # the observer hears of it as pip goes.
    events: list[Any] = []
    fetched = make_wheelhouse(exported, LOCK, here(), PYTHON, str(wheels), root=root,
                              pip_python=str(fake_pip(tmp_path, built)), observer=events.append)
    assert fetched.downloaded == ("thdemo==0.1.0",)
    assert events == [WheelsDownloading(tag, version, ("thdemo==0.1.0",), ", ".join(map(str, local_dirs(str(wheels))))),
                      WheelFetched(built.name, "1.2 kB", False)]
    assert fetched.path == root / cache_name(LOCK, here(), PYTHON)
    assert stat.S_IMODE(fetched.path.stat().st_mode) == 0o700
    assert [name for name, _ in fetched.files] == ["requirements.txt", built.name]
    # what each node checks its copy against: the node program's own hash of that directory
    assert fetched.sha256 == find(str(root), fetched.path.name)["sha256"]

    # Complete by hash now: taken as it is, pip not run.
    calls = (tmp_path / "pip-calls").read_text()
    again = make_wheelhouse(exported, LOCK, here(), PYTHON, str(wheels), root=root, pip_python=str(failing))
    assert again == replace(fetched, downloaded=())
    assert (tmp_path / "pip-calls").read_text() == calls

    # The lock's own wheel in [uv] wheels: gathered from there for another python, no download.
    planted.unlink()
    os.link(built, wheels / built.name)
    other = make_wheelhouse(exported, LOCK, here(), "3.99.0", str(wheels), root=root, pip_python=str(failing))
    assert other.downloaded == () and other.path.name.endswith("-3.99")
    assert (tmp_path / "pip-calls").read_text() == calls


@pytest.mark.parametrize(("document", "message"), [
    ('[uv]\noffline = "yes"\n', "[uv].offline: expected true or false"),
    ("[uv]\nofline = true\n", "[uv]"),
])
def test_a_bad_offline_key_exits_2_with_one_line(tmp_path: Path, document: str, message: str) -> None:
    inventory = tmp_path / "hosts.toml"
    inventory.write_text('[[hosts]]\nname = "n0"\n' + document)
    out = StringIO()
    code = main(["-i", str(inventory), "run", "--dry-run", "--", "train.py"], console=make_console(out, width=300))
    assert code == 2, out.getvalue()
    lines = [line for line in out.getvalue().splitlines() if not line.startswith("  hint:")]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in out.getvalue(), out.getvalue()


@pytest.mark.parametrize(("flags", "message"), [
    (["--uv-offline", "--no-uv"], "error: --uv-offline: not with --no-uv"),
    (["--uv-offline"], "error: --uv-offline: {project} has no uv.lock"),
    (["--uv-offline", "--no-sync"], "error: --uv-offline: the venv is built from the synced project's uv.lock, "
                                    "and nothing is synced"),
])
def test_bad_offline_flags_exit_2_with_one_line(tmp_path: Path, flags: list[str], message: str) -> None:
    project = tmp_path / "proj"
    project.mkdir()
    (project / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    sync = [] if "--no-sync" in flags else ["--sync", str(project)]
    out = StringIO()
    code = main(["run", "-H", "192.0.2.1", "--dry-run", *sync, *flags, "--", "train.py"],
                console=make_console(out, width=300))
    assert code == 2, out.getvalue()
    lines = [line for line in out.getvalue().splitlines() if not line.startswith("  hint:")]
    assert lines == [message.format(project=project)], out.getvalue()


def test_the_inventory_key_and_the_flag_reach_the_plan(tmp_path: Path) -> None:
    project, _ = registry_project(tmp_path / "proj")
    keyed = Cluster.from_toml(_inventory(tmp_path, '[uv]\noffline = true\n'))
    plan = keyed.plan("train.py", sync=project)
    assert plan.options.uv is not None and plan.options.uv.offline
    assert "uv pip sync builds offline from the lock's wheels, sent from this machine" in plan.nodes[0].notes[-1]
    assert keyed.plan("train.py", sync=project, uv_offline=False).options.uv == replace(plan.options.uv,
                                                                                         offline=False)
    plain = Cluster.from_toml(_inventory(tmp_path, ""))
    assert plain.plan("train.py", sync=project).options.uv.offline is False  # type: ignore[union-attr]
    assert plain.plan("train.py", sync=project, uv_offline=True).options.uv.offline  # type: ignore[union-attr]
    assert keyed.plan("train.py", sync=False).options.uv is None  # the key alone: no error without a lock


def _inventory(tmp_path: Path, more: str) -> Path:
    path = tmp_path / f"h{len(more)}.toml"
    path.write_text(f'[[hosts]]\nname = "n0"\naddress = "192.0.2.1"\n{more}')
    return path


def test_the_wheels_note_says_what_this_machine_sent() -> None:
    text, style = wheels_note(WheelsRelayed("manylinux_2_35_aarch64", "3.11", "/c/h", (("n0", "n1"),), 2, 2_500_000,
                                            2_500_000, ("torch==2.5.1",), 1.25))
    assert text == ("wheels: uv.lock's 2 files for manylinux_2_35_aarch64 python 3.11 (2.5 MB, 1 downloaded now; "
                    "/c/h) relayed node to node: this machine -> n0 -> n1: on 2 of 2 nodes (1.2 s; 2.5 MB sent from "
                    "this machine)") and style == "dim"


def test_the_download_before_the_relay_says_what_pip_fetches_as_it_goes() -> None:
    out = StringIO()
    observer = ConsoleObserver(Console(file=out, width=400))
    names = tuple(f"pkg{index}==1.0" for index in range(7))
    observer(WheelsDownloading("manylinux_2_35_aarch64", "3.11", names, "/srv/wheels, /root/.cache/pip/wheels"))
    observer(WheelFetched("torch-2.5.1-cp311-cp311-manylinux_2_17_aarch64.whl", "90.6 MB", False))
    observer(WheelFetched("pkg1-1.0-py3-none-any.whl", "", True))
    observer(WheelFetched("\x1b[2Jevil.whl", "1 kB", False))
    printed = StringIO()  # check --sync prints the same, beside its own grid
    printer = SyncPrinter(Console(file=printed, width=400))
    printer(WheelsDownloading("manylinux_2_35_aarch64", "3.11", names[:1], "/srv/wheels"))
    printer(WheelFetched("pkg0-1.0-py3-none-any.whl", "3 kB", False))
    assert printed.getvalue() == (
        "wheels: downloading 1 wheel of uv.lock for manylinux_2_35_aarch64 python 3.11 with pip, in none of "
        "/srv/wheels: pkg0==1.0\nwheels: pip: downloading pkg0-1.0-py3-none-any.whl (3 kB)\n")
    assert out.getvalue() == (
        "torchherd: wheels: downloading 7 wheels of uv.lock for manylinux_2_35_aarch64 python 3.11 with pip, in none "
        "of /srv/wheels, /root/.cache/pip/wheels: pkg0==1.0, pkg1==1.0, pkg2==1.0, pkg3==1.0, pkg4==1.0 and 2 more\n"
        "torchherd: wheels: pip: downloading torch-2.5.1-cp311-cp311-manylinux_2_17_aarch64.whl (90.6 MB)\n"
        "torchherd: wheels: pip: from pip's cache pkg1-1.0-py3-none-any.whl\n"
        "torchherd: wheels: pip: downloading \\x1b[2Jevil.whl (1 kB)\n")


def test_the_wheels_bars_one_per_node_between_the_start_and_the_summary_exactly() -> None:
    """Off a terminal (a log, a pipe) the bars are printed once, in their last state, between
    the note that starts the copy and the summary that ends it."""
    out = StringIO()
    observer = ConsoleObserver(Console(file=out, width=120))
    total = 2_500_000
    observer(WheelsStarted("manylinux_2_35_aarch64", "3.11", "/c/h", (("n0", "n10"), ("n2",)), 2, total))
    assert observer.wheel_bars.bars.progress is not None  # shown while the wheels travel
    observer(WheelsProgress("n0", 1_000_000, total))
    observer(WheelsProgress("n10", total, total))
    observer(WheelsRelayed("manylinux_2_35_aarch64", "3.11", "/c/h", (("n0", "n10"), ("n2",)), 2, total, 2 * total,
                           ("torch==2.5.1",), 1.25, (("n2", "no answer"),)))
    assert observer.wheel_bars.bars.progress is None  # the summary closed them
    assert out.getvalue() == (
        "torchherd: wheels: sending uv.lock's 2 files for manylinux_2_35_aarch64 python 3.11 (2.5 MB; /c/h) once per "
        "chain (2 chains), relayed node to node: this machine -> n0 -> n10, then this machine -> n2\n"
        "  n0  ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━ 2.5 MB / 2.5 MB verified\n"
        "  n10 ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━ 2.5 MB / 2.5 MB verified\n"
        "  n2                                 0 B / 2.5 MB    failed  \n"
        "torchherd: wheels: uv.lock's 2 files for manylinux_2_35_aarch64 python 3.11 (2.5 MB, 1 downloaded now; /c/h) "
        "relayed node to node: this machine -> n0 -> n10, then this machine -> n2: on 2 of 3 nodes (1.2 s; 5.0 MB sent from "
        "this machine); "
        "n2: no answer\n")


def test_the_wheels_bars_move_as_the_nodes_receive() -> None:
    """A bar says "receiving" with the bytes so far, "received" once all are in (the node
    checks the hash then); one chain's start note says "once"."""
    bars = WheelBars(Console(file=StringIO(), width=120))
    started = WheelsStarted("musllinux_1_2_x86_64", "3.12", "/c/h", (("node0", "node1"),), 3, 8_000_000)
    assert wheels_started_note(started) == (
        "wheels: sending uv.lock's 3 files for musllinux_1_2_x86_64 python 3.12 (8.0 MB; /c/h) once, relayed node to "
        "node: this machine -> node0 -> node1", "bold")
    bars(started)
    bars(WheelsProgress("node0", 3_000_000, 8_000_000))
    bars(WheelsProgress("node1", 8_000_000, 8_000_000))
    assert bars.bars.progress is not None
    shown = {task.description.strip(): (task.completed, task.fields["amount"], task.fields["state"])
             for task in bars.bars.progress.tasks}
    assert shown == {"node0": (3_000_000, "3.0 MB / 8.0 MB", "receiving"),
                     "node1": (8_000_000, "8.0 MB / 8.0 MB", "received")}
    bars.close()


# for real: this machine plays two nodes -------------------------------------------------


@pytest.mark.timeout(240)
def test_two_nodes_without_an_index_build_from_one_relayed_wheelhouse_then_cost_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not platform.libc_ver()[0]:
        pytest.skip("this machine has no glibc")
    project, built = registry_project(tmp_path / "proj")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    built.rename(wheels / built.name)
    monkeypatch.setattr(offline, "WHEELHOUSES", tmp_path / "houses")
    env = {"UV_OFFLINE": "1", "UV_CACHE_DIR": str(tmp_path / "uv-cache"), "UV_NO_INDEX": "1"}
    inventory = parse({"cluster": {"nproc_per_node": 1}, "uv": {"wheels": str(wheels)},
                       "defaults": {"python": sys.executable, "workdir": str(tmp_path), "uv": uv_binary(),
                                    "env": env},
                       "hosts": [{"name": "n0", "address": "127.0.0.1", "venv_dir": str(tmp_path / "v0")},
                                 {"name": "n1", "address": "127.0.0.1", "venv_dir": str(tmp_path / "v1")}]}, Path("h.toml"))
    plan = build_plan(inventory, RunOptions(script="train.py", run_id="r1", sync=SyncOptions(str(project)),
                                            uv=UvOptions(LOCK, offline=True)))
    plan = replace(plan, nodes=tuple(replace(node, venv=replace(node.venv, project=str(project)))  # type: ignore[arg-type]
                                     for node in plan.nodes))
    events: list[Any] = []
    sessions = {"n0": LocalSession("n0"), "n1": LocalSession("n1")}

    done = venvs.build_venvs(plan, sessions, events.append)
    assert done.ok, done
    relayed = [event for event in events if isinstance(event, WheelsRelayed)]
    assert len(relayed) == 1, events
    house = tmp_path / "houses" / cache_name(LOCK, here(), PYTHON)
    once = sum(path.stat().st_size for path in house.iterdir())
    assert relayed[0].nodes == ("n0", "n1") and relayed[0].failed == () and relayed[0].downloaded == ()
    assert relayed[0].sent == relayed[0].size == once  # sent once: n1's copy came from n0
    [started] = [event for event in events if isinstance(event, WheelsStarted)]
    assert (started.chains, started.size, started.files) == ((("n0", "n1"),), once, relayed[0].files)
    moved = [event for event in events if isinstance(event, WheelsProgress)]
    for name in ("n0", "n1"):  # a copy this short still brings each node's bar to the total
        assert [(event.done, event.total) for event in moved if event.node == name][-1] == (once, once), moved
    kinds = [type(event) for event in events]
    assert kinds.index(WheelsStarted) < kinds.index(WheelsProgress) and \
        max(index for index, kind in enumerate(kinds) if kind is WheelsProgress) < kinds.index(WheelsRelayed)
    for node in plan.nodes:
        assert node.venv is not None
        ready = [result for result in done.nodes if result.node == node.host.name][0]
        assert isinstance(ready, VenvReady) and ready.built and ready.offline
        value = os.popen(f"{node.venv.python_path} -c 'import thdemo; print(thdemo.VALUE)'").read()
        assert value == "from the wheelhouse\n"
        assert not Path(node_dir(node.venv.path, node.venv.key)).exists()  # removed once built

    events.clear()
    again = venvs.build_venvs(plan, sessions, events.append)
    assert [type(event) for event in events] == [VenvsDone]  # nothing made, nothing relayed
    assert all(isinstance(result, VenvReady) and not result.built for result in again.nodes)


@pytest.mark.timeout(120)
def test_a_copy_that_reaches_no_node_fails_their_venvs_in_one_line_each(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    project, built = registry_project(tmp_path / "proj")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    built.rename(wheels / built.name)
    monkeypatch.setattr(offline, "WHEELHOUSES", tmp_path / "houses")
    # n0 (the chain's first) listens for n1 at an address that is not this machine's: the chain cannot start
    inventory = parse({"cluster": {"nproc_per_node": 1}, "uv": {"wheels": str(wheels)},
                       "defaults": {"python": sys.executable, "workdir": str(tmp_path), "uv": uv_binary(),
                                    "env": {"UV_OFFLINE": "1", "UV_CACHE_DIR": str(tmp_path / "uv-cache")}},
                       "hosts": [{"name": "n0", "address": "192.0.2.1", "venv_dir": str(tmp_path / "v0")},
                                 {"name": "n1", "address": "127.0.0.1", "venv_dir": str(tmp_path / "v1")}]},
                      Path("h.toml"))
    plan = build_plan(inventory, RunOptions(script="train.py", run_id="r1", sync=SyncOptions(str(project)),
                                            uv=UvOptions(LOCK, offline=True)))
    plan = replace(plan, nodes=tuple(replace(node, venv=replace(node.venv, project=str(project)))  # type: ignore[arg-type]
                                     for node in plan.nodes))
    events: list[Any] = []
    done = venvs.build_venvs(plan, {"n0": LocalSession("n0"), "n1": LocalSession("n1")}, events.append)
    assert not done.ok
    [relayed] = [event for event in events if isinstance(event, WheelsRelayed)]
    assert [node for node, _ in relayed.failed] == ["n0", "n1"] and relayed.sent == 0
    assert wheels_note(relayed)[1] == "bold red"
    for failed in done.nodes:
        assert isinstance(failed, VenvFailed)
        assert failed.message.startswith(f"the lock's wheels did not reach {failed.node}: the copy from node to node "
                                         "could not start on n0: "), failed
        assert "\n" not in failed.message


@pytest.mark.timeout(120)
def test_each_node_says_how_far_it_is_while_the_wheelhouse_travels(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The real chain, this machine -> n0 -> n1, with this machine's feed held back (64 kB
    blocks, 40 ms apart: about 2.6 s for 4 MB), so that each node says how far it is
    several times (every 0.5 s): byte counts that rise to the wheelhouse's size."""
    house_dir = tmp_path / "house"
    house_dir.mkdir()
    listed = []
    for name, length in (("a-1.0-py3-none-any.whl", 3_000_000), ("b-1.0-py3-none-any.whl", 1_194_304),
                         ("requirements.txt", 100)):
        (house_dir / name).write_bytes(os.urandom(length))
        listed.append((name, length, file_sha256(str(house_dir / name))))
    house = offline.Wheelhouse(house_dir, tuple((name, length) for name, length, _ in listed), combined("dir", listed))
    inventory = parse({"cluster": {"nproc_per_node": 1},
                       "defaults": {"python": sys.executable, "workdir": str(tmp_path)},
                       "hosts": [{"name": "n0", "address": "127.0.0.1", "venv_dir": str(tmp_path / "v0")},
                                 {"name": "n1", "address": "127.0.0.1", "venv_dir": str(tmp_path / "v1")}]},
                      Path("h.toml"))
    plan = build_plan(inventory, RunOptions(script="train.py", run_id="r1", sync=SyncOptions(str(tmp_path)),
                                            uv=UvOptions(LOCK, offline=True)))
    targets = []
    for node in plan.nodes:
        assert node.venv is not None
        Path(node.venv.path).parent.mkdir(parents=True, exist_ok=True)
        targets.append((node, node_dir(node.venv.path, node.venv.key)))
    sent_at_once = LocalProcess.send

    def held_back(self: LocalProcess, data: bytes) -> bool:
        time.sleep(0.04)
        return sent_at_once(self, data)

    monkeypatch.setattr(relay, "FEED_CHUNK", 1 << 16)
    monkeypatch.setattr(LocalProcess, "send", held_back)
    events: list[Any] = []
    results, sent = offline.relay_wheelhouse(house, targets, {"n0": LocalSession("n0"), "n1": LocalSession("n1")},
                                             observer=events.append)
    assert results == {"n0": None, "n1": None} and sent == house.size
    for node, target in targets:
        done = [event.done for event in events if event.node == node.host.name]
        assert len(done) >= 3, events  # while it travels, not only at the end
        assert done == sorted(set(done)) and done[-1] == house.size, done  # rising, to the total
        assert {event.total for event in events if event.node == node.host.name} == {house.size}
        assert (Path(target) / "a-1.0-py3-none-any.whl").read_bytes() == (house_dir / "a-1.0-py3-none-any.whl").read_bytes()
    assert all(isinstance(event, WheelsProgress) for event in events)


def test_the_relay_runs_with_the_nodes_python_as_written_a_home_path_expanded_by_the_node(tmp_path: Path) -> None:
    inventory = parse({"cluster": {"nproc_per_node": 1},
                       "defaults": {"python": "~/my env/bin/python", "workdir": "~/proj"},
                       "hosts": [{"name": "n0", "address": "127.0.0.1"}]}, Path("h.toml"))
    plan = build_plan(inventory, RunOptions(script="train.py", run_id="r1", sync=SyncOptions(str(tmp_path)),
                                            uv=UvOptions(LOCK, offline=True)))
    program = offline.relay_program(plan.nodes[0], "~/proj/.torchherd-venvs", "wheelhouse-k1")
    assert program.startswith("~/'my env/bin/python' ")  # the node's shell expands ~, the space stays quoted
    assert program.endswith(" relay '~/proj/.torchherd-venvs' wheelhouse-k1")  # checkpoint.py expands it itself
