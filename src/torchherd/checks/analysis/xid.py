"""``xid``: the NVIDIA driver's Xid errors in the node's kernel log since boot, each with
what it means.

A GPU fallen off the bus (Xid 79) fails: it stays gone until the node is power-cycled.
Memory Xids (48, 63, 64, 92, 94, 95) and the driver's own faults warn: whether the GPU
still needs a reset is what its counters say now (the ``gpu`` check reads them; an Xid
from before a reset is history). The ones an application usually causes (13, 31, 43,
45) are named in a pass. Where the kernel log cannot be read (this user may not, or no tool answered in time), a
skip says so.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from torchherd.checks.analysis import nvsmi
from torchherd.checks.analysis.common import per_node
from torchherd.checks.analysis.gpu import smi_report
from torchherd.checks.model import NodeFacts, Observed
from torchherd.checks.results import CheckResult, CheckStatus
from torchherd.inventory import Host

CHECK = "xid"
_XID = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<bus>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.\d)?\): "
                  r"(?P<code>\d{1,4})\b,?\s*(?P<detail>.*)")
_FALLEN = re.compile(r"NVRM: (?:The NVIDIA )?GPU (?:at )?(?:PCI:)?(?P<bus>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:"
                     r"[0-9a-fA-F]{2})(?:\.\d)?\b.*fallen off the bus")
APPLICATION = "usually the application"
MEMORY = "memory"

MEANINGS: dict[int, tuple[str, str]] = {
    13: ("graphics engine exception", APPLICATION),
    31: ("GPU memory page fault", APPLICATION),
    43: ("GPU stopped processing", APPLICATION),
    45: ("channels cleaned up after an earlier error or a killed process", APPLICATION),
    48: ("double-bit ECC error", MEMORY),
    61: ("internal micro-controller breakpoint", "the driver or the GPU"),
    62: ("internal micro-controller halt", "the driver or the GPU"),
    63: ("ECC page retirement or row remapping recorded", MEMORY),
    64: ("ECC page retirement or row remapping failed", MEMORY),
    74: ("NVLink error", "the NVLink connection"),
    79: ("the GPU has fallen off the bus", "the GPU, its slot, riser or power"),
    92: ("high single-bit ECC error rate", MEMORY),
    94: ("contained ECC error (the process using the memory was stopped)", MEMORY),
    95: ("uncontained ECC error", MEMORY),
    109: ("context switch timeout", "the application, the driver or the GPU"),
    119: ("GSP firmware RPC timeout", "the driver or the GPU"),
    120: ("GSP firmware error", "the driver or the GPU"),
    154: ("the driver changed the GPU's recovery action", "the GPU"),
}
"""The common Xids (NVIDIA's Xid catalog): what each is and what usually causes it."""
MEANINGS.update({code: ("NVLink error", "the NVLink connection") for code in range(144, 151)})
FATAL = frozenset({79})
SHOWN = 6
"""Distinct (Xid, GPU) pairs a summary names; the rest are counted."""


@dataclass(frozen=True)
class Xid:
    code: int
    bus: str
    """The PCI address as the kernel prints it, lower case: ``0000:3b:00``."""
    detail: str


def parse_lines(lines: list[str]) -> list[Xid]:
    """The Xids among kernel log lines (dmesg's or journalctl's, with or without their
    prefixes); the driver's multi-line "fallen off the bus" message, which newer drivers
    print without an Xid, counts as an Xid 79."""
    found: list[Xid] = []
    fallen: list[Xid] = []
    for number, line in enumerate(lines):
        match = _XID.search(line)
        if match:
            found.append(Xid(int(match.group("code")), _short(match.group("bus")), match.group("detail")[:200]))
            continue
        if "fallen off the bus" not in line:
            continue
        # The message may span three lines, the GPU's address on the first.
        off = _FALLEN.search(" ".join(lines[max(0, number - 2):number + 1]))
        if off:
            fallen.append(Xid(79, _short(off.group("bus")), "GPU has fallen off the bus"))
    reported = {xid.bus for xid in found if xid.code == 79}
    return found + [xid for xid in dict.fromkeys(fallen) if xid.bus not in reported]


def _short(bus: str) -> str:
    """``0000:3b:00`` for the kernel's and nvidia-smi's spellings alike (nvidia-smi writes
    ``00000000:3B:00.0``)."""
    domain, rest = bus.lower().split(":", 1)
    return f"{domain[-4:]}:{rest[:5]}"


def analyse(observed: Observed) -> list[CheckResult]:
    return per_node(observed, CHECK, _node)


def _node(observed: Observed, host: Host, facts: NodeFacts) -> CheckResult:
    log = facts.get("kernel_xids")
    if not isinstance(log, dict):
        return CheckResult(host.name, CHECK, "skip", "no NVIDIA driver here")
    if "lines" not in log:
        said = str(log.get("error") or "no kernel log tool answered")[:300]
        return CheckResult(host.name, CHECK, "skip",
                           f"the kernel log could not be read on {host.name} ({said}): Xids not checked",
                           "to let check read it: add the user to the adm or systemd-journal group, or "
                           "`sysctl kernel.dmesg_restrict=0`")
    found = log.get("lines")
    lines = [line for line in found if isinstance(line, str)] if isinstance(found, list) else []
    report = smi_report(facts)
    return verdict(host.name, parse_lines(lines), report if isinstance(report, nvsmi.SmiReport) else None,
                   str(log.get("source") or "the kernel log"))


def verdict(node: str, xids: list[Xid], report: nvsmi.SmiReport | None, source: str) -> CheckResult:
    """The node's result for its Xids since boot; GPUs named by nvidia-smi's index where
    the report has their bus."""
    if not xids:
        return CheckResult(node, CHECK, "pass", f"no Xid errors since boot ({source})")
    index = {_short(gpu.bus_id): gpu.index for gpu in report.gpus} if report else {}
    counts = Counter((xid.code, xid.bus) for xid in xids)
    parts: list[tuple[CheckStatus, str]] = []
    for (code, bus), times in counts.items():
        meaning, cause = MEANINGS.get(code, ("see NVIDIA's Xid catalog", ""))
        where = f"GPU {index[bus]} ({bus})" if bus in index else bus
        said = f"Xid {code} on {where}" + (f" x{times}" if times > 1 else "") + f": {meaning}"
        said += f" ({cause})" if cause else ""
        status: CheckStatus = "fail" if code in FATAL else "pass" if cause == APPLICATION else "warn"
        parts.append((status, said))
    order = {"fail": 0, "warn": 1, "pass": 2}
    parts.sort(key=lambda part: order[part[0]])
    status = parts[0][0]
    shown = [text for _, text in parts[:SHOWN]] + ([f"{len(parts) - SHOWN} more"] if len(parts) > SHOWN else [])
    summary = f"{node}: " + "; ".join(shown) + f" (since boot, {source})"
    if status == "pass":
        return CheckResult(node, CHECK, "pass", summary)
    return CheckResult(node, CHECK, status, summary, _fix(node, [xid.code for xid in xids]))


def _fix(node: str, codes: list[int]) -> str:
    fixes = []
    if 79 in codes:
        fixes.append(f"drain {node} and power-cycle it (a GPU off the bus does not come back without one); if it "
                     "happens again, reseat or replace the GPU, its riser or its power cable")
    if any(MEANINGS.get(code, ("", ""))[1] == MEMORY for code in codes):
        fixes.append("memory errors: the gpu check says whether a GPU still needs a reset (ECC, remapping)")
    if any(code not in FATAL and MEANINGS.get(code, ("", ""))[1] != MEMORY and MEANINGS.get(code, ("", ""))[1]
           != APPLICATION for code in codes):
        fixes.append(f"look up the Xids in NVIDIA's Xid catalog; `dmesg | grep Xid` on {node} shows them all")
    return "; ".join(fixes)
