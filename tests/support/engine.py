"""The SSH engine on this machine: ``cluster`` (a ``Cluster`` of local nodes) and
``faked`` (a plan whose torchrun is the stand-in fakes/fake_torchrun.py, told what to do)."""

from __future__ import annotations

import sys
import uuid
from dataclasses import replace
from pathlib import Path

from torchherd.api import Cluster
from torchherd.plan import Plan
from torchherd.transport.local import LocalConnector

FAKE = str(Path(__file__).resolve().parent.parent / "unit" / "fakes" / "fake_torchrun.py")


def cluster(tmp_path: Path, count: int = 2, **connector: object) -> Cluster:
    hosts = [{"name": f"n{index}", "address": "127.0.0.1"} for index in range(count)]
    return Cluster(hosts, python=sys.executable, workdir=str(tmp_path), nproc_per_node=2,
                   connector=LocalConnector(**connector))  # type: ignore[arg-type]


def faked(plan: Plan, **behaviour: str) -> Plan:
    """The plan with each node's torchrun replaced by the stand-in, told what to do."""
    nodes = []
    for node in plan.nodes:
        first = node.node_rank * 2
        spec = [f"ranks={first},{first + 1}", *behaviour.get(node.host.name, "lines=2").split()]
        # A log directory of its own: the supervisor refuses one that exists, and a fixed run
        # id would meet the directory of another run of this test (concurrent, or killed).
        log_dir = f"/tmp/torchherd-test-{uuid.uuid4().hex}"
        nodes.append(replace(node, argv=(sys.executable, FAKE, *spec), remote_log_dir=log_dir))
    return replace(plan, nodes=tuple(nodes))
