"""What a scheduler does for a plan, behind one interface (TorchX's ``Scheduler`` is the
model). Each scheduler is a package of its own under ``engine/`` (SSH's: torchherd starts
every node itself; SLURM's: SLURM does), named in one place only, ``engine.schedulers``;
``backend_class`` here imports it when it is asked for. ``Cluster`` picks one from
its scheduler once (``backend_for``), and a detached run's record names the backend that
started it (``backend_of``); nothing above the backends asks which scheduler it is
talking to, and this module imports none of them.

A caller that builds its own plan (a subset of the hosts, say: ``Cluster.select``)
launches it here and reads from the ``RunSummary`` which node failed first
(``headline``, ``NodeOutcome.state == "failed"``) and which were lost
(``"lost"``, ``"unresponsive"``).

A flag one backend cannot honour is refused by it (``UsageError``: exit 2, one line
naming the flag), never silently ignored.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Protocol, Sequence

from torchherd.checks import CheckOptions
from torchherd.checks.results import CheckReport, CheckResult
from torchherd.engine import schedulers
from torchherd.engine.observer import ignore
from torchherd.engine.recovery.policy import TRIAGE_CHECKS
from torchherd.errors import UsageError
from torchherd.inventory import Bandwidth, Host, Recovery
from torchherd.plan import Plan
from torchherd.transport import Connector

if TYPE_CHECKING:  # a run's types: `check` never loads them (issue 43)
    from torchherd.engine.events import CheckpointReplicated, CheckpointSaved, LostContainers, Observer
    from torchherd.engine.prepare.staging import Staged
    from torchherd.engine.recorder import Recorder
    from torchherd.engine.records import NodeState, RecoveryRecord, RunRecord
    from torchherd.engine.run import Follow, LaunchOptions, Run

__all__ = ["Backend", "Description", "backend_class", "backend_for", "backend_of", "own_checks", "scheduler_of"]


class Description(Protocol):
    """What ``run --dry-run`` shows for a plan, whatever the scheduler: every node's
    command (SSH: the ``Plan`` itself), or the batch script (SLURM's ``BatchJob``)."""

    @property
    def run_id(self) -> str: ...

    def as_json(self) -> dict[str, Any]:
        """``run --dry-run --json`` (but its schema number): the exact commands, the
        environment's names only (never their values: a token may be among them)."""

    def text(self) -> tuple[tuple[str, str], ...]:
        """What ``run --dry-run`` prints, line by line, each with its role: ``"title"``,
        ``"node:N"`` (the Nth node's head), ``"note"`` (why a choice was made) or ``""``.
        The text is as the plan holds it: the console shows its escapes."""


@dataclass(frozen=True)
class Backend(ABC):
    """One scheduler: how a plan is checked, shown, started (attached or detached), and
    how a detached run is found again. ``connector`` reaches the hosts (SSH) or the
    submit host (SLURM); a detached run's backend may have none (rebuilt from the record)."""

    connector: Connector | None = None

    scheduler: ClassVar[str]
    """Its name in ``[cluster].scheduler``, ``--scheduler`` and a run record's ``scheduler``."""
    title: ClassVar[str]
    """Its name in text (``check --help``)."""
    live_checks: ClassVar[bool] = True
    """Whether ``check`` reports one node's results at a time (a live grid is worth it)."""
    refuses: ClassVar[Mapping[str, tuple[str, str]]] = {}
    """The flags it cannot honour: flag -> (why, hint)."""
    triage_checks: ClassVar[frozenset[str]] = TRIAGE_CHECKS
    """The checks a recovering run's triage runs on the next attempt's nodes."""
    check_ids: ClassVar[tuple[str, ...]] = ()
    """The check ids of its own that ``check``/``run`` take beside the common ones
    (``--only``, ``--skip``)."""

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
        self.allow("--resume-args", bool(recovery.resume_args))

    def stage_checkpoint(self, plan: Plan, sources: Sequence[str], receivers: Sequence[str], path: str,
                         attempt: int, stopping: Callable[[], bool] = lambda: False) -> Staged:
        """Puts the newest copy of the checkpoint ``path`` among ``sources`` on each node of
        ``receivers`` that lacks it (``engine.prepare.staging``); ``plan`` has every one of them.
        ``stopping`` true: the copy is given up (Ctrl-C)."""
        from torchherd.engine.events import CheckpointMissing

        return CheckpointMissing(attempt, "this scheduler cannot stage a checkpoint")

    def remove_lost_containers(self, plan: Plan, nodes: Sequence[str]) -> LostContainers | None:
        """Removes the run's containers on ``nodes`` (lost in an attempt: their supervisor died
        with them); ``plan`` has every one of them. None: no container to remove."""
        return None

    def replicate_checkpoint(self, plan: Plan, saved: CheckpointSaved, targets: Sequence[str], bandwidth: Bandwidth,
                             stopping: Callable[[], bool] = lambda: False) -> CheckpointReplicated:
        """Copies the checkpoint ``saved`` to each node of ``targets`` that lacks it, while the
        job runs, at low priority and at most at ``bandwidth`` (``engine.prepare.staging.replicate``)."""
        from torchherd.engine.events import CheckpointReplicated

        return CheckpointReplicated(saved.path, saved.size, saved.mtime, saved.node, (), 0.0, str(bandwidth),
                                    failed=tuple((node, "this scheduler cannot replicate a checkpoint")
                                                 for node in targets))

    @abstractmethod
    def check(self, plan: Plan, options: CheckOptions, *, sync: bool = False,
              on_result: Callable[[CheckResult], None] | None = None, on_event: Observer = ignore) -> CheckReport:
        """The preflight of ``plan``, changing nothing on the nodes (with ``sync``: the
        project made identical first, its events to ``on_event``). Returns the report;
        each result also goes to ``on_result`` as it is known."""

    @classmethod
    @abstractmethod
    def script(cls, plan: Plan, *, fail_fast: bool = True) -> Description:
        """What this scheduler is handed for ``plan``, unchecked and pure: the plan itself
        (SSH), or the batch script (SLURM)."""

    @abstractmethod
    def describe(self, plan: Plan, *, fail_fast: bool = True) -> Description:
        """What ``run --dry-run`` prints for ``plan`` (``script``), once this backend has
        refused what it cannot honour."""

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
    def detached_recorder(self, plan: Plan, grace: float, controller: RecoveryRecord) -> Recorder:
        """The record of a detached run with retries before its first attempt (``plan``'s
        nodes, ``controller`` the background process that runs it), and the observer that
        keeps it up to date from the attempts' events (``engine.recovery.background``)."""

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


def backend_class(scheduler: str) -> type[Backend]:
    """The ``Backend`` class of ``scheduler`` (``engine.schedulers``), its package imported now (once)."""
    module, name = schedulers.backend_path(scheduler)
    kind: type[Backend] = getattr(importlib.import_module(module), name)
    return kind


def backend_for(scheduler: str, connector: Connector | None = None) -> Backend:
    """The backend of a scheduler (``Cluster`` calls this once)."""
    return backend_class(scheduler)(connector)


def scheduler_of(backend: Backend) -> str:
    """The scheduler whose backend ``backend`` is (its run records say it)."""
    return backend.scheduler


def backend_of(record: RunRecord, connector: Connector | None = None) -> Backend:
    """The backend that started a detached run, as its record says."""
    return backend_for(str(record.extra.get("scheduler", schedulers.DEFAULT)), connector)


def own_checks() -> list[tuple[str, tuple[str, ...]]]:
    """Per scheduler with check ids of its own, its title and those ids (``check --help``
    lists them; this imports every scheduler's package)."""
    kinds = [backend_class(name) for name in schedulers.names()]
    return [(kind.title, kind.check_ids) for kind in kinds if kind.check_ids]
