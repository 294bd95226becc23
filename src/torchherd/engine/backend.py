"""What a scheduler does for a plan, behind one interface (TorchX's ``Scheduler`` is the
model): ``SshBackend`` starts every node itself over SSH, ``SlurmBackend`` hands the
job to SLURM. ``Cluster`` picks one from its scheduler once (``backend_for``), and a
detached run's record names the backend that started it (``backend_of``); nothing
above this module asks which scheduler it is talking to.

A caller that builds its own plan (a subset of the hosts, say: ``Cluster.select``)
launches it here and reads from the ``RunSummary`` which node failed first
(``headline``, ``NodeOutcome.state == "failed"``) and which were lost
(``"lost"``, ``"unresponsive"``).

A flag one backend cannot honour is refused by it (``UsageError``: exit 2, one line
naming the flag), never silently ignored.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Callable, ClassVar, Mapping, Sequence, Union

from torchherd.checks import CheckOptions
from torchherd.checks.results import CheckReport, CheckResult
from torchherd.engine import detach as detached
from torchherd.engine.containers import remove_lost
from torchherd.engine.events import (
    CheckpointMissing,
    CheckpointReplicated,
    CheckpointSaved,
    LostContainers,
    Observer,
    ignore,
)
from torchherd.engine.job import LaunchOptions
from torchherd.engine.launch import Run, launch, open_nodes, preflight, sync_first, with_probes
from torchherd.engine.records import NodeState, RunRecord
from torchherd.engine.recovery.policy import TRIAGE_CHECKS
from torchherd.engine.recovery.staging import Staged, replicate, stage
from torchherd.engine.slurm import check as slurm_check
from torchherd.engine.slurm import detached as slurm_detached
from torchherd.engine.slurm import job as slurm_job
from torchherd.engine.slurm.batch import BatchJob, batch_job, picked_count, placement
from torchherd.errors import TorchherdError, UsageError
from torchherd.inventory import Bandwidth, Host, Recovery
from torchherd.plan import Plan
from torchherd.transport import Connector
from torchherd.transport.ssh import SshConnector, ssh_hostnames

Description = Union[Plan, BatchJob]
"""What ``--dry-run`` shows: every node's command (SSH), or the batch script (SLURM)."""
Follow = detached.Follow


class DetachedStartFailed(TorchherdError):
    """Not every node of a detached run started; the others were stopped."""

    def __init__(self, start: detached.DetachedStart) -> None:
        super().__init__(f"run {start.record.run_id}: not every node started; the others were stopped")
        self.start = start


