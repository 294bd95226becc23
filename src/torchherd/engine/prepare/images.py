"""``--image-archive FILE``: the image put on every node that lacks it, for clusters that
reach no registry. The archive leaves this machine once and travels node to node over the
cluster's own network (``engine.prepare.relay``, the chain checkpoint staging uses):

1. every node says, with ``remote/image.py have``, which runtime it uses and the image's id
   there; a node that shows the archive's id already is left alone (nothing sent, nothing
   loaded);
2. the others, in node-rank order (the master first), form one chain: this machine feeds
   the first over its SSH channel, each node writes the archive to a private file, passes
   it on as it comes, checks its SHA-256, runs ``docker load`` / ``podman load``, checks
   that the image now has the archive's id, and removes the file.

The events: ``ArchiveStarted``, ``ArchiveProgress`` per node as it goes (the console draws
one bar per node), ``ArchiveDone``. A node that could not load it fails the launch.
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from torchherd.engine.events import ArchiveDone, ArchiveProgress, ArchiveStarted, Observer
from torchherd.engine.prepare.relay import Hop, file_feed, run_chain
from torchherd.engine.prepare.staging import job_address
from torchherd.errors import TransportError
from torchherd.imagearchive import ImageArchive
from torchherd.plan import NodePlan
from torchherd.remote import command
from torchherd.remote.checkpoint import file_sha256
from torchherd.shell import quote_path
from torchherd.transport import Session, fan_out

HAVE_SECONDS = 120.0
"""The most a node may take to say which image it holds (a busy docker daemon)."""
LOAD_SECONDS = 600.0
"""What a load may take beyond the copy, in the wait for the chain's last answer."""
ARCHIVES_DIR = "~/.cache/torchherd/archives"
"""Where a node keeps an archive while it receives and loads it (the user's own; the file
is removed once loaded)."""


@dataclass(frozen=True)
class NodeImage:
    """What ``image.py have`` said: the node's runtime (None: neither docker nor podman) and
    the image's id there (None: not there)."""

    node: str
    runtime: str | None
    image_id: str | None


@dataclass(frozen=True)
class ArchivePlan:
    """Which nodes load the archive (in chain order), which have the image already, which cannot."""

    loading: tuple[str, ...]
    having: tuple[str, ...]
    failed: tuple[tuple[str, str], ...]


def plan_archive(archive: ImageArchive, order: Sequence[str], found: Mapping[str, NodeImage | str]) -> ArchivePlan:
    """Pure: ``found`` per node what it holds (a string: why it could not say)."""
    loading: list[str] = []
    having: list[str] = []
    failed: list[tuple[str, str]] = []
    for node in order:
        answer = found.get(node, "not asked")
        if isinstance(answer, str):
            failed.append((node, answer))
        elif answer.runtime is None:
            failed.append((node, "neither docker nor podman is installed there to load the archive with"))
        elif answer.image_id == archive.image_id:
            having.append(node)
        else:
            loading.append(node)
    return ArchivePlan(tuple(loading), tuple(having), tuple(failed))


def groups(nodes: Sequence[NodePlan]) -> list[tuple[ImageArchive, str, str, list[NodePlan]]]:
    """The nodes that take an archive, by (archive, image, runtime), in node-rank order: one
    chain each (one, unless hosts name archives of their own)."""
    found: dict[tuple[str, str, str], tuple[ImageArchive, list[NodePlan]]] = {}
    for node in nodes:
        settings = node.host.container
        if settings is None or settings.archive is None:
            continue
        key = (settings.archive.path, settings.image, settings.runtime)
        found.setdefault(key, (settings.archive, []))[1].append(node)
    return [(archive, image, runtime, members) for (_, image, runtime), (archive, members) in found.items()]


def program(node: NodePlan, mode: str, runtime: str, image: str, folder: str = ARCHIVES_DIR) -> str:
    words = f"{quote_path(node.host.python)} {command('image.py')} {mode} {shlex.quote(runtime)} " \
            f"{shlex.quote(image)}"
    return words + (f" {quote_path(folder)}" if mode == "relay" else "")


