"""``venv``: a uv-locked project's venv on every node is the one its lock makes.

Each node's facts read the venv's marker (written once ``uv sync --frozen`` built it from
this lock) and ask the uv that built it whether a sync would change anything (``uv sync
--frozen --offline --check``): a package installed, removed or swapped there by hand since
is named, with the node. A venv not built yet is no failure here (``run`` builds it first;
``check --sync`` too); the project's lock on the node must be the controller's.
"""

from __future__ import annotations

import re

from torchherd.checks.analysis.common import per_node
from torchherd.checks.model import NodeFacts, Observed
from torchherd.checks.results import CheckResult
from torchherd.inventory import Host
from torchherd.plan import NodeVenv
from torchherd.shell import quote_path

CHECK = "venv"
CHANGE = re.compile(r"^([+~-]) ([A-Za-z0-9._-]+)(?:==(\S+)| @ \S+)?")
"""uv's lines for what a sync would do: ``+ name==1.0`` (or ``+ name @ file:///...``)
install, ``- name==1.0`` remove."""
SHOWN = 4


def venv_config(venv: NodeVenv) -> dict[str, str]:
    """What the node's facts script is asked about its venv."""
    return {"path": venv.path, "key": venv.key, "project": venv.project}


def analyse(observed: Observed) -> list[CheckResult]:
    if not observed.venvs:
        return []  # no uv-locked project: the report is the one it always was
    return per_node(observed, CHECK, _node)


def not_built(facts: NodeFacts) -> bool:
    """Whether the node has no venv built from this lock yet (then its python cannot run either)."""
    state = facts.get("venv")
    return isinstance(state, dict) and "error" not in state and state.get("marker") is None


def _node(observed: Observed, host: Host, facts: NodeFacts) -> CheckResult:
    venv = observed.venvs.get(host.name)
    if venv is None:
        return CheckResult(host.name, CHECK, "skip", "no venv for this node")
    state = facts.get("venv")
    if not isinstance(state, dict) or "error" in state:
        why = state.get("error") if isinstance(state, dict) else "no answer"
        return CheckResult(host.name, CHECK, "fail", f"{host.name}: cannot read the venv {venv.path}: {why}")
    if state.get("lock_hash") != venv.lock_hash:
        found = "no pyproject.toml and uv.lock" if state.get("lock_hash") is None else "another uv.lock or pyproject.toml"
        return CheckResult(host.name, CHECK, "fail",
                           f"the project on {host.name} ({venv.project}) has {found} than this machine's",
                           "send the project with its lock: torchherd check --sync (or run --sync)")
    if state.get("marker") is None:
        return CheckResult(host.name, CHECK, "skip",
                           f"{venv.path} not built from this lock yet: run builds it (check --sync too)")
    outcome = state.get("check") or {}
    if "error" in outcome or "code" not in outcome:
        return CheckResult(host.name, CHECK, "fail",
                           f"{host.name}: uv could not check the venv {venv.path}: {outcome.get('error', 'no answer')}",
                           _rebuild(host, venv, state))
    if outcome["code"] == 0:
        uv = state["marker"].get("uv", "uv")
        return CheckResult(host.name, CHECK, "pass",
                           f"{venv.path} matches uv.lock (sha256 {venv.lock_hash[:12]}; {uv} sync --check)")
    lines = [str(line) for line in outcome.get("lines") or []]
    matches = [match for line in lines if (match := CHANGE.match(line))]
    if matches and _reinstalls_only(matches):
        names = ", ".join(sorted({match.group(2) for match in matches}))
        return CheckResult(host.name, CHECK, "warn",
                           f"the venv on {host.name} has the lock's packages, but uv would reinstall {names} from "
                           "the project's own files (changed on the node, or their timestamps, since it was built)",
                           _rebuild(host, venv, state))
    changes = [_change(match.group(1), _package(match)) for match in matches]
    if changes:
        shown = ", ".join(changes[:SHOWN]) + (f" and {len(changes) - SHOWN} more" if len(changes) > SHOWN else "")
    else:
        shown = lines[-1] if lines else f"uv sync --check exited {outcome['code']}"
    return CheckResult(host.name, CHECK, "fail",
                       f"the venv on {host.name} differs from uv.lock (changed since it was built): a sync would "
                       f"{shown}", _rebuild(host, venv, state))


def _package(match: re.Match[str]) -> str:
    return match.group(2) + (f"=={match.group(3)}" if match.group(3) else "")


def _reinstalls_only(matches: list[re.Match[str]]) -> bool:
    """Whether a sync would only put back the same packages (a local path source whose file
    uv finds newer: same name, same version where shown), nothing added, removed or changed.
    The lock is unchanged (the key says so) and records a local wheel's hash: not a drift."""
    removed = {match.group(2): match.group(3) for match in matches if match.group(1) == "-"}
    added = {match.group(2): match.group(3) for match in matches if match.group(1) == "+"}
    return bool(removed) and removed.keys() == added.keys() and all(
        added[name] in (None, version) for name, version in removed.items()) and not any(
        match.group(1) == "~" for match in matches)


def _change(sign: str, package: str) -> str:
    return {"+": "install ", "-": "remove ", "~": "reinstall "}[sign] + package


def _rebuild(host: Host, venv: NodeVenv, state: dict[str, object]) -> str:
    marker = state.get("marker")
    uv = str(marker.get("uv", "uv")) if isinstance(marker, dict) else "uv"
    return (f"make it the lock's again on {host.name}: cd {quote_path(venv.project)} && "
            f"UV_PROJECT_ENVIRONMENT={quote_path(venv.path)} {quote_path(uv)} sync --frozen "
            f"(or remove {venv.path} there: the next run builds it)")
