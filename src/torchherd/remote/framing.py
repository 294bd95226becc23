"""Framing: a byte stream cut into the records the controller reads, and the writer
that sends them without ever blocking.

Standard library and ``wire`` only, Python >= 3.8. Shipped to the nodes inside the
supervisor's program (``torchherd.remote.program``); the controller imports the same
classes to frame what it reads itself (SLURM's output files), so both sides cut lines
the same way.
"""

from __future__ import annotations

import os
import re
import select
import selectors
import time
from typing import IO, Dict, List, Optional, Tuple

# On a node this is the stand-in module the shipped program registered; see
# torchherd/remote/__init__.py.
from torchherd.remote import wire

READ_SIZE = 65536
MAX_LINE = 1 << 20
"""A line longer than this is cut into several records."""
MAX_HELD_RANKS = 4096
OUT_HIGH_WATER = 8 << 20
"""Bytes waiting for the channel above which the supervisor stops reading the job."""
OUT_LOW_WATER = 2 << 20


class RankMender:
    """Mends lines that torchrun's --tee tore apart.

    torchrun copies each rank's output with one thread per rank, each reading its
    rank's file line by line; a line the rank had not finished writing comes out
    without its newline, and the next rank's line is glued to it:
    ``[M 7] rank 7 li[M 6] a whole line`` ... ``[M 7] ne 12`` (M the rank marker).
    A segment that ends at another marker instead of a newline is such a partial
    line: it is held back and joined to the same rank's next segment."""

    def __init__(self, marker: bytes) -> None:
        self.marker = marker
        self.prefix = re.compile(re.escape(marker) + rb"(\d+)" + re.escape(wire.RANK_PREFIX_END))
        self.pending: Dict[bytes, List[bytes]] = {}
        """Per rank, its torn segments (joined once, when its line goes out)."""
        self.held: Dict[bytes, int] = {}

    def mend(self, lines: bytes) -> bytes:
        """``lines``: complete lines, each ending in a newline; returns them mended."""
        starts = lines.count(b"\n" + self.marker) + (1 if lines.startswith(self.marker) else 0)
        if not self.pending and lines.count(self.marker) == starts:
            return lines  # nothing torn: the common case costs two counts
        out: List[bytes] = []
        for line in lines[:-1].split(b"\n"):
            prefixes = list(self.prefix.finditer(line))
            if not prefixes or prefixes[0].start() > 0:
                out.append(line[: prefixes[0].start()] if prefixes else line)  # torchrun's own text
            for index, prefix in enumerate(prefixes):
                last = index == len(prefixes) - 1
                rank, body = prefix.group(1), line[prefix.end(): None if last else prefixes[index + 1].start()]
                if last:
                    out.append(self.marker + rank + wire.RANK_PREFIX_END + self._release(rank) + body)
                else:
                    self._hold(rank, body, out)
        return b"".join(line + b"\n" for line in out)

    def _hold(self, rank: bytes, body: bytes, out: List[bytes]) -> None:
        """Holds a torn segment for its rank's next one; at MAX_LINE it goes out as a line of
        its own, as the framer cuts a long line: one rank must not make the mender hold 20 MB."""
        self.pending.setdefault(rank, []).append(body)
        self.held[rank] = self.held.get(rank, 0) + len(body) + len(rank)
        if self.held[rank] >= MAX_LINE:
            out.append(self.marker + rank + wire.RANK_PREFIX_END + self._release(rank))
        if len(self.held) > MAX_HELD_RANKS or sum(self.held.values()) >= 4 * MAX_LINE:
            out.extend(self.finish()[:-1].split(b"\n"))  # many ranks torn at once: none held

    def _release(self, rank: bytes) -> bytes:
        self.held.pop(rank, None)
        return b"".join(self.pending.pop(rank, ()))

    def finish(self) -> bytes:
        """What was still held back when the stream ended, as lines of their own."""
        held = [self.marker + rank + wire.RANK_PREFIX_END + self._release(rank) for rank in list(self.pending)]
        return b"".join(line + b"\n" for line in held)


