"""Detached runs followed through their record: ``wait_states`` (the nodes' states),
``wait_recovery`` (the recovering controller's status)."""

from __future__ import annotations

import time
from collections.abc import Callable

from torchherd.api import attach
from torchherd.engine.records import NodeState, RecoveryStatus, load
from torchherd.engine.ssh.detach import node_states


def wait_states(run_id: str, done: Callable[[list[NodeState]], bool], timeout: float) -> list[NodeState]:
    deadline = time.monotonic() + timeout
    while True:
        states = node_states(load(run_id))
        if done(states) or time.monotonic() > deadline:
            return states
        time.sleep(0.5)


def all_exited(states: list[NodeState]) -> bool:
    return all(state.state == "exited" for state in states)


def wait_recovery(run_id: str, done: object, timeout: float) -> RecoveryStatus:
    """The run's recovery once ``done(status)`` holds (or the timeout passed)."""
    assert callable(done)
    deadline = time.monotonic() + timeout
    while True:
        status = attach(run_id).recovery()
        assert status is not None
        if done(status) or time.monotonic() > deadline:
            return status
        time.sleep(0.5)
