"""torchherd checkpoint watch, in the node's supervisor: says when the job has written a
new checkpoint, once it is complete (``[recovery] replicate``).

Standard library only, Python >= 3.8, Linux. The path (relative to the job's workdir; a
glob picks the newest match, as staging does: ``checkpoint.newest``) is looked at once
every ``POLL_SECONDS``. A checkpoint counts as complete when its size and mtime (a
directory: its files' total size, its newest file's mtime) have stayed the same for
``settle`` seconds, its mtime is that old too, and no process of the job holds one of its
files open for writing. A checkpoint written in place (``torch.save(state, "snapshot.pt")``)
is then closed; one written aside and renamed into place is complete at once, and waits
only for the settle time. Each complete checkpoint is reported once, and only one newer
than the last reported (``Settle``): the replication never copies an older one over it.
"""

from __future__ import annotations

import os
import time

from torchherd.remote.checkpoint import listing, newest

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, Iterable, Optional, Tuple

    State = Tuple[str, int, float]
    """A checkpoint as looked at: its path (relative to the workdir), size and mtime."""

POLL_SECONDS = 1.0
SETTLE_SECONDS = 2.0
"""How long a checkpoint's size and mtime stay the same before it counts as complete:
longer than any pause of a process writing it (a page cache flushed to a slow disk)."""
WRITE_MODES = (os.O_WRONLY, os.O_RDWR)


class Settle:
    """The decision, from successive looks at the newest checkpoint: ``seen`` returns the
    state once it is complete and newer than the last one reported, else None."""

    def __init__(self, settle: float = SETTLE_SECONDS) -> None:
        self.settle = settle
        self.candidate = None  # type: Optional[State]
        self.since = 0.0
        self.reported = None  # type: Optional[State]

    def seen(self, state: Optional[State], now: float, wall: float, writing: Callable[[str], bool]) -> Optional[State]:
        """``now``: a monotonic clock; ``wall``: the time the mtimes are in; ``writing(path)``:
        whether a process of the job holds the checkpoint open for writing."""
        if state is None:
            self.candidate = None
            return None
        if state != self.candidate:
            self.candidate, self.since = state, now
            return None
        if now - self.since < self.settle or wall - state[2] < self.settle:
            return None
        reported = self.reported
        if reported is not None and (state[2] <= reported[2] or state == reported):
            return None
        if writing(state[0]):
            self.since = now  # still open: complete only a settle time after it is closed
            return None
        self.reported = state
        return state


def look(workdir: str, pattern: str) -> Optional[State]:
    """The newest match of ``pattern`` under ``workdir``: its path, size and mtime."""
    try:
        relative = newest(workdir, pattern)
        if relative is None:
            return None
        full = os.path.join(workdir, relative)
        files = listing(full)
        mtime = max([when for _, _, when in files] + [os.stat(full).st_mtime])
    except OSError:  # gone between the glob and the stat: the next look sees the new one
        return None
    return relative, sum(size for _, size, _ in files), mtime


def open_for_writing(paths: Iterable[str], pids: Iterable[int], proc: str = "/proc") -> bool:
    """Whether one of ``pids`` has one of the files ``paths`` open for writing."""
    wanted = set(paths)
    for pid in pids:
        folder = os.path.join(proc, str(pid), "fd")
        try:
            fds = os.listdir(folder)
        except OSError:
            continue  # gone, or not ours to read
        for fd in fds:
            try:
                if os.readlink(os.path.join(folder, fd)) not in wanted:
                    continue
                with open(os.path.join(proc, str(pid), "fdinfo", fd)) as info:
                    flags = next((int(line.split()[1], 8) for line in info if line.startswith("flags:")), 0)
            except (OSError, ValueError, IndexError):
                continue
            if flags & os.O_ACCMODE in WRITE_MODES:
                return True
    return False


class CheckpointWatch:
    """The supervisor's side: ``poll(now)`` at most once every ``POLL_SECONDS`` (``due``)."""

    def __init__(self, workdir: str, pattern: str, pids: Callable[[], Iterable[int]],
                 settle: float = SETTLE_SECONDS) -> None:
        self.workdir = workdir
        self.pattern = pattern
        self.pids = pids
        self.decision = Settle(settle)
        self.due = 0.0

    def poll(self, now: float) -> Optional[State]:
        if now < self.due:
            return None
        self.due = now + POLL_SECONDS
        return self.decision.seen(look(self.workdir, self.pattern), now, time.time(), self._writing)

    def _writing(self, relative: str) -> bool:
        full = os.path.realpath(os.path.join(self.workdir, relative))
        try:
            paths = [os.path.realpath(os.path.join(full, path)) if path else full for path, _, _ in listing(full)]
        except OSError:
            return True  # changing under us: not complete
        return open_for_writing(paths, self.pids())
