"""``python``: the configured interpreter runs and imports torch, and python, torch,
CUDA and NCCL versions agree across nodes."""

from __future__ import annotations

from typing import Callable

from torchherd.checks.analysis.common import per_node
from torchherd.checks.analysis.venv import not_built
from torchherd.checks.model import NodeFacts, Observed
from torchherd.checks.results import CheckResult, CheckStatus
from torchherd.inventory import Host

CHECK = "python"


def analyse(observed: Observed) -> list[CheckResult]:
    found: list[tuple[str, dict[str, str]] | None] = []

    def reference() -> tuple[str, dict[str, str]] | None:
        # Once per run, not once per node (O(n^2): 3 of 4.5 s at 1,000 nodes); inside
        # per_node still, so malformed facts remain each node's malformed result.
        if not found:
            found.append(_reference(observed))
        return found[0]

    return per_node(observed, CHECK, lambda seen, host, facts: _node(seen, host, facts, reference))


UNREAD = "?"
"""A version the facts could not give without importing torch (NCCL's, read from its files)."""


def versions(facts: NodeFacts) -> dict[str, str]:
    torch = facts.get("torch") or {}
    python = facts.get("python") or {}
    nccl = UNREAD if torch.get("files") else str(torch.get("nccl") or "-")
    return {"python": str(python.get("version")), "torch": str(torch.get("version")),
            "CUDA": str(torch.get("cuda") or "-"), "NCCL": nccl}


def _reference(observed: Observed) -> tuple[str, dict[str, str]] | None:
    """The first node whose torch was imported (all of its versions known), else the first
    whose torch's files were read."""
    candidates = [(host.name, facts) for host in observed.inventory.hosts
                  if (facts := observed.facts.get(host.name)) is not None and host.container is None
                  and not facts.python_error and "version" in (facts.get("torch") or {})]
    ordered = sorted(candidates, key=lambda candidate: bool((candidate[1].get("torch") or {}).get("files")))
    return (ordered[0][0], versions(ordered[0][1])) if ordered else None


def _node(observed: Observed, host: Host, facts: NodeFacts,
          reference_of: Callable[[], tuple[str, dict[str, str]] | None]) -> CheckResult:
    if host.container is not None:  # the job's python is the image's: the container check reads it there
        return CheckResult(host.name, CHECK, "skip", f"the job runs in image {host.container.image}: the container "
                           "check reads python and torch inside it")
    if facts.python_error and host.name in observed.venvs and not_built(facts):
        return CheckResult(host.name, CHECK, "skip", f"{host.python} (the uv-locked project's venv) is not built "
                           "yet: run builds it (check --sync too)")
    if facts.python_error:
        return CheckResult(host.name, CHECK, "fail", f"python {host.python} does not run on {host.name}: "
                           f"{facts.python_error}",
                           f"set python for {host.name} in the inventory to the interpreter that has torch "
                           f"(an absolute path: the non-interactive shell skips ~/.bashrc)")
    torch = facts.get("torch") or {}
    if "error" in torch and host.name in observed.venvs:
        return CheckResult(host.name, CHECK, "fail",
                           f"{host.python} (the venv built from uv.lock) on {host.name} cannot import torch: "
                           f"{torch['error']}",
                           "add torch to the project's dependencies and lock it (uv add torch), or give the venv the "
                           "node python's own packages (run --uv-system-site-packages)")
    if "error" in torch:
        executable = (facts.get("python") or {}).get("executable")
        return CheckResult(host.name, CHECK, "fail",
                           f"{host.python} ({executable}) on {host.name} cannot import torch: {torch['error']}",
                           f"point python for {host.name} at the environment that has torch, or install it "
                           f"there: {host.python} -m pip install torch{_pin(reference_of())}")
    mine = versions(facts)
    reference = reference_of()
    shown = ", ".join(f"{key} {value}" for key, value in mine.items() if value != UNREAD)
    if torch.get("files"):
        shown += f" (read from its files: {_imported_by(observed, host.name, torch.get('fingerprint'))} imported it)"
    if reference is not None and reference[0] != host.name:
        differing = [key for key in mine if UNREAD not in (mine[key], reference[1][key]) and mine[key] != reference[1][key]]
        if differing:
            status: CheckStatus = "warn" if differing == ["python"] and _same_minor(mine, reference[1]) else "fail"
            return CheckResult(host.name, CHECK, status,
                               f"{shown}; differs from {reference[0]} in {', '.join(differing)} "
                               f"({', '.join(reference[1][key] for key in differing)})",
                               "install the same torch (and CUDA/NCCL) build on every node")
    return CheckResult(host.name, CHECK, "pass", shown)


def _imported_by(observed: Observed, node: str, fingerprint: object) -> str:
    """What imported the torch whose files were read: the run's own ranks (a triage's
    ``torch_known``), else the earlier check that imported this very install."""
    if node in observed.torch_known:
        return observed.torch_known[node]
    return observed.torch_imported.get(node, {}).get(str(fingerprint), "a recent run")


def _same_minor(mine: dict[str, str], other: dict[str, str]) -> bool:
    return mine["python"].split(".")[:2] == other["python"].split(".")[:2]


def _pin(reference: tuple[str, dict[str, str]] | None) -> str:
    return f"=={reference[1]['torch']}" if reference else ""
