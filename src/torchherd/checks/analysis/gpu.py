"""``gpu``: the GPUs a node sees are enough for nproc_per_node, and not already busy."""

from __future__ import annotations

from torchherd.checks.analysis.common import per_node
from torchherd.checks.model import NodeFacts, Observed
from torchherd.inventory import Host
from torchherd.results import CheckResult

CHECK = "gpu"


def analyse(observed: Observed) -> list[CheckResult]:
    return per_node(observed, CHECK, _node)


def gpu_count(facts: NodeFacts) -> int | None:
    torch = facts.get("torch") or {}
    if isinstance(torch.get("gpus"), int):
        return int(torch["gpus"])
    smi = (facts.get("gpu") or {}).get("nvidia_smi") or {}
    if smi.get("code") == 0:
        return len([line for line in str(smi.get("out")).splitlines() if line.strip()])
    return None


def _node(observed: Observed, host: Host, facts: NodeFacts) -> CheckResult:
    nproc = observed.nproc_of(host)
    count = gpu_count(facts)
    if count is None:
        return CheckResult(host.name, CHECK, "skip", "neither torch nor nvidia-smi could count GPUs here")
    if count == 0:
        if nproc == "gpu":
            return CheckResult(host.name, CHECK, "fail", f"no GPU visible on {host.name}, nproc_per_node = gpu",
                               "set nproc_per_node to a number (CPU, gloo) or check the driver (nvidia-smi)")
        return CheckResult(host.name, CHECK, "skip", f"CPU-only node: nproc_per_node = {nproc} runs on CPU (gloo)")
    if isinstance(nproc, int) and nproc > count:
        return CheckResult(host.name, CHECK, "fail",
                           f"{host.name} sees {count} GPU(s), nproc_per_node = {nproc}",
                           f"set nproc_per_node = {count}, or check CUDA_VISIBLE_DEVICES on {host.name}")
    apps = ((facts.get("gpu") or {}).get("compute_apps") or {})
    busy = [line for line in str(apps.get("out", "")).splitlines() if line.strip()]
    if busy:
        return CheckResult(host.name, CHECK, "warn", f"{count} GPU(s); already in use by: {'; '.join(busy)}",
                           f"stop the other jobs on {host.name} or expect less memory and speed")
    return CheckResult(host.name, CHECK, "pass", f"{count} GPU(s) visible for nproc_per_node = {nproc}")
