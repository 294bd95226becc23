"""The controller lock: the file a run's controller holds locked for as long as it lives,
what tells it from a process that reuses its pid."""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

from torchherd.engine.records.paths import runs_dir
from torchherd.engine.records.recovery import RecoveryRecord


def controller_lock(run_id: str, directory: Path | None = None) -> Path:
    """The file the background controller of ``run_id`` holds locked for as long as it
    lives, in the private run-record directory: what tells it from a process that reuses
    its pid (after a reboot, or where there is no /proc to read its start time)."""
    return (directory or runs_dir()) / f"{run_id}.controller.lock"


def hold_controller_lock(run_id: str, directory: Path | None = None, timeout: float = 10.0) -> int:
    """The background controller: locks its run's file and writes its pid in it. The
    descriptor is never closed: the kernel releases the lock when the process ends, however
    it ends. Not inherited by the processes it starts (Python's descriptors are not)."""
    path = controller_lock(run_id, directory)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    deadline = time.monotonic() + timeout
    while True:  # a ``status`` may hold it shared for a moment
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise
            time.sleep(0.05)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _lock_holder(run_id: str, directory: Path | None = None) -> int | None:
    """The pid written in the run's controller lock while some process holds it locked;
    None when no one does (the controller ended, or never ran on this machine)."""
    try:
        fd = os.open(controller_lock(run_id, directory), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None  # taken: nobody holds it (closing the file lets it go)
        except OSError as error:
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None
        text = os.read(fd, 32).decode("ascii", "replace").strip()
        return int(text) if text.isascii() and text.isdigit() else None
    finally:
        os.close(fd)


def controller_alive(recovery: RecoveryRecord, run_id: str) -> bool:
    """Whether the recovering controller of ``run_id`` still runs (``holds_lock``)."""
    return holds_lock(run_id, recovery.pid, recovery.start)


def holds_lock(run_id: str, pid: int, start: int | None, directory: Path | None = None) -> bool:
    """Whether the controller of ``run_id`` (pid ``pid``, started at ``start``) still runs:
    it holds its run's lock (``controller_lock``), with that pid written in it; where /proc
    says, also started then, and not a zombie. A pid alone is never enough: after a reboot
    or a crash it is another process's, perhaps another user's."""
    if _lock_holder(run_id, directory) != pid:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            fields = file.read().rsplit(b")", 1)[1].split()
    except OSError:
        return True  # no /proc (macOS): the lock is the proof
    except IndexError:
        return False
    # after the command: state is field 3, the start time field 22 (proc(5))
    return fields[0] != b"Z" and (start is None or fields[19:20] == [str(start).encode()])
