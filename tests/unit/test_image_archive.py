"""``--image-archive``: what an archive holds, bad input, which nodes load it, the relay and
load through the in-process transport (a stand-in ``podman`` on PATH: the cluster test
runs the real one), the events as the console renders them, and the check's words."""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from pathlib import Path

import pytest
from rich.console import Console

from support.cli import assert_one_line, run_cli
from torchherd.console.images import ArchiveBars, archive_notes
from torchherd.engine.events import ArchiveDone, ArchiveProgress, ArchiveStarted, Collector
from torchherd.engine.prepare.images import NodeImage, plan_archive
from torchherd.imagearchive import ImageArchive, holds, read_archive, short_name

CONFIG_ID = "c0" * 32


def write_archive(path: Path, tags: list[str], config: str = f"{CONFIG_ID}.json", payload: int = 1000) -> Path:
    """A tar shaped as docker save writes it (the layer's bytes random: any size wanted)."""
    def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    with tarfile.open(path, "w") as tar:
        add(tar, "layer/layer.tar", os.urandom(payload))
        add(tar, config, b"{}")
        add(tar, "manifest.json", json.dumps([{"Config": config, "RepoTags": tags,
                                                "Layers": ["layer/layer.tar"]}]).encode())
    return path


# ------------------------------------------------------------------ the archive


def test_an_archive_names_its_image_id_and_tags(tmp_path: Path) -> None:
    archive = read_archive(str(write_archive(tmp_path / "a.tar", ["localhost/th:1"])))
    assert (archive.image_id, archive.tags) == (CONFIG_ID, ("localhost/th:1",))
    assert archive.size == (tmp_path / "a.tar").stat().st_size and archive.path == str(tmp_path / "a.tar")
    oci = read_archive(str(write_archive(tmp_path / "b.tar", ["th:1"], config=f"blobs/sha256/{CONFIG_ID}")))
    assert oci.image_id == CONFIG_ID  # docker >= 25 writes the OCI layout


@pytest.mark.parametrize(("image", "tags", "held"), [
    ("th:1", ["localhost/th:1"], True),             # podman names a local image localhost/...
    ("th", ["docker.io/library/th:latest"], True),  # docker's default registry and tag
    ("nvcr.io/nvidia/pytorch:24.05-py3", ["nvcr.io/nvidia/pytorch:24.05-py3"], True),
    ("th:2", ["localhost/th:1"], False),
    ("other/th:1", ["localhost/th:1"], False),
    ("th@sha256:" + "a" * 64, [], True),             # a digest: no registry digest in an archive to compare
])
def test_an_archive_holds_an_image_by_the_name_the_runtimes_resolve(image: str, tags: list[str], held: bool) -> None:
    assert holds(ImageArchive("/a.tar", 1, CONFIG_ID, tuple(tags)), image) is held


def test_short_names() -> None:
    assert short_name("docker.io/library/python") == "python:latest"
    assert short_name("localhost:5000/th") == "localhost:5000/th:latest"


INVENTORY = '[[hosts]]\nname = "n0"\n'


@pytest.mark.parametrize("what", ["missing", "not a tar", "no manifest", "a directory"])
def test_a_bad_archive_flag_is_one_line_naming_the_flag_and_the_file(tmp_path: Path, what: str) -> None:
    path = tmp_path / "image.tar"
    if what == "not a tar":
        path.write_text("not a tar at all\n" * 100)
    elif what == "no manifest":
        with tarfile.open(path, "w") as tar:
            tar.addfile(tarfile.TarInfo("hello"), io.BytesIO(b""))
    elif what == "a directory":
        path.mkdir()
    code, out = run_cli(tmp_path, INVENTORY, ["check", "--image", "th:1", "--image-archive", str(path)])
    assert_one_line(code, out, f"--image-archive: {path}: ")
    assert "hint: give a file written by docker save -o FILE IMAGE" in out


