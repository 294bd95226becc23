"""The replication's rate kept to the job's pace (remote/pace.py), with a fake clock."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from torchherd.remote.checkpoint import Pace
from torchherd.remote.pace import (
    CEILING_SHARE,
    FLOOR_SHARE,
    INCREASE,
    PERIOD_SECONDS,
    QUIET_SECONDS,
    REBASE_SECONDS,
    GovernedPace,
    Governor,
    PaceWriter,
    job_cpu,
    read_pace,
)
from torchherd.remote.wire import write_json_atomic

START = 10e6


class Job:
    """A job printing ``lines`` a second at full pace, slowed by ``cost`` (a share of its
    pace) per MB/s the copy sends; its counters as the supervisor writes them every 0.5 s."""

    def __init__(self, lines: float = 100.0, cpu: float = 1.0, cost: float = 0.0) -> None:
        self.lines_rate, self.cpu_rate, self.cost = lines, cpu, cost
        self.lines = self.cpu = 0.0
        self.at = 0.0

    def run(self, until: float, rate: float) -> None:
        slowed = 1.0 - min(0.9, self.cost * rate / 1e6)
        self.lines += (until - self.at) * self.lines_rate * slowed
        self.cpu += (until - self.at) * self.cpu_rate * slowed
        self.at = until

    def sample(self) -> tuple[float, float, float]:
        return self.at, self.lines, self.cpu


def drive(governor: Governor, job: Job | None, seconds: float, step: float = 0.5) -> list[float]:
    """The rates the governor gives every ``step`` seconds, the job run at each meanwhile."""
    rates: list[float] = []
    now = 0.0
    rate = governor.rate(now, job.sample() if job else None)
    while now < seconds:
        now += step
        if job is not None:
            job.run(now, rate)
        rate = governor.rate(now, job.sample() if job else None)
        rates.append(rate)
    return rates


def test_nothing_is_sent_while_the_jobs_own_pace_is_measured_then_the_starting_cap() -> None:
    governor = Governor(START, 1e9, 0.0)
    job = Job()
    assert governor.rate(0.0, job.sample()) == 0.0
    job.run(1.5, 0.0)
    assert governor.rate(1.5, job.sample()) == 0.0
    job.run(QUIET_SECONDS, 0.0)
    assert governor.rate(QUIET_SECONDS, job.sample()) == START
    assert governor.baseline == pytest.approx((100.0, 1.0))


def test_a_job_the_copy_does_not_slow_lets_the_rate_rise_by_steps_to_four_times_the_start() -> None:
    governor = Governor(START, 1e9, 0.0)
    rates = drive(governor, Job(), 30.0)
    sending = [rate for rate in rates if rate > 0]
    assert sending[:5:2] == [START, START + START * INCREASE, START + 2 * START * INCREASE]
    assert max(rates) == START * CEILING_SHARE
    assert governor.summary()["slowed"] == 0


def test_the_ceiling_is_the_links_share_when_lower() -> None:
    governor = Governor(START, 15e6, 0.0)
    assert max(drive(governor, Job(), 20.0)) == 15e6


def test_a_job_slowed_by_more_than_three_percent_halves_the_rate_down_to_the_floor() -> None:
    governor = Governor(START, 1e9, 0.0)
    job = Job(cost=0.5)  # any copy at all slows it by far more than 3 %
    rates = drive(governor, job, 10.0)
    sending = [rate for rate in rates if rate > 0]
    assert sending[2] == START / 2  # the first period's decision
    assert min(sending) == START * FLOOR_SHARE
    assert governor.summary()["raised"] == 0


def test_the_rate_settles_where_the_job_is_slowed_by_less_than_five_percent() -> None:
    governor = Governor(START, 1e9, 0.0)
    job = Job(cost=0.004)  # 0.4 % a MB/s: 10 MB/s costs 4 %, 12.5 MB/s the 5 %
    rates = drive(governor, job, 120.0, step=0.1)
    late = [rate for rate in rates[len(rates) // 2:] if rate > 0]
    mean = sum(late) / len(late)
    assert 0.004 * mean / 1e6 < 0.05
    assert mean > START * FLOOR_SHARE * 2  # and the copy goes on at a useful rate


def test_a_job_that_prints_less_is_judged_over_a_longer_period() -> None:
    governor = Governor(START, 1e9, 0.0)
    rates = drive(governor, Job(lines=25.0, cpu=0.0), QUIET_SECONDS + 8.5)
    assert governor.period == 4.0  # 100 lines at 25 a second
    assert [rate for rate in rates if rate > 0][-1] == START + 2 * START * INCREASE  # two decisions in 8.5 s


def test_the_jobs_pace_is_measured_again_every_thirty_seconds() -> None:
    governor = Governor(START, 1e9, 0.0)
    rates = drive(governor, Job(), QUIET_SECONDS + REBASE_SECONDS + 1.0)
    assert rates[-1] == 0.0 and governor.quiet_until == pytest.approx(QUIET_SECONDS + REBASE_SECONDS + 2.5, abs=0.5)


def test_without_counters_the_starting_cap_is_held() -> None:
    governor = Governor(START, 1e9, 0.0)
    rates = drive(governor, None, 60.0)
    assert set(rates[int(QUIET_SECONDS / 0.5):]) == {START} and governor.summary()["baseline"] is None


def test_a_job_that_prints_little_and_waits_keeps_the_starting_cap() -> None:
    governor = Governor(START, 1e9, 0.0)
    rates = drive(governor, Job(lines=1.0, cpu=0.02, cost=0.5), 60.0)
    assert set(rates[int(QUIET_SECONDS / 0.5):]) == {START}


def test_the_cpu_share_alone_tells_a_job_that_prints_nothing_slowed() -> None:
    governor = Governor(START, 1e9, 0.0)
    rates = drive(governor, Job(lines=0.0, cpu=2.0, cost=0.5), 10.0)
    assert min(rate for rate in rates if rate > 0) == START * FLOOR_SHARE


def test_the_governed_bucket_waits_out_the_quiet_then_paces_at_the_governors_rate() -> None:
    job = Job()
    reads: list[float] = []

    def read() -> tuple[float, float, float]:
        reads.append(job.at)
        return job.sample()

    governed = GovernedPace(Governor(START, 1e9, 0.0), lambda rate: Pace(rate, 0.0), read)
    assert governed.take(1 << 16, 0.0) == QUIET_SECONDS  # the block goes once the quiet is over
    governed.take(1 << 16, 0.1)
    assert reads == [0.0]  # read again only after READ_EVERY
    job.run(QUIET_SECONDS, 0.0)
    wait = governed.take(1 << 16, QUIET_SECONDS)
    assert governed.bucket.rate == START and wait == pytest.approx((1 << 16) / START)
    job.run(QUIET_SECONDS + PERIOD_SECONDS + 0.5, START)
    governed.take(1 << 16, QUIET_SECONDS + 0.3)
    governed.take(1 << 16, QUIET_SECONDS + PERIOD_SECONDS + 0.5)
    assert governed.bucket.rate == START + START * INCREASE


def test_the_supervisor_writes_the_counters_and_the_source_reads_only_its_own_file(tmp_path: Path) -> None:
    path = tmp_path / "run" / "node0.pace"
    writer = PaceWriter(str(path), lambda: [os.getpid()], lambda where: os.makedirs(where, mode=0o700),
                        write_json_atomic)
    writer.count(b"a\nb\n[rank0] c\n")
    writer.poll(10.0)
    writer.poll(10.1)  # not due: nothing written
    at, lines, cpu = read_pace(str(path)) or (0.0, 0.0, 0.0)
    assert (at, lines) == (10.0, 3.0) and cpu > 0
    assert json.loads(path.read_text())["lines"] == 3
    link = tmp_path / "link.pace"
    link.symlink_to(path)
    assert read_pace(str(link)) is None  # never through a link
    assert read_pace(str(tmp_path / "none.pace")) is None
    link.unlink()
    writer.remove()
    assert not path.exists() and not path.parent.exists()  # the run's directory too, once empty


def test_the_jobs_cpu_is_its_processes_user_and_system_time(tmp_path: Path) -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    for pid, (user, system) in {11: (3 * ticks, ticks), 12: (ticks, 0)}.items():
        (tmp_path / str(pid)).mkdir()
        fields = ["S", "1"] + ["0"] * 9 + [str(user), str(system)] + ["0"] * 20
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (python3 x) " + " ".join(fields))
    assert job_cpu([11, 12, 13], str(tmp_path)) == 5.0  # 13 is gone: not counted