def stage_archives(nodes: Sequence[NodePlan], sessions: Mapping[str, Session], observer: Observer,
                   stopping: Callable[[], bool] = lambda: False) -> tuple[ArchiveDone, ...]:
    """Every archive of ``nodes`` loaded where its image is missing; one ``ArchiveDone`` per archive."""
    return tuple(stage(archive, image, runtime, members, sessions, observer, stopping)
                 for archive, image, runtime, members in groups(nodes))


def stage(archive: ImageArchive, image: str, runtime: str, nodes: Sequence[NodePlan], sessions: Mapping[str, Session],
          observer: Observer, stopping: Callable[[], bool] = lambda: False) -> ArchiveDone:
    started = time.monotonic()
    by_name = {node.host.name: node for node in nodes}
    asked = [name for name in by_name if name in sessions]
    answers = dict(zip(asked, fan_out(asked, lambda name: _have(sessions[name], by_name[name], runtime, image))))
    answers.update({name: "not reached" for name in by_name if name not in sessions})
    planned = plan_archive(archive, list(by_name), answers)
    sha256 = file_sha256(archive.path) if planned.loading else ""
    observer(ArchiveStarted(archive.path, image, archive.image_id, archive.size, planned.loading, planned.having))
    failed = list(planned.failed)
    loaded: tuple[str, ...] = ()
    sent = [0]
    if planned.loading:
        results = relay_archive(archive, image, runtime, sha256, [by_name[name] for name in planned.loading],
                                sessions, observer, stopping, sent)
        loaded = tuple(name for name in planned.loading if results[name] is None)
        failed += [(name, why) for name in planned.loading if (why := results[name]) is not None]
    order = list(by_name)
    failed.sort(key=lambda item: order.index(item[0]))
    done = ArchiveDone(archive.path, image, loaded, planned.having, tuple(failed), time.monotonic() - started, sent[0])
    observer(done)
    return done


def _have(session: Session, node: NodePlan, runtime: str, image: str) -> NodeImage | str:
    try:
        result = session.run(program(node, "have", runtime, image), timeout=HAVE_SECONDS)
    except TransportError as error:
        return str(error)
    for line in reversed(result.stdout.decode("utf-8", "replace").splitlines()):
        try:
            answer = json.loads(line)
        except ValueError:
            continue
        if isinstance(answer, dict):
            if "error" in answer:
                return str(answer["error"])
            return NodeImage(node.host.name, answer.get("runtime"), answer.get("id"))
    return f"no answer (exit {result.exit_code}): {result.stderr.decode(errors='replace').strip()[-200:]}"


def relay_archive(archive: ImageArchive, image: str, runtime: str, sha256: str, nodes: Sequence[NodePlan],
                  sessions: Mapping[str, Session], observer: Observer, stopping: Callable[[], bool],
                  sent: list[int], *, load: bool = True, folder: str = ARCHIVES_DIR) -> dict[str, str | None]:
    """The chain this machine -> nodes[0] -> nodes[1] ...; per node None (verified and, with
    ``load``, loaded) or why not; ``sent[0]`` counts the archive's bytes this machine sent
    (once: the nodes relay it among themselves). ``load`` and ``folder`` are for
    scripts/bench-archive, which times the relay alone, into the nodes' tmpfs."""
    hops = [Hop(node.host.name, sessions[node.host.name], program(node, "relay", runtime, image, folder),
                job_address(node)) for node in nodes]
    expect = {"sha256": sha256, "size": archive.size, "id": archive.image_id}

    feed = file_feed([("image.tar", str(archive.path), archive.size)], sent)

    def on_message(node: str, message: Mapping[str, Any]) -> None:
        if "progress" in message:
            observer(ArchiveProgress(node, "receiving", int(message["progress"]), archive.size))
        elif message.get("loading"):
            observer(ArchiveProgress(node, "loading", archive.size, archive.size))

    return run_chain(hops, {"expect": expect, "load": load, "progress": True}, archive.size, feed=feed,
                     on_message=on_message, stopping=stopping, extra_seconds=LOAD_SECONDS)
