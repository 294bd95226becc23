"""``run --retries`` on SLURM, the pure side: the resubmission (its own run directory,
``sbatch --exclude``, quoted), the triage from sinfo's rows, what is refused, and the
recovery loop handing the excluded nodes to the backend. No SLURM, no socket (the real
one: tests/cluster/test_slurm.py)."""

from __future__ import annotations

import shlex
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, ClassVar

import pytest

from torchherd.api import Cluster
from torchherd.checks import CheckOptions
from torchherd.checks.analysis.slurm import parse_sinfo, slurm_view
from torchherd.checks.results import CheckReport, CheckResult
from torchherd.engine.events import (
    AttemptStarted,
    Collector,
    NodeExcluded,
    Observer,
    RecoveryEnded,
    RunShrunk,
    RunStarted,
    TriageDone,
    ignore,
)
from torchherd.engine.recovery.policy import triage_failures
from torchherd.engine.recovery.runner import RecoveringRun, attempt_plan
from torchherd.engine.run import LaunchOptions, Run, RunEvents
from torchherd.engine.slurm.backend import SlurmBackend
from torchherd.engine.slurm.batch import (
    Placement,
    attempt_settings,
    batch_job,
    for_attempt,
    picked_count,
    run_dir,
    submit_command,
)
from torchherd.engine.slurm.commands import submit
from torchherd.engine.slurm.settings import settings_of
from torchherd.errors import TorchherdError, Unplaceable, UsageError
from torchherd.inventory import Recovery
from torchherd.plan import Plan
from torchherd.runlog import NodeOutcome, RunSummary
from torchherd.transport import CommandResult


def plan(hosts: int = 3, spares: str = "", **slurm: object) -> Plan:
    made = Cluster([f"node{index}" for index in range(hosts)], scheduler="slurm", python="/opt/venv/bin/python",
                   slurm={"partition": "main", **slurm})
    if spares:
        made = made.with_spares(spares)
    return made.plan("train.py", run_id="th-test", nproc_per_node=1)


def sbatch_words(command: str) -> list[str]:
    """The words of the submit command's sbatch, as the shell splits them."""
    return shlex.split(command[command.index("sbatch --parsable"):])


# the resubmission ------------------------------------------------------------------------


def test_the_first_attempt_is_submitted_as_without_retries() -> None:
    job = batch_job(plan(), settings_of(plan().inventory))
    assert for_attempt(job, 1, ()) == job
    assert sbatch_words(submit_command(for_attempt(job, 1, ()))) == ["sbatch", "--parsable", "job.sbatch"]


def test_a_later_attempt_has_its_own_directory_and_excludes_the_nodes() -> None:
    job = for_attempt(batch_job(plan(), settings_of(plan().inventory)), 2, ("node1", "node4"))
    assert job.run_dir == "~/.torchherd/runs/th-test/attempt-2" == run_dir("th-test", 2)
    command = submit_command(job)
    assert sbatch_words(command) == ["sbatch", "--parsable", "--exclude=node1,node4", "job.sbatch"]
    assert "mkdir -p ~/.torchherd/runs/th-test/attempt-2 && cd ~/.torchherd/runs/th-test/attempt-2" in command


def test_a_node_name_cannot_reach_the_shell_unquoted() -> None:
    job = for_attempt(batch_job(plan(), settings_of(plan().inventory)), 3, ("node1", "x;touch /tmp/owned $(id)"))
    command = submit_command(job)
    assert shlex.quote("--exclude=node1,x;touch /tmp/owned $(id)") in command
    assert sbatch_words(command)[2] == "--exclude=node1,x;touch /tmp/owned $(id)"


@pytest.mark.parametrize("given", ["--exclude=node9", "--exclude node9", "-x node9", "-xnode9"])
def test_an_exclude_of_slurm_extra_is_kept_in_the_resubmissions(given: str) -> None:
    # sbatch's command line overrides the script's #SBATCH line: the user's nodes go with ours.
    chosen = plan(extra=[given])
    job = for_attempt(batch_job(chosen, settings_of(chosen.inventory)), 2, ("node1",))
    assert job.exclude == ("node9", "node1")
    assert f"#SBATCH {given}" in job.script


