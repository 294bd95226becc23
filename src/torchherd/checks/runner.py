"""Runs the preflight: connect and gather facts on every node in parallel, run the
cross-node probes, then the pure analyses. A dead node costs one SSH timeout,
in parallel with the others, never a stall."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Mapping

from torchherd.checks.analysis.network import compute_networks
from torchherd.checks.analysis.registry import ANALYSES
from torchherd.checks.analysis.ssh import SLOW_SHELL_SECONDS, busy_node_explains
from torchherd.checks.analysis.venv import venv_config
from torchherd.checks.bandwidth import Launched, measure, probe_paths, start_paths, stop_paths
from torchherd.checks.container import gather as gather_containers
from torchherd.checks.gather import NODES_AT_ONCE, FactsSession, StartedFacts, finish_facts, start_facts, stop_listeners
from torchherd.checks.gpudiag import gather as gather_gpu_diag
from torchherd.checks.icmp import echo_all
from torchherd.checks.model import CHECK_IDS, OPT_IN, Mesh, Observed
from torchherd.checks.probes import listen_config, run_probes
from torchherd.checks.results import CheckResult
from torchherd.errors import TransportError, UsageError
from torchherd.inventory import Host
from torchherd.plan import Plan
from torchherd.plan import is_ip_address as is_ip
from torchherd.transport import Connector, Session, fan_out
from torchherd.transport.ssh import resolve_target

Progress = Callable[[CheckResult], None]
FACTS_EXTRA_SECONDS = 20.0
"""On top of ssh_timeout: importing torch on a loaded node takes seconds."""
SHELLS_AT_ONCE_AGAIN = 8
"""Slow shells timed again this many at a time (not alone: 256 slow nodes one by one would
take minutes, and eight logins at once are no burst)."""
SHELL_EXTRA_SECONDS = 20.0
"""On top of ssh_timeout: a slow login shell is reported (ssh warns), not cut off."""
PROBED = frozenset({"port", "ping", "hostname", "network", "firewall"})
NEED_TORCH = frozenset({"python", "gpu", "smoke"})
MEASURED = frozenset({"bandwidth", "mtu"})
"""Need the bandwidth script on every node (checks/bandwidth.py)."""


def selected_checks(only: frozenset[str] | None, skip: frozenset[str], smoke: bool,
                    bandwidth: bool = False, gpu_diag: bool = False) -> tuple[str, ...]:
    """The checks to run: ``only`` (else all) less ``skip``; the smoke job with ``smoke``;
    the bandwidth and MTU measurements with ``bandwidth`` or ``smoke``, DCGM's diagnostic
    with ``gpu_diag``, or any of them when ``only`` names them."""
    unknown = sorted(((only or frozenset()) | skip) - set(CHECK_IDS))
    if unknown:
        raise UsageError(f"unknown check id {', '.join(unknown)}", f"known ids: {', '.join(CHECK_IDS)}")
    wanted = [check for check in CHECK_IDS if (only is None or check in only) and check not in skip]
    opted = {"smoke"} if smoke else set()
    if bandwidth or smoke:
        opted |= MEASURED
    if gpu_diag:
        opted.add("gpudiag")
    opted |= (only or frozenset()) & (MEASURED | {"gpudiag"})
    return tuple(check for check in wanted if check not in OPT_IN or check in opted)


def facts_config(observed: Observed, host: Host, listen: bool, master_ssh_name: str | None = None) -> dict[str, object]:
    """What ``host``'s facts script is asked; ``master_ssh_name`` (the master's SSH host
    name) is looked up in the ssh_config when not given (once per run is enough)."""
    target = observed.master_target
    ssh_name = master_ssh_name or resolve_target(observed.master, observed.inventory.cluster.ssh_config).hostname
    return {"port": observed.port, "resolve": [] if is_ip(target) else [target],
            "route_to": [target, ssh_name], "script": observed.script, "workdir": host.workdir,
            "torch": "files" if observed.with_torch and host.name in observed.torch_known else observed.with_torch,
            "imported": sorted(observed.torch_imported.get(host.name, {})),
            "listen": listen_config(observed, host) if listen else None,
            "venv": venv_config(observed.venvs[host.name]) if host.name in observed.venvs else None}


class _Collector:
    """Per-node SSH + facts, run in threads; reports each ssh result as it arrives."""

    def __init__(self, observed: Observed, connector: Connector, need_facts: bool, progress: Progress | None,
                 report_ssh: bool, listen: bool) -> None:
        self.observed = observed
        self.connector = connector
        self.need_facts = need_facts
        self.progress = progress
        self.report_ssh = report_ssh
        self.listen = listen
        self.lock = threading.Lock()
        self.connections: dict[str, Session] = {}
        self.sessions: dict[str, FactsSession] = {}
        self.started: dict[str, StartedFacts] = {}
        """In the order they were started."""
        self.master_ssh_name: str | None = None

    def node(self, host: Host) -> None:
        try:
            connection = self.connector.connect(host)
        except TransportError as error:
            with self.lock:
                self.observed.ssh_errors[host.name] = error
            self._emit(CheckResult(host.name, "ssh", "fail", str(error), error.hint))
            return
        with self.lock:
            self.connections[host.name] = connection
            address = connection.peer_address()
            if address is not None:
                self.observed.ssh_addresses[host.name] = address
            # Only SSH sessions have host keys to speak of; other sessions have no note.
            note = getattr(connection, "host_key_note", None)
            if note:
                self.observed.host_key_notes[host.name] = note
        self._emit(CheckResult(host.name, "ssh", "pass", "connected"))
        if self.need_facts:
            self._start(connection, host)
        else:
            self._time_shell(connection, host)

    def _time_shell(self, connection: Session, host: Host) -> None:
        """A trivial command's round trip: what the node's shell startup costs every SSH command."""
        seconds = time_trivial_command(connection, self.observed.inventory.cluster.ssh_timeout)
        if seconds is not None:
            with self.lock:
                self.observed.shell_seconds[host.name] = seconds

    def _start(self, connection: Session, host: Host) -> None:
        timeout = self.observed.inventory.cluster.ssh_timeout + FACTS_EXTRA_SECONDS
        try:
            config = facts_config(self.observed, host, self.listen, self.master_ssh_name)
            started = start_facts(connection, config, timeout, host.python)
        except TransportError as error:
            with self.lock:
                self.observed.facts_errors[host.name] = str(error)
            return
        with self.lock:
            self.started[host.name] = started

    def finish(self) -> None:
        """Every started node's facts, read in the order they were started: the nodes' scripts
        ran at once meanwhile, and no thread waited on a node."""
        by_name = {host.name: host for host in self.observed.inventory.hosts}
        for name, started in list(self.started.items()):
            try:
                session = finish_facts(started, by_name[name])
            except TransportError as error:
                self.observed.facts_errors[name] = str(error)
                continue
            self.sessions[name] = session
            self.observed.facts[name] = session.facts
            if session.shell_seconds is not None:
                self.observed.shell_seconds[name] = session.shell_seconds
            if session.bound is not None:
                self.observed.listened[name] = session.bound

    def _emit(self, result: CheckResult) -> None:
        if self.progress is not None and self.report_ssh:
            with self.lock:
                self.progress(result)


def time_trivial_command(connection: Session, ssh_timeout: float) -> float | None:
    """Seconds ``true`` takes over the session; None when the session broke (the facts and
    probes report that)."""
    started = time.monotonic()
    try:
        connection.run("true", timeout=ssh_timeout + SHELL_EXTRA_SECONDS)
    except TransportError:
        return None
    return time.monotonic() - started


def confirm_slow_shells(observed: Observed, connections: dict[str, Session]) -> None:
    """Times a trivial command again on each node whose shell was slow to start (and not
    already explained by busy CPUs), after the burst and a few at a time: every node's
    login shell starting at once on busy CPUs is slow for that reason alone, and a warning
    must hold when the node is not that busy."""
    slow = [name for name, seconds in observed.shell_seconds.items()
            if seconds > SLOW_SHELL_SECONDS and name in connections
            and not busy_node_explains(observed.facts.get(name))]
    timeout = observed.inventory.cluster.ssh_timeout

    def again(name: str) -> None:
        seconds = time_trivial_command(connections[name], timeout)
        if seconds is not None:
            observed.shell_alone[name] = seconds

    fan_out(slow, again, SHELLS_AT_ONCE_AGAIN)


def _controller_pings(observed: Observed) -> None:
    hosts = [host for host in observed.inventory.hosts if host.name in observed.ssh_addresses]
    answers = echo_all([observed.ssh_addresses[host.name] for host in hosts])
    observed.controller_ping.update((host.name, answers[observed.ssh_addresses[host.name]]) for host in hosts)


def observe(plan: Plan, selected: tuple[str, ...], min_bandwidth: float | None = None,
            torch_known: Mapping[str, str] | None = None,
            torch_imported: Mapping[str, Mapping[str, str]] | None = None) -> Observed:
    """What the checks will verify: the plan's master address, port, processes per node,
    script and each node's job environment (not the inventory's defaults); the bandwidth
    floor given, else the inventory's."""
    given = ("--master-addr" if plan.options.master_addr
             else "[cluster].master_addr" if plan.inventory.cluster.master_addr else None)
    floor = min_bandwidth if min_bandwidth is not None else plan.inventory.checks.min_bandwidth
    return Observed(inventory=plan.inventory, master_target=plan.master_addr, master_given=given, script=plan.script,
                    # a job in an image imports the image's torch (the container check reads it
                    # there): the node's own is nobody's business, and costs seconds of CPU
                    with_torch=bool(NEED_TORCH & set(selected)) and any(node.container is None for node in plan.nodes),
                    nproc_per_node=plan.nproc_per_node,
                    node_nproc={node.host.name: node.nproc_per_node for node in plan.nodes},
                    job_env={node.host.name: node.env for node in plan.nodes}, ssh_hostnames=plan.ssh_hostnames,
                    min_bandwidth=floor, slow_ratio=plan.inventory.checks.slow_ratio,
                    venvs={node.host.name: node.venv for node in plan.nodes if node.venv is not None},
                    torch_known=dict(torch_known or {}), torch_imported=dict(torch_imported or {}))


