"""Checkpoint staging (``[recovery] checkpoint``, ``run --checkpoint``): before a new
attempt, the newest copy of the job's checkpoint is put on every node of that attempt
that lacks it, copied node to node over the cluster's network, never through the controller.

1. On every node reached, of the failed attempt and of the next one, the node program
   ``remote/checkpoint.py find`` names the newest match of the path in the node's workdir
   with its size, mtime and SHA-256 (``Copy``).
2. The newest copy on a node of the failed attempt is the one (``newest``); every node
   of the next attempt that has no copy with the same path and hash needs it (``lacking``).
3. One chain of ``checkpoint.py relay`` programs carries it (``engine.prepare.relay``, the relay
   image archives use too): the source listens on its job address, the first receiver
   connects to it, listens in turn for the second, and so on; each receiver writes what it
   gets and passes it on at once, so N nodes take about the time of one copy. Each receiver
   checks the SHA-256 and renames the copy into place.

The outcome is one event: ``CheckpointStaged`` (or ``CheckpointMissing`` when there is
nothing to stage); a node that could not take it is named there, and the attempt starts
anyway (the job decides what to do without its checkpoint).

Replication (``replicate``, ``[recovery] replicate``) is the same chain while the job runs,
from the node that saved a new checkpoint to the next nodes in the ring: every program at
the lowest CPU and I/O priority, the source paced to the bandwidth cap, and a receiver that
holds a newer copy of its own keeps it. Its outcome is ``CheckpointReplicated``.
"""

from __future__ import annotations

import json
import math
import shlex
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, Union

from torchherd.engine.events import CheckpointMissing, CheckpointReplicated, CheckpointSaved, CheckpointStaged
from torchherd.engine.prepare.relay import BYTES_PER_SECOND, Hop, run_chain
from torchherd.engine.records.links import measured_link
from torchherd.errors import TransportError
from torchherd.inventory import Bandwidth
from torchherd.plan import NodePlan, Plan
from torchherd.remote import command
from torchherd.remote.checkpoint import LINK_ASSUMED
from torchherd.remote.pace import SLOWEST_SHARE
from torchherd.shell import quote_path
from torchherd.transport import Connector, Session, connect_all, fan_out
from torchherd.words import count

FIND_SECONDS = 300.0
"""The most a node may take to find and hash its copy (a few GB: seconds; a slow disk: more)."""
Staged = Union[CheckpointStaged, CheckpointMissing]


@dataclass(frozen=True)
class Copy:
    """A node's newest copy of the checkpoint, as ``checkpoint.py find`` reported it."""

    node: str
    path: str
    """Relative to the node's workdir (a glob's match)."""
    kind: str
    """"file" or "dir"."""
    size: int
    mtime: float
    sha256: str


def newest(copies: Sequence[Copy]) -> Copy | None:
    """The newest copy by mtime (the first of equal ones: the sources are in node-rank order)."""
    best: Copy | None = None
    for copy in copies:
        if best is None or copy.mtime > best.mtime:
            best = copy
    return best


def lacking(best: Copy, found: Mapping[str, Copy | None], nodes: Sequence[str]) -> tuple[str, ...]:
    """The nodes of ``nodes`` without ``best``: no copy, or one at another path or with another hash."""
    return tuple(node for node in nodes
                 if (have := found.get(node)) is None or (have.path, have.sha256) != (best.path, best.sha256))


def job_address(node: NodePlan) -> str:
    """The address the other nodes reach ``node`` at: its torchrun ``--local-addr`` when the
    plan has one, else its SSH address."""
    return node.torchrun.local_addr or node.host.local_addr or node.host.address


def program(node: NodePlan, mode: str, path: str, low: bool = False) -> str:
    return (f"{quote_path(node.host.python)} {command('checkpoint.py')} {mode} "
            f"{shlex.quote(node.workdir)} {shlex.quote(path)}" + (" low" if low else ""))


def stage(connector: Connector, nodes: Mapping[str, NodePlan], sources: Sequence[str], receivers: Sequence[str],
          path: str, attempt: int, stopping: Callable[[], bool] = lambda: False) -> Staged:
    """Puts the newest copy of ``path`` on the ``sources`` (the failed attempt's nodes still
    reached) on every node of ``receivers`` (the next attempt's) that lacks it. Once
    ``stopping()`` is true (Ctrl-C) the copy is given up: the relays end and remove
    their temporary copies."""
    started = time.monotonic()
    names = list(dict.fromkeys([*sources, *receivers]))
    connected = connect_all(connector, [nodes[name].host for name in names])
    try:
        sessions = connected.succeeded
        answers = dict(zip(sessions, fan_out(list(sessions.items()),
                                             lambda item: _find(item[1], nodes[item[0]], path))))
        found = {name: answer for name, answer in answers.items() if isinstance(answer, Copy)}
        best = newest([found[name] for name in sources if name in found])
        if best is None:
            return CheckpointMissing(attempt, _nowhere(path, sources, connected.failed, answers))
        needing = tuple(name for name in lacking(best, found, receivers) if name in sessions)
        failed = [(name, f"not reached: {connected.failed[name]}") for name in receivers if name in connected.failed]
        if not needing:
            return CheckpointStaged(attempt, best.path, best.size, best.node, (), time.monotonic() - started,
                                    tuple(failed))
        results = _relay(sessions, nodes, best, needing, stopping)
        staged = tuple(name for name in needing if results[name] is None)
        failed += [(name, why) for name in needing if (why := results[name]) is not None]
        return CheckpointStaged(attempt, best.path, best.size, best.node, staged, time.monotonic() - started,
                                tuple(failed))
    finally:
        connected.close()