# the triage: SLURM's own view of each node ----------------------------------------------

SINFO = """node0|main*|up|idle|2|(null)|none
node1|main*|up|drained|2|(null)|fan failure, ticket 42
node2|main*|up|completing|2|(null)|none
node3|main*|up|down*|2|(null)|Not responding
node4|main*|up|draining|2|(null)|bad DIMM
"""


def triage(nodes: tuple[str, ...], spares: tuple[str, ...] = ()) -> dict[str, str]:
    """What the SLURM triage of ``nodes`` (and ``spares``) finds, from SINFO."""
    chosen = plan(5)
    where = Placement(len(nodes + spares), ",".join(nodes + spares), "the inventory's hosts")
    results = [result for result in slurm_view(parse_sinfo(SINFO), settings_of(chosen.inventory), where, 1)
               if result.check in SlurmBackend.triage_checks]
    return triage_failures(results, nodes + spares)


def test_the_triage_excludes_drained_draining_and_down_nodes_with_slurms_reason() -> None:
    assert triage(("node0", "node1", "node2", "node3", "node4")) == {
        "node1": "slurm-node: node1 is drained (fan failure, ticket 42)",
        "node3": "slurm-node: node3 is down* (Not responding)",
        "node4": "slurm-node: node4 is draining (bad DIMM)",
    }


def test_a_node_still_completing_the_last_attempt_passes_the_triage() -> None:
    assert triage(("node0", "node2")) == {}


def test_a_node_slurm_does_not_know_is_excluded() -> None:
    assert triage(("node0", "gpu7")) == {"gpu7": "slurm-node: gpu7 is not in the partition"}


# what SLURM refuses ----------------------------------------------------------------------


def test_retries_where_slurm_picks_the_nodes_are_allowed_but_not_with_spares() -> None:
    backend = SlurmBackend()
    backend.allow_recovery(plan(), Recovery(retries=2, min_nodes=2))
    for chosen in (plan(nodes=3), plan(nodelist="node[0-2]")):
        assert backend.picked_nodes(chosen) == 3
        backend.allow_recovery(chosen, Recovery(retries=1, min_nodes=2))
        with pytest.raises(UsageError, match=r"^--spares: \[slurm\].nodes or nodelist lets SLURM pick the nodes, "
                                             r"and it picks the replacement .* \(spares: node4\)$"):
            backend.allow_recovery(replace(chosen, base_inventory=plan(5, spares="node4").inventory),
                                   Recovery(retries=1))
    assert backend.picked_nodes(plan()) is None
    backend.allow_recovery(plan(nodes=3), Recovery(retries=1, hang_timeout=60.0))  # the watch reaches them by srun


def test_min_nodes_counts_the_nodes_slurm_is_asked_to_pick() -> None:
    with pytest.raises(UsageError, match=r"^--min-nodes 4: more than the 3 nodes of the run"):
        RecoveringRun(SlurmBackend(), plan(nodes=3), LaunchOptions(), Recovery(retries=1, min_nodes=4))


# an attempt where SLURM picks the nodes ---------------------------------------------------


def test_an_attempt_that_may_shrink_asks_sbatch_for_a_node_range_over_the_scripts_count() -> None:
    chosen = plan(nodes=4)
    job = for_attempt(batch_job(chosen, settings_of(chosen.inventory)), 2, ("node1",), shrink_to=2)
    assert "#SBATCH --nodes=4" in job.script
    assert sbatch_words(submit_command(job)) == ["sbatch", "--parsable", "--exclude=node1", "--nodes=2-4",
                                                 "job.sbatch"]
    # no range where it cannot shrink, or where the inventory names the nodes
    assert for_attempt(batch_job(chosen, settings_of(chosen.inventory)), 2, ("node1",), shrink_to=4).node_range is None
    assert for_attempt(batch_job(plan(4), settings_of(plan(4).inventory)), 2, ("node1",), shrink_to=2).node_range == "2-4"


