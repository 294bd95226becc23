"""An allocated SLURM node as a transport ``Session``: each command a job step
(``srun --overlap``) of the allocation, started through the submit host's session, so
the checks run unchanged on SLURM's nodes.
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import Callable

from torchherd.errors import TransportError
from torchherd.inventory import Host
from torchherd.shell import quote_path
from torchherd.transport import CommandResult, Process, Session
from torchherd.transport.base import Closing


def step_command(job_id: str, node: str, command: str, unbuffered: bool = False) -> str:
    """``command`` as a step of allocation ``job_id`` on ``node``, beside its other steps."""
    flags = ["srun", f"--jobid={job_id}", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--quiet"]
    if unbuffered:
        flags.append("--unbuffered")
    return shlex.join([*flags, "bash", "-c", command])


class SrunSession(Closing):
    """One allocated node, reached as job steps through the submit host's session."""

    def __init__(self, front: Session, job_id: str, node: str) -> None:
        self.front = front
        self.job_id = job_id
        self._node = node

    @property
    def node(self) -> str:
        return self._node

    def run(self, command: str, stdin: bytes = b"", timeout: float = 30.0) -> CommandResult:
        return self.front.run(step_command(self.job_id, self._node, command), stdin, timeout)

    def start(self, command: str) -> Process:
        return self.front.start(step_command(self.job_id, self._node, command, unbuffered=True))

    def put(self, path: str, data: bytes, mode: int = 0o600) -> None:
        result = self.run(f"umask {0o777 & ~mode:03o} && set -C && cat > {quote_path(path)}", stdin=data)
        if result.exit_code != 0:
            raise TransportError(self._node, "put", f"{self._node}: cannot write {path}: "
                                 f"{result.stderr.decode('utf-8', 'replace').strip()[-200:]}")

    def peer_address(self) -> str | None:
        return None

    def is_alive(self) -> bool:
        return self.front.is_alive()

    def link_quiet(self, every: float) -> float | None:
        return None  # the submit host's link says nothing of the node's

    def close(self) -> None:
        self.front.close()


@dataclasses.dataclass(frozen=True)
class SrunConnector:
    """A session per allocated node, each over a submit-host session of its own (one
    SSH connection holds only so many channels: sshd's MaxSessions)."""

    open_front: Callable[[], Session]
    job_id: str

    def connect(self, host: Host) -> SrunSession:
        return SrunSession(self.open_front(), self.job_id, host.name)
