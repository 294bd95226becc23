"""The links as ``check --bandwidth`` measured them, kept on this machine per pair of hosts,
so that a later run's replication takes its share of the link as it is, not as the NIC
states it (a virtual NIC states 10 Gb/s, or nothing, whatever it carries).

``$XDG_STATE_HOME/torchherd/links.json`` (beside the run records, 0600): ``{"SENDER
RECEIVER": [bits per second, when measured]}``, each host by its address (how the
controller reaches it, the same in every inventory that names the machine). A figure older
than ``KEPT_SECONDS`` is not used: links change (a switch replaced, a VM moved)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Mapping

from torchherd.engine.records.paths import runs_dir
from torchherd.remote.wire import write_text_atomic
from torchherd.statedir import read_kept

KEPT_SECONDS = 7 * 86400.0
"""How long a measured figure stands for its link."""
MAX_LINKS = 4096
"""The most pairs kept (the newest): a 64-node mesh is 4032."""
MAX_FILE_BYTES = 1 << 20


def links_file(directory: Path | None = None) -> Path:
    return (directory or runs_dir().parent) / "links.json"


def keep_links(bandwidth: Mapping[str, Any], addresses: Mapping[str, str], now: float | None = None,
               directory: Path | None = None) -> None:
    """Adds the links of ``check --bandwidth``'s figures (``CheckReport.bandwidth``) to the
    kept ones; ``addresses``: each node's address by its name. A link that failed is left
    out (its old figure too stays: a failure says nothing of its speed)."""
    when = time.time() if now is None else now
    measured = {f"{addresses[link['from']]} {addresses[link['to']]}": [float(link["gbit"]) * 1e9, when]
                for link in bandwidth.get("links", ())
                if link.get("gbit") and link.get("from") in addresses and link.get("to") in addresses}
    if not measured:
        return
    kept = {**_read(links_file(directory)), **measured}
    newest = dict(sorted(kept.items(), key=lambda item: item[1][1])[-MAX_LINKS:])
    path = links_file(directory)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_text_atomic(str(path), json.dumps(newest, separators=(",", ":")))


def measured_link(sender: str, receiver: str, now: float | None = None, directory: Path | None = None) -> float | None:
    """Bytes per second from ``sender`` to ``receiver`` (their addresses) as last measured,
    when that was less than ``KEPT_SECONDS`` ago; None: no such figure."""
    figure = _read(links_file(directory)).get(f"{sender} {receiver}")
    when = time.time() if now is None else now
    if figure is None or when - figure[1] > KEPT_SECONDS:
        return None
    return figure[0] / 8


def _read(path: Path) -> dict[str, list[float]]:
    """The kept figures; a file that is missing, too big or damaged keeps none (a check
    run again writes it anew)."""
    raw = read_kept(path, MAX_FILE_BYTES)
    return {key: [float(value[0]), float(value[1])] for key, value in raw.items()
            if isinstance(key, str) and isinstance(value, list) and len(value) == 2
            and all(isinstance(number, (int, float)) and not isinstance(number, bool) for number in value)
            and value[0] > 0}