def test_an_excluded_node_leaves_the_nodelist_and_slurm_picks_its_replacement() -> None:
    settings = settings_of(plan(nodelist="node[0-2]").inventory)
    assert attempt_settings(settings, ()) == settings
    changed = attempt_settings(settings, ("node1", "node7"))
    assert (changed.nodelist, changed.nodes) == ("node0,node2", 3)
    assert attempt_settings(settings_of(plan(nodes=4, nodelist="node[0-1]").inventory), ("node0", "node1")).nodelist is None
    assert picked_count(changed) == 3 and picked_count(settings_of(plan(nodes=5).inventory)) == 5


# the loop hands every excluded node to the backend --------------------------------------


def _summary(chosen: Plan, culprit: str | None) -> RunSummary:
    nodes = tuple(NodeOutcome(node.host.name, index, "failed" if node.host.name == culprit else
                              ("torn down" if culprit else "ok"), 1 if node.host.name == culprit else 0, 1.0,
                              "rank 1: RuntimeError: boom" if node.host.name == culprit else None, None, ())
                  for index, node in enumerate(chosen.nodes))
    if culprit is None:
        return RunSummary(chosen.run_id, 0, "all finished", nodes, "logs")
    return RunSummary(chosen.run_id, 1, f"{culprit} failed first", nodes, "logs", culprit)


@dataclass
class _Done:
    plan: Plan
    summary: RunSummary
    log_dir: Path = Path("/nonexistent")

    def supervise(self) -> RunSummary:
        return self.summary

    def request_stop(self) -> None:
        pass


@dataclass
class SlurmLike:
    """A backend with SLURM's triage: sinfo says ``drained`` for the nodes in it."""

    culprits: list[str | None]
    drained: dict[str, str] = field(default_factory=dict)
    launched: list[tuple[tuple[str, ...], LaunchOptions]] = field(default_factory=list)
    checked: list[frozenset[str]] = field(default_factory=list)
    triage_checks: ClassVar[frozenset[str]] = SlurmBackend.triage_checks
    lock: threading.Lock = field(default_factory=threading.Lock)

    def check(self, plan: Plan, options: CheckOptions, *, sync: bool = False,
              on_result: Callable[[CheckResult], None] | None = None, on_event: Observer = ignore) -> CheckReport:
        assert options.only is not None
        self.checked.append(options.only)
        return CheckReport(tuple(
            CheckResult(node.host.name, "slurm-node", "fail" if node.host.name in self.drained else "pass",
                        f"{node.host.name} is drained ({self.drained[node.host.name]})"
                        if node.host.name in self.drained else f"{node.host.name} is idle")
            for node in plan.nodes))

    def picked_nodes(self, plan: Plan) -> int | None:
        return SlurmBackend.picked_nodes(SlurmBackend(), plan)

    def launch(self, plan: Plan, options: LaunchOptions, observer: Observer = ignore) -> Run:
        self.launched.append((tuple(node.host.name for node in plan.nodes), options))
        if self.culprits[len(self.launched) - 1] == "sbatch":
            raise TorchherdError("sbatch failed on localhost: sbatch: error: Batch job submission failed: "
                                 "Socket timed out on send/recv operation")
        if self.culprits[len(self.launched) - 1] == "never":
            raise Unplaceable("sbatch failed on localhost: sbatch: error: Batch job submission failed: "
                              "Requested node configuration is not available")
        run = Run(_Done(plan, _summary(plan, self.culprits[len(self.launched) - 1])), RunEvents(observer))
        run.start()
        return run


def recover(backend: SlurmLike, chosen: Plan, recovery: Recovery) -> tuple[RunSummary, Collector]:
    events = Collector()
    run = RecoveringRun(backend, chosen, LaunchOptions(check=False, log_dir=Path("/nonexistent")), recovery, events)
    return run.start().wait(timeout=20), events


def test_a_drained_node_is_excluded_and_its_place_taken_by_a_spare() -> None:
    backend = SlurmLike(["node1", None], drained={"node1": "fan failure"})
    summary, events = recover(backend, plan(4, spares="node3"), Recovery(retries=1))
    assert summary.exit_code == 0
    assert [(nodes, options.attempt, options.exclude) for nodes, options in backend.launched] == [
        (("node0", "node1", "node2"), 1, ()),
        (("node0", "node2", "node3"), 2, ("node1",)),
    ]
    assert backend.checked == [frozenset({"slurm-node"})]
    assert [event.reason for event in events.of(NodeExcluded)] == ["slurm-node: node1 is drained (fan failure)"]


