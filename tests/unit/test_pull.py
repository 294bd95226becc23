"""The pull step (``--pull missing|always``): the progress read from the runtimes' real output
(tests/unit/data/pull), the step on in-process "nodes" whose ``podman`` is a stand-in that
replays that output, and what the console shows (exact texts, a recording console).
The real failure (an image no registry serves) is tests/cluster/test_containers.py's."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from torchherd.console.pull import NodeBar, PullView, bars, pull_notes
from torchherd.engine.events import Collector, NodePulled, PullFailed, PullProgress, PullsDone, PullStarted
from torchherd.engine.prepare.pull import Tracker, pull_images, pulled_nodes
from torchherd.plan import Plan

DATA = Path(__file__).resolve().parent / "data" / "pull"
IMAGE = "nvcr.io/nvidia/pytorch:24.05-py3"


def replay(name: str) -> list[tuple[int, int, str]]:
    """(done, layers, status) after every line of a recorded pull that changed them."""
    tracker = Tracker()
    seen = []
    for line in (DATA / name).read_text(encoding="utf-8").splitlines():
        if tracker.feed(line):
            seen.append((tracker.done, len(tracker.layers), tracker.status))
    return seen


def test_podman_names_its_layers_one_by_one_and_all_are_in_at_the_manifest() -> None:
    assert replay("podman-4.3-archive.txt") == [(0, 0, "starting"), (0, 1, "copying layers"),
                                                (1, 1, "writing the image")]


def test_docker_names_every_layer_first_then_each_comes_in() -> None:
    seen = replay("docker-node-alpine.txt")
    assert seen[:4] == [(0, 0, "starting"), (0, 1, "pulling fs layer"), (0, 2, "pulling fs layer"),
                        (0, 3, "pulling fs layer")]
    assert [done for done, _, _ in seen if done] == [1, 2, 3]
    assert seen[-1] == (3, 3, "pull complete")


def test_layers_already_there_count_as_in() -> None:
    seen = replay("docker-rancher-some-exist.txt")
    assert seen[5] == (5, 5, "already exists")
    assert seen[-1] == (6, 6, "pull complete")


def test_a_refused_pull_changes_no_progress() -> None:
    assert replay("podman-4.3-refused.txt") == [(0, 0, "starting")]


# ------------------------------------------------------------------ the step, on in-process nodes


def plan_of(tmp_path: Path, nodes: int, pull: str = "missing") -> Plan:
    from torchherd.api import Cluster
    from torchherd.transport.local import LocalConnector

    hosts = [{"name": f"node{index}", "address": "127.0.0.1", "workdir": str(tmp_path)} for index in range(nodes)]
    return Cluster(hosts, python=sys.executable, nproc_per_node=1, connector=LocalConnector(),
                   container={"image": IMAGE, "runtime": "podman", "pull": pull}).plan("train.py")


def stand_in(directory: Path, replayed: str, code: int, present: bool = False, pause: float = 0.0) -> dict[str, str]:
    """A ``podman`` that answers ``image inspect`` (there or not) and replays a recorded pull."""
    directory.mkdir(parents=True)
    script = directory / "podman"
    script.write_text(f"""#!/bin/sh
case "$1" in
  image) exit {0 if present else 1} ;;
  pull) [ "$2" = {IMAGE} ] || exit 9
        # one process to the outside, as podman is: SIGTERM ends its wait too
        trap 'kill $waiting; exit 143' TERM; sleep {pause} & waiting=$!; wait $waiting
        cat {DATA / replayed}; exit {code} ;;