def test_an_unreadable_archive_is_one_line(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads every file")
    path = write_archive(tmp_path / "image.tar", ["th:1"])
    path.chmod(0)
    code, out = run_cli(tmp_path, INVENTORY, ["run", "--image", "th:1", "--image-archive", str(path), "--", "t.py"])
    assert_one_line(code, out, f"--image-archive: {path}: Permission denied")


def test_an_archive_of_another_image_is_one_line_with_the_image_it_holds(tmp_path: Path) -> None:
    path = write_archive(tmp_path / "image.tar", ["localhost/th:1"])
    code, out = run_cli(tmp_path, INVENTORY, ["check", "--image", "th:2", "--image-archive", str(path)])
    assert_one_line(code, out, f"--image-archive: {path} holds localhost/th:1, not th:2")
    assert "hint: run with --image localhost/th:1" in out


def test_the_inventory_key_is_relative_to_the_inventory_and_named_in_errors(tmp_path: Path) -> None:
    write_archive(tmp_path / "image.tar", ["localhost/th:1"])
    code, out = run_cli(tmp_path, '[container]\nimage = "th:1"\nruntime = "apptainer"\narchive = "image.tar"\n'
                        + INVENTORY, ["hosts"])
    assert_one_line(code, out, f"[container].archive: {tmp_path / 'image.tar'}: runtime apptainer does not load")
    code, out = run_cli(tmp_path, '[container]\nimage = "th:1"\narchive = "nothing.tar"\n' + INVENTORY, ["hosts"])
    assert_one_line(code, out, f"[container].archive: {tmp_path / 'nothing.tar'}: No such file or directory")


def test_the_api_takes_the_archive(tmp_path: Path) -> None:
    from torchherd import Cluster

    path = write_archive(tmp_path / "image.tar", ["localhost/th:1"])
    cluster = Cluster(hosts=["a", "b"]).with_container("th:1", archive=path)
    assert {host.container.archive.image_id for host in cluster.inventory.hosts  # type: ignore[union-attr]
            } == {CONFIG_ID}


# ------------------------------------------------------------------ which nodes load it


def test_only_the_nodes_without_the_archives_id_load_it_in_node_rank_order() -> None:
    archive = ImageArchive("/a.tar", 10, CONFIG_ID, ("th:1",))
    found: dict[str, NodeImage | str] = {
        "n0": NodeImage("n0", "podman", None),            # not there: loads it
        "n1": NodeImage("n1", "podman", CONFIG_ID),       # the very same image: left alone
        "n2": NodeImage("n2", "docker", "ff" * 32),       # another image under the name: loaded over
        "n3": NodeImage("n3", None, None),                # nothing to load it with
        "n4": "not reached",
    }
    planned = plan_archive(archive, ["n0", "n1", "n2", "n3", "n4"], found)
    assert planned.loading == ("n0", "n2") and planned.having == ("n1",)
    assert planned.failed == (("n3", "neither docker nor podman is installed there to load the archive with"),
                              ("n4", "not reached"))


FAKE_PODMAN = """#!/bin/sh
# podman as far as image.py uses it: "image inspect" says the id once "load" was run
case "$1" in
  image) if [ -f "$FAKE_STATE/loaded" ]; then echo "$FAKE_ID"; else echo "no such image" >&2; exit 125; fi ;;
  load) sha256sum "$3" | cut -d" " -f1 >> "$FAKE_STATE/loads"; touch "$FAKE_STATE/loaded"; echo "Loaded image" ;;
esac
"""


@pytest.fixture
def fake_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A stand-in podman on PATH (its state in the returned folder) and a HOME of the test's own."""
    bin_dir, state, home = tmp_path / "bin", tmp_path / "state", tmp_path / "home"
    for folder in (bin_dir, state, home):
        folder.mkdir()
    (bin_dir / "podman").write_text(FAKE_PODMAN)
    (bin_dir / "podman").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_STATE", str(state))
    monkeypatch.setenv("FAKE_ID", CONFIG_ID)
    monkeypatch.setenv("HOME", str(home))
    return state, home


def staged(path: Path, sha256: str | None = None) -> tuple[Collector, ArchiveDone]:
    """The archive staged on three in-process nodes (with ``sha256``: the chain told that hash)."""
    from torchherd.api import Cluster
    from torchherd.engine.prepare.images import file_sha256, relay_archive, stage_archives
    from torchherd.transport import connect_all
    from torchherd.transport.local import LocalConnector

    cluster = Cluster([{"name": f"n{index}", "address": "127.0.0.1"} for index in range(3)], python=sys.executable,
                      nproc_per_node=1, connector=LocalConnector()).with_container("th:1", archive=path)
    plan = cluster.plan("train.py")
    events = Collector()
    connected = connect_all(LocalConnector(), [node.host for node in plan.nodes])
    try:
        if sha256 is None:
            (done,) = stage_archives(plan.nodes, connected.succeeded, events)
            return events, done
        archive = read_archive(str(path))
        sent = [0]
        results = relay_archive(archive, "th:1", "auto", sha256, plan.nodes, connected.succeeded, events,
                                lambda: False, sent)
        assert file_sha256(str(path)) != sha256
        failed = tuple((name, why) for name, why in results.items() if why is not None)
        return events, ArchiveDone(str(path), "th:1", (), (), failed, 0.0, sent[0])
    finally:
        connected.close()


def test_the_archive_goes_down_one_chain_verified_and_loaded_on_each_node(tmp_path: Path,
                                                                          fake_nodes: tuple[Path, Path]) -> None:
    from torchherd.engine.prepare.images import file_sha256

    state, home = fake_nodes
    path = write_archive(tmp_path / "image.tar", ["localhost/th:1"], payload=3_000_000)
    events, done = staged(path)
    assert done == events.events[-1]
    assert (done.loaded, done.failed, done.sent) == (("n0", "n1", "n2"), (), path.stat().st_size)
    started = events.events[0]
    assert isinstance(started, ArchiveStarted) and started.loading == ("n0", "n1", "n2")
    assert {event.node for event in events.events if isinstance(event, ArchiveProgress) and event.phase == "loading"} \
        == {"n0", "n1", "n2"}
    # every node loaded a copy with the archive's own bytes, and removed it after
    assert (state / "loads").read_text().split() == [file_sha256(str(path))] * 3
    assert list((home / ".cache" / "torchherd" / "archives").iterdir()) == []
    _, again = staged(path)  # now every node shows the archive's id: nothing sent, nothing loaded
    assert (again.loaded, again.having, again.sent) == ((), ("n0", "n1", "n2"), 0)
    assert len((state / "loads").read_text().split()) == 3


def test_a_copy_that_is_not_the_archive_is_never_loaded(tmp_path: Path, fake_nodes: tuple[Path, Path]) -> None:
    state, home = fake_nodes
    path = write_archive(tmp_path / "image.tar", ["localhost/th:1"], payload=500_000)
    _, done = staged(path, sha256="0" * 64)
    assert [node for node, _ in done.failed] == ["n0", "n1", "n2"]
    assert all("SHA-256" in why for _, why in done.failed), done.failed
    assert not (state / "loads").exists()
    assert list((home / ".cache" / "torchherd" / "archives").iterdir()) == []


# ------------------------------------------------------------------ as the user sees it


def test_the_notes_and_one_bar_per_node_exactly() -> None:
    console = Console(record=True, width=120, file=io.StringIO())
    bars = ArchiveBars(console)
    started = ArchiveStarted("/data/th.tar", "localhost/th:1", "ab" * 32, 200_000_000, ("node0", "node10"), ("node2",))
    done = ArchiveDone("/data/th.tar", "localhost/th:1", ("node0",), ("node2",),
                       (("node10", "podman load failed (exit 125): no space left on device"),), 3.25, 200_000_000)
    for event in (started, ArchiveProgress("node0", "receiving", 50_000_000, 200_000_000),
                  ArchiveProgress("node10", "loading", 200_000_000, 200_000_000), done):
        if not isinstance(event, ArchiveDone):
            for text, _ in archive_notes(event):
                console.print(text, soft_wrap=True)
        bars(event)
        if isinstance(event, ArchiveDone):
            for text, _ in archive_notes(event):
                console.print(text, soft_wrap=True)
    assert console.export_text() == (
        "image archive: sending /data/th.tar (200.0 MB, image localhost/th:1 abababababab) once, relayed node to "
        "node: this machine -> node0 -> node10\n"
        "node2: image localhost/th:1 abababababab there already: nothing sent\n"
        "  node0  ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━ 200.0 MB / 200.0 MB loaded\n"
        "  node10 ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━ 200.0 MB / 200.0 MB failed\n"
        "node10: image not loaded: podman load failed (exit 125): no space left on device\n"
        "image archive: localhost/th:1 loaded on 1 of 2 nodes (3.2 s; 200.0 MB sent from this machine)\n")


def test_nothing_to_load_is_one_note_and_no_bar() -> None:
    console = Console(record=True, width=120, file=io.StringIO())
    bars = ArchiveBars(console)
    started = ArchiveStarted("/data/th.tar", "th:1", "ab" * 32, 10, (), ("node0", "node1"))
    done = ArchiveDone("/data/th.tar", "th:1", (), ("node0", "node1"), (), 0.5, 0)
    for event in (started, done):
        bars(event)
        for text, _ in archive_notes(event):
            console.print(text, soft_wrap=True)
    assert console.export_text() == "node0, node1: image th:1 abababababab there already: nothing sent\n"


# ------------------------------------------------------------------ check


def test_check_says_how_many_nodes_the_archive_would_load_it_on(tmp_path: Path) -> None:
    from torchherd.checks.analysis import container as analysis
    from torchherd.checks.model import NodeFacts, Observed
    from torchherd.inventory import parse

    path = write_archive(tmp_path / "image.tar", ["localhost/img:1"])
    inventory = parse({"container": {"image": "img:1", "archive": str(path)},
                       "hosts": [{"name": f"n{index}"} for index in range(3)]}, Path("h.toml"))
    observed = Observed(inventory=inventory, master_target="n0")
    observed.facts.update({host.name: NodeFacts(raw={}, sent=0.0, received=0.0) for host in inventory.hosts})
    versions = {"python": "3.11.7", "torch": "2.13.0", "cuda": None, "nccl": None}
    observed.containers.update({
        "n0": {"runtime": "podman", "image-error": "Error: img:1: image not known"},
        "n1": {"runtime": "docker", "id": "sha256:" + "ff" * 32, "versions": versions},
        "n2": {"runtime": "podman", "id": CONFIG_ID, "versions": versions},
    })
    found = {result.node: (result.status, result.summary) for result in analysis.analyse(observed)}
    assert found["n0"] == ("warn", f"image img:1 is not on n0: --image-archive would load it ({path}, c0c0c0c0c0c0)")
    assert found["n1"] == ("warn", f"image img:1 on n1 is ffffffffffff, the archive's is c0c0c0c0c0c0: --image-archive "
                                   f"would load it over it ({path})")
    assert found["n2"][0] == "pass"
    assert found["cluster"] == ("warn", "image img:1 missing on 2 nodes; --image-archive would load it")


def test_a_relay_given_up_midway_leaves_no_copy_and_no_program(tmp_path: Path, fake_nodes: tuple[Path, Path]) -> None:
    """Ctrl-C while the archive travels: every node's program ends and removes its copy."""
    import subprocess
    import time

    from torchherd.api import Cluster
    from torchherd.engine.prepare.images import file_sha256, relay_archive
    from torchherd.transport import connect_all
    from torchherd.transport.local import LocalConnector

    state, home = fake_nodes
    path = write_archive(tmp_path / "image.tar", ["localhost/th:1"], payload=300_000_000)
    archive = read_archive(str(path))
    plan = Cluster([{"name": f"n{index}", "address": "127.0.0.1"} for index in range(3)], python=sys.executable,
                   nproc_per_node=1, connector=LocalConnector()).with_container("th:1", archive=path).plan("t.py")
    events = Collector()
    connected = connect_all(LocalConnector(), [node.host for node in plan.nodes])
    try:
        results = relay_archive(archive, "th:1", "auto", file_sha256(str(path)), plan.nodes, connected.succeeded,
                                events, lambda: any(isinstance(event, ArchiveProgress) for event in events.events), [0])
    finally:
        connected.close()
    assert set(results.values()) == {"given up: the run was interrupted"}, results
    folder = home / ".cache" / "torchherd" / "archives"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (list(folder.iterdir()) or subprocess.run(
            ["pgrep", "-f", str(folder)], capture_output=True).returncode == 0):
        time.sleep(0.2)
    assert list(folder.iterdir()) == []
    assert subprocess.run(["pgrep", "-f", str(folder)], capture_output=True).returncode == 1  # no program left
    assert not (state / "loads").exists()
