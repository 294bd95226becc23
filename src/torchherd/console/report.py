"""``report RUN --text`` and ``logs RUN --events`` on the terminal: the run's story in a
few lines, its history one record a line. Text only, never markup (a node's output may
hold brackets); escapes shown, never acted on (``printable``)."""

from __future__ import annotations

import json
import time
from typing import Sequence

from rich.console import Console
from rich.text import Text

from torchherd.console import printable
from torchherd.engine.eventlog import LinesSeen, Recorded, encoded


def render_story(console: Console, text: str) -> None:
    for line in text.splitlines():
        console.print(Text(printable(line)), soft_wrap=True)


def event_text(record: Recorded) -> str:
    """``08:00:02.000 AttemptStarted {"number":1,...}``: UTC time, kind, fields as JSON."""
    stamp = time.strftime("%H:%M:%S", time.gmtime(record.at)) + f".{int(record.at * 1000) % 1000:03d}"
    data = encoded(record.event)
    kind = data.pop("_type")
    if kind == "NodeStatus":  # a sample: its node, its kind, its fields
        status = data["status"]
        kind = f"{status['node']} {status['event']}"
        data = {key: value for key, value in status["fields"].items() if key != "event"}
    elif isinstance(record.event, LinesSeen):
        kind = f"{record.event.node} lines"
        data = {"total": record.event.total}
    return f"{stamp} {kind} {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}"


def render_events(console: Console, records: Sequence[Recorded]) -> None:
    for record in records:
        console.print(Text(printable(event_text(record))), soft_wrap=True)
