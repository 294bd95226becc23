"""--sync on the local transport: every "node" is this machine with a HOME of its own
(``LocalConnector(env=...)``), running the real receiver script."""

from __future__ import annotations

import json
import marshal
import os
import stat
import sys
from pathlib import Path

import pytest

from torchherd.engine.events import Collector, NodeSynced, SyncDone, SyncFailed, SyncStarted
from torchherd.engine.prepare.sync import _Node, frame, sync_nodes
from torchherd.errors import UsageError
from torchherd.inventory import parse
from torchherd.plan import Plan, RunOptions, SyncOptions, build_plan
from torchherd.remote.receive import LARGE, MANIFEST
from torchherd.transport.local import LocalConnector, LocalSession

NODES = ("a", "b")


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "proj"
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("print('train')\n")
    (root / "pkg" / "model.py").write_text("W = 1\n")
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / "big.bin").write_bytes(os.urandom(LARGE + 123))
    os.symlink("train.py", root / "main.py")
    return root


def homes(tmp_path: Path) -> dict[str, Path]:
    made = {name: tmp_path / f"home-{name}" for name in NODES}
    for home in made.values():
        home.mkdir(exist_ok=True)
    return made


def plan_for(project: Path, workdir: str = "~/work", dest: str | None = None,
             exclude: tuple[str, ...] = ()) -> Plan:
    inventory = parse({"defaults": {"python": sys.executable, "workdir": workdir},
                       "hosts": [{"name": name} for name in NODES]}, Path("hosts.toml"))
    return build_plan(inventory, RunOptions(script="train.py", run_id="r1",
                                            sync=SyncOptions(str(project), dest, exclude)))


def sync(tmp_path: Path, plan: Plan, dry_run: bool = False, log_dir: Path | None = None) -> tuple[SyncDone, Collector]:
    connector = LocalConnector(env={name: {"HOME": str(home)} for name, home in homes(tmp_path).items()})
    sessions: dict[str, LocalSession] = {host.name: connector.connect(host) for host in plan.inventory.hosts}
    collector = Collector()
    try:
        done = sync_nodes(plan, sessions, collector, dry_run=dry_run, log_dir=log_dir)
    finally:
        for session in sessions.values():
            session.close()
    return done, collector


def node_tree(root: Path) -> dict[str, bytes | str]:
    found: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        relative = str(path.relative_to(root))
        if path.is_symlink():
            found[relative] = "-> " + os.readlink(path)
        elif path.is_file() and path.name != MANIFEST:
            found[relative] = path.read_bytes()
    return found


def synced(done: SyncDone) -> dict[str, NodeSynced]:
    assert done.ok, done.failed
    return {node.node: node for node in done.nodes if isinstance(node, NodeSynced)}


def test_first_sync_makes_every_node_identical_and_private(tmp_path: Path, project: Path) -> None:
    done, collector = sync(tmp_path, plan_for(project))
    expected = node_tree(project)
    for name, home in homes(tmp_path).items():
        work = home / "work"
        assert node_tree(work) == expected
        assert stat.S_IMODE((work / "train.py").stat().st_mode) == 0o600
        assert stat.S_IMODE((work / "run.sh").stat().st_mode) == 0o700
        assert stat.S_IMODE((work / MANIFEST).stat().st_mode) == 0o600
        result = synced(done)[name]
        assert result.dest == str(work)
        assert set(result.sent) == {"big.bin", "main.py", "pkg/model.py", "run.sh", "train.py"}
        assert result.sent_bytes == sum(len(content) for content in expected.values() if isinstance(content, bytes))
    started = collector.of(SyncStarted)[0]
    assert isinstance(started, SyncStarted) and started.files == 5 and started.nodes == NODES
    assert collector.events[-1] == done


def test_nothing_changed_sends_nothing_and_one_edit_sends_that_file(tmp_path: Path, project: Path) -> None:
    plan = plan_for(project)
    sync(tmp_path, plan)
    again, _ = sync(tmp_path, plan)
    assert {node: (result.sent, result.sent_bytes) for node, result in synced(again).items()} == {
        "a": ((), 0), "b": ((), 0)}
    (project / "pkg" / "model.py").write_text("W = 22\n")
    edited, _ = sync(tmp_path, plan)
    assert {node: (result.sent, result.sent_bytes) for node, result in synced(edited).items()} == {
        "a": (("pkg/model.py",), 7), "b": (("pkg/model.py",), 7)}
    assert (homes(tmp_path)["a"] / "work" / "pkg" / "model.py").read_text() == "W = 22\n"


