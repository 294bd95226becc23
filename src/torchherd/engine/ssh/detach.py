"""Detached runs: start the job so that it outlives the controller, then find it
again from any later shell (``status``, ``logs``, ``stop``, ``attach``).

Each node runs the same supervisor as an attached run, in its detached mode: its
own session, stdin from /dev/null, framed records appended to
``~/.torchherd/runs/<run-id>/<node>.log`` and a small state file beside it. Fail
fast needs no controller and no SSH between nodes: a coordinator on the master
node (standard library, shipped over SSH like the supervisor) takes a TCP
connection from every node's supervisor and tells the others to stop when one
fails. The local run record keeps what it takes to reconnect. Nothing here
prints: starting returns a result, following reports events to an observer.
"""

from __future__ import annotations

import queue
import shlex
import threading
import time
from dataclasses import replace
from typing import Callable, Mapping

from torchherd.engine.bookkeeping import connector_for, max_rank, node_record, report, run_record
from torchherd.engine.events import Observer
from torchherd.engine.records import (
    NodeRecord,
    NodeState,
    RunRecord,
    load,
    parse_node_state,
    remote_coordinator_file,
    remote_log_file,
    remote_state_file,
    save,
)
from torchherd.engine.run import DetachedStart, Follow, LaunchOptions
from torchherd.engine.ssh.failfast import START_TIMEOUT, Coordination, start_coordinator
from torchherd.engine.ssh.job import Record, records_to_events, remote_command, supervisor_config, supervisor_source
from torchherd.errors import TransportError, UsageError
from torchherd.plan import Plan
from torchherd.remote import command as node_program
from torchherd.remote import wire
from torchherd.runlog import RecordSplitter, Status, parse_status
from torchherd.shell import quote_path
from torchherd.transport import Connected, Connector, Session, connect_all, fan_out
from torchherd.transport.base import MAX_PARALLEL

FETCH_LIMIT = 4 << 20
"""Bytes of a node's log fetched at once (more than the supervisor's longest record)."""
FETCH_TIMEOUT = 5.0
"""A fetch that takes longer means the connection is gone: reconnect and resume."""
POLL_EVERY = 0.5
RETRY_EVERY = 1.0
CONNECT_TRIES = 3
"""Connects a plain ``logs`` makes to a node before it says it could not read its log and
goes on without it (``logs -f`` retries on, having said so once)."""

# starting ----------------------------------------------------------------------


def start_detached(plan: Plan, options: LaunchOptions, sessions: Mapping[str, Session]) -> DetachedStart:
    """Starts every node of ``plan`` detached (the sessions come from ``launch.open_nodes``),
    with the coordinator on the master for fail-fast; saves the record."""
    coordinator = None
    if options.fail_fast and len(plan.nodes) > 1:
        coordinator = start_coordinator(plan, sessions[plan.master], remote_coordinator_file(plan.run_id))
    record = _new_record(plan, options, coordinator)
    save(record)
    started = _start_nodes(plan, record, sessions, options.stop_grace, coordinator, options.warm_start)
    record = replace(record, nodes=tuple(_started_or(started.get(node.name), node) for node in record.nodes))
    save(record)
    errors = tuple(result for result in started.values() if isinstance(result, str))
    if not errors:
        return DetachedStart(record)
    return DetachedStart(record, errors, stop_nodes(record, sessions))


def _started_or(started: NodeRecord | str | None, node: NodeRecord) -> NodeRecord:
    return started if isinstance(started, NodeRecord) else node


def _new_record(plan: Plan, options: LaunchOptions, coordinator: Coordination | None) -> RunRecord:
    nodes = [node_record(node.host, remote_log_file(plan.run_id, node.host.name),
                         remote_state_file(plan.run_id, node.host.name), node.workdir) for node in plan.nodes]
    return run_record(plan, options.stop_grace, nodes, max_rank(plan), coordinator.record if coordinator else None)


