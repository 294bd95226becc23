"""The run directory on the submit host, followed: each node's task writes its stdout,
stderr and exit record to files there (SLURM's ``%N`` pattern); they are polled from
where the last read stopped, and their bytes go through the same framing and parsing
as a supervisor's (``runlog``), so a SLURM run's lines are an SSH run's.
"""

from __future__ import annotations

import re
from typing import Sequence, Union

from torchherd.engine.slurm.batch import (
    BATCH_OUTPUT,
    ERR,
    EXIT,
    OUT,
)
from torchherd.engine.slurm.commands import (
    COMMAND_TIMEOUT,
    NodeExit,
    parse_exit_file,
    parse_poll,
    poll_command,
)
from torchherd.remote import wire
from torchherd.remote.framing import LineFramer, RankMender
from torchherd.remote.wire import RANK_PREFIX_HEAD
from torchherd.runlog import OutputLine, OutputParser, RankLines, Status
from torchherd.transport import Session

BATCH_NODE = "slurm"
"""The name ``batch.out``'s lines carry: what srun and slurmstepd say about the job."""


Item = Union[OutputLine, RankLines, NodeExit]


class NodeFiles:
    """One node's files as they grow: stdout and stderr framed like a supervisor's
    records (torn rank lines mended), then parsed by ``runlog``; its exit record."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.parser = OutputParser(node)
        mender = RankMender(RANK_PREFIX_HEAD) if node != BATCH_NODE else None
        out_tag = wire.TAG_STDERR if node == BATCH_NODE else wire.TAG_STDOUT
        self.framers = {OUT: LineFramer(out_tag, mender=mender),
                        ERR: LineFramer(wire.TAG_STDERR, mender=RankMender(RANK_PREFIX_HEAD))}
        self.exit_text = ""
        self.exit: NodeExit | None = None

    def feed(self, suffix: str, data: bytes) -> list[Item]:
        if suffix == EXIT:
            self.exit_text += data.decode("utf-8", "replace")
            if self.exit is None and self.exit_text.endswith("\n"):
                self.exit = parse_exit_file(self.node, self.exit_text)
                return [self.exit] if self.exit is not None else []
            return []
        return self._lines(self.framers[suffix].feed(data))

    def finish(self) -> list[Item]:
        rest = self._lines(b"".join(framer.finish() for framer in self.framers.values()))
        return rest + [chunk for chunk in self.parser.finish() if not isinstance(chunk, Status)]

    def _lines(self, records: bytes) -> list[Item]:
        if not records:
            return []
        return [chunk for chunk in self.parser.feed(records) if not isinstance(chunk, Status)]


_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}\Z")
"""A host name as SLURM's ``$SLURMD_NODENAME`` gives it."""


def split_name(name: str) -> tuple[str, str] | None:
    """``node0.out`` -> ("node0", ".out"); ``batch.out`` -> (BATCH_NODE, ".out"). None for
    any other name: the job can make files in the run directory, and a name that is not a
    host name (escape sequences, spaces, a leading ``-``) must never become a node's."""
    if name == BATCH_OUTPUT:
        return BATCH_NODE, OUT
    for suffix in (OUT, ERR, EXIT):
        if name.endswith(suffix) and len(name) > len(suffix):
            node = name[:-len(suffix)]
            return (node, suffix) if _NODE_NAME.match(node) else None
    return None


class RunFiles:
    """The run directory on the submit host, read from where the last read stopped, so
    no line is shown twice or lost; optionally squeue's answer in the same round trip."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.offsets: dict[str, int] = {}
        self.nodes: dict[str, NodeFiles] = {}

    def node(self, name: str) -> NodeFiles:
        if name not in self.nodes:
            self.nodes[name] = NodeFiles(name)
        return self.nodes[name]

    def poll(self, session: Session, job_id: str | None = None,
             suffixes: Sequence[str] = (OUT, ERR, EXIT)) -> tuple[list[Item], str | None]:
        command = poll_command(self.directory, self.offsets, job_id, suffixes=suffixes)
        result = session.run(command, timeout=COMMAND_TIMEOUT)
        answer = parse_poll(result.stdout)
        items: list[Item] = []
        for chunk in answer.chunks:
            where = split_name(chunk.name)
            if where is None or chunk.offset != self.offsets.get(chunk.name, 0):
                continue
            self.offsets[chunk.name] = chunk.offset + len(chunk.data)
            items += self.node(where[0]).feed(where[1], chunk.data)
        return items, answer.queue

    def finish(self) -> list[Item]:
        return [item for files in self.nodes.values() for item in files.finish()]
