"""Recovery on the local cluster: the resumable example, a node killed mid-run
(``kill_node``), the attempts table's rows and the hang watch's py-spy dumps as printed."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

from localcluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]
RESUMABLE = str(ROOT / "examples" / "resumable.py")


def attempt_rows(out: str) -> list[str]:
    """The rows of the attempts table (each starts with its number: piped, plain columns)."""
    table = out[out.rindex("attempts"):]
    return [line for line in table.splitlines() if re.match(r"^\d+  node", line)]


def kill_node(cluster: LocalCluster, name: str) -> None:
    """The node dies: its link goes down and every process of its namespace is killed."""
    cluster.cut_network(name)
    for pid in cluster.node_pids(name):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def assert_spied(out: str, sleeping: int) -> None:
    """py-spy (a test extra, beside the nodes' Python) dumped every rank while they were
    stopped: the headline names the file, which has the sleeping rank in its own frame."""
    found = re.search(r"\(py-spy: (\S+py-spy-attempt-1\.txt)\)", out)
    assert found, out
    path = Path(found.group(1))
    assert path.stat().st_mode & 0o777 == 0o600
    dumps = path.read_text(encoding="utf-8")
    assert [int(rank) for rank in re.findall(r"^==== rank (\d) on node\d$", dumps, re.M)] == [0, 1, 2], dumps
    one = dumps[dumps.index("==== rank 1 on node1"):dumps.index("==== rank 2")]
    assert re.search(rf"^\s+main \(\S+/resumable\.py:{sleeping}\)$", one, re.M), dumps
