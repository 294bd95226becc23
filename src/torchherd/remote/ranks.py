"""What the supervisor follows beside the job's pipes: the ranks' own output files, the
node's GPUs, and the run's coordinator.

Standard library and ``wire`` only, Python >= 3.8, Linux. Shipped to the nodes inside
the supervisor's program (``torchherd.remote.program``).
"""

from __future__ import annotations

import os
import re
import selectors
import shutil
import socket
import subprocess
from typing import Callable, Dict, List, Optional, Set, Tuple

# On a node these are the stand-in modules the shipped program registered; see
# torchherd/remote/__init__.py.
from torchherd.remote import wire
from torchherd.remote.framing import MAX_LINE, OUT_HIGH_WATER, READ_SIZE
from torchherd.remote.proctable import GONE_STATES, descendants, read_proc_table

COORD_CONNECT_TIMEOUT = 1.0
COORD_RETRY = 2.0
COORD_TRIES = 15
RANK_POLL = 0.05
"""Seconds between two reads of the ranks' files while the job is quiet."""
RANK_LOOK_EVERY = 0.1
"""Seconds between two looks for new rank files (an attempt starting, a restart)."""
PROGRESS_EVERY = 0.25
"""A rank's progress bar is reported at most this often."""
GPU_QUERY_TIMEOUT = 10.0
ELSEWHERE_EVERY = 1.0
"""Seconds between two searches of the whole process table for ranks outside the tree."""
Elsewhere = Callable[[], Set[int]]
"""The job's processes wherever they are on the node (``proctable.find_job_processes``:
by the run's id and the supervisor's token in their environment)."""


