"""A detached SLURM run: submitted, its record saved, then found again from any later
shell (``status``, ``logs``, ``stop``, ``attach``) through the submit host.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

from torchherd.engine.bookkeeping import connector_for, max_rank, node_record, report, run_record
from torchherd.engine.events import (
    JobQueued,
    Observer,
)
from torchherd.engine.records import NodeRecord, NodeState, RunRecord, load, save
from torchherd.engine.run import LaunchOptions
from torchherd.engine.slurm.batch import (
    EXIT,
    OUT,
    placement,
)
from torchherd.engine.slurm.commands import (
    JobState,
    NodeExit,
    cancel_and_wait,
    final_state,
    hostnames,
    login_host,
    parse_squeue,
    queue_state,
)
from torchherd.engine.slurm.files import Item, RunFiles
from torchherd.engine.slurm.job import POLL_EVERY, submitted
from torchherd.engine.slurm.settings import settings_of
from torchherd.errors import TorchherdError, TransportError
from torchherd.inventory import Host
from torchherd.plan import Plan
from torchherd.runlog import Status
from torchherd.transport import Connector, Session
from torchherd.transport.local import LocalSession

SCHEDULER = "slurm"


def start_detached(plan: Plan, options: LaunchOptions, connector: Connector, observer: Observer) -> RunRecord:
    """Submits the job and saves a run record that says it is SLURM's (job id, run
    directory, the login host); ``status``, ``logs``, ``stop`` and ``attach`` read it."""
    session, batch, job_id = submitted(plan, options, connector, observer)
    session.close()
    observer(JobQueued(job_id, "SUBMITTED"))
    record = slurm_record(plan, options.stop_grace, job_id, batch.run_dir)
    save(record)
    return record


def slurm_record(plan: Plan, grace: float, job_id: str, directory: str) -> RunRecord:
    """The record of a detached SLURM run: its job, its run directory on the submit host,
    the login host, and the nodes where the inventory names them."""
    inventory = plan.inventory
    where = placement(plan, settings_of(inventory))
    login = dataclasses.asdict(_node_record(login_host(inventory), directory)) if settings_of(inventory).login else None
    names = where.nodelist.split(",") if where.source != "[slurm]" and where.nodelist else []
    return run_record(plan, grace, slurm_nodes(plan, names, directory), max_rank(plan, where.nodes or len(names) or 1),
                      extra={"scheduler": SCHEDULER, "job_id": job_id, "run_dir": directory, "login": login})


def slurm_nodes(plan: Plan, names: Sequence[str], directory: str) -> list[NodeRecord]:
    """A record per node of a SLURM run: its output and exit files in the run directory."""
    return [_node_record(dataclasses.replace(plan.nodes[0].host, name=name, address=name), directory)
            for name in names]


def with_job(record: RunRecord, job_id: str, directory: str) -> RunRecord:
    """``record`` now following job ``job_id`` (an attempt of a recovering run: a job of its own)."""
    return dataclasses.replace(record, extra={**record.extra, "job_id": job_id, "run_dir": directory})


def _node_record(host: Host, directory: str) -> NodeRecord:
    return node_record(host, f"{directory}/{host.name}{OUT}", f"{directory}/{host.name}{EXIT}")


def record_session(record: RunRecord, connector: Connector | None = None) -> Session:
    """The submit host of a detached SLURM run, again."""
    login = record.extra.get("login")
    if not login:
        return LocalSession("localhost")
    return (connector or connector_for(record)).connect(NodeRecord(**login).host())


def _job(record: RunRecord) -> tuple[str, str]:
    return str(record.extra["job_id"]), str(record.extra["run_dir"])


def job_status(record: RunRecord, connector: Connector | None = None) -> list[NodeState]:
    """``status``: per node, running or exited (its code) as its exit record says; while
    the job waits, one row for the job and SLURM's reason."""
    job_id, directory = _job(record)
    try:
        session = record_session(record, connector)
    except TransportError as error:
        return [NodeState(f"job {job_id}", "unreachable", detail=str(error))]
    try:
        state = queue_state(session, job_id) or final_state(session, job_id)
        files = RunFiles(directory)
        items, _ = files.poll(session, suffixes=(EXIT,))
        names = hostnames(session, state.nodelist) if state is not None and state.nodelist else ()
    except (TransportError, TorchherdError) as error:
        return [NodeState(f"job {job_id}", "unreachable", detail=str(error))]
    finally:
        session.close()
    return job_states(job_id, state, names, [item for item in items if isinstance(item, NodeExit)])


