"""The preflight of a plan over SSH: the checks (``checks.run_preflight``), and with
``smoke`` a real tiny job run the way ``run`` runs one (``run_quietly``). ``check`` needs
this module alone; ``launch`` (``engine.ssh.launch``) runs it before starting the job."""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Callable, Mapping

from torchherd.checks import CheckOptions, PreflightOutcome, run_preflight
from torchherd.checks import smoke as smoke_check
from torchherd.checks.analysis import port as port_check
from torchherd.checks.analysis.smoke import SmokeRun
from torchherd.checks.model import NodeFacts
from torchherd.checks.results import CheckReport, CheckResult, ProbeResult
from torchherd.errors import TransportError
from torchherd.plan import NodePlan, Plan
from torchherd.transport import Connector, Session, fan_out


def preflight(plan: Plan, options: CheckOptions, connector: Connector,
              progress: Callable[[CheckResult], None] | None = None) -> PreflightOutcome:
    """The checks on ``plan``, and with ``options.smoke`` a real tiny job run the way
    ``run`` runs one. The caller closes the outcome."""
    outcome = run_preflight(plan, options, connector, progress)
    if outcome.observed is not None:
        _keep_imports(plan, outcome.observed.facts)
    if "smoke" not in outcome.selected or outcome.observed is None:
        return outcome
    results = list(outcome.report.results)
    smoke = _smoke(outcome, results)
    if progress is not None:
        for result in smoke:
            progress(result)
    outcome.report = CheckReport(tuple(results + smoke))
    return outcome


def _keep_imports(plan: Plan, facts: Mapping[str, NodeFacts]) -> None:
    from torchherd.engine.ssh.imports import keep_imports

    # What is kept only spares a later preflight an import: a state directory that
    # cannot be written costs that, never the check.
    with contextlib.suppress(OSError):
        keep_imports(plan.inventory.hosts, facts)


def with_probes(outcome: PreflightOutcome) -> CheckReport:
    """The report, with every cross-node connect the probes made (``check``'s matrix)."""
    report, observed = outcome.report, outcome.observed
    if observed is None:
        return report
    probes = [ProbeResult(probe.prober, probe.peer, probe.kind, str(probe.outcome.get("result")),
                          probe.verdict == "fail")
              for prober in observed.connected for probe in port_check.probes_of(observed, prober)]
    return dataclasses.replace(report, probes=tuple(probes))


RUNS_WHEN_SLOW = frozenset({"bandwidth"})
"""Failed checks the smoke job still runs after: a link under the bandwidth floor still
carries a job, and the smoke's own all_reduce figure says how slow the collective is."""


def _smoke(outcome: PreflightOutcome, results: list[CheckResult]) -> list[CheckResult]:
    observed = outcome.observed
    assert observed is not None
    if any(result.status == "fail" and result.check not in RUNS_WHEN_SLOW for result in results):
        return [CheckResult(host.name, "smoke", "skip", "not run: a static check failed")
                for host in observed.inventory.hosts]
    missing = smoke_check.unreachable(observed, set(outcome.connections))
    if missing:
        return missing
    plan = smoke_check.smoke_plan(observed)
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="torchherd-smoke-") as log_dir:
            ran = run_quietly(plan, outcome.connections, Path(log_dir), smoke_check.JOB_TIMEOUT)
    finally:
        _clean_smoke(plan, outcome.connections)
    return smoke_check.verdicts(observed, ran, time.monotonic() - started)


def _clean_smoke(plan: Plan, sessions: Mapping[str, Session]) -> None:
    def clean(node: NodePlan) -> None:
        try:
            sessions[node.host.name].run(smoke_check.cleanup_command(node), timeout=10.0)
        except TransportError:  # a node that went away keeps its files; its verdict says why
            pass

    fan_out(list(plan.nodes), clean)


def run_quietly(plan: Plan, sessions: Mapping[str, Session], log_dir: Path, timeout: float,
                grace: float = 2.0) -> SmokeRun:
    """Runs ``plan`` like ``run`` (same supervisor, fail-fast teardown, torchrun started warm
    on each node unless ``[recovery] warm = false``), reporting nothing; every node is
    stopped after ``timeout`` seconds. Every line each node printed is kept."""
    # A job's own: `check` without the smoke job does without their imports.
    from torchherd.engine.events import Collector
    from torchherd.engine.run import LaunchOptions
    from torchherd.engine.ssh.job import Job

    collector = Collector()
    job = Job(plan, sessions, LaunchOptions(log_dir=log_dir, grace=grace, timeout=timeout,
                                            warm_start=plan.inventory.recovery.warm), collector)
    job.start_all()
    summary = job.supervise()
    lines = {name: tuple(collector.lines.get(name, ())) for name in job.nodes}
    return SmokeRun(summary, lines, job.timed_out)
