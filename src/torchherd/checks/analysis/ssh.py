"""``ssh``: the controller reaches and authenticates to every node non-interactively."""

from __future__ import annotations

from torchherd.checks.model import Observed
from torchherd.results import CheckResult


def analyse(observed: Observed) -> list[CheckResult]:
    results = []
    for host in observed.inventory.hosts:
        error = observed.ssh_errors.get(host.name)
        if error is not None:
            results.append(CheckResult(host.name, "ssh", "fail", str(error), error.hint))
            continue
        address = observed.ssh_addresses.get(host.name, host.address)
        results.append(CheckResult(host.name, "ssh", "pass",
                                   f"logged in to {address} non-interactively, host key verified"))
    return results
