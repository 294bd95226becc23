"""A uv-locked project's venv on every node, after the sync and before the preflight.

Per node, one command runs ``remote/venv.py`` with the node's configured python: when the
venv's marker holds the plan's key (same lock, python and kind of venv) nothing else runs;
else it finds uv there and runs ``uv sync --frozen`` into the venv. The job's environment
(``[defaults].env``, ``--env``: an index URL, ``UV_OFFLINE``, a proxy) reaches uv through
the program's stdin, never a command line. A node without uv (and none configured) gets
this machine's own uv binary, when it runs there (Linux, the same machine and libc), else
the binary of the ``uv`` wheel for the node's platform from a local wheel directory
(engine/prepare/uvwheels.py), sent over SFTP beside the node's venvs. With ``--uv-offline`` a node
that must build gets the lock's wheels from this machine (``engine.prepare.offline``: made once per
node platform and python, relayed node to node; the observer is told ``WheelsStarted``, each node's ``WheelsProgress``
and ``WheelsRelayed``) and
builds from them with no network; a node whose venv is built costs what it always did. The
observer is told ``VenvsDone``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import posixpath
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence, Union

from torchherd.engine.events import Observer, VenvFailed, VenvReady, VenvsDone, WheelsRelayed, WheelsStarted
from torchherd.engine.prepare.offline import (
    Wheelhouse,
    WheelhouseError,
    export_requirements,
    make_wheelhouse,
    project_build,
    relay_wheelhouse,
)
from torchherd.engine.prepare.uvwheels import (
    DEFAULT_WHEELS,
    MalformedAnswer,
    NodePlatform,
    WheelError,
    extract_uv,
    find_wheel,
    missing_wheel,
    reported,
    reported_platform,
    wheel_dirs,
)
from torchherd.engine.prepare.wheelhouse import looks_offline, node_dir, platforms
from torchherd.errors import TransportError
from torchherd.plan import NodePlan, Plan
from torchherd.remote import command
from torchherd.shell import quote_path
from torchherd.transport import Session, fan_out

EXTRACTED = Path.home() / ".cache" / "torchherd" / "uv"
"""Where a uv binary taken out of a wheel is kept (under its hash) before it is sent."""

BUILD_SECONDS = 3600.0
"""How long one node's ``uv sync`` may take: a first build downloads torch and CUDA's
libraries (gigabytes); a cached venv answers in well under a second."""


def venv_command(node: NodePlan) -> str:
    """The node program that builds (or finds) the venv, with the configured python."""
    assert node.venv is not None
    return f"{quote_path(node.venv.python)} {command('venv.py')}"


def venv_config(node: NodePlan, offline: bool = False) -> dict[str, object]:
    """What ``remote/venv.py`` reads on its stdin (``offline``: its build from the
    wheelhouse relayed beside its venvs, ``engine.prepare.offline``)."""
    venv = node.venv
    assert venv is not None
    config: dict[str, object] = {"path": venv.path, "key": venv.key, "project": venv.project, "uv": list(venv.uv),
                                 "system_site_packages": venv.system_site_packages, "env": dict(node.env)}
    if offline:
        config["wheelhouse"] = node_dir(venv.path, venv.key)
    return config


@dataclass(frozen=True)
class NeedsWheels:
    """A node that must build its venv and has no wheelhouse yet (``--uv-offline``): its
    platform and python, and the config to ask it again with once the wheelhouse is there."""

    node: NodePlan
    platform: NodePlatform
    python: str
    config: Mapping[str, object]
    shipped: bool = False
    wheel: str = ""


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
    wheels = plan.inventory.uv.wheels
    offline = plan.options.uv is not None and plan.options.uv.offline
    first = fan_out(nodes, lambda node: _build(node, sessions.get(node.host.name), wheels, offline))
    needing = [result for result in first if isinstance(result, NeedsWheels)]
    supplied = supply_wheels(plan, needing, sessions, observer) if needing else {}
    results = tuple(supplied[result.node.host.name] if isinstance(result, NeedsWheels) else result
                    for result in first)
    done = VenvsDone(results, time.monotonic() - started)
    observer(done)
    return done


def _build(node: NodePlan, session: Session | None, wheels: str | None = None,
           offline: bool = False) -> Union[VenvReady, VenvFailed, NeedsWheels]:
    assert node.venv is not None
    name = node.host.name
    if session is None:
        return VenvFailed(name, "no SSH session")
    try:
        return _build_with(node, session, wheels, offline)
    except MalformedAnswer as malformed:
        return VenvFailed(name, str(malformed), "the node's venv builder (remote/venv.py) reports what Python's "
                                                "platform module reads there: see what answers in its place")


def _build_with(node: NodePlan, session: Session, wheels: str | None,
                offline: bool) -> Union[VenvReady, VenvFailed, NeedsWheels]:
    """``_build`` with a session; raises MalformedAnswer for a platform answer that is not one."""
    assert node.venv is not None
    name = node.host.name
    config = venv_config(node, offline)
    answer = _ask(session, node, config)
    if answer.get("wheelhouse_missing"):
        return NeedsWheels(node, reported_platform(answer), reported(answer, "python"), config)
    if "error" not in answer or not answer.get("uv_missing") or node.host.uv is not None:
        return _outcome(node, answer, offline=offline)
    # No uv on the node, none configured: this machine's own, where it runs there; else
    # the binary of the uv wheel for the node's platform, from a wheel directory here.
    platform_there = reported_platform(answer)
    local = local_uv()
    if local is None or _not_for(local, answer):
        try:
            local = uv_from_wheel(platform_there, wheels, name)
        except WheelMissing as missing:
            return VenvFailed(name, str(answer["error"]), f"{missing}; or {missing_uv_hint(node)}")
    try:
        shipped = ship_uv(session, node, local)
    except TransportError as error:
        return VenvFailed(name, f"{answer['error']}; sending this machine's uv failed: {error}", missing_uv_hint(node))
    config = {**config, "uv": [shipped]}
    answer = _ask(session, node, config)
    if answer.get("wheelhouse_missing"):
        return NeedsWheels(node, reported_platform(answer), reported(answer, "python"), config, True, local.wheel)
    return _outcome(node, answer, shipped=True, wheel=local.wheel, offline=offline)


def supply_wheels(plan: Plan, needing: Sequence[NeedsWheels], sessions: Mapping[str, Session],
                  observer: Observer) -> dict[str, Union[VenvReady, VenvFailed]]:
    """The lock's wheels made here once per node platform and python, relayed to the nodes
    of ``needing`` (in node-rank order: the master first), which are then asked again to
    build. Per node, its venv's outcome."""
    assert plan.options.sync is not None and plan.options.uv is not None
    wheels = plan.inventory.uv.wheels
    by_name = {item.node.host.name: item for item in needing}
    project = Path(plan.options.sync.source)
    try:
        exported = export_requirements(project)
    except WheelhouseError as error:
        return {name: VenvFailed(name, str(error), error.hint) for name in by_name}
    # uv export leaves the project out; a package project is installed editable on the
    # node, as uv sync does, with its build backend's wheels sent in the wheelhouse.
    build = project_build(project)
    outcomes: dict[str, Union[VenvReady, VenvFailed]] = {}
    groups = platforms([(name, item.platform, item.python) for name, item in by_name.items()])
    for (tag, python), names in groups.items():
        started = time.monotonic()
        first = by_name[names[0]]
        try:
            house = make_wheelhouse(exported, plan.options.uv.lock_hash, first.platform, first.python, wheels,
                                    observer=observer, build=build, project=project)
        except WheelhouseError as error:
            outcomes.update({name: VenvFailed(name, str(error), error.hint) for name in names})
            continue
        chains = _chains([by_name[name] for name in names])
        routes = tuple(tuple(node.host.name for node, _ in targets) for targets in chains)
        observer(WheelsStarted(tag, python, str(house.path), routes, len(house.files), house.size))
        reached, sent = _relay(house, chains, sessions, observer)
        failed = tuple((name, why) for name in names if (why := reached[name]) is not None)
        observer(WheelsRelayed(tag, python, str(house.path), routes, len(house.files), house.size, sent,
                               house.downloaded, time.monotonic() - started, failed))
        # Every node is asked again, those the copy did not reach too: nodes that share
        # a directory may have it from another.
        answers = fan_out(names, lambda name: _ask(sessions[name], by_name[name].node, by_name[name].config))
        for name, answer in zip(names, answers):
            item = by_name[name]
            if answer.get("wheelhouse_missing"):
                why = reached[name] or "not there after the copy"
                outcomes[name] = VenvFailed(name, f"the lock's wheels did not reach {name}: {why}",
                                            "see the copy's error above; nodes relay it to each other over the "
                                            "address the job uses (local_addr, else address)")
            else:
                outcomes[name] = _outcome(item.node, answer, item.shipped, item.wheel, offline=True)
    return outcomes


