"""Process helpers the node-program tests share: find what a run left, wait for a state,
a run id whose processes are killed after the test whatever happened, and the real
supervisor run to its end as the controller runs it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

from torchherd.remote import argv, wire


def pids_with(text: bytes) -> list[int]:
    """Processes (not this one) whose environment or command line holds ``text``."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            for part in ("environ", "cmdline"):
                try:
                    with open(f"/proc/{name}/{part}", "rb") as f:
                        if text in f.read():
                            found.append(int(name))
                            break
                except OSError:
                    continue
    return found


def default_signals(*signums: int) -> Callable[[], None]:
    """A ``preexec_fn`` that gives the child the default disposition of ``signums``. A
    test that signals a process it starts sets that signal's disposition there: started
    from a shell that ignores SIGINT (``nohup``, a background job of a script, some CI
    runners), pytest's children inherit the ignore, Python then installs no
    KeyboardInterrupt handler, and the signal would do nothing (as torchherd means it to
    when a user started it that way)."""

    def reset() -> None:
        for signum in signums:
            signal.signal(signum, signal.SIG_DFL)

    return reset


def wait_until(cond: Callable[[], bool], timeout: float, every: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(every)
    return cond()


def killed_after(prefix: str) -> Iterator[str]:
    """A fresh run id; every process still carrying it is SIGKILLed afterwards."""
    rid = prefix + uuid.uuid4().hex
    try:
        yield rid
    finally:
        for pid in pids_with(rid.encode()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


PLANTED = ("base64", "binascii", "errno", "hmac", "json", "marshal", "re", "select", "selectors", "shutil",
           "signal", "socket", "struct", "subprocess", "time", "types", "typing", "zlib")
"""The standard modules the node programs import, as a project's own files could name them."""


def plant(directory: Path) -> None:
    """A project's files in ``directory`` named as the standard modules a node program imports."""
    for name in PLANTED:
        (directory / f"{name}.py").write_text(f"raise SystemExit('planted {name}.py ran')\n")


def run_supervisor(config: wire.SupervisorConfig, timeout: float = 60) -> tuple[int, bytes]:
    """The supervisor program with ``config`` on its stdin, which stays open (its end would
    tear the job down) until the supervisor has ended: its exit status and every record."""
    process = subprocess.Popen([sys.executable, *argv("supervisor.py"), "-", config.run_id],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(config.to_line())
    process.stdin.flush()
    try:
        out = process.stdout.read()
        return process.wait(timeout=timeout), out
    finally:
        process.kill()
        process.stdin.close()
        process.stdout.close()
