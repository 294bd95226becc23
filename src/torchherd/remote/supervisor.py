"""torchherd node supervisor: runs one job on a node and leaves nothing behind.

Standard library and ``wire`` only, Python >= 3.8, Linux. The controller runs it
over SSH (no PTY) as ``PYTHON -u -c PROGRAM - RUN_ID`` (``torchherd.remote.program``)
and sends its config (``wire.SupervisorConfig``) as the first line of stdin; the
config may also be ``argv[1]``. Stdin and stdout are the SSH channel; what goes
over them, and every config key, is defined in ``wire``.

Detached mode (``log_file`` set): records are appended to the log file instead of
stdout; the supervisor forks into its own session, stdin from /dev/null (no EOF
teardown, no watchdog), and the parent prints the child's first status record
("started" or "error") and exits. A ``state_file`` is written at start and at the
end; with a ``coordinator`` the supervisor says HELLO to it, EXIT when the job ends,
and tears its job down on a STOP line (fail fast with no controller).

Stdin: every byte counts as a heartbeat from the controller; a TERM line asks for
a graceful teardown, KILL for an immediate SIGKILL teardown. EOF on stdin,
EOF/EPIPE on stdout, SIGTERM/SIGINT/SIGHUP to the supervisor and the watchdog all
start a graceful teardown; a second request while a graceful teardown runs
escalates it to SIGKILL. A line longer than MAX_LINE bytes is cut into several
records; every record the job's output makes comes before its "exit" event.

Job processes: every live descendant of the supervisor (it is a child
subreaper, so orphans stay in its tree) plus every process whose initial
environment holds TORCHHERD_RUN_ID=<run_id> and this supervisor's own
TORCHHERD_SUPERVISOR token (which only the processes it started inherit: a run
id alone is a name anyone can set, and another token is a sibling supervisor's
of the same run on the same process table), less the supervisor and its ancestors.
When the job's main process exits by itself, leftovers are swept the same way.

Exit status (= "code" in done): the job's exit status, 128+N when it died on
signal N (143 after a SIGTERM teardown, 137 after SIGKILL), 137 when it could
not be reaped after SIGKILL, 127/126 when the command was not found / not
executable, 2 for an invalid config.
"""

from __future__ import annotations

import json
import os
import re
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import IO, Dict, List, Mapping, Optional, Set, Tuple

# On a node this is the stand-in module the shipped program registered; see
# torchherd/remote/__init__.py.
from torchherd.remote import wire

EXIT_BAD_CONFIG = 2
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
EXIT_UNKILLABLE = 128 + 9

READ_SIZE = 65536
MAX_LINE = 1 << 20
OUT_HIGH_WATER = 8 << 20
OUT_LOW_WATER = 2 << 20
POLL_INTERVAL = 0.05
COALESCE_BELOW = 16384
COALESCE_DELAY = 0.002
KILL_TIMEOUT = 5.0
DRAIN_IDLE_TIMEOUT = 2.0
FINAL_FLUSH_STALL = 10.0
PR_SET_CHILD_SUBREAPER = 36
LEFTOVER = "leftover"
TEE_DIR_PREFIX = "torchherd-"
MAX_HELD_RANKS = 4096
"""Ranks with a torn line held at once (a node runs far fewer); beyond, all are let go."""
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


