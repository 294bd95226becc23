"""The image pulled on every node before the launch (``--pull missing|always``,
``[container].pull``): a step of its own, all nodes at once, each node's progress an
event (``PullProgress``: the layers there so far), before the preflight, so that the
``container`` check compares the ids of the images the job will run.

The job's container itself always runs with ``--pull never`` (plan.py): nothing is pulled
twice, and a run's start never waits on a registry unseen. Apptainer and enroot take no pull policy: a node
whose runtime is one of them is left out of the step.

What the runtimes print, without a terminal (tests/unit/test_pull.py has their real output):

- podman: ``Copying blob sha256:...`` as each layer starts (``... done`` or ``... skipped:
  already exists`` on a terminal), ``Copying config``, ``Writing manifest to image
  destination``, then the image id; an error is its last line, ``Error: ...``;
- docker: ``<layer>: Pulling fs layer`` (or ``Already exists``) for every layer first, then
  ``<layer>: Pull complete`` as each is in, ``Digest:``, ``Status:``.
"""

from __future__ import annotations

import re
import shlex
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from torchherd.engine.events import NodePulled, Observer, PullFailed, PullProgress, PullsDone, PullStarted
from torchherd.engine.prepare.sync import Lines
from torchherd.errors import TransportError
from torchherd.plan import NodePlan, Plan
from torchherd.remote import container as containers
from torchherd.transport import Process, Session

PULL_SECONDS = 6 * 3600.0
"""The most one node's pull may take (a 20 GB image over a slow link); a runtime that
says nothing for STALL_SECONDS is given up on sooner."""
STALL_SECONDS = 600.0
"""A pull that prints nothing this long is taken as stalled (docker and podman print a line
per layer; a single huge layer over a slow link is the case this leaves room for)."""
MARK = "torchherd-pull:"
"""The lines of the node command's own, apart from the runtime's."""

LAYERED = tuple(runtime for runtime in containers.RUNTIME.values() if runtime.layer_line is not None)
"""The runtimes whose pull names its layers (``Runtime.layer_line``), in the table's order."""


@dataclass
class Tracker:
    """One node's pull, from the runtime's lines: which layers it named, which are in."""

    layers: dict[str, bool] = field(default_factory=dict)
    status: str = ""
    finished: bool = False
    """podman said it is writing the manifest: every layer is in."""

    @property
    def done(self) -> int:
        return len(self.layers) if self.finished else sum(self.layers.values())

    def feed(self, line: str) -> bool:
        """Takes one line of the runtime's; True when the progress changed."""
        line = line.strip()
        before = (dict(self.layers), self.status, self.finished)
        layer = _layer(line)
        if layer is not None:
            runtime, name, said = layer
            assert runtime.layer_in is not None
            self.layers[name] = self.layers.get(name, False) or runtime.layer_in.match(said) is not None
            self.status = runtime.layer_status or said.split(" [")[0].lower()
        elif line.startswith(("Copying config", "Writing manifest")):
            self.finished = True
            self.status = "writing the image"
        elif line.startswith(("Trying to pull", "Getting image source signatures")) or ": Pulling from " in line:
            self.status = "starting"
        return (self.layers, self.status, self.finished) != before


def _layer(line: str) -> tuple[containers.Runtime, str, str] | None:
    """The runtime whose pull printed ``line`` about a layer, the layer's id, what it says of it."""
    for runtime in LAYERED:
        assert runtime.layer_line is not None
        match = runtime.layer_line.match(line)
        if match:
            return runtime, match.group(1)[:12], match.group(2) or ""
    return None


def pulled_nodes(plan: Plan) -> tuple[NodePlan, ...]:
    """The nodes whose image is pulled before the launch: docker, podman or "auto", with a
    pull policy other than "never"."""
    return tuple(node for node in plan.nodes if node.container is not None and node.host.container is not None
                 and node.host.container.pull != "never"
                 and node.container.runtime in ("auto", *containers.OCI_RUNTIMES))


def _policy(node: NodePlan) -> str:
    return node.host.container.pull if node.host.container is not None else "never"


