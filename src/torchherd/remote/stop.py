"""torchherd stop: ends one detached run's processes on a node.

Standard library and ``wire`` only, Python >= 3.8, Linux. ``torchherd stop`` runs
it on every node as ``PYTHON -c PROGRAM RUN_ID SUPERVISOR_PID GRACE``
(``torchherd.remote.program``) and reads one JSON line back (``wire.StopReply``).
Bad arguments are one line on stderr and exit status 2.

It does what Ctrl-C does to an attached run: SIGTERM to the supervisor, which tears
its job down (SIGKILL after its grace period); a second SIGTERM if it is still
there after that, which escalates. Then anything that still carries the run id,
in its environment (TORCHHERD_RUN_ID=<run id>: the job) or on its command line
(the supervisor, the coordinator), gets SIGTERM, then SIGKILL. Nothing is matched
by name, so other runs are never touched; this process and its ancestors (the SSH
session's shell, whose command line holds the run id too) are left alone, and so are
the other stops of the same run where nodes share one process table (several nodes
on one machine, stopped at once): they must not kill each other.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Callable, Dict, Iterable, List, Optional

# On a node this is the stand-in module the shipped program registered; see
# torchherd/remote/__init__.py.
from torchherd.remote import wire

EXIT_BAD_ARGS = 2
POLL = 0.1
SUPERVISOR_MARGIN = 5.0
"""Beyond the grace period: how long the supervisor gets to finish its teardown."""
SECOND_TERM_WAIT = 6.0
SWEEP_TERM_WAIT = 2.0
SWEEP_KILL_WAIT = 3.0
COMMAND_SHOWN = 200
"""Characters of a leftover process's command line in the reply."""


def read(pid: int, name: str) -> bytes:
    try:
        with open("/proc/%d/%s" % (pid, name), "rb") as f:
            return f.read()
    except OSError:
        return b""


def live_parents() -> Dict[int, int]:
    """pid -> parent pid of every process that is not a zombie."""
    parents: Dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = read(int(name), "stat")
            fields = stat[stat.rfind(b")") + 2:].split()
            if len(fields) > 1 and fields[0] not in (b"Z", b"X"):
                parents[int(name)] = int(fields[1])
    return parents


def own_program() -> Optional[bytes]:
    """The text this process runs with ``python -c``, when it was started so."""
    argv = read(os.getpid(), "cmdline").split(b"\0")
    if b"-c" not in argv[:-1]:
        return None
    return argv[argv.index(b"-c") + 1] or None


class Run:
    """The processes of one run on this node."""

    def __init__(self, run_id: str, program: Optional[bytes]) -> None:
        self.mark = run_id.encode()
        self.env_mark = (wire.RUN_ID_ENV + "=" + run_id).encode()
        self.program = program
        """A command line that holds it is another stop (or its shell), not the run's."""

    def processes(self) -> List[int]:
        parents, skip, pid = live_parents(), set(), os.getpid()
        while pid in parents and pid not in skip:
            skip.add(pid)
            pid = parents[pid]
        return [p for p in parents if p not in skip and self.belongs(p)]

    def belongs(self, pid: int) -> bool:
        cmdline = read(pid, "cmdline")
        if self.program is not None and self.program in cmdline:
            return False
        return self.mark in cmdline or self.env_mark in read(pid, "environ").split(b"\0")

    def gone(self) -> bool:
        return not self.processes()


def wait(cond: Callable[[], bool], seconds: float) -> bool:
    end = time.time() + seconds
    while time.time() < end and not cond():
        time.sleep(POLL)
    return cond()


def kill(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def command_line(pid: int) -> str:
    return read(pid, "cmdline").replace(b"\0", b" ").decode("utf-8", "replace")[:COMMAND_SHOWN]


def stop(run_id: str, supervisor: int, grace: float) -> wire.StopReply:
    """Ends every process of the run; what could not be killed is in the reply."""
    run = Run(run_id, own_program())

    def supervisor_gone() -> bool:
        return supervisor <= 0 or supervisor not in run.processes()

    was_running = not supervisor_gone()
    if was_running:
        kill([supervisor], signal.SIGTERM)
        if not wait(supervisor_gone, grace + SUPERVISOR_MARGIN):
            kill([supervisor], signal.SIGTERM)
            wait(supervisor_gone, SECOND_TERM_WAIT)
    kill(run.processes(), signal.SIGTERM)
    if not wait(run.gone, SWEEP_TERM_WAIT):
        kill(run.processes(), signal.SIGKILL)
        wait(run.gone, SWEEP_KILL_WAIT)
    return wire.StopReply(was_running, tuple(command_line(pid) for pid in run.processes()))


def main(args: List[str]) -> int:
    try:
        # An empty run id would be in every command line: refuse it, never stop everything.
        if len(args) != 3 or not args[0]:
            raise ValueError("three arguments, the first not empty")
        run_id, supervisor, grace = args[0], int(args[1]), float(args[2])
    except ValueError:
        sys.stderr.write("usage: stop.py RUN_ID SUPERVISOR_PID GRACE_SECONDS\n")
        return EXIT_BAD_ARGS
    sys.stdout.write(stop(run_id, supervisor, grace).to_json() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