def exit_code_from_status(status: int) -> int:
    """A wait() status as a shell would report it: code, or 128+signal."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    return 1


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


# ---------------------------------------------------------------- processes

ProcTable = Dict[int, Tuple[int, str]]


def read_proc_table(proc: str = "/proc") -> ProcTable:
    """pid -> (ppid, state letter) for every process visible in /proc."""
    table: ProcTable = {}
    try:
        names = os.listdir(proc)
    except OSError:
        return table
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(proc + "/" + name + "/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        end = data.rfind(b")")
        fields = data[end + 2 :].split()
        if len(fields) < 2:
            continue
        try:
            table[int(name)] = (int(fields[1]), fields[0].decode("ascii", "replace"))
        except ValueError:
            continue
    return table


def descendants(table: ProcTable, root: int) -> Set[int]:
    children: Dict[int, List[int]] = {}
    for pid, (ppid, _state) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: Set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found and child != root:
                found.add(child)
                stack.append(child)
    return found


def ancestors(table: ProcTable, pid: int) -> Set[int]:
    found: Set[int] = set()
    while pid in table and pid not in found:
        found.add(pid)
        pid = table[pid][0]
    return found


def environ_belongs(pid: int, run_id: str, token: Optional[str], proc: str = "/proc") -> bool:
    """True when the process's environment marks it as this supervisor's job: the run id
    and, given a ``token``, this supervisor's own token (TORCHHERD_SUPERVISOR), which only
    the processes it started inherit. The run id alone is a name anyone can put in an
    environment; another supervisor's token is a sibling node's on this process table.
    """
    try:
        with open(proc + "/" + str(pid) + "/environ", "rb") as f:
            data = f.read()
    except OSError:
        return False
    run_entry = (wire.RUN_ID_ENV + "=" + run_id).encode()
    if run_entry not in data:
        return False
    entries = data.split(b"\0")
    if run_entry not in entries:
        return False
    if token is not None:
        return (wire.SUPERVISOR_ENV + "=" + token).encode() in entries
    return True


def find_job_processes(
    run_id: str, token: Optional[str], root: int, proc: str = "/proc"
) -> Set[int]:
    """Live processes of this run: descendants of root, plus environ matches."""
    table = read_proc_table(proc)
    live = {pid for pid, (_pp, state) in table.items() if state not in ("Z", "X", "x")}
    found = descendants(table, root) & live
    exclude = ancestors(table, root) | {root}
    for pid in live:
        if pid in found or pid in exclude:
            continue
        if environ_belongs(pid, run_id, token, proc):
            found.add(pid)
    return found


def send_signal(pids: Set[int], sig: int) -> Set[int]:
    sent: Set[int] = set()
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            continue
        sent.add(pid)
    return sent


def set_child_subreaper() -> bool:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except Exception:
        return False


# ------------------------------------------------------------------- output


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


def write_json_atomic(path: str, fields: Mapping[str, object]) -> None:
    """Readers (torchherd status over SSH) never see a half-written file."""
    path = os.path.expanduser(path)
    tmp = "%s.%d.tmp" % (path, os.getpid())
    # 0600: it holds the supervisor's token. Modes are given per file, not by umask: the
    # job inherits the supervisor's umask, and its own files are the user's business.
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(fields, f, separators=(",", ":"))
    os.replace(tmp, path)


def make_private_dirs(path: str, run_id: str) -> None:
    """``os.makedirs`` with every directory it makes 0700; ``path`` itself is made 0700 when
    it is the run's own directory (named after the run id), whoever made it."""
    old = os.umask(0o077)
    try:
        os.makedirs(path, exist_ok=True)
    finally:
        os.umask(old)
    if os.path.basename(path.rstrip("/")) == run_id:
        os.chmod(path, 0o700)


def make_private_dir(path: str) -> Optional[str]:
    """Creates torchrun's log directory, mode 0700; None when done, else why not. One that
    already exists is refused: its name is guessable (the run id is in every process
    list), and another user who made it first could read the ranks' output, or plant
    files the supervisor would report as theirs."""
    path = os.path.expanduser(path).rstrip("/")
    if not os.path.basename(path).startswith(TEE_DIR_PREFIX):
        return "%s: not a torchherd directory name" % path
    try:
        os.mkdir(path, 0o700)  # atomic: it is ours, or it fails
    except FileExistsError:
        return ("%s already exists (another user's, or left by a run): refusing to use it; "
                "remove it if it is yours" % path)
    except OSError as exc:
        return "%s: cannot create it: %s" % (path, exc.strerror)
    return None


def remove_tee_dir(path: str) -> None:
    """Removes torchrun's per-rank tee directory; any other name is refused, so a
    bad config can never delete something that is not the run's own."""
    path = os.path.expanduser(path).rstrip("/")
    if os.path.basename(path).startswith(TEE_DIR_PREFIX):
        shutil.rmtree(path, ignore_errors=True)


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