@dataclass(frozen=True)
class Backend(ABC):
    """One scheduler: how a plan is checked, shown, started (attached or detached), and
    how a detached run is found again. ``connector`` reaches the hosts (SSH) or the
    submit host (SLURM); a detached run's backend may have none (rebuilt from the record)."""

    connector: Connector | None = None

    live_checks: ClassVar[bool] = True
    """Whether ``check`` reports one node's results at a time (a live grid is worth it)."""
    takes_slurm_keys: ClassVar[bool] = False
    """Whether the ``[slurm]`` keys (``--slurm-*``) mean anything to it."""
    refuses: ClassVar[Mapping[str, tuple[str, str]]] = {}
    """The flags it cannot honour: flag -> (why, hint)."""
    triage_checks: ClassVar[frozenset[str]] = TRIAGE_CHECKS
    """The checks a recovering run's triage runs on the next attempt's nodes."""

    def ssh_hostnames(self, hosts: Sequence[Host]) -> dict[str, str]:
        """Per host reached by an ssh_config alias, the alias's HostName (the address its
        peers are told); empty where torchherd does not reach the hosts over SSH itself."""
        return {}

    def picked_nodes(self, plan: Plan) -> int | None:
        """How many nodes the scheduler picks for ``plan`` itself; None when the plan names
        its nodes (a recovering run then names each attempt's too, spares included)."""
        return None

    def allow(self, flag: str, given: object) -> None:
        """Raises UsageError (exit 2, one line naming ``flag``) when ``flag`` is given and
        this backend cannot honour it."""
        if given and flag in self.refuses:
            why, hint = self.refuses[flag]
            raise UsageError(f"{flag}: {why}", hint)

    def allow_recovery(self, plan: Plan, recovery: Recovery) -> None:
        """Raises UsageError (exit 2, one line naming the flag) for the recovery this
        backend cannot give ``plan``."""
        self.allow("--retries", recovery.retries > 0)
        self.allow("--hang-timeout", recovery.hang_timeout is not None)
        self.allow("--checkpoint", recovery.checkpoint is not None)

    def stage_checkpoint(self, plan: Plan, sources: Sequence[str], receivers: Sequence[str], path: str,
                         attempt: int, stopping: Callable[[], bool] = lambda: False) -> Staged:
        """Puts the newest copy of the checkpoint ``path`` among ``sources`` on each node of
        ``receivers`` that lacks it (``engine.recovery.staging``); ``plan`` has every one of them.
        ``stopping`` true: the copy is given up (Ctrl-C)."""
        return CheckpointMissing(attempt, "this scheduler cannot stage a checkpoint")

    def remove_lost_containers(self, plan: Plan, nodes: Sequence[str]) -> LostContainers | None:
        """Removes the run's containers on ``nodes`` (lost in an attempt: their supervisor died
        with them); ``plan`` has every one of them. None: no container to remove."""
        return None

    def replicate_checkpoint(self, plan: Plan, saved: CheckpointSaved, targets: Sequence[str], bandwidth: Bandwidth,
                             stopping: Callable[[], bool] = lambda: False) -> CheckpointReplicated:
        """Copies the checkpoint ``saved`` to each node of ``targets`` that lacks it, while the
        job runs, at low priority and at most at ``bandwidth`` (``engine.staging.replicate``)."""
        return CheckpointReplicated(saved.path, saved.size, saved.mtime, saved.node, (), 0.0, str(bandwidth),
                                    failed=tuple((node, "this scheduler cannot replicate a checkpoint")
                                                 for node in targets))

    @abstractmethod
    def check(self, plan: Plan, options: CheckOptions, *, sync: bool = False,
              on_result: Callable[[CheckResult], None] | None = None, on_event: Observer = ignore) -> CheckReport:
        """The preflight of ``plan``, changing nothing on the nodes (with ``sync``: the
        project made identical first, its events to ``on_event``). Returns the report;
        each result also goes to ``on_result`` as it is known."""

    @abstractmethod
    def describe(self, plan: Plan, *, fail_fast: bool = True) -> Description:
        """What ``run --dry-run`` prints for ``plan``: the plan itself, or the batch script."""

    @abstractmethod
    def launch(self, plan: Plan, options: LaunchOptions, observer: Observer = ignore) -> Run:
        """Starts ``plan`` (preflight first unless ``options.check`` is off) and returns the
        attached ``Run``: ``wait()`` gives the ``RunSummary``. Raises LaunchAborted when it
        could not start (the observer was told why)."""

    @abstractmethod
    def preflight(self, plan: Plan, options: LaunchOptions, observer: Observer = ignore) -> Plan:
        """What ``launch`` checks first (unless ``options.check`` is off), starting nothing:
        for a controller that starts the run elsewhere (``run --detach --retries``: in the
        background, ``engine.recovery.background``). Returns the plan as checked (SSH: with the
        addresses the nodes were found at); raises LaunchAborted as ``launch`` does."""

    @abstractmethod
    def start_detached(self, plan: Plan, options: LaunchOptions, observer: Observer = ignore) -> RunRecord:
        """Starts ``plan`` so that it outlives this process; returns its saved ``RunRecord``
        (``status``, ``follow`` and ``stop`` take it). Raises LaunchAborted when it could
        not start, DetachedStartFailed when only some nodes did (the others stopped)."""

    @abstractmethod
    def status(self, record: RunRecord) -> list[NodeState]:
        """Per node (or for a job still queued, one row): running, exited (its code), unreachable."""

    @abstractmethod
    def follow(self, record: RunRecord, observer: Observer, options: Follow) -> None:
        """Reports the run's output (``Output``) and each node's status records
        (``NodeStatus``) from the start; with ``options.follow`` until the run has ended."""

    @abstractmethod
    def stop(self, record: RunRecord, grace: float | None = None) -> dict[str, list[str]]:
        """Stops the run everywhere and waits for it; per node (or job) what is still left
        (an empty list: nothing). ``grace``: seconds from SIGTERM to SIGKILL (None: the run's)."""