def _chains(nodes: Sequence[NeedsWheels]) -> list[list[tuple[NodePlan, str]]]:
    """One chain per place the nodes receive it at (nodes whose pythons differ have venvs,
    and wheelhouse names, of their own): each node with its target path, in node-rank order."""
    chains: dict[str, list[tuple[NodePlan, str]]] = {}
    for item in nodes:
        target = str(item.config["wheelhouse"])
        chains.setdefault(target.rsplit("/", 1)[-1], []).append((item.node, target))
    return list(chains.values())


def _relay(house: Wheelhouse, chains: Sequence[Sequence[tuple[NodePlan, str]]], sessions: Mapping[str, Session],
           observer: Observer) -> tuple[dict[str, str | None], int]:
    """``chains`` one after the other: this machine sends the wheelhouse once per chain."""
    reached: dict[str, str | None] = {}
    sent = 0
    for targets in chains:
        results, bytes_sent = relay_wheelhouse(house, targets, sessions, observer=observer)
        reached.update(results)
        sent += bytes_sent
    return reached, sent


def _ask(session: Session, node: NodePlan, config: Mapping[str, object]) -> dict[str, Any]:
    stdin = (json.dumps(config) + "\n").encode()
    try:
        result = session.run(venv_command(node), stdin=stdin, timeout=BUILD_SECONDS)
    except TransportError as error:
        return {"error": str(error)}
    try:
        answer = json.loads(result.stdout.decode("utf-8", "replace").strip().splitlines()[-1])
    except (ValueError, IndexError):
        stderr = result.stderr.decode("utf-8", "replace").strip().splitlines()
        reason = stderr[-1] if stderr else f"exit status {result.exit_code}"
        return {"error": f"the venv builder did not answer: {reason}"}
    answer.setdefault("seconds", result.seconds)
    return dict(answer)


