"""From a plan to a running job: preflight the plan (``engine.ssh.preflight``, or just
connect), start it on every node, and hand back a ``Run`` to wait on, stop, or read lines from.

The plan is built once (``plan.build_plan``); the preflight verifies that very plan,
and the launch executes it with the addresses the preflight found on the nodes
(``Plan.with_networks``). Everything is reported to an observer as typed events;
nothing here prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from torchherd.checks import CheckOptions
from torchherd.engine.bookkeeping import max_rank
from torchherd.engine.events import ConnectFailed, Observer, PreflightDone, RunStarted, ignore
from torchherd.engine.prepare.pull import pull_images, pulled_nodes
from torchherd.engine.prepare.sync import sync_nodes
from torchherd.engine.run import LaunchAborted, LaunchOptions, Run, RunEvents
from torchherd.engine.ssh.preflight import preflight
from torchherd.inventory import Host
from torchherd.plan import Plan
from torchherd.transport import Connector, Session, close_all, connect_all
from torchherd.words import count

# opening the nodes ------------------------------------------------------------------


@dataclass
class Opened:
    """The plan as it will run (networks found by the preflight) and a session per node."""

    plan: Plan
    sessions: Mapping[str, Session]
    _close: Callable[[], None] = field(repr=False, default=lambda: None)

    def close(self) -> None:
        self._close()


def open_nodes(plan: Plan, options: LaunchOptions, connector: Connector, observer: Observer) -> Opened:
    """Preflights the plan (or just connects); raises LaunchAborted when a node failed.
    With ``plan.sync`` the project is made identical on every node first, so the
    preflight checks the files the job will run."""
    if plan.sync is not None:
        connector = sync_first(plan, connector, observer, options.log_dir)
    # The archive first: an air-gapped node then has the image a "missing" pull looks for.
    if any(node.host.container is not None and node.host.container.archive is not None for node in plan.nodes):
        connector = images_first(plan, connector, observer)
    if pulled_nodes(plan):
        connector = pull_first(plan, connector, observer)
    if options.check:
        return _after_preflight(plan, connector, observer, options)
    return _connect(plan, connector, observer)


def pull_first(plan: Plan, connector: Connector, observer: Observer) -> Connector:
    """Connects to every node and pulls the image on those with a pull policy, all at once
    (``engine.prepare.pull``), before the preflight compares the images' ids; returns a connector
    that hands the preflight and the launch the very same sessions. Raises LaunchAborted
    (the sessions closed) when a node could not be reached or could not pull."""
    opened = _connect(plan, connector, observer)
    try:
        done = pull_images(plan, dict(opened.sessions), observer)
    except BaseException:
        opened.close()
        raise
    if done is not None and done.failed:
        opened.close()
        images = sorted({failed.image for failed in done.failed})
        raise LaunchAborted(f"the image could not be pulled on {len(done.failed)} of "
                            f"{count(len(done.nodes), 'node')} ({', '.join(images)})")
    return _Reusing(opened.sessions, connector)


def sync_first(plan: Plan, connector: Connector, observer: Observer, log_dir: Path | None = None) -> Connector:
    """Connects to every node and syncs the project over those sessions (never ``log_dir``),
    and builds a uv-locked project's venv there (``engine.prepare.venvs``); returns a connector that
    hands the preflight and the launch the very same sessions. Raises LaunchAborted (the
    sessions closed) when a node could not be reached or synced."""
    opened = _connect(plan, connector, observer)
    try:
        done = sync_nodes(plan, opened.sessions, observer, log_dir=log_dir)
        if done.ok and any(node.venv is not None for node in plan.nodes):
            # The project's lock is on every node now: its venv is built before the
            # preflight, which checks the job's python (the venv's) and the venv itself.
            from torchherd.engine.prepare.venvs import build_venvs  # packaging's markers: only here

            venvs = build_venvs(plan, opened.sessions, observer)
            if not venvs.ok:
                raise LaunchAborted(f"the locked environment could not be built on {len(venvs.failed)} of "
                                    f"{count(len(plan.nodes), 'node')}")
    except BaseException:
        opened.close()
        raise
    if not done.ok:
        opened.close()
        raise LaunchAborted(f"the project is not in sync on {len(done.failed)} of {count(len(plan.nodes), 'node')}")
    return _Reusing(opened.sessions, connector)


def images_first(plan: Plan, connector: Connector, observer: Observer) -> Connector:
    """Loads ``--image-archive`` on every node that lacks the image (``engine.prepare.images``), so
    the preflight's ``container`` check and the launch find it there; returns a connector
    that hands them the same sessions. Raises LaunchAborted (the sessions closed) when a
    node could not be reached or could not load it."""
    from torchherd.engine.prepare.images import stage_archives

    opened = _connect(plan, connector, observer)
    try:
        done = stage_archives(plan.nodes, opened.sessions, observer)
    except BaseException:
        opened.close()
        raise
    failed = sorted({name for archive in done for name, _ in archive.failed})
    if failed:
        opened.close()
        raise LaunchAborted(f"the image could not be loaded from the archive on {len(failed)} of "
                            f"{count(len(plan.nodes), 'node')}")
    return _Reusing(opened.sessions, connector)


@dataclass(frozen=True)
class _Reusing:
    """A connector that gives out sessions already open (the sync's), else connects."""

    sessions: Mapping[str, Session]
    fallback: Connector

    def connect(self, host: Host) -> Session:
        session = self.sessions.get(host.name)
        return session if session is not None else self.fallback.connect(host)


def _connect(plan: Plan, connector: Connector, observer: Observer,
             already: Mapping[str, Session] | None = None) -> Opened:
    already = already or {}
    missing = [node.host for node in plan.nodes if node.host.name not in already]
    results = connect_all(connector, missing)
    sessions = {**already, **results.succeeded}
    failures = tuple(results.failed.values())
    if failures:
        for error in failures:
            observer(ConnectFailed(error))
        close_all(sessions.values())
        raise LaunchAborted(f"{len(failures)} of {count(len(plan.nodes), 'node')} could not be reached", errors=failures)
    return Opened(plan, sessions, lambda: close_all(sessions.values()))


def _after_preflight(plan: Plan, connector: Connector, observer: Observer, options: LaunchOptions) -> Opened:
    only = options.only
    from torchherd.engine.ssh.imports import imported_on

    # torchrun imports torch on every node moments later: where a check already imported
    # this very install there, the preflight reads its versions from its files.
    outcome = preflight(plan, CheckOptions(only=only, skip=options.skip, smoke=only is not None and "smoke" in only,
                                           torch_imported=imported_on(plan.inventory.hosts)),
                        connector)
    observer(PreflightDone(outcome.report))
    if not outcome.report.ok:
        outcome.close()
        raise LaunchAborted("the preflight checks failed", report=outcome.report)
    try:
        # A node the checks did not keep a session to (none today) is connected now.
        return _connect(plan.with_networks(outcome.networks), connector, observer, outcome.connections)
    except BaseException:
        outcome.close()
        raise


# the run ------------------------------------------------------------------------------


def launch(plan: Plan, options: LaunchOptions, connector: Connector, observer: Observer = ignore) -> Run:
    """Preflights ``plan`` (unless ``options.check`` is off), starts it on every node and
    returns the running ``Run``. Raises LaunchAborted when it could not start."""
    opened = open_nodes(plan, options, connector, observer)
    from torchherd.engine.ssh.job import Job

    try:
        started = opened.plan if options.started_as is None else options.started_as(opened.plan)
    except BaseException:
        opened.close()
        raise
    events = RunEvents(observer)
    job = Job(started, opened.sessions, options, events)
    run = Run(job, events, opened.close)
    observer(RunStarted(plan.run_id, tuple(node.host.name for node in plan.nodes), plan.master,
                        opened.plan.master_addr, plan.port, str(job.log_dir), max_rank(plan)))
    try:
        job.start_all()
    except KeyboardInterrupt:
        job.interrupt()
    run.start()
    return run
