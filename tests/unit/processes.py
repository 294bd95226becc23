"""Process helpers the node-program tests share: find what a run left, wait for a state,
and a run id whose processes are killed after the test whatever happened."""
from __future__ import annotations

import os
import signal
import time
import uuid
from typing import Callable, Iterator


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
