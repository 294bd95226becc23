"""Where a run's files are: the nodes' run directories (logs, state files, coordinator
state) and this machine's private run-record directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

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
    env = os.environ if environ is None else environ
    base = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "torchherd" / "runs"
