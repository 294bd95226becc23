"""The SLURM backend: SLURM places the job, starts one task per node and does the killing
(torchherd docs slurm); torchherd talks only to the submit host."""

from __future__ import annotations

from typing import Callable, ClassVar, Mapping

from torchherd.checks import CheckOptions
from torchherd.checks.results import CheckReport, CheckResult
from torchherd.engine.backend import Backend, Description
from torchherd.engine.events import Observer, ignore
from torchherd.engine.recorder import Recorder
from torchherd.engine.records import NodeState, RecoveryRecord, RunRecord
from torchherd.engine.run import Follow, LaunchOptions, Run
from torchherd.engine.slurm import check as slurm_check
from torchherd.engine.slurm import detached as slurm_detached
from torchherd.engine.slurm import job as slurm_job
from torchherd.engine.slurm.batch import batch_job, picked_count, placement
from torchherd.engine.slurm.check import SLURM_CHECKS
from torchherd.engine.slurm.recorder import slurm_recorder
from torchherd.engine.slurm.settings import settings_of
from torchherd.errors import UsageError
from torchherd.inventory import Recovery
from torchherd.plan import Plan
from torchherd.transport import Connector


class SlurmBackend(Backend):
    """SLURM places the job, starts one task per node and does the killing (torchherd docs slurm).
    torchherd never reaches its nodes over SSH: what needs that is refused (``refuses``)."""

    scheduler: ClassVar[str] = "slurm"
    title: ClassVar[str] = "SLURM"
    check_ids: ClassVar[tuple[str, ...]] = SLURM_CHECKS
    live_checks: ClassVar[bool] = False
    refuses: ClassVar[Mapping[str, tuple[str, str]]] = {
        "--sync": ("not for SLURM runs (torchherd does not reach SLURM's nodes itself)",
                   "keep the project on the cluster's shared filesystem, or sync it to the login host first"),
        "--grace": ("not for SLURM runs (SLURM's KillWait is the grace period)", "leave --grace out"),
        "--smoke": ("not for SLURM checks (the nodes are reached as steps of an allocation, not by run's supervisor)",
                    "leave --smoke out; a short torchherd run is the smoke test"),
        "--checkpoint": ("not for SLURM runs (torchherd does not reach SLURM's nodes to copy it)",
                         "keep checkpoints on the cluster's shared filesystem, and leave --checkpoint out"),
        "--resume-args": ("not for SLURM runs (they are added on an attempt from a checkpoint torchherd staged, and "
                          "it stages none there)", "leave --resume-args out; the script can read TORCHHERD_ATTEMPT "
                          "(2 and up: a new attempt) and look for its checkpoint on the shared filesystem"),
        "--matrix": ("not for SLURM checks (the probes run inside an allocation; the report lists the failed ones)",
                     "leave --matrix out"),
        "--only": ("not for SLURM runs (run's preflight there is SLURM's view only: sbatch --test-only)",
                   "leave --only out, or --no-check to submit unchecked"),
        "--skip": ("not for SLURM runs (run's preflight there is SLURM's view only: sbatch --test-only)",
                   "leave --skip out, or --no-check to submit unchecked"),
    }

    triage_checks: ClassVar[frozenset[str]] = frozenset({"slurm-node"})
    """SLURM's own word on each node (sinfo: drained, down, not responding, with the
    admin's reason): torchherd does not reach SLURM's nodes to run the fast checks."""

    def picked_nodes(self, plan: Plan) -> int | None:
        if placement(plan, settings_of(plan.inventory)).source != "[slurm]":
            return None
        return picked_count(settings_of(plan.inventory))

    def allow_recovery(self, plan: Plan, recovery: Recovery) -> None:
        super().allow_recovery(plan, recovery)
        spares = (plan.base_inventory or plan.inventory).spares
        if recovery.retries and spares and self.picked_nodes(plan) is not None:
            # SLURM picks a replacement for each node left out (sbatch --exclude): a spare
            # named beside [slurm].nodes would never be the one it picks.
            raise UsageError(f"--spares: [slurm].nodes or nodelist lets SLURM pick the nodes, and it picks the "
                             f"replacement for an excluded node too (spares: {', '.join(h.name for h in spares)})",
                             "leave the spares out, or list every node as [[hosts]] instead of [slurm].nodes "
                             "and nodelist")

    def check(self, plan: Plan, options: CheckOptions, *, sync: bool = False,
              on_result: Callable[[CheckResult], None] | None = None, on_event: Observer = ignore) -> CheckReport:
        self.allow("--smoke", options.smoke)
        self.allow("--sync", sync and plan.sync is not None)
        return slurm_check.check(plan, options, self._connector(), on_result)

    @classmethod
    def script(cls, plan: Plan, *, fail_fast: bool = True) -> Description:
        return batch_job(plan, settings_of(plan.inventory), fail_fast, pyxis=None)

    def describe(self, plan: Plan, *, fail_fast: bool = True) -> Description:
        self.allow("--sync", plan.sync is not None)
        return self.script(plan, fail_fast=fail_fast)

    def launch(self, plan: Plan, options: LaunchOptions, observer: Observer = ignore) -> Run:
        return slurm_job.launch(self._attached(plan, options), options, self._connector(), observer)

    def preflight(self, plan: Plan, options: LaunchOptions, observer: Observer = ignore) -> Plan:
        if options.check:
            slurm_job.preflight(self._attached(plan, options), options, self._connector(), observer)
        return plan

    def start_detached(self, plan: Plan, options: LaunchOptions, observer: Observer = ignore) -> RunRecord:
        return slurm_detached.start_detached(self._attached(plan, options), options, self._connector(), observer)

    def detached_recorder(self, plan: Plan, grace: float, controller: RecoveryRecord) -> Recorder:
        return slurm_recorder(plan, grace, controller)

    def status(self, record: RunRecord) -> list[NodeState]:
        return slurm_detached.job_status(record, self.connector)

    def follow(self, record: RunRecord, observer: Observer, options: Follow) -> None:
        following: RunRecord | None = record
        while following is not None:
            slurm_detached.follow_job(following, observer, options.follow, options.node, options.rank,
                                      self.connector)
            # A recovering run's next attempt is a job of its own, its files in a directory of its own.
            more = options.more
            following = slurm_detached.next_job(following, more) if options.follow and more is not None else None

    def stop(self, record: RunRecord, grace: float | None = None) -> dict[str, list[str]]:
        self.allow("--grace", grace is not None)
        return slurm_detached.stop_job(record, self.connector)

    def _attached(self, plan: Plan, options: LaunchOptions) -> Plan:
        self.allow("--grace", options.grace is not None)
        self.allow("--sync", plan.sync is not None)
        return plan

    def _connector(self) -> Connector:
        assert self.connector is not None, "a Cluster's backend has its connector"
        return self.connector