def node_command(node: NodePlan) -> str:
    """Pulls ``node``'s image with its runtime (``missing``: only when it is not there),
    ``torchherd-pull:`` lines saying what it found; the pull ends when the controller goes
    (its stdin's EOF): no pull is left running on a node after Ctrl-C."""
    spec = node.container
    assert spec is not None
    image = shlex.quote(spec.image)
    candidates = containers.RUNTIMES if spec.runtime == "auto" else (spec.runtime,)
    oci = " | ".join(containers.OCI_RUNTIMES)
    return "\n".join([
        "rt=",
        f"for r in {' '.join(candidates)}; do if command -v \"$r\" >/dev/null 2>&1; then rt=$r; break; fi; done",
        f'if [ -z "$rt" ]; then echo "{MARK} no-runtime"; exit 3; fi',
        f'case "$rt" in {oci}) ;; *) echo "{MARK} not-pulled $rt"; exit 0 ;; esac',
        f'echo "{MARK} runtime $rt"',
        f'if [ {shlex.quote(_policy(node))} = missing ] && "$rt" image inspect {image} >/dev/null 2>&1; then',
        f'  echo "{MARK} present"; exit 0',
        "fi",
        # a background list's stdin is /dev/null: the watcher reads the channel's through fd 3
        "exec 3<&0",
        f'"$rt" pull {image} </dev/null 3<&- 2>&1 &',
        "pid=$!",
        # the controller gone (stdin at EOF): the pull is stopped, not left to run on
        '{ cat <&3 >/dev/null 2>&1; kill "$pid" 2>/dev/null; } >/dev/null 2>&1 &',
        "watcher=$!",
        'wait "$pid"; code=$?',
        'kill "$watcher" 2>/dev/null',
        'exit "$code"',
    ])


@dataclass
class _Node:
    plan: NodePlan
    session: Session
    started: float = 0.0
    process: Process | None = None
    result: NodePulled | PullFailed | None = None


def pull_images(plan: Plan, sessions: dict[str, Session], observer: Observer) -> PullsDone | None:
    """Every node of ``pulled_nodes(plan)`` pulls its image at once; None when there is none.
    Ctrl-C (KeyboardInterrupt) stops every pull on the nodes and goes on up."""
    wanted = pulled_nodes(plan)
    if not wanted:
        return None
    lock = threading.Lock()

    def emit(event: PullStarted | PullProgress | NodePulled | PullFailed | PullsDone) -> None:
        with lock:
            observer(event)

    started = time.monotonic()
    policy = _policy(wanted[0])
    emit(PullStarted(tuple((node.host.name, node.container.image) for node in wanted if node.container is not None),
                     policy))
    nodes = [_Node(node, sessions[node.host.name]) for node in wanted]
    stop = threading.Event()
    threads = [threading.Thread(target=_pull, args=(node, emit, stop), name=f"torchherd-pull-{node.plan.host.name}",
                                daemon=True) for node in nodes]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(0.2)
    except KeyboardInterrupt:
        stop.set()
        for node in nodes:
            if node.process is not None:
                node.process.close_stdin()  # the node command stops its pull
        for thread in threads:
            thread.join(5)
        raise
    results = tuple(node.result or PullFailed(node.plan.host.name, _image(node.plan), "no answer") for node in nodes)
    done = PullsDone(results, time.monotonic() - started)
    emit(done)
    return done


def _image(node: NodePlan) -> str:
    return node.container.image if node.container is not None else ""


def _pull(node: _Node, emit: Observer, stop: threading.Event) -> None:
    name, image = node.plan.host.name, _image(node.plan)
    node.started = time.monotonic()
    try:
        node.process = node.session.start(node_command(node.plan))
    except TransportError as error:
        node.result = PullFailed(name, image, f"not started: {error}")
        emit(node.result)
        return
    tracker = Tracker()
    lines = Lines(node.process)
    said: list[str] = []
    present = False
    deadline = node.started + PULL_SECONDS
    while True:
        raw = lines.line(min(STALL_SECONDS, max(0.0, deadline - time.monotonic())), stop.is_set)
        if raw is None:
            break
        text = raw.decode("utf-8", "replace").rstrip("\r")
        if text.startswith(MARK):
            word = text[len(MARK):].split()[0] if text[len(MARK):].strip() else ""
            present = present or word in ("present", "not-pulled")
            if word == "no-runtime":
                said.append("no docker or podman on PATH")
            continue
        if text.strip():
            said.append(text.strip())
        if tracker.feed(text):
            emit(PullProgress(name, tracker.done, len(tracker.layers), tracker.status))
    node.process.close_stdin()  # ended, stalled or stopped: the node command stops a pull still running
    code = None if stop.is_set() else node.process.exit_code(timeout=30)
    node.process.close()
    if code == 0:
        node.result = NodePulled(name, image, not present, len(tracker.layers), time.monotonic() - node.started)
    else:
        node.result = PullFailed(name, image, _error(said, code, stop.is_set()))
    emit(node.result)


def _error(said: Sequence[str], code: int | None, stopped: bool) -> str:
    """The runtime's own error line (``Error: ...`` from podman and docker), else its last line."""
    if stopped:
        return "stopped (interrupted)"
    errors = [line for line in said if line.startswith("Error")]
    line = errors[-1] if errors else (said[-1] if said else f"exit status {code}" if code is not None else
                                      "no exit status (the connection was lost, or the pull stalled)")
    return re.sub(r"^Error( response from daemon)?: ", "", line)[:400]
