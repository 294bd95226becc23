"""``torchherd hosts``: the resolved inventory."""

from __future__ import annotations

from typing import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from torchherd.console import PIPE_WIDTH, print_table, printable
from torchherd.inventory import Inventory
from torchherd.words import count

COLUMNS = ("name", "SSH target", "node_rank", "nproc", "python", "workdir")
PATH_COLUMNS = ("python", "workdir")
"""Shortened in the middle when the table is wider than the terminal (the ends of a path say most);
never when piped."""
MIN_PATH = 16
"""A path column narrower than this says too little: it is left out, and a note says so."""


THIS_MACHINE = "this machine, no SSH"
"""A host reached in-process (``Host.transport`` "local": ``-H localhost``)."""


def hosts_rows(inventory: Inventory, ssh_targets: Sequence[str]) -> list[dict[str, object]]:
    """One row per host; ``ssh`` is None for this machine reached without SSH, and
    ``reached`` says which ("ssh" or "this machine, no SSH")."""
    cluster = inventory.cluster
    return [
        {"name": host.name, "ssh": None if host.transport == "local" else target,
         "reached": THIS_MACHINE if host.transport == "local" else "ssh", "node_rank": rank,
         "nproc_per_node": cluster.nproc_per_node if host.nproc_per_node is None else host.nproc_per_node,
         "python": host.python, "workdir": host.workdir, "master": rank == 0}
        for rank, (host, target) in enumerate(zip(inventory.hosts, ssh_targets))
    ]


def render_hosts(console: Console, inventory: Inventory, ssh_targets: Sequence[str]) -> None:
    # Text, never markup: a workdir like "~/p[/]" is a path, not a closing tag; every value
    # comes from the inventory or ssh_config, so control characters are shown escaped.
    cluster = inventory.cluster
    cells = [dict(zip(COLUMNS, (printable(str(value)) for value in (
        f"{row['name']} (master)" if row["master"] else row["name"], row["ssh"] or row["reached"], row["node_rank"],
        row["nproc_per_node"], row["python"], row["workdir"])))) for row in hosts_rows(inventory, ssh_targets)]
    # Piped, nothing is shortened: a script reads whole paths (the table is as wide as they are).
    width = console.width if console.is_terminal else PIPE_WIDTH
    widths = fit_paths({column: max([len(column)] + [len(cell[column]) for cell in cells]) for column in COLUMNS},
                       width)
    table = Table(title=Text(printable(f"{inventory.path}: {count(len(inventory.hosts), 'host')}, master {cluster.master}:"
                                       f"{cluster.port}, rendezvous {cluster.rdzv_backend}")), title_justify="left")
    shown = [column for column in COLUMNS if widths[column] > 0]
    for column in shown:
        table.add_column(column, overflow="fold")
    for cell in cells:
        table.add_row(*(Text(middle(cell[column], widths[column]) if column in PATH_COLUMNS else cell[column])
                        for column in shown))
    print_table(console, table)
    left_out = [column for column in COLUMNS if column not in shown]
    if left_out:
        console.print(f"{' and '.join(left_out)} left out at {console.width} columns (torchherd hosts --json has "
                      "every column)", markup=False, highlight=False)


def fit_paths(natural: dict[str, int], width: int) -> dict[str, int]:
    """Each column's width in a table ``width`` wide: the path columns shortened to what is
    left by the others, shared evenly, or 0 (left out) where that is under MIN_PATH."""
    paths = [column for column in PATH_COLUMNS if column in natural]
    while paths:
        others = sum(size for column, size in natural.items() if column not in PATH_COLUMNS)
        room = width - others - _frame(len(natural) - len(PATH_COLUMNS) + len(paths))
        fitted = _share(room, [natural[column] for column in paths])
        if min(fitted) >= MIN_PATH or sum(natural[column] for column in paths) <= room:
            return {**natural, **dict(zip(paths, fitted)), **{column: 0 for column in PATH_COLUMNS
                                                             if column not in paths}}
        paths.pop()  # workdir goes first: the interpreter says more about a node
    return {**natural, **{column: 0 for column in PATH_COLUMNS}}


def _frame(columns: int) -> int:
    """What rich's table adds around its cells: a border each side and one cell padding each side."""
    return 3 * columns + 1


def _share(room: int, needs: list[int]) -> list[int]:
    """``room`` split among columns that need ``needs``: a column that needs less than an
    even share gets its need, the others share the rest evenly."""
    result = list(needs)
    open_columns = sorted(range(len(needs)), key=lambda index: needs[index])
    left = room
    for position, index in enumerate(open_columns):
        share = left // (len(open_columns) - position)
        result[index] = min(needs[index], share)
        left -= result[index]
    return result


def middle(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters: its middle replaced by '…', cut at a '/' where
    one is near, so both ends of a path stay (``/home/ann/…/.venv/bin/python``)."""
    if len(text) <= width:
        return text
    budget = width - 1
    tail_room = budget * 2 // 3
    cut = text.find("/", len(text) - tail_room)  # the longest "/..." end that fits
    tail = text[cut:] if cut >= 0 else text[len(text) - tail_room:]
    return text[:budget - len(tail)] + "…" + tail
