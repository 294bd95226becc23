"""A uv-locked project's venv on every node, after the sync and before the preflight.

Per node, one command runs ``remote/venv.py`` with the node's configured python: when the
venv's marker holds the plan's key (same lock, python and kind of venv) nothing else runs;
else it finds uv there and runs ``uv sync --frozen`` into the venv. The job's environment
(``[defaults].env``, ``--env``: an index URL, ``UV_OFFLINE``, a proxy) reaches uv through
the program's stdin, never a command line. The observer is told ``VenvsDone``.
"""

from __future__ import annotations

import json
import time
from typing import Mapping, Union

from torchherd.engine.events import Observer, VenvFailed, VenvReady, VenvsDone
from torchherd.errors import TransportError
from torchherd.plan import NodePlan, Plan
from torchherd.remote import command
from torchherd.shell import quote_path
from torchherd.transport import Session, fan_out

BUILD_SECONDS = 3600.0
"""How long one node's ``uv sync`` may take: a first build downloads torch and CUDA's
libraries (gigabytes); a cached venv answers in well under a second."""


def venv_command(node: NodePlan) -> str:
    """The node program that builds (or finds) the venv, with the configured python."""
    assert node.venv is not None
    return f"{quote_path(node.venv.python)} {command('venv.py')}"


def venv_config(node: NodePlan) -> dict[str, object]:
    """What ``remote/venv.py`` reads on its stdin."""
    venv = node.venv
    assert venv is not None
    return {"path": venv.path, "key": venv.key, "project": venv.project, "uv": list(venv.uv),
            "system_site_packages": venv.system_site_packages, "env": dict(node.env)}


def missing_uv_hint(node: NodePlan) -> str:
    assert node.venv is not None
    name = node.host.name
    return (f"install uv on {name} ({node.venv.python} -m pip install --user uv, or uv's own installer), "
            f"or set uv = \"/path/to/uv\" for {name} in the inventory")


def build_venvs(plan: Plan, sessions: Mapping[str, Session], observer: Observer) -> VenvsDone:
    """Builds (or finds built) every node's venv, all nodes at once. Never raises for one
    node's failure: ``VenvsDone.failed`` says which and why."""
    started = time.monotonic()
    nodes = [node for node in plan.nodes if node.venv is not None]
    results = tuple(fan_out(nodes, lambda node: _build(node, sessions.get(node.host.name))))
    done = VenvsDone(results, time.monotonic() - started)
    observer(done)
    return done


def _build(node: NodePlan, session: Session | None) -> Union[VenvReady, VenvFailed]:
    assert node.venv is not None
    name = node.host.name
    if session is None:
        return VenvFailed(name, "no SSH session")
    stdin = (json.dumps(venv_config(node)) + "\n").encode()
    try:
        result = session.run(venv_command(node), stdin=stdin, timeout=BUILD_SECONDS)
    except TransportError as error:
        return VenvFailed(name, str(error))
    try:
        answer = json.loads(result.stdout.decode("utf-8", "replace").strip().splitlines()[-1])
    except (ValueError, IndexError):
        stderr = result.stderr.decode("utf-8", "replace").strip().splitlines()
        reason = stderr[-1] if stderr else f"exit status {result.exit_code}"
        return VenvFailed(name, f"the venv builder did not answer: {reason}")
    if "error" in answer:
        hint = missing_uv_hint(node) if answer.get("uv_missing") else (
            "make the lock installable on the node (its index reachable, or UV_OFFLINE=1 with every wheel in "
            "uv's cache), or run uv sync --frozen there to see more")
        return VenvFailed(name, str(answer["error"]), hint)
    return VenvReady(name, node.venv.path, bool(answer.get("built")), float(answer.get("seconds", result.seconds)),
                     str(answer.get("uv", "")))