def _start_nodes(plan: Plan, record: RunRecord, connections: Mapping[str, Session], grace: float,
                 coordinator: Coordination | None, warm: bool) -> dict[str, NodeRecord | str]:
    """Every node's supervisor, detached; per node its updated record or why it did not start."""
    source = supervisor_source()

    def start(index: int) -> NodeRecord | str:
        node, node_record = plan.nodes[index], record.nodes[index]
        config = supervisor_config(node, plan.run_id, grace, warm=warm)._replace(
            log_file=node_record.log_file, state_file=node_record.state_file, node=node_record.name,
            heartbeat=0.0, watchdog=0.0,
            coordinator=None if coordinator is None else coordinator.for_node(node_record.name))
        try:
            result = connections[node_record.name].run(remote_command(node, plan.run_id, source), timeout=START_TIMEOUT,
                                                        stdin=config.to_line())
        except TransportError as error:  # the node is reported, the others go on
            return f"{node_record.name}: cannot start the job: {error}"
        return _started(node_record, result.stdout, result.stderr)

    results = fan_out(list(range(len(plan.nodes))), start)
    return {node.name: result for node, result in zip(record.nodes, results)}


def _started(node: NodeRecord, stdout: bytes, stderr: bytes) -> NodeRecord | str:
    for raw in RecordSplitter().feed(stdout + b"\n"):
        status = parse_status(node.name, raw[1:]) if raw[:1] == wire.TAG_STATUS else None
        if status is not None and status.event == wire.EVENT_STARTED:
            fields = status.fields
            return replace(node, supervisor=int(fields["supervisor"]), pid=int(fields["pid"]),
                           pgid=int(fields["pgid"]))
        if status is not None and status.event == wire.EVENT_ERROR:
            return f"{node.name}: {status.fields.get('message', 'the job did not start')}"
    text = stderr.decode("utf-8", "replace").strip()
    return f"{node.name}: the job did not start" + (f": {text[-300:]}" if text else "")


# reconnecting ------------------------------------------------------------------


def connect_run(record: RunRecord, connector: Connector | None = None) -> Connected:
    return connect_all(connector or connector_for(record), [node.host() for node in record.nodes])


def _alive_test(record: RunRecord, node: NodeRecord) -> str:
    """Shell test: the node's supervisor still runs (its command line holds the run id)."""
    pid = node.supervisor or 0
    return f"grep -qa -- {shlex.quote(record.run_id)} /proc/{pid}/cmdline 2>/dev/null"


def node_states(record: RunRecord, connector: Connector | None = None) -> list[NodeState]:
    """``status``: each node's state file and whether its supervisor still runs."""
    connections = connect_run(record, connector)
    try:
        return fan_out(list(record.nodes), lambda node: _node_state(record, node, connections[node.name]))
    finally:
        connections.close()


def _node_state(record: RunRecord, node: NodeRecord, connection: Session | TransportError) -> NodeState:
    if isinstance(connection, TransportError):
        return NodeState(node.name, "unreachable", detail=str(connection))
    command = (f"cat {quote_path(node.state_file)} 2>/dev/null; echo; echo --torchherd--; "
               f"{_alive_test(record, node)} && echo alive")
    try:
        result = connection.run(command, timeout=FETCH_TIMEOUT * 2)
    except TransportError as error:
        return NodeState(node.name, "unreachable", detail=str(error))
    text, _, tail = result.stdout.decode("utf-8", "replace").partition("--torchherd--")
    return parse_node_state(node.name, text, tail.strip() == "alive")


# stopping ----------------------------------------------------------------------


def stop_nodes(record: RunRecord, connections: Mapping[str, Session | TransportError]) -> dict[str, list[str]]:
    """The same teardown as Ctrl-C, on every node at once; per node what is still left
    (``["unreachable: ..."]`` when the node could not be asked)."""
    source = node_program("stop.py")

    def stop(node: NodeRecord) -> list[str]:
        connection = connections.get(node.name)
        if connection is None or isinstance(connection, TransportError):
            return [f"unreachable: {connection}"]
        coordinator = record.coordinator
        command = (f"{quote_path(node.python)} {source} {shlex.quote(record.run_id)} "
                   f"{record.grace:g} {quote_path(node.state_file)}"
                   + (f" {quote_path(coordinator.state_file)}" if coordinator and coordinator.node == node.name else ""))
        try:
            result = connection.run(command, timeout=record.grace + 30)
            reply = wire.StopReply.from_json(result.stdout.decode("utf-8", "replace").strip().splitlines()[-1])
        except (TransportError, ValueError, IndexError) as error:
            return [f"unknown: {error}"]
        return list(reply.left)

    return dict(zip((node.name for node in record.nodes), fan_out(list(record.nodes), stop)))


