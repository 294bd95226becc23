"""What one real NVIDIA H200 (driver 580.159.04, CUDA 13.0, torch 2.11) printed, read by the
checks and the supervisor's GPU samples (tests/unit/data/gpu/h200 and the H200 files
beside the others: README there): the healthy GPU passes with no warning, the supervisor's
queries are answered, its samples read, and the driver's persistence advice is followed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from support.gpu import by_node, gather, gathered_observed, node_facts, observed, smi, stand_ins, xid_result
from torchherd.checks.analysis import gpu, nvsmi, xid
from torchherd.remote import ranks
from torchherd.runlog import GpuUsage, Status, gpu_usage

DATA = Path(__file__).parent / "data" / "gpu"
H200 = DATA / "h200"
XML = "h200-580-v13.xml"
DEPRECATED = ("NVRM: Persistence mode is deprecated and will be removed in a future release. Please use "
              "nvidia-persistenced instead.")


def gpu_result(xml: str, **gpu_facts: object) -> tuple[str, str, str]:
    facts = node_facts(xml, 1)
    facts.raw["gpu"].update(gpu_facts)
    result = by_node(gpu.analyse(observed(node0=facts)))["node0"]
    return result.status, result.summary, result.fix


def test_the_h200_document_of_driver_580_is_read_whole() -> None:
    report = nvsmi.parse(smi(XML))
    assert (report.driver, report.cuda, report.models) == ("580.159.04", "13.0", ("NVIDIA H200",))
    [only] = report.gpus
    assert (only.persistence, only.mig, only.volatile_uncorrectable, only.aggregate_uncorrectable) == (
        "Enabled", "Disabled", 0, 0)
    assert (only.remap_pending, only.remap_failed, only.clock_reasons, only.fabric_state) == (False, False, (), None)


def test_the_healthy_h200_passes_with_zero_warnings() -> None:
    assert gpu.health_findings("node0", nvsmi.parse(smi(XML))) == []
    assert gpu_result(smi(XML)) == (
        "pass", "1 GPU(s) visible for nproc_per_node = 1 (driver 580.159.04, CUDA 13.0, NVIDIA H200)", "")


def test_persistence_by_the_deprecated_mode_passes_and_says_which_to_use() -> None:
    """The H200's persistence was the mode driver 580 deprecates (its kernel log says so),
    no nvidia-persistenced: it works, so a pass, that names the one to use."""
    assert DEPRECATED in (DATA / "kernel-log" / "h200-580-dmesg.txt").read_text()
    assert gpu_result(smi(XML), persistenced=False) == (
        "pass", "1 GPU(s) visible for nproc_per_node = 1 (driver 580.159.04, CUDA 13.0, NVIDIA H200); persistence by "
                "`nvidia-smi -pm 1`, which driver 580.159.04 deprecates: nvidia-persistenced is the one to use", "")
    assert gpu_result(smi(XML), persistenced=True)[1].endswith("NVIDIA H200)")


def test_persistence_off_is_accepted_where_nvidia_persistenced_runs() -> None:
    off = smi(XML).replace("<persistence_mode>Enabled</persistence_mode>",
                           "<persistence_mode>Disabled</persistence_mode>", 1)
    assert gpu_result(off, persistenced=True)[0] == "pass"
    assert gpu_result(off, persistenced=False) == (
        "warn", "node0 GPU 0 (00000000:00:06.0): persistence mode off (every job start reinitialises the GPU)",
        "start nvidia-persistenced on node0: `sudo systemctl enable --now nvidia-persistenced` (driver 580.159.04 "
        "deprecates `nvidia-smi -pm 1`)")


def test_an_older_driver_is_told_the_daemon_first_and_the_mode_it_still_has() -> None:
    status, _, fix = gpu_result(smi("tesla-t4.xml"), persistenced=False)  # driver 515, persistence off
    assert (status, fix) == (
        "warn", "start nvidia-persistenced on node0: `sudo systemctl enable --now nvidia-persistenced` "
                "(`sudo nvidia-smi -pm 1` also works on this driver; drivers from 580 on deprecate it)")


def test_the_h200_kernel_log_has_no_xid_and_its_persistence_line_is_not_one() -> None:
    lines = (DATA / "kernel-log" / "h200-580-dmesg.txt").read_text().splitlines()
    assert xid.parse_lines(lines) == []
    result = xid_result(lines, smi(XML))
    assert (result.status, result.summary) == ("pass", "no Xid errors since boot (dmesg)")


def query_lines() -> dict[str, str]:
    """Each ``--query-gpu`` the H200 answered: the query's fields, its line."""
    text = (H200 / "query-and-dmesg.txt").read_text()
    return dict(re.findall(r"--query-gpu=(\S+) --format=csv,noheader,nounits\n(.+)\n", text))


def test_driver_580_answers_both_spellings_of_the_clock_reasons() -> None:
    """The supervisor asks ``clocks_throttle_reasons.active`` first (GPU_QUERIES), then the
    newer ``clocks_event_reasons.active``: driver 580 answers both, a bitmask in hex."""
    answers = query_lines()
    assert [fields.rsplit(",", 1)[1] for fields in answers] == ["clocks_throttle_reasons.active",
                                                                 "clocks_event_reasons.active"]
    first = ranks.GPU_QUERIES[0].split(",")
    for fields, line in answers.items():
        asked = fields.split(",")
        assert [name for name in asked if name not in first] in ([], ["clocks_event_reasons.active"])
        values = dict(zip(asked, (value.strip() for value in line.split(","))))
        assert (values["index"], int(values[asked[-1]], 16), float(values["clocks.max.sm"])) == ("0", 0, 1980.0)