def test_vanished_files_are_deleted_and_nothing_else(tmp_path: Path, project: Path) -> None:
    plan = plan_for(project)
    sync(tmp_path, plan)
    work = homes(tmp_path)["a"] / "work"
    (work / "outputs").mkdir()
    (work / "outputs" / "ckpt.pt").write_bytes(b"job output")
    (project / "pkg" / "model.py").unlink()
    (project / "pkg").rmdir()
    done, _ = sync(tmp_path, plan)
    assert synced(done)["a"].deleted == ("pkg/model.py",)
    assert not (work / "pkg").exists()
    assert (work / "outputs" / "ckpt.pt").read_bytes() == b"job output"


def test_a_file_changed_on_the_node_is_sent_again(tmp_path: Path, project: Path) -> None:
    plan = plan_for(project)
    sync(tmp_path, plan)
    work = homes(tmp_path)["b"] / "work"
    (work / "train.py").write_text("print('tampered')\n")  # same size or not, the manifest no longer vouches
    with (work / "big.bin").open("r+b") as file:
        file.write(b"X")
    done, _ = sync(tmp_path, plan)
    assert synced(done)["a"].sent == ()
    assert synced(done)["b"].sent == ("big.bin", "train.py")
    assert node_tree(work) == node_tree(project)


def test_a_small_file_already_there_is_compared_by_hash_not_sent(tmp_path: Path, project: Path) -> None:
    work = homes(tmp_path)["a"] / "work"
    (work / "pkg").mkdir(parents=True)
    (work / "pkg" / "model.py").write_text("W = 1\n")
    (work / "pkg" / "model.py").chmod(0o600)
    done, _ = sync(tmp_path, plan_for(project))
    assert "pkg/model.py" not in synced(done)["a"].sent
    assert "pkg/model.py" in synced(done)["b"].sent
    manifest = marshal.loads((work / MANIFEST).read_bytes())["files"]
    assert "pkg/model.py" in manifest


def test_exclude_and_dest(tmp_path: Path, project: Path) -> None:
    done, _ = sync(tmp_path, plan_for(project, dest="code", exclude=("*.bin",)))
    work = homes(tmp_path)["a"] / "work" / "code"
    assert synced(done)["a"].dest == str(work)
    assert "big.bin" not in node_tree(work) and "train.py" in node_tree(work)


def test_private_material_and_the_logs_never_reach_a_node_and_the_console_says_so(
        tmp_path: Path, project: Path) -> None:
    from torchherd.console.sync import sync_notes

    for path in (".ssh/id_ed25519", ".env", "torchherd-logs/r0/a.log", "out/r1/a.log", "deploy.pem"):
        (project / path).parent.mkdir(parents=True, exist_ok=True)
        (project / path).write_text("private")
    done, collector = sync(tmp_path, plan_for(project), log_dir=project / "out")
    for home in homes(tmp_path).values():
        assert sorted(node_tree(home / "work")) == ["big.bin", "main.py", "pkg/model.py", "run.sh", "train.py"]
        assert sorted(path.name for path in (home / "work").iterdir()) == [
            MANIFEST, "big.bin", "main.py", "pkg", "run.sh", "train.py"]
    started = collector.of(SyncStarted)[0]
    assert isinstance(started, SyncStarted) and started.private == (".env", ".ssh/", "deploy.pem")
    assert done.private == started.private
    assert ("sync: left out as private: .env, .ssh/, deploy.pem (--sync-include PATTERN sends it)", ""
            ) in list(sync_notes(started))
    plan = build_plan(plan_for(project).inventory, RunOptions(
        script="train.py", run_id="r1", sync=SyncOptions(str(project), include=(".env",))))
    sync(tmp_path, plan)
    assert (homes(tmp_path)["a"] / "work" / ".env").read_text() == "private"


def test_dry_run_lists_per_node_and_writes_nothing(tmp_path: Path, project: Path) -> None:
    done, _ = sync(tmp_path, plan_for(project), dry_run=True)
    assert done.dry_run and done.ok
    assert synced(done)["a"].sent == ("big.bin", "main.py", "pkg/model.py", "run.sh", "train.py")
    assert not (homes(tmp_path)["a"] / "work").exists()


