"""The controller's side of a node-to-node relay (``remote/relay.py`` has the protocol): one
chain of node programs carries files from where they are to the nodes that lack them, each
node passing the bytes on to the next as it writes them, so N nodes take about the time of
one copy, and the controller's own link carries them at most once.

Two things use it: checkpoint staging (``engine.prepare.staging``: the source is a node that holds
the checkpoint) and image archives (``engine.prepare.images``: the source is the controller, which
feeds the first receiver over its SSH channel). Every connection between nodes is
authenticated with a random token the controller sends on each program's stdin (never on
a command line, never between nodes: each end proves it knows it, ``remote/relay.py``).
"""

from __future__ import annotations

import json
import queue
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from torchherd.engine.prepare.sync import Lines
from torchherd.errors import TransportError
from torchherd.transport import Process, Session

START_SECONDS = 60.0
"""The most a relay program may take to start and say its port."""
BYTES_PER_SECOND = 10e6
"""The slowest rate the wait for the copy allows for (on top of START_SECONDS): a link slower
than this is taken as stalled (each node program also gives up after 2 minutes without a byte)."""
POLL_SECONDS = 0.5
"""While the copy runs, how often the controller looks whether the run was interrupted."""
GIVEN_UP = "given up: the run was interrupted"
"""A chain's outcome for a program that had not answered when ``stopping()`` came."""
END_SECONDS = 10.0
"""Once the chain is over (done, failed or given up), the most its programs may take, all
together, to end after their stdin closed: a replication's programs run at the lowest CPU
priority and, on a node whose CPUs are all busy, take seconds to wake up and exit."""

Feed = Callable[[Callable[[bytes], bool]], None]
"""The controller as the chain's source: called with the first receiver's ``send``, it sends
the header line and the bytes (``remote/relay.py``'s stream)."""
FEED_CHUNK = 1 << 20


def file_feed(files: Sequence[tuple[str, str, int]], sent: list[int]) -> Feed:
    """The controller as the chain's source of files here: ``files`` are (the name in the
    stream's header, where the file is here, its size), sent in that order; ``sent[0]``
    counts the bytes sent. Raises OSError once the first receiver's channel is closed."""

    def feed(send: Callable[[bytes], bool]) -> None:
        header = {"files": [[name, size, 0.0] for name, _, size in files]}
        if not send((json.dumps(header) + "\n").encode()):
            raise OSError("the first node's channel closed")
        for _, path, _ in files:
            with open(path, "rb") as file:
                while block := file.read(FEED_CHUNK):
                    if not send(block):
                        raise OSError("the first node's channel closed")
                    sent[0] += len(block)

    return feed


@dataclass(frozen=True)
class Hop:
    """One node of the chain: the program started there, and the address the next node reaches it at."""

    node: str
    session: Session
    command: str
    address: str


def run_chain(hops: Sequence[Hop], config: Mapping[str, Any], size: int, *, feed: Feed | None = None,
              on_message: Callable[[str, Mapping[str, Any]], None] = lambda node, message: None,
              stopping: Callable[[], bool] = lambda: False, extra_seconds: float = 0.0) -> dict[str, str | None]:
    """Starts ``hops[0] -> hops[1] -> ...``, each given ``config`` (its own ``bind`` and
    ``downstream`` added, and ``source``: the first hop, when nothing ``feed``s it); with
    ``feed`` the controller is the upstream of the first hop. Every line a program prints
    before its last goes to ``on_message``. Per hop: None (it did its part) or why not.
    Once ``stopping()`` is true the copy is given up: the programs end and remove their
    temporary copies. ``extra_seconds``: what the programs may take after the copy (a load)."""
    token = secrets.token_hex(16)
    processes: dict[str, Process] = {}
    lines: dict[str, Lines] = {}
    names = [hop.node for hop in hops]
    try:
        deadline = time.monotonic() + START_SECONDS
        for index, hop in enumerate(hops):
            try:
                process = hop.session.start(hop.command)
                processes[hop.node], lines[hop.node] = process, Lines(process)
                own = {**config, "token": token, "source": index == 0 and feed is None, "bind": hop.address,
                       "downstream": index < len(hops) - 1}
                process.send((json.dumps(own) + "\n").encode())
            except TransportError as error:
                return broken(names, hop.node, str(error))
        ports: dict[str, Any] = {}
        for hop in hops:
            answer = _answer(lines[hop.node], deadline)
            if answer is None or "error" in answer:
                return broken(names, hop.node, why(answer, processes[hop.node]))
            ports[hop.node] = answer.get("port")
        if feed is not None:
            processes[hops[0].node].send(b'{"upstream": null}\n')
        for upstream, hop in zip(hops, hops[1:]):
            where = {"upstream": [upstream.address, ports[upstream.node]]}
            processes[hop.node].send((json.dumps(where) + "\n").encode())
        finish = time.monotonic() + START_SECONDS + size / BYTES_PER_SECOND + extra_seconds
        return _wait(hops, processes, lines, finish, feed, on_message, stopping)
    finally:
        fed = processes.get(hops[0].node) if feed is not None else None
        if fed is not None:
            fed.close()  # the feed's thread may be blocked in a send to it: its stdin is not ours to close
        _end([process for process in processes.values() if process is not fed], END_SECONDS)


