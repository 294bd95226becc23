"""``torchherd check`` output: a live node x check grid while it runs, then the
report table and one block per failure or warning with its fix."""

from __future__ import annotations

import re
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from torchherd import words
from torchherd.checks.results import CheckReport, CheckResult
from torchherd.console import STATUS_STYLES, print_table, printable
from torchherd.inventory import Inventory
from torchherd.inventory.nodeset import fold_names, split_top

SYMBOLS = {"pass": "ok", "warn": "WARN", "fail": "FAIL", "skip": "-"}
PENDING = "..."


def _columns(results: list[CheckResult] | tuple[CheckResult, ...]) -> list[str]:
    from torchherd.checks import CHECK_IDS

    present = {result.check for result in results}
    # Ids of another kind of check (SLURM's view) follow, in the order they came.
    others = [check for check in dict.fromkeys(result.check for result in results) if check not in CHECK_IDS]
    return [check for check in CHECK_IDS if check in present] + others


def _cell(result: CheckResult | None, missing: str) -> Text:
    if result is None:
        return Text(missing, style="dim")
    return Text(SYMBOLS[result.status], style=STATUS_STYLES[result.status])


def _grid(nodes: list[str], columns: list[str], results: list[CheckResult] | tuple[CheckResult, ...],
          missing: str = "") -> Table:
    by_key = {(result.node, result.check): result for result in results}
    return _table(columns, [(node, [_cell(by_key.get((node, check)), missing) for check in columns])
                            for node in nodes])


def _table(columns: list[str], rows: list[tuple[str, list[Text]]]) -> Table:
    """The node x check table: a row's name, then its cells."""
    # Columns one space apart: every check id stays whole on an 80-column terminal.
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False, collapse_padding=True)
    # The node name is the row's identity: the check headers give way first on a narrow terminal.
    table.add_column("node", no_wrap=True, min_width=max((len(name) for name, _ in rows), default=4))
    for check in columns:
        table.add_column(check, justify="center")
    for name, cells in rows:
        table.add_row(name, *cells)
    return table


def _nodes(report_results: tuple[CheckResult, ...]) -> list[str]:
    seen: list[str] = []
    for result in report_results:
        if result.node not in seen:
            seen.append(result.node)
    return seen


def render_report(console: Console, report: CheckReport) -> None:
    """The node x check table, then summary and fix for every fail and warn; the same
    finding on many nodes once, under their nodeset (as ``dshbak -c`` shows pdsh's output)."""
    nodes, columns = _nodes(report.results), _columns(report.results)
    if len(nodes) > FOLD_ROWS:
        print_table(console, _folded_grid(nodes, columns, report.results))
    else:
        print_table(console, _grid(nodes, columns, report.results))
    for status in ("fail", "warn"):
        for result, count in _coalesced([result for result in report.results if result.status == status]):
            _block(console, result, count=count)
    notes = [result for result in report.results if result.status == "pass" and result.fix]
    for result in notes[:NOTES]:
        _block(console, result, "NOTE")
    if len(notes) > NOTES:
        console.print(f"[dim]{len(notes) - NOTES} more notes like these (check --json lists them)[/]", soft_wrap=True)
    if report.bandwidth is not None:
        _bandwidth_lines(console, report.bandwidth)
    # a node SSH did not reach counts once, as its ssh failure: not once more per check it could not run
    unreached = {result.node for result in report.results if result.check == "ssh" and result.status == "fail"}
    counted = [result for result in report.results if not (result.status == "skip" and result.node in unreached)]
    counts = {status: sum(1 for r in counted if r.status == status) for status in SYMBOLS}
    verdict = "[bold red]preflight failed[/]" if not report.ok else "[green]preflight passed[/]"
    not_run = len(report.results) - len(counted)
    missed = f"; {words.count(len(unreached), 'node')} not reached ({not_run} checks not run there)" if not_run else ""
    console.print(f"{verdict}: {counts['pass']} pass, {counts['warn']} warn, {counts['fail']} fail, "
                  f"{counts['skip']} skip{missed}")


