"""Warm interpreters for the attempts (``[recovery] warm``): one ``remote/zygote.py`` per
node of a run with retries, spares included, that imports torch once, beside attempt 1's
preflight (or while attempt 1 runs, when a sync comes first), so that the torchrun and ranks
of every attempt fork from it instead of starting Python and importing torch each (seconds
per process, paid by every GPU of the job while it waits; and the agent's own interpreter
shutdown, about half a second, at every teardown).

Each zygote runs over an SSH channel of its own, in the node's workdir after its setup
snippet, with the job's environment (sent on its stdin, never on the command line), and
ends when that channel's stdin ends: ``close`` at the run's end, or the controller gone.
Whatever it forked dies with it. A node whose zygote is not ready (still importing, failed,
unreachable) starts cold, as before.
"""

from __future__ import annotations

import json
import shlex
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Collection, Mapping, Sequence

from torchherd.engine.events import WarmReady
from torchherd.errors import TransportError
from torchherd.plan import NodePlan, Plan
from torchherd.remote import program, wire
from torchherd.remote.zygote import CLIENT_NAME
from torchherd.shell import quote_path
from torchherd.transport import Connector, Process, Session, fan_out

PRELOAD = ("torch", "torch.distributed.run")
"""What a zygote imports: torch, and torchrun's agent (it imports most of torch.distributed)."""
READY_WITHIN = 300.0
"""The most a zygote may take to import torch (a cold page cache on a network filesystem)."""
CLOSE_WAIT = 1.0
"""How long the run's end waits for zygotes still starting."""
EXIT_WAIT = 10.0
"""How long the run's end waits, for all its zygotes together, for each to end."""
PYTHON_EXEC = "PYTHON_EXEC"
"""torchrun's own override of the interpreter that runs each rank."""


@dataclass(frozen=True)
class WarmNode:
    """A node's zygote: its private directory once ready, or why there is none."""

    node: str
    directory: str | None
    error: str | None = None


def zygote_command(node: NodePlan) -> str:
    """The shell line: the workdir, the setup snippet, then the zygote (no ``-I``: it
    imports what the job imports, from the job's ``sys.path``)."""
    parts = node.shell_prefix()
    parts.append(f"exec {quote_path(node.host.python)} -u -c {shlex.quote(program('zygote.py'))} serve "
                 + " ".join(PRELOAD))
    return " && ".join(parts)


def zygote_env(node: NodePlan) -> dict[str, str]:
    """The job's environment as the zygote imports torch with it (no supervisor's token:
    the zygote is no attempt's process, and no teardown of one may take it)."""
    return {name: value for name, value in node.env.items() if name != wire.SUPERVISOR_ENV}


