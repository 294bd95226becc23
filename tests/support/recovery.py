"""The recovering loop on a fake backend: ``FakeBackend`` ends each attempt as its script
says; ``recover`` runs a ``RecoveringRun`` over it (tests/unit/test_recovery.py and the
checkpoint staging and replication tests)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar, Collection, Sequence

from torchherd.checks import CheckOptions
from torchherd.checks.results import CheckReport, CheckResult
from torchherd.engine.events import (
    Collector,
    LostContainers,
    NodeLost,
    Observer,
    RanksRunning,
    WarmReady,
    ignore,
)
from torchherd.engine.recovery.policy import TRIAGE_CHECKS
from torchherd.engine.recovery.runner import RecoveringRun
from torchherd.engine.run import LaunchOptions, Run, RunEvents
from torchherd.errors import TorchherdError
from torchherd.inventory import Recovery, parse
from torchherd.plan import Plan, RunOptions, build_plan
from torchherd.runlog import NodeOutcome, RunSummary


def inventory(text: str) -> object:
    import tomllib

    return parse(tomllib.loads(text), Path("hosts.toml"))


def plan_of(spares: str = "", nodes: int = 3) -> Plan:
    hosts = "".join(f'[[hosts]]\nname = "node{index}"\n' for index in range(nodes))
    parsed = inventory(hosts + (f'[recovery]\nspares = "{spares}"\n' if spares else ""))
    return build_plan(parsed, RunOptions("train.py", run_id="th-test"))  # type: ignore[arg-type]


@dataclass
class _Job:
    plan: Plan
    log_dir: Path
    summary: RunSummary
    release: threading.Event
    stopped: int = 0

    def supervise(self) -> RunSummary:
        self.release.wait(10)
        if self.stopped:
            return RunSummary(self.plan.run_id, 130, "interrupted: every node was told to stop",
                              self.summary.nodes, str(self.log_dir))
        return self.summary

    def request_stop(self) -> None:
        self.stopped += 1
        self.release.set()


def outcome(node: str, state: str, error: str | None = None, code: int | None = None) -> NodeOutcome:
    return NodeOutcome(node, 0, state, code, 1.0, error, None, ())  # type: ignore[arg-type]


def ended(plan: Plan, culprit: str | None, state: str = "failed", error: str = "rank 1: RuntimeError: boom",
          code: int = 1) -> RunSummary:
    nodes = tuple(outcome(node.host.name, state if node.host.name == culprit else ("torn down" if culprit else "ok"),
                          error if node.host.name == culprit else None, code if node.host.name == culprit else 0)
                  for node in plan.nodes)
    if culprit is None:
        return RunSummary(plan.run_id, 0, "all finished", nodes, "logs")
    return RunSummary(plan.run_id, 1, f"{culprit} failed first", nodes, "logs", culprit)


@dataclass
class FakeBackend:
    """Each launch ends as ``script`` says for that attempt; each check fails ``bad``."""

    script: list[Callable[[Plan], RunSummary]]
    bad: dict[str, str] = field(default_factory=dict)
    launched: list[Plan] = field(default_factory=list)
    checked: list[tuple[str, ...]] = field(default_factory=list)
    only: dict[tuple[str, ...], frozenset[str]] = field(default_factory=dict)
    known: dict[tuple[str, ...], dict[str, str]] = field(default_factory=dict)
    """Per check, the nodes whose torch it was told ran lately (``CheckOptions.torch_known``)."""
    running: Callable[[Plan], tuple[str, ...]] = lambda plan: tuple(node.host.name for node in plan.nodes)
    """The nodes whose ranks get through the rendezvous in each attempt."""
    hold: bool = False
    jobs: list[_Job] = field(default_factory=list)
    removed: list[tuple[tuple[str, ...], tuple[str, ...]]] = field(default_factory=list)
    containers: bool = False
    remove_error: str = ""
    triage_checks: ClassVar[frozenset[str]] = TRIAGE_CHECKS

    def check(self, plan: Plan, options: CheckOptions, *, sync: bool = False,
              on_result: Callable[[CheckResult], None] | None = None, on_event: Observer = ignore) -> CheckReport:
        assert options.only is not None and "smoke" not in options.only and "ssh" in options.only
        names = tuple(node.host.name for node in plan.nodes)
        self.checked.append(names)
        self.only[names] = options.only
        self.known[names] = dict(options.torch_known)
        return CheckReport(tuple(CheckResult(name, "ssh", "fail" if name in self.bad else "pass",
                                             self.bad.get(name, "")) for name in names))

    def picked_nodes(self, plan: Plan) -> int | None:
        return None  # the SSH backend's answer: the plan names every node

    def remove_lost_containers(self, plan: Plan, nodes: Sequence[str]) -> LostContainers | None:
        self.removed.append((names(plan), tuple(nodes)))
        if self.remove_error:
            raise TorchherdError(self.remove_error)
        return LostContainers(tuple(nodes)) if self.containers else None

    def launch(self, plan: Plan, options: LaunchOptions, observer: Observer = ignore) -> Run:
        summary = self.script[len(self.launched)](plan)
        self.launched.append(plan)
        release = threading.Event()
        if not self.hold:
            release.set()
        if options.started_as is not None:  # as the SSH launch: once the preflight kept the plan
            plan = options.started_as(plan)
            self.launched[-1] = plan
        job = _Job(plan, options.log_dir / plan.run_id, summary, release)
        self.jobs.append(job)
        for node in self.running(plan):
            observer(RanksRunning(node))
        for lost in summary.nodes:  # as the SSH backend tells of a node it lost
            if lost.state == "lost":
                observer(NodeLost(lost.node, lost.first_error or ""))
        run = Run(job, RunEvents(observer))
        run.start()
        return run


def recover(backend: FakeBackend, plan: Plan, recovery: Recovery) -> tuple[RunSummary, Collector]:
    events = Collector()
    run = RecoveringRun(backend, plan, LaunchOptions(check=False, log_dir=Path("/nonexistent")), recovery, events)
    return run.start().wait(timeout=20), events


def names(plan: Plan) -> tuple[str, ...]:
    return tuple(node.host.name for node in plan.nodes)


@dataclass
class FakePool:
    """Warm Pythons that answer as told: ``ready`` (node -> directory), ``failed`` (node ->
    why); ``answered`` is set when they have, and ``wait_for`` waits on it as the real pool does."""

    ready_dirs: dict[str, str]
    failed: dict[str, str] = field(default_factory=dict)
    answered: threading.Event = field(default_factory=threading.Event)
    waited: list[tuple[tuple[str, ...], float]] = field(default_factory=list)
    closed: list[tuple[str, ...]] = field(default_factory=list)

    def ready(self) -> dict[str, str]:
        return dict(self.ready_dirs) if self.answered.is_set() else {}

    def errors(self) -> dict[str, str]:
        return dict(self.failed) if self.answered.is_set() else {}

    def wait_for(self, names: Sequence[str], timeout: float) -> None:
        self.waited.append((tuple(names), timeout))
        self.answered.wait(timeout)

    def close(self, gone: Collection[str] = ()) -> None:
        self.closed.append(tuple(sorted(gone)))


@dataclass
class WarmingBackend(FakeBackend):
    """A FakeBackend that keeps warm Pythons (``pool``) as the SSH backend does, rewriting a
    plan with ``engine.ssh.warm.warmed``; ``started`` says when the pool was started, against
    the launches made by then."""

    pool: FakePool = field(default_factory=lambda: FakePool({}))
    started: list[int] = field(default_factory=list)
    """For each start of the pool, how many attempts had been launched before it."""

    def start_warm(self, plan: Plan, on_ready: Callable[[WarmReady], None]) -> FakePool:
        self.started.append(len(self.launched))
        return self.pool

    @staticmethod
    def warmed(plan: Plan, pool: FakePool) -> tuple[Plan, tuple[str, ...]]:
        from torchherd.engine.ssh.warm import warmed

        return warmed(plan, pool.ready())