def test_the_cooldown_excludes_a_node_slurm_calls_idle_and_the_run_shrinks() -> None:
    backend = SlurmLike(["node1", "node1", None])
    summary, _ = recover(backend, plan(3), Recovery(retries=2, min_nodes=2))
    assert summary.exit_code == 0
    assert [(nodes, options.exclude) for nodes, options in backend.launched] == [
        (("node0", "node1", "node2"), ()),
        (("node0", "node1", "node2"), ()),
        (("node0", "node2"), ("node1",)),
    ]


def test_a_resubmission_slurm_refuses_is_a_failed_attempt_not_the_end() -> None:
    backend = SlurmLike(["node1", "sbatch", None])
    summary, _ = recover(backend, plan(3), Recovery(retries=2))
    assert summary.exit_code == 0
    assert [record.ended for record in summary.attempts] == ["failed", "failed", "ok"]
    assert summary.attempts[1].headline == ("attempt 2 could not start: sbatch failed on localhost: sbatch: error: "
                                            "Batch job submission failed: Socket timed out on send/recv operation")


def test_a_resubmission_slurm_could_never_place_ends_the_run_instead_of_spending_the_retries() -> None:
    backend = SlurmLike(["node1", "never", None], drained={"node1": "fan failure"})
    summary, events = recover(backend, plan(4, spares="node3"), Recovery(retries=3))
    assert summary.exit_code == 1 and len(backend.launched) == 2
    assert [record.ended for record in summary.attempts] == ["failed", "failed"]
    assert summary.attempts[1].next == "the scheduler cannot place the run without node1 (it refused the attempt)"
    assert [event.message for event in events.of(RecoveryEnded)] == [summary.attempts[1].next]


def test_a_shrunk_attempt_asks_slurm_for_its_nodes_by_name_and_count() -> None:
    base = plan(4, spares="node3")
    job = batch_job(attempt_plan(base, ("node0", "node2"), 3), settings_of(base.inventory))
    assert "#SBATCH --nodes=2" in job.script and "#SBATCH --nodelist=node0,node2" in job.script
    assert "export TORCHHERD_ATTEMPT=3" in job.script
    assert '--nnodes "$SLURM_JOB_NUM_NODES"' in job.script


@dataclass
class _Picked:
    """An attempt where SLURM picked ``nodes``: it says so (RunStarted), then ``culprit`` fails."""

    plan: Plan
    nodes: tuple[str, ...]
    culprit: str | None
    observer: Observer
    log_dir: Path = Path("/nonexistent")

    def supervise(self) -> RunSummary:
        self.observer(RunStarted(self.plan.run_id, self.nodes, self.nodes[0], self.nodes[0], 29500, "logs", 0))
        outcomes = tuple(NodeOutcome(node, index, "failed" if node == self.culprit else "ok",
                                     1 if node == self.culprit else 0, 1.0,
                                     f"rank {index}: RuntimeError: boom" if node == self.culprit else None,
                                     None, ()) for index, node in enumerate(self.nodes))
        if self.culprit is None:
            return RunSummary(self.plan.run_id, 0, "all finished", outcomes, "logs")
        return RunSummary(self.plan.run_id, 1, f"{self.culprit} failed first", outcomes, "logs", self.culprit)

    def request_stop(self) -> None:
        pass


@dataclass
class SlurmPicks(SlurmLike):
    """SLURM picking the first free nodes of ``pool`` not excluded: all it was asked for,
    or with ``--nodes=K-N`` as many as there are, down to K."""

    pool: tuple[str, ...] = ("node0", "node1", "node2", "node3")
    plans: list[Plan] = field(default_factory=list)

    def launch(self, plan: Plan, options: LaunchOptions, observer: Observer = ignore) -> Run:
        self.launched.append((tuple(node.host.name for node in plan.nodes), options))
        self.plans.append(plan)
        wanted = settings_of(plan.inventory).nodes
        assert wanted is not None and plan.nodes[0].host.name == "node0"  # the template: the plan names no node
        free = [node for node in self.pool if node not in options.exclude]
        picked = tuple(free[:wanted])
        assert len(picked) == wanted or (options.shrink_to is not None and len(picked) >= options.shrink_to)
        events = RunEvents(observer)
        run = Run(_Picked(plan, picked, self.culprits[len(self.launched) - 1], events), events)
        run.start()
        return run


