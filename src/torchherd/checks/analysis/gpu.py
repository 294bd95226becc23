"""``gpu``: the GPUs a node sees are enough for nproc_per_node, not already busy, and
healthy by ``nvidia-smi -q -x`` (ECC, row remapping, retired pages, a reset the driver
asks for, clock slowdowns, PCIe links, persistence and MIG modes), with the same driver,
CUDA version and GPU model as the other nodes."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

from torchherd.checks.analysis import nvsmi
from torchherd.checks.analysis.common import mapping, per_node
from torchherd.checks.model import NodeFacts, Observed
from torchherd.checks.results import CheckResult, CheckStatus
from torchherd.inventory import Host

CHECK = "gpu"


@dataclass(frozen=True)
class Finding:
    status: CheckStatus
    text: str
    fix: str


def analyse(observed: Observed) -> list[CheckResult]:
    reports = {name: smi_report(facts) for name, facts in observed.facts.items()}
    parsed = {name: report for name, report in reports.items() if isinstance(report, nvsmi.SmiReport)}
    peers = _Peers.of(parsed, {name: nvlinks(observed.facts[name]) for name in parsed})
    odd = odd_ones_out(parsed)
    return per_node(observed, CHECK, lambda seen, host, facts: _node(seen, host, facts, reports.get(host.name),
                                                                     peers, odd.get(host.name, [])))


def gpu_count(facts: NodeFacts) -> int | None:
    torch = mapping(facts.get("torch"))
    if isinstance(torch.get("gpus"), int) and not isinstance(torch.get("gpus"), bool):
        return int(torch["gpus"])
    smi = mapping(mapping(facts.get("gpu")).get("nvidia_smi"))
    if smi.get("code") == 0:
        return len([line for line in str(smi.get("out")).splitlines() if line.strip()])
    return None


def smi_report(facts: NodeFacts) -> nvsmi.SmiReport | str | None:
    """The node's ``nvidia-smi -q -x``, read; the reason when it could not be; None when
    nvidia-smi is not there (a CPU node, or GPUs seen by torch alone)."""
    query = mapping(facts.get("gpu")).get("query")
    if not isinstance(query, dict):
        return None
    if query.get("truncated"):
        return "nvidia-smi -q -x printed more than the node sends back"
    if query.get("code") != 0:
        lines = str(query.get("err") or query.get("out") or "").strip().splitlines()
        said = lines[-1][:200] if lines else f"exit status {query.get('code')}"
        return f"nvidia-smi -q -x failed ({said})"
    try:
        return nvsmi.parse(str(query.get("out") or ""))
    except nvsmi.SmiParseError as error:
        return f"nvidia-smi -q -x could not be read: {error}"


def _node(observed: Observed, host: Host, facts: NodeFacts, report: nvsmi.SmiReport | str | None,
          peers: _Peers, odd: list[str]) -> CheckResult:
    nproc = observed.nproc_of(host)
    count = gpu_count(facts)
    if count is None and isinstance(report, nvsmi.SmiReport):
        count = len(report.gpus)
    stuck = mapping(facts.get("gpu")).get("error")
    if count is None:
        if stuck:
            return _result(host.name, [_stuck(host.name, stuck)])
        return CheckResult(host.name, CHECK, "skip", "neither torch nor nvidia-smi could count GPUs here")
    listed = len(report.gpus) if isinstance(report, nvsmi.SmiReport) else 0
    oversized = _above_the_node(host, nproc, facts, count)
    if count == 0:
        if nproc == "gpu":
            return CheckResult(host.name, CHECK, "fail", f"no GPU visible on {host.name}, nproc_per_node = gpu",
                               "set nproc_per_node to a number (CPU, gloo) or check the driver (nvidia-smi)")
        if not listed and oversized:
            return _result(host.name, [oversized])
        if not listed:
            return CheckResult(host.name, CHECK, "skip",
                               f"CPU-only node: nproc_per_node = {nproc} runs on CPU (gloo)")
    findings: list[Finding] = []
    if count == 0 and listed:
        torch = facts.get("torch")
        cpu_build = isinstance(torch, dict) and "version" in torch and torch.get("cuda") is None
        findings.append(Finding(
            "warn", f"{host.name}: torch sees no GPU, nvidia-smi lists {listed}"
                    + (" (torch is a CPU build)" if cpu_build else ""),
            f"install a CUDA build of torch on {host.name}" if cpu_build
            else f"check CUDA_VISIBLE_DEVICES and the driver on {host.name} (`python -c 'import torch; "
                 "torch.cuda.init()'` says why)"))
    if isinstance(nproc, int) and nproc > count > 0:  # none at all: the job runs on CPU (gloo)
        findings.append(Finding("fail", f"{host.name} sees {count} GPU(s), nproc_per_node = {nproc}",
                                f"set nproc_per_node = {count}, or check CUDA_VISIBLE_DEVICES on {host.name}"))
    elif isinstance(nproc, int) and 0 < nproc < count and _nproc_given(observed, host):
        findings.append(Finding("warn", f"{count} GPU(s) visible, nproc_per_node = {nproc}: {count - nproc} GPU(s) "
                                        "idle unless each process uses several",
                                "--nproc-per-node gpu (nproc_per_node = \"gpu\") starts one process per GPU"))
    if oversized:
        findings.append(oversized)
    if stuck:
        findings.append(_stuck(host.name, stuck))
    if isinstance(report, nvsmi.SmiReport):
        findings += lost_gpus(host.name, facts, report) + health_findings(host.name, report, peers, nvlinks(facts),
                                                                          daemon_runs(facts))
    elif isinstance(report, str):
        findings.append(Finding("warn", f"{host.name}: {report}; ECC, remapping and clocks not checked",
                                f"run `nvidia-smi -q -x` on {host.name} to see why"))
    findings += [Finding("warn", text, "install the same driver and CUDA on every node, and the same GPUs")
                 for text in odd]
    apps = mapping(mapping(facts.get("gpu")).get("compute_apps"))
    busy = [line for line in str(apps.get("out", "")).splitlines() if line.strip()]
    if busy:
        findings.append(Finding("warn", f"{count} GPU(s); already in use by: {'; '.join(busy)}",
                                f"stop the other jobs on {host.name} or expect less memory and speed"))
    if findings:
        return _result(host.name, findings)
    return CheckResult(host.name, CHECK, "pass", f"{count} GPU(s) visible for nproc_per_node = {nproc}"
                       + (_describe(report) + _legacy_persistence(report, daemon_runs(facts))
                          if isinstance(report, nvsmi.SmiReport) else ""))


def _above_the_node(host: Host, nproc: int | str, facts: NodeFacts, gpus: int) -> Finding | None:
    """A host's own count above both its CPUs and its GPUs: ``ubuntu@gpu01:2222`` in a
    hostfile is MPICH's host:N, 2,222 processes, where -H reads an SSH port."""
    cpus = mapping(facts.get("cpu_contention")).get("cpus")
    if (host.nproc_per_node != nproc or not isinstance(nproc, int) or not isinstance(cpus, int)
            or nproc <= max(cpus, gpus)):
        return None
    return Finding("warn", f"nproc_per_node = {nproc} is above {host.name}'s {cpus} CPU(s) and {gpus} GPU(s) "
                           f"(a hostfile's {host.name}:{nproc} is read as {nproc} processes, MPICH's host:N, "
                           "not an SSH port)",
                   f"for an SSH port, write ssh_port = {nproc} in hosts.toml (or -H {host.name}:{nproc}); for "
                   f"processes, slots=N")


