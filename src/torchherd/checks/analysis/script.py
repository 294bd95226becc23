"""``script``: the training script exists at the same path on every node, same content."""

from __future__ import annotations

from torchherd.checks.analysis.common import per_node
from torchherd.checks.model import NodeFacts, Observed
from torchherd.checks.results import CheckResult
from torchherd.inventory import Host

CHECK = "script"


def analyse(observed: Observed) -> list[CheckResult]:
    if observed.script is None:
        return [CheckResult(host.name, CHECK, "skip", "no script given (torchherd check -- SCRIPT)")
                for host in observed.inventory.hosts]
    return per_node(observed, CHECK, _node)


def _reference(observed: Observed) -> tuple[str, str] | None:
    for host in observed.inventory.hosts:
        facts = observed.facts.get(host.name)
        digest = ((facts.get("script") if facts else None) or {}).get("sha256")
        if digest:
            return host.name, str(digest)
    return None


def _node(observed: Observed, host: Host, facts: NodeFacts) -> CheckResult:
    found = facts.get("script") or {}
    path = found.get("path", observed.script)
    if "sha256" not in found:
        return CheckResult(host.name, CHECK, "fail", f"{path} on {host.name}: {found.get('error', 'not readable')}",
                           f"send your project there with `torchherd run --sync` (or scp {observed.script} "
                           f"{host.address}:{path}, or a shared filesystem); workdir for {host.name} is "
                           f"{host.workdir}")
    reference = _reference(observed)
    if reference is not None and reference[1] != found["sha256"]:
        return CheckResult(host.name, CHECK, "warn",
                           f"{path} on {host.name} differs from {reference[0]}'s "
                           f"(sha256 {found['sha256'][:12]} vs {reference[1][:12]})",
                           "send the same version to every node: `torchherd run --sync` (or check out the same "
                           "commit)")
    return CheckResult(host.name, CHECK, "pass", f"{path} (sha256 {found['sha256'][:12]})")