def test_where_slurm_picks_the_triage_checks_the_nodes_it_picked_and_sbatch_leaves_out_the_bad_one() -> None:
    backend = SlurmPicks(["node1", None], drained={"node1": "fan failure"})
    summary, events = recover(backend, plan(1, nodes=2), Recovery(retries=2))
    assert summary.exit_code == 0, summary.headline
    assert [(options.attempt, options.exclude, options.shrink_to) for _, options in backend.launched] == [
        (1, (), None), (2, ("node1",), None)]
    assert [chosen.options.extra_env["TORCHHERD_ATTEMPT"] for chosen in backend.plans] == ["1", "2"]
    assert [(record.nodes, record.ended, record.next) for record in summary.attempts] == [
        (("node0", "node1"), "failed", "attempt 2 on 2 nodes SLURM picks, not node1"),
        (("node0", "node2"), "ok", "")]
    assert [event.nodes for event in events.of(TriageDone)] == [("node0", "node1")]
    assert [(event.nodes, event.picking) for event in events.of(AttemptStarted)] == [
        ((), "2 nodes SLURM picks"), ((), "2 nodes SLURM picks, not node1")]
    assert not events.of(RunShrunk)


def test_where_slurm_picks_and_too_few_nodes_are_left_the_attempt_may_start_on_fewer() -> None:
    # node2 was drained too (an admin's doing): the triage of the nodes attempt 1 ran on finds both.
    backend = SlurmPicks(["node1", None], drained={"node1": "fan failure", "node2": "bad DIMM"},
                         pool=("node0", "node1", "node2"))
    summary, events = recover(backend, plan(1, nodes=3), Recovery(retries=2, min_nodes=1))
    assert summary.exit_code == 0, summary.headline
    assert [(options.exclude, options.shrink_to) for _, options in backend.launched] == [
        ((), None), (("node1", "node2"), 1)]
    assert [record.nodes for record in summary.attempts] == [("node0", "node1", "node2"), ("node0",)]
    assert [(event.nodes, event.was) for event in events.of(RunShrunk)] == [(1, 3)]
    assert events.of(AttemptStarted)[1].picking == "1 to 3 nodes SLURM picks, not node1, node2"


def test_where_slurm_picks_the_same_error_on_the_node_it_picked_next_is_a_job_bug() -> None:
    backend = SlurmPicks(["node1", "node0", None])
    summary, _ = recover(backend, plan(1, nodes=2), Recovery(retries=3))
    assert summary.exit_code == 1 and len(summary.attempts) == 2, summary.attempts
    assert summary.headline.startswith("the same error on node1 (attempt 1) and on node0 (attempt 2)")


class _Refusing:
    """A submit host whose sbatch fails with ``said`` on stderr."""

    node = "login1"

    def __init__(self, said: str) -> None:
        self.said = said

    def run(self, command: str, stdin: bytes = b"", timeout: float = 30.0) -> CommandResult:
        return CommandResult(1, b"", self.said.encode(), 0.0)


@pytest.mark.parametrize(("said", "never"), [
    ("sbatch: error: Batch job submission failed: Requested node configuration is not available", True),
    ("sbatch: error: Batch job submission failed: Socket timed out on send/recv operation", False),
    ("sbatch: error: Batch job submission failed: Invalid node name specified", False),
])
def test_only_a_job_slurm_could_never_place_is_unplaceable(said: str, never: bool) -> None:
    chosen = plan(nodes=3)
    with pytest.raises(TorchherdError) as raised:
        submit(_Refusing(said), batch_job(chosen, settings_of(chosen.inventory)))  # type: ignore[arg-type]
    assert isinstance(raised.value, Unplaceable) is never
    assert str(raised.value) == f"sbatch failed on login1: {said}"
