"""``torchherd check``: preflight diagnostics over SSH, in parallel on every node.

``run_preflight`` is what the CLI and ``run`` call; the connections that worked and
each node's network (address and interface) are handed back for the launch to reuse.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from torchherd.checks.model import CHECK_IDS
from torchherd.inventory import Inventory
from torchherd.plan import NodeNetwork
from torchherd.results import CheckReport, CheckResult
from torchherd.transport import Connection

__all__ = ["CHECK_IDS", "CheckOptions", "PreflightOutcome", "run_preflight"]


@dataclass(frozen=True)
class CheckOptions:
    only: frozenset[str] | None = None
    skip: frozenset[str] = frozenset()
    script: str | None = None
    smoke: bool = False
    accept_new_host_keys: bool = False


@dataclass
class PreflightOutcome:
    report: CheckReport
    connections: Mapping[str, Connection] = field(default_factory=dict)
    """Open, authenticated connections to the nodes that answered; ``close()`` closes them."""
    networks: Mapping[str, NodeNetwork] = field(default_factory=dict)

    def close(self) -> None:
        for connection in self.connections.values():
            connection.close()


def run_preflight(inventory: Inventory, options: CheckOptions,
                  progress: Callable[[CheckResult], None] | None = None) -> PreflightOutcome:
    """Runs the selected checks on every node; raises UsageError for an unknown check id."""
    from torchherd.checks import runner

    selected = runner.selected_checks(options.only, options.skip, options.smoke)
    observed, connections = runner.collect(inventory, selected, options.script, options.accept_new_host_keys,
                                           progress)
    results = runner.analyse(observed, selected)
    if "smoke" in selected:
        results += runner.smoke_results(observed, connections, results)
    if progress is not None:
        for result in results:
            if result.check != "ssh":
                progress(result)
    return PreflightOutcome(CheckReport(tuple(results)), connections, dict(observed.networks))
