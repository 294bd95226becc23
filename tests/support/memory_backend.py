"""A scheduler that exists only in the tests: every node "runs" in this process and ends at
once. Registered the way a real scheduler is (``engine.schedulers.register``, one line),
it shows that a new scheduler needs no change above ``engine.backend``, and it runs the
contract tests every backend must pass (tests/unit/test_backend_contract.py). Its own
inventory table (``[memory]``, ``TABLE``) is registered with one line too
(``engine.schedulers.TABLES``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping

from torchherd.checks import CheckOptions
from torchherd.checks.results import CheckReport, CheckResult
from torchherd.engine.backend import Backend, Description
from torchherd.engine.bookkeeping import node_record, run_record
from torchherd.engine.events import Observer, Output, RunStarted, ignore
from torchherd.engine.recorder import Recorder
from torchherd.engine.records import NodeState, RecoveryRecord, RunRecord, with_recovery
from torchherd.engine.run import Follow, LaunchOptions, Run, RunEvents
from torchherd.inventory.reader import Reader
from torchherd.inventory.tables import SchedulerTable, TableSettings
from torchherd.plan import Plan
from torchherd.runlog import NodeOutcome, OutputLine, RunSummary

NAME = "memory"


@dataclass(frozen=True)
class MemorySettings(TableSettings):
    """The ``[memory]`` table: how many lanes the nodes share (nothing reads it but the tests)."""

    lanes: int = 1
    label: str | None = None


class MemoryTable(SchedulerTable):
    name = NAME
    title = "in-memory"
    keys = ("lanes", "label")

    def parse(self, table: Mapping[str, Any], path: Path, where: str) -> MemorySettings:
        read = Reader(path, where, table, self.keys)
        return MemorySettings(lanes=read.get("lanes", 1, read.count), label=read.get("label", None, read.text))


TABLE = MemoryTable()


@dataclass(frozen=True)
class MemoryJob:
    """What the memory scheduler is handed: the nodes' names."""

    run_id: str
    nodes: tuple[str, ...]

    def as_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "scheduler": NAME, "nodes": list(self.nodes)}

    def text(self) -> tuple[tuple[str, str], ...]:
        return (("title", f"run {self.run_id}: in memory"),
                *((f"node:{index}", name) for index, name in enumerate(self.nodes)),
                ("", "dry run: nothing was started"))


@dataclass
class _Job:
    """Every node ends with 0 at once, unless stopped first (130)."""

    plan: Plan
    log_dir: Path
    events: RunEvents
    stopped: bool = False

    def supervise(self) -> RunSummary:
        names = [node.host.name for node in self.plan.nodes]
        self.events(Output(tuple(OutputLine(name, 0, "stdout", "hello") for name in names)))
        code = 130 if self.stopped else 0
        outcomes = tuple(NodeOutcome(name, rank, "interrupted" if self.stopped else "ok", code, 0.0, None, None, ())
                         for rank, name in enumerate(names))
        return RunSummary(self.plan.run_id, code, "all finished" if not code else "interrupted", outcomes,
                          str(self.log_dir))

    def request_stop(self) -> None:
        self.stopped = True

    def hang_targets(self) -> Any:
        return {}


class MemoryBackend(Backend):
    scheduler: ClassVar[str] = NAME
    title: ClassVar[str] = "memory"
    check_ids: ClassVar[tuple[str, ...]] = ("memory-node",)
    refuses: ClassVar[Mapping[str, tuple[str, str]]] = {
        "--sync": ("not for memory runs (there is no node to sync to)", "leave --sync out")}
    triage_checks: ClassVar[frozenset[str]] = frozenset({"memory-node"})

    def check(self, plan: Plan, options: CheckOptions, *, sync: bool = False,
              on_result: Callable[[CheckResult], None] | None = None, on_event: Observer = ignore) -> CheckReport:
        self.allow("--sync", sync and plan.sync is not None)
        results = tuple(CheckResult(node.host.name, "memory-node", "pass", "in memory") for node in plan.nodes)
        for result in results:
            if on_result is not None:
                on_result(result)
        return CheckReport(results)

    @classmethod
    def script(cls, plan: Plan, *, fail_fast: bool = True) -> Description:
        return MemoryJob(plan.run_id, tuple(node.host.name for node in plan.nodes))

    def describe(self, plan: Plan, *, fail_fast: bool = True) -> Description:
        self.allow("--sync", plan.sync is not None)
        return self.script(plan, fail_fast=fail_fast)

    def launch(self, plan: Plan, options: LaunchOptions, observer: Observer = ignore) -> Run:
        events = RunEvents(observer)
        run = Run(_Job(plan, options.log_dir, events), events)
        observer(RunStarted(plan.run_id, tuple(node.host.name for node in plan.nodes), plan.master,
                            plan.master_addr, plan.port, str(options.log_dir), len(plan.nodes)))
        run.start()
        return run

    def preflight(self, plan: Plan, options: LaunchOptions, observer: Observer = ignore) -> Plan:
        return plan

    def start_detached(self, plan: Plan, options: LaunchOptions, observer: Observer = ignore) -> RunRecord:
        return self._record(plan, options.stop_grace)

    def detached_recorder(self, plan: Plan, grace: float, controller: RecoveryRecord) -> Recorder:
        return Recorder(with_recovery(self._record(plan, grace), controller), {}, {})

    def status(self, record: RunRecord) -> list[NodeState]:
        return [NodeState(node.name, "exited", 0) for node in record.nodes]

    def follow(self, record: RunRecord, observer: Observer, options: Follow) -> None:
        observer(Output(tuple(OutputLine(node.name, 0, "stdout", "hello") for node in record.nodes)))

    def stop(self, record: RunRecord, grace: float | None = None) -> dict[str, list[str]]:
        return {node.name: [] for node in record.nodes}

    def _record(self, plan: Plan, grace: float) -> RunRecord:
        nodes = [node_record(node.host, "memory.log", "memory.state", node.workdir) for node in plan.nodes]
        return run_record(plan, grace, nodes, len(plan.nodes), extra={"scheduler": NAME})
