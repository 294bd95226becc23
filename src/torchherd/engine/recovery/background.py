"""A detached run with retries: its recovering controller runs in the background.

``run --detach --retries N`` preflights in the foreground as any run does, then starts
this module as a process of its own (``start_background``): its own session, so the
terminal closing (SIGHUP) does not reach it; stdin and stdout on /dev/null once it has
said that the first attempt started; stderr to a private file beside the run record.
What it needs (the plan holds the job's environment) comes pickled on its stdin, never
on its command line, which only names the run.

The process runs the very ``RecoveringRun`` of an attached run, the nodes' supervisors in
persist mode: each also keeps the node's log and state file of a detached run, so
``logs``, ``attach`` and ``stop`` work on the nodes as for any detached run, and the job
goes on when this process is gone (without recovery, but with the fail fast of a plain
detached run: each attempt has its coordinator on the master). It keeps the run record up to
date (its pid and start time, every attempt, the final summary). SIGTERM stops the run
as Ctrl-C stops an attached one: no further attempt.
"""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import IO, Any, Callable, Mapping

from torchherd.engine.backend import Backend, backend_for, scheduler_of
from torchherd.engine.eventlog import HISTORY_FILE, HISTORY_KEY, HistoryRecorder, recording
from torchherd.engine.events import (
    Observer,
)
from torchherd.engine.recorder import Recorder
from torchherd.engine.records import (
    RecoveryRecord,
    RunRecord,
    controller_alive,
    hold_controller_lock,
    load,
    runs_dir,
    save,
)
from torchherd.engine.recovery.runner import RecoveringRun
from torchherd.engine.run import STOP_MARGIN, LaunchOptions
from torchherd.errors import EXIT_FAILED, TorchherdError
from torchherd.inventory import Recovery
from torchherd.plan import Plan
from torchherd.remote.wire import process_start
from torchherd.transport.ssh import SshConnector

ENTRY = ("import sys; sys.path[:] = [entry for entry in sys.path if entry]; "
         "from torchherd.engine.recovery.background import main; sys.exit(main(sys.argv[1:]))")
"""The background controller's program: this module's ``main`` (run as ``-m``, its classes
would be ``__main__``'s, not those the order was pickled with). Its command line names
the run, nothing more. ``-c`` puts the start directory first on ``sys.path`` (as ``''``),
so its first act is to drop it: a ``secrets.py`` or ``logging.py`` where ``run`` was
typed must never run in the process that holds the plan, the job's environment and SSH
to every node. ``-I`` would do it too, but also drop ``PYTHONPATH`` and the user's
site-packages, where torchherd itself may be installed; ``-P`` is 3.11's."""
STARTED = b"started\n"
"""What the background controller says on its stdout once the first attempt runs."""


@dataclass(frozen=True)
class Order:
    """What the background controller is given, pickled on its stdin."""

    plan: Plan
    options: LaunchOptions
    recovery: Recovery
    check_spares: bool
    accept_new_host_keys: bool
    scheduler: str = "ssh"


