"""Runs as data: the local run record of every run started from here (detached, and the
attached ones of the history), the remote paths, and the state a node's supervisor leaves
behind; and the history of attached runs (``history``, imported by itself: it sits on the
engine's bookkeeping).

Pure (files on this machine only, no SSH). The record is what lets a later shell
find, reconnect to, follow and stop a run: it keeps enough of the resolved
inventory to reconnect even when the inventory file changed or moved. ``model``: the
record; ``fields``: its reader; ``attached``, ``recovery``: its extensions; ``store``: the
records on disk; ``locks``: the controller lock; ``paths``: where a run's files are.
"""

from __future__ import annotations

from torchherd.engine.records.attached import (
    ATTACHED_KEY,
    CONTROLLER_GONE,
    ENDINGS,
    KEPT_RUNS,
    OUTCOMES,
    AttachedRecord,
    AttachedStatus,
    NodeEnding,
    attached_state,
)
from torchherd.engine.records.fields import (
    RecordError,
)
from torchherd.engine.records.locks import (
    controller_alive,
    controller_lock,
    hold_controller_lock,
    holds_lock,
)
from torchherd.engine.records.model import (
    CoordinatorRecord,
    NodeRecord,
    NodeState,
    RunRecord,
    attached_node_states,
    attached_of,
    describe_since,
    parse_node_state,
    recovery_of,
    with_attached,
    with_recovery,
)
from torchherd.engine.records.paths import (
    REMOTE_RUNS_DIR,
    remote_coordinator_file,
    remote_log_file,
    remote_run_dir,
    remote_state_file,
    runs_dir,
)
from torchherd.engine.records.recovery import (
    ATTEMPT_HEADLINES,
    ATTEMPT_STATES,
    ATTEMPT_TEXT_CHARS,
    RECOVERY_KEY,
    STORED_TEXT_CHARS,
    AttemptState,
    RecoveryRecord,
    RecoveryStatus,
    stored_text,
)
from torchherd.engine.records.store import (
    AMBIGUOUS_SHOWN,
    MAX_RECORD_BYTES,
    load,
    load_all,
    prune,
    read_record,
    save,
    scan,
)

__all__ = ["AMBIGUOUS_SHOWN", "ATTACHED_KEY", "ATTEMPT_HEADLINES", "ATTEMPT_STATES", "ATTEMPT_TEXT_CHARS",
           "AttachedRecord", "AttachedStatus", "AttemptState",
           "CONTROLLER_GONE", "CoordinatorRecord", "ENDINGS", "KEPT_RUNS", "MAX_RECORD_BYTES", "NodeEnding",
           "NodeRecord", "NodeState", "OUTCOMES", "RECOVERY_KEY", "REMOTE_RUNS_DIR", "RecordError", "RecoveryRecord",
           "RecoveryStatus", "RunRecord", "STORED_TEXT_CHARS", "attached_node_states", "attached_of", "attached_state",
           "controller_alive", "controller_lock", "describe_since", "hold_controller_lock", "holds_lock", "load",
           "load_all", "parse_node_state", "prune", "read_record", "recovery_of", "remote_coordinator_file",
           "remote_log_file", "remote_run_dir", "remote_state_file", "runs_dir", "save", "scan", "stored_text",
           "with_attached", "with_recovery"]