def _bandwidth_lines(console: Console, figures: Mapping[str, Any]) -> None:
    """Each node's best figure each way, on as few lines as fit (--matrix draws every link)."""
    from torchherd.console.matrix import rate_word

    nodes = figures.get("nodes") or {}
    words = [f"{escape(printable(name))} {rate_word(rate.get('in_gbit'))}/{rate_word(rate.get('out_gbit'))}"
             for name, rate in nodes.items()]
    console.print(f"bandwidth (bit/s in/out at best; median {rate_word(figures.get('median_gbit'))}): "
                  + ", ".join(words), soft_wrap=False, highlight=False)


NOTES = 3
"""Passes with advice (a fix that is not needed to run) shown at most; the rest counted."""


FOLD_ROWS = 16
"""Past this many nodes, the table's rows that read alike are one row under their nodeset."""


def _folded_grid(nodes: list[str], columns: list[str], results: tuple[CheckResult, ...]) -> Table:
    """The table with one row per distinct line of verdicts, named by its nodes' nodeset and count."""
    by_key = {(result.node, result.check): result for result in results}
    rows: dict[tuple[str | None, ...], list[str]] = {}
    for node in nodes:
        rows.setdefault(tuple(getattr(by_key.get((node, check)), "status", None) for check in columns),
                        []).append(node)
    return _table(columns, [(f"{fold_names(names)} ({len(names)})" if len(names) > 1 else names[0],
                             [_cell(by_key.get((names[0], check)), "") for check in columns])
                            for names in rows.values()])


def _coalesced(results: list[CheckResult]) -> list[tuple[CheckResult, int]]:
    """Results that say the same of different nodes (each node's name in its own text), once
    each: under the nodes' nodeset, with how many they are."""
    groups: dict[tuple[str, str, str], list[CheckResult]] = {}
    for result in results:
        name = _name_pattern(result.node)
        key = (result.check, name.sub("\0", result.summary), name.sub("\0", result.fix))
        groups.setdefault(key, []).append(result)
    merged = []
    for (check, summary, fix), members in groups.items():
        if len(members) == 1:
            merged.append((members[0], 1))
            continue
        # "a, b": "a,b" in "cannot resolve 'a,b'" read as one host's name
        label = ", ".join(split_top(fold_names([member.node for member in members])))
        merged.append((CheckResult(label, check, members[0].status, summary.replace("\0", label),
                                   fix.replace("\0", label)), len(members)))
    return merged


def _name_pattern(node: str) -> re.Pattern[str]:
    """The node's name as a word of its own: node1 in "node1:" or "node1's", not in "node10"."""
    return re.compile(rf"(?<![\w.-]){re.escape(node)}(?![\w-])")


def _block(console: Console, result: CheckResult, label: str | None = None, count: int = 1) -> None:
    style = STATUS_STYLES[result.status]
    nodes = f" ({count} nodes)" if count > 1 else ""
    console.print(f"[{style}]{label or result.status.upper()}[/] {escape(result.node)} {escape(result.check)}: "
                  f"{escape(printable(result.summary))}{nodes}", soft_wrap=True)
    if result.fix:
        console.print(f"  [dim]fix:[/] {escape(printable(result.fix))}", soft_wrap=True)


@contextmanager
def live_progress(console: Console, inventory: Inventory,
                  measured: bool = False) -> Iterator[Callable[[CheckResult], None]]:
    """Yields the progress callback; a live grid on a terminal, nothing otherwise; the
    bandwidth and MTU columns with ``measured``."""
    if not console.is_terminal:
        yield lambda result: None
        return
    from torchherd.checks.model import CHECK_IDS, OPT_IN, WHERE_THEY_APPLY

    nodes = [host.name for host in inventory.hosts]
    columns = [check for check in CHECK_IDS if check not in OPT_IN or (measured and check != "smoke")]
    results: list[CheckResult] = []
    lock = threading.Lock()

    def view() -> Group:
        # A check that applies to few runs (venv: a uv-locked project) gets its column with its first result.
        shown = [check for check in columns
                 if check not in WHERE_THEY_APPLY or any(result.check == check for result in results)]
        return Group(Text("torchherd check: running on every node...", style="bold"), _grid(nodes, shown, results, PENDING))

    with Live(view(), console=console, refresh_per_second=8, transient=True) as live:
        def progress(result: CheckResult) -> None:
            with lock:
                results.append(result)
                live.update(view())

        yield progress