def job_states(job_id: str, state: JobState | None, names: Sequence[str],
               exits: Sequence[NodeExit]) -> list[NodeState]:
    """Pure: the rows of ``status`` for a SLURM run."""
    said = "SLURM no longer knows the job" if state is None else f"SLURM: {state.state}" + (
        f" ({state.reason})" if state.reason else "")
    if state is not None and state.phase == "pending":
        return [NodeState(f"job {job_id}", "pending", detail=said)]
    by_node = {exit.node: exit for exit in exits}
    rows = []
    for name in list(names) + [node for node in by_node if node not in names]:
        exit = by_node.get(name)
        if exit is not None:
            rows.append(NodeState(name, "exited", exit.code, exit.at or None, said))
        elif state is not None and state.phase in ("running", "ending"):
            rows.append(NodeState(name, "running", detail=said))
        else:
            rows.append(NodeState(name, "exited", None, detail=said))
    return rows or [NodeState(f"job {job_id}", "exited" if state is not None else "unknown", detail=said)]


def follow_job(record: RunRecord, observer: Observer, follow: bool = False, node: str | None = None,
               rank: int | None = None, connector: Connector | None = None) -> None:
    """``logs`` (``-f``: until the job has left the queue): every node's lines and exit
    records as ``Output`` and ``NodeStatus`` events, from the start of the files."""
    job_id, directory = _job(record)
    session = record_session(record, connector)
    files = RunFiles(directory)
    try:
        while True:
            items, answer = files.poll(session, job_id if follow else None)
            _report(items, observer, node, rank)
            state = parse_squeue(answer, job_id) if answer is not None else None
            if not follow or state is None or state.phase == "done":
                break
            time.sleep(POLL_EVERY)
        if follow:  # what the nodes wrote between the last read and the end
            _report(files.poll(session)[0], observer, node, rank)
        _report(files.finish(), observer, node, rank)
    finally:
        session.close()


def next_job(record: RunRecord, more: Callable[[], bool]) -> RunRecord | None:
    """A detached SLURM run with retries, once its job has left the queue: the record as
    it names the next attempt's job, when its recovering controller submits one (None
    once the controller is gone without one)."""
    job_id = record.extra.get("job_id")
    while True:
        alive = more()
        now = load(record.run_id)
        if now.extra.get("job_id") not in (None, "", job_id):
            return now
        if not alive:
            return None
        time.sleep(POLL_EVERY)


def _report(items: Sequence[Item], observer: Observer, node: str | None, rank: int | None) -> None:
    """``bookkeeping.report``, a node's exit record as the status record an SSH node writes."""
    report([Status(item.node, "exit", {"code": item.code}) if isinstance(item, NodeExit) else item
            for item in items], observer, node, rank)


def stop_job(record: RunRecord, connector: Connector | None = None) -> dict[str, list[str]]:
    """``stop``: scancel, and wait until the job has left the queue; what is left."""
    job_id, _ = _job(record)
    name = f"SLURM job {job_id}"
    try:
        session = record_session(record, connector)
    except TransportError as error:
        return {name: [f"unreachable: {error}"]}
    try:
        left = cancel_and_wait(session, job_id)
    except (TransportError, TorchherdError) as error:
        return {name: [f"unknown: {error}"]}
    finally:
        session.close()
    return {name: [] if left is None else [f"still in the queue: {left.state}"]}