def _end(processes: Sequence[Process], seconds: float) -> None:
    """Each program told to end (its stdin closed: ``remote/relay.py``'s ``watch_controller``
    ends it, and it removes its temporary copy), then waited for, within ``seconds`` for all:
    a channel closed at once would leave a program that has not yet run since (a relay at the
    lowest priority on a busy node) behind the run that started it."""
    for process in processes:
        try:
            process.close_stdin()
        except TransportError:
            pass  # the channel is gone already: so is its program, or its node
    deadline = time.monotonic() + seconds
    for process in processes:
        process.exit_code(timeout=max(0.0, deadline - time.monotonic()))
        process.close()


def _wait(hops: Sequence[Hop], processes: Mapping[str, Process], lines: Mapping[str, Lines], finish: float,
          feed: Feed | None, on_message: Callable[[str, Mapping[str, Any]], None],
          stopping: Callable[[], bool]) -> dict[str, str | None]:
    """Every program's last line, read by one thread per program (one long read each: over
    SSH a channel keeps its last read's timeout, and the feed's sends would time out by a
    short one), handed here in order; ``on_message`` gets the lines before it."""
    answers: queue.Queue[tuple[str, dict[str, Any] | None]] = queue.Queue()

    def read(node: str) -> None:
        while True:
            answer = _answer(lines[node], finish)
            if answer is not None and not ({"ok", "error"} & answer.keys()):
                answers.put((node, {"message": answer}))
                continue
            answers.put((node, answer))
            return

    fed: list[str] = []
    if feed is not None:
        first = processes[hops[0].node]

        def send() -> None:
            try:
                feed(first.send)
            except (OSError, TransportError) as error:
                fed.append(str(error))
                try:
                    first.close_stdin()  # the first node reads a short stream and ends, not waits for the rest
                except TransportError:
                    pass

        threading.Thread(target=send, name="relay-feed", daemon=True).start()
    for hop in hops:
        threading.Thread(target=read, args=(hop.node,), name=f"relay-{hop.node}", daemon=True).start()
    results: dict[str, str | None] = {}
    while len(results) < len(hops):
        stopped = stopping()
        try:
            node, answer = answers.get(block=not stopped, timeout=POLL_SECONDS)
        except queue.Empty:
            if stopped:
                # What the programs said stands: a receiver that said ok holds its copy (a job
                # that waits for it may end its attempt, and so the copy, right after). The
                # others are given up.
                return {hop.node: results.get(hop.node, GIVEN_UP) for hop in hops}
            continue
        if answer is not None and "message" in answer:
            if _well_formed(answer["message"]):
                on_message(node, answer["message"])
            continue
        results[node] = None if answer is not None and answer.get("ok") else why(answer, processes[node])
        if fed and node == hops[0].node and results[node] is not None:
            results[node] = f"{results[node]} (sending it: {fed[0]})"
    return {hop.node: results[hop.node] for hop in hops}


def _answer(lines: Lines, deadline: float) -> dict[str, Any] | None:
    """A relay program's next line as the JSON object it carries (None: no such line in time)."""
    line = lines.line(deadline - time.monotonic())
    if line is None:
        return None
    try:
        value = json.loads(line)
    except ValueError:
        return {}  # not the program's (nothing else prints there): passed over as a message
    return value if isinstance(value, dict) else {}


def _well_formed(message: Mapping[str, Any]) -> bool:
    """A program's message as the observers read it: its ``progress`` a count of bytes
    (another type from a node is passed over, never an error that ends the run)."""
    progress = message.get("progress", 0)
    return type(progress) is int and progress >= 0


def broken(names: Sequence[str], where: str, why: str) -> dict[str, str | None]:
    text = f"the copy from node to node could not start on {where}: {why}"
    return {name: text for name in names}


def why(answer: Mapping[str, Any] | None, process: Process) -> str:
    if answer is not None and "error" in answer:
        return str(answer["error"])
    try:
        text = process.read_stderr().decode(errors="replace").strip()
    except TransportError:
        text = ""
    return "no answer" + (f": {text.splitlines()[-1][:200]}" if text else "")