class LineFramer:
    """Cuts a byte stream into TAG-prefixed records, one per line."""

    def __init__(self, tag: bytes, max_line: int = MAX_LINE, mender: Optional[RankMender] = None) -> None:
        self.tag = tag
        self.max_line = max_line
        self.partial = b""
        self.mender = mender

    def feed(self, data: bytes) -> bytes:
        if not data:
            return b""
        if self.partial:
            data = self.partial + data
        end = data.rfind(b"\n") + 1
        self.partial = data[end:]
        out = b""
        complete = data[:end]
        if complete and self.mender is not None:
            complete = self.mender.mend(complete)
        if complete:
            # one replace over the chunk, not a bytes object per line: the node's
            # cores are the job's too
            out = self.tag + complete[:-1].replace(b"\n", b"\n" + self.tag) + b"\n"
        if len(self.partial) >= self.max_line:
            out += self.tag + self.partial + b"\n"
            self.partial = b""
        return out

    def finish(self) -> bytes:
        """Flush a final line that had no newline, and any torn line still held back."""
        rest = self.partial + b"\n" if self.partial else b""
        self.partial = b""
        if rest and self.mender is not None:
            rest = self.mender.mend(rest)
        if self.mender is not None:
            rest += self.mender.finish()
        if not rest:
            return b""
        return self.tag + rest[:-1].replace(b"\n", b"\n" + self.tag) + b"\n"



class Output:
    """Non-blocking writer for fd 1, so a stalled channel never stops the loop."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.chunks: List[bytes] = []
        self.current = b""
        self.offset = 0
        self.size = 0
        self.closed = False

    def add(self, data: bytes) -> None:
        if data and not self.closed:
            self.chunks.append(data)
            self.size += len(data)

    def flush(self) -> bool:
        """Write what the fd takes now; True when something was written."""
        wrote = False
        while not self.closed and self.size:
            if self.offset >= len(self.current):
                self.current = b"".join(self.chunks)
                self.chunks = []
                self.offset = 0
            try:
                n = os.write(self.fd, memoryview(self.current)[self.offset :])
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.close()
                break
            wrote = wrote or n > 0
            self.offset += n
            self.size -= n
        return wrote

    def close(self) -> None:
        self.closed = True
        self.chunks = []
        self.current = b""
        self.offset = 0
        self.size = 0


    def flush_all(self, stall: float) -> None:
        """Writes everything, waiting for the fd; gives up once it took nothing for ``stall`` seconds."""
        last_progress = time.monotonic()
        while self.size and not self.closed:
            if self.flush():
                last_progress = time.monotonic()
                continue
            if time.monotonic() - last_progress > stall:
                return
            try:
                select.select([], [self.fd], [], 0.2)
            except (OSError, ValueError):
                time.sleep(0.05)


class JobPipes:
    """The job's stdout and stderr, each cut into records by its own framer; in the loop's
    selector (as "pipe") while it reads them, out of it while ``paused``."""

    def __init__(self, sel: selectors.BaseSelector) -> None:
        self.sel = sel
        self.framers: Dict[int, LineFramer] = {}
        self.files: Dict[int, IO[bytes]] = {}
        self.paused = False

    def add(self, stream: IO[bytes], framer: LineFramer) -> None:
        fd = stream.fileno()
        self.framers[fd], self.files[fd] = framer, stream
        if not self.paused:
            self.sel.register(fd, selectors.EVENT_READ, "pipe")

    def read(self, fd: int) -> Optional[Tuple[bytes, int]]:
        """(records, bytes read) of one read; at the end of the pipe its last records, and
        it is closed; None when it had nothing after all."""
        try:
            data = os.read(fd, READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            data = b""
        if data:
            return self.framers[fd].feed(data), len(data)
        records = self.framers[fd].finish()
        self.close(fd)
        return records, 0

    def read_ready(self, budget: int) -> Optional[Tuple[bytes, int]]:
        """What the pipes hold right now (about ``budget`` bytes of records at most), without
        waiting: the job has ended, and its last lines go out before "exit"."""
        out: List[bytes] = []
        count, read_any = 0, False
        while self.framers and budget > 0:
            poller = select.poll()
            for fd in self.framers:
                poller.register(fd, select.POLLIN)
            ready = [fd for fd, _event in poller.poll(0)]
            if not ready:
                break
            for fd in ready:
                got = self.read(fd) if fd in self.framers else None
                if got is not None:
                    out.append(got[0])
                    count, read_any = count + got[1], True
                budget -= max(1, len(got[0]) if got else 0)
        return (b"".join(out), count) if read_any else None

    def pause(self) -> None:
        if not self.paused:
            self.paused = True
            for fd in self.framers:
                self.sel.unregister(fd)

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            for fd in self.framers:
                self.sel.register(fd, selectors.EVENT_READ, "pipe")

    def close(self, fd: int) -> None:
        if not self.paused:
            self.sel.unregister(fd)
        del self.framers[fd]
        # Closed through its file object: closing the bare fd would leave the object to
        # close it again at exit, when the number may be another file's (3.13 says so).
        self.files.pop(fd).close()

    def finish(self) -> bytes:
        """The last records of every pipe still open, which are then closed."""
        out = [self.framers[fd].finish() for fd in self.framers]
        for fd in list(self.framers):
            self.close(fd)
        return b"".join(out)
