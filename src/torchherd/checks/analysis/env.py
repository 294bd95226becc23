"""``env``: stray torchrun variables in the node's non-interactive shell, NCCL/GLOO/TORCH
variables that differ between nodes, a too small /dev/shm, a container."""

from __future__ import annotations

from torchherd.checks.analysis.common import per_node
from torchherd.checks.model import NodeFacts, Observed
from torchherd.checks.results import CheckResult
from torchherd.inventory import Host

CHECK = "env"
STRAY = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
         "MASTER_PORT")
COMPARED = ("NCCL_", "GLOO_", "TORCH_")
SHM_MINIMUM = 1 << 30
"""NCCL's shared-memory transport needs far more than Docker's default 64 MiB."""


def analyse(observed: Observed) -> list[CheckResult]:
    return per_node(observed, CHECK, _node)


def _env(facts: NodeFacts) -> dict[str, str]:
    found = facts.get("env")
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}


def _node(observed: Observed, host: Host, facts: NodeFacts) -> CheckResult:
    env = _env(facts)
    stray = sorted(name for name in env if name in STRAY or name.startswith("PET_"))
    if stray:
        shown = ", ".join(f"{name}={env[name]}" for name in stray)
        return CheckResult(host.name, CHECK, "warn", f"{host.name}'s shell sets {shown}",
                           f"remove {', '.join(stray)} from {host.name}'s shell startup files "
                           f"(~/.bashrc, ~/.profile, /etc/environment)")
    differing = _differences(observed, host, env)
    if differing:
        return CheckResult(host.name, CHECK, "warn",
                           f"{host.name} differs from {observed.master.name}: {'; '.join(differing)}",
                           "set NCCL_*/GLOO_*/TORCH_* the same on every node (or in the inventory's env)")
    shm = (facts.get("shm") or {}).get("bytes")
    if isinstance(shm, int) and shm < SHM_MINIMUM:
        return CheckResult(host.name, CHECK, "warn", f"/dev/shm on {host.name} is {shm >> 20} MiB",
                           "give the container more: docker --shm-size=8g or --ipc=host; or NCCL_SHM_DISABLE=1")
    notes = [f"/dev/shm {shm >> 30} GiB" if isinstance(shm, int) else "/dev/shm unknown"]
    if facts.get("container"):
        notes.append(f"container ({', '.join(facts.get('container'))})")
    return CheckResult(host.name, CHECK, "pass", f"no stray rank variables; {', '.join(notes)}")


def _differences(observed: Observed, host: Host, env: dict[str, str]) -> list[str]:
    master = observed.facts.get(observed.master.name)
    if master is None or host.name == observed.master.name:
        return []
    reference = _env(master)
    names = sorted({name for name in set(env) | set(reference) if name.startswith(COMPARED)})
    return [f"{name}={env.get(name, '(unset)')} vs {reference.get(name, '(unset)')}"
            for name in names if env.get(name) != reference.get(name)]
