"""``gpudiag``: DCGM's ``dcgmi diag -r 1 -j`` read in both of its JSON shapes, a failure
given only when a second run confirms it, and every way DCGM may not answer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from torchherd.checks.analysis.gpudiag import FIX, node_result, parse
from torchherd.checks.runner import selected_checks

DATA = Path(__file__).parent / "data" / "gpu" / "dcgmi"
REAL_31 = (DATA / "dcgm-3.1.0-8gpu.txt").read_text(encoding="utf-8")
"""A real 8-GPU output of DCGM 3.1.0, every test passed, with DCGM's warning line before it."""


def failing_31(gpu: int = 3) -> str:
    """The real output with one GPU's ``software`` result turned into a failure with a
    warning, as DCGM 3.x writes them (one visible substitution)."""
    old = f'"gpu_ids" : {gpu},\n\t\t\t\t\t\t\t"status" : "PASS"'
    assert old in REAL_31
    return REAL_31.replace(old, f'"gpu_ids" : {gpu},\n"status" : "FAIL", "warnings" : [{{"warning" : "GPU {gpu} '
                                f'has uncorrectable memory errors and row remappings are pending", "error_id" : 95, '
                                f'"error_category" : 2, "error_severity" : 2}}]')


def dcgm4(statuses: dict[int, str]) -> str:
    """A DCGM 4.x document, in the shape of NVIDIA/DCGM's testing/python3/dcgm_diag_schema.json."""
    results: list[dict[str, Any]] = [{"entity_group": "GPU", "entity_group_id": 1, "entity_id": gpu, "status": status}
                                     for gpu, status in statuses.items()]
    for result in results:
        if result["status"] == "Fail":
            result["warnings"] = [{"error_category": 4, "error_id": 28, "error_severity": 2,
                                   "warning": f"GPU {result['entity_id']}: PCIe link width x8 below x16"}]
    return json.dumps({"DCGM Diagnostic": {"test_categories": [
        {"category": "Deployment", "tests": [{"name": "software", "results": results,
                                              "test_summary": {"status": "Pass"}}]}]},
        "metadata": {"version": "4.2.3", "Driver Version Detected": "570.124.06"}})


def test_the_real_3_1_output_reads_as_eight_gpus_passing() -> None:
    diagnostic = parse(REAL_31)
    assert diagnostic.version == "3.1.0" and diagnostic.gpus() == set(range(8)) and not diagnostic.failed()
    assert {result.test for result in diagnostic.results} >= {"Denylist", "Persistence Mode", "software"}
    assert node_result("n1", {"code": 0, "out": REAL_31}).summary == (
        "DCGM 3.1.0 level 1: no test failed (17 result(s) passed on 8 GPU(s))")


def test_a_failure_that_comes_back_fails_the_node_naming_the_test_the_gpu_and_dcgm_s_words() -> None:
    result = node_result("n1", {"code": 226, "out": failing_31(), "again": failing_31()})
    assert (result.status, result.fix) == ("fail", FIX)
    assert result.summary == ("n1: DCGM level 1 failed software on GPU 3 (GPU 3 has uncorrectable memory errors and "
                              "row remappings are pending) (twice)")


def test_a_failure_that_does_not_come_back_only_warns() -> None:
    result = node_result("n1", {"code": 226, "out": failing_31(), "again": REAL_31})
    assert result.status == "warn" and result.summary.endswith("once, and passed it on a second run")


def test_a_failure_without_a_second_answer_is_not_given() -> None:
    assert node_result("n1", {"code": 226, "out": failing_31(), "again": None}).status == "warn"
    assert node_result("n1", {"code": 226, "out": failing_31()}).status == "warn"


def test_the_4x_shape_names_the_failed_gpu() -> None:
    doc = dcgm4({0: "Pass", 1: "Fail", 2: "Pass"})
    assert parse(doc).version == "4.2.3"
    result = node_result("n2", {"code": 226, "out": doc, "again": doc})
    assert result.status == "fail"
    assert result.summary == "n2: DCGM level 1 failed software on GPU 1 (GPU 1: PCIe link width x8 below x16) (twice)"
    assert node_result("n2", {"code": 0, "out": dcgm4({0: "Pass", 1: "Skip"})}).status == "pass"


def test_a_status_it_does_not_know_is_never_a_pass() -> None:
    assert node_result("n2", {"code": 0, "out": dcgm4({0: "Pass", 1: "Incomplete"})}).status == "warn"


@pytest.mark.parametrize(("answer", "status", "words"), [
    ({"missing": True}, "skip", "dcgmi is not installed here (DCGM)"),
    ({"error": "no answer in 290 s"}, "warn", "n1: dcgmi diag did not run: no answer in 290 s"),
    ({"code": 255, "out": "Error: unable to establish a connection to the specified host: localhost\n"}, "warn",
     "n1: dcgmi diag gave no result (no JSON document in dcgmi's output): Error: unable to establish"),
    ({"code": 0, "out": '{"DCGM Diagnostic": {"runtime_error": "The diagnostic was cancelled"}, '
                        '"metadata": {"version": "4.1.0"}}'}, "warn",
     "n1: DCGM could not run its diagnostic: The diagnostic was cancelled"),
    ({"code": 0, "out": '{"something": "else"}'}, "warn", "n1: dcgmi diag gave no result (dcgmi's JSON has no"),
])
def test_every_way_dcgm_does_not_answer_is_said_and_never_fails(answer: dict[str, Any], status: str,
                                                                 words: str) -> None:
    result = node_result("n1", answer)
    assert result.status == status and result.summary.startswith(words), result.summary


def test_the_diagnostic_runs_only_when_asked() -> None:
    assert "gpudiag" not in selected_checks(None, frozenset(), smoke=True, bandwidth=True)
    assert "gpudiag" in selected_checks(None, frozenset(), smoke=False, gpu_diag=True)
    assert selected_checks(frozenset({"gpudiag"}), frozenset(), smoke=False) == ("gpudiag",)