def _nproc_given(observed: Observed, host: Host) -> bool:
    """Whether someone chose this node's process count: the default 1 on a GPU node is
    told by the plan, not warned about here (a warning must never be a false alarm)."""
    cluster = observed.inventory.cluster
    return (host.nproc_per_node is not None or cluster.nproc_per_node_set
            or observed.nproc_per_node not in (None, cluster.nproc_per_node))


def _stuck(node: str, error: object) -> Finding:
    return Finding("warn", f"{node}: nvidia-smi gave {str(error)[:120]}; GPU health not read (a GPU in a bad state "
                           "can leave nvidia-smi stuck)",
                   f"run `nvidia-smi` on {node}; if it hangs, drain the node and reboot it")


def _result(node: str, findings: list[Finding]) -> CheckResult:
    """One result: the worst status, its findings first; every distinct fix."""
    ordered = sorted(findings, key=lambda finding: finding.status != "fail")
    fixes = list(dict.fromkeys(finding.fix for finding in ordered if finding.fix))
    status: CheckStatus = "fail" if ordered[0].status == "fail" else "warn"
    return CheckResult(node, CHECK, status, "; ".join(finding.text for finding in ordered), "; ".join(fixes))


def _describe(report: nvsmi.SmiReport) -> str:
    parts = [f"driver {report.driver}" if report.driver else "", f"CUDA {report.cuda}" if report.cuda else "",
             ", ".join(report.models)]
    shown = ", ".join(part for part in parts if part)
    return f" ({shown})" if shown else ""