def stop_run(record: RunRecord, connector: Connector | None = None) -> dict[str, list[str]]:
    connections = connect_run(record, connector)
    try:
        return stop_nodes(record, connections)
    finally:
        connections.close()


# following ---------------------------------------------------------------------


JOIN_EVERY = 1.0
"""Seconds between reads of a recovering run's record while following it: a spare that
took a place is followed from then on."""


class NodeFollower:
    """Reads one node's log from a byte offset, only ever up to a complete record, so a
    dropped connection is resumed from where it was: no line twice, none missing. Driven
    by ``follow_logs``'s workers, a step (one fetch) at a time."""

    def __init__(self, record: RunRecord, node: NodeRecord, follow: bool, events: queue.Queue[list[Record]],
                 stop: threading.Event, connector: Connector | None = None,
                 more: Callable[[], bool] | None = None) -> None:
        self.record, self.node, self.follow = record, node, follow
        self.more = more if follow else None
        self.events, self.stop = events, stop
        # A dead connection must be noticed fast: following resumes on a new one.
        self.connector = connector or connector_for(record, min(record.ssh_timeout, 5.0))
        self.offset = 0
        self.connection: Session | None = None
        self.reconnects = 0
        self.finished = False
        self.last_round = False
        self.failed_connects = 0
        self.unreachable: TransportError | None = None
        """The last connect's failure, while the node cannot be reached."""
        self.told = False

    def step(self) -> float | None:
        """One fetch; the seconds until the next one is due, or None when this node is done."""
        fetched = self._fetch()
        if fetched is None:
            return self._not_reached()
        self.failed_connects, self.unreachable = 0, None
        size, done, gone = fetched
        if self.more is not None:
            if self.more():
                return POLL_EVERY if size == 0 else 0.0
            self._last_attempt()
            return 0.0
        if done or (size < FETCH_LIMIT and (not self.follow or self.last_round)):
            return None
        # The supervisor may write its last records between the read and the check.
        self.last_round = gone
        return POLL_EVERY if size == 0 else 0.0

    def _not_reached(self) -> float | None:
        """After a failed fetch: when the node could not even be connected to, said once (a
        node that refuses SSH must not be silence that never ends); a plain ``logs`` then
        goes on without it, ``logs -f`` keeps trying."""
        if self.unreachable is None:
            return RETRY_EVERY  # the connection dropped mid-read: resumed at once on a new one
        self.failed_connects += 1
        if self.failed_connects < CONNECT_TRIES:
            return RETRY_EVERY
        if not self.told:
            self.told = True
            retrying = f"; trying again every {RETRY_EVERY:g} s" if self.follow else ""
            self._put([Status(self.node.name, "error", {
                "event": "error",
                "message": f"cannot read its log ({self.node.log_file}): {self.unreachable}{retrying}"})])
        return RETRY_EVERY if self.follow else None

    def _last_attempt(self) -> None:
        """Once the recovering controller ended (or is gone): the node as its record has it
        now (the last attempt's supervisor), followed as any detached run's."""
        self.more = None
        try:
            self.node = load(self.record.run_id).node(self.node.name)
        except UsageError:  # the record went away: the supervisor known before stands
            pass

    def end(self) -> None:
        self.finished = True
        self._put([])
        if self.connection is not None:
            self.connection.close()

    def _put(self, events: list[Record]) -> None:
        """Queues a batch; waits while the queue is full (the observer is behind), not forever."""
        while not self.stop.is_set():
            try:
                self.events.put(events, timeout=0.2)
                return
            except queue.Full:
                continue

    def _fetch(self) -> tuple[int, bool, bool] | None:
        """One read: (bytes read, a "done" record seen, the supervisor is gone); None on a failure."""
        if self.connection is None and not self._connect():
            return None
        assert self.connection is not None
        node = self.node
        command = (f"tail -c +{self.offset + 1} {quote_path(node.log_file)} 2>/dev/null | head -c {FETCH_LIMIT}; "
                   f"{_alive_test(self.record, node)} || echo gone >&2")
        try:
            result = self.connection.run(command, timeout=FETCH_TIMEOUT)
        except TransportError:  # the connection dropped (timeout, reset): resume on a new one
            self._drop()
            return None
        data = result.stdout
        complete = data[:data.rfind(b"\n") + 1]
        self.offset += len(complete)
        records = RecordSplitter().feed(complete)
        events = records_to_events(node.name, records)
        if events:
            self._put(events)
        done = any(isinstance(event, Status) and event.event == "done" for event in events)
        return len(data), done, b"gone" in result.stderr

    def _connect(self) -> bool:
        try:
            self.connection = self.connector.connect(self.node.host())
        except TransportError as error:
            self.unreachable = error
            return False
        self.unreachable = None
        return True

    def _drop(self) -> None:
        connection, self.connection = self.connection, None
        self.reconnects += 1
        if connection is not None:
            # Closing may wait on a dead network; following must not.
            threading.Thread(target=connection.close, daemon=True).start()