class SshBackend(Backend):
    """torchherd starts every node itself: one supervisor per node over SSH."""

    def check(self, plan: Plan, options: CheckOptions, *, sync: bool = False,
              on_result: Callable[[CheckResult], None] | None = None, on_event: Observer = ignore) -> CheckReport:
        connector = self._connector()
        if sync and plan.sync is not None:
            connector = sync_first(plan, connector, on_event)
        outcome = preflight(plan, options, connector, on_result)
        outcome.close()
        return with_probes(outcome)

    def describe(self, plan: Plan, *, fail_fast: bool = True) -> Description:
        return plan

    def launch(self, plan: Plan, options: LaunchOptions, observer: Observer = ignore) -> Run:
        return launch(plan, options, self._connector(), observer)

    def preflight(self, plan: Plan, options: LaunchOptions, observer: Observer = ignore) -> Plan:
        opened = open_nodes(plan, options, self._connector(), observer)
        opened.close()
        return opened.plan

    def start_detached(self, plan: Plan, options: LaunchOptions, observer: Observer = ignore) -> RunRecord:
        opened = open_nodes(plan, options, self._connector(), observer)
        try:
            start = detached.start_detached(opened.plan, options, opened.sessions)
        finally:
            opened.close()
        if not start.ok:
            raise DetachedStartFailed(start)
        return start.record

    def status(self, record: RunRecord) -> list[NodeState]:
        return detached.node_states(record, self.connector)

    def follow(self, record: RunRecord, observer: Observer, options: Follow) -> None:
        detached.follow_logs(record, observer, options, self.connector)

    def stop(self, record: RunRecord, grace: float | None = None) -> dict[str, list[str]]:
        return detached.stop_run(record if grace is None else replace(record, grace=grace), self.connector)

    def ssh_hostnames(self, hosts: Sequence[Host]) -> dict[str, str]:
        if not isinstance(self.connector, SshConnector):
            return {}
        return ssh_hostnames(hosts, self.connector.ssh_config)

    def stage_checkpoint(self, plan: Plan, sources: Sequence[str], receivers: Sequence[str], path: str,
                         attempt: int, stopping: Callable[[], bool] = lambda: False) -> Staged:
        nodes = {node.host.name: node for node in plan.nodes}
        return stage(self._connector(), nodes, sources, receivers, path, attempt, stopping)

    def remove_lost_containers(self, plan: Plan, nodes: Sequence[str]) -> LostContainers | None:
        hosts = {node.host.name: node.host for node in plan.nodes}
        return remove_lost(self._connector(), [hosts[name] for name in nodes], plan.run_id)

    def replicate_checkpoint(self, plan: Plan, saved: CheckpointSaved, targets: Sequence[str], bandwidth: Bandwidth,
                             stopping: Callable[[], bool] = lambda: False) -> CheckpointReplicated:
        nodes = {node.host.name: node for node in plan.nodes}
        return replicate(self._connector(), nodes, saved, targets, bandwidth.wire(), str(bandwidth), stopping)

    def _connector(self) -> Connector:
        assert self.connector is not None, "a Cluster's backend has its connector"
        return self.connector


class SlurmBackend(Backend):
    """SLURM places the job, starts one task per node and does the killing (torchherd docs slurm).
    torchherd never reaches its nodes over SSH: what needs that is refused (``refuses``)."""

    live_checks: ClassVar[bool] = False
    takes_slurm_keys: ClassVar[bool] = True
    refuses: ClassVar[Mapping[str, tuple[str, str]]] = {
        "--sync": ("not for SLURM runs (torchherd does not reach SLURM's nodes itself)",
                   "keep the project on the cluster's shared filesystem, or sync it to the login host first"),
        "--grace": ("not for SLURM runs (SLURM's KillWait is the grace period)", "leave --grace out"),
        "--smoke": ("not for SLURM checks (the nodes are reached as steps of an allocation, not by run's supervisor)",
                    "leave --smoke out; a short torchherd run is the smoke test"),
        "--checkpoint": ("not for SLURM runs (torchherd does not reach SLURM's nodes to copy it)",
                         "keep checkpoints on the cluster's shared filesystem, and leave --checkpoint out"),
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
        if placement(plan, plan.inventory.slurm).source != "[slurm]":
            return None
        return picked_count(plan.inventory.slurm)

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

    def describe(self, plan: Plan, *, fail_fast: bool = True) -> Description:
        self.allow("--sync", plan.sync is not None)
        return batch_job(plan, plan.inventory.slurm, fail_fast, pyxis=None)

    def launch(self, plan: Plan, options: LaunchOptions, observer: Observer = ignore) -> Run:
        return slurm_job.launch(self._attached(plan, options), options, self._connector(), observer)

    def preflight(self, plan: Plan, options: LaunchOptions, observer: Observer = ignore) -> Plan:
        if options.check:
            slurm_job.preflight(self._attached(plan, options), options, self._connector(), observer)
        return plan

    def start_detached(self, plan: Plan, options: LaunchOptions, observer: Observer = ignore) -> RunRecord:
        return slurm_detached.start_detached(self._attached(plan, options), options, self._connector(), observer)

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


BACKENDS: dict[str, type[Backend]] = {"ssh": SshBackend, "slurm": SlurmBackend}
"""Every scheduler the inventory's ``[cluster].scheduler`` names, and its backend."""


def backend_for(scheduler: str, connector: Connector | None = None) -> Backend:
    """The backend of a scheduler (``Cluster`` calls this once)."""
    return BACKENDS[scheduler](connector)


def scheduler_of(backend: Backend) -> str:
    """The scheduler whose backend ``backend`` is (its run records say it)."""
    return next(name for name, kind in BACKENDS.items() if isinstance(backend, kind))


def backend_of(record: RunRecord, connector: Connector | None = None) -> Backend:
    """The backend that started a detached run, as its record says."""
    return backend_for(str(record.extra.get("scheduler", "ssh")), connector)