def collect(plan: Plan, selected: tuple[str, ...], connector: Connector, progress: Progress | None,
            mesh: Mesh = "auto", min_bandwidth: float | None = None,
            torch_known: Mapping[str, str] | None = None,
            torch_imported: Mapping[str, Mapping[str, str]] | None = None) -> tuple[Observed, dict[str, Session]]:
    observed = observe(plan, selected, min_bandwidth, torch_known, torch_imported)
    # The measurements need the job's addresses, which the probes find.
    probing = bool((PROBED | MEASURED) & set(selected))
    collector = _Collector(observed, connector, any(check != "ssh" for check in selected), progress,
                           "ssh" in selected, probing)
    with contextlib.suppress(TransportError):  # else each node looks it up, and says why it cannot
        collector.master_ssh_name = resolve_target(observed.master, plan.inventory.cluster.ssh_config).hostname
    launched: Launched | None = None
    try:
        fan_out(plan.inventory.hosts, collector.node, NODES_AT_ONCE)
        collector.finish()
        observed.networks = compute_networks(observed)
        if "mtu" in selected and "bandwidth" not in selected:
            launched = start_paths(observed, collector.connections)
        if probing:
            _probe(observed, collector, "ping" in selected, mesh)
    except BaseException:
        if launched is not None:
            stop_paths(observed, launched)
        raise
    finally:
        stop_listeners(list(collector.sessions.values()))
        for name, started in collector.started.items():
            if name not in collector.sessions:  # interrupted before its answer was read
                started.process.close()
    if "container" in selected:
        observed.containers.update(gather_containers(plan.inventory.hosts, collector.connections))
    if "gpudiag" in selected:
        observed.gpu_diag.update(gather_gpu_diag(plan.inventory.hosts, collector.connections))
    if "bandwidth" in selected:
        measure(observed, collector.connections, mesh)
    elif "mtu" in selected:
        probe_paths(observed, collector.connections, launched)
    if "ssh" in selected:
        confirm_slow_shells(observed, collector.connections)
    return observed, collector.connections


def _probe(observed: Observed, collector: _Collector, ping: bool, mesh: Mesh) -> None:
    if ping:
        pinger = threading.Thread(target=_controller_pings, args=(observed,), daemon=True)
        pinger.start()
    run_probes(observed, collector.sessions, mesh)
    observed.networks = compute_networks(observed)
    if ping:
        pinger.join()


def analyse(observed: Observed, selected: tuple[str, ...]) -> list[CheckResult]:
    by_check = {check: ANALYSES[check](observed) for check in selected if check in ANALYSES}
    order = {host.name: index for index, host in enumerate(observed.inventory.hosts)}
    results = [result for check in selected for result in by_check.get(check, [])]
    return sorted(results, key=lambda result: (order.get(result.node, len(order)), CHECK_IDS.index(result.check)))
