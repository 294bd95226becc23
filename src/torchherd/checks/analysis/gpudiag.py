"""``gpudiag``: DCGM's level-1 diagnostic (``dcgmi diag -r 1 -j``) on every node that has
DCGM, its failures shown as this check's (``check --gpu-diag``).

DCGM's JSON changed between major versions: 3.x nests the tests under ``"DCGM GPU
Diagnostic"`` with each result naming ``gpu_ids`` (a string of ids for the deployment
tests, a number for the per-GPU ones) and statuses in capitals; 4.x uses ``"DCGM
Diagnostic"`` and names each result's entity (``entity_group``, ``entity_id``). Both are
read. A status this module does not know is never taken for a pass.

A failed test is confirmed before the node fails: the gather runs the diagnostic a second
time on a node whose first run failed, and a failure that does not come back is a warning
(a flaky GPU is worth knowing of, not worth a drained node).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Mapping

from torchherd.checks.model import Observed
from torchherd.checks.results import CheckResult

CHECK = "gpudiag"
DiagStatus = Literal["pass", "fail", "warn", "skip", "unknown"]
_STATUSES: dict[str, DiagStatus] = {"pass": "pass", "fail": "fail", "warn": "warn", "warning": "warn",
                                    "skip": "skip", "skipped": "skip", "not run": "skip", "not applicable": "skip"}
SHOWN = 4
"""Failed tests a summary names; the rest are counted."""
FIX = ("drain the node and run `dcgmi diag -r 3` there for the full diagnostic; a GPU that fails again needs "
       "service (NVIDIA's field diagnostic)")


@dataclass(frozen=True)
class DiagResult:
    """One test's outcome on some GPUs."""

    test: str
    status: DiagStatus
    gpus: tuple[int, ...]
    """Empty where the result names no GPU (a node-wide test)."""
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Diagnostic:
    """What one ``dcgmi diag -j`` document said."""

    version: str
    results: tuple[DiagResult, ...]
    error: str = ""
    """DCGM's own runtime error, when it could not run the tests."""

    def failed(self) -> tuple[DiagResult, ...]:
        return tuple(result for result in self.results if result.status == "fail")

    def gpus(self) -> set[int]:
        return {gpu for result in self.results for gpu in result.gpus}


def _gpu_ids(result: Mapping[str, Any]) -> tuple[int, ...]:
    if "entity_id" in result:  # 4.x: one entity per result; GPUs only
        group = str(result.get("entity_group", "GPU"))
        entity = result.get("entity_id")
        return (entity,) if group.upper() == "GPU" and isinstance(entity, int) else ()
    ids = result.get("gpu_ids")
    if isinstance(ids, int) and not isinstance(ids, bool):
        return (ids,)
    if isinstance(ids, str):
        return tuple(int(part) for part in ids.split(",") if part.strip().isdigit())
    return ()


def _warnings(result: Mapping[str, Any]) -> tuple[str, ...]:
    found = []
    for warning in result.get("warnings") or ():
        text = warning.get("warning") if isinstance(warning, dict) else warning
        if isinstance(text, str) and text.strip():
            found.append(" ".join(text.split())[:300])
    return tuple(found)


def parse(text: str) -> Diagnostic:
    """The document ``dcgmi diag -j`` printed (anything before its first ``{`` is DCGM's
    chatter); raises ValueError when there is none or it is not DCGM's shape."""
    start = text.find("{")
    if start < 0:
        raise ValueError("no JSON document in dcgmi's output")
    document = json.loads(text[start:])
    if not isinstance(document, dict):
        raise ValueError("dcgmi's JSON is not an object")
    root = document.get("DCGM Diagnostic", document.get("DCGM GPU Diagnostic"))
    if not isinstance(root, dict):
        raise ValueError("dcgmi's JSON has no \"DCGM Diagnostic\" section")
    metadata = document.get("metadata")
    version = root.get("version") or (metadata.get("version") if isinstance(metadata, dict) else None) or "?"
    results = []
    for category in root.get("test_categories") or ():
        for test in (category.get("tests") or ()) if isinstance(category, dict) else ():
            if not isinstance(test, dict):
                continue  # 3.x writes nulls between its tests
            name = str(test.get("name", "?"))[:100]
            for result in test.get("results") or ():
                if isinstance(result, dict):
                    status = _STATUSES.get(str(result.get("status", "")).strip().lower(), "unknown")
                    results.append(DiagResult(name, status, _gpu_ids(result), _warnings(result)))
    error = root.get("runtime_error") or document.get("runtime_error") or ""
    if not results and not error:
        raise ValueError("dcgmi's JSON lists no test")
    return Diagnostic(str(version)[:40], tuple(results), " ".join(str(error).split())[:300])


