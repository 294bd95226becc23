"""``ib``: the InfiniBand and RoCE ports the nodes' sysfs lists (state, rate), compared
across nodes; ``NCCL_IB_HCA`` naming devices that exist on every node; GPUDirect RDMA
(``nvidia_peermem``) where GPUs and RDMA ports are both there.

A port counts as down only where the job would use it: the same port is active on another
node, or ``NCCL_IB_HCA`` names it. A port down on every node is an unused one (a second
port without a cable) and passes, said. ``NCCL_SOCKET_IFNAME`` is the ``network`` check's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torchherd.checks.analysis.common import mapping, per_node
from torchherd.checks.analysis.gpu import gpu_count
from torchherd.checks.model import NodeFacts, Observed
from torchherd.checks.results import CheckResult, CheckStatus
from torchherd.inventory import Host

CHECK = "ib"
DMABUF_NCCL = (2, 19)
"""NCCL from 2.19 registers GPU memory through DMA-BUF where the kernel (5.12 on) and the
open GPU kernel modules allow it: GPUDirect RDMA without nvidia_peermem."""
DMABUF_KERNEL = (5, 12)


@dataclass(frozen=True)
class Port:
    device: str
    port: str
    state: str
    """sysfs's text without its number: ACTIVE, DOWN, INIT, ARMED."""
    phys_state: str
    rate: float | None
    """Gb/s; None when sysfs's text does not start with a number."""
    rate_text: str
    link_layer: str

    @property
    def name(self) -> str:
        return f"{self.device} port {self.port}"

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"


def ports_of(facts: NodeFacts) -> list[Port] | None:
    """The node's RDMA ports; None when the facts do not have them (an older facts script,
    or sysfs unreadable)."""
    found = facts.get("infiniband")
    if not isinstance(found, dict) or not isinstance(found.get("ports"), list):
        return None
    ports = []
    for entry in found["ports"]:
        if not isinstance(entry, dict):
            continue
        rate_text = str(entry.get("rate") or "")
        rate = re.match(r"\s*(\d+(?:\.\d+)?)\s*Gb/sec", rate_text)
        ports.append(Port(device=str(entry.get("device") or "?"), port=str(entry.get("port") or "?"),
                          state=_word(entry.get("state")), phys_state=_word(entry.get("phys_state")),
                          rate=float(rate.group(1)) if rate else None, rate_text=rate_text.strip(),
                          link_layer=str(entry.get("link_layer") or "")))
    return ports


def _word(value: object) -> str:
    """``4: ACTIVE`` -> ``ACTIVE``; ``5: LinkUp`` -> ``LinkUp``."""
    return str(value or "").split(":", 1)[-1].strip() or "unknown"


def hca_entries(spec: str) -> tuple[bool, bool, list[tuple[str, str | None]]]:
    """NCCL_IB_HCA as NCCL reads it: excluded (``^``), exact (``=``), and (device, port)."""
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    entries: list[tuple[str, str | None]] = []
    for item in spec.lstrip("=").split(","):
        device, _, port = item.strip().partition(":")
        if device:
            entries.append((device, port or None))
    return exclude, exact, entries


def analyse(observed: Observed) -> list[CheckResult]:
    cluster = {name: ports for name, facts in observed.facts.items() if (ports := ports_of(facts)) is not None}
    return per_node(observed, CHECK, lambda seen, host, facts: _node(seen, host, facts, cluster))