class CoordinatorLink:
    """The supervisor's TCP line to the run's coordinator on the master node."""

    def __init__(self, host: str, port: int, token: str, node: str) -> None:
        self.address = (host, port)
        self.hello = wire.hello_line(token, node)
        self.node = node
        self.sock: Optional[socket.socket] = None
        self.next_try = 0.0
        self.tries = 0
        self.gone = False
        self.partial = b""

    def connect(self, now: float) -> Optional[socket.socket]:
        """One try when it is due; the connected socket, else None."""
        if self.sock is not None or self.gone or now < self.next_try:
            return None
        self.tries += 1
        self.next_try = now + COORD_RETRY
        try:
            sock = socket.create_connection(self.address, timeout=COORD_CONNECT_TIMEOUT)
            sock.sendall(self.hello)
        except OSError:
            self.gone = self.tries >= COORD_TRIES
            return None
        sock.setblocking(False)
        self.sock = sock
        return sock

    def send(self, line: bytes) -> None:
        if self.sock is None:
            return
        try:
            self.sock.sendall(line)
        except OSError:
            pass

    def read(self) -> List[str]:
        """Complete lines received; [] and closed when the coordinator went away."""
        if self.sock is None:
            return []
        try:
            data = self.sock.recv(READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if not data:
            self.close()
            return []
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()[-4096:]
        return [line.decode("utf-8", "replace").strip() for line in lines]

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock = None
        self.gone = True

    def connect_in(self, sel: selectors.BaseSelector, now: float) -> bool:
        """``connect``, its socket then in the loop's selector (as "coord"); True when it connected."""
        sock = self.connect(now)
        if sock is not None:
            sel.register(sock.fileno(), selectors.EVENT_READ, "coord")
        return sock is not None

    def stop_reasons(self, sel: selectors.BaseSelector) -> List[str]:
        """Why the coordinator says to stop, from the lines it sent; out of the selector
        once it went away."""
        if self.sock is None:
            return []
        fd = self.sock.fileno()
        reasons = [wire.parse_stop(line) for line in self.read()]
        if self.sock is None:
            sel.unregister(fd)
        return [reason or "another node failed" for reason in reasons if reason is not None]

    def close_in(self, sel: selectors.BaseSelector) -> None:
        if self.sock is not None:
            sel.unregister(self.sock.fileno())
            self.close()



def visible_now(line: bytes) -> bytes:
    """What a terminal shows of a line still being redrawn: the text after its last
    ``\\r`` (a trailing ``\\r`` only moved the cursor)."""
    return line.rstrip(b"\r").rsplit(b"\r", 1)[-1]


def compact_redraws(partial: bytes) -> bytes:
    """A line without its newline yet, less the redraws a ``\\r`` has already covered:
    a progress bar held for hours stays one bar long, and its line is its final state."""
    cut = partial.rstrip(b"\r").rfind(b"\r")
    return partial[cut:] if cut > 0 else partial


class RankStream:
    """One rank's stdout or stderr file, read byte for byte as the rank wrote it (torchrun
    only redirects it there); cut into records with the rank's prefix. A line the rank is
    still redrawing with ``\\r`` is reported as progress, at most every PROGRESS_EVERY."""

    def __init__(self, path: str, tag: bytes, attempt: int, local_rank: int) -> None:
        self.path = path
        self.tag = tag
        self.attempt = attempt
        self.local_rank = local_rank
        self.fd: Optional[int] = None
        self.partial = b""
        self.head: Optional[bytes] = None
        """``TAG[torchherd-rank R] `` once the rank is known."""
        self.rank: Optional[int] = None
        self.shown = b""
        self.shown_at = 0.0

    def name(self, rank: Optional[int]) -> None:
        """The global rank; None when it could not be learned: the lines then go out as
        the node's own, saying which local rank printed them."""
        self.rank = rank
        if rank is None:
            self.head = self.tag + b"[local rank %d] " % self.local_rank
        else:
            self.head = self.tag + wire.RANK_PREFIX_HEAD + str(rank).encode() + wire.RANK_PREFIX_END

    def read(self, budget: int) -> bytes:
        """Records for what the file holds beyond what was read (up to ``budget`` bytes)."""
        if self.fd is None:
            try:
                self.fd = os.open(self.path, os.O_RDONLY)
            except OSError:
                return b""
        chunks: List[bytes] = []
        while budget > 0:
            try:
                data = os.read(self.fd, min(READ_SIZE, budget))
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
            budget -= len(data)
        return self._cut(b"".join(chunks)) if chunks else b""

    def _cut(self, data: bytes) -> bytes:
        assert self.head is not None
        data = self.partial + data
        end = data.rfind(b"\n") + 1
        complete, self.partial = data[:end], compact_redraws(data[end:])
        out = b""
        if complete:
            # one replace for the chunk, as LineFramer does: the node's cores are the job's
            out = self.head + complete[:-1].replace(b"\n", b"\n" + self.head) + b"\n"
        if len(self.partial) >= MAX_LINE:
            out += self.head + self.partial + b"\n"
            self.partial = b""
        return out

    def progress(self, now: float) -> bytes:
        """A progress record for the line being redrawn, when it changed and is due."""
        if b"\r" not in self.partial or now - self.shown_at < PROGRESS_EVERY:
            return b""
        shown = visible_now(self.partial)
        if shown == self.shown:
            return b""
        self.shown, self.shown_at = shown, now
        return wire.progress_record(self.rank, shown.decode("utf-8", "replace"))

    def flush(self) -> bytes:
        """The line being written, as a record of its own (the job has ended)."""
        out = self.head + self.partial + b"\n" if self.partial and self.head is not None else b""
        self.partial = b""
        return out

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def worker_ranks(pid: int, proc: str = "/proc") -> Optional[Tuple[int, int, int]]:
    """(restart count, global rank, local rank) from a torchrun worker's environment."""
    try:
        with open(proc + "/" + str(pid) + "/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return None
    found: Dict[bytes, bytes] = {}
    for entry in entries:
        key, _, value = entry.partition(b"=")
        if key in (b"RANK", b"LOCAL_RANK", b"TORCHELASTIC_RESTART_COUNT"):
            found[key] = value
    try:
        return int(found[b"TORCHELASTIC_RESTART_COUNT"]), int(found[b"RANK"]), int(found[b"LOCAL_RANK"])
    except (KeyError, ValueError):
        return None


class RankFiles:
    """The ranks' output as torchrun ``--redirects 3`` leaves it:
    ``LOG_DIR/<rendezvous id>_<random>/attempt_<N>/<local rank>/{stdout,stderr}.log``.

    torchrun's tee would read these files as text (a ``\\r`` becomes a line break) and
    copy them with a thread per rank (lines torn apart); read here, each file is whole
    and in order. torch numbers a node's ranks consecutively, so an attempt's global
    ranks are ``RANK - LOCAL_RANK`` of any of its workers plus each local rank, read from
    a worker's environment; a file is read only once its rank is known (the bytes wait
    in the file), and at the end, when no worker of its attempt was ever seen, its
    lines go out with their local rank."""

    def __init__(self, log_dir: str, root: int, progress: bool, base: Optional[int] = None,
                 elsewhere: Optional[Elsewhere] = None) -> None:
        self.log_dir = os.path.expanduser(log_dir)
        self.root = root
        self.elsewhere = elsewhere
        """Where the job's workers may be outside ``root``'s tree (a container: ``job_workers``)."""
        self.next_search = 0.0
        self.with_progress = progress
        self.streams: Dict[str, RankStream] = {}
        self.bases: Dict[int, int] = {}
        self.base = base
        """Every attempt's first global rank when the controller knew it (static rendezvous)."""
        self.next_look = 0.0

    def poll(self, now: float, budget: int = OUT_HIGH_WATER) -> bytes:
        """Records of everything new in the files (``budget`` bytes at most)."""
        if now >= self.next_look:
            self.next_look = now + RANK_LOOK_EVERY
            self._discover()
        if any(stream.head is None for stream in self.streams.values()):
            search = now >= self.next_search
            if search:
                self.next_search = now + ELSEWHERE_EVERY
            self._learn_ranks(search)
        out: List[bytes] = []
        for stream in self.streams.values():
            if stream.head is None or budget <= 0:
                continue
            data = stream.read(budget)
            budget -= len(data)
            out.append(data)
            if self.with_progress:
                out.append(stream.progress(now))
        return b"".join(out)

    def drain(self) -> bytes:
        """Everything in every file, last lines without a newline included: the job has
        ended (its workers with it, so a rank still unknown stays so)."""
        self._discover()
        self._learn_ranks()
        out: List[bytes] = []
        for stream in self.streams.values():
            if stream.head is None:
                stream.name(None)
            while True:
                data = stream.read(OUT_HIGH_WATER)
                if not data:
                    break
                out.append(data)
            out.append(stream.flush())
        return b"".join(out)

    def finish(self) -> bytes:
        """``drain`` once more (what leftovers wrote since), then every file is closed."""
        out = self.drain()
        for stream in self.streams.values():
            stream.close()
        return out

    def _discover(self) -> None:
        for path, tag, attempt, local_rank in self._files():
            if path not in self.streams:
                self.streams[path] = RankStream(path, tag, attempt, local_rank)

    def _files(self) -> List[Tuple[str, bytes, int, int]]:
        found: List[Tuple[str, bytes, int, int]] = []
        for run in _subdirs(self.log_dir):
            for attempt_name in _subdirs(run):
                match = re.match(r"attempt_(\d+)$", os.path.basename(attempt_name))
                if match is None:
                    continue
                for rank_dir in _subdirs(attempt_name):
                    local = os.path.basename(rank_dir)
                    if not local.isdigit():
                        continue
                    for name, tag in (("stdout.log", wire.TAG_STDOUT), ("stderr.log", wire.TAG_STDERR)):
                        found.append((rank_dir + "/" + name, tag, int(match.group(1)), int(local)))
        return found

    def _learn_ranks(self, search: bool = True) -> None:
        """Each attempt's first global rank: the controller's, else from the workers now alive
        (``search``: outside the tree too, where they may be)."""
        if self.base is None:
            for ranks in job_workers(self.root, self.elsewhere if search else None).values():
                self.bases.setdefault(ranks[0], ranks[1] - ranks[2])
        for stream in self.streams.values():
            base = self.bases.get(stream.attempt, self.base)
            if stream.head is None and base is not None:
                stream.name(base + stream.local_rank)


def _subdirs(path: str) -> List[str]:
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return []
    return [path + "/" + name for name in names if os.path.isdir(path + "/" + name)]


GPU_FIELDS = "index,utilization.gpu,memory.used,memory.total"
GPU_QUERIES = (
    GPU_FIELDS + ",clocks.sm,clocks.max.sm,power.draw,clocks_throttle_reasons.active",
    GPU_FIELDS + ",clocks.sm,clocks.max.sm,power.draw,clocks_event_reasons.active",
    GPU_FIELDS,
)
"""Tried in order until one answers: the clocks and throttle reasons name a GPU straggler;
drivers that renamed the reasons (``clocks_event_reasons``) or lack a field refuse the
whole query, and the last one is what every driver answers."""


class GpuSampler:
    """``nvidia-smi`` every few seconds where the node has it; never blocks the loop: the
    query runs as a child, and its output is read once it has ended."""

    def __init__(self, every: float) -> None:
        self.every = every
        self.path = shutil.which("nvidia-smi") if every > 0 else None
        self.proc: Optional["subprocess.Popen[bytes]"] = None
        self.started = 0.0
        self.next = 0.0
        self.query = 0
        """Which of GPU_QUERIES is asked."""

    def poll(self, now: float) -> bytes:
        """A gpu record when a query has just ended; starts the next one when due."""
        if self.path is None:
            return b""
        proc = self.proc
        if proc is not None:
            if proc.poll() is None and now - self.started < GPU_QUERY_TIMEOUT:
                return b""
            self.proc = None
            return self._record(proc)
        if now >= self.next:
            self.next, self.started = now + self.every, now
            try:
                argv = (self.path, "--query-gpu=" + GPU_QUERIES[self.query], "--format=csv,noheader,nounits")
                self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            except OSError:
                self.path = None
        return b""

    def _record(self, proc: "subprocess.Popen[bytes]") -> bytes:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        text = proc.stdout.read().decode("ascii", "replace")
        proc.stdout.close()
        gpus = [gpu for gpu in (gpu_sample(line) for line in text.splitlines()) if gpu is not None]
        if not gpus and proc.returncode not in (0, None) and self.query < len(GPU_QUERIES) - 1:
            self.query += 1  # a field this driver does not know: ask less
        return wire.gpu_record(gpus) if gpus else b""

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self._record(self.proc)
            self.proc = None
        self.path = None


def gpu_sample(line: str) -> Optional[List[float]]:
    """One GPU's line: [index, utilisation %, memory used, memory total] and, where the
    board reports them, [SM clock MHz, its maximum, power W, throttle reasons bitmask];
    None where the first four are not numbers ("[N/A]" on some boards: no sample rather
    than a wrong one)."""
    fields = [field.strip() for field in line.split(",")]
    try:
        sample: List[float] = [int(fields[0])] + [float(field) for field in fields[1:4]]
    except (ValueError, IndexError):
        return None
    try:
        more: List[float] = [float(fields[4]), float(fields[5]), float(fields[6]), int(fields[7], 16)]
    except (ValueError, IndexError):
        return sample
    return sample + more if more[1] > 0 else sample


BUSY_SAMPLE = 0.2
"""Seconds between two looks at the ranks' states."""
BUSY_LOOK = 2.0
"""Seconds between two searches for the ranks (a restart, a rank that ended)."""
ASLEEP = "S"
"""A rank blocked in a collective, on a socket or in a sleep (interruptible sleep)."""


def tree_of(root: int, proc: str = "/proc") -> List[int]:
    """The descendants of ``root``, read from each task's ``children`` file: a handful of
    reads, where the whole process table of a node (or of a test cluster of hundreds of
    nodes on one machine) is thousands; the whole table where the kernel has no such file."""
    found: List[int] = []
    stack = [root]
    while stack:
        pid = stack.pop()
        try:
            tasks = os.listdir("%s/%d/task" % (proc, pid))
        except OSError:
            continue
        for task in tasks:
            try:
                with open("%s/%d/task/%s/children" % (proc, pid, task), "rb") as file:
                    children = [int(child) for child in file.read().split()]
            except FileNotFoundError:
                return sorted(descendants(read_proc_table(proc), root))
            except (OSError, ValueError):
                continue
            found += children
            stack += children
    return found


def warm_client(pid: int, proc: str = "/proc") -> bool:
    """Whether ``pid`` is a warm Python's client (``remote/zygote.py``: ``PYTHON -I -S
    DIR/program.py client ...``, what torchrun started for a rank that was forked
    elsewhere): it carries the rank's variables, and sleeps while the rank works."""
    try:
        with open(proc + "/" + str(pid) + "/cmdline", "rb") as f:
            words = f.read().split(b"\0")
    except OSError:
        return False
    return words[1:3] == [b"-I", b"-S"] and len(words) > 4 and words[3].endswith(b"/program.py") \
        and words[4] == b"client"


def job_workers(root: int, elsewhere: Optional[Elsewhere] = None,
                proc: str = "/proc") -> Dict[int, Tuple[int, int, int]]:
    """torchrun's workers of the job, pid -> ``worker_ranks``: those in ``root``'s tree;
    where it holds none, those of ``elsewhere`` (given where the job runs in a container).
    podman's conmon, orphaned by its client, is adopted by the supervisor (a child
    subreaper), so a podman container's ranks are in the tree; a docker container's are
    the children of the daemon's shim, never of the client the supervisor started."""
    found: Dict[int, Tuple[int, int, int]] = {}
    for pids in (tree_of(root, proc), sorted(elsewhere()) if elsewhere is not None else []):
        for pid in pids:
            ranks = worker_ranks(pid, proc)
            if ranks is not None and not warm_client(pid, proc):
                found[pid] = ranks
        if found:
            break
    return found


class BusySampler:
    """How much of the time the node's ranks are busy rather than asleep: the state letter
    of each rank (its main thread) five times a second, reported as counts every few
    seconds. In a synchronous job every rank waits in each collective for the slowest;
    the ranks of the node the others wait for never do: running, runnable (waiting for a
    CPU, a throttled cgroup), stopped (``cpulimit``'s SIGSTOP) or in disk I/O. The ranks
    are looked for as ``job_workers`` finds them (``elsewhere``: in a container)."""

    def __init__(self, root: int, every: float, elsewhere: Optional[Elsewhere] = None) -> None:
        self.root, self.every, self.elsewhere = root, every, elsewhere
        self.pids: Tuple[int, ...] = ()
        self.samples = self.busy = 0
        self.next_look = self.next_sample = 0.0
        self.next_report: Optional[float] = None

    def poll(self, now: float) -> bytes:
        """A busy record when one is due and a rank was seen; samples when due."""
        if self.every <= 0:
            return b""
        if now >= self.next_look:
            self.next_look = now + BUSY_LOOK
            self.pids = tuple(sorted(job_workers(self.root, self.elsewhere)))
        if self.pids and now >= self.next_sample:
            self.next_sample = now + BUSY_SAMPLE
            for _parent, state in read_proc_table(pids=self.pids).values():
                if state not in GONE_STATES:
                    self.samples += 1
                    self.busy += state != ASLEEP
        if self.next_report is None:
            self.next_report = now + self.every
        if now < self.next_report:
            return b""
        self.next_report = now + self.every
        samples, busy, self.samples, self.busy = self.samples, self.busy, 0, 0
        return wire.busy_record(samples, busy) if samples else b""


# -------------------------------------------------------------- supervisor
