"""The run record of a detached run with retries, kept up to date by its background
controller (``engine.recovery.background``) from the attempts' events. Each backend
gives the first record and its recorder (``Backend.detached_recorder``): SSH's nodes are
the plan's, SLURM's are those SLURM started each attempt's job on (its ``recorder``).
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Callable, Mapping

from torchherd.engine.bookkeeping import node_record
from torchherd.engine.events import (
    AttemptFailed,
    AttemptStarted,
    CheckpointReplicated,
    CheckpointSaved,
    CheckpointStaged,
    CoordinatorStarted,
    Event,
    NodeStarted,
    RunFinished,
)
from torchherd.engine.records import (
    AttemptState,
    CoordinatorRecord,
    NodeRecord,
    RecoveryRecord,
    RunRecord,
    recovery_of,
    remote_log_file,
    remote_state_file,
    save,
    with_recovery,
)
from torchherd.inventory import Host


class Recorder:
    """The background controller's observer: keeps the run record up to date, atomically
    (``records.save``), from the events of the attempts (called from several threads)."""

    def __init__(self, record: RunRecord, hosts: Mapping[str, Host], workdirs: Mapping[str, str]) -> None:
        self.record = record
        self.hosts = hosts
        self.workdirs = workdirs
        self.checkpoint: Callable[[], str] | None = None
        """Where the newest checkpoint is, as the run's summary says it (the recovering
        run's ``checkpoint_line``): a detached run has no terminal to print it on."""
        self._lock = threading.Lock()

    @property
    def recovery(self) -> RecoveryRecord:
        found = recovery_of(self.record)
        assert found is not None, "the controller's record has its recovery"
        return found

    def __call__(self, event: Event) -> None:
        with self._lock:
            changed = self._changed(event)
            if changed is not None:
                self.record = changed
                save(self.record)

    def _changed(self, event: Event) -> RunRecord | None:
        """The record after ``event``; None: unchanged."""
        if isinstance(event, AttemptStarted):
            return with_recovery(self._with_nodes(event.nodes), self.recovery.started(event.number, event.nodes))
        if isinstance(event, AttemptFailed):
            return with_recovery(self.record, self.recovery.failed(event.number, event.headline))
        if isinstance(event, CoordinatorStarted):  # ``stop`` ends it with the rest
            return replace(self.record, coordinator=CoordinatorRecord(event.node, event.port, event.pid,
                                                                      event.state_file))
        if isinstance(event, NodeStarted):
            return replace(self.record, nodes=tuple(
                replace(node, supervisor=event.supervisor, pid=event.pid) if node.name == event.node else node
                for node in self.record.nodes))
        if isinstance(event, (CheckpointSaved, CheckpointReplicated, CheckpointStaged)) and \
                self.checkpoint is not None:
            return with_recovery(self.record, replace(self.recovery, checkpoint=self.checkpoint()))
        if isinstance(event, RunFinished):
            summary = event.summary
            attempts = tuple(AttemptState(attempt.number, attempt.nodes, attempt.ended, attempt.headline)
                             for attempt in summary.attempts)
            recovery = self.recovery.finished(summary.exit_code, summary.headline, attempts)
            if summary.checkpoint is not None:
                recovery = replace(recovery, checkpoint=summary.checkpoint)
            return with_recovery(self.record, recovery)
        return None

    def ended(self, code: int, headline: str) -> None:
        """The run ended without a summary (its first attempt could not start)."""
        with self._lock:
            self.record = with_recovery(self.record, replace(self.recovery, exit_code=code, headline=headline))
            save(self.record)

    def _with_nodes(self, nodes: tuple[str, ...]) -> RunRecord:
        """The record's nodes: this attempt's first (its master leads), then the earlier ones
        (their logs hold the earlier attempts)."""
        known = {node.name: node for node in self.record.nodes}
        ordered = [known.get(name) or self._node(name) for name in nodes]
        return replace(self.record, nodes=tuple(ordered + [node for node in self.record.nodes if node.name not in nodes]))

    def _node(self, name: str) -> NodeRecord:
        run_id = self.record.run_id
        return node_record(self.hosts[name], remote_log_file(run_id, name), remote_state_file(run_id, name),
                           self.workdirs.get(name))