def _describe(failed: tuple[DiagResult, ...]) -> str:
    by_test: dict[str, list[DiagResult]] = {}
    for result in failed:
        by_test.setdefault(result.test, []).append(result)
    parts = []
    for test, results in list(by_test.items())[:SHOWN]:
        gpus = sorted({gpu for result in results for gpu in result.gpus})
        where = f" on GPU {', '.join(map(str, gpus))}" if gpus else ""
        said = next((warning for result in results for warning in result.warnings), "")
        parts.append(f"{test}{where}" + (f" ({said})" if said else ""))
    more = len(by_test) - SHOWN
    return "; ".join(parts) + (f"; and {more} more test(s)" if more > 0 else "")


def _failed_tests(diagnostic: Diagnostic) -> set[str]:
    return {result.test for result in diagnostic.failed()}


def node_result(node: str, answer: Mapping[str, Any]) -> CheckResult:
    """``answer``: what checks/gpudiag.py gathered on ``node`` (``missing``, ``error``, or
    ``out`` with the first run's output and ``again`` with a second run's, if any)."""
    if answer.get("missing"):
        return CheckResult(node, CHECK, "skip", "dcgmi is not installed here (DCGM)",
                           "install NVIDIA DCGM (datacenter-gpu-manager) to run its diagnostic")
    if "out" not in answer:
        return CheckResult(node, CHECK, "warn", f"{node}: dcgmi diag did not run: {answer.get('error', '?')}",
                           "start DCGM's host engine (`sudo systemctl start nvidia-dcgm`) and try `dcgmi diag -r 1`")
    try:
        first = parse(str(answer["out"]))
    except ValueError as error:
        said = " ".join(str(answer["out"]).split())[:200] or f"exit status {answer.get('code')}"
        return CheckResult(node, CHECK, "warn", f"{node}: dcgmi diag gave no result ({error}): {said}",
                           "run `dcgmi diag -r 1` there; DCGM's host engine may not be running "
                           "(`sudo systemctl start nvidia-dcgm`)")
    if first.error and not first.results:
        return CheckResult(node, CHECK, "warn", f"{node}: DCGM could not run its diagnostic: {first.error}",
                           "run `dcgmi diag -r 1` there to see why")
    unknown = sorted({result.test for result in first.results if result.status == "unknown"})
    if not first.failed():
        passed = sum(result.status == "pass" for result in first.results)
        gpus = len(first.gpus())
        summary = f"DCGM {first.version} level 1: no test failed ({passed} result(s) passed on {gpus} GPU(s))"
        warned = [result for result in first.results if result.status == "warn"]
        if warned:
            return CheckResult(node, CHECK, "warn", f"{node}: DCGM warned: {_describe(tuple(warned))}",
                               "read `dcgmi diag -r 1` on the node")
        if unknown:
            return CheckResult(node, CHECK, "warn", f"{node}: DCGM gave a status torchherd does not know for "
                                                    f"{', '.join(unknown)}", "read `dcgmi diag -r 1` on the node")
        return CheckResult(node, CHECK, "pass", summary)
    again = answer.get("again")
    repeated: set[str] | None = None
    if isinstance(again, str):
        try:
            repeated = _failed_tests(parse(again))
        except ValueError:
            repeated = None
    if repeated is None:
        return CheckResult(node, CHECK, "warn", f"{node}: DCGM failed {_describe(first.failed())}; a second run, "
                                                "to confirm it, gave no result", FIX)
    confirmed = tuple(result for result in first.failed() if result.test in repeated)
    if not confirmed:
        return CheckResult(node, CHECK, "warn", f"{node}: DCGM failed {_describe(first.failed())} once, and "
                                                "passed it on a second run", FIX)
    return CheckResult(node, CHECK, "fail", f"{node}: DCGM level 1 failed {_describe(confirmed)} (twice)", FIX)


def analyse(observed: Observed) -> list[CheckResult]:
    return [node_result(host.name, observed.gpu_diag[host.name])
            for host in observed.inventory.hosts if host.name in observed.gpu_diag]
