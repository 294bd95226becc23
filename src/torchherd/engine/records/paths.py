"""Where a run's files are: the nodes' run directories (logs, state files, coordinator
state) and this machine's private run-record directory."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from torchherd.statedir import state_dir

REMOTE_RUNS_DIR = "~/.torchherd/runs"
"""On each node: ``<this>/<run-id>/<node>.log`` and ``<node>.state.json``. The node's
name is in the file name because nodes may share a home directory (NFS)."""


def remote_run_dir(run_id: str) -> str:
    return f"{REMOTE_RUNS_DIR}/{run_id}"


def remote_log_file(run_id: str, node: str) -> str:
    return f"{remote_run_dir(run_id)}/{node}.log"


def remote_state_file(run_id: str, node: str) -> str:
    return f"{remote_run_dir(run_id)}/{node}.state.json"


def remote_coordinator_file(run_id: str, attempt: int = 0) -> str:
    """A plain detached run's coordinator state file; with retries, one per attempt (the
    last attempt's coordinator may still be on its way out when the next one starts)."""
    name = f"coordinator-{attempt}.json" if attempt else "coordinator.json"
    return f"{remote_run_dir(run_id)}/{name}"


def runs_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_STATE_HOME/torchherd/runs`` (default ``~/.local/state/torchherd/runs``)."""
    return state_dir(environ) / "runs"