class WarmPool:
    """The run's zygotes, started in the background; ``ready`` names those that answered."""

    def __init__(self, connector: Connector, nodes: Sequence[NodePlan],
                 on_ready: Callable[[WarmReady], None] = lambda _ready: None) -> None:
        self.connector = connector
        self.nodes = list(nodes)
        self.on_ready = on_ready
        self._lock = threading.Lock()
        self._answered = threading.Condition(self._lock)
        self._found: dict[str, WarmNode] = {}
        self._running: dict[str, tuple[Session, Process]] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._start_all, name="torchherd-warm", daemon=True)

    def start(self) -> WarmPool:
        self._thread.start()
        return self

    def ready(self) -> dict[str, str]:
        """Node -> its zygote's private directory, for every zygote ready and still there."""
        with self._lock:
            return {name: found.directory for name, found in self._found.items()
                    if found.directory is not None and name in self._running}

    def wait_for(self, names: Sequence[str], timeout: float) -> None:
        """Returns once each of ``names`` answered (ready or not), or ``timeout`` seconds passed."""
        with self._answered:
            self._answered.wait_for(lambda: self._closed or all(name in self._found for name in names), timeout)

    def errors(self) -> dict[str, str]:
        with self._lock:
            return {name: found.error for name, found in self._found.items() if found.error is not None}

    def close(self, gone: Collection[str] = ()) -> None:
        """Every zygote's stdin ends: each kills what it forked, removes its directory, exits.
        The zygotes of ``gone`` (nodes the run lost) are not waited for: nothing answers there."""
        with self._answered:
            self._closed = True
            running = list(self._running.items())
            self._running.clear()
            self._answered.notify_all()
        for _name, (_session, process) in running:
            process.close_stdin()
        deadline = time.monotonic() + EXIT_WAIT
        for name, (session, process) in running:
            if name not in gone:
                process.exit_code(timeout=max(0.0, deadline - time.monotonic()))
            process.close()
            session.close()
        # A connect still pending (a node whose sshd does not answer) is not waited for: the
        # zygote it would start sees the pool closed and ends at once (``_start``).
        self._thread.join(timeout=CLOSE_WAIT)

    def _start_all(self) -> None:
        started = time.monotonic()
        fan_out(self.nodes, self._start)
        with self._lock:
            if self._closed:
                return
            found = [self._found[node.host.name] for node in self.nodes if node.host.name in self._found]
        self.on_ready(WarmReady(tuple(one.node for one in found if one.directory is not None),
                                tuple((one.node, one.error) for one in found if one.error is not None),
                                time.monotonic() - started))

    def _start(self, node: NodePlan) -> None:
        name = node.host.name
        try:
            session = self.connector.connect(node.host)
        except TransportError as error:
            self._found_one(WarmNode(name, None, f"not reached: {error}"))
            return
        with self._lock:
            closed = self._closed
        if closed:  # the run ended while this node was being reached (a slow sshd): nothing to start
            session.close()
            return
        try:
            process = session.start(zygote_command(node))
            process.send((json.dumps({"env": zygote_env(node)}) + "\n").encode())
        except TransportError as error:
            session.close()
            self._found_one(WarmNode(name, None, str(error)))
            return
        with self._lock:
            if self._closed:
                process.close_stdin()
                process.close()
                session.close()
                return
            self._running[name] = (session, process)
        self._found_one(_answer(name, process))

    def _found_one(self, found: WarmNode) -> None:
        with self._answered:
            self._found[found.node] = found
            self._answered.notify_all()


def _answer(name: str, process: Process) -> WarmNode:
    """The zygote's first line: its directory, or why it could not start."""
    data = b""
    while b"\n" not in data:
        chunk = process.read(READY_WITHIN)
        if not chunk:
            why = process.read_stderr().decode(errors="replace").strip().splitlines()
            return WarmNode(name, None, why[-1] if why else "the warm interpreter ended before it was ready")
        data += chunk
    try:
        answer = json.loads(data.split(b"\n", 1)[0])
    except ValueError:
        return WarmNode(name, None, "the warm interpreter said something else than where it is")
    if isinstance(answer, dict) and isinstance(answer.get("dir"), str):
        return WarmNode(name, answer["dir"])
    return WarmNode(name, None, str(answer.get("error") if isinstance(answer, dict) else answer))


def warmed(plan: Plan, directories: Mapping[str, str]) -> tuple[Plan, tuple[str, ...]]:
    """``plan`` with every node that has a ready zygote starting its torchrun through it
    (``DIR/python -m torch.distributed.run ...``) and each rank too (``PYTHON_EXEC``, unless
    the job sets its own); the nodes that start warm. A node in a container starts cold."""
    nodes = []
    warm = []
    for node in plan.nodes:
        directory = directories.get(node.host.name)
        if directory is None or node.container is not None or not node.argv:
            nodes.append(node)
            continue
        client = f"{directory}/{CLIENT_NAME}"
        env = dict(node.env)
        if PYTHON_EXEC not in env:
            env[PYTHON_EXEC] = client
        nodes.append(replace(node, argv=(client, *node.argv[1:]), env=env))
        warm.append(node.host.name)
    return replace(plan, nodes=tuple(nodes)), tuple(warm)


def start_warm(connector: Connector, plan: Plan, on_ready: Callable[[WarmReady], None]) -> WarmPool:
    return WarmPool(connector, plan.nodes, on_ready).start()