def replication_rate(plan: Plan, saved: CheckpointSaved, targets: Sequence[str], bandwidth: Bandwidth) -> dict[str, Any]:
    """What the source of a replica is told of its rate (``remote/checkpoint.py``): the
    cap's own keys, the link to the first node it sends to as ``check --bandwidth`` last
    measured it (where kept: ``records.links``), and whose pace to keep to (the run's and
    the source's: the file its supervisor writes, ``remote/pace.py``)."""
    rate: dict[str, Any] = {**bandwidth.wire(), "pace": [plan.run_id, saved.node]}
    hosts = {node.host.name: node.host for node in plan.nodes}
    if targets and saved.node in hosts and targets[0] in hosts:
        link = measured_link(hosts[saved.node].address, hosts[targets[0]].address)
        if link is not None:
            rate["link"] = link
    return rate


def replicate(connector: Connector, nodes: Mapping[str, NodePlan], saved: CheckpointSaved, targets: Sequence[str],
              rate: Mapping[str, Any], cap: str, stopping: Callable[[], bool] = lambda: False
              ) -> CheckpointReplicated:
    """Copies the checkpoint ``saved`` on ``saved.node`` to each node of ``targets`` that
    lacks it, at low priority, the source sending at most at ``rate`` (``Bandwidth.wire``;
    ``cap`` says it). The copy is the source's newest at the time (a newer one may have come
    since the record), found and hashed again there."""
    started = time.monotonic()
    source = saved.node
    connected = connect_all(connector, [nodes[name].host for name in [source, *targets]])
    try:
        sessions = connected.succeeded
        # Nothing is hashed beforehand: that would read the whole checkpoint at full speed
        # before the paced copy. The source hashes what it sends and the receivers check
        # their copies against that (``"trailer"``). A node whose copy looks the same (path,
        # size and mtime: a replica keeps the original's mtime) holds it already.
        answers = dict(zip(sessions, fan_out(list(sessions.items()), lambda item: _find(
            item[1], nodes[item[0]], saved.path, low=True, mode="look"))))
        failed = [(name, f"not reached: {connected.failed[name]}") for name in targets if name in connected.failed]
        own = answers.get(source)
        if not isinstance(own, Copy):
            why = own if isinstance(own, str) else "its checkpoint is gone" if source in answers else "not reached"
            failed += [(name, f"the source {source}: {why}") for name in targets if name in sessions]
            return CheckpointReplicated(saved.path, saved.size, saved.mtime, source, (), time.monotonic() - started,
                                        cap, failed=tuple(failed))
        failed += [(name, answer) for name in targets if isinstance(answer := answers.get(name), str)]
        copies = {name: answer for name, answer in answers.items() if isinstance(answer, Copy)}
        held = tuple(name for name in targets if name in copies
                     and (copies[name].path, copies[name].size, copies[name].mtime) == (own.path, own.size, own.mtime))
        kept = tuple(name for name in targets if name in copies and name not in held and copies[name].mtime > own.mtime)
        needing = tuple(name for name in targets if name in sessions and name not in held and name not in kept
                        and not isinstance(answers.get(name), str))
        done: tuple[str, ...] = ()
        pace = ""
        if needing:
            # a node of one core under the default's per-core cap, the job's pace holding the
            # copy at the governor's floor throughout, is the slowest a copy may be
            slowest = min(BYTES_PER_SECOND, rate.get("bytes", rate.get("share", 1.0) * LINK_ASSUMED),
                          rate.get("per_core", BYTES_PER_SECOND)) * (SLOWEST_SHARE if "pace" in rate else 0.5)
            told: list[Mapping[str, Any]] = []
            results = _relay(sessions, nodes, own, needing, stopping,
                             {"rate": dict(rate), "keep_newer": True, "trailer": True}, slowest,
                             lambda node, message: told.append(message) if node == source else None)
            pace = governed(told)
            done = tuple(name for name in needing if results[name] is None)
            failed += [(name, problem) for name in needing if (problem := results[name]) is not None]
        return CheckpointReplicated(own.path, own.size, own.mtime, source, done, time.monotonic() - started, cap,
                                    held, tuple(failed), kept, pace)
    finally:
        connected.close()


