"""The run record of a detached SLURM run with retries, kept by its background controller."""

from __future__ import annotations

from dataclasses import replace

from torchherd.engine.events import AttemptStarted, Event, JobQueued, NodeStarted, RunStarted
from torchherd.engine.recorder import Recorder
from torchherd.engine.records import RecoveryRecord, RunRecord, with_recovery
from torchherd.engine.slurm.batch import run_dir
from torchherd.engine.slurm.detached import slurm_nodes, slurm_record, with_job
from torchherd.plan import Plan


class SlurmRecorder(Recorder):
    """A SLURM run's: each attempt is a job of its own, with its own run directory on the
    submit host; the record follows the current one (``status``, ``logs``, ``stop`` read
    it), and its nodes are those SLURM started the job on."""

    def __init__(self, record: RunRecord, plan: Plan) -> None:
        super().__init__(record, {}, {})
        self.plan = plan

    def _changed(self, event: Event) -> RunRecord | None:
        if isinstance(event, AttemptStarted):
            return with_recovery(self.record, self.recovery.started(event.number, event.nodes))
        if isinstance(event, JobQueued):  # the job of the attempt started last (0: a run without retries)
            attempts = self.recovery.attempts
            attempt = attempts[-1].number if attempts else 0
            return with_job(self.record, event.job_id, run_dir(self.record.run_id, attempt))
        if isinstance(event, RunStarted):
            directory = str(self.record.extra["run_dir"])
            return replace(self.record, nodes=tuple(slurm_nodes(self.plan, event.nodes, directory)))
        if isinstance(event, NodeStarted):
            return None  # no supervisor: SLURM's task
        return super()._changed(event)


def slurm_recorder(plan: Plan, grace: float, controller: RecoveryRecord) -> SlurmRecorder:
    """The record before the first attempt: no job yet, the run's directory, ``controller``."""
    record = slurm_record(plan, grace, "", run_dir(plan.run_id))
    return SlurmRecorder(with_recovery(record, controller), plan)
