"""The public Python API: what ``import torchherd`` gives, and what the CLI itself calls.

    cluster = torchherd.Cluster.from_toml("hosts.toml")
    report = cluster.check(script="train.py")                      # report.ok, report.results
    plan = cluster.plan("train.py", "--lr", "3e-4", nproc_per_node=2)
    run = cluster.launch(plan, log_dir="logs", on_event=print)      # preflight, then start
    summary = run.wait()                                           # summary.exit_code, .nodes

Nothing here prints or imports rich: a library user sees events (``on_event``) and
results; the CLI renders the same events with its console.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Literal, Mapping, Sequence, TypeVar, overload

from torchherd.checks import CheckOptions
from torchherd.checks.model import CHECK_IDS, Mesh
from torchherd.checks.results import CheckReport, CheckResult
from torchherd.engine import schedulers
from torchherd.engine.backend import Backend, Description, backend_class, backend_for, backend_of
from torchherd.engine.observer import ignore
from torchherd.errors import UsageError
from torchherd.inventory import (
    HEARTBEAT_HINT,
    Inventory,
    Recovery,
    heartbeat_problem,
    hostspec,
    load,
    parse,
    with_container,
    with_spares,
)
from torchherd.inventory.nodeset import NodesetError, expand
from torchherd.inventory.options import (
    GRACE,
    STRAGGLER_WINDOW,
    UV,
    UV_OFFLINE,
    UV_SYSTEM_SITE_PACKAGES,
    OptionError,
    checked_recovery,
    given_fields,
    recovery_problem,
)
from torchherd.plan import Plan, RunOptions, SyncOptions, UvOptions, build_plan
from torchherd.remote.uvlock import UV_FILES
from torchherd.transport import Connector
from torchherd.transport.ssh import SshConnector

if TYPE_CHECKING:  # a run's own: `check` never loads them (issue 43)
    from torchherd.engine.eventlog import HistoryRecorder, Recorded
    from torchherd.engine.events import Event, Observer, SyncDone
    from torchherd.engine.records import AttachedStatus, NodeState, RecoveryStatus, RunRecord
    from torchherd.engine.recovery.runner import RecoveringRun
    from torchherd.engine.run import DetachedStartFailed, LaunchAborted, LaunchOptions, Run
    from torchherd.runlog import OutputLine

RunT = TypeVar("RunT", "Run", "RecoveringRun")

_RUN_NAMES = {"Run": "torchherd.engine.run", "LaunchAborted": "torchherd.engine.run",
              "DetachedStartFailed": "torchherd.engine.run", "RecoveringRun": "torchherd.engine.recovery.runner"}


def __getattr__(name: str) -> Any:
    """The run's classes this module exports, loaded on first use: ``check`` never needs them."""
    if name in _RUN_NAMES:
        import importlib

        return getattr(importlib.import_module(_RUN_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["Cluster", "DetachedRun", "DetachedStartFailed", "LaunchAborted", "RecoveringRun", "Recovery", "Run", "attach",
           "damaged_runs", "new_run_id", "runs"]


def new_run_id() -> str:
    """``th-<date>-<time>-<6 hex>``: sortable, and unique across laptops."""
    return time.strftime("th-%Y%m%d-%H%M%S-") + secrets.token_hex(3)


class Cluster:
    """A set of nodes and how to reach them: an inventory, plus the way to connect.

    ``Cluster(hosts=["node0", {"name": "node1", "address": "10.0.0.2"}], python="/opt/venv/bin/python",
    nproc_per_node=2)``: hosts are names or tables of the inventory's host keys, ``defaults``
    the ``[defaults]`` table, a keyword named after a scheduler with a table of its own that
    table (``engine.schedulers.TABLES``), any other keyword a ``[cluster]`` or ``[defaults]``
    key; every value is validated as the TOML inventory's is.
    """

    def __init__(self, hosts: Sequence[str | Mapping[str, Any]] = (), *, inventory: Inventory | None = None,
                 defaults: Mapping[str, Any] | None = None, connector: Connector | None = None,
                 accept_new_host_keys: bool = False, **keys: Any) -> None:
        if inventory is None:
            inventory = parse(_document(hosts, defaults, keys), Path("<torchherd.Cluster>"), schedulers.known())
        elif hosts or defaults or any(key not in schedulers.TABLES or value is not None for key, value in keys.items()):
            raise UsageError("Cluster: give either an inventory or hosts and keys, not both")
        self.inventory = inventory
        self.accept_new_host_keys = accept_new_host_keys
        self.connector: Connector = connector or SshConnector(
            inventory.cluster.ssh_config, inventory.cluster.ssh_timeout, accept_new_host_keys)
        self.backend: Backend = backend_for(inventory.cluster.scheduler, self.connector)
        """Who starts the job: chosen here, once, from the inventory's scheduler."""

    @classmethod
    def from_toml(cls, path: str | Path, *, connector: Connector | None = None,
                  accept_new_host_keys: bool = False) -> Cluster:
        """The cluster a TOML inventory describes (``torchherd init --example`` writes one, every key explained)."""
        return cls(inventory=load(Path(path).expanduser(), schedulers.known()), connector=connector,
                   accept_new_host_keys=accept_new_host_keys)

    @classmethod
    def from_hosts(cls, hosts: str | Sequence[str], *, python: str | None = None, workdir: str | None = None,
                   nproc_per_node: int | str | None = None, master: str | None = None,
                   connector: Connector | None = None, accept_new_host_keys: bool = False) -> Cluster:
        """The cluster of hosts given as ``-H`` takes them, without an inventory file:
        ``Cluster.from_hosts("node0,ubuntu@node1:2222,gpu[01-04]", python="/opt/venv/bin/python")``
        (or a list of such items). The first host is the master unless ``master`` says."""
        text = hosts if isinstance(hosts, str) else ",".join(hosts)
        document = hostspec.document(hostspec.host_items(text), python=python, workdir=workdir,
                                     nproc_per_node=nproc_per_node, master=master)
        return cls(inventory=parse(document, Path("-H"), schedulers.known()), connector=connector,
                   accept_new_host_keys=accept_new_host_keys)

    @classmethod
    def from_nodelist(cls, nodelist: str, *, python: str | None = None, workdir: str | None = None,
                      nproc_per_node: int | str | None = None, master: str | None = None,
                      connector: Connector | None = None, accept_new_host_keys: bool = False) -> Cluster:
        """The hosts of a SLURM nodelist string (``gpu[01-04],cpu1``)."""
        document = hostspec.document(hostspec.nodelist_items(nodelist), python=python, workdir=workdir,
                                     nproc_per_node=nproc_per_node, master=master, flag="--nodelist")
        return cls(inventory=parse(document, Path("--nodelist"), schedulers.known()), connector=connector,
                   accept_new_host_keys=accept_new_host_keys)

    @classmethod
    def from_file(cls, path: str | Path, *, python: str | None = None, workdir: str | None = None,
                  nproc_per_node: int | str | None = None, master: str | None = None,
                  connector: Connector | None = None, accept_new_host_keys: bool = False) -> Cluster:
        """A TOML inventory, or a DeepSpeed/MPI hostfile (``worker-1 slots=4``: slots is the
        host's nproc_per_node). The keywords override the file for every host."""
        inventory = hostspec.load_any(Path(path).expanduser(), schedulers.known(), python=python, workdir=workdir,
                                      nproc_per_node=nproc_per_node, master=master)
        return cls(inventory=inventory, connector=connector, accept_new_host_keys=accept_new_host_keys)

    def select(self, include: str | None = None, exclude: str | None = None) -> Cluster:
        """The same cluster with only the hosts ``include`` names, less those ``exclude``
        names (names, nodesets or globs, comma-separated). A master left out gives way to
        the first host left."""
        return self._with(hostspec.select(self.inventory, include, exclude))

    def override(self, *, python: str | None = None, workdir: str | None = None,
                 nproc_per_node: int | str | None = None, master: str | None = None,
                 port: int | None = None, ssh_timeout: float | None = None) -> Cluster:
        """The same cluster with every host's python, workdir or process count, or another
        master, master port (``[cluster].port``, ``--master-port``) or SSH timeout."""
        return self._with(hostspec.override(self.inventory, python=python, workdir=workdir,
                                            nproc_per_node=nproc_per_node, master=master, port=port,
                                            ssh_timeout=ssh_timeout))

    def with_container(self, image: str | None = None, *, runtime: str | None = None,
                       mounts: Sequence[str] | None = None, options: Sequence[str] | None = None,
                       pull: str | None = None, archive: str | Path | None = None,
                       where: str = "with_container") -> Cluster:
        """The same cluster with every host's job inside ``image`` (``--image``): the keys
        of ``[container]``, over the inventory's own; ``where`` names them in errors ("" for
        the command line's flags). ``archive`` (``--image-archive``): a ``docker save`` tar
        of the image here, relayed node to node and loaded where the image is missing
        before the launch (`torchherd docs containers`)."""
        table = {key: list(value) if isinstance(value, (list, tuple)) else value
                 for key, value in (("image", image), ("runtime", runtime), ("mounts", mounts), ("options", options),
                                    ("pull", pull), ("archive", None if archive is None else str(archive)))
                 if value is not None}
        if not table:
            return self
        return self._with(with_container(self.inventory, table, where))

    def with_spares(self, spares: str) -> Cluster:
        """The same cluster with the hosts ``spares`` names (a nodeset: ``node[4-5]``) set
        aside as spare hosts: checked, not launched, until a run with retries needs one."""
        try:
            names = frozenset(expand(spares))
        except NodesetError as error:
            raise UsageError(f"--spares {spares!r}: {error}", "write host names or a nodeset: node4,gpu[05-06]") from None
        return self._with(with_spares(self.inventory, names))

    @property
    def spares(self) -> tuple[str, ...]:
        return tuple(host.name for host in self.inventory.spares)

    @property
    def recovery(self) -> Recovery:
        """The inventory's ``[recovery]`` table (no retries without one)."""
        return self.inventory.recovery

    def _with(self, inventory: Inventory) -> Cluster:
        if inventory is self.inventory:
            return self
        return Cluster(inventory=inventory, connector=self._connector_for(inventory),
                       accept_new_host_keys=self.accept_new_host_keys)

    def _connector_for(self, inventory: Inventory) -> Connector:
        """This cluster's connector, following ``inventory``'s SSH settings: an SSH
        connector keeps the timeout and ssh_config it was built with, so an override
        (``--ssh-timeout``) that left it would bound nothing."""
        connector, cluster = self.connector, inventory.cluster
        if isinstance(connector, SshConnector) and (connector.timeout, connector.ssh_config) != (
                cluster.ssh_timeout, cluster.ssh_config):
            return replace(connector, timeout=cluster.ssh_timeout, ssh_config=cluster.ssh_config)
        return connector

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(host.name for host in self.inventory.hosts)

    @property
    def scheduler(self) -> str:
        """Who starts the nodes: "ssh" (torchherd itself) or another of ``engine.schedulers``
        (``[cluster].scheduler``)."""
        return self.inventory.cluster.scheduler

    def using(self, scheduler: str | None = None, **tables: Mapping[str, Any] | None) -> Cluster:
        """The same cluster with another scheduler and its own table's keys (a keyword named
        after the scheduler: the command line's ``--scheduler`` and ``--NAME-KEY``), validated
        as the file's are."""
        inventory = self.inventory
        if scheduler is not None:
            if scheduler not in schedulers.names():
                raise UsageError(f"--scheduler {scheduler!r}: expected one of {', '.join(schedulers.names())}")
            inventory = replace(inventory, cluster=replace(inventory.cluster, scheduler=scheduler))
        known = schedulers.known()
        for name, keys in tables.items():
            table = known.table(name)
            if table is None:
                raise UsageError(f"Cluster.using: {name}: no scheduler has such a table",
                                 f"one of: {', '.join(table.name for table in known.tables)}")
            given = {key: value for key, value in (keys or {}).items() if value is not None}
            if not given:
                continue
            if inventory.cluster.scheduler != name:
                flag = f"--{name}-" + next(iter(given)).replace("_", "-")
                raise UsageError(f"{flag}: only for {table.title} runs",
                                 f'add --scheduler {name}, or set scheduler = "{name}" in [cluster]')
            parsed = table.parse(given, Path("command line"), f"--{name}-")
            current = inventory.table(name) or table.parse({}, inventory.path, f"[{name}].")
            inventory = inventory.with_table(name, current.updated(parsed, tuple(key for key in table.keys
                                                                                 if key in given)))
        return self._with(inventory)

    def batch_script(self, plan: Plan, *, fail_fast: bool = True) -> Description:
        """The batch script ``plan`` becomes (what ``run --dry-run`` prints for the scheduler
        that takes one: ``engine.schedulers.BATCH_SCRIPT``)."""
        return backend_class(schedulers.BATCH_SCRIPT).script(plan, fail_fast=fail_fast)

    def describe(self, plan: Plan, *, fail_fast: bool = True) -> Description:
        """What ``run --dry-run`` prints: ``plan`` itself (SSH), or its batch script (SLURM)."""
        return self.backend.describe(plan, fail_fast=fail_fast)

    def plan(self, script: str, *args: str, nproc_per_node: int | str | None = None,
             env: Mapping[str, str] | None = None, master_addr: str | None = None, nnodes: str | None = None,
             module: bool = False, rdzv_backend: str | None = None, rdzv_conf: str | None = None,
             max_restarts: int = 0, monitor_interval: float | None = None, run_id: str | None = None,
             sync: bool | str | Path | None = None, sync_include: Iterable[str] = (),
             sync_anyway: bool = False, uv: bool | None = None, uv_system_site_packages: bool = False,
             uv_offline: bool | None = None) -> Plan:
        """The job, decided: every node's exact torchrun command and environment (what
        ``--dry-run`` prints). Raises UsageError for options that cannot work together.
        ``sync``: the local project to make identical on every node before the launch (True:
        ``[sync].dir``, else the enclosing git repository, else the current directory; a
        directory; False: not even with a ``[sync]`` table); the job then runs there.
        ``sync_include``: patterns sent although the private defaults leave them out
        (``.env``); ``sync_anyway``: send a home directory, or a large directory outside
        git, which is otherwise refused (UsageError).
        ``uv``: run the job in a venv built on every node from the synced project's uv.lock
        (None: when the project has pyproject.toml and uv.lock; True: it must; False: never);
        ``uv_system_site_packages``: that venv also sees the node python's own packages;
        ``uv_offline``: a node that must build its venv gets the lock's wheels from this
        machine, relayed node to node, and builds with no network (None: ``[uv] offline``)."""
        synced = self._sync_options(sync, tuple(sync_include), sync_anyway)
        options = RunOptions(script=script, script_args=tuple(args), run_id=run_id or new_run_id(),
                             nproc_per_node=nproc_per_node, nnodes=nnodes, module=module,
                             extra_env=dict(env or {}), master_addr=master_addr, max_restarts=max_restarts,
                             monitor_interval=monitor_interval, rdzv_conf=rdzv_conf, rdzv_backend=rdzv_backend,
                             sync=synced, uv=_uv_options(synced, uv, uv_system_site_packages,
                                                         self.inventory.uv.offline if uv_offline is None
                                                         else uv_offline, uv_offline is True))
        return build_plan(self.inventory, options, ssh_hostnames=self._ssh_hostnames())

    def _ssh_hostnames(self) -> dict[str, str]:
        """What the ssh_config makes of each host's address (an alias's HostName), for the
        master address the workers are told: they cannot resolve the controller's aliases."""
        return self.backend.ssh_hostnames(self.inventory.hosts)

    def check(self, script: str | None = None, *, plan: Plan | None = None, only: Iterable[str] | None = None,
              skip: Iterable[str] = (), smoke: bool = False, mesh: Mesh = "auto",
              on_result: Callable[[CheckResult], None] | None = None, sync: bool | str | Path | None = None,
              on_event: Observer | None = None, bandwidth: bool = False,
              min_bandwidth: float | None = None, sync_include: Iterable[str] = (),
              sync_anyway: bool = False, uv: bool | None = None,
              uv_system_site_packages: bool = False, uv_offline: bool | None = None,
              gpu_diag: bool = False) -> CheckReport:
        """The preflight checks, changing nothing on the nodes. They verify ``plan`` when
        given (its master address, port, processes per node, script, environment), else the
        plan of a default run of ``script``. With ``sync`` the project is first made
        identical on the nodes (its events to ``on_event``; LaunchAborted if it fails). With
        ``bandwidth`` (or ``smoke``) the links' throughput and path MTU are measured too;
        ``min_bandwidth`` (bits per second) overrides the inventory's floor. ``sync_include``,
        ``sync_anyway``, ``uv``, ``uv_system_site_packages`` and ``uv_offline``: as for ``plan``; with ``sync``
        a uv-locked project's venv is built (or found built) first, then checked against the lock.
        ``gpu_diag``: DCGM's level-1 diagnostic on every node that has DCGM (a minute or so)."""
        options = CheckOptions(only=frozenset(only) if only is not None else None, skip=frozenset(skip), smoke=smoke,
                               mesh=mesh, bandwidth=bandwidth, min_bandwidth=min_bandwidth,
                               gpu_diag=gpu_diag)
        plan = plan or self.plan(script or "", run_id="check", sync=sync, sync_include=sync_include,
                                 sync_anyway=sync_anyway, uv=uv, uv_system_site_packages=uv_system_site_packages,
                                 uv_offline=uv_offline)
        report = self.backend.check(plan, options, sync=bool(sync), on_result=on_result, on_event=on_event or ignore)
        if report.bandwidth is not None:  # kept: a run's replication takes its share of the link as measured
            from torchherd.engine.records.links import keep_links

            keep_links(report.bandwidth, {node.host.name: node.host.address for node in plan.nodes})
        return report

    def sync(self, source: bool | str | Path = True, *, plan: Plan | None = None, dry_run: bool = False,
             on_event: Observer | None = None, include: Iterable[str] = (), anyway: bool = False,
             log_dir: str | Path = "torchherd-logs") -> SyncDone:
        """Makes the local project (``source``: a directory, or True for ``[sync].dir``, else
        the enclosing git repository, else the current directory) identical on every node,
        or with ``dry_run`` says per node what would be sent and deleted. ``plan`` (one made
        with ``sync``) gives the destinations; else ``include`` and ``anyway`` are ``plan``'s
        ``sync_include`` and ``sync_anyway``. ``log_dir`` (``launch``'s) is never sent. A
        ``SyncDone``: ``.ok``, per node ``NodeSynced`` or ``SyncFailed``. ``launch`` of a plan
        made with ``sync`` does this itself."""
        plan = plan or self.plan("", run_id="sync", sync=source, sync_include=include, sync_anyway=anyway)
        if plan.sync is None:
            raise UsageError("sync: the plan has nothing to sync", "make it with plan(..., sync=True)")
        from torchherd.engine.prepare.sync import sync_over

        return sync_over(plan, self.connector, on_event or ignore, dry_run, Path(log_dir))

    def _sync_options(self, sync: bool | str | Path | None, include: tuple[str, ...],
                      anyway: bool) -> SyncOptions | None:
        """``--sync [DIR]``, with the inventory's ``[sync]`` table: None when there is nothing
        to sync. A home directory, or a large directory outside git, is refused unless ``anyway``."""
        table = self.inventory.sync
        if sync is False or (sync is None and table is None):
            return None
        chosen = (table.dir if table is not None else None) if sync is None or sync is True else Path(sync)
        from torchherd.tree import project_root, refusal

        source = Path(chosen).expanduser() if chosen is not None else project_root(Path.cwd())
        if not source.is_dir():
            raise UsageError(f"--sync {chosen}: not a directory",
                             "write --sync DIR -- train.py, or --sync -- train.py for the enclosing git repository")
        exclude = table.exclude if table else ()
        include = (table.include if table else ()) + include
        if not anyway:
            why = refusal(source, exclude, include, home=Path.home())
            if why is not None:
                raise UsageError(f"--sync: {why}", "to send it on purpose add --sync-anyway; "
                                 "else name the project: --sync DIR (a git repository's .gitignore is honoured)")
        return SyncOptions(str(source.resolve()), table.dest if table else None, exclude, include)

    @overload
    def launch(self, plan: Plan, *, log_dir: str | Path = ..., on_event: Observer | None = ...,
               check: bool = ..., only: Iterable[str] | None = ..., skip: Iterable[str] = ...,
               grace: float | None = ..., fail_fast: bool = ...,
               detach: Literal[True], recovery: Recovery | None = ...,
               straggler_window: float | None = ...) -> DetachedRun: ...

    @overload
    def launch(self, plan: Plan, *, log_dir: str | Path = ..., on_event: Observer | None = ...,
               check: bool = ..., only: Iterable[str] | None = ..., skip: Iterable[str] = ...,
               grace: float | None = ..., fail_fast: bool = ...,
               detach: Literal[False] = ..., recovery: Recovery | None = ...,
               straggler_window: float | None = ...) -> Run | RecoveringRun: ...

    @overload
    def launch(self, plan: Plan, *, log_dir: str | Path = ..., on_event: Observer | None = ...,
               check: bool = ..., only: Iterable[str] | None = ..., skip: Iterable[str] = ...,
               grace: float | None = ..., fail_fast: bool = ...,
               detach: bool = ..., recovery: Recovery | None = ...,
               straggler_window: float | None = ...) -> Run | DetachedRun | RecoveringRun: ...

    def launch(self, plan: Plan, *, log_dir: str | Path = "torchherd-logs", on_event: Observer | None = None,
               check: bool = True, only: Iterable[str] | None = None, skip: Iterable[str] = (),
               grace: float | None = None, fail_fast: bool = True,
               detach: bool = False, recovery: Recovery | None = None,
               straggler_window: float | None = None) -> Run | DetachedRun | RecoveringRun:
        """Preflights ``plan`` (``check=False`` only connects; ``only``/``skip``: the check ids
        the preflight runs or leaves out, as ``check`` takes them; SSH only), then starts it on every node.
        Attached: returns the ``Run`` (``wait``, ``stop``, ``lines``); its lines also go to
        ``log_dir/<run id>/<node>.log``. With ``detach``: the job outlives this process;
        returns a ``DetachedRun``. ``grace``: seconds from SIGTERM to SIGKILL (None: 10;
        SLURM refuses any, its KillWait decides). Raises LaunchAborted when it could not start.
        ``recovery`` (default: the inventory's ``[recovery]``) with ``retries`` > 0: a failed
        attempt is followed by triage and another, on the spares where nodes were excluded;
        returns a ``RecoveringRun`` (``wait``, ``stop``; ``summary.attempts``). With both
        (SSH or SLURM): the recovering controller runs in the background on this machine and
        outlives this process; returns a ``DetachedRun`` (``recovery()``: the attempts).
        ``straggler_window``: seconds over which each node's progress is judged for the
        straggler the summary names (None: 30; at least 10)."""
        from torchherd.engine.eventlog import HistoryRecorder, recording
        from torchherd.engine.events import EventsNotKept
        from torchherd.engine.recovery.background import start_background
        from torchherd.engine.recovery.runner import RecoveringRun
        from torchherd.engine.run import LaunchOptions

        picked, left_out = None if only is None else frozenset(only), frozenset(skip)
        self.backend.allow("--only", picked is not None and check)
        self.backend.allow("--skip", bool(left_out) and check)
        unknown = sorted(((picked or frozenset()) | left_out) - set(CHECK_IDS))
        if unknown:  # before the sync and the connections, not after them
            raise UsageError(f"unknown check id {', '.join(unknown)}", f"known ids: {', '.join(CHECK_IDS)}")
        if grace is not None:
            GRACE.from_argument(grace)
        if straggler_window is not None:
            STRAGGLER_WINDOW.from_argument(straggler_window)
        if recovery is not None:  # the file's [recovery] was checked as the file was read
            checked = checked_recovery(recovery)  # the error names the value as given (one string, say)
            given = given_fields(checked, self.recovery)
            # A scheduler that cannot honour them says so first (the rule would ask for a checkpoint it refuses).
            self.backend.allow("--resume-args", bool(checked.resume_args and ("resume_args" in given or checked.retries)))
            needs = recovery_problem(recovery, given, "argument", detached=detach)
            if needs is not None:
                raise needs
            recovery = checked
        recovery = recovery if recovery is not None else self.recovery
        problem = heartbeat_problem(recovery)
        if problem is not None:
            raise UsageError(f"recovery: {problem}", HEARTBEAT_HINT)
        options = LaunchOptions(check=check, only=picked, skip=left_out, log_dir=Path(log_dir), grace=grace,
                                fail_fast=fail_fast, heartbeat=recovery.heartbeat,
                                heartbeat_misses=recovery.heartbeat_misses, straggler_window=straggler_window,
                                warm_start=recovery.warm and recovery.hang_timeout is None)
        told = on_event or ignore
        history = HistoryRecorder(failed=lambda reason: told(EventsNotKept(reason)))
        observer = recording(told, history)
        # A detached run that replicates keeps a controller in the background for the copies,
        # with retries or without (then it makes no new attempt: it copies while the job runs).
        if recovery.retries > 0 or recovery.hang_timeout is not None or (detach and recovery.replicas > 0):
            with _named_as_arguments():
                self.backend.allow_recovery(plan, recovery)
                if not detach:
                    recovering = RecoveringRun(self.backend, plan, options, recovery, observer).start()
                    return _remembered(recovering, plan, options, observer)
                record = start_background(self.backend, plan, options, recovery, observer)
                _kept_before(history, options.log_dir / plan.run_id)  # the preflight; the controller appends the rest
                return DetachedRun(record, self.connector)
        if detach:
            if straggler_window is not None:
                raise UsageError("--straggler-window with a plain --detach: no controller stays to judge the straggler",
                                 "leave it out, or add --retries N (its controller stays in the background)")
            return DetachedRun(self.backend.start_detached(plan, options, observer), self.connector)
        run = None
        if recovery.warm:
            from torchherd.engine.recovery.runner import launch_warm

            run = launch_warm(self.backend, plan, options, observer)
        if run is None:
            run = self.backend.launch(plan, options, observer)
        return _remembered(run, plan, options, run.report)


def _kept_before(history: HistoryRecorder, directory: Path) -> None:
    """What the foreground recorded before the background controller took the run over."""
    history.keep_in(directory)
    history.close()


@contextmanager
def _named_as_arguments() -> Iterator[None]:
    """The engine names a value it refuses by its flag, for its own callers; a ``Cluster``
    caller passed it as an argument (``Recovery(min_nodes=9)``), and is told so."""
    try:
        yield
    except OptionError as error:
        if error.final:
            raise
        raise error.as_argument() from None


def _remembered(run: RunT, plan: Plan, options: LaunchOptions, report: Observer) -> RunT:
    """An attached run, its job started, in the run history (``status``, ``logs``) until
    the history prunes it; a state directory that cannot be written is said (``report``),
    and the run goes on: its job is running already."""
    from torchherd.engine.events import HistoryNotKept
    from torchherd.engine.records import runs_dir
    from torchherd.engine.records.history import History

    try:
        history = History.start(plan, options.log_dir, options.stop_grace)
    except OSError as error:
        report(HistoryNotKept(f"{error.filename or runs_dir()}: {error.strerror}"))
        return run
    run.when_done(history.ended)
    return run


def _uv_options(sync: SyncOptions | None, uv: bool | None, system_site_packages: bool, offline: bool = False,
                asked_offline: bool = False) -> UvOptions | None:
    """A uv-locked project's options: the synced project's lock, hashed here. ``offline``
    from the inventory alone (not ``asked_offline``) is no error where no venv is built.
    Errors name the arguments (the CLI names its flags: ``OptionError``)."""
    asked = UV if uv else UV_SYSTEM_SITE_PACKAGES if system_site_packages else UV_OFFLINE if asked_offline else None
    if uv is False:
        if system_site_packages or asked_offline:
            option = UV_SYSTEM_SITE_PACKAGES if system_site_packages else UV_OFFLINE
            raise OptionError(option, True, "not with uv=False", "leave one of them out",
                              flag_problem="not with --no-uv")
        return None
    if sync is None:
        if asked is not None:
            raise OptionError(asked, True, "the venv is built from the synced project's uv.lock, and nothing is "
                              "synced", "pass sync=True too (or add a [sync] table) to send the project with its lock",
                              flag_hint="add --sync (or a [sync] table) to send the project with its lock")
        return None
    from torchherd.tree import uv_lock_hash

    lock_hash = uv_lock_hash(Path(sync.source))
    if lock_hash is None:
        if asked is not None:
            missing = " and ".join(name for name in UV_FILES if not (Path(sync.source) / name).is_file())
            first = f"lock the project first (uv lock, in {sync.source}), or leave "
            raise OptionError(asked, True, f"{sync.source} has no {missing or 'readable uv.lock'}",
                              first + f"{asked.name} out", flag_hint=first + f"{asked.flag} out")
        return None
    return UvOptions(lock_hash, system_site_packages, offline)


def _document(hosts: Sequence[str | Mapping[str, Any]], defaults: Mapping[str, Any] | None,
              keys: Mapping[str, Any]) -> dict[str, Any]:
    from torchherd.inventory import CLUSTER_KEYS

    tables = {key: dict(value) for key, value in keys.items() if key in schedulers.TABLES and value is not None}
    keys = {key: value for key, value in keys.items() if key not in schedulers.TABLES}
    cluster = {key: value for key, value in keys.items() if key in CLUSTER_KEYS}
    merged_defaults = {**(defaults or {}), **{key: value for key, value in keys.items()
                                              if key not in CLUSTER_KEYS and key != "container"}}
    rows = [{"name": host} if isinstance(host, str) else dict(host) for host in hosts]
    document = {"cluster": cluster, "defaults": merged_defaults, "hosts": rows, **tables}
    if "container" in keys:  # Cluster(container={"image": ...}): the [container] table
        document["container"] = keys["container"]
    return document


@dataclass
class DetachedRun:
    """A run started with ``detach=True``, found again by id: its state per node, its
    output, and the same teardown as Ctrl-C. Also an attached run of the history
    (``attached``): its state and its output (its local log files), from its record."""

    record: RunRecord
    connector: Connector | None = None

    @property
    def run_id(self) -> str:
        return self.record.run_id

    @property
    def attached(self) -> bool:
        """An attached run's record (history: its controller owns the job), not a detached run."""
        from torchherd.engine.records import attached_of

        return attached_of(self.record) is not None

    def controller(self) -> AttachedStatus | None:
        """An attached run: its record as it is now, and whether its controller still runs
        (when not, and the record says running, the controller was killed: the run ended,
        how is not known). None for a detached run."""
        from torchherd.engine.records import AttachedStatus, attached_of
        from torchherd.engine.records import load as load_record
        from torchherd.engine.records.history import controller_runs

        if not self.attached:
            return None
        self.record = load_record(self.run_id)
        attached = attached_of(self.record)
        if attached is None:
            return None
        return AttachedStatus(attached, controller_runs(self.record, attached))

    @property
    def backend(self) -> Backend:
        """The backend that started the run, as its record says."""
        return backend_of(self.record, self.connector)

    def status(self) -> list[NodeState]:
        """Per node: running, exited (its code), unreachable; a SLURM job still queued: one
        row. An attached run: as its record says (no node is asked)."""
        from torchherd.engine.records import attached_node_states

        controller = self.controller()
        if controller is not None:
            return attached_node_states(self.record, controller.record, controller.alive)
        self._reload()
        return self.backend.status(self.record)

    def recovery(self) -> RecoveryStatus | None:
        """A detached run with retries: what its recovering controller (in the background on
        this machine) recorded, every attempt and how it ended, the run's exit code once it
        ended, and whether the controller still runs (when not, and the job still does, it
        runs on without recovery). None for a run without retries."""
        from torchherd.engine.records import RecoveryStatus, controller_alive, recovery_of

        self._reload()
        found = recovery_of(self.record)
        return None if found is None else RecoveryStatus(found, controller_alive(found, self.run_id))

    def _reload(self) -> None:
        """A recovering run's record changes as it goes (each attempt's nodes): read it again."""
        from torchherd.engine.records import load as load_record
        from torchherd.engine.records import recovery_of

        if recovery_of(self.record) is not None:
            self.record = load_record(self.run_id)

    def follow(self, on_event: Observer, *, follow: bool = True, node: str | None = None,
               rank: int | None = None) -> dict[str, int]:
        """Reports the run's output (``Output``) and each node's status records (``NodeStatus``)
        from the start; with ``follow`` until every node is done. Per node: its exit code,
        for the nodes whose job ended (1 for one whose job could not start, or whose log
        could not be read)."""
        from torchherd.engine.events import NodeStatus
        from torchherd.engine.records import controller_alive
        from torchherd.engine.records.history import follow_history
        from torchherd.engine.run import Follow

        codes: dict[str, int] = {}

        def observe(event: Event) -> None:
            if isinstance(event, NodeStatus) and event.status.event == "exit":
                codes[event.status.node] = int(event.status.fields.get("code", 1))
            elif isinstance(event, NodeStatus) and event.status.event == "error":
                # the job could not start there, or its log could not be read: not a success
                codes.setdefault(event.status.node, 1)
            on_event(event)

        if self.attached:
            follow_history(self.record, observe, follow, node, rank)
            return codes
        recovery = self.recovery()
        more = None if recovery is None else (lambda: controller_alive(recovery.record, self.run_id))
        self.backend.follow(self.record, observe, Follow(follow=follow, node=node, rank=rank, more=more))
        return codes

    def lines(self, *, follow: bool = False) -> Iterator[OutputLine]:
        """Every line the run printed so far, in order per node; with ``follow`` on as they
        arrive, until the run ends. Leaving the loop early stops the reading."""
        feed = _LineFeed()
        threading.Thread(target=feed.read, args=(self, follow), name="torchherd-lines", daemon=True).start()
        try:
            yield from feed
        finally:
            feed.stopped.set()

    def stop(self, grace: float | None = None) -> dict[str, list[str]]:
        """Stops the run on every node; per node what is left (empty: nothing). ``grace``:
        seconds from SIGTERM to SIGKILL (None: the run's; SLURM refuses any). A run with
        retries: its recovering controller stops the run first, as Ctrl-C would (no further
        attempt); then, and when that controller is gone, every node is stopped directly."""
        from torchherd.engine.recovery.background import stop_controller

        controller = self.controller()
        if controller is not None:
            how = (f"Ctrl-C in its terminal stops it (or kill -INT {controller.record.pid} on this machine)"
                   if controller.alive else f"it has ended: torchherd status {self.run_id} says how")
            raise UsageError(f"run {self.run_id} is an attached run: torchherd stop stops detached runs", how)
        recovery = self.recovery()
        if recovery is not None:
            stop_controller(recovery.record, self.run_id, self.record.grace if grace is None else grace)
            self._reload()
        return self.backend.stop(self.record, grace)


class _Stopped(Exception):
    """The reader of ``DetachedRun.lines`` left: following ends."""


class _LineFeed:
    """Lines from a thread that follows a detached run to the iterator of ``lines``,
    a bounded number of batches at a time (a slow reader slows the reads, not memory)."""

    def __init__(self) -> None:
        self.batches: queue.Queue[list[OutputLine] | BaseException | None] = queue.Queue(maxsize=64)
        self.stopped = threading.Event()

    def read(self, run: DetachedRun, follow: bool) -> None:
        try:
            run.follow(self._observe, follow=follow)
            self._put(None)
        except _Stopped:
            pass
        except BaseException as error:  # handed to the reader: a failure must not vanish in a thread
            self._put(error)

    def _observe(self, event: Event) -> None:
        from torchherd.engine.events import Output
        from torchherd.runlog import flat

        if isinstance(event, Output):
            self._put(flat(event.lines))

    def _put(self, item: list[OutputLine] | BaseException | None) -> None:
        while True:
            if self.stopped.is_set():
                raise _Stopped
            try:
                self.batches.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[OutputLine]:
        while True:
            item = self.batches.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield from item


def runs() -> list[DetachedRun]:
    """Every run this user started from this machine, oldest first: the detached ones, and
    the attached ones the history keeps (``DetachedRun.attached``)."""
    from torchherd.engine.records import load_all

    return [DetachedRun(record) for record in load_all()]


def damaged_runs() -> list[str]:
    """Per run record that cannot be read (damaged, or written by hand): what is wrong
    with it, naming the file; ``status`` lists them rather than hide a run."""
    from torchherd.engine.records import scan

    return [f"{error} ({error.hint})" if error.hint else str(error) for error in scan()[1]]


def attach(run_id: str, connector: Connector | None = None) -> DetachedRun:
    """The detached run ``run_id`` (UsageError when no record of it is here)."""
    from torchherd.engine.records import load as load_record

    return DetachedRun(load_record(run_id), connector)


def report(run_id: str, path: str | Path | None = None) -> Path:
    """Writes run ``run_id``'s report, one self-contained HTML page (the timeline of its
    nodes and attempts, progress, busy shares, GPU heatmaps, the preflight, the summary), to
    ``path`` (default: ``report.html`` in the run's log directory); returns its path.
    Needs plotly (``pip install 'torchherd[report]'``): UsageError naming it where missing."""
    from torchherd.runreport import default_path, story, write_html
    from torchherd.runreport.html import plotly_modules

    plotly_modules()  # before the history is read: the one line that names the extra
    found = story(run_id)
    return write_html(found, Path(path) if path is not None else default_path(run_id))


def report_text(run_id: str) -> str:
    """Run ``run_id``'s story in a few lines (``report RUN --text``)."""
    from torchherd.runreport import story
    from torchherd.runreport.text import story_text

    return story_text(story(run_id))


def events_of(run_id: str) -> list[Recorded]:
    """Run ``run_id``'s history, oldest first: each typed event (``torchherd.events``) and
    node sample (``NodeStatus``: gpu, busy, progress; ``LinesSeen``) with its time
    (``Recorded.at``, seconds since the epoch), as its controller received them."""
    from torchherd.runreport import history_of

    return history_of(run_id)
