"""``torchherd run``: the plan (``--dry-run``), the live lines, and the summary."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from torchherd.console import node_colour, print_table, printable
from torchherd.engine.eventlog import HISTORY_FILE
from torchherd.remote.wire import RANK_PREFIX_HEAD
from torchherd.runlog import ERR_HEAD, OUT_HEAD, OUT_RANKS, STDERR, OutputLine, RankLines, RunSummary

if TYPE_CHECKING:  # the engine is imported when a run starts, not with the console
    from torchherd.engine.backend import Description

SEPARATOR = " │ "
"""Between a line's prefix and its text on a terminal (the prefixes padded to one width)."""
PIPE_SEPARATOR = ": "
"""... and anywhere else, as pdsh writes it: ``node1:3: text``, for ``grep '^node1:'`` and ``cut -d:``."""
_CONTROL_BYTES = re.compile(rb"[\x00-\x08\x0b-\x1f\x7f]|\xc2[\x80-\x9f]")
"""A control character in UTF-8 (C0 but tab and newline, DEL, C1)."""
STATE_STYLES = {"ok": "green", "failed": "bold red", "lost": "bold red", "torn down": "yellow",
                "interrupted": "yellow", "not started": "bold red", "unresponsive": "bold red"}


def render_description(console: Console, described: Description, after: Sequence[str] = ()) -> None:
    """What ``run --dry-run`` prints: every node's command, or SLURM's batch script; what
    comes from the nodes, the job and the inventory with its escapes shown. ``after``: notes
    put before its closing line (a run with retries: what its later attempts add)."""
    lines = described.text()
    for role, text in (*lines[:-1], *(("note", f"  - {note}") for note in after), *lines[-1:]):
        # a note stays on its line; a command and a script keep theirs (a setup snippet spans lines)
        shown = printable(text) if role == "note" else printable(text, lines=True)
        console.print(Text(shown, style=_style(role)), soft_wrap=True)


_ROLE_STYLES = {"": "", "title": "bold", "note": "dim"}


def _style(role: str) -> str:
    """A line's style by its role; ``node:N``: the Nth node's head, in its colour."""
    if role in _ROLE_STYLES:
        return _ROLE_STYLES[role]
    return f"bold {node_colour(int(role.removeprefix('node:')))}"


def plan_json(described: Description) -> dict[str, object]:
    """``run --dry-run --json``: every node's exact command, its environment's names (never
    their values: a token may be among them), or SLURM's batch script with secrets as ***."""
    return {"dry_run": True, **described.as_json()}


