"""Every scheduler torchherd knows, by name: the one place a scheduler is named.

Each entry is the module path and class of the scheduler's ``Backend``, imported only
when that scheduler is asked for (``engine.backend.backend_class``, as TorchX's
``torchx.schedulers`` and torch elastic's rendezvous registry do): an SSH run never
imports SLURM's package, and ``--help`` neither. A scheduler with a table of its own in
the inventory declares it in its package (an ``inventory.tables.SchedulerTable``, as
TorchX's schedulers declare their run options) and names it in ``TABLES``; the readers
above the inventory hand them to it (``known``).

A new scheduler is its package under ``engine/`` (a ``Backend``: torchherd docs api) and
one line in ``SCHEDULERS``, with its table's line where it has one. This module imports no
scheduler and nothing of the engine, so every module may ask it which names there are.
"""

from __future__ import annotations

import importlib

from torchherd.inventory.tables import Schedulers, SchedulerTable

SCHEDULERS: dict[str, str] = {
    "ssh": "torchherd.engine.ssh.backend:SshBackend",
    "slurm": "torchherd.engine.slurm.backend:SlurmBackend",
}
"""Scheduler name -> ``module:Backend class`` (``[cluster].scheduler``, ``--scheduler``)."""
TABLES: dict[str, str] = {
    "slurm": "torchherd.engine.slurm.settings:TABLE",
}
"""Scheduler name -> ``module:SchedulerTable`` of its own inventory table (``[NAME]``, ``--NAME-KEY``)."""
DEFAULT = "ssh"
"""A run record written before records named their scheduler was an SSH run's."""
BATCH_SCRIPT = "slurm"
"""The scheduler whose description is a batch script (``Cluster.batch_script``)."""
JOB_RECORDS = frozenset({"slurm"})
"""The schedulers whose run records name a batch job (``job_id``, ``run_dir``): each value
reaches the scheduler's commands, so a record is read only as torchherd writes it."""


def register(name: str, path: str) -> None:
    """Adds a scheduler (``module:Backend class``) under ``name``: a plugin's, or a test's."""
    SCHEDULERS[name] = path


def names() -> tuple[str, ...]:
    """Every scheduler's name, in the order they were registered."""
    return tuple(SCHEDULERS)


def _loaded(path: str) -> object:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def known() -> Schedulers:
    """What the inventory's readers are told: every name, and each table (imported now)."""
    tables = []
    for name, path in TABLES.items():
        table = _loaded(path)
        if not isinstance(table, SchedulerTable) or table.name != name:
            raise TypeError(f"{path}: not the SchedulerTable of {name!r}")
        tables.append(table)
    return Schedulers(names(), tuple(tables))


def backend_path(scheduler: str) -> tuple[str, str]:
    """The module and class name of ``scheduler``'s backend (KeyError: no such scheduler)."""
    module, _, name = SCHEDULERS[scheduler].partition(":")
    return module, name
