"""A run record as data: the nodes, the coordinator, the record itself (parsed and checked
from its JSON), its extensions read back, and what ``status`` says about a node."""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field, replace
from types import MappingProxyType
from typing import Any, Mapping

from torchherd.engine import schedulers
from torchherd.engine.records.attached import ATTACHED_KEY, AttachedRecord, NodeEnding, read_attached
from torchherd.engine.records.fields import DAMAGED, Fields, RecordError
from torchherd.engine.records.paths import remote_run_dir
from torchherd.engine.records.recovery import RECOVERY_KEY, RecoveryRecord, read_recovery
from torchherd.errors import UsageError
from torchherd.inventory import Host


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
    transport: str = "ssh"
    """"local": this machine itself, reached without SSH (``Host.transport``)."""

    def host(self) -> Host:
        return Host(name=self.name, address=self.address, user=self.user, ssh_port=self.ssh_port,
                    identity_file=self.identity_file, python=self.python, workdir=self.workdir,
                    env=MappingProxyType({}), setup="", local_addr=None, transport=self.transport)


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
    def from_json(cls, text: str, source: str = "run record") -> RunRecord:
        """Parses and checks every field (RecordError names ``source`` and the key): a
        record's values reach remote shells and file paths, so nothing is taken on trust."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            raise RecordError(f"{source}: not valid JSON", DAMAGED) from None
        read = Fields(source, "", data)
        nodes = read.value("nodes", list)
        if not nodes:
            read.fail("nodes", "no nodes")
        records = tuple(_node(Fields(source, f"nodes[{index}].", node)) for index, node in enumerate(nodes))
        coordinator = read.optional("coordinator", dict)
        extra = read.optional("extra", dict) or {}
        if extra.get(RECOVERY_KEY) is not None:  # checked now: a damaged one fails at load, as any key does
            read_recovery(Fields(source, f"extra.{RECOVERY_KEY}.", extra[RECOVERY_KEY]))
        if extra.get("login") is not None:  # a batch job's login host: reached over SSH as a node is
            extra = {**extra, "login": asdict(_node(Fields(source, "extra.login.", extra["login"])))}
        if extra.get(ATTACHED_KEY) is not None:
            read_attached(Fields(source, f"extra.{ATTACHED_KEY}.", extra[ATTACHED_KEY]))
        run_id = read.run_id("run_id")
        _scheduler(Fields(source, "extra.", extra), run_id)
        return cls(run_id=run_id, inventory=read.text("inventory"), created=read.number("created"),
                   command=read.texts("command"), nodes=records, max_rank=read.integer("max_rank", low=-1),
                   grace=read.number("grace"), ssh_config=read.optional_text("ssh_config"),
                   ssh_timeout=read.number("ssh_timeout", 10.0, positive=True),
                   coordinator=None if coordinator is None else _coordinator(
                       Fields(source, "coordinator.", coordinator), records),
                   extra=extra)


def _node(read: Fields) -> NodeRecord:
    return NodeRecord(name=read.name("name"), address=read.address("address"), user=read.user("user"),
                      ssh_port=read.optional_integer("ssh_port", 1, 65535),
                      identity_file=read.optional_text("identity_file"), python=read.text("python"),
                      workdir=read.text("workdir"), log_file=read.text("log_file"),
                      state_file=read.text("state_file"), supervisor=read.optional_integer("supervisor"),
                      pid=read.optional_integer("pid"), pgid=read.optional_integer("pgid"),
                      transport=_transport(read))


def _transport(read: Fields) -> str:
    """A record from before ``transport`` was kept reached every node over SSH."""
    transport = read.optional_text("transport") or "ssh"
    if transport not in ("ssh", "local"):
        read.fail("transport", f"expected 'ssh' or 'local', got {transport!r}")
    return transport


_JOB_ID = re.compile(r"(?:[0-9]+(?:_[0-9]+)?)?\Z", re.ASCII)
"""``sbatch --parsable``'s job id (``commands.parse_job_id``); empty before the first
submission of a run with retries."""


def _scheduler(read: Fields, run_id: str) -> None:
    """The scheduler's part of ``extra``: its values reach ``scancel``, ``squeue`` and
    remote paths (a job id ``--partition=gpu`` once made ``stop`` cancel every job of the
    user in that partition), so each is what torchherd writes, or the record is damaged."""
    scheduler = read.data.get("scheduler")
    if scheduler is not None and scheduler not in schedulers.names():
        read.fail("scheduler", f"{scheduler!r} is not one of {', '.join(schedulers.names())}")
    if scheduler not in schedulers.JOB_RECORDS:
        return
    job_id = read.value("job_id", str)
    if not _JOB_ID.match(job_id):
        read.fail("job_id", f"{job_id!r} is not a SLURM job id")
    directory = read.value("run_dir", str)
    if not re.fullmatch(re.escape(remote_run_dir(run_id)) + r"(?:/attempt-[1-9][0-9]{0,8})?", directory):
        read.fail("run_dir", f"{directory!r} is not the run's directory ({remote_run_dir(run_id)})")


def _coordinator(read: Fields, nodes: tuple[NodeRecord, ...]) -> CoordinatorRecord:
    node = read.name("node")
    if node not in {record.name for record in nodes}:
        read.fail("node", f"{node!r} is not a node of the run")
    return CoordinatorRecord(node=node, port=read.integer("port", 1, 65535), pid=read.integer("pid"),
                             state_file=read.text("state_file"))


def attached_of(record: RunRecord) -> AttachedRecord | None:
    """The record's ``AttachedRecord``; None for a detached run."""
    data = record.extra.get(ATTACHED_KEY)
    return None if data is None else read_attached(Fields(f"run record {record.run_id}", f"extra.{ATTACHED_KEY}.", data))