def busy_samples() -> list[Status]:
    """The samples of a 40 s bf16 matmul job as the run's events carried them."""
    found = re.findall(r"fields=(\{'event': 'gpu', 'gpus': .*?\]\]\})", (H200 / "gpu-samples-busy.txt").read_text())
    return [Status("192.0.2.2", "gpu", ast.literal_eval(fields)) for fields in found]


def test_the_busy_h200_samples_read_as_a_power_capped_gpu_at_full_use() -> None:
    usages = [usage for status in busy_samples() for usage in gpu_usage(status)]
    assert len(usages) == 4
    assert usages[0] == GpuUsage(0, 100.0, 1661.0, 143771.0, 1440.0, 1980.0, 693.39, 4)
    assert {usage.reasons for usage in usages} == {0x4}
    assert all(usage.utilisation >= 99 and 1440 <= (usage.clock or 0) <= 1455 for usage in usages)


@pytest.mark.parametrize("name", ["hang-on-gpu.txt", "gpu-samples-busy.txt"])
def test_the_samples_on_the_h200_are_eight_values_each(name: str) -> None:
    for fields in re.findall(r"'gpus': (\[\[.*?\]\])", (H200 / name).read_text()):
        assert all(len(sample) == 8 for sample in ast.literal_eval(fields))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("daemon", "note"), [
    (None, "; persistence by `nvidia-smi -pm 1`, which driver 580.159.04 deprecates: nvidia-persistenced is the one to use"),
    ("nvidia-persistenced", ""),
])
def test_the_h200_through_the_node_s_facts_passes_and_sees_nvidia_persistenced(tmp_path: Path, daemon: str | None,
                                                                                note: str) -> None:
    """remote/facts.py as a node runs it, the H200's outputs from its nvidia-smi and dmesg,
    nvidia-persistenced found by its process name (the kernel keeps 15 characters)."""
    root = tmp_path / "root"
    for pid, name in (("1", "systemd"), ("900", "python3")) + ((("812", daemon[:15]),) if daemon else ()):
        (root / "proc" / pid).mkdir(parents=True)
        (root / "proc" / pid / "comm").write_text(name + "\n")
    bin_dir = stand_ins(tmp_path, smi(XML), (DATA / "kernel-log" / "h200-580-dmesg.txt").read_text())
    facts = gather(bin_dir, root)
    assert facts.get("gpu")["persistenced"] is (daemon is not None)
    seen = gathered_observed(facts)
    (found,) = gpu.analyse(seen)  # the count is the stand-in's --query-gpu (two lines), the rest the H200's
    assert (found.status, found.summary) == (
        "pass", f"2 GPU(s) visible for nproc_per_node = 2 (driver 580.159.04, CUDA 13.0, NVIDIA H200){note}")
    (kernel,) = xid.analyse(seen)
    assert (kernel.status, kernel.summary) == ("pass", "no Xid errors since boot (dmesg)")


PROBE = Path(__file__).parent / "data" / "gpu-h200-probe"
"""scripts/gpu-probe's outputs on another H200 (its README there): 5 uncorrectable ECC errors
in its lifetime, the supervisor's own queries as it asks them."""


def probe_answers() -> dict[str, str]:
    """Each ``--query-gpu`` of query-gpu.txt: its fields, the line the H200 answered."""
    text = (PROBE / "query-gpu.txt").read_text()
    return dict(re.findall(r"(?m)^\$ nvidia-smi --query-gpu=(\S+) --format=csv,noheader,nounits\n(.+)\n\(exit 0\)", text))


def test_the_supervisor_s_own_queries_as_the_h200_answered_them() -> None:
    answers = probe_answers()
    assert list(answers) == list(ranks.GPU_QUERIES)
    assert [ranks.gpu_sample(answers[query]) for query in ranks.GPU_QUERIES] == [
        [0, 0.0, 0.0, 143771.0, 345.0, 1980.0, 78.28, 1],  # idle: reasons 0x1, GPU idle
        [0, 0.0, 0.0, 143771.0, 345.0, 1980.0, 78.27, 1],
        [0, 0.0, 0.0, 143771.0]]


def test_the_samples_of_a_busy_job_on_the_probed_h200() -> None:
    import json

    samples = json.loads((PROBE / "ddp-run-gpu-samples.json").read_text())
    usages = [usage for gpus in samples for usage in gpu_usage(Status("localhost", "gpu", {"gpus": gpus}))]
    assert len(usages) == len(samples) == 7
    busy = [usage for usage in usages if usage.utilisation > 90]
    assert len(busy) == 4 and {(usage.clock, usage.max_clock, usage.reasons) for usage in busy} == {(1830.0, 1980.0, 4)}


def test_a_lifetime_ecc_history_warns_and_nothing_else_on_the_probed_h200() -> None:
    report = nvsmi.parse((PROBE / "nvidia-smi-q-x.xml").read_text())
    assert [gpu.persistence for gpu in report.gpus] == ["Enabled"]
    assert [(finding.status, finding.text) for finding in gpu.health_findings("localhost", report, daemon=False)] == [
        ("warn", "localhost GPU 0 (00000000:00:06.0): 5 uncorrectable ECC error(s) in its lifetime, none since the last "
                 "reset")]
    assert DEPRECATED in (PROBE / "kernel-log.txt").read_text()
