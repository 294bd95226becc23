"""torchherd stop: ends one detached run's processes on a node.

Standard library and ``wire`` only, Python >= 3.8, Linux. ``torchherd stop`` runs
it on every node as ``PYTHON -I -S -u -c PROGRAM RUN_ID GRACE STATE_FILE [COORDINATOR_FILE]``
(``torchherd.remote.command``) and reads one JSON line back (``wire.StopReply``).
Bad arguments are one line on stderr and exit status 2.

It does what Ctrl-C does to an attached run: SIGTERM to the supervisor, which tears
its job down (SIGKILL after its grace period); a second SIGTERM if it is still
there after that, which escalates. Then every process that carries the supervisor's
own token in its environment (``TORCHHERD_SUPERVISOR``: the job, orphans included)
gets SIGTERM, then SIGKILL; on the master, the run's coordinator too.

Only what the run itself started is touched: the supervisor and the coordinator by
the pid *and* start time their state files recorded (a pid reused since is another
process), the job by the token, which only the supervisor's state file (private to
the user) and its own children know. Nothing is matched by name or command line: a
``tail -f`` of the run's log, a concurrent ``attach`` or ``stop``, or another user's
``vim notes-<run id>.md`` are never killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

# On a node these are the stand-in modules the shipped program registered; see
# torchherd/remote/__init__.py.
from torchherd.remote import container, wire
from torchherd.remote.proctable import command_line, find_job_processes, is_process, send_signal

EXIT_BAD_ARGS = 2
POLL = 0.1
SUPERVISOR_MARGIN = 5.0
"""Beyond the grace period: how long the supervisor gets to finish its teardown."""
SECOND_TERM_WAIT = 6.0
SWEEP_TERM_WAIT = 2.0
SWEEP_KILL_WAIT = 3.0


def number(value: object) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def load_state(path: Optional[str]) -> Dict[str, object]:
    """A state file the run's own supervisor or coordinator wrote ({} when there is none)."""
    if not path:
        return {}
    try:
        with open(os.path.expanduser(path)) as f:
            fields = json.load(f)
    except (OSError, ValueError):
        return {}
    return fields if isinstance(fields, dict) else {}


class Run:
    """The processes of one run on this node: those carrying its supervisor's token (the
    supervisor's own table search, from this process: never it or its ancestors)."""

    def __init__(self, run_id: str, token: Optional[str]) -> None:
        self.run_id = run_id
        self.token = token

    def processes(self) -> List[int]:
        if not self.token:
            return []
        return sorted(find_job_processes(self.run_id, self.token, os.getpid()))

    def gone(self) -> bool:
        return not self.processes()


def wait(cond: Callable[[], bool], seconds: float) -> bool:
    end = time.time() + seconds
    while time.time() < end and not cond():
        time.sleep(POLL)
    return cond()


def kill(pids: List[int], sig: int) -> None:
    send_signal(set(pids), sig)


def end_process(pid: int, start: int, term_wait: float) -> bool:
    """SIGTERM, then SIGKILL, to the one process ``pid`` started at ``start``; True when gone."""
    kill([pid], signal.SIGTERM)
    if wait(lambda: not is_process(pid, start), term_wait):
        return True
    kill([pid], signal.SIGKILL)
    return wait(lambda: not is_process(pid, start), SWEEP_KILL_WAIT)


def remove_container(state: Dict[str, object]) -> None:
    """The run's container, by the name its supervisor recorded (its supervisor removes it
    itself, unless it was killed first). Only a torchherd name of this run is touched."""
    recorded = state.get("container")
    if not (isinstance(recorded, list) and len(recorded) == 2 and all(isinstance(x, str) for x in recorded)):
        return
    runtime, name = recorded
    run_id = state.get("run_id")
    if not (isinstance(run_id, str) and name.startswith(container.NAME_PREFIX + run_id + "-")):
        return
    argv = container.remove_argv(runtime, name)
    if argv is not None:
        try:
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=60, check=False)
        except (OSError, subprocess.SubprocessError):
            pass


def stop(run_id: str, grace: float, state_file: str, coordinator_file: Optional[str] = None) -> wire.StopReply:
    """Ends every process of the run; what could not be killed is in the reply."""
    state = load_state(state_file)
    if state.get("run_id") not in (None, run_id):
        state = {}  # another run's file: nothing in it is ours to kill
    token = state.get("token")
    run = Run(run_id, token if isinstance(token, str) else None)
    supervisor, start = number(state.get("supervisor")) or 0, number(state.get("start"))

    def supervisor_gone() -> bool:
        return not is_process(supervisor, start)

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
    remove_container(state)
    left = [command_line(pid) for pid in run.processes()]
    if not supervisor_gone():
        left.append(command_line(supervisor))
    coordinator = load_state(coordinator_file)
    pid, started = number(coordinator.get("pid")) or 0, number(coordinator.get("start"))
    if started is not None and is_process(pid, started) and not end_process(pid, started, SWEEP_TERM_WAIT):
        left.append(command_line(pid))
    return wire.StopReply(was_running, tuple(left))


def main(args: List[str]) -> int:
    try:
        if len(args) not in (3, 4) or not wire.is_run_id(args[0]) or not args[2]:
            raise ValueError("a run id, the grace period, the state file")
        run_id, grace = args[0], float(args[1])
    except ValueError:
        sys.stderr.write("usage: stop.py RUN_ID GRACE_SECONDS STATE_FILE [COORDINATOR_STATE_FILE]\n")
        return EXIT_BAD_ARGS
    sys.stdout.write(stop(run_id, grace, args[2], args[3] if len(args) == 4 else None).to_json() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