@dataclass(frozen=True)
class _Peers:
    """What the same GPU model reaches elsewhere in the cluster: a link trained below its
    siblings' is a fault, where a link below the GPU's own maximum may be the slot's wiring
    (x8 slots, PCIe 3 hosts) or, idle, the power saving that every GPU does."""

    width: dict[str, int]
    gen: dict[str, int]
    """Among GPUs that were not idle."""
    nvlink: dict[str, int]
    """The most active NVLinks a GPU of the model has."""

    @staticmethod
    def of(reports: dict[str, nvsmi.SmiReport], links: dict[str, dict[int, tuple[int, int]]] | None = None) -> _Peers:
        width: dict[str, int] = {}
        gen: dict[str, int] = {}
        nvlink: dict[str, int] = {}
        for node, report in reports.items():
            for gpu in report.gpus:
                if gpu.link_width is not None:
                    width[gpu.name] = max(width.get(gpu.name, 0), gpu.link_width)
                if gpu.link_gen is not None and not gpu.idle:
                    gen[gpu.name] = max(gen.get(gpu.name, 0), gpu.link_gen)
                active = (links or {}).get(node, {}).get(gpu.index)
                if active is not None:
                    nvlink[gpu.name] = max(nvlink.get(gpu.name, 0), active[0])
        return _Peers(width, gen, nvlink)


def nvlinks(facts: NodeFacts) -> dict[int, tuple[int, int]]:
    """The node's ``nvidia-smi nvlink -s``: (active, listed) links per GPU; empty where it
    did not run or failed."""
    done = mapping(facts.get("gpu")).get("nvlink")
    if not isinstance(done, dict) or done.get("code") != 0:
        return {}
    return nvsmi.nvlink_links(str(done.get("out") or ""))


def health_findings(node: str, report: nvsmi.SmiReport, peers: _Peers | None = None,
                    links: dict[int, tuple[int, int]] | None = None, daemon: bool | None = None) -> list[Finding]:
    """Per GPU, what is wrong with it by its own report (and beside its peers'); ``daemon``:
    whether nvidia-persistenced runs on the node (None: not known)."""
    links = links or {}
    peers = peers or _Peers.of({node: report}, {node: links})
    findings: list[Finding] = []
    def persistence(node: str, gpu: nvsmi.SmiGpu, peers: _Peers) -> Finding | None:
        return _persistence(node, gpu, report.driver, daemon)

    for gpu in report.gpus:
        for check in (*_GPU_CHECKS[:-1], persistence, _GPU_CHECKS[-1]):
            found = check(node, gpu, peers)
            if found is not None:
                findings.append(found)
        found = _nvlink(node, gpu, links.get(gpu.index), peers)
        if found is not None:
            findings.append(found)
    return findings


def _nvlink(node: str, gpu: nvsmi.SmiGpu, links: tuple[int, int] | None, peers: _Peers) -> Finding | None:
    """Fewer active NVLinks than another GPU of its model has: a link down (a GPU whose
    model has none active anywhere, a PCIe card without a bridge, is not judged)."""
    most = peers.nvlink.get(gpu.name, 0)
    if links is None or links[0] >= most:
        return None
    return Finding("warn", f"{node} {gpu.label}: {links[1] - links[0]} of its {links[1]} NVLinks inactive "
                           f"(other {gpu.name} GPUs have {most} active)",
                   f"drain {node} and reset GPU {gpu.index} (`sudo nvidia-smi -r -i {gpu.index}`); if the links stay "
                   "down, the GPU or its baseboard needs service (`nvidia-smi nvlink -s` shows them)")


