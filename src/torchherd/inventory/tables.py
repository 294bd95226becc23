"""A scheduler's own table of the inventory (``[NAME]`` in ``hosts.toml``, ``--NAME-KEY`` on
the command line), as the scheduler declares it in its package: TorchX's schedulers declare
their run options so. The inventory reads each table with its declaration and knows no
scheduler by name: the layer above hands it the schedulers there are (``Schedulers``, from
``engine.schedulers.known``).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, TypeVar

S = TypeVar("S", bound="TableSettings")


@dataclass(frozen=True)
class TableSettings:
    """What a scheduler's table holds, typed (a frozen dataclass of the scheduler's)."""

    def named(self: S) -> S:
        """These settings where the inventory names every host itself (an attempt's nodes,
        once the scheduler picked them): what let the scheduler pick them is dropped."""
        return self

    def updated(self: S, other: S, keys: tuple[str, ...]) -> S:
        """These settings with ``keys`` taken from ``other`` (the command line's over the file's)."""
        changes: dict[str, Any] = {key: getattr(other, key) for key in keys}
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Flag:
    """One key of a scheduler's table as the command line takes it: ``--NAME-KEY``."""

    key: str
    metavar: str
    help: str
    kind: Literal["text", "count", "repeat"] = "text"
    """"count": a whole number from 1; "repeat": given once per value."""


class SchedulerTable(ABC):
    """How the inventory reads one scheduler's table: its keys, their rules (``parse``), and
    whether that scheduler runs an inventory without ``[[hosts]]`` (it picks the nodes)."""

    name: str
    """The scheduler's name (``[cluster].scheduler``), its table's (``[NAME]``) and its flags' (``--NAME-KEY``)."""
    title: str
    """The scheduler's name in text: "only for TITLE runs"."""
    keys: tuple[str, ...]
    flags: tuple[Flag, ...] = ()
    """Its keys on the command line, in the order ``--help`` lists them."""
    flags_default: str = ""
    """What a ``--NAME-KEY`` left out and absent from the file means (``--help``)."""

    @abstractmethod
    def parse(self, table: Mapping[str, Any], path: Path, where: str) -> TableSettings:
        """The table's settings (``where`` names its keys in errors: ``[NAME].`` in a file,
        ``--NAME-`` on the command line); raises InventoryError naming the key."""

    def template_host(self, settings: TableSettings, cluster: Mapping[str, Any], path: Path) -> str | None:
        """For an inventory of this scheduler that lists no ``[[hosts]]``: the name of its one
        host (the ``[defaults]`` every node runs with), the scheduler picking the nodes; None:
        it needs ``[[hosts]]``. Raises InventoryError when the table cannot say which nodes."""
        return None


@dataclass(frozen=True)
class Schedulers:
    """The schedulers an inventory may name: every name, and the tables of those with one."""

    names: tuple[str, ...] = ("ssh",)
    tables: tuple[SchedulerTable, ...] = ()

    def table(self, name: str) -> SchedulerTable | None:
        return next((table for table in self.tables if table.name == name), None)


SSH_ONLY = Schedulers()
"""What a reader knows when it is told no schedulers: torchherd's own, over SSH, and no table."""
