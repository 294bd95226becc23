"""Fail fast with no controller: the coordinator on the master node.

A plain detached run starts one (``engine.ssh.detach``); so does each attempt of a detached
run with retries (``engine.ssh.job``, persist mode), whose supervisors obey it only once
the background controller is gone. The coordinator (``remote/coordinator.py``) takes a
TCP connection from every node's supervisor and tells the others to stop when one fails.
"""

from __future__ import annotations

import secrets
import shlex
from dataclasses import dataclass
from typing import Mapping

from torchherd.engine.records import CoordinatorRecord
from torchherd.errors import TransportError
from torchherd.plan import Plan
from torchherd.remote import command as node_program
from torchherd.remote import wire
from torchherd.shell import quote_path
from torchherd.transport import Session

START_TIMEOUT = 60.0
COORDINATOR_WAIT = 120.0
"""Seconds the coordinator waits for a node that never connected before it exits."""


@dataclass(frozen=True)
class Coordination:
    """A started coordinator: its record, the address the supervisors reach it at (the
    master address the workers use), and each node's own token."""

    record: CoordinatorRecord
    address: str
    tokens: Mapping[str, str]

    def for_node(self, node: str) -> wire.CoordinatorAddress:
        return wire.CoordinatorAddress(self.address, self.record.port, self.tokens[node])


def start_coordinator(plan: Plan, connection: Session, state_file: str) -> Coordination:
    """Starts the coordinator on the master (``connection``); raises TransportError. The
    config (with the tokens) goes on stdin: the master's process list is public, and with
    a token anyone could announce a node and stop the run."""
    tokens = {node.host.name: secrets.token_hex(16) for node in plan.nodes}
    master = plan.nodes[0]
    config = wire.CoordinatorConfig(plan.run_id, tokens, plan.master_addr, state_file, COORDINATOR_WAIT)
    command = (f"exec {quote_path(master.host.python)} {node_program('coordinator.py')} "
               f"- {shlex.quote(plan.run_id)}")
    result = connection.run(command, stdin=config.to_line(), timeout=START_TIMEOUT)
    try:
        reply = wire.CoordinatorReply.from_json(result.stdout.decode("utf-8", "replace").strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise TransportError(master.host.name, "coordinator",
                             f"{master.host.name}: the run coordinator did not start: "
                             f"{result.stderr.decode('utf-8', 'replace').strip()[-300:]}") from None
    return Coordination(CoordinatorRecord(master.host.name, reply.port, reply.pid, state_file), plan.master_addr,
                        tokens)