def lost_gpus(node: str, facts: NodeFacts, report: nvsmi.SmiReport) -> list[Finding]:
    """NVIDIA GPUs the PCI bus lists that nvidia-smi does not: bound to the driver (lost
    since: fallen off the bus) or to no driver (its probe failed). One bound to another
    driver (vfio-pci: passed through to a VM) is left alone."""
    pci = mapping(facts.get("gpu")).get("pci")
    if not isinstance(pci, list):
        return []
    seen = {_pci_address(gpu.bus_id) for gpu in report.gpus}
    lost = [entry for entry in pci if isinstance(entry, dict) and entry.get("driver") in ("nvidia", None)
            and _pci_address(str(entry.get("bus") or "")) not in seen]
    if not lost:
        return []
    shown = ", ".join(f"{entry.get('bus')} ({'the nvidia driver' if entry.get('driver') else 'no driver'})"
                      for entry in lost[:8])
    return [Finding("fail", f"{node}: the PCI bus lists {len(lost)} NVIDIA GPU(s) that nvidia-smi does not: {shown}",
                    f"drain {node} and power-cycle it (a GPU the driver lost does not come back without one); "
                    f"`dmesg | grep NVRM` on {node} says why (Xid 79, or a failed probe)")]


def _pci_address(bus: str) -> str:
    """``0000:c1:00.0`` for sysfs's and nvidia-smi's (``00000000:C1:00.0``) spellings."""
    domain, _, rest = bus.lower().partition(":")
    return f"{domain[-4:]}:{rest}"


def _reset_fix(node: str, gpu: nvsmi.SmiGpu) -> str:
    return (f"drain {node} and reset GPU {gpu.index}: `sudo nvidia-smi -r -i {gpu.index}` once no process uses it "
            f"(or reboot {node})")


def _memory(node: str, gpu: nvsmi.SmiGpu, peers: _Peers) -> Finding | None:
    if gpu.remap_failed:
        return Finding("fail", f"{node} {gpu.label}: row remapping failed, its memory cannot repair itself",
                       f"take {node} out of service: GPU {gpu.index} ({gpu.bus_id}) needs replacing")
    if gpu.sram_threshold_exceeded:
        return Finding("fail", f"{node} {gpu.label}: uncorrectable SRAM errors over the threshold",
                       f"take {node} out of service: GPU {gpu.index} ({gpu.bus_id}) needs replacing")
    pending = []
    if gpu.volatile_uncorrectable:
        pending.append(f"{gpu.volatile_uncorrectable} uncorrectable ECC error(s) since the last reset")
    if gpu.remap_pending:
        pending.append("a row remapping pending")
    if gpu.retirement_pending:
        pending.append("a page retirement pending")
    if gpu.reset_required or gpu.drain_and_reset:
        pending.append("the driver asks for a reset")
    if pending:
        return Finding("fail", f"{node} {gpu.label}: {', '.join(pending)}", _reset_fix(node, gpu))
    if gpu.aggregate_uncorrectable:
        # A lifetime count: a GPU whose rows were remapped after an error long ago works;
        # only a pending remap or a fresh (volatile) error needs action.
        return Finding("warn", f"{node} {gpu.label}: {gpu.aggregate_uncorrectable} uncorrectable ECC error(s) in "
                               "its lifetime, none since the last reset",
                       f"watch GPU {gpu.index} on {node}: a new error or a pending remap means a reset or a new GPU")
    return None


def _clocks(node: str, gpu: nvsmi.SmiGpu, peers: _Peers) -> Finding | None:
    if not gpu.clock_reasons:
        return None
    reasons = ", ".join(nvsmi.BAD_CLOCK_REASONS[reason] for reason in gpu.clock_reasons)
    return Finding("warn", f"{node} {gpu.label}: clocks held down ({reasons})",
                   f"check cooling and power on {node} (`nvidia-smi -q -d PERFORMANCE,TEMPERATURE,POWER`)")


def _link(node: str, gpu: nvsmi.SmiGpu, peers: _Peers) -> Finding | None:
    width = peers.width.get(gpu.name)
    gen = peers.gen.get(gpu.name)
    low = []
    if gpu.link_width is not None and width is not None and gpu.link_width < width:
        low.append(f"x{gpu.link_width} where the other {gpu.name} GPUs run x{width}")
    if gpu.link_gen is not None and not gpu.idle and gen is not None and gpu.link_gen < gen:
        low.append(f"PCIe gen {gpu.link_gen} under load where the other {gpu.name} GPUs run gen {gen}")
    if not low:
        return None
    return Finding("warn", f"{node} {gpu.label}: PCIe link {', '.join(low)}",
                   f"reseat GPU {gpu.index} on {node} or check its riser and BIOS PCIe settings")


DAEMON_ONLY_FROM = 580
"""The driver whose kernel module says "Persistence mode is deprecated and will be removed in
a future release. Please use nvidia-persistenced instead." (``nvidia-smi -pm 1``)."""


