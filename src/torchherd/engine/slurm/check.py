"""``check`` for a SLURM cluster: SLURM's own view, then the SSH checks' facts and probes
run as job steps inside a short allocation of the job's own shape.

torchherd never reaches SLURM's nodes over SSH; it reaches them as ``srun --overlap``
steps of an allocation (``salloc --no-shell``), through the submit host. ``transport.srun.SrunSession``
makes each allocated node a transport ``Session``, so the checks run unchanged: the
facts script, the listeners and the cross-node probes are the same programs, started
as steps instead of SSH commands. The allocation is cancelled at the end, whatever
happened; when SLURM cannot grant it at once (``--immediate``), the node checks are
reported as skipped, with why.
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import Callable

from torchherd.checks import CheckOptions, run_preflight
from torchherd.checks.analysis import slurm as analysis
from torchherd.checks.model import CHECK_IDS
from torchherd.checks.results import CLUSTER, CheckReport, CheckResult
from torchherd.engine.slurm.batch import (
    BatchJob,
    batch_job,
    salloc_command,
)
from torchherd.engine.slurm.commands import (
    COMMAND_TIMEOUT,
    ask,
    cancel_and_wait,
    frontend,
    hostnames,
    parse_salloc,
    queue_state,
)
from torchherd.engine.slurm.settings import settings_of
from torchherd.errors import TorchherdError, TransportError, UsageError
from torchherd.plan import Plan, build_plan
from torchherd.transport import Connector, Session
from torchherd.transport.srun import SrunConnector


def slurm_view(session: Session, plan: Plan, batch: BatchJob, test_submit: bool = True) -> list[CheckResult]:
    """What SLURM itself says: partitions and nodes (sinfo), and (``test_submit``) whether
    it would take the job (``sbatch --test-only``, the script on stdin: nothing is submitted)."""
    try:
        rows = analysis.parse_sinfo(ask(session, f"sinfo -h -N -o {shlex.quote(analysis.SINFO_FORMAT)}", "sinfo"))
    except (TorchherdError, TransportError) as error:
        return [CheckResult(CLUSTER, "slurm", "fail", str(error), "is SLURM's controller up? (scontrol ping)")]
    results = analysis.slurm_view(rows, settings_of(plan.inventory), batch.placement, plan.nproc_per_node)
    if not test_submit:
        return results
    test = session.run("sbatch --test-only", stdin=batch.script.encode("utf-8"), timeout=COMMAND_TIMEOUT)
    said = test.stderr.decode("utf-8", "replace").strip().splitlines()
    last = said[-1].removeprefix("sbatch: ") if said else f"exit {test.exit_code}"
    if test.exit_code == 0:
        results.append(CheckResult(CLUSTER, "sbatch", "pass", f"SLURM would take the job: {last}"))
    else:
        results.append(CheckResult(CLUSTER, "sbatch", "fail", f"SLURM would refuse the job: {last}",
                                   "torchherd run --dry-run shows the batch script"))
    return results


SLURM_CHECKS = ("slurm", "slurm-node", "gres", "sbatch")


ALLOCATION_WAIT = 30
"""Seconds SLURM may take to grant check's allocation (--immediate): a preflight must
not wait in the queue for hours."""


IN_ALLOCATION = tuple(check for check in CHECK_IDS if check not in ("ssh", "ping", "smoke"))
"""The SSH checks that make sense as steps: not ``ssh`` (there is none) nor ``ping``
(from the controller, which may not reach SLURM's nodes); the smoke job is ``run``'s."""


def check(plan: Plan, options: CheckOptions, connector: Connector,
          progress: Callable[[CheckResult], None] | None = None) -> CheckReport:
    """SLURM's view of the job, then (when any is selected) the node checks as steps
    inside an allocation like the job's."""
    wanted = _wanted(options)
    batch = batch_job(plan, settings_of(plan.inventory))
    try:
        session = frontend(plan.inventory, connector)
    except TransportError as error:
        return _report([CheckResult(CLUSTER, "slurm", "fail", str(error), error.hint)], progress)
    try:
        results = [result for result in slurm_view(session, plan, batch, "sbatch" in wanted)
                   if result.check in wanted]
        _emit(results, progress)
        inside = tuple(check for check in IN_ALLOCATION if check in wanted)
        if inside and not any(result.status == "fail" for result in results):
            results += in_allocation(plan, batch, session, dataclasses.replace(options, only=frozenset(inside),
                                                                               skip=frozenset()),
                                     lambda: frontend(plan.inventory, connector), progress)
    finally:
        session.close()
    return CheckReport(tuple(results))


def _wanted(options: CheckOptions) -> frozenset[str]:
    known = SLURM_CHECKS + IN_ALLOCATION
    unknown = sorted(((options.only or frozenset()) | options.skip) - set(known) - set(CHECK_IDS))
    if unknown:
        raise UsageError(f"unknown check id {', '.join(unknown)}", f"SLURM runs know: {', '.join(known)}")
    # The measurements are opt-in here as in an SSH check (--bandwidth, or named in --only).
    measured = options.bandwidth or options.smoke or bool(options.only and {"bandwidth", "mtu"} & options.only)
    return frozenset(check for check in known if (options.only is None or check in options.only)
                     and check not in options.skip and (measured or check not in ("bandwidth", "mtu")))


def _emit(results: list[CheckResult], progress: Callable[[CheckResult], None] | None) -> None:
    if progress is not None:
        for result in results:
            progress(result)


def _report(results: list[CheckResult], progress: Callable[[CheckResult], None] | None) -> CheckReport:
    _emit(results, progress)
    return CheckReport(tuple(results))


def in_allocation(plan: Plan, batch: BatchJob, session: Session, options: CheckOptions,
                  open_front: Callable[[], Session],
                  progress: Callable[[CheckResult], None] | None) -> list[CheckResult]:
    """salloc, the checks on the allocated nodes as steps, scancel: always, and the
    allocation confirmed gone from the queue."""
    result = session.run(salloc_command(batch, ALLOCATION_WAIT), timeout=ALLOCATION_WAIT + 60)
    said = result.stderr.decode("utf-8", "replace")
    job_id = parse_salloc(said)
    if job_id is None:
        why = (said.strip().splitlines() or [f"exit {result.exit_code}"])[-1].removeprefix("salloc: ")
        skipped = [CheckResult(CLUSTER, "slurm", "skip",
                               f"the node checks did not run: no allocation within {ALLOCATION_WAIT} s ({why})",
                               "run check again when the partition has room")]
        _emit(skipped, progress)
        return skipped
    try:
        state = queue_state(session, job_id)
        names = hostnames(session, state.nodelist) if state is not None and state.nodelist else ()
        if not names:
            raise TorchherdError(f"allocation {job_id} has no nodes")
        outcome = run_preflight(_allocated_plan(plan, names), options, SrunConnector(open_front, job_id), progress)
        outcome.close()
        return list(outcome.report.results)
    finally:
        cancel_and_wait(session, job_id)


def _allocated_plan(plan: Plan, names: tuple[str, ...]) -> Plan:
    """The plan as the allocated nodes would run it: the inventory's one host shape on
    each of them, rank 0 on the first (as the batch script does it)."""
    inventory = plan.inventory
    template = inventory.hosts[0]
    hosts = tuple(dataclasses.replace(template, name=name, address=name, local_addr=None) for name in names)
    cluster = dataclasses.replace(inventory.cluster, master=names[0])
    return build_plan(dataclasses.replace(inventory, hosts=hosts, cluster=cluster), plan.options)