def _follow_group(followers: list[NodeFollower], stop: threading.Event) -> None:
    """One worker: steps each of its followers when it is due, until all are done."""
    due = {follower: 0.0 for follower in followers}
    try:
        while due and not stop.is_set():
            now = time.monotonic()
            for follower in [follower for follower, at in due.items() if at <= now]:
                delay = follower.step()
                if delay is None:
                    del due[follower]
                    follower.end()
                else:
                    due[follower] = time.monotonic() + delay
            if due:
                stop.wait(max(0.0, min(due.values()) - time.monotonic()))
    finally:
        for follower in due:
            follower.end()


def follow_logs(record: RunRecord, observer: Observer, options: Follow,
                connector: Connector | None = None) -> dict[str, NodeFollower]:
    """Fetches (and with ``follow``, follows until every node is done) the logs, reporting
    each node's lines (``Output``) and status records (``NodeStatus``) as they come.
    Returns the followers (offsets, reconnects). At most MAX_PARALLEL threads follow, each
    a share of the nodes, and a bounded queue holds what the observer has not taken yet:
    5,000 nodes are not 5,000 threads, and a slow terminal slows the reads, not the memory."""
    nodes = [record.node(options.node)] if options.node else list(record.nodes)
    workers = max(1, min(MAX_PARALLEL, len(nodes)))
    events: queue.Queue[list[Record]] = queue.Queue(maxsize=4 * workers)
    stop = threading.Event()
    followers = {node.name: NodeFollower(record, node, options.follow, events, stop, connector, options.more)
                 for node in nodes}
    shares = [list(followers.values())[index::workers] for index in range(workers)]
    for share in shares:
        _start_group(share, stop)
    joining = options.more if options.follow and options.node is None else None
    looked = time.monotonic()
    try:
        while not all(follower.finished for follower in followers.values()) or not events.empty():
            if joining is not None and time.monotonic() - looked >= JOIN_EVERY and joining():
                looked = time.monotonic()
                for node in _joined(record, followers):
                    followers[node.name] = NodeFollower(record, node, True, events, stop, connector, joining)
                    _start_group([followers[node.name]], stop)
            try:
                batch = events.get(timeout=0.2)
            except queue.Empty:
                continue
            report(batch, observer, options.node, options.rank)
    finally:
        stop.set()
    return followers


def _start_group(followers: list[NodeFollower], stop: threading.Event) -> None:
    threading.Thread(target=_follow_group, args=(followers, stop), name="torchherd-follow", daemon=True).start()


def _joined(record: RunRecord, followed: Mapping[str, NodeFollower]) -> list[NodeRecord]:
    """The nodes a recovering run's record names now and nobody follows yet: a spare that
    took an excluded node's place (its controller writes them into the record)."""
    try:
        now = load(record.run_id)
    except UsageError:  # the record went away: nothing joins any more
        return []
    return [node for node in now.nodes if node.name not in followed]