esac
exit 8
""", encoding="utf-8")
    script.chmod(0o755)
    return {"PATH": f"{directory}:{os.environ['PATH']}"}


def sessions_for(plan: Plan, env: dict[str, dict[str, str]]) -> dict[str, object]:
    from torchherd.transport.local import LocalConnector

    connector = LocalConnector(env=env)
    return {node.host.name: connector.connect(node.host) for node in plan.nodes}


def test_every_node_pulls_at_once_and_says_how_far_it_is(tmp_path: Path) -> None:
    plan = plan_of(tmp_path, 3)
    env = {"node0": stand_in(tmp_path / "a", "podman-4.3-archive.txt", 0),
           "node1": stand_in(tmp_path / "b", "podman-4.3-archive.txt", 0, present=True),
           "node2": stand_in(tmp_path / "c", "podman-4.3-refused.txt", 125)}
    events = Collector()
    done = pull_images(plan, sessions_for(plan, env), events)  # type: ignore[arg-type]
    assert done is not None
    assert [type(node).__name__ for node in done.nodes] == ["NodePulled", "NodePulled", "PullFailed"]
    first, second, third = done.nodes
    assert isinstance(first, NodePulled) and (first.pulled, first.layers) == (True, 1)
    assert isinstance(second, NodePulled) and second.pulled is False  # "missing": there already, not pulled
    assert isinstance(third, PullFailed)
    assert third.message == ('initializing source docker://127.0.0.1:9/torchherd/none:1: pinging container registry '
                             '127.0.0.1:9: Get "https://127.0.0.1:9/v2/": dial tcp 127.0.0.1:9: connect: connection '
                             'refused')
    assert [(event.node, event.done, event.layers) for event in events.of(PullProgress) if event.node == "node0"] == [
        ("node0", 0, 0), ("node0", 0, 1), ("node0", 1, 1)]
    assert isinstance(events.events[0], PullStarted) and isinstance(events.events[-1], PullsDone)


def test_always_pulls_though_the_image_is_there(tmp_path: Path) -> None:
    plan = plan_of(tmp_path, 1, pull="always")
    env = {"node0": stand_in(tmp_path / "a", "podman-4.3-archive.txt", 0, present=True)}
    done = pull_images(plan, sessions_for(plan, env), Collector())  # type: ignore[arg-type]
    assert done is not None and isinstance(done.nodes[0], NodePulled) and done.nodes[0].pulled


def test_never_is_no_step_and_the_container_itself_never_pulls(tmp_path: Path) -> None:
    assert pulled_nodes(plan_of(tmp_path, 2, pull="never")) == ()
    plan = plan_of(tmp_path, 2, pull="always")
    assert len(pulled_nodes(plan)) == 2
    for node in plan.nodes:  # pulled before: never twice, never a launch waiting on a registry
        argv = node.job_argv()
        assert argv[argv.index("--pull") + 1] == "never"
        assert any(note.endswith("; the image pulled first (pull = always)") for note in node.notes), node.notes


def test_ctrl_c_stops_the_pull_on_every_node(tmp_path: Path) -> None:
    """The stand-in pulls for 60 s; a KeyboardInterrupt in the waiting thread closes every
    node command's stdin, which stops its pull: no ``sleep`` of it is left."""
    import subprocess
    import threading

    plan = plan_of(tmp_path, 2)
    marker = f"torchherd-test-pull-{os.getpid()}"
    env = {name: {**stand_in(tmp_path / name, "podman-4.3-archive.txt", 0, pause=60), "MARKER": marker}
           for name in ("node0", "node1")}
    events = Collector()
    # Ctrl-C as a terminal sends it, whatever started the tests: a shell's background job
    # (``nohup ... &``) inherits SIGINT ignored, and Python then keeps it so.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            pull_images(plan, sessions_for(plan, env), events)  # type: ignore[arg-type]
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, inherited)
    assert time.monotonic() - started < 15
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = subprocess.run(["pgrep", "-f", "sleep 60"], capture_output=True, text=True).stdout.split()
        mine = [pid for pid in left if marker in environ(pid)]
        if not mine:
            break
        time.sleep(0.2)
    assert not mine, mine


def environ(pid: str) -> str:
    """A process's environment; "" once it is gone (pgrep listed it, it ended since)."""
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode("utf-8", "replace")
    except OSError:
        return ""


# ------------------------------------------------------------------ what the console shows


