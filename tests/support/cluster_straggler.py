"""The straggler on the local cluster: ``less_cpu`` throttles a node's ranks as cpulimit
would, ``compute_job`` runs a 4x1 tqdm job on a terminal, ``assert_named_the_straggler``
holds what the summary and the live panel must say (with and without a container)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from io import StringIO
from pathlib import Path

from localcluster import LocalCluster
from rich.console import Console

from torchherd.cli import main

TQDM_DEMO = str(Path(__file__).resolve().parents[2] / "examples" / "tqdm_demo.py")
ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def node_ranks(cluster: LocalCluster, node: str) -> list[int]:
    """The torchrun workers on ``node`` (their environment holds LOCAL_RANK)."""
    found = []
    for pid in cluster.node_pids(node):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(entry.startswith(b"LOCAL_RANK=") for entry in environ):
            found.append(pid)
    return found


@contextlib.contextmanager
def less_cpu(cluster: LocalCluster, node: str, stopped: float = 0.07, running: float = 0.03) -> Iterator[None]:
    """``node``'s ranks stopped for ``stopped`` of every ``stopped + running`` seconds, as
    ``cpulimit`` throttles a process (SIGSTOP, SIGCONT): a node with less CPU."""
    done = threading.Event()

    def throttle() -> None:
        pids: list[int] = []
        looked = 0.0
        while not done.is_set():
            if time.monotonic() - looked > 1.0:  # a rank that started (or ended) since
                pids, looked = node_ranks(cluster, node), time.monotonic()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            time.sleep(running)

    thread = threading.Thread(target=throttle, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        for pid in node_ranks(cluster, node):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def assert_named_the_straggler(code: int, text: str, node: str) -> None:
    """The job ended 0, the summary named ``node`` the others waited for (1.5x and more),
    and the live panel marked it slow."""
    assert code == 0, text[-3000:]
    named = re.search(r"slowest node: (\S+), ([0-9.]+)x slower than the median \(the others waited for it", text)
    assert named is not None and named.group(1) == node and float(named.group(2)) >= 1.5, text[-3000:]
    assert re.search(rf"{node}\s+slow [0-9.]+x", text), f"{node} not marked in the live panel"


WINDOW = 10.0
"""The straggler window the runs ask for (``--straggler-window``: its least, the default is 30 s).
Measured with it, a job 5 s longer than the window: the throttled node named 2.1-2.8x slower
than the median (1.5x names it), the healthy run nothing, 3 runs of 3."""


def compute_job(cluster: LocalCluster, logs: Path) -> tuple[int, str]:
    """A 4x1 tqdm job doing real work for 15 s (its 10 s straggler window and five seconds
    more to judge in), on a terminal: the code and the text. Timed, not counted in steps,
    so that a throttled node makes the job no longer, only slower."""
    out = StringIO()
    console = Console(file=out, width=160, height=40, force_terminal=True, color_system="standard", highlight=False)
    code = main(["-i", str(cluster.inventory), "run", "--no-check", "--log-dir", str(logs), "--nproc-per-node", "1",
                 "--straggler-window", str(WINDOW), "--", TQDM_DEMO, "--epochs", "1", "--steps", "100000", "--seconds", str(WINDOW + 5),
                 "--compute", "1000"], console=console)
    return code, ESCAPE.sub("", out.getvalue())
