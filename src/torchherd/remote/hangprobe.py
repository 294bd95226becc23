"""On a node: the ranks of one run, found by their environment, and their CPU time;
with ``stop``, SIGSTOP to each; with ``abort``, SIGABRT then SIGCONT (the job runs with
PYTHONFAULTHANDLER=1, so each rank prints every thread's Python stack before it dies).

    python -I -S -u -c PROGRAM RUN_ID cpu|fr|stop|spy|abort [SUPERVISOR [THAW]]
        ->   one JSON line: {"ticks": N, "cpu": S, "ranks": [...]}

``fr`` adds ``"fr"``: per rank, the last collectives torch's flight recorder holds of it,
where the job runs with torchherd's hook (remote/flight.py); asked before ``stop``, while
the ranks still run.

``spy`` adds ``"dumps"``: per rank, what ``py-spy dump`` says of it, where the node has
py-spy (beside the Python, or on PATH); nothing otherwise.

A rank is a process whose environment holds ``TORCHHERD_RUN_ID=<run id>`` and a
``LOCAL_RANK`` (torchrun's workers; torchrun itself has none) and, given the pid of the
node's SUPERVISOR, that descends from it (anyone can put the run id in an environment: a
decoy must neither hide a hang nor be named its culprit; 0: the supervisor is not known
yet, no rank). Without SUPERVISOR (a SLURM job step, where the job is SLURM's), the
environment alone. Nothing is found, or signalled, by name. ``stop`` leaves a guard
behind: THAW seconds later (default 120) it sends SIGCONT to every rank it froze that is
still the same process, so a job whose controller died before its ``abort`` does not stay
frozen on its GPUs. Standard library only (the node's Python 3.8 or later).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

from torchherd.remote import flight

THAW = 120.0
"""Seconds after ``stop`` its guard continues the ranks it froze (the controller's whole
stop, spy and abort take less)."""
FR_WAIT = 3.0
"""Seconds the ranks have to write their flight records (each rank's hook looks every 0.25 s)."""
SPY_TIMEOUT = 10.0
"""Seconds one ``py-spy dump`` may take (it reads a rank's memory; a second or so)."""


Found = List[Tuple[int, int, int, bytes]]
"""(pid, global rank, CPU ticks, start time) of each rank."""


def ranks(run_id: str, supervisor: Optional[int] = None) -> Found:
    """Every rank of the run on this node (only descendants of ``supervisor``, given; 0:
    not known yet, none)."""
    if supervisor == 0:
        return []
    wanted = ("TORCHHERD_RUN_ID=" + run_id).encode()
    stats: Dict[int, List[bytes]] = {}
    for entry in os.listdir("/proc"):
        if not (entry.isascii() and entry.isdigit()):
            continue
        try:
            with open("/proc/" + entry + "/stat", "rb") as file:
                stat = file.read()
        except OSError:
            continue
        stats[int(entry)] = stat[stat.rindex(b")") + 2:].split()
    found = []
    for pid, fields in stats.items():
        if supervisor is not None and not descends(stats, pid, supervisor):
            continue
        try:
            with open("/proc/" + str(pid) + "/environ", "rb") as file:
                variables = file.read().split(b"\0")
        except OSError:  # gone, or another user's
            continue
        if wanted not in variables:
            continue
        names = dict(item.split(b"=", 1) for item in variables if b"=" in item)
        if b"LOCAL_RANK" not in names:
            continue
        ticks = int(fields[11]) + int(fields[12])  # utime + stime
        rank = names.get(b"RANK", b"-1")
        found.append((pid, int(rank) if rank.lstrip(b"-").isdigit() else -1, ticks, fields[19]))
    return found


def hook_dirs(found: Found) -> Dict[int, str]:
    """Per rank (pid), the flight recorder hook's directory its environment names."""
    dirs = {}
    for pid, _, _, _ in found:
        try:
            with open("/proc/" + str(pid) + "/environ", "rb") as file:
                variables = dict(item.split(b"=", 1) for item in file.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        directory = flight.directory_of(variables)
        if directory:
            dirs[pid] = directory
    return dirs


def descends(stats: Dict[int, List[bytes]], pid: int, root: int) -> bool:
    """Whether ``pid`` is a descendant of ``root`` (parents from /proc/PID/stat)."""
    seen = set()
    while pid in stats and pid not in seen:
        seen.add(pid)
        parent = int(stats[pid][1])
        if parent == root:
            return True
        pid = parent
    return False


def state_of(pid: int, start: bytes) -> Optional[bytes]:
    """The process's state letter while it is still the process that started at ``start``;
    None once it is gone (or its pid is another's)."""
    try:
        with open("/proc/" + str(pid) + "/stat", "rb") as file:
            stat = file.read()
        fields = stat[stat.rindex(b")") + 2:].split()
    except (OSError, ValueError):
        return None
    return fields[0] if len(fields) > 19 and fields[19] == start and fields[0] not in (b"Z", b"X") else None


def thaw_later(found: Found, seconds: float) -> None:
    """A guard, in a process of its own that outlives this one (its output closed: the SSH
    command ends now): ``seconds`` later, SIGCONT to each of ``found`` still stopped and
    still the same process (its start time). It ends as soon as none is left to thaw (each
    gone, or continued: ``abort`` came), so it outlives the run by a moment at most."""
    try:
        if os.fork():
            return
    except OSError:
        return
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        started = time.monotonic()
        watched = {pid: (start, False) for pid, _, _, start in found}  # pid -> (start, seen stopped)
        while watched and time.monotonic() - started < seconds:
            time.sleep(0.2)
            for pid, (start, seen) in list(watched.items()):
                state = state_of(pid, start)
                stopped = state == b"T"
                if state is None or (seen and not stopped) or (not stopped and time.monotonic() - started > 2.0):
                    del watched[pid]  # gone, continued, or never stopped: nothing to thaw
                else:
                    watched[pid] = (start, seen or stopped)
        for pid, (start, _) in watched.items():
            if state_of(pid, start) == b"T":
                try:
                    os.kill(pid, signal.SIGCONT)
                except OSError:
                    continue
    finally:
        os._exit(0)


def main() -> None:
    run_id, action = sys.argv[1], sys.argv[2]
    given = sys.argv[3] if len(sys.argv) > 3 else "-"
    supervisor = int(given) if given.isascii() and given.isdigit() else None
    found = ranks(run_id, supervisor)
    # "stop" freezes every rank first (on every node), so that no rank sees a peer die, and
    # fail out of its collective, before its own SIGABRT: each prints where the hang held it.
    signals = {"stop": (signal.SIGSTOP,), "abort": (signal.SIGABRT, signal.SIGCONT)}.get(action, ())
    for pid, _, _, _ in found:
        for number in signals:
            try:
                os.kill(pid, number)
            except OSError:
                pass
    if action == "stop" and found:
        thaw_later(found, float(sys.argv[4]) if len(sys.argv) > 4 else THAW)
    ticks = sum(ticks for _, _, ticks, _ in found)
    answer = {"ticks": ticks, "cpu": ticks / os.sysconf("SC_CLK_TCK"), "ranks": sorted(rank for _, rank, _, _ in found)}
    if action == "spy":
        answer["dumps"] = dumps(found)
    if action == "fr":
        answer["fr"] = flight.collect(hook_dirs(found), {pid: rank for pid, rank, _, _ in found}, FR_WAIT)
    print(json.dumps(answer))


def py_spy() -> Optional[str]:
    """py-spy where the node has it: beside this Python (a virtualenv's bin), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else shutil.which("py-spy")


def dumps(found: Found) -> Dict[str, str]:
    """Per rank, ``py-spy dump`` of its process (every thread's Python stack, read from
    outside: no signal, nothing of the rank's own needed); empty without py-spy. The
    ranks are stopped (SIGSTOP) already: ``--nonblocking`` reads them as they are (py-spy's
    own ptrace pause fails on a stopped process)."""
    program = py_spy()
    if program is None:
        return {}
    said = {}
    for pid, rank, _, _ in found:
        try:
            done = subprocess.run([program, "dump", "--nonblocking", "--full-filenames", "--pid", str(pid)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=SPY_TIMEOUT, check=False)
        except (OSError, subprocess.SubprocessError):
            continue
        said[str(rank)] = done.stdout.decode("utf-8", "replace")
    return said


if __name__ == "__main__":
    main()
