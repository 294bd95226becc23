"""SLURM's own table of the inventory, ``[slurm]`` (and ``--slurm-KEY``): how the job is
handed to SLURM. Declared here, in SLURM's package, and named in ``engine.schedulers.TABLES``:
the inventory reads it with this declaration (``inventory.tables``) and knows no scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from torchherd.errors import InventoryError
from torchherd.inventory import Inventory
from torchherd.inventory.reader import Reader
from torchherd.inventory.tables import Flag, SchedulerTable, TableSettings

NAME = "slurm"
SLURM_KEYS = ("login", "partition", "account", "nodes", "nodelist", "gpus_per_node", "time", "extra")
TEMPLATE_HOST = "slurm-node"
"""The one host of a SLURM inventory without [[hosts]]: the [defaults] every node runs with."""


@dataclass(frozen=True)
class SlurmSettings(TableSettings):
    """The ``[slurm]`` table: how the job is handed to SLURM (``--scheduler slurm``)."""

    login: str | None = None
    """The host sbatch runs on, reached over SSH like a node; None: run it on this machine."""
    partition: str | None = None
    account: str | None = None
    nodes: int | None = None
    nodelist: str | None = None
    """A nodeset (``gpu[01-04]``); without it and ``nodes``, the [[hosts]] by name."""
    gpus_per_node: int | None = None
    time: str | None = None
    extra: tuple[str, ...] = ()
    """More sbatch options, each one as sbatch takes it (``--qos=high``)."""

    def named(self) -> SlurmSettings:
        return replace(self, nodes=None, nodelist=None)


def parse_slurm(table: Mapping[str, Any], path: Path, where: str) -> SlurmSettings:
    """The ``[slurm]`` keys (``where`` names them in errors: ``[slurm].`` in a file)."""
    read = Reader(path, where, table, SLURM_KEYS)
    return SlurmSettings(
        login=read.get("login", None, read.host),
        partition=read.get("partition", None, read.text),
        account=read.get("account", None, read.text),
        nodes=read.get("nodes", None, read.count),
        nodelist=read.get("nodelist", None, read.nodeset),
        gpus_per_node=read.get("gpus_per_node", None, read.count),
        time=read.get("time", None, read.text),
        extra=read.get("extra", (), read.options),
    )


class SlurmTable(SchedulerTable):
    name = NAME
    title = "SLURM"
    keys = SLURM_KEYS
    flags = (
        Flag("login", "HOST", "submit on this host over SSH (default: here)"),
        Flag("partition", "NAME", "sbatch --partition"),
        Flag("account", "NAME", "sbatch --account"),
        Flag("nodes", "N", "sbatch --nodes", "count"),
        Flag("nodelist", "NODESET", "sbatch --nodelist, e.g. 'gpu[01-04]'"),
        Flag("gpus_per_node", "N", "sbatch --gpus-per-node", "count"),
        Flag("time", "LIMIT", "sbatch --time"),
        Flag("extra", "OPTION", "one more sbatch option, e.g. --slurm-extra=--qos=high (repeatable)", "repeat"),
    )
    flags_default = "sbatch's own"

    def parse(self, table: Mapping[str, Any], path: Path, where: str) -> SlurmSettings:
        return parse_slurm(table, path, where)

    def template_host(self, settings: TableSettings, cluster: Mapping[str, Any], path: Path) -> str | None:
        """SLURM picks the nodes of an inventory without [[hosts]]: ``[slurm].nodes`` or
        ``nodelist`` must say how many, or which, and the first of them is the master."""
        slurm = settings if isinstance(settings, SlurmSettings) else SlurmSettings()
        if slurm.nodes is None and slurm.nodelist is None:
            raise InventoryError(f"{path}: [slurm].nodes: missing: SLURM must know how many nodes, or which",
                                 'set nodes = 4 or nodelist = "gpu[01-04]" in [slurm], or list [[hosts]]')
        if "master" in cluster:
            raise InventoryError(f"{path}: [cluster].master: SLURM decides the nodes; the first node of the "
                                 "allocation is node_rank 0", "remove master")
        return TEMPLATE_HOST


TABLE = SlurmTable()


def settings_of(inventory: Inventory) -> SlurmSettings:
    """The inventory's ``[slurm]`` settings (the defaults where its reader knew no such table)."""
    settings = inventory.table(NAME)
    return settings if isinstance(settings, SlurmSettings) else SlurmSettings()