def _outcome(node: NodePlan, answer: Mapping[str, Any], shipped: bool = False,
             wheel: str = "", offline: bool = False) -> Union[VenvReady, VenvFailed]:
    assert node.venv is not None
    name = node.host.name
    if "error" in answer:
        error = str(answer["error"])
        if answer.get("uv_missing"):
            hint = missing_uv_hint(node)
        elif answer.get("editable"):
            hint = ("the project's build backend was sent in the wheelhouse (build/requires.txt there names it), from "
                    f"[uv] wheels, {DEFAULT_WHEELS} or pip's cache, else pip download: put the wheels the build lacks "
                    "there, for the node's python")
        elif offline:
            hint = ("the wheelhouse was made from uv export of the lock (each wheel by the lock's hash, from "
                    f"{DEFAULT_WHEELS} or [uv] wheels, else pip download) and is sent again on the next run")
        elif looks_offline(error):
            hint = (f"{name} reaches no package index: --uv-offline (or [uv] offline = true) sends it the lock's "
                    "wheels from this machine, downloaded once and relayed node to node")
        else:
            hint = ("make the lock installable on the node (its index reachable, or UV_OFFLINE=1 with every wheel "
                    "in uv's cache), or run uv sync --frozen there to see more")
        return VenvFailed(name, error, hint)
    return VenvReady(name, node.venv.path, bool(answer.get("built")), float(answer.get("seconds", 0.0)),
                     str(answer.get("uv", "")), shipped, wheel, offline and bool(answer.get("built")))