def test_the_notes_fold_the_nodes_alike_and_name_the_image_in_one_line_per_failure() -> None:
    started = PullStarted(tuple((f"node{index}", IMAGE) for index in range(6)), "missing")
    assert list(pull_notes(started)) == [(f"pull: {IMAGE} on 6 nodes (pull missing), all at once", "bold")]
    refused = "initializing source docker://x: connection refused"
    done = PullsDone((NodePulled("node0", IMAGE, True, 3, 12.04), NodePulled("node1", IMAGE, True, 3, 14.26),
                      NodePulled("node2", IMAGE, False, 0, 0.3), PullFailed("node3", IMAGE, refused),
                      PullFailed("node4", IMAGE, refused), PullFailed("node5", IMAGE, refused)), 14.9)
    assert list(pull_notes(done)) == [
        (f"node[0-1]: {IMAGE} pulled (3 layers, 14.3 s)", "dim"),
        (f"node2: {IMAGE} there already", "dim"),
        (f"pull: {IMAGE} could not be pulled on node[3-5]: {refused}", "bold red"),
        ("pull: 3 of 6 nodes have the image (14.9 s)", "bold red"),
    ]


def rendered(table: object, width: int = 80) -> str:
    console = Console(record=True, width=width, force_terminal=False, color_system=None)
    console.print(table)
    return console.export_text()


def test_one_bar_per_node_exact() -> None:
    states = [NodeBar("node0", 2, 4, "pull complete"), NodeBar("node1", 0, 0, "starting"),
              NodeBar("node2", 3, 3, "done", ended="pulled"), NodeBar("node3", 0, 0, "connection refused",
                                                                     ended="failed")]
    assert [line.rstrip() for line in rendered(bars(states, width=10)).splitlines()] == [
        "node0 ━━━━━      2/4 layers pull complete",
        "node1 ··········            starting",
        "node2 ━━━━━━━━━━ 3/3 layers done",
        "node3 failed                connection refused",
    ]


def test_the_view_follows_the_events_to_the_notes() -> None:
    console = Console(record=True, width=100, force_terminal=False, color_system=None)
    view = PullView(console, live=False)
    notes = list(view.observe(PullStarted((("node0", IMAGE), ("node1", IMAGE)), "always")))
    notes += list(view.observe(PullProgress("node0", 1, 2, "pull complete")))
    assert (view.states["node0"].done, view.states["node0"].layers) == (1, 2)
    notes += list(view.observe(NodePulled("node0", IMAGE, True, 2, 3.0)))
    notes += list(view.observe(NodePulled("node1", IMAGE, True, 2, 2.5)))
    notes += list(view.observe(PullsDone((NodePulled("node0", IMAGE, True, 2, 3.0),
                                          NodePulled("node1", IMAGE, True, 2, 2.5)), 3.1)))
    assert [text for text, _ in notes] == [f"pull: {IMAGE} on 2 nodes (pull always), all at once",
                                           f"node[0-1]: {IMAGE} pulled (2 layers, 3.0 s)",
                                           "pull: 2 of 2 nodes have the image (3.1 s)"]
    assert view.states["node0"].ended == "pulled" and view.states["node0"].done == 2


def test_on_a_terminal_the_bars_live_while_pulling_and_go_before_the_notes() -> None:
    from io import StringIO

    from torchherd.console.observer import ConsoleObserver
    from torchherd.console.view import ViewOptions

    out = StringIO()
    console = Console(file=out, width=100, force_terminal=True, color_system=None)
    observer = ConsoleObserver(console, view=ViewOptions.choose(console))
    observer(PullStarted((("node0", IMAGE), ("node1", IMAGE)), "missing"))
    assert observer.pulls.live is not None and observer.pulls.live.is_started
    observer(PullProgress("node0", 1, 3, "pull complete"))
    observer(NodePulled("node0", IMAGE, True, 3, 2.0))
    observer(PullFailed("node1", IMAGE, "connection refused"))
    observer(PullsDone((NodePulled("node0", IMAGE, True, 3, 2.0), PullFailed("node1", IMAGE, "connection refused")),
                       2.2))
    assert observer.pulls.live is None
    text = out.getvalue()
    assert f"pull: {IMAGE} could not be pulled on node1: connection refused" in text
    assert f"node0: {IMAGE} pulled (3 layers, 2.0 s)" in text
