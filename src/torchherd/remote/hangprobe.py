"""On a node: the ranks of one run, found by their environment, and their CPU time;
with ``stop``, SIGSTOP to each; with ``abort``, SIGABRT then SIGCONT (the job runs with
PYTHONFAULTHANDLER=1, so each rank prints every thread's Python stack before it dies).

    python -I -S -u -c PROGRAM RUN_ID cpu|stop|spy|abort   ->   one JSON line: {"ticks": N, "cpu": S, "ranks": [...]}

``spy`` adds ``"dumps"``: per rank, what ``py-spy dump`` says of it, where the node has
py-spy (beside the Python, or on PATH); nothing otherwise.

A rank is a process whose environment holds ``TORCHHERD_RUN_ID=<run id>`` and a
``LOCAL_RANK`` (torchrun's workers; torchrun itself has none): nothing is found, or
signalled, by name. Standard library only (the node's Python 3.8 or later).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

SPY_TIMEOUT = 10.0
"""Seconds one ``py-spy dump`` may take (it reads a rank's memory; a second or so)."""


def ranks(run_id: str) -> List[Tuple[int, int, int]]:
    """(pid, global rank, CPU ticks) of every rank of the run on this node."""
    wanted = ("TORCHHERD_RUN_ID=" + run_id).encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/" + entry + "/environ", "rb") as file:
                variables = file.read().split(b"\0")
            with open("/proc/" + entry + "/stat", "rb") as file:
                stat = file.read()
        except OSError:  # gone, or another user's
            continue
        if wanted not in variables:
            continue
        names = dict(item.split(b"=", 1) for item in variables if b"=" in item)
        if b"LOCAL_RANK" not in names:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()
        ticks = int(fields[11]) + int(fields[12])  # utime + stime
        rank = names.get(b"RANK", b"-1")
        found.append((int(entry), int(rank) if rank.lstrip(b"-").isdigit() else -1, ticks))
    return found


def main() -> None:
    run_id, action = sys.argv[1], sys.argv[2]
    found = ranks(run_id)
    # "stop" freezes every rank first (on every node), so that no rank sees a peer die, and
    # fail out of its collective, before its own SIGABRT: each prints where the hang held it.
    signals = {"stop": (signal.SIGSTOP,), "abort": (signal.SIGABRT, signal.SIGCONT)}.get(action, ())
    for pid, _, _ in found:
        for number in signals:
            try:
                os.kill(pid, number)
            except OSError:
                pass
    ticks = sum(ticks for _, _, ticks in found)
    answer = {"ticks": ticks, "cpu": ticks / os.sysconf("SC_CLK_TCK"), "ranks": sorted(rank for _, rank, _ in found)}
    if action == "spy":
        answer["dumps"] = dumps(found)
    print(json.dumps(answer))


def py_spy() -> Optional[str]:
    """py-spy where the node has it: beside this Python (a virtualenv's bin), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else shutil.which("py-spy")


def dumps(found: List[Tuple[int, int, int]]) -> Dict[str, str]:
    """Per rank, ``py-spy dump`` of its process (every thread's Python stack, read from
    outside: no signal, nothing of the rank's own needed); empty without py-spy. The
    ranks are stopped (SIGSTOP) already: ``--nonblocking`` reads them as they are (py-spy's
    own ptrace pause fails on a stopped process)."""
    program = py_spy()
    if program is None:
        return {}
    said = {}
    for pid, rank, _ in found:
        try:
            done = subprocess.run([program, "dump", "--nonblocking", "--full-filenames", "--pid", str(pid)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=SPY_TIMEOUT, check=False)
        except (OSError, subprocess.SubprocessError):
            continue
        said[str(rank)] = done.stdout.decode("utf-8", "replace")
    return said


if __name__ == "__main__":
    main()