def _node(observed: Observed, host: Host, facts: NodeFacts, cluster: dict[str, list[Port]]) -> CheckResult:
    ports = cluster.get(host.name)
    if ports is None:
        return CheckResult(host.name, CHECK, "skip", "the node's RDMA ports were not read")
    env = {**mapping(facts.get("env")), **observed.env_of(host)}
    hca = str(env.get("NCCL_IB_HCA") or "")
    others = {node: theirs for node, theirs in cluster.items() if node != host.name}
    if not ports:
        if hca and not hca.startswith("^"):
            return CheckResult(host.name, CHECK, "fail", f"NCCL_IB_HCA={hca} but {host.name} has no RDMA device",
                               f"unset NCCL_IB_HCA for {host.name}, or check its InfiniBand driver (ibstat)")
        if others and all(any(port.active for port in theirs) for theirs in others.values()):
            # NCCL would take sockets here and RDMA on the others: the job would not form.
            return CheckResult(host.name, CHECK, "fail",
                               f"{host.name} has no RDMA device, while {_nodes(sorted(others))} have active ports",
                               f"check the InfiniBand driver on {host.name} (`ibstat`, `lsmod | grep mlx5`)")
        return CheckResult(host.name, CHECK, "skip", "no InfiniBand or RoCE device here")
    fails: list[str] = []
    warns: list[str] = []
    notes: list[str] = []
    fixes: list[str] = []
    named = _named_ports(hca, ports, host.name, fails, fixes)
    mine = {(port.device, port.port) for port in ports}
    missing = sorted({(p.device, p.port) for theirs in others.values() for p in theirs if p.active} - mine)
    if missing:
        shown = ", ".join(f"{device} port {number}" for device, number in missing[:4])
        warns.append(f"{host.name} lacks {shown}" + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
                     + ", active on other nodes")
        fixes.append(f"check the InfiniBand devices on {host.name} (`ibstat`): one may have failed or lost its "
                     "driver (or the nodes' hardware differs)")
    for port in ports:
        active_elsewhere = sorted(node for node, theirs in others.items()
                                  if any(p.device == port.device and p.port == port.port and p.active for p in theirs))
        if not port.active:
            down = f"{port.name} is {port.state} ({port.phys_state})"
            if active_elsewhere or port in named:
                why = (f"active on {', '.join(active_elsewhere[:3])}" if active_elsewhere else f"NCCL_IB_HCA={hca}")
                fails.append(f"{host.name} {down}; {why}")
                fixes.append(_down_fix(host.name, port))
            else:
                notes.append(f"{port.name} {port.state.lower()} (not active on any node: unused)")
            continue
        faster = [(node, p.rate) for node, theirs in others.items() for p in theirs
                  if p.device == port.device and p.port == port.port and p.active and p.rate is not None
                  and port.rate is not None and p.rate > port.rate]
        if faster:
            best = max(rate for _, rate in faster)
            at = sorted({node for node, rate in faster if rate == best})
            warns.append(f"{host.name} {port.name} runs at {port.rate_text}, {', '.join(at[:3])} at {best:g} Gb/sec")
            fixes.append(f"check the cable and switch port of {port.device} on {host.name} (`ibstat {port.device}`); "
                         "a link trained to a lower rate is a bad cable or a wrong switch setting")
    active = [port for port in ports if port.active]
    peermem = _peermem(host.name, facts, active)
    if peermem is not None:
        warns.append(peermem[0])
        fixes.append(peermem[1])
    if fails or warns:
        status: CheckStatus = "fail" if fails else "warn"
        return CheckResult(host.name, CHECK, status, "; ".join(fails + warns), "; ".join(dict.fromkeys(fixes)))
    rates = sorted({port.rate_text for port in active})
    said = f"{len(active)} of {len(ports)} RDMA port(s) active" + (f" ({', '.join(rates)})" if rates else "")
    if notes:
        said += "; " + "; ".join(notes)
    return CheckResult(host.name, CHECK, "pass", said)


def _nodes(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _named_ports(hca: str, ports: list[Port], node: str, fails: list[str], fixes: list[str]) -> list[Port]:
    """The ports NCCL_IB_HCA selects on this node; an entry that selects none fails."""
    if not hca:
        return []
    exclude, exact, entries = hca_entries(hca)
    if exclude:
        return []
    devices = sorted({port.device for port in ports})
    selected: list[Port] = []
    for device, number in entries:
        hits = [port for port in ports if (port.device == device if exact else port.device.startswith(device))
                and (number is None or port.port == number)]
        if not hits:
            shown = f"{device}:{number}" if number else device
            fails.append(f"NCCL_IB_HCA={hca}: {shown} names no port on {node} (it has {', '.join(devices)})")
            fixes.append(f"set NCCL_IB_HCA to devices every node has (`ls /sys/class/infiniband` on {node})")
        selected += hits
    return selected


def _down_fix(node: str, port: Port) -> str:
    if port.state == "INIT":
        return f"{port.name} on {node} is up but not configured: is a subnet manager running (opensm, the switch's)?"
    return f"check the cable and the switch port of {port.device} on {node} (`ibstat {port.device}`)"


def _peermem(node: str, facts: NodeFacts, active: list[Port]) -> tuple[str, str] | None:
    found = mapping(facts.get("infiniband"))
    if not active or found.get("peermem") or not (gpu_count(facts) or 0):
        return None
    if _dmabuf_capable(facts):
        return None
    return (f"{node} has GPUs and active RDMA ports but nvidia_peermem is not loaded: no GPUDirect RDMA, NCCL "
            "copies through host memory",
            f"`sudo modprobe nvidia_peermem` on {node} (and add it to /etc/modules-load.d)")


def _dmabuf_capable(facts: NodeFacts) -> bool:
    found = mapping(facts.get("infiniband"))
    nccl = str(mapping(facts.get("torch")).get("nccl") or "")
    return (_version(nccl) >= DMABUF_NCCL and _version(str(found.get("kernel") or "")) >= DMABUF_KERNEL
            and bool(found.get("open_driver")))


def _version(text: str) -> tuple[int, ...]:
    numbers = re.match(r"(\d+)\.(\d+)", text)
    return (int(numbers.group(1)), int(numbers.group(2))) if numbers else (0,)
