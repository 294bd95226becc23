"""torchherd job pace, on a node: how fast the job goes, and a replication's cap kept to it.

Standard library only, Python >= 3.8, Linux. Two sides on the same node:

- The supervisor (``PaceWriter``), while it watches a checkpoint for replication, writes the
  job's counters every ``WRITE_EVERY`` seconds to ``pace_path(run_id, node)`` (in the run's
  own 0700 directory under ``~/.torchherd/runs``, atomically): the lines the job has written
  and the CPU seconds its processes have used, both since it started, with the monotonic
  time of the look (one clock for every process of the node).
- A replication's source (``checkpoint.py relay``) keeps its sending rate with a
  ``Governor``: from those counters it knows the job's pace (lines a second, CPU seconds a
  second) with nothing copied (``QUIET_SECONDS`` without sending, at the start and again
  every ``REBASE_SECONDS``: the job's own pace drifts), then, every period while it sends
  (``PERIOD_SECONDS``, longer for a job that prints less: ``PERIOD_LINES``), whether the job went slower than that by more than ``TOLERANCE``: then the rate
  is halved (down to ``floor``), else raised by a step (up to ``ceiling``). AIMD, as TCP
  shares a link: the cap settles just under what the job stands, and a job that slows for
  any reason (the copy's packets, the pages it writes, another program) gets its CPU back
  within a period.

Why the job's own pace rather than a priority or a fixed cap: what a copy costs a job is
mostly not the copy program's CPU (that runs at ``SCHED_IDLE``) but the kernel's work for
it (the packets, the page cache), done on the cores the ranks run on and lowered by no
priority; how much that is depends on the cores, the NIC and the job, and only the job's
pace shows it. A job whose counters move too little to tell (it prints a line a minute and
waits on a GPU) keeps the starting cap: nothing is guessed from noise.
"""

from __future__ import annotations

import json
import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Tuple

    Sample = Tuple[float, float, float]
    """(monotonic time, lines, CPU seconds): the job's counters at one look."""

WRITE_EVERY = 0.5
"""Seconds between two writes of the counters by the supervisor: a period holds two."""
PERIOD_SECONDS = 1.0
"""Seconds between two decisions of the governor at least: short enough that a job slowed
by the copy is slowed for about a second, long enough that a busy job's CPU seconds (100
clock ticks a core) tell a 3 % change from noise."""
PERIOD_LINES = 100.0
"""Lines a period holds at the quiet pace, at least (its length grows to hold them, up to
``LONGEST_PERIOD``): a count of 30 moves by 3 % with one line more or less."""
LONGEST_PERIOD = 5.0
QUIET_SECONDS = 2.0
"""Seconds without sending that measure the job's own pace."""
REBASE_SECONDS = 30.0
"""Seconds of sending between two quiet measures: the job's pace drifts (an evaluation, a
data loader's epoch), and a stale baseline would hold the copy too low or too high. The
quiet parts cost the copy a fifteenth of its time."""
TOLERANCE = 0.03
"""The job counts as slowed when its pace falls below the quiet one by more than this:
under the 5 % a replication may cost, above the noise of a period's counts."""
DECREASE = 0.5
"""The rate's cut when the job slowed (multiplicative decrease)."""
INCREASE = 0.125
"""The rate's raise when it did not, as a share of the starting rate (additive increase):
eight periods from the start to twice it."""
FLOOR_SHARE = 0.125
"""The lowest rate, as a share of the starting one: a copy always ends (a 1 GB copy at
10 MB/s's eighth takes under 14 minutes), while costing the job next to nothing."""
CEILING_SHARE = 4.0
"""The highest rate, as a share of the starting one (and never above the link's share)."""
MIN_LINES = 10.0
"""Lines a second, with nothing copied, below which the line rate says nothing."""
MIN_CPU = 0.1
"""CPU seconds a second (a tenth of a core), with nothing copied, below which the CPU
share says nothing."""
READ_EVERY = 0.25
"""Seconds between two reads of the counters by the source (it sends a block every few
milliseconds: one read each would cost more than the block)."""
SLOWEST_SHARE = FLOOR_SHARE * REBASE_SECONDS / (REBASE_SECONDS + QUIET_SECONDS)
"""The slowest a governed copy goes on average, as a share of its starting rate: at the
floor throughout, and quiet now and then (the controller's wait for it allows for that)."""


