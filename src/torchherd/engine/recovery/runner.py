"""A run that survives a bad node (``run --retries N``): attempts, triage, spares.

Each attempt is an ordinary run of the same plan (the same run id, ``TORCHHERD_ATTEMPT``
in the job's environment, the same node logs written on after a marker line), started
and supervised by the backend. After a failed attempt the pure policy
(``recovery_policy``) decides whether the run ends; if not, the fast node checks run on
the next attempt's nodes (the triage: the backend's ``triage_checks``), nodes that fail
them are excluded, spares take their places, and the next attempt starts; a backend
whose scheduler places the job (SLURM) is also told every node excluded so far
(``LaunchOptions.exclude``). Where the scheduler also picks the nodes (SLURM's
``nodes`` key: ``picked_nodes``), an attempt's nodes are known once it started, the
triage checks those, and the scheduler picks the replacements (no spares; with
``--min-nodes``, it may start on fewer). Ctrl-C or SIGTERM (``stop``) never retries.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Collection, Iterator, Mapping, Protocol, Sequence

from torchherd.checks import CheckOptions
from torchherd.checks.results import CheckReport, CheckResult
from torchherd.engine.bookkeeping import log_dir
from torchherd.engine.events import (
    AttemptFailed,
    AttemptStarted,
    AttemptWarm,
    CheckpointMissing,
    CheckpointReplicated,
    CheckpointSaved,
    CheckpointStaged,
    Event,
    HangFound,
    Interrupted,
    LostContainers,
    NodeExcluded,
    NodeLost,
    Observer,
    Output,
    RanksRunning,
    RecoveryEnded,
    RunFinished,
    RunShrunk,
    RunStarted,
    SpareTaken,
    TriageDone,
    WarmReady,
    ignore,
)
from torchherd.engine.recovery.policy import (
    Attempt,
    End,
    NextNodes,
    attempt_of,
    cooldown,
    doubtful,
    known_lost,
    next_nodes,
    triage_failures,
    verdict,
)
from torchherd.engine.recovery.replication import Holdings, Replicator
from torchherd.engine.recovery.resume import Resume, resume_of, resumed_host, resumed_options
from torchherd.engine.run import LINE_BUFFER, Ended, Endings, LaunchOptions, Run, wait_stopping
from torchherd.engine.watch.hang import (
    FAULTHANDLER,
    HangWatch,
    described,
    flight_described,
    flight_issued,
    merged,
    spy_stacks,
    stacks_of,
)
from torchherd.errors import EXIT_FAILED, EXIT_INTERRUPTED, TorchherdError, Unplaceable, UsageError
from torchherd.inventory import Bandwidth, Recovery
from torchherd.inventory.options import MIN_NODES, OptionError
from torchherd.plan import NodeNetwork, Plan, RunOptions, build_plan
from torchherd.remote import flight, wire
from torchherd.remote.container import container_name
from torchherd.runlog import AttemptRecord, OutputLine, RankLines, RunSummary, flat

ATTEMPT_VARIABLE = wire.ATTEMPT_ENV
TRIAGE_ROUNDS = 4
"""Triage rounds before an attempt at most: a round that excluded a node, or whose
cross-node checks could not count, is followed by one on the new set of nodes."""
FIRST_WARM_WAIT = 30.0
"""How long attempt 1 waits, after its preflight, for its nodes' warm Pythons to import torch;
a node whose warm Python is not ready by then starts cold."""


class Backendish(Protocol):
    """What recovery needs of a backend (``engine.backend.Backend`` has it)."""

    @property
    def triage_checks(self) -> frozenset[str]:
        """The checks a triage runs on the next attempt's nodes (``check``'s ``only``)."""

    def check(self, plan: Plan, options: CheckOptions, *, sync: bool = False,
              on_result: Callable[[CheckResult], None] | None = None, on_event: Observer = ignore) -> CheckReport: ...

    def launch(self, plan: Plan, options: LaunchOptions, observer: Observer = ignore) -> Run: ...

    def picked_nodes(self, plan: Plan) -> int | None: ...

    def stage_checkpoint(self, plan: Plan, sources: Sequence[str], receivers: Sequence[str], path: str,
                         attempt: int, stopping: Callable[[], bool] = lambda: False,
                         ) -> CheckpointStaged | CheckpointMissing: ...

    def remove_lost_containers(self, plan: Plan, nodes: Sequence[str]) -> LostContainers | None: ...
    def replicate_checkpoint(self, plan: Plan, saved: CheckpointSaved, targets: Sequence[str], bandwidth: Bandwidth,
                             stopping: Callable[[], bool] = lambda: False) -> CheckpointReplicated: ...


class WarmPool(Protocol):
    """A backend's warm Pythons for the attempts (the SSH backend's ``engine.ssh.warm``)."""

    def errors(self) -> dict[str, str]:
        """Node -> why it has no warm Python (it could not start one)."""

    def wait_for(self, names: Sequence[str], timeout: float) -> None:
        """Returns once each of ``names`` answered (ready or not), or after ``timeout``."""

    def close(self, gone: Collection[str] = ()) -> None: ...


class Warming(Protocol):
    """A backend that can keep a warm Python per node (``start_warm``, ``warmed``)."""

    def start_warm(self, plan: Plan, on_ready: Callable[[WarmReady], None]) -> WarmPool: ...

    def warmed(self, plan: Plan, pool: WarmPool) -> tuple[Plan, tuple[str, ...]]: ...


def launch_warm(backend: Backendish, plan: Plan, options: LaunchOptions, observer: Observer) -> Run | None:
    """A run without retries, started as a recovering run's attempt 1 is: each node's warm
    Python (``[recovery] warm``) imports torch beside the preflight, and once the preflight
    passed each node's torchrun and ranks fork from it (a node whose warm Python is not ready
    within FIRST_WARM_WAIT starts cold). One import of torch per node, not one per process:
    on a GPU node, eight ranks that each import torch at once queue behind each other.
    The warm Pythons end with the run. None where the backend keeps none, or the job cannot
    fork from one: its files are synced first (its venv is not there yet), it runs in a
    container (its Python is the image's), or it outlives the controller."""
    warming = _warming_backend(backend)
    if warming is None or plan.sync is not None or options.persist or any(
            node.container is not None for node in plan.nodes):
        return None
    pool = warming.start_warm(plan, lambda _ready: None)

    def first(kept: Plan) -> Plan:
        pool.wait_for(tuple(node.host.name for node in kept.nodes), FIRST_WARM_WAIT)
        return warming.warmed(kept, pool)[0]

    try:
        run = backend.launch(plan, replace(options, started_as=first), observer)
    except BaseException:
        pool.close()
        raise

    def ended(summary: RunSummary | None, _error: BaseException | None) -> None:
        # A node the run lost has no zygote left to answer: not waited for.
        pool.close(gone=[node.node for node in summary.nodes if node.state == "lost"] if summary else ())

    run.when_done(ended)
    return run


def _warming_backend(backend: object) -> Warming | None:
    """``backend`` where it keeps warm Pythons (``start_warm``, ``warmed``), else None."""
    if not (callable(getattr(backend, "start_warm", None)) and callable(getattr(backend, "warmed", None))):
        return None
    return backend  # type: ignore[return-value]


def attempt_plan(base: Plan, nodes: Sequence[str], attempt: int,
                 networks: Mapping[str, NodeNetwork] | None = None, faulthandler: bool = False,
                 resume: Resume | None = None) -> Plan:
    """``base`` on ``nodes`` (names of its hosts or spares; the first is the master), with
    the attempt's number in the job's environment (and ``PYTHONFAULTHANDLER=1`` for the
    hang watch, unless set). A fixed ``--nnodes`` follows the count. ``resume``: the attempt
    starts from the staged checkpoint (``engine.recovery.resume``)."""
    inventory = base.base_inventory or base.inventory
    known = {host.name: host for host in inventory.hosts + inventory.spares}
    hosts = tuple(resumed_host(replace(known[name], spare=False), resume) for name in nodes)
    chosen = replace(inventory, hosts=hosts, spares=(), cluster=replace(inventory.cluster, master=nodes[0]))
    nnodes = base.options.nnodes
    if nnodes is not None and ":" not in nnodes:
        nnodes = str(len(nodes))
    options = resumed_options(_attempt_options(base, attempt, faulthandler), resume)
    return build_plan(chosen, replace(options, nnodes=nnodes), networks)


def picked_plan(base: Plan, attempt: int, faulthandler: bool = False, resume: Resume | None = None) -> Plan:
    """``base`` as an attempt where the scheduler picks the nodes: the same plan, with the
    attempt's number (and the hang watch's variable) in the job's environment."""
    inventory = base.base_inventory or base.inventory
    if resume is not None:
        inventory = replace(inventory, hosts=tuple(resumed_host(host, resume) for host in inventory.hosts))
    return build_plan(inventory, resumed_options(_attempt_options(base, attempt, faulthandler), resume))


def named_plan(base: Plan, nodes: Sequence[str]) -> Plan:
    """``base`` on the nodes the scheduler picked for an attempt, by name (the inventory's
    one host shape on each), for the triage to check them."""
    inventory = base.base_inventory or base.inventory
    template = inventory.hosts[0]
    hosts = tuple(replace(template, name=name, address=name, local_addr=None) for name in nodes)
    named = replace(inventory, hosts=hosts, cluster=replace(inventory.cluster, master=nodes[0]),
                    tables=inventory.named_tables())
    return build_plan(named, base.options)


def _attempt_options(base: Plan, attempt: int, faulthandler: bool) -> RunOptions:
    extra = {ATTEMPT_VARIABLE: str(attempt)}
    if faulthandler and FAULTHANDLER not in base.options.extra_env:
        extra[FAULTHANDLER] = "1"
    if faulthandler:  # the hang watch's runs: each rank's flight record can be read (remote/flight.py)
        extra[flight.ENABLE_ENV] = "1"
    return replace(base.options, extra_env={**base.options.extra_env, **extra})


def check_recovery(plan: Plan, recovery: Recovery, count: int | None = None) -> None:
    """Refuses (UsageError, exit 2) what cannot work with this plan (``count``: the nodes
    the scheduler picks for it, where it picks them)."""
    count = len(plan.nodes) if count is None else count
    if recovery.min_nodes is not None and recovery.min_nodes > count:
        raise OptionError(MIN_NODES, recovery.min_nodes, f"more than the {count} nodes of the run",
                          f"give at most {count}", first="flag")


@dataclass(frozen=True)
class _Triaged:
    """The next attempt's nodes (or the run's end), and what the triage found."""

    outcome: NextNodes | End
    found: tuple[str, ...]


class _Lines:
    """``RecoveringRun.lines``'s feed: every attempt's lines once someone reads them (the
    oldest dropped beyond ``LINE_BUFFER`` unread, as ``Run.lines``), None at the run's end."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.queue: queue.Queue[OutputLine | None] | None = None
        self.ended = False

    def reader(self) -> queue.Queue[OutputLine | None] | None:
        """The queue to read (made at the first call); None when the run has ended already."""
        with self._lock:
            if self.queue is None:
                self.queue = queue.Queue(LINE_BUFFER)
                if self.ended:
                    return None
            return self.queue

    def offer(self, line: OutputLine | None) -> None:
        with self._lock:
            if line is None:
                self.ended = True
            lines = self.queue
        if lines is None:
            return
        while True:
            try:
                lines.put_nowait(line)
                return
            except queue.Full:
                try:
                    lines.get_nowait()
                except queue.Empty:
                    pass


class RecoveringRun:
    """A run with retries: ``wait`` for the summary of the whole run (every attempt in
    ``RunSummary.attempts``), ``stop`` it (never retried), read every attempt's ``lines``.
    The attempts run in a thread of their own; the observer gets each attempt's events and
    the recovery's own."""

    def __init__(self, backend: Backendish, plan: Plan, options: LaunchOptions, recovery: Recovery,
                 observer: Observer = ignore, check_spares: bool | None = None) -> None:
        self.picked = backend.picked_nodes(plan)
        """How many nodes the scheduler picks for each attempt; None: the plan names them."""
        check_recovery(plan, recovery, self.picked)
        self.backend = backend
        self.plan = plan
        self.run_id = plan.run_id
        self.log_dir = options.log_dir / plan.run_id
        self.options = options
        self.recovery = recovery
        self.emit = observer
        self.check_spares = options.check if check_spares is None else check_spares
        """The spares in the first preflight (a detached run's was made before, without them)."""
        self.spares = [host.name for host in (plan.base_inventory or plan.inventory).spares]
        self.torch_known: dict[str, str] = {}
        """Per node whose torch ran lately, what ran it ("attempt 1's ranks", the first
        preflight): a triage reads its torch's versions from its files instead of importing
        it again (``CheckOptions.torch_known``), seconds of CPU on every node."""
        self._running: set[str] = set()
        """The current attempt's nodes whose ranks got through the rendezvous."""
        self._spares_checked: Future[CheckReport] | None = None
        """The spares' ``python`` check while the first attempt runs (without ``check_spares``)."""
        self.records: list[AttemptRecord] = []
        self.attempts: list[Attempt] = []
        self.networks: dict[str, NodeNetwork] = {}
        self.excluded: list[str] = []
        """Every node excluded so far: a scheduler that places the job itself is told to
        leave them out (``LaunchOptions.exclude``: SLURM's ``--exclude``)."""
        self.unreachable: set[str] = set()
        """Nodes a triage could not reach: not asked for the checkpoint (a wait for nothing)."""
        self._lock = threading.Lock()
        self._stopping = 0
        self._current: Run | None = None
        self._summary: RunSummary | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._endings = Endings(self._done)
        self._lines = _Lines()
        self._refused: TorchherdError | None = None
        """Why the last attempt could not start (``LaunchAborted``, a refused submission);
        None when it started."""
        self._watch: HangWatch | None = None
        self._hang_text = ""
        self._stacks: list[OutputLine] = []
        """The ranks' lines after a hang's SIGABRT: their stacks."""
        self.lost: set[str] = set()
        """Every node lost in an attempt (the summary's checkpoint line marks them)."""
        self.holdings = Holdings(recovery.checkpoint) if recovery.checkpoint is not None else None
        self._running_plan = plan
        """The plan of the attempt running now: the replication reaches its nodes."""
        self.warm_pool: WarmPool | None = None
        """The warm Pythons later attempts fork from, where the backend keeps them."""
        self.started_warm: dict[int, tuple[str, ...]] = {}
        """Per attempt, the nodes that started warm."""
        self._resume: Resume | None = None
        """How the next attempt starts from the checkpoint its staging found; None: as the first."""
        self.replicator = (Replicator(self._replicate, recovery.replicas, observer, self.holdings)
                           if self.holdings is not None and recovery.replicas and (recovery.retries or options.persist)
                           and self.picked is None else None)
        """With retries: a replica is there for the staging before a new attempt (a run with
        ``hang_timeout`` alone has none, as a plain run has no controller to copy). Detached
        (``persist``, the controller in the background) without retries too: it runs to copy."""

    # the caller's side ------------------------------------------------------------------
    def start(self) -> RecoveringRun:
        """Checks the spares (with the preflight), starts the first attempt (raising
        LaunchAborted as a run without retries would), then goes on in its thread."""
        # Where nothing is synced first (the job's files and venv are on the nodes already),
        # the warm Pythons import torch beside the preflight, and attempt 1 forks from them.
        early = self.plan.sync is None
        if early:
            self.warm_pool = self._start_warm()
        try:
            if self.check_spares and self.spares:
                self._check_spares()
            first = self._launch(1, self._first_nodes(), self.options)
        except BaseException:
            if self.warm_pool is not None:
                self.warm_pool.close()
            raise
        if (not self.check_spares and self.spares and self.recovery.retries and self.picked is None
                and "python" in self.backend.triage_checks):
            # Meanwhile the spares' torch is imported once, so that a triage need not (and
            # their page cache holds it when one is taken).
            self._spares_checked = _in_background(self.backend.check, attempt_plan(self.plan, self.spares, 1),
                                                  CheckOptions(only=frozenset({"ssh", "python"})))
        if not early:
            self.warm_pool = self._start_warm()
        threading.Thread(target=self._loop, args=(first,), name="torchherd-recovery", daemon=True).start()
        return self

    def _warming(self) -> Warming | None:
        """The backend, when an attempt can start warm: retries, nodes the plan names,
        no container (the job's Python is the image's), attached (a background controller's
        nodes outlive it), and no hang watch (its probe looks for the ranks among the
        supervisor's descendants; a warm rank is the warm Python's)."""
        backend = self.backend
        if not (self.recovery.warm and self.recovery.retries and self.picked is None
                and self.recovery.hang_timeout is None and not self.options.persist
                and all(node.container is None for node in self.plan.nodes)):
            return None
        return _warming_backend(backend)

    def _start_warm(self) -> WarmPool | None:
        """A warm Python on every node of the run and every spare, while attempt 1 runs."""
        warming = self._warming()
        if warming is None:
            return None
        return warming.start_warm(attempt_plan(self.plan, self._first_nodes() + tuple(self.spares), 1, self.networks),
                                  self.report)

    def wait(self, timeout: float | None = None) -> RunSummary:
        """The summary once the last attempt ended. Ctrl-C while waiting stops the run as
        ``stop`` does (a second one kills) and waits on for the teardown."""
        wait_stopping(self._done, timeout, self.stop, self.run_id)
        if self._error is not None:
            raise self._error
        assert self._summary is not None
        return self._summary

    def stop(self) -> None:
        """Ends the run without another attempt: the current one stops as on Ctrl-C
        (called again: killed at once)."""
        with self._lock:
            self._stopping += 1
            current = self._current
        if current is not None:
            current.stop()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def lines(self) -> Iterator[OutputLine]:
        """Every line of every attempt as it arrives, until the run ends (as ``Run.lines``:
        node, rank, stream, text; those before the first call are in the log files)."""
        lines = self._lines.reader()
        while lines is not None:
            line = lines.get()
            if line is None:
                lines.put_nowait(None)  # the end stays: a later reader ends at once too
                return
            yield line

    def report(self, event: Event) -> None:
        """Hands ``event`` to the run's observer (and its lines to ``lines``), in order with
        the current attempt's own."""
        with self._lock:
            current = self._current
        if current is not None and not current.done:
            current.report(event)
        else:
            self._relay(event)

    @property
    def stopping(self) -> bool:
        with self._lock:
            return self._stopping > 0

    # the attempts ------------------------------------------------------------------------
    def _first_nodes(self) -> tuple[str, ...]:
        return () if self.picked is not None else tuple(node.host.name for node in self.plan.nodes)

    def _launch(self, number: int, nodes: tuple[str, ...], options: LaunchOptions) -> Run:
        timeout = self.recovery.hang_timeout
        resume = self._resume if number > 1 else None
        if self.picked is None:
            plan = attempt_plan(self.plan, nodes, number, self.networks, faulthandler=timeout is not None,
                                resume=resume)
        else:
            plan = picked_plan(self.plan, number, faulthandler=timeout is not None, resume=resume)
        warming, pool = self._warming(), self.warm_pool
        warm: AttemptWarm | None = None
        if warming is not None and pool is not None:
            if number > 1:
                plan, started = warming.warmed(plan, pool)
                warm = self._started_warm(number, nodes, started, pool)
            else:
                options = replace(options, started_as=lambda kept: self._first_warm(kept, warming, pool))
        if self.recovery.retries:
            self.emit(AttemptStarted(number, self.recovery.retries + 1, nodes, self._picking()))
        if warm is not None:
            self.emit(warm)
        shrink = self.recovery.min_nodes if self.picked is not None and self.excluded else None
        self._running = set()
        if self.replicator is not None:
            self._running_plan = plan
            self.replicator.attempt([node.host.name for node in plan.nodes])
            options = replace(options, watch_checkpoint=self.recovery.checkpoint)
        run = self.backend.launch(plan, replace(options, attempt=number if self.recovery.retries else 0,
                                                exclude=tuple(self.excluded), shrink_to=shrink), self._relay)
        with self._lock:
            self._current = run
            stopping = self._stopping
            if timeout is not None:
                self._watch = HangWatch(run.run_id, run.job, timeout, lambda seconds: run.report(HangFound(seconds)),
                                        run.stop).start()
        for _ in range(stopping):  # stopped while it was starting: it stops now
            run.stop()
        # The addresses the preflight found stay the nodes' own in later attempts.
        self.networks.update({node.host.name: node.network for node in run.plan.nodes if node.network is not None})
        return run

    def _first_warm(self, plan: Plan, warming: Warming, pool: WarmPool) -> Plan:
        """Attempt 1's plan as the preflight kept it, each node forking from its warm Python
        if that is ready within FIRST_WARM_WAIT (it imports torch beside the preflight; a cold
        start would import it too); the others start cold."""
        names = tuple(node.host.name for node in plan.nodes)
        pool.wait_for(names, FIRST_WARM_WAIT)
        plan, started = warming.warmed(plan, pool)
        self.emit(self._started_warm(1, names, started, pool))
        return plan

    def _started_warm(self, number: int, nodes: Sequence[str], started: tuple[str, ...],
                      pool: WarmPool) -> AttemptWarm:
        self.started_warm[number] = started
        cold = tuple(name for name in nodes if name not in started)
        why = pool.errors()
        return AttemptWarm(number, started, cold, tuple((name, why.get(name, "not ready yet")) for name in cold))

    def _replicate(self, saved: CheckpointSaved, targets: tuple[str, ...],
                   cancelled: Callable[[], bool]) -> CheckpointReplicated:
        return self.backend.replicate_checkpoint(self._running_plan, saved, targets,
                                                 self.recovery.replicate_bandwidth,
                                                 lambda: cancelled() or self.stopping)

    def _relay(self, event: Event) -> None:
        """An attempt's events go on to the observer; its RunFinished is the recovery's to give
        (and a new checkpoint, the replication's to copy: a node's own save goes on once the
        holdings know it, so that a detached run's record says at once where the newest is)."""
        if isinstance(event, CheckpointSaved):
            if self.replicator is not None and self.replicator.saved(event):
                self.emit(event)
            return
        if isinstance(event, NodeLost):
            self.lost.add(event.node)
        watch = self._watch
        if isinstance(event, RanksRunning):
            self._running.add(event.node)
        if isinstance(event, Output) and self._lines.queue is not None:  # someone reads lines()
            for line in flat(event.lines):
                self._lines.offer(line)
        if isinstance(event, Output) and watch is not None:
            watch.saw_output()
            if watch.hung is not None:
                for chunk in event.lines:
                    self._stacks.extend(chunk.lines() if isinstance(chunk, RankLines) else (chunk,))
        if isinstance(event, RunStarted) and self.picked is not None:
            # The attempts before this one are recorded: the last that started is the one to compare with.
            was = next((len(record.nodes) for record in reversed(self.records) if record.nodes), 0)
            if 0 < len(event.nodes) < was:  # SLURM found fewer nodes than the attempt before (--min-nodes)
                self.emit(RunShrunk(len(event.nodes), was))
        if not isinstance(event, RunFinished):
            self.emit(event)

    def _picking(self) -> str:
        """"2 nodes SLURM picks, not node1": an attempt's nodes where the scheduler picks them."""
        if self.picked is None:
            return ""
        low = self.recovery.min_nodes if self.excluded else None
        count = f"{low} to {self.picked}" if low is not None and low < self.picked else f"{self.picked}"
        leaving = f", not {', '.join(self.excluded)}" if self.excluded else ""
        return f"{count} nodes SLURM picks{leaving}"

    def _loop(self, first: Run) -> None:
        try:
            self._summary = self._attempts(first)
            self._remove_lost_containers(self._summary)
            self.emit(RunFinished(self._summary))
        except BaseException as error:  # handed to wait(): a bug must not vanish in a thread
            self._error = error
        finally:
            if self._spares_checked is not None:  # its commands on the spares end before the run does
                wait([self._spares_checked])
            if self.replicator is not None:
                self.replicator.close()
            if self.warm_pool is not None:  # every warm Python ends, and what it forked
                self.warm_pool.close(gone=self.lost)
            self._lines.offer(None)
            self._error = self._endings.end(self._summary, self._error)

    def when_done(self, ended: Ended) -> None:
        """``ended`` is told how the run ended, before ``wait`` returns (at once when it has)."""
        self._endings.add(ended)

    def _attempts(self, run: Run | None) -> RunSummary:
        number = 1
        nodes = self._first_nodes()
        later = replace(self.options, check=False)  # the triage checked the nodes
        while True:
            started = time.monotonic()
            summary = self._finish(run, number, nodes)
            seconds = time.monotonic() - started
            if self.picked is not None:  # the nodes the scheduler picked, in node-rank order
                nodes = tuple(outcome.node for outcome in summary.nodes)
            attempt = self._hung(attempt_of(number, nodes, summary))
            summary = replace(summary, headline=self._headline(summary))
            if attempt.ended == "hung" and summary.exit_code == EXIT_INTERRUPTED:  # the watch stopped it
                summary = replace(summary, exit_code=EXIT_FAILED)
            if not self.recovery.retries:  # only the hang watch: one attempt, told as a run without retries
                return summary
            if attempt.ended in ("ok", "interrupted") or self.stopping:
                self.records.append(AttemptRecord(number, nodes, attempt.ended, summary.headline, seconds))
                return self._final(summary, None if attempt.ended == "ok" else "interrupted")
            self.emit(AttemptFailed(number, summary.headline, seconds))
            end = verdict(attempt, self.attempts, self.recovery) or self._never_placed()
            triaged = _Triaged(end, ()) if end is not None else self._triage(attempt)
            self.attempts.append(attempt)
            if self.stopping:
                self.records.append(AttemptRecord(number, nodes, attempt.ended, summary.headline, seconds,
                                                  triaged.found, "interrupted"))
                self.emit(Interrupted())
                return self._final(summary, "interrupted")
            if isinstance(triaged.outcome, End):
                self.records.append(AttemptRecord(number, nodes, attempt.ended, summary.headline, seconds,
                                                  triaged.found, triaged.outcome.message))
                self.emit(RecoveryEnded(triaged.outcome.message))
                return self._final(summary, triaged.outcome.message)
            following = triaged.outcome
            staged = self._stage(attempt, following)
            if self.stopping:  # during the staging: no attempt starts
                self.records.append(AttemptRecord(number, nodes, attempt.ended, summary.headline, seconds,
                                                  triaged.found, "interrupted"))
                self.emit(Interrupted())
                return self._final(summary, "interrupted")
            self.records.append(AttemptRecord(number, nodes, attempt.ended, summary.headline, seconds,
                                              triaged.found, self._described(number + 1, following) + staged))
            number, nodes = number + 1, following.nodes
            run = self._try_launch(number, nodes, later)

    def _try_launch(self, number: int, nodes: tuple[str, ...], options: LaunchOptions) -> Run | None:
        """The attempt's run; None when it could not start (its ``_finish`` says so)."""
        self._refused = None
        try:
            return self._launch(number, nodes, options)
        except UsageError:
            raise
        except TorchherdError as error:
            # LaunchAborted, or a scheduler that refused the submission (sbatch: SLURM's controller
            # busy, a node it no longer knows) or whose host did not answer: a failed
            # attempt, as the policy counts them, not the end of the run (but where the
            # scheduler could never place it: Unplaceable).
            self._refused = error
            return None

    def _never_placed(self) -> End | None:
        """The run's end when the scheduler refused the last attempt as one it could never
        place: without the nodes left out, the next one would be refused alike."""
        if not isinstance(self._refused, Unplaceable):
            return None
        without = f" without {', '.join(self.excluded)}" if self.excluded else ""
        return End("no node left", f"the scheduler cannot place the run{without} (it refused the attempt)")

    def _finish(self, run: Run | None, number: int, nodes: tuple[str, ...]) -> RunSummary:
        if run is not None:
            try:
                summary = run.wait()
            finally:
                if self._watch is not None:
                    self._watch.close()
                if self.replicator is not None:  # a copy from an attempt that ended is given up
                    self.replicator.pause()
            with self._lock:
                self._current = None
            return summary
        message = f"attempt {number} could not start: {self._refused}"
        return RunSummary(self.run_id, EXIT_FAILED, message, (), str(self.log_dir))

    def _hung(self, attempt: Attempt) -> Attempt:
        """The attempt as the hang watch saw it: hung, its culprit the node of the rank whose
        stack differs (when one does); the watch is done with."""
        watch, self._watch = self._watch, None
        if watch is None or watch.hung is None or (attempt.ended == "interrupted" and not watch.stopped):
            self._stacks = []
            return attempt
        stacks = merged(stacks_of(self._stacks), spy_stacks(watch.dumps))
        counts: dict[tuple[str, str], int] = {}
        for stack in stacks:
            counts[(stack.function, stack.where)] = counts.get((stack.function, stack.where), 0) + 1
        odd = [stack for stack in stacks if len(counts) > 1 and counts[(stack.function, stack.where)] == min(counts.values())]
        self._hang_text = f"hung: no rank printed a line or used CPU for {watch.timeout:g} s; {described(stacks)}"
        recorded, behind = flight_described(flight_issued(watch.flight))
        if recorded:
            self._hang_text += f"; {recorded}"
        if watch.dumps:
            self._hang_text += f" (py-spy: {self._save_dumps(attempt.number, watch.dumps)})"
        self._stacks = []
        return replace(attempt, ended="hung", culprit=odd[0].node if odd else behind, error=self._hang_text,
                       exit_code=None)

    def _save_dumps(self, number: int, dumps: Mapping[tuple[str, int], str]) -> Path:
        """py-spy's dumps of a hung attempt's ranks, in rank order, into a private file
        beside the node logs; its path."""
        path = self.log_dir / f"py-spy-attempt-{number}.txt"
        text = "".join(f"==== rank {rank} on {node}\n{dumps[(node, rank)].rstrip()}\n\n"
                       for node, rank in sorted(dumps, key=lambda key: key[1]))
        descriptor = log_dir(self.log_dir).open(path.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(text)
        return path

    def _headline(self, summary: RunSummary) -> str:
        text, self._hang_text = self._hang_text, ""
        return text or summary.headline

    def _final(self, summary: RunSummary, why: str | None) -> RunSummary:
        """The run's summary: the last attempt's nodes, every attempt, and why it ended."""
        headline = summary.headline
        code = summary.exit_code
        if why == "interrupted":
            code = EXIT_INTERRUPTED
            if summary.exit_code != EXIT_INTERRUPTED:  # stopped between two attempts
                headline = f"interrupted after attempt {len(self.records)}: no further attempt was started"
        elif why is not None:
            headline = f"{why}; attempt {len(self.records)}: {summary.headline}"
        elif len(self.records) > 1:
            headline = f"{summary.headline} (attempt {len(self.records)})"
        records = tuple(replace(record, warm=self.started_warm.get(record.number, ())) for record in self.records)
        return replace(summary, exit_code=code, headline=headline, attempts=records,
                       checkpoint=self.checkpoint_line() or None)

    def checkpoint_line(self) -> str:
        """Where the newest checkpoint is, as the summary says it ("newest checkpoint:
        snapshot.pt (...) on node0, node1"); empty without replication. A detached run's
        controller keeps it in the run record as it changes."""
        if self.replicator is None or self.holdings is None:
            return ""
        return self.holdings.line(self.lost)

    def _remove_lost_containers(self, summary: RunSummary) -> None:
        """The containers of the nodes lost in an attempt and not in the last one: their
        supervisor died with them, so the runtime still holds them wherever the node is back."""
        gone = ("lost", "unresponsive")
        kept = {outcome.node for outcome in summary.nodes if outcome.state not in gone}
        lost = [node for attempt in self.attempts for node in attempt.lost]
        lost += [outcome.node for outcome in summary.nodes if outcome.state in gone]
        lost = [node for node in lost if node not in kept]
        if not lost or not self.recovery.retries or self.picked is not None:
            return
        nodes = tuple(dict.fromkeys(lost))
        try:
            event = self.backend.remove_lost_containers(attempt_plan(self.plan, nodes, len(self.records)), nodes)
        except TorchherdError as error:  # the run's outcome stands; what may be left is named
            event = LostContainers((), tuple((node, container_name(self.run_id, node), "podman or docker", str(error))
                                             for node in nodes))
        if event is not None and (event.removed or event.left):
            self.emit(event)

    # triage ------------------------------------------------------------------------------
    def _check_spares(self) -> None:
        """The spares in the first preflight: the fast checks with the master; a spare that
        fails them is dropped (the run goes on without it)."""
        master = self.plan.nodes[0].host.name
        checked = (master, *self.spares)
        started = time.monotonic()
        report = self.backend.check(attempt_plan(self.plan, checked, 1),
                                    CheckOptions(only=self.backend.triage_checks), sync=self.plan.sync is not None)
        failed = {node: why for node, why in triage_failures(report.results, self.spares).items()}
        self.emit(TriageDone(checked, tuple(failed.items()), time.monotonic() - started))
        for spare, why in failed.items():
            self.spares.remove(spare)
            self._exclude(spare, f"spare dropped: {why}")
        self.torch_known.update((spare, "the first preflight") for spare in self.spares)

    def _learn(self, attempt: Attempt) -> None:
        """What the failed attempt proved of its nodes' torch (its ranks imported it where
        they got through the rendezvous; not on the node that failed first, nor a lost one),
        and what the spares' check in the background proved, if it is done."""
        for node in attempt.nodes:
            if node in self._running and node != attempt.culprit and node not in attempt.lost:
                self.torch_known[node] = f"attempt {attempt.number}'s ranks"
            else:
                self.torch_known.pop(node, None)
        checked = self._spares_checked
        if checked is None or not checked.done() or attempt.number > 1:
            return  # not done (the triage checks the spares in full: a failure is its to tell), or learnt
        try:
            results = checked.result().results
        except TorchherdError:
            return
        failed = triage_failures(results, self.spares)
        self.torch_known.update((spare, "a check while attempt 1 ran") for spare in self.spares
                                if spare not in failed and any(result.node == spare for result in results))

    def _triage(self, attempt: Attempt) -> _Triaged:
        """The fast checks on the next attempt's nodes (and the unchecked spares), round
        after round until one excludes nobody."""
        excluded: dict[str, str] = {}
        found: list[str] = []
        self._cool(attempt, excluded, found)
        if self.picked is not None:
            return self._triage_picked(attempt, excluded, found)
        self._learn(attempt)
        for node, why in known_lost(attempt, list(excluded), self.spares, self.recovery).items():
            excluded[node] = why
            found.append(f"{node}: {why}")
            self._exclude(node, why)
        for _ in range(TRIAGE_ROUNDS):
            if self.stopping:
                break
            proposal = next_nodes(attempt.nodes, list(excluded), self.spares, attempt.nodes[0], self.recovery)
            if isinstance(proposal, End):
                return _Triaged(proposal, tuple(found))
            checked = proposal.nodes + tuple(spare for spare in self.spares if spare not in proposal.nodes)
            started = time.monotonic()
            report = self._check_round(checked, attempt.number + 1)
            failed = triage_failures(report.results, checked)
            self.emit(TriageDone(checked, tuple(failed.items()), time.monotonic() - started))
            for node, why in failed.items():
                if why.startswith("ssh:"):
                    self.unreachable.add(node)
                excluded[node] = why
                found.append(f"{node}: {why}")
                if node in self.spares:
                    self.spares.remove(node)
                self._exclude(node, why)
            if not failed:
                return _Triaged(self._take(proposal, len(attempt.nodes)), tuple(found))
            settled = self._settled(attempt, list(excluded), checked, report.results)
            if settled is not None:
                return _Triaged(self._take(settled, len(attempt.nodes)), tuple(found))
        return _Triaged(End("no node left", f"the triage still excluded nodes after {TRIAGE_ROUNDS} rounds"),
                        tuple(found))

    def _check_round(self, checked: tuple[str, ...], number: int) -> CheckReport:
        """The fast checks on ``checked`` (its master first), all of them on every node; where
        torch ran lately (``torch_known``), its versions are read from its files, not imported."""
        known = tuple((node, self.torch_known[node]) for node in checked if node in self.torch_known)
        return self.backend.check(attempt_plan(self.plan, checked, number),
                                  CheckOptions(only=self.backend.triage_checks, torch_known=known))

    def _cool(self, attempt: Attempt, excluded: dict[str, str], found: list[str]) -> None:
        """Excludes the node whose ranks failed first in this attempt and the one before."""
        again = cooldown(attempt, self.attempts)
        if again is not None:
            excluded[again] = "its ranks failed first in two attempts in a row"
            self._exclude(again, excluded[again])
            found.append(f"{again}: {excluded[again]}")

    def _triage_picked(self, attempt: Attempt, excluded: dict[str, str], found: list[str]) -> _Triaged:
        """Where the scheduler picks the nodes: the checks on the nodes the attempt ran on
        (one round: the next attempt's are the scheduler's to pick, less every node
        excluded so far)."""
        if attempt.nodes and not self.stopping:
            started = time.monotonic()
            report = self.backend.check(named_plan(self.plan, attempt.nodes),
                                        CheckOptions(only=self.backend.triage_checks))
            failed = triage_failures(report.results, attempt.nodes)
            self.emit(TriageDone(attempt.nodes, tuple(failed.items()), time.monotonic() - started))
            for node, why in failed.items():
                if node not in excluded:
                    excluded[node] = why
                    found.append(f"{node}: {why}")
                    self._exclude(node, why)
        return _Triaged(NextNodes((), "", (), False), tuple(found))

    def _exclude(self, node: str, why: str) -> None:
        if node not in self.excluded:
            self.excluded.append(node)
        self.emit(NodeExcluded(node, why))

    def _settled(self, attempt: Attempt, excluded: list[str], checked: tuple[str, ...],
                 results: Sequence[CheckResult]) -> NextNodes | None:
        """The next nodes when this round already vouches for every one of them: all
        checked and passed, under the same master, no cross-node check left uncounted
        (so a lost worker costs one round, not two)."""
        following = next_nodes(attempt.nodes, excluded, self.spares, attempt.nodes[0], self.recovery)
        if (not isinstance(following, NextNodes) or following.master != checked[0]
                or not set(following.nodes) <= set(checked) - set(excluded) or doubtful(results, checked)):
            return None
        return following

    def _take(self, proposal: NextNodes, was: int) -> NextNodes:
        for spare, replacing in proposal.taken:
            self.spares.remove(spare)
            self.emit(SpareTaken(spare, replacing))
        if proposal.shrunk:
            self.emit(RunShrunk(len(proposal.nodes), was))
        return proposal


    def _stage(self, attempt: Attempt, following: NextNodes) -> str:
        """The checkpoint (``Recovery.checkpoint``) put on the next attempt's nodes that lack
        it, from the failed attempt's nodes still reached; what the summary's table says of it."""
        path = self.recovery.checkpoint
        self._resume = None
        if path is None or self.picked is not None or self.stopping:
            return ""
        sources = [node for node in attempt.nodes if node not in attempt.lost and node not in self.unreachable]
        everyone = tuple(dict.fromkeys([*following.nodes, *sources]))
        try:
            event = self.backend.stage_checkpoint(attempt_plan(self.plan, everyone, attempt.number + 1, self.networks),
                                                  sources, following.nodes, path, attempt.number + 1,
                                                  lambda: self.stopping)
        except TorchherdError as error:  # staging never ends a run: the job decides without its checkpoint
            event = CheckpointMissing(attempt.number + 1, f"{path} could not be staged: {error}")
        if self.holdings is not None and not isinstance(event, CheckpointMissing):
            self.holdings.staged(event)  # before the event: a detached run's record reads where it is then
        self._resume = resume_of(event, self.recovery, following.nodes)
        self.emit(event)
        if isinstance(event, CheckpointMissing):
            return f"; no checkpoint: {event.message}"
        where = f" to {','.join(event.nodes)}" if event.nodes else " (every node had it)"
        failed = f", not to {','.join(node for node, _ in event.failed)}" if event.failed else ""
        return f"; checkpoint {event.path} from {event.source}{where}{failed}"

    def _described(self, number: int, following: NextNodes) -> str:
        """The next attempt, for the summary's table."""
        if self.picked is not None:
            return f"attempt {number} on {self._picking()}"
        return _described(number, following)


def _described(number: int, following: NextNodes) -> str:
    taken = "".join(f"; {spare} for {replacing}" for spare, replacing in following.taken)
    shrunk = f"; {len(following.nodes)} nodes" if following.shrunk else ""
    return f"attempt {number} on {','.join(following.nodes)}{taken}{shrunk}"


def _in_background(check: Callable[..., CheckReport], plan: Plan, options: CheckOptions) -> Future[CheckReport]:
    """``check(plan, options)`` in a thread of its own; its future."""
    future: Future[CheckReport] = Future()

    def run() -> None:
        try:
            future.set_result(check(plan, options))
        except BaseException as error:  # the future holds it: the triage decides what it means
            future.set_exception(error)

    threading.Thread(target=run, name="torchherd-spares-check", daemon=True).start()
    return future
