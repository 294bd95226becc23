"""The SSH backend: torchherd starts every node itself, one supervisor per node over SSH
(``launch``, ``job``), detached runs found again from their record (``detach``)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Callable, ClassVar, Sequence

from torchherd.checks import CheckOptions
from torchherd.checks.results import CheckReport, CheckResult
from torchherd.engine.backend import Backend, Description
from torchherd.engine.observer import ignore
from torchherd.engine.ssh.preflight import preflight, with_probes
from torchherd.inventory import Bandwidth, Host
from torchherd.plan import Plan
from torchherd.transport import Connector
from torchherd.transport.ssh import SshConnector, ssh_hostnames

if TYPE_CHECKING:  # a run's own: `check` never loads them (issue 43)
    from torchherd.engine.events import CheckpointReplicated, CheckpointSaved, LostContainers, Observer, WarmReady
    from torchherd.engine.prepare.staging import Staged
    from torchherd.engine.recorder import Recorder
    from torchherd.engine.records import NodeState, RecoveryRecord, RunRecord
    from torchherd.engine.run import Follow, LaunchOptions, Run
    from torchherd.engine.ssh.warm import WarmPool


class SshBackend(Backend):
    """torchherd starts every node itself: one supervisor per node over SSH."""

    scheduler: ClassVar[str] = "ssh"
    title: ClassVar[str] = "SSH"

    def check(self, plan: Plan, options: CheckOptions, *, sync: bool = False,
              on_result: Callable[[CheckResult], None] | None = None, on_event: Observer = ignore) -> CheckReport:
        connector = self._connector()
        if sync and plan.sync is not None:
            from torchherd.engine.ssh.launch import sync_first

            connector = sync_first(plan, connector, on_event)
        outcome = preflight(plan, options, connector, on_result)
        outcome.close()
        return with_probes(outcome)

    @classmethod
    def script(cls, plan: Plan, *, fail_fast: bool = True) -> Description:
        return plan

    def describe(self, plan: Plan, *, fail_fast: bool = True) -> Description:
        return self.script(plan, fail_fast=fail_fast)

    def launch(self, plan: Plan, options: LaunchOptions, observer: Observer = ignore) -> Run:
        from torchherd.engine.ssh.launch import launch

        return launch(plan, options, self._connector(), observer)

    def preflight(self, plan: Plan, options: LaunchOptions, observer: Observer = ignore) -> Plan:
        from torchherd.engine.ssh.launch import open_nodes

        opened = open_nodes(plan, options, self._connector(), observer)
        opened.close()
        return opened.plan

    def start_detached(self, plan: Plan, options: LaunchOptions, observer: Observer = ignore) -> RunRecord:
        from torchherd.engine.run import DetachedStartFailed
        from torchherd.engine.ssh import detach as detached  # a detached run's own: not `check`'s
        from torchherd.engine.ssh.launch import open_nodes

        opened = open_nodes(plan, options, self._connector(), observer)
        try:

            start = detached.start_detached(opened.plan, options, opened.sessions)
        finally:
            opened.close()
        if not start.ok:
            raise DetachedStartFailed(start)
        return start.record

    def detached_recorder(self, plan: Plan, grace: float, controller: RecoveryRecord) -> Recorder:
        from torchherd.engine.bookkeeping import max_rank, node_record, run_record
        from torchherd.engine.recorder import Recorder
        from torchherd.engine.records import remote_log_file, remote_state_file, with_recovery

        run_id = plan.run_id
        inventory = plan.base_inventory or plan.inventory
        hosts = {host.name: host for host in inventory.hosts + inventory.spares}
        workdirs = {node.host.name: node.workdir for node in plan.nodes}
        nodes = [node_record(node.host, remote_log_file(run_id, node.host.name),
                             remote_state_file(run_id, node.host.name), node.workdir) for node in plan.nodes]
        record = run_record(plan, grace, nodes, max_rank(plan), extra={"scheduler": self.scheduler})
        return Recorder(with_recovery(record, controller), hosts, workdirs)

    def status(self, record: RunRecord) -> list[NodeState]:
        from torchherd.engine.ssh import detach as detached

        return detached.node_states(record, self.connector)

    def follow(self, record: RunRecord, observer: Observer, options: Follow) -> None:
        from torchherd.engine.ssh import detach as detached

        detached.follow_logs(record, observer, options, self.connector)

    def stop(self, record: RunRecord, grace: float | None = None) -> dict[str, list[str]]:
        from torchherd.engine.ssh import detach as detached

        return detached.stop_run(record if grace is None else replace(record, grace=grace), self.connector)

    def ssh_hostnames(self, hosts: Sequence[Host]) -> dict[str, str]:
        if not isinstance(self.connector, SshConnector):
            return {}
        return ssh_hostnames(hosts, self.connector.ssh_config)

    def stage_checkpoint(self, plan: Plan, sources: Sequence[str], receivers: Sequence[str], path: str,
                         attempt: int, stopping: Callable[[], bool] = lambda: False) -> Staged:
        from torchherd.engine.prepare.staging import stage

        nodes = {node.host.name: node for node in plan.nodes}
        return stage(self._connector(), nodes, sources, receivers, path, attempt, stopping)

    def remove_lost_containers(self, plan: Plan, nodes: Sequence[str]) -> LostContainers | None:
        from torchherd.engine.ssh.containers import remove_lost

        hosts = {node.host.name: node.host for node in plan.nodes}
        return remove_lost(self._connector(), [hosts[name] for name in nodes], plan.run_id)

    def replicate_checkpoint(self, plan: Plan, saved: CheckpointSaved, targets: Sequence[str], bandwidth: Bandwidth,
                             stopping: Callable[[], bool] = lambda: False) -> CheckpointReplicated:
        from torchherd.engine.prepare.staging import replicate, replication_rate

        nodes = {node.host.name: node for node in plan.nodes}
        return replicate(self._connector(), nodes, saved, targets, replication_rate(plan, saved, targets, bandwidth),
                         str(bandwidth), stopping)

    def start_warm(self, plan: Plan, on_ready: Callable[[WarmReady], None]) -> WarmPool:
        """A warm Python on every node of ``plan`` (``engine.ssh.warm``), started in the
        background; ``on_ready`` once every node answered."""
        from torchherd.engine.ssh.warm import start_warm

        return start_warm(self._connector(), plan, on_ready)

    @staticmethod
    def warmed(plan: Plan, pool: WarmPool) -> tuple[Plan, tuple[str, ...]]:
        """``plan`` with each node whose warm Python is ready starting from it; those nodes."""
        from torchherd.engine.ssh.warm import warmed

        return warmed(plan, pool.ready())

    def _connector(self) -> Connector:
        assert self.connector is not None, "a Cluster's backend has its connector"
        return self.connector