def _mapping_proxy(items: dict[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(items)


def _dumps(order: Order) -> bytes:
    # The inventory's read-only tables (a host's env) pickle as the dicts they wrap.
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = {**copyreg.dispatch_table,
                              MappingProxyType: lambda proxy: (_mapping_proxy, (dict(proxy),))}
    pickler.dump(order)
    return buffer.getvalue()


def controller_log(run_id: str) -> Path:
    """The background controller's stderr: beside the run record, private."""
    return runs_dir() / f"{run_id}.controller.log"


# the foreground ---------------------------------------------------------------------


def start_background(backend: Backend, plan: Plan, options: LaunchOptions, recovery: Recovery,
                     observer: Observer) -> RunRecord:
    """Preflights ``plan`` here (LaunchAborted as ``run`` raises it), then starts the
    background controller and returns the run's record once its first attempt started."""
    checked = backend.preflight(plan, options, observer)
    connector = backend.connector
    accept = connector.accept_new if isinstance(connector, SshConnector) else False
    order = Order(checked, replace(options, check=False, log_dir=options.log_dir.resolve()), recovery,
                  options.check, accept, scheduler_of(backend))
    _spawn(order)
    return load(plan.run_id)


def command(run_id: str) -> list[str]:
    """The background controller's command line: this Python, ``ENTRY``, the run."""
    return [sys.executable, "-c", ENTRY, run_id]


def _spawn(order: Order) -> None:
    run_id = order.plan.run_id
    log = controller_log(run_id)
    log.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with os.fdopen(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600), "ab") as errors:
        process = subprocess.Popen(command(run_id),
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors,
                                   start_new_session=True, close_fds=True)
    assert process.stdin is not None and process.stdout is not None
    try:
        process.stdin.write(_dumps(order))
        process.stdin.close()
        said = process.stdout.read()
    except KeyboardInterrupt:  # Ctrl-C while it starts: it stops what it started, as run would
        process.terminate()
        process.wait()
        raise
    finally:
        process.stdout.close()
    # Reaped when it ends, as long as this process lives (an API user's): no zombie for
    # ``status`` to take for a live controller.
    threading.Thread(target=process.wait, name="torchherd-background-reaper", daemon=True).start()
    if said != STARTED:
        reason = said.decode("utf-8", "replace").strip() or f"it died at start (see {log})"
        raise TorchherdError(f"run {run_id}: the background controller did not start the run: {reason}",
                             f"its log: {log}")


def stop_controller(recovery: RecoveryRecord, run_id: str, grace: float) -> bool:
    """SIGTERM to the background controller, which stops the run as Ctrl-C does (no
    further attempt), then waits until it is gone; SIGKILL when it takes longer than its
    own teardown may (the nodes' stop then does the rest). False: it was gone already, or
    could not be signalled. Only a process that holds the run's controller lock is ever
    signalled (``controller_alive``): never another process that got its pid."""
    if not controller_alive(recovery, run_id) or not _signal(recovery.pid, signal.SIGTERM):
        return False
    deadline = time.monotonic() + grace + 2 * STOP_MARGIN + 10.0
    while controller_alive(recovery, run_id):
        if time.monotonic() > deadline:
            _signal(recovery.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    return True


def _signal(pid: int, signum: int) -> bool:
    """False where the process is gone, or is not ours to signal: ``stop`` goes on to the nodes."""
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        return False
    return True


# the background ---------------------------------------------------------------------


def first_record(order: Order, backend: Backend) -> Recorder:
    """The record before the first attempt (the backend's: its nodes), this process its controller."""
    return backend.detached_recorder(order.plan, order.options.stop_grace, _controller(order))


def _controller(order: Order) -> RecoveryRecord:
    """This process, the controller, as the record names it."""
    pid = os.getpid()
    return RecoveryRecord(pid, process_start(pid), order.recovery.retries)


def serve(order: Order, said: IO[bytes]) -> int:
    """Runs the order to its end; says STARTED (or why not) on ``said`` once the first
    attempt runs. The exit code is the run's."""
    hold_controller_lock(order.plan.run_id)  # held until this process ends: ``stop`` knows it by this
    cluster = order.plan.inventory.cluster
    connector = SshConnector(cluster.ssh_config, cluster.ssh_timeout, order.accept_new_host_keys)
    backend = backend_for(order.scheduler, connector)
    recorder = first_record(order, backend)
    history_file = order.options.log_dir / order.plan.run_id / HISTORY_FILE
    recorder.record = replace(recorder.record, extra={**recorder.record.extra, HISTORY_KEY: str(history_file)})
    save(recorder.record)
    options = replace(order.options, persist=True)
    history = HistoryRecorder()  # the foreground's file: its preflight is there already
    run = RecoveringRun(backend, order.plan, options, order.recovery, recording(recorder, history),
                        check_spares=order.check_spares)
    recorder.checkpoint = run.checkpoint_line
    on_sigterm(run.stop)
    try:
        run.start()
    except TorchherdError as error:
        recorder.ended(EXIT_FAILED, f"the first attempt could not start: {error}")
        said.write(f"the first attempt could not start: {error}\n".encode())
        return EXIT_FAILED
    said.write(STARTED)
    said.close()
    return run.wait().exit_code


def on_sigterm(stop: Callable[[], None]) -> None:
    """SIGTERM (``torchherd stop``) calls ``stop`` as Ctrl-C does in an attached run (a
    second one kills), at any moment: a run stopped while its first attempt starts stops
    once it has (``RecoveringRun`` counts the requests). From a thread of its own: the
    handler may have interrupted the main thread holding the run's lock."""
    signal.signal(signal.SIGTERM, lambda signum, frame: threading.Thread(
        target=stop, name="torchherd-stop", daemon=True).start())


def main(argv: list[str]) -> int:
    """The background controller (``ENTRY RUN_ID``), the order on stdin."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a terminal's end is not ours to obey
    order = pickle.loads(sys.stdin.buffer.read())  # from the foreground, through a pipe only it holds
    if not isinstance(order, Order) or argv != [order.plan.run_id]:
        sys.stderr.write("the background controller of a run takes its run id, and its order on stdin\n")
        return 2
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    said = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(null, 1)  # nothing of the run reaches the foreground's pipe but ``said``
    os.close(null)
    try:
        return serve(order, said)
    finally:
        said.close()