def pace_path(run_id: str, node: str) -> str:
    """Where the supervisor of ``node`` writes the job's counters: the run's own directory
    (``~/.torchherd/runs/RUN``, 0700, where a detached run's log is too)."""
    return os.path.join(os.path.expanduser("~/.torchherd/runs"), run_id, node.replace("/", "_") + ".pace")


def job_cpu(pids: "List[int]", proc: str = "/proc") -> float:
    """CPU seconds (user and system) the processes ``pids`` have used."""
    ticks = 0
    for pid in pids:
        try:
            with open("%s/%d/stat" % (proc, pid), "rb") as file:
                fields = file.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        try:
            ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
        except (IndexError, ValueError):
            continue
    return ticks / float(os.sysconf("SC_CLK_TCK"))


class PaceWriter:
    """The supervisor's side: ``poll`` writes the counters when due. ``pids()``: the job's
    processes now; ``make_dir(path)``: the run's private directory made; ``write(path,
    fields)``: the supervisor's atomic private writer (``wire.write_json_atomic``: this
    module goes to the replication's source too, without ``wire``)."""

    def __init__(self, path: str, pids: "Callable[[], List[int]]", make_dir: "Callable[[str], None]",
                 write: "Callable[[str, Dict[str, float]], None]") -> None:
        self.path, self.pids, self.make_dir, self.write = path, pids, make_dir, write
        self.lines = 0
        self.due = 0.0
        self.made = False

    def count(self, data: bytes) -> None:
        self.lines += data.count(b"\n")

    def poll(self, now: float) -> None:
        if now < self.due:
            return
        self.due = now + WRITE_EVERY
        try:
            if not self.made:
                self.make_dir(os.path.dirname(self.path))
                self.made = True
            self.write(self.path, {"at": now, "lines": float(self.lines), "cpu": job_cpu(self.pids())})
        except OSError:
            pass  # no pace for the replication to keep to: it keeps its starting cap

    def remove(self) -> None:
        """The file, and the run's directory when nothing else is in it (an attached run
        keeps nothing there: only a detached one's log and state file stay)."""
        for remove, path in ((os.unlink, self.path), (os.rmdir, os.path.dirname(self.path))):
            try:
                remove(path)
            except OSError:
                pass


