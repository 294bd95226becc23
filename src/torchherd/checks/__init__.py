"""``torchherd check``: preflight diagnostics over SSH, in parallel on every node.

``run_preflight`` verifies one job's plan (its master address, port, processes per
node, script and environment) on the nodes a connector reaches; the sessions that
worked and each node's network (address and interface) are handed back for the
launch to reuse. The smoke job is run by the engine (``engine.preflight``), which
hands what it saw back to ``checks.smoke`` for the verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from torchherd.checks.model import CHECK_IDS, Mesh, Observed
from torchherd.checks.results import CheckReport, CheckResult
from torchherd.plan import NodeNetwork, Plan
from torchherd.transport import Connector, Session

__all__ = ["CHECK_IDS", "CheckOptions", "PreflightOutcome", "run_preflight"]


@dataclass(frozen=True)
class CheckOptions:
    only: frozenset[str] | None = None
    skip: frozenset[str] = frozenset()
    smoke: bool = False
    mesh: Mesh = "auto"
    """"full": every node probes every other; "auto": full up to a threshold, then sampled."""
    bandwidth: bool = False
    """Measure the links' throughput and path MTU (``--bandwidth``; ``--smoke`` does too)."""
    min_bandwidth: float | None = None
    """Bits per second below which a link or node fails; None: the inventory's, else no floor."""
    gpu_diag: bool = False
    """Run DCGM's level-1 diagnostic where it is installed (``--gpu-diag``)."""
    torch_known: tuple[tuple[str, str], ...] = ()
    """(node, what imported its torch lately, "attempt 1's ranks"): there the facts read
    torch's versions from its files instead of importing it again (seconds of CPU each).
    A triage's, for the nodes whose ranks just ran."""
    torch_imported: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    """(node, ((fingerprint, what imported it: "a check 3 min ago"), ...)): installs of torch an earlier check imported on
    the node (``engine.ssh.imports``). Where the node's torch is still one of them (the
    same interpreter, files and variables), its facts read its versions from its files: a
    run's preflight, whose torchrun imports it seconds later anyway."""


@dataclass
class PreflightOutcome:
    report: CheckReport
    connections: Mapping[str, Session] = field(default_factory=dict)
    """Open, authenticated sessions to the nodes that answered; ``close()`` closes them."""
    networks: Mapping[str, NodeNetwork] = field(default_factory=dict)
    observed: Observed | None = None
    selected: tuple[str, ...] = ()

    def close(self) -> None:
        for connection in self.connections.values():
            connection.close()


def run_preflight(plan: Plan, options: CheckOptions, connector: Connector,
                  progress: Callable[[CheckResult], None] | None = None) -> PreflightOutcome:
    """Runs the selected checks (all but the smoke job) on every node of ``plan``;
    raises UsageError for an unknown check id."""
    from torchherd.checks import runner
    from torchherd.checks.analysis.bandwidth import figures as bandwidth_figures

    selected = runner.selected_checks(options.only, options.skip, options.smoke, options.bandwidth,
                                       options.gpu_diag)
    observed, connections = runner.collect(plan, selected, connector, progress, options.mesh,
                                           options.min_bandwidth, dict(options.torch_known),
                                           {node: dict(kept) for node, kept in options.torch_imported})
    results = runner.analyse(observed, selected)
    if progress is not None:
        for result in results:
            if result.check != "ssh":
                progress(result)
    report = CheckReport(tuple(results), bandwidth=bandwidth_figures(observed))
    return PreflightOutcome(report, connections, dict(observed.networks), observed, selected)
