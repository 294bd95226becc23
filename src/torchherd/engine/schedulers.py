"""Every scheduler torchherd knows, by name: the one place a scheduler is named.

Each entry is the module path and class of the scheduler's ``Backend``, imported only
when that scheduler is asked for (as TorchX's ``torchx.schedulers`` and torch elastic's
rendezvous registry do): an SSH run never imports SLURM's package, and ``--help`` neither.
A new scheduler is its package under ``engine/`` (a ``Backend``: torchherd docs api) and one line
in ``SCHEDULERS``, with its settings table where it has one.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the interface only: importing it imports the engine
    from torchherd.engine.backend import Backend
    from torchherd.engine.records import RunRecord
    from torchherd.transport import Connector

SCHEDULERS: dict[str, str] = {
    "ssh": "torchherd.engine.ssh.backend:SshBackend",
    "slurm": "torchherd.engine.slurm.backend:SlurmBackend",
}
"""Scheduler name -> ``module:Backend class`` (``[cluster].scheduler``, ``--scheduler``)."""
DEFAULT = "ssh"
"""A run record written before records named their scheduler was an SSH run's."""


def register(name: str, path: str) -> None:
    """Adds a scheduler (``module:Backend class``) under ``name``: a plugin's, or a test's."""
    SCHEDULERS[name] = path


def backend_class(scheduler: str) -> type[Backend]:
    """The ``Backend`` class of ``scheduler``, its package imported now (once)."""
    module, _, name = SCHEDULERS[scheduler].partition(":")
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
    return backend_for(str(record.extra.get("scheduler", DEFAULT)), connector)


def own_checks() -> list[tuple[str, tuple[str, ...]]]:
    """Per scheduler with check ids of its own, its title and those ids (``check --help``
    lists them; this imports every scheduler's package)."""
    kinds = [backend_class(name) for name in SCHEDULERS]
    return [(kind.title, kind.check_ids) for kind in kinds if kind.check_ids]
