"""``ssh``: the controller reaches and authenticates to every node non-interactively."""

from __future__ import annotations

from torchherd.checks.model import Observed
from torchherd.results import CheckResult

SLOW_SHELL_SECONDS = 2.0
"""A trivial command taking longer than this over SSH means a slow login shell."""


def analyse(observed: Observed) -> list[CheckResult]:
    results = []
    for host in observed.inventory.hosts:
        error = observed.ssh_errors.get(host.name)
        if error is not None:
            results.append(CheckResult(host.name, "ssh", "fail", str(error), error.hint))
            continue
        address = observed.ssh_addresses.get(host.name, host.address)
        note = observed.host_key_notes.get(host.name)
        result = _shell_speed(host.name, f"logged in to {address} non-interactively, {note or 'host key verified'}",
                              observed.shell_seconds.get(host.name))
        if note is not None and "StrictHostKeyChecking no" in note and result.status == "pass":
            result = CheckResult(host.name, "ssh", "warn", result.summary,
                                 "your ssh config turns host key checking off for this node: use "
                                 "StrictHostKeyChecking accept-new (or yes) so that a key is at least pinned")
        results.append(result)
    return results


def _shell_speed(node: str, logged_in: str, seconds: float | None) -> CheckResult:
    """``warn`` when a trivial command's round trip shows a slow remote shell startup."""
    if seconds is None:
        return CheckResult(node, "ssh", "pass", logged_in)
    if seconds <= SLOW_SHELL_SECONDS:
        return CheckResult(node, "ssh", "pass", f"{logged_in}; a trivial command's round trip took {seconds:.2f} s")
    return CheckResult(node, "ssh", "warn",
                       f"{logged_in}, but a trivial command (`true`) took {seconds:.1f} s over SSH (over "
                       f"{SLOW_SHELL_SECONDS:g} s): the remote shell's startup is slow, and every command "
                       f"torchherd runs there pays it",
                       f"on {node}, make non-interactive shells skip the slow part of the startup files "
                       f"(~/.bashrc is read even by `ssh host cmd`: put `case $- in *i*) ;; *) return;; esac` "
                       f"above conda/module/nvm init, network-mounted paths and similar); time it with "
                       f"`time ssh {node} true`")