def governed(told: Sequence[Mapping[str, Any]]) -> str:
    """The source's account of its rate kept to the job's pace, in words: "kept to the
    job's pace (101 lines/s, 1.10 CPU): 10 MB/s at first, 12.5 MB/s at the end (at most 40 MB/s, a share of the
    link), cut 2 times, raised 14 times"; empty when it said none (its rate was not governed)."""
    for message in told:
        said = message.get("governed")
        if not isinstance(said, Mapping):
            continue
        try:
            start, rate, ceiling = (float(said[key]) for key in ("start", "rate", "ceiling"))
            slowed, raised = int(said["slowed"]), int(said["raised"])
            baseline = said.get("baseline")
            lines, cpu = (float(value) for value in baseline) if baseline is not None else (0.0, 0.0)
        except (KeyError, TypeError, ValueError):
            return ""
        if baseline is None:
            return f"at {start / 1e6:.3g} MB/s: the job's pace too slight to keep to"
        link = " as measured" if said.get("link") == "measured" else ""
        return (f"kept to the job's pace ({lines:.0f} lines/s, {cpu:.2f} CPU): {start / 1e6:.3g} MB/s at first, {rate / 1e6:.3g} MB/s at the end "
                f"(at most {ceiling / 1e6:.3g} MB/s, a share of the link{link}), cut {count(slowed, 'time')}, "
                f"raised {count(raised, 'time')}")
    return ""


def _nowhere(path: str, sources: Sequence[str], unreached: Mapping[str, TransportError],
             answers: Mapping[str, Copy | str | None]) -> str:
    asked = [name for name in sources if name in answers]
    problems = [f"{name}: {answer}" for name, answer in answers.items() if isinstance(answer, str)]
    problems += [f"{name} not reached" for name in sources if name in unreached]
    where = f"on none of {', '.join(asked)}" if asked else "on no node"
    return f"{path} found {where}" + (f" ({'; '.join(problems)})" if problems else "")


def _find(session: Session, node: NodePlan, path: str, low: bool = False, mode: str = "find") -> Copy | str | None:
    """The node's newest copy; None: it has none; a string: why it could not say. Mode
    ``look``: its hash left out ("")."""
    try:
        result = session.run(program(node, mode, path, low), timeout=FIND_SECONDS)
    except TransportError as error:
        return str(error)
    answer = _last_json(result.stdout)
    if answer is None:
        return f"no answer (exit {result.exit_code}): {result.stderr.decode(errors='replace').strip()[-200:]}"
    if "error" in answer:
        return str(answer["error"])
    if answer.get("path") is None:
        return None
    return _copy(node.host.name, answer)


def _copy(name: str, answer: Mapping[str, Any]) -> Copy | str:
    """The node's answer as a Copy, each field of its type; else why not, in one line (a
    node's answer of the wrong type fails that node, never the run)."""
    path, kind, size, mtime, sha256 = (answer.get(key) for key in ("path", "kind", "size", "mtime", "sha256"))
    if not isinstance(path, str) or kind not in ("file", "dir") or type(size) is not int or size < 0 \
            or not isinstance(mtime, (int, float)) or isinstance(mtime, bool) or not math.isfinite(mtime) \
            or not isinstance(sha256, (str, type(None))):
        return "a malformed answer from checkpoint.py find"
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return (f"its newest checkpoint's name is not UTF-8 ({ascii(path)[1:-1][:200]}): rename it; torchherd "
                "names files on command lines as UTF-8")
    return Copy(name, path, kind, size, float(mtime), sha256 or "")


def _last_json(data: bytes) -> dict[str, Any] | None:
    for line in reversed(data.decode("utf-8", errors="replace").splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def _relay(sessions: Mapping[str, Session], nodes: Mapping[str, NodePlan], best: Copy,
           needing: Sequence[str], stopping: Callable[[], bool], extra: Mapping[str, Any] | None = None,
           slowest: float = BYTES_PER_SECOND,
           on_message: Callable[[str, Mapping[str, Any]], None] = lambda node, message: None) -> dict[str, str | None]:
    """The chain source -> needing[0] -> needing[1] ...; per receiver None (staged) or why not.
    ``extra``: replication's keys (and its programs run ``low``); ``slowest``: the lowest rate
    in bytes per second the wait for the copy allows for."""
    hops = [Hop(name, sessions[name], program(nodes[name], "relay", best.path, low=extra is not None),
                job_address(nodes[name])) for name in (best.node, *needing)]
    expect = {"path": best.path, "kind": best.kind, "sha256": best.sha256 or None, "size": best.size}
    slower = max(0.0, best.size / slowest - best.size / BYTES_PER_SECOND)  # a paced copy takes longer
    results = run_chain(hops, {"expect": expect, **(extra or {})}, best.size, stopping=stopping, extra_seconds=slower,
                        on_message=on_message)
    source_failed = results.pop(best.node)
    return {name: f"{why} (the source {best.node}: {source_failed})" if why and source_failed else why
            for name, why in results.items()}
