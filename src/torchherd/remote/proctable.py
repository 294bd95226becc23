"""The node's process table, read from /proc, and the teardown that empties it of a run.

Standard library and ``wire`` only, Python >= 3.8, Linux. Shipped to the nodes inside
the supervisor's and ``stop``'s programs (``torchherd.remote.program``): both find a
run's processes the same way, by this supervisor's tree and by the token in their
environment (``wire.SUPERVISOR_ENV``), never by name or command line.
"""

from __future__ import annotations

import os
import signal
from typing import Dict, List, Optional, Set, Tuple

# On a node this is the stand-in module the shipped program registered; see
# torchherd/remote/__init__.py.
from torchherd.remote import wire

POLL_INTERVAL = 0.05
KILL_TIMEOUT = 5.0
PR_SET_CHILD_SUBREAPER = 36
LEFTOVER = "leftover"
"""The teardown's reason when the job's main process ended by itself: its leftovers are swept."""
GONE_STATES = ("Z", "X", "x")
"""Zombies and the dead: no longer running, nothing to signal."""
COMMAND_SHOWN = 200
"""Characters of a leftover process's command line in ``stop``'s reply."""

def exit_code_from_status(status: int) -> int:
    """A wait() status as a shell would report it: code, or 128+signal."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    return 1


ProcTable = Dict[int, Tuple[int, str]]
"""pid -> (parent pid, state letter)."""


def read_proc_table(proc: str = "/proc", pids: Optional[Tuple[int, ...]] = None) -> ProcTable:
    """pid -> (ppid, state letter) for every process visible in /proc (only ``pids``, given)."""
    table: ProcTable = {}
    try:
        names = os.listdir(proc) if pids is None else [str(pid) for pid in pids]
    except OSError:
        return table
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(proc + "/" + name + "/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        end = data.rfind(b")")
        fields = data[end + 2 :].split()
        if len(fields) < 2:
            continue
        try:
            table[int(name)] = (int(fields[1]), fields[0].decode("ascii", "replace"))
        except ValueError:
            continue
    return table


def descendants(table: ProcTable, root: int) -> Set[int]:
    children: Dict[int, List[int]] = {}
    for pid, (ppid, _state) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: Set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found and child != root:
                found.add(child)
                stack.append(child)
    return found


def ancestors(table: ProcTable, pid: int) -> Set[int]:
    found: Set[int] = set()
    while pid in table and pid not in found:
        found.add(pid)
        pid = table[pid][0]
    return found


def environ_belongs(pid: int, run_id: str, token: Optional[str], proc: str = "/proc") -> bool:
    """True when the process's environment marks it as this supervisor's job: the run id
    and, given a ``token``, this supervisor's own token (TORCHHERD_SUPERVISOR), which only
    the processes it started inherit. The run id alone is a name anyone can put in an
    environment; another supervisor's token is a sibling node's on this process table.
    """
    try:
        with open(proc + "/" + str(pid) + "/environ", "rb") as f:
            data = f.read()
    except OSError:
        return False
    run_entry = (wire.RUN_ID_ENV + "=" + run_id).encode()
    if run_entry not in data:
        return False
    entries = data.split(b"\0")
    if run_entry not in entries:
        return False
    if token is not None:
        return (wire.SUPERVISOR_ENV + "=" + token).encode() in entries
    return True


def find_job_processes(
    run_id: str, token: Optional[str], root: int, proc: str = "/proc"
) -> Set[int]:
    """Live processes of this run: descendants of root, plus environ matches."""
    table = read_proc_table(proc)
    live = {pid for pid, (_pp, state) in table.items() if state not in GONE_STATES}
    found = descendants(table, root) & live
    exclude = ancestors(table, root) | {root}
    for pid in live:
        if pid in found or pid in exclude:
            continue
        if environ_belongs(pid, run_id, token, proc):
            found.add(pid)
    return found


def send_signal(pids: Set[int], sig: int) -> Set[int]:
    sent: Set[int] = set()
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            continue
        sent.add(pid)
    return sent


def set_child_subreaper() -> bool:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except Exception:
        return False




def is_process(pid: Optional[int], start: Optional[int]) -> bool:
    """``pid`` still runs and is the process that started at ``start`` (``wire.process_start``)."""
    if pid is None or pid <= 0 or start is None:
        return False
    return read_proc_table(pids=(pid,)).get(pid, (0, "X"))[1] not in GONE_STATES and wire.process_start(pid) == start


def command_line(pid: int) -> str:
    """The process's command line as ``ps`` shows it, cut to COMMAND_SHOWN characters."""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            data = f.read()
    except OSError:
        return ""
    return data.replace(b"\0", b" ").decode("utf-8", "replace")[:COMMAND_SHOWN]


class Teardown:
    """Ends a job's processes: SIGTERM to each, SIGKILL to all once the grace period is
    over (or at once), and gives up KILL_TIMEOUT after that; looked at every POLL_INTERVAL."""

    def __init__(self, reason: str, kill_now: bool, now: float, grace: float) -> None:
        self.reason = reason
        self.kill_phase = kill_now
        self.term_deadline = now + grace
        self.kill_deadline = now + KILL_TIMEOUT
        self.next_poll = now
        self.signalled: Set[int] = set()
        self.killed: Set[int] = set()
        self.complete = False
        self.gave_up = False
        self.left = 0

    def escalate(self, now: float) -> None:
        if not self.kill_phase and not self.complete:
            self.kill_phase = True
            self.kill_deadline = now + KILL_TIMEOUT
            self.next_poll = now

    def due(self, now: float) -> bool:
        return not self.complete and now >= self.next_poll

    def step(self, now: float, pids: Set[int]) -> bool:
        """Signals what is left of the job (``pids``); True once it is over: nothing left,
        or still something after SIGKILL's timeout (``gave_up``; ``left`` says how much)."""
        self.next_poll = now + POLL_INTERVAL
        if pids and not self.kill_phase and now >= self.term_deadline:
            self.kill_phase = True
            self.kill_deadline = now + KILL_TIMEOUT
        if pids and self.kill_phase and now >= self.kill_deadline:
            self.gave_up = True
        if not pids or self.gave_up:
            self.complete, self.left = True, len(pids)
            return True
        if self.kill_phase:
            self.killed |= send_signal(pids, signal.SIGKILL)
        else:
            self.signalled |= send_signal(pids - self.signalled, signal.SIGTERM)
        return False

    def record(self) -> bytes:
        """The "teardown" record; none when leftovers were looked for and there were none."""
        if self.reason == LEFTOVER and not self.signalled and not self.killed:
            return b""
        return wire.teardown_record(self.reason, self.signalled, self.killed)
