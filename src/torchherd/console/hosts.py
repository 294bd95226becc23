"""``torchherd hosts``: the resolved inventory."""

from __future__ import annotations

from typing import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from torchherd.console import printable
from torchherd.inventory import Inventory


def hosts_rows(inventory: Inventory, ssh_targets: Sequence[str]) -> list[dict[str, object]]:
    cluster = inventory.cluster
    return [
        {"name": host.name, "ssh": target, "node_rank": rank,
         "nproc_per_node": cluster.nproc_per_node if host.nproc_per_node is None else host.nproc_per_node,
         "python": host.python, "workdir": host.workdir, "master": rank == 0}
        for rank, (host, target) in enumerate(zip(inventory.hosts, ssh_targets))
    ]


def render_hosts(console: Console, inventory: Inventory, ssh_targets: Sequence[str]) -> None:
    # Text, never markup: a workdir like "~/p[/]" is a path, not a closing tag; every value
    # comes from the inventory or ssh_config, so control characters are shown escaped.
    cluster = inventory.cluster
    table = Table(title=Text(printable(f"{inventory.path}: {len(inventory.hosts)} hosts, master {cluster.master}:"
                                       f"{cluster.port}, rendezvous {cluster.rdzv_backend}")), title_justify="left")
    for column in ("name", "SSH target", "node_rank", "nproc", "python", "workdir"):
        table.add_column(column, overflow="fold")
    for row in hosts_rows(inventory, ssh_targets):
        name = f"{row['name']} (master)" if row["master"] else str(row["name"])
        table.add_row(*(Text(printable(str(value))) for value in (
            name, row["ssh"], row["node_rank"], row["nproc_per_node"], row["python"], row["workdir"])))
    console.print(table)