def test_a_destination_outside_the_workdir_or_the_home_itself_is_refused(tmp_path: Path, project: Path) -> None:
    with pytest.raises(UsageError, match="outside the workdir"):
        plan_for(project, workdir="/srv/work", dest="/srv/other")
    with pytest.raises(UsageError, match="home directory itself"):
        plan_for(project, dest="~")
    # What the controller cannot see (the workdir is the home, given as an absolute path) the node refuses.
    outside = tmp_path / "elsewhere"
    done, _ = sync(tmp_path, plan_for(project, workdir="~", dest=str(outside)))
    assert not done.ok
    assert all(isinstance(node, SyncFailed) and "outside the workdir" in node.message for node in done.nodes)
    assert not outside.exists()
    home_a = homes(tmp_path)["a"]
    done, _ = sync(tmp_path, plan_for(project, workdir=str(home_a)))
    failed = {node.node: node for node in done.failed}
    assert "home directory itself" in failed["a"].message


def test_the_default_destination_in_a_home_workdir_is_the_project_name(tmp_path: Path, project: Path) -> None:
    plan = plan_for(project, workdir="~")
    assert {node.workdir for node in plan.nodes} == {"~/proj"}
    assert any("the workdir is the home directory" in note for note in plan.nodes[0].notes)
    done, _ = sync(tmp_path, plan)
    assert node_tree(homes(tmp_path)["b"] / "proj") == node_tree(project)


def test_a_symlinked_directory_on_the_node_is_never_written_through(tmp_path: Path, project: Path) -> None:
    work = homes(tmp_path)["a"] / "work"
    work.mkdir(parents=True)
    target = tmp_path / "victim"
    target.mkdir()
    os.symlink(target, work / "pkg")
    done, _ = sync(tmp_path, plan_for(project))
    failed = {node.node: node for node in done.failed}
    assert "pkg is a symbolic link on the node" in failed["a"].message
    assert list(target.iterdir()) == []
    assert isinstance(done.nodes[1], NodeSynced)


def test_a_workdir_others_can_write_is_refused_and_nothing_is_written(tmp_path: Path, project: Path) -> None:
    # Another user who made the workdir (or any directory on the way to it) writable
    # could swap a synced file or plant a symbolic link in its place: refused, as
    # OpenSSH's StrictModes refuses such a home.
    home_a = homes(tmp_path)["a"]
    (home_a / "work").mkdir()
    (home_a / "work").chmod(0o777)
    victim = tmp_path / "victim-bin"
    victim.mkdir()
    os.symlink(victim, home_a / "work" / "proj")  # "a symlink planted in its place"
    done, _ = sync(tmp_path, plan_for(project, dest="proj"))
    failed = {node.node: node for node in done.failed}
    assert set(failed) == {"a"}
    assert f"{home_a / 'work'} cannot hold a sync: it is writable by group or others (chmod go-w" \
        in failed["a"].message
    assert list(victim.iterdir()) == []
    # A directory above the workdir that others can write is refused as well.
    (home_a / "work").chmod(0o700)
    home_a.chmod(0o757)
    done, _ = sync(tmp_path, plan_for(project, dest="proj"))
    assert f"{home_a} cannot hold a sync" in done.failed[0].message
    assert list(victim.iterdir()) == []
    # The destination's own subdirectories too: a file synced into one could be swapped.
    home_a.chmod(0o700)
    os.unlink(home_a / "work" / "proj")
    (home_a / "work" / "proj" / "pkg").mkdir(parents=True)
    (home_a / "work" / "proj" / "pkg").chmod(0o775)
    done, _ = sync(tmp_path, plan_for(project, dest="proj"))
    assert "pkg cannot hold a sync: it is writable by group or others" in done.failed[0].message
    assert not (home_a / "work" / "proj" / "pkg" / "model.py").exists()


