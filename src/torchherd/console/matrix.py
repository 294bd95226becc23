"""``torchherd check``'s probes as a picture: which node could open a TCP connection to
which, a row per prober, a column per node it connected to (its ephemeral ports) and
one for the master port.

A cell says how the pair's connects ended, the worst first: ``refused``, ``timed out``,
``unreachable``, ``unresolved``, then ``?`` (one timeout alone, or no time left to try:
not a verdict), then ``ok``; ``·`` where the probe plan had no connect for the pair.
Beyond ``GROUP_AFTER`` nodes, the nodes whose every cell is ok fold into one row and
one column (``node[0-27,30-63]``), and the others into groups of the same picture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from torchherd.checks.results import ProbeResult
from torchherd.console import print_table
from torchherd.inventory.nodeset import fold_names

GROUP_AFTER = 12
"""The most nodes drawn one by one."""
WORDS = {"ok": "ok", "refused": "refused", "timeout": "timed out", "unreachable": "unreachable",
         "unresolved": "unresolved"}
STYLES = {"ok": "green", "?": "yellow", "·": "dim", "-": "dim"}
# The worst outcome of a pair is what its cell says.
_WORST = ("refused", "timeout", "unreachable", "unresolved")
MASTER = "master"


def failed(probes: Sequence[ProbeResult]) -> bool:
    """Whether any cross-node connect failed for good (what makes ``check`` draw the matrix)."""
    return any(probe.holds and probe.result != "ok" for probe in probes)


def _cell_word(probes: Sequence[ProbeResult]) -> str:
    if not probes:
        return "·"
    for result in _WORST:
        if any(probe.result == result and probe.holds for probe in probes):
            return WORDS[result]
    if any(probe.result != "ok" for probe in probes):
        return "?"
    return "ok"


@dataclass(frozen=True)
class _Axis:
    """A row or column: one node, or nodes folded together."""

    label: str
    nodes: tuple[str, ...]


def _cell(probes: Sequence[ProbeResult], rows: _Axis, columns: _Axis, port: str | None) -> str:
    """The word for a block of the matrix; in a block of many pairs that do not all
    agree, how many of them say the worst (``timed out 3/4``)."""
    pairs = [[probe for probe in probes if probe.prober == prober and probe.peer == peer
              and (probe.port == MASTER) == (port == MASTER)]
             for prober in rows.nodes for peer in columns.nodes if prober != peer]
    if not pairs:
        return "-"
    words = [_cell_word(pair) for pair in pairs]
    probed = [word for word in words if word != "·"]
    if not probed:
        return "·"
    worst = next((word for word in (*(WORDS[result] for result in _WORST), "?") if word in probed), "ok")
    return worst if probed.count(worst) == len(probed) or len(probed) == 1 else f"{worst} {probed.count(worst)}/{len(probed)}"


def _axes(nodes: Sequence[str], probes: Sequence[ProbeResult]) -> list[_Axis]:
    if len(nodes) <= GROUP_AFTER:
        return [_Axis(node, (node,)) for node in nodes]
    shapes: dict[tuple[frozenset[str], frozenset[str]], list[str]] = {}
    for node in nodes:
        out = frozenset(_cell_word([probe]) for probe in probes if probe.prober == node)
        into = frozenset(_cell_word([probe]) for probe in probes if probe.peer == node)
        shapes.setdefault((out - {"ok"}, into - {"ok"}), []).append(node)
    return [_Axis(fold_names(members) if len(members) > 1 else members[0], tuple(members))
            for members in shapes.values()]


def render_matrix(console: Console, probes: Sequence[ProbeResult], nodes: Sequence[str], master: str,
                  port: int) -> None:
    """The probes as a node x node table, a legend under it."""
    axes = _axes(nodes, probes)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1), pad_edge=False,
                  title=Text("connections: rows connected to columns", style="bold"), title_justify="left")
    table.add_column("from \\ to", no_wrap=True)
    for axis in axes:
        table.add_column(axis.label, justify="center", no_wrap=True)
    table.add_column(f"{master}:{port}", justify="center", no_wrap=True)
    master_axis = _Axis(master, (master,))
    for row in axes:
        cells = [_cell(probes, row, column, None) for column in axes]
        cells.append(_cell(probes, row, master_axis, MASTER))
        table.add_row(row.label, *(Text(word, style=STYLES.get(word, "bold red")) for word in cells))
    print_table(console, table)
    console.print(Text(f"each node's two ephemeral ports under its name; {master}:{port} is the master port. "
                       "ok: connected; refused: nothing listening, or a REJECT rule; timed out: packets dropped; "
                       "?: not a verdict (one timeout, or no time left); ·: not probed", style="dim"))


def rate_word(gbit: float | None) -> str:
    if gbit is None:
        return "failed"
    return f"{gbit:.3g}G" if gbit >= 0.1 else f"{gbit * 1000:.3g}M"


def render_bandwidth(console: Console, figures: Mapping[str, Any], nodes: Sequence[str]) -> None:
    """``check --bandwidth``'s links as a node x node table, a row per sender: each cell the
    link's best figure (``9.41G``, ``47.8M`` bit/s), red where slow, ``·`` where not measured.
    Beyond GROUP_AFTER nodes only the rows and columns of nodes with a slow link are drawn."""
    links = {(link["from"], link["to"]): link for link in figures.get("links", [])}
    if len(nodes) > GROUP_AFTER:
        nodes = [node for node in nodes if any(link.get("slow") and node in pair for pair, link in links.items())]
        if not nodes:
            return
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1), pad_edge=False,
                  title=Text("bandwidth: rows sent to columns", style="bold"), title_justify="left")
    table.add_column("from \\ to", no_wrap=True)
    for node in nodes:
        table.add_column(node, justify="right", no_wrap=True)
    for sender in nodes:
        cells = []
        for receiver in nodes:
            link = links.get((sender, receiver))
            if sender == receiver or link is None:
                cells.append(Text("-" if sender == receiver else "·", style="dim"))
                continue
            style = "bold red" if link.get("slow") else ("yellow" if link.get("cpu_bound") else "green")
            cells.append(Text(rate_word(link.get("gbit")), style=style))
        table.add_row(sender, *cells)
    print_table(console, table)
    console.print(Text(f"bit/s, each link's best of its transfers (median of the nodes {rate_word(figures.get('median_gbit'))}); "
                       "red: slow (measured again alone); yellow: the CPU limited it (the link may be faster); "
                       "·: not measured (--mesh full measures every pair)", style="dim"))