def daemon_runs(facts: NodeFacts) -> bool | None:
    """Whether nvidia-persistenced runs on the node; None where the facts do not say."""
    running = mapping(facts.get("gpu")).get("persistenced")
    return running if isinstance(running, bool) else None


def _legacy_only(driver: str | None) -> bool:
    """A driver that deprecates ``nvidia-smi -pm 1`` for nvidia-persistenced."""
    major = (driver or "").split(".")[0]
    return major.isdigit() and int(major) >= DAEMON_ONLY_FROM


def _persistence(node: str, gpu: nvsmi.SmiGpu, driver: str | None, daemon: bool | None) -> Finding | None:
    """Persistence off, unless nvidia-persistenced runs (it keeps the GPU initialised
    whatever the deprecated mode says); the fix names the one to use for this driver."""
    if gpu.persistence != "Disabled" or daemon:
        return None
    start = f"start nvidia-persistenced on {node}: `sudo systemctl enable --now nvidia-persistenced`"
    fix = (f"{start} (driver {driver} deprecates `nvidia-smi -pm 1`)" if _legacy_only(driver)
           else f"{start} (`sudo nvidia-smi -pm 1` also works on this driver; drivers from 580 on deprecate it)")
    return Finding("warn", f"{node} {gpu.label}: persistence mode off (every job start reinitialises the GPU)", fix)


def _legacy_persistence(report: nvsmi.SmiReport, daemon: bool | None) -> str:
    """On a healthy node: persistence by the mode a driver from 580 on deprecates, without
    nvidia-persistenced (it works; a later driver removes it)."""
    if daemon is not False or not _legacy_only(report.driver):
        return ""
    if not any(gpu.persistence == "Enabled" for gpu in report.gpus):
        return ""
    return (f"; persistence by `nvidia-smi -pm 1`, which driver {report.driver} deprecates: "
            "nvidia-persistenced is the one to use")


def _mig(node: str, gpu: nvsmi.SmiGpu, peers: _Peers) -> Finding | None:
    if gpu.mig != "Enabled":
        return None
    return Finding("warn", f"{node} {gpu.label}: MIG mode on, a rank gets one MIG slice, not the whole GPU",
                   f"turn MIG off on {node}: `sudo nvidia-smi -i {gpu.index} -mig 0` and reset the GPU")


def _fabric(node: str, gpu: nvsmi.SmiGpu, peers: _Peers) -> Finding | None:
    """On NVSwitch systems the fabric manager registers each GPU with the NVLink fabric;
    until it has, CUDA cannot start there (error 802, "system not yet initialized")."""
    state, status = gpu.fabric_state, gpu.fabric_status
    if state is None or (state == "Completed" and status in (None, "Success")):
        return None
    said = f"NVLink fabric {state.lower()}" + (f" ({status})" if status and status != "N/A" else "")
    return Finding("fail", f"{node} {gpu.label}: {said}, CUDA cannot start on it",
                   f"start the fabric manager on {node}: `sudo systemctl enable --now nvidia-fabricmanager` "
                   f"(`systemctl status nvidia-fabricmanager` says why it stopped)")


_GPU_CHECKS: tuple[Callable[[str, nvsmi.SmiGpu, _Peers], Finding | None], ...] = (
    _memory, _fabric, _clocks, _link, _mig)
"""Each GPU's own checks; the node's persistence comes before the last (MIG)."""


def odd_ones_out(reports: dict[str, nvsmi.SmiReport]) -> dict[str, list[str]]:
    """Per node, the driver, CUDA version or GPU models that differ from most nodes' (every
    node's, when no value is held by a majority)."""
    found: dict[str, list[str]] = {}
    for what, value_of in (("driver", lambda report: report.driver), ("CUDA", lambda report: report.cuda),
                           ("GPU model", lambda report: ", ".join(report.models) or None)):
        values = {node: value_of(report) for node, report in reports.items()}
        known = {node: value for node, value in values.items() if value}
        counts = Counter(known.values())
        if len(counts) < 2:
            continue
        common, most = counts.most_common(1)[0]
        majority = common if most * 2 > len(known) else None
        for node, value in known.items():
            if value == majority:
                continue
            others = sorted({f"{other} {theirs}" for other, theirs in known.items() if theirs != value})
            where = (f"{most} of {len(known)} nodes have {majority}" if majority is not None
                     else f"the nodes differ: {', '.join(others)}")
            found.setdefault(node, []).append(f"{node} has {what} {value}; {where}")
    return found