def test_a_symbolic_link_the_user_made_is_followed_within_the_workdir(tmp_path: Path, project: Path) -> None:
    # A link in a directory only the user can write is the user's own: followed (a
    # workdir on another disk), and still held to the workdir.
    home_a = homes(tmp_path)["a"]
    (home_a / "work" / "real").mkdir(parents=True)
    os.symlink("real", home_a / "work" / "proj")
    done, _ = sync(tmp_path, plan_for(project, dest="proj"))
    assert synced(done)["a"].dest == str(home_a / "work" / "real")
    assert node_tree(home_a / "work" / "real") == node_tree(project)
    os.unlink(home_a / "work" / "proj")
    os.symlink(tmp_path / "elsewhere", home_a / "work" / "proj")
    done, _ = sync(tmp_path, plan_for(project, dest="proj"))
    assert "outside the workdir" in done.failed[0].message and not (tmp_path / "elsewhere").exists()


def test_a_file_swapped_with_the_same_size_and_mtime_is_sent_again(tmp_path: Path, project: Path) -> None:
    plan = plan_for(project)
    sync(tmp_path, plan)
    work = homes(tmp_path)["b"] / "work"
    for name in ("train.py", "big.bin"):  # a small file and one the manifest alone vouched for
        before = (work / name).stat()
        data = (work / name).read_bytes()
        (work / name).write_bytes(bytes([data[0] ^ 1]) + data[1:])
        os.utime(work / name, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert (work / name).stat().st_size == before.st_size
    done, _ = sync(tmp_path, plan)
    assert synced(done)["b"].sent == ("big.bin", "train.py")
    assert node_tree(work) == node_tree(project)
    # Touched but not changed (a chmod back and forth): its content vouches, nothing travels.
    (work / "big.bin").chmod(0o644)
    (work / "big.bin").chmod(0o600)
    done, _ = sync(tmp_path, plan)
    assert synced(done)["b"].sent == () and synced(done)["b"].unchanged == 5


def test_the_temporary_manifest_is_never_opened_through_a_planted_link(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from torchherd.remote import receive

    root = tmp_path / "dest"
    root.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    # The name a pid gave it once, and (had it been guessed) the random one itself.
    os.symlink(victim, root / f".{MANIFEST}.{os.getpid()}")
    receive.write_manifest(str(root), {})
    assert victim.read_text() == "precious\n"
    monkeypatch.setattr(receive, "TOKEN", "guessed")
    os.symlink(victim, root / f".{MANIFEST}.guessed")
    with pytest.raises(FileExistsError):
        receive.write_manifest(str(root), {})
    assert victim.read_text() == "precious\n"
    assert marshal.loads((root / MANIFEST).read_bytes()) == {"version": 2, "files": {}}


@pytest.mark.parametrize("files", [
    {1: ["0" * 64, 6, 1, 6, 1]},  # a key that is not a path (what crashed every later sync)
    {"train.py": ["0" * 64, 6, 1, 6, 1, 1, 1], 2: ["0" * 64, 6, 1, 6, 1, 1, 1]},
    {"train.py": ["0" * 64, 6, 1, 6, 1]},  # a line of version 1
    {"train.py": ["0" * 64, "6", 1, 6, 1, 1, 1]},
    {"train.py": None},
    [],
])
def test_a_damaged_manifest_is_no_manifest(tmp_path: Path, project: Path, files: object) -> None:
    plan = plan_for(project)
    sync(tmp_path, plan)
    work = homes(tmp_path)["a"] / "work"
    (work / MANIFEST).write_bytes(marshal.dumps({"version": 2, "files": files}))
    (work / "train.py").write_text("print('train!')\n")  # not as the manifest had it: found by hashing again
    done, _ = sync(tmp_path, plan)
    assert synced(done)["a"].sent == ("big.bin", "main.py", "train.py")  # vouched for by nothing now
    assert node_tree(work) == node_tree(project)
    again, _ = sync(tmp_path, plan)
    assert synced(again)["a"].sent == ()


def test_a_node_without_the_python_fails_alone(tmp_path: Path, project: Path) -> None:
    inventory = parse({"defaults": {"workdir": "~/work", "python": sys.executable},
                       "hosts": [{"name": "a"}, {"name": "b", "python": "/nonexistent/python"}]}, Path("h.toml"))
    plan = build_plan(inventory, RunOptions(script="train.py", sync=SyncOptions(str(project))))
    done, _ = sync(tmp_path, plan)
    assert isinstance(done.nodes[0], NodeSynced)
    assert isinstance(done.nodes[1], SyncFailed) and done.nodes[1].message.startswith("the receiver ")


def test_a_launch_with_sync_runs_the_synced_project(tmp_path: Path, project: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # the run's history: the test's own

    from torchherd.api import Cluster
    from torchherd.engine.events import RunStarted

    (project / "train.py").write_text("print('[torchherd-rank 0] ran the synced train.py', flush=True)\n")
    connector = LocalConnector(env={name: {"HOME": str(home)} for name, home in homes(tmp_path).items()})
    cluster = Cluster([{"name": name} for name in NODES], python=sys.executable, workdir="~/work",
                      connector=connector)
    plan = cluster.plan("train.py", sync=str(project), run_id="t-sync")
    plan = replace(plan, nodes=tuple(replace(node, argv=(sys.executable, "train.py")) for node in plan.nodes))
    events = Collector()
    run = cluster.launch(plan, check=False, log_dir=tmp_path / "logs", on_event=events)
    assert not isinstance(run, type(None)) and run.wait(timeout=60).exit_code == 0  # type: ignore[union-attr]
    kinds = [type(event) for event in events.events]
    assert kinds.index(SyncDone) < kinds.index(RunStarted)
    assert {node: [line.text for line in lines] for node, lines in events.lines.items()} == {
        "a": ["ran the synced train.py"], "b": ["ran the synced train.py"]}


def test_check_with_sync_finds_the_script_it_sent(tmp_path: Path, project: Path) -> None:
    from torchherd.api import Cluster

    connector = LocalConnector(env={name: {"HOME": str(home)} for name, home in homes(tmp_path).items()})
    cluster = Cluster([{"name": name} for name in NODES], python=sys.executable, workdir="~/work",
                      connector=connector)
    before = cluster.check("train.py", only=["script"], sync=None)
    assert not before.ok  # nothing there yet, and check alone changes nothing
    events = Collector()
    report = cluster.check("train.py", only=["script"], sync=str(project), on_event=events)
    assert report.ok, [result.summary for result in report.results]
    assert isinstance(events.events[-1], SyncDone) and events.events[-1].ok


def test_the_console_tells_alike_nodes_on_one_line() -> None:
    from torchherd.console.sync import sync_notes

    nodes = tuple(NodeSynced(f"node{index}", "/w", ("a.py",), 10, (), 5, 0.5) for index in range(8))
    odd = SyncFailed("node8", "the receiver gave no answer")
    notes = list(sync_notes(SyncDone("/proj", nodes + (odd,), 1.25)))
    assert notes == [
        ("node0, node1, node2, node3, node4, ... node7 (8 nodes): in sync at /w: 1 file sent (10 B), 0 deleted, "
         "5 unchanged (0.5 s)", "dim"),
        ("sync: 8 of 9 nodes in sync (1.2 s)", "bold red")]
    assert list(sync_notes(odd)) == [("node8: not in sync: the receiver gave no answer", "bold red")]


@pytest.mark.parametrize("value", [
    {"need": ["a b.py", 'q"uote', "back\\slash", "tab\tnew\nline", "\x01\x7f", "é", "\udcff", "🐍"],
     "same": 3, "ok": True, "error": None, "seconds": 0.25},
    [], {}, "", 0, -7,
])
def test_the_receivers_json_is_json(value: object) -> None:
    from torchherd.remote.receive import to_json

    text = to_json(value)
    assert text.isascii()
    assert json.loads(text) == value


def test_a_receiver_that_refused_and_ended_before_the_listing_came_is_heard(tmp_path: Path, project: Path) -> None:
    # The receiver refuses an unsafe workdir at once and ends without reading its stdin: the
    # controller's listing then finds the pipe closed, and the refusal must still be what the
    # node's failure says (a loaded CI run said "the receiver was gone" instead).
    home_a = homes(tmp_path)["a"]
    (home_a / "work").mkdir()
    (home_a / "work").chmod(0o777)
    plan = plan_for(project, dest="proj")
    connector = LocalConnector(env={name: {"HOME": str(home)} for name, home in homes(tmp_path).items()})
    session = connector.connect(plan.inventory.hosts[0])
    node = _Node(plan.nodes[0], session)
    try:
        node.open()
        assert node.process is not None and node.process.exit_code(timeout=60) is not None  # it has ended
        node.ask(frame({"want": []}), timeout=10)
    finally:
        node.close()
        session.close()
    assert node.error is not None and f"{home_a / 'work'} cannot hold a sync: it is writable by group or others" \
        in node.error
