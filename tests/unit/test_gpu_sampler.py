"""The supervisor's GPU samples, with a stand-in ``nvidia-smi`` on the PATH (this machine
has no GPU): every few seconds a ``gpu`` record, never a blocked loop, nothing where
there is no nvidia-smi."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from torchherd.remote import ranks
from torchherd.runlog import GpuUsage, OutputParser, Status, gpu_usage

QUERY_ANSWER = "0, 87, 12000, 81920\n1, [N/A], 0, 81920\n2, 15, 100, 40960\n"


@pytest.fixture
def fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    script = tmp_path / "nvidia-smi"
    script.write_text(f"#!/bin/sh\nprintf '{QUERY_ANSWER}'\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return script


def sample(sampler: ranks.GpuSampler, seconds: float) -> bytes:
    records = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        records += sampler.poll(time.monotonic())
        time.sleep(0.01)
    return records


def first_sample(sampler: ranks.GpuSampler) -> Status:
    """The first gpu record of the sampler run as the supervisor's loop runs it (30 s at most,
    however busy this machine: the test is not about how soon)."""
    records = b""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        records += sampler.poll(time.monotonic())
        parsed = [chunk for chunk in OutputParser("node0").feed(records) if isinstance(chunk, Status)]
        if parsed:
            return parsed[0]
        time.sleep(0.01)
    raise AssertionError(f"no gpu record in 30 s: {records!r}")


def test_a_sample_every_few_seconds_and_boards_without_a_reading_left_out(fake_smi: Path) -> None:
    """The times are the loop's, given to ``poll``: a query when due, its record once it has
    ended, none before the next is due (the queries run for real, however slow this machine)."""
    sampler = ranks.GpuSampler(0.3)
    assert sampler.poll(100.0) == b"" and sampler.proc is not None  # the first query starts
    sampler.proc.wait(timeout=30)
    first = sampler.poll(100.1)
    assert sampler.poll(100.2) == b"" and sampler.proc is None  # not due before 100.3
    assert sampler.poll(100.3) == b"" and sampler.proc is not None
    sampler.proc.wait(timeout=30)
    second = sampler.poll(100.4)
    sampler.stop()
    parsed = [chunk for chunk in OutputParser("node0").feed(first + second) if isinstance(chunk, Status)]
    assert len(parsed) == 2, first + second
    assert gpu_usage(parsed[0]) == (GpuUsage(0, 87.0, 12000.0, 81920.0), GpuUsage(2, 15.0, 100.0, 40960.0))
    assert gpu_usage(parsed[1]) == gpu_usage(parsed[0])


def test_no_nvidia_smi_no_samples(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    sampler = ranks.GpuSampler(0.1)
    assert sampler.path is None and sample(sampler, 0.3) == b""
    assert ranks.GpuSampler(0.0).path is None


def test_a_query_that_hangs_is_killed_and_gives_no_sample(fake_smi: Path) -> None:
    fake_smi.write_text("#!/bin/sh\nexec sleep 30\n")
    sampler = ranks.GpuSampler(0.1)
    started = time.monotonic()
    assert sampler.poll(started) == b""
    assert sampler.proc is not None
    assert sampler.poll(started + ranks.GPU_QUERY_TIMEOUT + 1) == b""
    assert sampler.proc is None and time.monotonic() - started < 5


def test_the_clocks_and_throttle_reasons_are_sampled_where_the_driver_answers(fake_smi: Path) -> None:
    fake_smi.write_text("#!/bin/sh\ncase \"$1\" in *clocks_throttle_reasons*) "
                        "printf '0, 100, 40000, 81559, 1980, 1980, 698.55, 0x0000000000000000\\n"
                        "1, 100, 40000, 81559, 1095, 1980, 301.20, 0x0000000000000040\\n' ;; esac\n")
    sampler = ranks.GpuSampler(0.3)
    first = first_sample(sampler)
    sampler.stop()
    assert gpu_usage(first)[1] == GpuUsage(1, 100.0, 40000.0, 81559.0, 1095.0, 1980.0, 301.2, 0x40)


def test_a_driver_that_refuses_a_field_is_asked_less(fake_smi: Path) -> None:
    """Drivers that renamed the throttle reasons refuse the whole query: the sampler falls
    back, and at the end every driver's four fields still come."""
    fake_smi.write_text("#!/bin/sh\ncase \"$1\" in *reasons*) echo 'Field \"x\" is not a valid field to query.'; "
                        f"exit 2 ;; esac\nprintf '{QUERY_ANSWER}'\n")
    sampler = ranks.GpuSampler(0.1)
    first = first_sample(sampler)
    sampler.stop()
    assert sampler.query == len(ranks.GPU_QUERIES) - 1
    assert gpu_usage(first)[0] == GpuUsage(0, 87.0, 12000.0, 81920.0)
