"""Detached runs as data: the local run record, the remote paths, and the state a
node's supervisor leaves behind.

Pure (files on this machine only, no SSH). The record is what lets a later shell
find, reconnect to, follow and stop a run: it keeps enough of the resolved
inventory to reconnect even when the inventory file changed or moved.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from torchherd.errors import UsageError
from torchherd.inventory import Host

REMOTE_RUNS_DIR = "~/.torchherd/runs"
"""On each node: ``<this>/<run-id>/<node>.log`` and ``<node>.state.json``. The node's
name is in the file name because nodes may share a home directory (NFS)."""


def remote_run_dir(run_id: str) -> str:
    return f"{REMOTE_RUNS_DIR}/{run_id}"


def remote_log_file(run_id: str, node: str) -> str:
    return f"{remote_run_dir(run_id)}/{node}.log"


def remote_state_file(run_id: str, node: str) -> str:
    return f"{remote_run_dir(run_id)}/{node}.state.json"


def remote_coordinator_file(run_id: str) -> str:
    return f"{remote_run_dir(run_id)}/coordinator.json"


def runs_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_STATE_HOME/torchherd/runs`` (default ``~/.local/state/torchherd/runs``)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "torchherd" / "runs"


@dataclass(frozen=True)
class NodeRecord:
    """One node of a detached run: how to reach it, and where its run lives there."""

    name: str
    address: str
    user: str | None
    ssh_port: int | None
    identity_file: str | None
    python: str
    workdir: str
    log_file: str
    state_file: str
    supervisor: int | None = None
    pid: int | None = None
    pgid: int | None = None

    def host(self) -> Host:
        return Host(name=self.name, address=self.address, user=self.user, ssh_port=self.ssh_port,
                    identity_file=self.identity_file, python=self.python, workdir=self.workdir,
                    env=MappingProxyType({}), setup="", local_addr=None)


@dataclass(frozen=True)
class CoordinatorRecord:
    node: str
    port: int
    pid: int
    state_file: str


@dataclass(frozen=True)
class RunRecord:
    run_id: str
    inventory: str
    created: float
    command: tuple[str, ...]
    nodes: tuple[NodeRecord, ...]
    max_rank: int
    grace: float
    ssh_config: str | None = None
    ssh_timeout: float = 10.0
    coordinator: CoordinatorRecord | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def master(self) -> str:
        return self.nodes[0].name

    def node(self, name: str) -> NodeRecord:
        for node in self.nodes:
            if node.name == name:
                return node
        raise UsageError(f"run {self.run_id} has no node {name!r}",
                         "its nodes: " + ", ".join(node.name for node in self.nodes))

    def to_json(self) -> str:
        data = asdict(self)
        data["extra"] = dict(self.extra)
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> RunRecord:
        data = json.loads(text)
        coordinator = data.get("coordinator")
        return cls(run_id=data["run_id"], inventory=data["inventory"], created=float(data["created"]),
                   command=tuple(data["command"]), nodes=tuple(NodeRecord(**node) for node in data["nodes"]),
                   max_rank=int(data["max_rank"]), grace=float(data["grace"]), ssh_config=data.get("ssh_config"),
                   ssh_timeout=float(data.get("ssh_timeout", 10.0)),
                   coordinator=CoordinatorRecord(**coordinator) if coordinator else None,
                   extra=dict(data.get("extra") or {}))


def save(record: RunRecord, directory: Path | None = None) -> Path:
    """Writes the record atomically (a concurrent ``status`` never reads half of it)."""
    directory = directory or runs_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # how to reach the nodes: the user's only
    path = directory / f"{record.run_id}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(record.to_json(), encoding="utf-8")
    os.replace(tmp, path)
    return path


def load(run_id: str, directory: Path | None = None) -> RunRecord:
    """The record of ``run_id``; a unique prefix (or the last characters) is enough."""
    directory = directory or runs_dir()
    exact = directory / f"{run_id}.json"
    if exact.is_file():
        return RunRecord.from_json(exact.read_text(encoding="utf-8"))
    matches = [path for path in _record_files(directory) if run_id and run_id in path.stem]
    if len(matches) == 1:
        return RunRecord.from_json(matches[0].read_text(encoding="utf-8"))
    if matches:
        raise UsageError(f"run id {run_id!r} is ambiguous: " + ", ".join(path.stem for path in matches),
                         "give more of the run id")
    raise UsageError(f"no detached run {run_id!r} in {directory}", "torchherd status lists the known runs")


def load_all(directory: Path | None = None) -> list[RunRecord]:
    """Every readable record, oldest first."""
    records = []
    for path in _record_files(directory or runs_dir()):
        try:
            records.append(RunRecord.from_json(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(records, key=lambda record: record.created)


def _record_files(directory: Path) -> list[Path]:
    try:
        return sorted(path for path in directory.iterdir() if path.suffix == ".json")
    except OSError:
        return []


@dataclass(frozen=True)
class NodeState:
    """What ``status`` says about one node."""

    node: str
    state: str
    """running, exited, gone (the supervisor vanished without a word), unreachable, unknown."""
    code: int | None = None
    since: float | None = None
    detail: str = ""


def parse_node_state(node: str, state_text: str, alive: bool) -> NodeState:
    """A node's state file (written by its supervisor) and whether the supervisor still runs."""
    try:
        fields = json.loads(state_text) if state_text.strip() else None
    except ValueError:
        fields = None
    if not isinstance(fields, dict):
        if alive:
            return NodeState(node, "running", detail="no state file yet")
        return NodeState(node, "unknown", detail="no state file on the node")
    if fields.get("state") == "exited":
        code = fields.get("code")
        return NodeState(node, "exited", int(code) if isinstance(code, int) else None, _float(fields.get("ended")))
    if alive:
        return NodeState(node, "running", since=_float(fields.get("started")))
    return NodeState(node, "gone", since=_float(fields.get("started")),
                     detail="the supervisor is gone without recording an exit (killed, or the node rebooted)")


def _float(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def describe_since(since: float | None, now: float | None = None) -> str:
    """``2024-05-01 12:00:03 (5m ago)``; ``-`` when unknown."""
    if since is None:
        return "-"
    now = time.time() if now is None else now
    ago = max(0, int(now - since))
    span = f"{ago}s" if ago < 120 else f"{ago // 60}m" if ago < 7200 else f"{ago // 3600}h"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) + f" ({span} ago)"
