"""Detached runs: start the job so that it outlives the controller, then find it
again from any later shell (``status``, ``logs``, ``stop``, ``attach``).

Each node runs the same supervisor as an attached run, in its detached mode: its
own session, stdin from /dev/null, framed records appended to
``~/.torchherd/runs/<run-id>/<node>.log`` and a small state file beside it. Fail
fast needs no controller and no SSH between nodes: a coordinator on the master
node (standard library, shipped over SSH like the supervisor) takes a TCP
connection from every node's supervisor and tells the others to stop when one
fails. The local run record keeps what it takes to reconnect.
"""

from __future__ import annotations

import importlib.resources
import json
import queue
import secrets
import shlex
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

from torchherd.errors import EXIT_FAILED, EXIT_OK, TransportError
from torchherd.inventory import Inventory
from torchherd.launch import Event, LaunchOptions, _max_rank, open_plan, records_to_events, remote_command, \
    supervisor_input, supervisor_source
from torchherd.plan import Plan, RunOptions, quote_path
from torchherd.runlog import OutputLine, RecordSplitter, Status, parse_status
from torchherd.runrecord import CoordinatorRecord, NodeRecord, NodeState, RunRecord, parse_node_state, \
    remote_coordinator_file, remote_log_file, remote_state_file, save
from torchherd.transport import Connection, connect, connect_all

if TYPE_CHECKING:
    from rich.console import Console

    from torchherd.console.run import LiveRenderer

FETCH_LIMIT = 4 << 20
"""Bytes of a node's log fetched at once (more than the supervisor's longest record)."""
FETCH_TIMEOUT = 5.0
"""A fetch that takes longer means the connection is gone: reconnect and resume."""
POLL_EVERY = 0.5
RETRY_EVERY = 1.0
START_TIMEOUT = 60.0
COORDINATOR_WAIT = 120.0

# Run on a node by `stop`: SIGTERM the supervisor (it tears its tree down, SIGKILL after
# its grace), a second SIGTERM escalates, then anything still carrying the run id (in
# its environment, or its command line: supervisor, coordinator) gets SIGKILL. Prints
# what is left. Nothing is matched by name, so other runs are never touched.
STOP_SCRIPT = r"""
import json, os, signal, sys, time
run_id, sup, grace = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
mark, env_mark = run_id.encode(), ("TORCHHERD_RUN_ID=" + run_id).encode()
def read(pid, name):
    try:
        with open("/proc/%d/%s" % (pid, name), "rb") as f:
            return f.read()
    except OSError:
        return b""
def table():
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = read(int(name), "stat")
            fields = stat[stat.rfind(b")") + 2:].split()
            if len(fields) > 1 and fields[0] not in (b"Z", b"X"):
                out[int(name)] = int(fields[1])
    return out
def mine():
    procs, skip, pid = table(), set(), os.getpid()
    while pid in procs and pid not in skip:
        skip.add(pid)
        pid = procs[pid]
    return [p for p in procs if p not in skip and (mark in read(p, "cmdline")
            or env_mark in read(p, "environ").split(b"\0"))]
def wait(cond, seconds):
    end = time.time() + seconds
    while time.time() < end and not cond():
        time.sleep(0.1)
    return cond()
def sup_gone():
    return sup <= 0 or sup not in mine()
def kill(pids, sig):
    for p in pids:
        try:
            os.kill(p, sig)
        except OSError:
            pass
was_running = not sup_gone()
if was_running:
    kill([sup], signal.SIGTERM)
    if not wait(sup_gone, grace + 5):
        kill([sup], signal.SIGTERM)
        wait(sup_gone, 6)
kill(mine(), signal.SIGTERM)
if not wait(lambda: not mine(), 2):
    kill(mine(), signal.SIGKILL)
    wait(lambda: not mine(), 3)
left = [read(p, "cmdline").replace(b"\0", b" ").decode("utf-8", "replace")[:200] for p in mine()]
print(json.dumps({"was_running": was_running, "left": left}))
"""


def _remote_source(name: str) -> str:
    return importlib.resources.files("torchherd.remote").joinpath(name).read_text("utf-8")