def read_pace(path: str) -> "Optional[Sample]":
    """The counters the supervisor wrote last; None: none (no supervisor watches, or a file
    this user does not own: never a pace someone else wrote)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            return None
        raw = json.loads(os.read(fd, 4096).decode("utf-8"))
        return float(raw["at"]), float(raw["lines"]), float(raw["cpu"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    finally:
        os.close(fd)


class Governor:
    """The AIMD rate of a replication's source. ``rate(now, sample)`` is called before each
    block: the rate to send at now (0: send nothing now, ``quiet_until`` says until when).
    ``sample``: the job's counters now, or None (unknown: the rate is held)."""

    def __init__(self, start: float, ceiling: float, now: float) -> None:
        self.start = start
        self.current = start
        self.floor = start * FLOOR_SHARE
        self.ceiling = max(start, min(ceiling, start * CEILING_SHARE))
        self.quiet_until = now + QUIET_SECONDS
        self.quiet_from = None  # type: Optional[Sample]
        self.baseline = None  # type: Optional[Tuple[float, float]]
        """The job's pace with nothing copied: (lines, CPU seconds) a second."""
        self.period_from = None  # type: Optional[Sample]
        self.period = PERIOD_SECONDS
        self.next_quiet = 0.0
        self.decisions = []  # type: List[Tuple[float, float, bool]]
        """(time, rate, slowed) at each decision: the source's last line tells them."""

    def rate(self, now: float, sample: "Optional[Sample]") -> float:
        if now < self.quiet_until:
            if self.quiet_from is None and sample is not None:
                self.quiet_from = sample
            return 0.0
        if self.quiet_from is not None:
            self._ended_quiet(now, sample)
        if self.baseline is None:
            return self.current  # nothing to keep to: the starting cap, held
        if now >= self.next_quiet:
            self.quiet_until, self.quiet_from = now + QUIET_SECONDS, sample
            return 0.0
        if sample is None:
            return self.current
        if self.period_from is None:
            self.period_from = sample
        elif sample[0] - self.period_from[0] >= self.period:
            self._decide(now, self.period_from, sample)
            self.period_from = sample
        return self.current

    def summary(self) -> "Dict[str, Any]":
        """For the source's last line: the quiet pace, the decisions, the rate at the end."""
        slowed = sum(1 for _, _, down in self.decisions if down)
        return {"baseline": None if self.baseline is None else [round(value, 3) for value in self.baseline],
                "slowed": slowed, "raised": len(self.decisions) - slowed, "rate": round(self.current)}

    def _ended_quiet(self, now: float, sample: "Optional[Sample]") -> None:
        began, self.quiet_from = self.quiet_from, None
        self.period_from = None
        self.next_quiet = now + REBASE_SECONDS
        if began is None or sample is None:
            return
        pace = _pace(began, sample)
        if pace is not None and (pace[0] >= MIN_LINES or pace[1] >= MIN_CPU):
            self.baseline = pace
            self.period = min(LONGEST_PERIOD, max(PERIOD_SECONDS, PERIOD_LINES / pace[0] if pace[0] else 0.0))

    def _decide(self, now: float, began: "Sample", ended: "Sample") -> None:
        pace = _pace(began, ended)
        baseline = self.baseline
        if pace is None or baseline is None:
            return
        slowed = any(base >= least and seen < base * (1.0 - TOLERANCE)
                     for base, seen, least in zip(baseline, pace, (MIN_LINES, MIN_CPU)))
        if slowed:
            self.current = max(self.floor, self.current * DECREASE)
        else:
            self.current = min(self.ceiling, self.current + self.start * INCREASE)
        self.decisions.append((now, self.current, slowed))


class GovernedPace:
    """A governed token bucket for ``relay.send``: ``take(size, now)`` is the wait before a
    block of ``size`` bytes goes. ``bucket(rate)``: the token bucket of that rate (kept,
    its rate changed with the governor's); ``read()``: the job's counters now."""

    def __init__(self, governor: Governor, bucket: "Callable[[float], Any]",
                 read: "Callable[[], Optional[Sample]]") -> None:
        self.governor, self.read = governor, read
        self.bucket = bucket(governor.current)
        self.sample = None  # type: Optional[Sample]
        self.next_read = 0.0

    def take(self, size: int, now: float) -> float:
        if now >= self.next_read:
            self.sample, self.next_read = self.read(), now + READ_EVERY
        rate = self.governor.rate(now, self.sample)
        if rate <= 0:  # quiet: the block goes once it is over (the bucket does not fill meanwhile)
            wait = self.governor.quiet_until - now
            self.bucket.tokens, self.bucket.last = 0.0, self.governor.quiet_until
            return wait
        if rate != self.bucket.rate:
            self.bucket.rate, self.bucket.burst = rate, rate * (self.bucket.burst / self.bucket.rate)
        return float(self.bucket.take(size, now))


def _pace(began: "Sample", ended: "Sample") -> "Optional[Tuple[float, float]]":
    """(lines, CPU seconds) a second between two samples; None: too close to tell (the
    supervisor had not written again)."""
    seconds = ended[0] - began[0]
    if seconds < WRITE_EVERY:
        return None
    return (ended[1] - began[1]) / seconds, (ended[2] - began[2]) / seconds