@dataclass(frozen=True)
class LocalUv:
    """This machine's uv binary, as it would run on a node."""

    path: Path
    digest: str
    system: str
    machine: str
    libc: str
    wheel: str = ""
    """The wheel it was taken out of; "": this machine's own."""


@functools.lru_cache(maxsize=1)
def local_uv() -> LocalUv | None:
    """This machine's own uv binary (beside this python: the ``uv`` package's; else on PATH),
    when it is one (an ELF file, not a shim script)."""
    for candidate in (Path(sys.executable).parent / "uv", Path(shutil.which("uv") or "/nonexistent")):
        try:
            path = candidate.resolve()
            with path.open("rb") as file:
                if file.read(4) != b"\x7fELF":
                    continue
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            continue
        return LocalUv(path, digest, platform.system(), platform.machine(), platform.libc_ver()[0])
    return None


class WheelMissing(Exception):
    """No uv wheel here for the node's platform (or an unreadable one): the one-line fix."""


def uv_from_wheel(node: NodePlatform, wheels: str | None, node_name: str = "") -> LocalUv:
    """The binary of the newest uv wheel here for ``node``'s platform, extracted once under
    its hash. Raises WheelMissing with the node, its platform and the download that fixes it."""
    found = find_wheel(wheel_dirs(wheels), node)
    if found is None:
        raise WheelMissing(missing_wheel(node_name or "the node", node, wheels))
    try:
        path, digest = extract_uv(found.path, EXTRACTED)
    except WheelError as error:
        raise WheelMissing(f"{error}: {missing_wheel(node_name or 'the node', node, wheels)}") from None
    return LocalUv(path, digest, node.system, node.machine, node.libc, found.path.name)


def _not_for(local: LocalUv | None, answer: Mapping[str, Any]) -> str:
    """Why this machine's uv would not run on the node ("" when it would)."""
    if local is None:
        return "this machine has no uv binary to send"
    node = (str(answer.get("system", "")), str(answer.get("machine", "")), str(answer.get("libc", "")))
    if node != (local.system, local.machine, local.libc):
        return (f"this machine's uv is for {local.system} {local.machine} {local.libc or 'no glibc'}, the node is "
                f"{node[0]} {node[1]} {node[2] or 'no glibc'}")
    return ""


def ship_uv(session: Session, node: NodePlan, local: LocalUv) -> str:
    """Sends ``local`` beside the node's venvs (as local, or as shared, as they are), under
    its hash: a node that has it already (a shared directory, an earlier run) gets nothing.
    Returns its path on the node."""
    assert node.venv is not None
    final = posixpath.join(posixpath.dirname(node.venv.path), f"uv-{local.digest[:16]}")
    # One already there is taken only when it is this user's own file, not a link (another
    # user's file of that name is replaced, never run; the node program lstats it again).
    found = session.run(f"mkdir -p {quote_path(posixpath.dirname(final))} && test ! -h {quote_path(final)} "
                        f"&& test -f {quote_path(final)} && test -x {quote_path(final)} && test -O {quote_path(final)}",
                        timeout=60.0)
    if found.exit_code == 0:
        return final
    partial = f"{final}.{os.getpid()}-{node.host.name}"
    # SFTP takes no ~: a path there is relative to the home directory already.
    session.put(partial[2:] if partial.startswith("~/") else partial, local.path.read_bytes(), 0o700)
    moved = session.run(f"mv -f {quote_path(partial)} {quote_path(final)}", timeout=60.0)
    if moved.exit_code != 0:
        raise TransportError(node.host.name, "uv", moved.stderr.decode("utf-8", "replace").strip() or "mv failed")
    return final