# ------------------------------------------------------ rank files and GPUs


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

    def __init__(self, log_dir: str, root: int, progress: bool, base: Optional[int] = None) -> None:
        self.log_dir = os.path.expanduser(log_dir)
        self.root = root
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
            self._learn_ranks()
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

    def _learn_ranks(self) -> None:
        """Each attempt's first global rank: the controller's, else from the workers now alive."""
        if self.base is None:
            table = read_proc_table()
            for pid in descendants(table, self.root):
                ranks = worker_ranks(pid)
                if ranks is not None:
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


class GpuSampler:
    """``nvidia-smi`` every few seconds where the node has it; never blocks the loop: the
    query runs as a child, and its output is read once it has ended."""

    QUERY = ("--query-gpu=index,utilization.gpu,memory.used,memory.total", "--format=csv,noheader,nounits")

    def __init__(self, every: float) -> None:
        self.every = every
        self.path = shutil.which("nvidia-smi") if every > 0 else None
        self.proc: Optional["subprocess.Popen[bytes]"] = None
        self.started = 0.0
        self.next = 0.0

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
                self.proc = subprocess.Popen((self.path,) + self.QUERY, stdin=subprocess.DEVNULL,
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
        gpus: List[Tuple[int, float, float, float]] = []
        for line in text.splitlines():
            fields = [field.strip() for field in line.split(",")]
            try:
                gpus.append((int(fields[0]), float(fields[1]), float(fields[2]), float(fields[3])))
            except (ValueError, IndexError):
                continue  # "[N/A]" on some boards: no sample rather than a wrong one
        return wire.gpu_record(gpus) if gpus else b""

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self._record(self.proc)
            self.proc = None
        self.path = None


# -------------------------------------------------------------- supervisor


class Teardown:
    def __init__(self, reason: str, kill_now: bool, now: float, grace: float) -> None:
        self.reason = reason
        self.kill_phase = kill_now
        self.term_deadline = now + grace
        self.kill_deadline = now + KILL_TIMEOUT
        self.next_poll = now
        self.signalled: Set[int] = set()
        self.killed: Set[int] = set()
        self.complete = False
        self.gave_up = False
        self.left = 0

    def escalate(self, now: float) -> None:
        if not self.kill_phase and not self.complete:
            self.kill_phase = True
            self.kill_deadline = now + KILL_TIMEOUT
            self.next_poll = now


class Supervisor:
    def __init__(self, config: wire.SupervisorConfig, notify_fd: Optional[int] = None) -> None:
        self.cfg = config
        self.notify_fd = notify_fd
        self.detached = config.log_file is not None
        self.link: Optional[CoordinatorLink] = None
        coordinator = config.coordinator
        if coordinator is not None:
            self.link = CoordinatorLink(coordinator.host, coordinator.port, coordinator.token, config.node)
        self.token = os.urandom(8).hex()
        self.pid = os.getpid()
        self.out = Output(1)
        self.sel = selectors.PollSelector()
        self.proc: Optional["subprocess.Popen[bytes]"] = None
        self.code: Optional[int] = None
        self.teardown: Optional[Teardown] = None
        self.signals: List[int] = []
        self.child_exited = True
        self.got = 0
        self.stdin_open = True
        self.stdin_partial = b""
        self.stdin_pending = b""
        self.last_in = time.monotonic()
        self.next_heartbeat = self.last_in + config.heartbeat
        self.pipes: Dict[int, LineFramer] = {}
        self.streams: Dict[int, IO[bytes]] = {}
        self.paused = False
        self.last_data = self.last_in
        self.writing = False
        self.wake_r, self.wake_w = os.pipe()
        self.made_dir = False
        # The ranks' own files (torchrun --redirects) and GPU samples; progress bars and
        # GPUs only feed a live view, so a detached run's log is spared them.
        self.ranks = (RankFiles(config.rank_logs, self.pid, not self.detached, config.rank_base)
                      if config.rank_logs else None)
        self.gpus = GpuSampler(0.0 if self.detached else config.gpu_every)
        self.state: wire.NodeStateFile = {
            "run_id": config.run_id, "node": config.node, "supervisor": self.pid,
            "start": wire.process_start(self.pid), "token": self.token,
            "started": time.time(), "state": wire.STATE_RUNNING,
        }

    # signals ------------------------------------------------------------
    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signals.append(signum)

    def _install_signals(self) -> None:
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, self._on_signal)
        self.sel.register(self.wake_r, selectors.EVENT_READ, "wake")

    def _handle_signals(self, now: float) -> None:
        pending, self.signals = self.signals, []
        for signum in pending:
            if signum == signal.SIGCHLD:
                self.child_exited = True
                continue
            name = signal.Signals(signum).name
            self.request_teardown("signal " + name, False, now, escalate=True)

    # job ------------------------------------------------------------------
    def _spawn(self) -> bool:
        cfg = self.cfg
        if cfg.cleanup_dir:
            refused = make_private_dir(cfg.cleanup_dir)
            if refused is not None:
                self.code = 1
                self._announce(wire.error_record("cannot start job: torchrun's log directory " + refused))
                return False
            self.made_dir = True
        env = dict(os.environ)
        env.update(cfg.env)
        env[wire.RUN_ID_ENV] = cfg.run_id
        env[wire.SUPERVISOR_ENV] = self.token
        cwd = os.path.expanduser(cfg.cwd) if cfg.cwd else None
        argv = list(cfg.argv)
        if argv[0] == "~" or argv[0].startswith("~/"):  # the python, by the rule every command follows
            argv[0] = os.path.expanduser(argv[0])
        try:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                env=env,
                cwd=cwd,
            )
        except OSError as exc:
            self.code = (
                EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) else EXIT_NOT_EXECUTABLE
            )
            self._announce(wire.error_record("cannot start job: %s" % exc))
            return False
        try:
            pgid = os.getpgid(self.proc.pid)
        except OSError:
            pgid = self.proc.pid
        self.state["pid"], self.state["pgid"] = self.proc.pid, pgid
        self._announce(wire.started_record(self.proc.pid, pgid, self.pid))
        assert self.proc.stdout is not None and self.proc.stderr is not None
        for stream, tag in ((self.proc.stdout, wire.TAG_STDOUT), (self.proc.stderr, wire.TAG_STDERR)):
            fd = stream.fileno()
            marker = self.cfg.rank_marker
            self.pipes[fd] = LineFramer(tag, mender=RankMender(marker.encode()) if marker else None)
            self.streams[fd] = stream
            self.sel.register(fd, selectors.EVENT_READ, "pipe")
        return True

    def _announce(self, record: bytes) -> None:
        """The first status record: to the output, the state file, and (detached)
        to the parent that waits for it to say the job is running."""
        self.out.add(record)
        self._write_state()
        if self.notify_fd is not None:
            try:
                os.write(self.notify_fd, record)
            except OSError:
                pass
            os.close(self.notify_fd)
            self.notify_fd = None

    def _write_exited(self, code: int, left: int) -> None:
        self.state.update({"state": wire.STATE_EXITED, "code": code, "ended": time.time(), "left": left})
        self._write_state()

    def _write_state(self) -> None:
        if self.cfg.state_file:
            try:
                write_json_atomic(self.cfg.state_file, self.state)
            except OSError:
                pass

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            except InterruptedError:
                continue
            if pid == 0:
                return
            if self.proc is not None and pid == self.proc.pid:
                self.code = exit_code_from_status(status)
                self.proc.returncode = self.code
                self._drain_ready()
                if self.ranks is not None:
                    self.out.add(self.ranks.drain())
                self.out.add(wire.exit_record(self.code))
                if self.link is not None:
                    self.link.send(wire.exit_line(self.cfg.node, self.code))

    def _scan(self) -> Set[int]:
        return find_job_processes(self.cfg.run_id, self.token, self.pid)

    # teardown ---------------------------------------------------------------
    def request_teardown(
        self,
        reason: str,
        kill_now: bool,
        now: float,
        escalate: bool = False,
        announce: bool = True,
    ) -> None:
        td = self.teardown
        if td is not None:
            if (kill_now or escalate) and not td.complete:
                td.escalate(now)
            return
        self.teardown = Teardown(reason, kill_now, now, self.cfg.grace)
        if announce:
            self.out.add(wire.stopping_record(reason, wire.MODE_KILL if kill_now else wire.MODE_TERM))

    def _step_teardown(self, now: float) -> None:
        td = self.teardown
        if td is None or td.complete or now < td.next_poll:
            return
        td.next_poll = now + POLL_INTERVAL
        self._reap()
        pids = self._scan()
        if not pids:
            self._reap()
            self._finish_teardown(td, 0)
            return
        if not td.kill_phase and now >= td.term_deadline:
            td.kill_phase = True
            td.kill_deadline = now + KILL_TIMEOUT
        if td.kill_phase:
            if now >= td.kill_deadline:
                td.gave_up = True
                self._finish_teardown(td, len(pids))
                return
            td.killed |= send_signal(pids, signal.SIGKILL)
        else:
            td.signalled |= send_signal(pids - td.signalled, signal.SIGTERM)

    def _finish_teardown(self, td: Teardown, left: int) -> None:
        td.complete = True
        td.left = left
        self.last_data = time.monotonic()
        if td.reason != LEFTOVER or td.signalled or td.killed:
            self.out.add(wire.teardown_record(td.reason, td.signalled, td.killed))

    # io -------------------------------------------------------------------
    def _read_pipe(self, fd: int) -> None:
        try:
            data = os.read(fd, READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        framer = self.pipes[fd]
        self.last_data = time.monotonic()
        if data:
            self.got += len(data)
            self.out.add(framer.feed(data))
            return
        self.out.add(framer.finish())
        self._close_pipe(fd)

    def _drain_ready(self) -> None:
        """Read what the pipes hold right now, so it goes out before "exit"."""
        budget = OUT_HIGH_WATER
        while self.pipes and budget > 0:
            poller = select.poll()
            for fd in self.pipes:
                poller.register(fd, select.POLLIN)
            ready = [fd for fd, _ev in poller.poll(0)]
            if not ready:
                return
            for fd in ready:
                if fd in self.pipes:
                    before = self.out.size
                    self._read_pipe(fd)
                    budget -= max(1, self.out.size - before)

    def _read_ranks(self, now: float) -> None:
        """What the ranks wrote to their files since the last look, as far as the output
        buffer takes it (the rest waits in the files: a rank never blocks on it)."""
        budget = OUT_HIGH_WATER - self.out.size
        if self.ranks is not None and budget > 0:
            data = self.ranks.poll(now, budget)
            self.got += len(data)
            self.out.add(data)
        if self.teardown is None:
            self.out.add(self.gpus.poll(now))

    def _close_pipe(self, fd: int) -> None:
        if not self.paused:
            self.sel.unregister(fd)
        del self.pipes[fd]
        # Closed through its file object: closing the bare fd would leave the object to
        # close it again at exit, when the number may be another file's (3.13 says so).
        self.streams.pop(fd).close()

    def _read_stdin(self, now: float) -> None:
        try:
            data = os.read(0, READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.stdin_open = False
            self.sel.unregister(0)
            self.request_teardown("stdin closed", False, now)
            return
        self._stdin_data(data, now)

    def _stdin_data(self, data: bytes, now: float) -> None:
        self.last_in = now
        lines = (self.stdin_partial + data).split(b"\n")
        self.stdin_partial = lines.pop()[-64:]
        for line in lines:
            level = wire.parse_control(line)
            if level is not None:
                self.request_teardown("control " + str(level.value), level is wire.StopLevel.KILL, now)

    def _update_registrations(self) -> None:
        if not self.paused and self.out.size > OUT_HIGH_WATER:
            self.paused = True
            for fd in self.pipes:
                self.sel.unregister(fd)
        elif self.paused and self.out.size < OUT_LOW_WATER:
            self.paused = False
            self.last_data = time.monotonic()
            for fd in self.pipes:
                self.sel.register(fd, selectors.EVENT_READ, "pipe")
        want_write = self.out.size > 0 and not self.out.closed
        if want_write != self.writing:
            self.writing = want_write
            if want_write:
                self.sel.register(1, selectors.EVENT_WRITE, "out")
            else:
                self.sel.unregister(1)

    def _finished(self, now: float) -> bool:
        td = self.teardown
        if td is None or not td.complete:
            return False
        if self.code is None and not td.gave_up:
            return False
        if self.pipes and (self.paused or now - self.last_data < DRAIN_IDLE_TIMEOUT):
            return False
        return True

    def _timeout(self, now: float) -> float:
        deadlines: List[float] = []
        if self.cfg.heartbeat > 0:
            deadlines.append(self.next_heartbeat)
        td = self.teardown
        if td is None:
            if self.stdin_open and self.cfg.watchdog > 0:
                deadlines.append(self.last_in + self.cfg.watchdog)
        elif not td.complete:
            deadlines.append(td.next_poll)
        elif self.pipes:
            deadlines.append(self.last_data + DRAIN_IDLE_TIMEOUT)
        if self.ranks is not None:
            deadlines.append(now + RANK_POLL)  # files have no readiness to wait on
        if not deadlines:
            return 1.0
        return min(1.0, max(0.0, min(deadlines) - now))

    def _timers(self, now: float) -> None:
        if self.cfg.heartbeat > 0 and now >= self.next_heartbeat:
            self.out.add(wire.HEARTBEAT_RECORD)
            self.next_heartbeat = now + self.cfg.heartbeat
        if (
            self.teardown is None
            and self.stdin_open
            and self.cfg.watchdog > 0
            and now - self.last_in >= self.cfg.watchdog
        ):
            self.request_teardown(
                "watchdog: no word from the controller for %gs" % self.cfg.watchdog,
                False,
                now,
            )
        if self.teardown is None and self.code is not None:
            self.request_teardown(LEFTOVER, False, now, announce=False)
        self._link_connect(now)

    # coordinator ------------------------------------------------------------
    def _link_connect(self, now: float) -> None:
        link = self.link
        if link is None:
            return
        if self.code is not None and link.sock is None and link.tries:
            # the job is over and the coordinator was out of reach: nobody to tell
            return
        sock = link.connect(now)
        if sock is None:
            return
        self.sel.register(sock.fileno(), selectors.EVENT_READ, "coord")
        if self.code is not None:
            link.send(wire.exit_line(self.cfg.node, self.code))

    def _read_link(self, now: float) -> None:
        link = self.link
        if link is None or link.sock is None:
            return
        fd = link.sock.fileno()
        for line in link.read():
            reason = wire.parse_stop(line)
            if reason is not None:
                self.request_teardown("coordinator: " + (reason or "another node failed"), False, now)
        if link.sock is None:
            self.sel.unregister(fd)

    def _close_link(self) -> None:
        link = self.link
        if link is not None and link.sock is not None:
            self.sel.unregister(link.sock.fileno())
            link.close()

    # main -----------------------------------------------------------------
    def run(self) -> int:
        set_child_subreaper()
        self._install_signals()
        self._register_stdin()
        if not self._spawn():
            code = self.code if self.code is not None else EXIT_NOT_EXECUTABLE
            if self.cfg.cleanup_dir and self.made_dir:
                remove_tee_dir(self.cfg.cleanup_dir)
            self._write_exited(code, 0)
            self.out.add(wire.done_record(code, 0))
            self._final_flush()
            return code
        if self.stdin_pending:
            # control lines that came right behind the config line on stdin
            self._stdin_data(self.stdin_pending, time.monotonic())
        while not self._iterate():
            pass
        return self._finish()

    def _register_stdin(self) -> None:
        try:
            if self.detached:
                # stdin is /dev/null: its EOF means nothing, and nobody sends heartbeats
                self.stdin_open = False
            else:
                self.sel.register(0, selectors.EVENT_READ, "stdin")
        except (OSError, ValueError):
            self.stdin_open = False

    def _iterate(self) -> bool:
        """One turn of the loop: read, react, write; True once the run is over."""
        now = time.monotonic()
        if self.out.closed and self.teardown is None:
            self.request_teardown("output closed", False, now)
        for key, _mask in self.sel.select(self._timeout(now)):
            self._dispatch(key, time.monotonic())
        now = time.monotonic()
        self._handle_signals(now)
        self._read_ranks(now)
        if self.child_exited:
            self.child_exited = False
            self._reap()
        self._timers(now)
        self._step_teardown(now)
        self.out.flush()
        if self._finished(time.monotonic()):
            return True
        self._update_registrations()
        if 0 < self.got < COALESCE_BELOW and self.teardown is None:
            # output trickles in line by line: let it pile up a moment,
            # so that one read and one write carry many lines
            time.sleep(COALESCE_DELAY)
        self.got = 0
        return False

    def _dispatch(self, key: selectors.SelectorKey, now: float) -> None:
        if key.data == "pipe":
            if key.fd in self.pipes:
                self._read_pipe(key.fd)
        elif key.data == "stdin":
            self._read_stdin(now)
        elif key.data == "coord":
            self._read_link(now)
        elif key.data == "wake":
            try:
                os.read(self.wake_r, 4096)
            except OSError:
                pass

    def _finish(self) -> int:
        """Flushes the last output, reports ``done`` and returns the exit code."""
        if self.ranks is not None:
            self.out.add(self.ranks.finish())
        self.gpus.stop()
        for fd in list(self.pipes):
            self.out.add(self.pipes[fd].finish())
            self._close_pipe(fd)
        td = self.teardown
        code = self.code if self.code is not None else EXIT_UNKILLABLE
        left = td.left if td is not None else 0
        self._close_link()
        if self.cfg.cleanup_dir and self.made_dir:  # never one this supervisor did not make
            remove_tee_dir(self.cfg.cleanup_dir)
        self.out.add(wire.done_record(code, left))
        self._final_flush()
        self._write_exited(code, left)
        return code

    def _final_flush(self) -> None:
        if self.writing:
            self.sel.unregister(1)
            self.writing = False
        last_progress = time.monotonic()
        while self.out.size and not self.out.closed:
            if self.out.flush():
                last_progress = time.monotonic()
                continue
            if time.monotonic() - last_progress > FINAL_FLUSH_STALL:
                return
            try:
                select.select([], [1], [], 0.2)
            except (OSError, ValueError):
                time.sleep(0.05)


def detach(config: wire.SupervisorConfig) -> int:
    """Forks the supervisor into its own session, writing its records to the log
    file; returns once the job has started (or failed to), so that the SSH
    command ends while the job runs on."""
    log = os.path.expanduser(config.log_file or "")
    if os.path.dirname(log):
        make_private_dirs(os.path.dirname(log), config.run_id)
    ready_r, ready_w = os.pipe()
    if os.fork() > 0:
        os.close(ready_w)
        first = b""
        while True:
            chunk = os.read(ready_r, READ_SIZE)
            if not chunk:
                break
            first += chunk
        if not first:
            first = wire.error_record("the detached supervisor died at start")
        os.write(1, first)
        return 0 if first.startswith(wire.status_head(wire.EVENT_STARTED)) else 1
    os.close(ready_r)
    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(null)
        os.close(out)
        code = Supervisor(config, notify_fd=ready_w).run()
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def read_config_line() -> Tuple[str, bytes]:
    """The config as the first line of stdin, and whatever followed it. The config holds
    the job's environment: on the command line every user of the node could read it."""
    data = b""
    while b"\n" not in data:
        chunk = os.read(0, READ_SIZE)
        if not chunk:
            break
        data += chunk
    line, _, rest = data.partition(b"\n")
    return line.decode("utf-8", "replace"), rest


def main(args: List[str]) -> int:
    # "- RUN_ID": the config comes on stdin; the run id stays on the command line only
    # so that ``status``/``stop`` can tell this run's supervisor from a reused pid.
    if not (len(args) == 1 or (len(args) == 2 and args[0] == "-")):
        sys.stderr.write("usage: supervisor.py JSON_CONFIG | - [RUN_ID]  (- reads the config from stdin)\n")
        return EXIT_BAD_CONFIG
    text, pending = read_config_line() if args[0] == "-" else (args[0], b"")
    try:
        config = wire.SupervisorConfig.from_json(text)
    except wire.ConfigError as exc:
        record = wire.error_record(str(exc)) + wire.done_record(EXIT_BAD_CONFIG, 0)
        os.write(1, record)
        return EXIT_BAD_CONFIG
    if config.log_file:
        return detach(config)
    flags = None
    try:
        flags = os.get_blocking(1)
        os.set_blocking(1, False)
    except OSError:
        pass
    try:
        supervisor = Supervisor(config)
        supervisor.stdin_pending = pending
        return supervisor.run()
    finally:
        if flags is not None:
            try:
                os.set_blocking(1, flags)
            except OSError:
                pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
