"""``ssh``: the controller reaches and authenticates to every node non-interactively."""

from __future__ import annotations

from torchherd.checks.model import NodeFacts, Observed
from torchherd.checks.results import CheckResult

SLOW_SHELL_SECONDS = 2.0
"""A trivial command taking longer than this over SSH means a slow login shell."""
THIS_MACHINE = "this machine, no SSH (commands run in-process: no sshd, no keys)"
BUSY_PRESSURE = 50.0
"""Percent of the last 10 s in which some task on the node waited for a CPU (PSI) above
which its CPUs count as busy: a shell slow to start that used little CPU itself spent
the time waiting for them, and its startup files are not what to fix."""


def analyse(observed: Observed) -> list[CheckResult]:
    results = []
    for host in observed.inventory.hosts:
        error = observed.ssh_errors.get(host.name)
        if error is not None:
            results.append(CheckResult(host.name, "ssh", "fail", str(error), _where_given(error.hint, observed)))
            continue
        address = observed.ssh_addresses.get(host.name, host.address)
        note = observed.host_key_notes.get(host.name)
        reached = (THIS_MACHINE if host.transport == "local"
                   else f"logged in to {address} non-interactively, {note or 'host key verified'}")
        result = _shell_speed(host.name, reached,
                              observed.shell_seconds.get(host.name), observed.facts.get(host.name),
                              observed.shell_alone.get(host.name))
        if note is not None and "StrictHostKeyChecking no" in note and result.status == "pass":
            result = CheckResult(host.name, "ssh", "warn", result.summary,
                                 "your ssh config turns host key checking off for this node: use "
                                 "StrictHostKeyChecking accept-new (or yes) so that a key is at least pinned")
        results.append(result)
    return results


EITHER_SOURCE = "(in -H or the inventory)"
"""The transport's fix for an address, which knows no more than the host: where it was given
is the inventory's path (``-H`` or ``--nodelist`` for hosts given on the command line)."""


def _where_given(fix: str, observed: Observed) -> str:
    path = str(observed.inventory.path)
    return fix.replace(EITHER_SOURCE, f"given to {path}" if path in ("-H", "--nodelist") else f"in {path}")


def _shell_speed(node: str, logged_in: str, seconds: float | None, facts: NodeFacts | None,
                 alone: float | None = None) -> CheckResult:
    """``warn`` when a trivial command's round trip shows a slow remote shell startup, and
    timed again after the burst of every node's logins it still does."""
    if seconds is None:
        return CheckResult(node, "ssh", "pass", logged_in)
    if seconds <= SLOW_SHELL_SECONDS:
        return CheckResult(node, "ssh", "pass", f"{logged_in}; a trivial command's round trip took {seconds:.2f} s")
    if facts is not None and busy_node_explains(facts):
        return CheckResult(node, "ssh", "pass",
                           f"{logged_in}; its shell took {seconds:.1f} s to start but used "
                           f"{facts.get('shell_cpu_seconds'):.2f} s of CPU, while the node's CPUs were busy "
                           f"({_busy(facts)}): a busy node, not slow startup files")
    if alone is not None and alone <= SLOW_SHELL_SECONDS:
        return CheckResult(node, "ssh", "pass",
                           f"{logged_in}; its shell took {seconds:.1f} s to start among every node's logins, "
                           f"{alone:.2f} s timed again after them: a busy moment, not slow startup files")
    again = "" if alone is None else f", and {alone:.1f} s timed again after the other nodes' logins"
    return CheckResult(node, "ssh", "warn",
                       f"{logged_in}, but a trivial command (`true`) took {seconds:.1f} s over SSH (over "
                       f"{SLOW_SHELL_SECONDS:g} s){again}: the remote shell's startup is slow, and every command "
                       f"torchherd runs there pays it",
                       f"on {node}, make non-interactive shells skip the slow part of the startup files "
                       f"(~/.bashrc is read even by `ssh host cmd`: put `case $- in *i*) ;; *) return;; esac` "
                       f"above conda/module/nvm init, network-mounted paths and similar); time it with "
                       f"`time ssh {node} true`")


def busy_node_explains(facts: NodeFacts | None) -> bool:
    """A shell slow to start that used little CPU itself while the node's CPUs were busy."""
    cpu = facts.get("shell_cpu_seconds") if facts is not None else None
    return _busy(facts) is not None and isinstance(cpu, (int, float)) and cpu < SLOW_SHELL_SECONDS


def _busy(facts: NodeFacts | None) -> str | None:
    """What shows the node's CPUs were busy when the facts ran, or None."""
    found = facts.get("cpu_contention") if facts is not None else None
    if not isinstance(found, dict):
        return None
    pressure, load, cpus = found.get("pressure"), found.get("load"), found.get("cpus")
    if isinstance(pressure, (int, float)):
        return f"a task waited for a CPU {pressure:.0f}% of the last 10 s" if pressure >= BUSY_PRESSURE else None
    if isinstance(load, (int, float)) and isinstance(cpus, int) and cpus > 0 and load >= cpus:
        return f"load {load:.1f} on {cpus} CPUs"
    return None