# starting ----------------------------------------------------------------------


def start_detached(inventory: Inventory, run_options: RunOptions, options: LaunchOptions, console: Console) -> int:
    """``torchherd run --detach``: preflight, start every node, save the record, return."""
    opened = open_plan(inventory, run_options, options, console)
    if opened is None:
        return EXIT_FAILED
    plan, connections, close = opened
    try:
        coordinator = None
        if options.fail_fast and len(plan.nodes) > 1:
            coordinator = _start_coordinator(plan, connections[plan.master])
        record = _new_record(inventory, run_options, plan, options, coordinator)
        save(record)
        started = _start_nodes(plan, record, connections, options.grace, coordinator)
        record = replace(record, nodes=tuple(_started_or(started.get(node.name), node) for node in record.nodes))
        save(record)
        return _report_start(console, record, started, connections)
    finally:
        close()


def _started_or(started: NodeRecord | str | None, node: NodeRecord) -> NodeRecord:
    return started if isinstance(started, NodeRecord) else node


def _start_coordinator(plan: Plan, connection: Connection) -> tuple[CoordinatorRecord, str, str]:
    """Starts the coordinator on the master; its record, the address workers use, the token."""
    token = secrets.token_hex(16)
    master = plan.nodes[0]
    state_file = remote_coordinator_file(plan.run_id)
    config = {"run_id": plan.run_id, "token": token, "nodes": [node.host.name for node in plan.nodes],
              "state_file": state_file, "wait": COORDINATOR_WAIT}
    command = (f"exec {quote_path(master.host.python)} -c {shlex.quote(_remote_source('coordinator.py'))} "
               f"{shlex.quote(json.dumps(config))}")
    result = connection.run(command, timeout=START_TIMEOUT)
    try:
        reply = json.loads(result.stdout.decode("utf-8", "replace").strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise TransportError(master.host.name, "coordinator",
                             f"{master.host.name}: the run coordinator did not start: "
                             f"{result.stderr.decode('utf-8', 'replace').strip()[-300:]}") from None
    record = CoordinatorRecord(master.host.name, int(reply["port"]), int(reply["pid"]), state_file)
    return record, plan.master_addr, token


def _new_record(inventory: Inventory, run_options: RunOptions, plan: Plan, options: LaunchOptions,
                coordinator: tuple[CoordinatorRecord, str, str] | None) -> RunRecord:
    nodes = tuple(NodeRecord(name=node.host.name, address=node.host.address, user=node.host.user,
                             ssh_port=node.host.ssh_port, identity_file=node.host.identity_file,
                             python=node.host.python, workdir=node.workdir,
                             log_file=remote_log_file(plan.run_id, node.host.name),
                             state_file=remote_state_file(plan.run_id, node.host.name)) for node in plan.nodes)
    ssh_config = inventory.cluster.ssh_config
    return RunRecord(run_id=plan.run_id, inventory=str(inventory.path.resolve()), created=time.time(),
                     command=(run_options.script, *run_options.script_args), nodes=nodes,
                     max_rank=_max_rank(plan), grace=options.grace,
                     ssh_config=str(ssh_config) if ssh_config else None,
                     ssh_timeout=inventory.cluster.ssh_timeout,
                     coordinator=coordinator[0] if coordinator else None)


def _start_nodes(plan: Plan, record: RunRecord, connections: Mapping[str, Connection], grace: float,
                 coordinator: tuple[CoordinatorRecord, str, str] | None) -> dict[str, NodeRecord | str]:
    """Every node's supervisor, detached; per node its updated record or why it did not start."""
    source = supervisor_source()

    def start(index: int) -> NodeRecord | str:
        node, node_record = plan.nodes[index], record.nodes[index]
        extra: dict[str, object] = {"log_file": node_record.log_file, "state_file": node_record.state_file,
                                    "node": node_record.name, "heartbeat": 0, "watchdog": 0, "coordinator": None}
        if coordinator is not None:
            extra["coordinator"] = {"host": coordinator[1], "port": coordinator[0].port, "token": coordinator[2]}
        try:
            result = connections[node_record.name].run(remote_command(node, plan.run_id, source), timeout=START_TIMEOUT,
                                                        stdin=supervisor_input(node, plan.run_id, grace, extra))
        except Exception as error:  # paramiko's own errors too: the node is reported, the others go on
            return f"{node_record.name}: cannot start the job: {error}"
        return _started(node_record, result.stdout, result.stderr)

    with ThreadPoolExecutor(max_workers=max(1, min(32, len(plan.nodes)))) as pool:
        results = list(pool.map(start, range(len(plan.nodes))))
    return {node.name: result for node, result in zip(record.nodes, results)}


def _started(node: NodeRecord, stdout: bytes, stderr: bytes) -> NodeRecord | str:
    for raw in RecordSplitter().feed(stdout + b"\n"):
        status = parse_status(node.name, raw[1:]) if raw[:1] == b"S" else None
        if status is not None and status.event == "started":
            fields = status.fields
            return replace(node, supervisor=int(fields["supervisor"]), pid=int(fields["pid"]),
                           pgid=int(fields["pgid"]))
        if status is not None and status.event == "error":
            return f"{node.name}: {status.fields.get('message', 'the job did not start')}"
    text = stderr.decode("utf-8", "replace").strip()
    return f"{node.name}: the job did not start" + (f": {text[-300:]}" if text else "")


def _report_start(console: Console, record: RunRecord, started: Mapping[str, NodeRecord | str],
                  connections: Mapping[str, Connection]) -> int:
    from torchherd.console.detach import render_started

    errors = [result for result in started.values() if isinstance(result, str)]
    if errors:
        for error in errors:
            console.print(error, style="bold red", markup=False, highlight=False)
        results = stop_nodes(record, connections)
        console.print(f"run {record.run_id}: not every node started; the others were stopped"
                      + ("" if all(not left for left in results.values()) else " (some processes are left)"),
                      style="bold red", markup=False, highlight=False)
        return EXIT_FAILED
    render_started(console, record)
    return EXIT_OK


# reconnecting ------------------------------------------------------------------


def _ssh_config(record: RunRecord) -> Path | None:
    return Path(record.ssh_config) if record.ssh_config else None


def connect_run(record: RunRecord) -> Mapping[str, Connection | TransportError]:
    return connect_all([node.host() for node in record.nodes], _ssh_config(record), record.ssh_timeout)


def _alive_test(record: RunRecord, node: NodeRecord) -> str:
    """Shell test: the node's supervisor still runs (its command line holds the run id)."""
    pid = node.supervisor or 0
    return f"grep -qa -- {shlex.quote(record.run_id)} /proc/{pid}/cmdline 2>/dev/null"


def node_states(record: RunRecord) -> list[NodeState]:
    """``status``: each node's state file and whether its supervisor still runs."""
    connections = connect_run(record)
    try:
        with ThreadPoolExecutor(max_workers=max(1, len(record.nodes))) as pool:
            return list(pool.map(lambda node: _node_state(record, node, connections[node.name]), record.nodes))
    finally:
        for connection in connections.values():
            if isinstance(connection, Connection):
                connection.close()


def _node_state(record: RunRecord, node: NodeRecord, connection: Connection | TransportError) -> NodeState:
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


def stop_nodes(record: RunRecord, connections: Mapping[str, Connection | TransportError]) -> dict[str, list[str]]:
    """The same teardown as Ctrl-C, on every node at once; per node what is still left
    (``["unreachable: ..."]`` when the node could not be asked)."""

    def stop(node: NodeRecord) -> list[str]:
        connection = connections.get(node.name)
        if not isinstance(connection, Connection):
            return [f"unreachable: {connection}"]
        command = (f"{quote_path(node.python)} -c {shlex.quote(STOP_SCRIPT)} {shlex.quote(record.run_id)} "
                   f"{node.supervisor or 0} {record.grace:g}")
        try:
            result = connection.run(command, timeout=record.grace + 30)
            reply = json.loads(result.stdout.decode("utf-8", "replace").strip().splitlines()[-1])
        except (TransportError, ValueError, IndexError) as error:
            return [f"unknown: {error}"]
        return [str(line) for line in reply["left"]]

    with ThreadPoolExecutor(max_workers=max(1, len(record.nodes))) as pool:
        results = list(pool.map(stop, record.nodes))
    return {node.name: left for node, left in zip(record.nodes, results)}


def stop_run(record: RunRecord) -> dict[str, list[str]]:
    connections = connect_run(record)
    try:
        return stop_nodes(record, connections)
    finally:
        for connection in connections.values():
            if isinstance(connection, Connection):
                connection.close()


# following ---------------------------------------------------------------------


@dataclass(frozen=True)
class Follow:
    follow: bool = False
    node: str | None = None
    rank: int | None = None


class NodeFollower(threading.Thread):
    """Reads one node's log from a byte offset, only ever up to a complete record, so a
    dropped connection is resumed from where it was: no line twice, none missing."""

    def __init__(self, record: RunRecord, node: NodeRecord, follow: bool, events: queue.Queue[list[Event]],
                 stop: threading.Event) -> None:
        super().__init__(name=f"torchherd-follow-{node.name}", daemon=True)
        self.record, self.node, self.follow = record, node, follow
        self.events, self.stop = events, stop
        self.offset = 0
        self.connection: Connection | None = None
        self.reconnects = 0
        self.finished = False

    def run(self) -> None:
        try:
            last_round = False
            while not self.stop.is_set():
                fetched = self._fetch()
                if fetched is None:
                    self.stop.wait(RETRY_EVERY)
                    continue
                size, done, gone = fetched
                if done or (size < FETCH_LIMIT and (not self.follow or last_round)):
                    return
                # The supervisor may write its last records between the read and the check.
                last_round = gone
                if size == 0:
                    self.stop.wait(POLL_EVERY)
        finally:
            self.finished = True
            self.events.put([])
            if self.connection is not None:
                self.connection.close()

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
        except Exception:  # the connection dropped (timeout, reset): resume on a new one
            self._drop()
            return None
        data = result.stdout
        complete = data[:data.rfind(b"\n") + 1]
        self.offset += len(complete)
        records = RecordSplitter().feed(complete)
        events = records_to_events(node.name, records)
        if events:
            self.events.put(events)
        done = any(isinstance(event, Status) and event.event == "done" for event in events)
        return len(data), done, b"gone" in result.stderr

    def _connect(self) -> bool:
        try:
            self.connection = connect(self.node.host(), _ssh_config(self.record), min(self.record.ssh_timeout, 5.0))
        except Exception:
            return False
        return True

    def _drop(self) -> None:
        connection, self.connection = self.connection, None
        self.reconnects += 1
        if connection is not None:
            # Closing may wait on a dead network; following must not.
            threading.Thread(target=connection.close, daemon=True).start()


def follow_logs(record: RunRecord, renderer: LiveRenderer, options: Follow,
                on_status: Callable[[Status], None] | None = None) -> dict[str, NodeFollower]:
    """Fetches (and with ``follow``, follows until every node is done) the logs, rendering
    each node's lines as a live run would. Returns the followers (offsets, reconnects)."""
    nodes = [record.node(options.node)] if options.node else list(record.nodes)
    events: queue.Queue[list[Event]] = queue.Queue()
    stop = threading.Event()
    followers = {node.name: NodeFollower(record, node, options.follow, events, stop) for node in nodes}
    for follower in followers.values():
        follower.start()
    try:
        while not all(follower.finished for follower in followers.values()) or not events.empty():
            try:
                batch = events.get(timeout=0.2)
            except queue.Empty:
                continue
            _render(batch, renderer, options, on_status)
    finally:
        stop.set()
    return followers


def _render(batch: list[Event], renderer: LiveRenderer, options: Follow,
            on_status: Callable[[Status], None] | None) -> None:
    lines: list[OutputLine] = []
    for event in batch:
        if isinstance(event, OutputLine):
            if options.rank is None or event.rank == options.rank:
                lines.append(event)
        elif isinstance(event, Status) and on_status is not None:
            renderer.render(lines)
            lines = []
            on_status(event)
    renderer.render(lines)