def with_attached(record: RunRecord, attached: AttachedRecord) -> RunRecord:
    return replace(record, extra={**record.extra, ATTACHED_KEY: attached.to_json_object()})


def attached_node_states(record: RunRecord, attached: AttachedRecord, alive: bool) -> list[NodeState]:
    """``status`` of an attached run, from its record alone (its controller owns the job:
    nothing to ask the nodes): each node as the summary had it, running while the
    controller runs, unknown once it is gone without a word."""
    if attached.ending != "running":
        return [_node_ending(node, attached.ended) for node in attached.nodes]
    if alive:
        return [NodeState(node.name, "running", since=record.created) for node in record.nodes]
    gone = f"the controller (pid {attached.pid}) ended without recording how the run ended"
    return [NodeState(node.name, "unknown", detail=gone) for node in record.nodes]


def _node_ending(node: NodeEnding, ended: float | None) -> NodeState:
    if node.state in ("ok", "failed", "torn down", "interrupted") and node.exit_code is not None:
        stopped = node.state in ("torn down", "interrupted")
        return NodeState(node.node, "exited", node.exit_code, ended, node.state if stopped else "", stopped=stopped)
    return NodeState(node.node, node.state, node.exit_code, ended)


def recovery_of(record: RunRecord) -> RecoveryRecord | None:
    """The record's ``RecoveryRecord``; None for a run without retries."""
    data = record.extra.get(RECOVERY_KEY)
    return None if data is None else read_recovery(Fields(f"run record {record.run_id}", f"extra.{RECOVERY_KEY}.", data))


def with_recovery(record: RunRecord, recovery: RecoveryRecord) -> RunRecord:
    return replace(record, extra={**record.extra, RECOVERY_KEY: recovery.to_json_object()})


@dataclass(frozen=True)
class NodeState:
    """What ``status`` says about one node."""

    node: str
    state: str
    """running, exited, gone (the supervisor vanished without a word), unreachable, unknown."""
    code: int | None = None
    since: float | None = None
    detail: str = ""
    stopped: bool = False
    """The supervisor had signalled the job before it ended (stop, a teardown): its exit
    code is how the job died of that, not a failure of its own."""


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
        stopped = fields.get("stopped")
        return NodeState(node, "exited", int(code) if isinstance(code, int) else None, _float(fields.get("ended")),
                         f"stopped ({stopped[:200]})" if isinstance(stopped, str) else "",
                         stopped=isinstance(stopped, str))
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
