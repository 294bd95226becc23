"""``torchherd run`` on the local cluster: in this process (``run_cli``) or as a
process a test can signal (``Controller``); ``assert_clean``: nothing left on any node; ``SKIP_TORCH``."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from io import StringIO
from pathlib import Path

from localcluster import LocalCluster

from support.processes import default_signals
from torchherd.checks.runner import NEED_TORCH
from torchherd.cli import main
from torchherd.console import make_console

SKIP_TORCH = ("--skip", ",".join(sorted(NEED_TORCH - {"smoke"})))
"""``check``'s and ``run``'s flags that leave out the checks whose facts import torch (about
2 s of CPU a node on this 2-core machine): for the tests of a fault those checks see nothing of
(the smoke job, which needs torch too, runs only when asked for)."""


def run_cli(cluster: LocalCluster, log_dir: Path, *args: str) -> tuple[int, str]:
    """``torchherd run --no-check`` in this process; the exit code and all it printed."""
    out = StringIO()
    code = main(["-i", str(cluster.inventory), "run", "--no-check", "--log-dir", str(log_dir), *args],
                console=make_console(out, width=200))
    return code, out.getvalue()


def assert_clean(cluster: LocalCluster, timeout: float = 5.0) -> None:
    for name in cluster.names:
        left = cluster.wait_no_processes(name, timeout=timeout)
        assert left == [], f"processes left on {name} {timeout} s on: " + "; ".join(left)


class Controller:
    """``torchherd run`` as a separate process, so a test can signal or kill it."""

    def __init__(self, cluster: LocalCluster, log_dir: Path, *args: str) -> None:
        argv = [sys.executable, "-m", "torchherd", "-i", str(cluster.inventory), "run", "--no-check",
                "--log-dir", str(log_dir), *args]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, text=True, env={**cluster.env(), "COLUMNS": "200"},
                                        preexec_fn=default_signals(signal.SIGINT, signal.SIGTERM))
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(re.search(pattern, line) for line in self.lines):
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r}; output:\n" + "\n".join(self.lines[-40:]))

    def wait(self, timeout: float) -> int:
        code = self.process.wait(timeout=timeout)
        self._reader.join(timeout=5)
        return code

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