class LiveRenderer:
    """Prints batches of lines as ``node:rank │ text``, one colour per node; not on a
    terminal, as ``node:rank: text`` (ASCII, the prefix unpadded).

    The launcher drains its queue and hands over everything it got at once. Each
    prefix is styled once through rich and cached; a batch is then one plain string
    and one write, so a chatty job costs string joins, not a rich render per line.
    """

    def __init__(self, console: Console, nodes: Sequence[str], max_rank: int) -> None:
        self.console = console
        self.terminal = console.is_terminal
        self.separator = SEPARATOR if self.terminal else PIPE_SEPARATOR
        self.colours = {node: node_colour(index) for index, node in enumerate(nodes)}
        longest = max((len(node) for node in nodes), default=0)
        self.width = longest + 1 + len(str(max(max_rank, 0)))
        self._prefixes: dict[tuple[str, int | None], str] = {}
        self._ranks: dict[str, set[int]] = {}
        """Per node, the ranks whose prefix ``block_text`` rewrites."""
        self._styles = {"red": self._ansi("red"), "dim": self._ansi("dim")}

    def _styled(self, text: Text) -> str:
        with self.console.capture() as capture:
            self.console.print(text, end="", soft_wrap=True)
        return capture.get()

    def _ansi(self, style: str) -> tuple[str, str]:
        """The escape codes that open and close ``style`` on this console ("" without colour)."""
        opened, _, closed = self._styled(Text("\0", style=style)).partition("\0")
        return opened, closed

    def prefix(self, line: OutputLine) -> str:
        label = line.node if line.rank is None else f"{line.node}:{line.rank}"
        return label.ljust(self.width) if self.terminal else label

    def _styled_prefix(self, node: str, rank: int | None) -> str:
        key = (node, rank)
        cached = self._prefixes.get(key)
        if cached is None:
            text = Text(self.prefix(OutputLine(node, rank, "", "")), style=self.colours.get(node, ""))
            text.append(self.separator, style="dim")
            cached = self._prefixes[key] = self._styled(text)
        return cached

    def format(self, line: OutputLine) -> str:
        text = printable(line.text)  # the job's bytes never act on the terminal
        if line.stream != STDERR:
            return self._styled_prefix(line.node, line.rank) + text
        opened, closed = self._styles["red" if line.rank is not None else "dim"]
        return f"{self._styled_prefix(line.node, line.rank)}{opened}{text}{closed}"

    def render(self, lines: Sequence[OutputLine | RankLines]) -> None:
        if lines:
            self.write(self.text(lines))

    def text(self, lines: Sequence[OutputLine | RankLines]) -> str:
        """The batch as the terminal shows it, every line ending in a newline."""
        return "".join(self.format(line) + "\n" if isinstance(line, OutputLine) else self.block_text(line)
                       for line in lines)

    def write(self, text: str) -> None:
        """One write of ready terminal text (``TerminalView`` puts its panel around it)."""
        if text:
            file = self.console.file
            file.write(text)
            file.flush()

    def collapsed(self, label: str, stream: str, text: str, count: int, node: str) -> str:
        """One line said by ``count`` ranks or nodes: ``node[0-3]:* │ text (x8)``."""
        head = Text(label, style=self.colours.get(node, ""))
        head.append(self.separator, style="dim")
        opened, closed = self._styles["red"] if stream == STDERR else ("", "")
        count_opened, count_closed = self._styles["dim"]
        return f"{self._styled(head)}{opened}{printable(text)}{closed} {count_opened}(x{count}){count_closed}"

    def block_text(self, block: RankLines) -> str:
        """A block's lines as ``format`` would print them, rewritten a whole block at a time."""
        if RANK_PREFIX_HEAD in block.node.encode() or _CONTROL_BYTES.search(block.records):
            # A prefix that holds the record's own head would be rewritten twice; control
            # characters are escaped line by line (``format``): the common block has none.
            return "".join(self.format(line) + "\n" for line in block.lines())
        data = block.records
        if ERR_HEAD in data:
            data = self._stderr_bytes(block.node, data, block.stderr_ranks())
        known = self._ranks.setdefault(block.node, set())
        data = self._stdout_bytes(block.node, data, known)
        if OUT_HEAD in data:
            # Ranks this node has not printed before: found once, then known.
            new = {int(rank) for rank in OUT_RANKS.findall(data)}
            known.update(new)
            data = self._stdout_bytes(block.node, data, new)
        return data[1:].decode("utf-8", "replace")

    def _stdout_bytes(self, node: str, data: bytes, ranks: set[int]) -> bytes:
        for rank in ranks:
            data = data.replace(b"%s%d] " % (OUT_HEAD, rank), b"\n" + self._styled_prefix(node, rank).encode())
        return data

    def _stderr_bytes(self, node: str, data: bytes, ranks: set[int]) -> bytes:
        opened, closed = (style.encode() for style in self._styles["red"])
        if closed:
            # Close the colour where each stderr record ends, while the tags still say which.
            parts = data.split(b"\nE")
            data = b"\nE".join([parts[0]] + [part.replace(b"\n", closed + b"\n", 1) for part in parts[1:]])
        for rank in ranks:
            data = data.replace(b"%s%d] " % (ERR_HEAD, rank), b"\n" + self._styled_prefix(node, rank).encode() + opened)
        return data

    def note(self, message: str, style: str = "bold") -> None:
        """A line from torchherd itself (a node started, exited, vanished)."""
        self.write(self.note_text(message, style))

    def note_text(self, message: str, style: str = "bold") -> str:
        return self._styled(Text(f"torchherd{self.separator}{printable(message)}", style=style)) + "\n"


def render_summary(console: Console, summary: RunSummary) -> None:
    # Cells are Text, never markup: job output like "[rank1]:" must show as written.
    table = Table(title=Text(f"run {summary.run_id}"), title_justify="left")
    for column in ("node", "state", "exit", "time", "first error"):
        table.add_column(column, overflow="fold")
    for outcome in summary.nodes:
        seconds = "-" if outcome.seconds is None else f"{outcome.seconds:.1f}s"
        code = "-" if outcome.exit_code is None else str(outcome.exit_code)
        state = outcome.state if outcome.failed_rank is None else f"{outcome.state} (rank {outcome.failed_rank})"
        if outcome.left:
            state += f", {outcome.left} left running"
        table.add_row(Text(outcome.node), Text(state, style=STATE_STYLES.get(outcome.state, "")), code, seconds,
                      Text(printable(outcome.first_error or "")))
    print_table(console, table)
    for outcome in summary.nodes:
        if outcome.state in ("failed", "lost", "not started", "unresponsive") and outcome.last_lines:
            console.print(Text(f"last lines of {outcome.node}:", style="bold"), soft_wrap=True)
            for text in outcome.last_lines:
                console.print(Text(f"  {printable(text)}"), soft_wrap=True)
    style = "bold green" if summary.exit_code == 0 else "bold red"
    console.print(Text(printable(summary.headline), style=style), soft_wrap=True)
    console.print(Text(f"logs: {summary.log_dir}", style="dim"), soft_wrap=True)


def render_report_line(console: Console, summary: RunSummary) -> None:
    """The summary's last line, where the run's history was kept: the command that draws it."""
    if (Path(summary.log_dir) / HISTORY_FILE).is_file():
        console.print(Text(f"report: torchherd report {summary.run_id} (--text: in a few lines)", style="dim"),
                      soft_wrap=True)
