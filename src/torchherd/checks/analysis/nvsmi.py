"""``nvidia-smi -q -x`` read into values: what the ``gpu`` check judges per GPU.

The XML comes from a node, so it is untrusted: it is size-capped, and anything that can
declare an entity (an internal DTD subset, ``<!ENTITY``) is refused before the parser
sees it. The only DOCTYPE allowed is the one nvidia-smi prints, naming its external DTD,
which the standard library's parser never fetches. A field that is absent, ``N/A`` or not
a number is unknown (None) and is never evidence of a fault.

The schema changed across driver generations, and every variant seen in real outputs is
read: ECC counts as ``volatile/double_bit/total`` (418) or ``*_uncorrectable*`` fields
(450 on: ``sram_uncorrectable``, then ``sram_uncorrectable_parity``/``_secded``), clock
reasons under ``clocks_throttle_reasons`` (before 535) or ``clocks_event_reasons``.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass

MAX_XML_BYTES = 8 << 20
"""nvidia-smi -q -x is 20-120 kB per GPU; 8 MiB holds 64 GPUs with every supported clock."""
_DOCTYPE = re.compile(r'<!DOCTYPE\s+nvidia_smi_log\s+SYSTEM\s+"[\w.\-]+"\s*>')
BAD_CLOCK_REASONS = {
    "hw_slowdown": "hardware slowdown",
    "hw_thermal_slowdown": "hardware thermal slowdown",
    "hw_power_brake_slowdown": "power brake",
    "sw_thermal_slowdown": "thermal slowdown",
}
"""Clock reasons that mean the GPU is held back by something wrong (heat, the power supply,
a failing board). The others (idle, the software power cap under load, application clocks,
sync boost, display) are how a healthy GPU runs."""


class SmiParseError(ValueError):
    """The output could not be read as nvidia-smi's XML (the message says why)."""


@dataclass(frozen=True)
class SmiGpu:
    """One ``<gpu>`` element; None where nvidia-smi said N/A, left the field out, or gave
    something that is not a value of the field's kind."""

    index: int
    """Its position in the output: nvidia-smi's own index (``-i``), in PCI bus order."""
    bus_id: str
    name: str
    persistence: str | None
    """"Enabled", "Disabled", or None (N/A: Windows, or not reported)."""
    mig: str | None
    """The current MIG mode: "Enabled", "Disabled", or None where the GPU has none."""
    volatile_uncorrectable: int | None
    """Uncorrectable ECC errors since the last driver load or GPU reset."""
    aggregate_uncorrectable: int | None
    """Over the GPU's lifetime (its InfoROM)."""
    sram_threshold_exceeded: bool | None
    retirement_pending: bool | None
    """Retired pages (pre-Ampere) waiting for a reset to take effect."""
    remap_pending: bool | None
    """A row remap (Ampere on) waiting for a reset to take effect."""
    remap_failed: bool | None
    reset_required: bool | None
    drain_and_reset: bool | None
    clock_reasons: tuple[str, ...]
    """The active reasons among BAD_CLOCK_REASONS (their keys)."""
    idle: bool
    """The idle clock reason is active, or the performance state is P8 or lower: its PCIe
    link is allowed to train down to save power."""
    link_gen: int | None
    link_gen_max: int | None
    """The lower of the GPU's and the host's maximum, where the output gives both."""
    link_width: int | None
    link_width_max: int | None
    fabric_state: str | None = None
    """NVSwitch systems (Hopper on): Not Started, In Progress, Completed; None where N/A."""
    fabric_status: str | None = None

    @property
    def label(self) -> str:
        return f"GPU {self.index} ({self.bus_id})"


@dataclass(frozen=True)
class SmiReport:
    driver: str | None
    cuda: str | None
    gpus: tuple[SmiGpu, ...]

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(sorted({gpu.name for gpu in self.gpus}))


def parse(text: str) -> SmiReport:
    """``nvidia-smi -q -x``'s output as values; raises SmiParseError when it is not that."""
    if len(text.encode("utf-8", "replace")) > MAX_XML_BYTES:
        raise SmiParseError(f"over {MAX_XML_BYTES >> 20} MiB")
    stripped = _DOCTYPE.sub("", text, count=1)
    if "<!DOCTYPE" in stripped or "<!ENTITY" in stripped:
        raise SmiParseError("it declares a DTD or entities, which nvidia-smi never does")
    try:
        root = ET.fromstring(stripped)
    except ET.ParseError as error:
        raise SmiParseError(f"not well-formed XML ({error})") from None
    if root.tag != "nvidia_smi_log":
        raise SmiParseError(f"its root element is <{root.tag[:40]}>, not <nvidia_smi_log>")
    gpus = tuple(_gpu(index, element) for index, element in enumerate(root.findall("gpu")))
    return SmiReport(_text(root, "driver_version"), _text(root, "cuda_version"), gpus)


def _text(element: ET.Element, path: str) -> str | None:
    found = element.find(path)
    if found is None or found.text is None:
        return None
    value = found.text.strip()
    return None if not value or value == "N/A" else value


def _int(element: ET.Element, path: str, suffix: str = "") -> int | None:
    """A count (ASCII digits only), or a width with its ``x`` (``16x``)."""
    value = _text(element, path) or ""
    match = re.fullmatch(r"([0-9]{1,9})" + re.escape(suffix), value)
    return int(match.group(1)) if match else None


def _yes(element: ET.Element, path: str) -> bool | None:
    value = (_text(element, path) or "").lower()
    return True if value == "yes" else False if value == "no" else None


def _uncorrectable(ecc: ET.Element | None, scope: str) -> int | None:
    """The sum of the scope's uncorrectable counts; None when none is a number."""
    section = None if ecc is None else ecc.find(scope)
    if section is None:
        return None
    counts = [_int(section, "double_bit/total")]
    counts += [_int(section, child.tag) for child in section if "uncorrectable" in child.tag]
    known = [count for count in counts if count is not None]
    return sum(known) if known else None


def _clock_reasons(gpu: ET.Element) -> tuple[tuple[str, ...], bool]:
    active: list[str] = []
    idle = False
    for container, prefix in (("clocks_event_reasons", "clocks_event_reason_"),
                              ("clocks_throttle_reasons", "clocks_throttle_reason_")):
        section = gpu.find(container)
        if section is None:
            continue
        for child in section:
            reason = child.tag.removeprefix(prefix)
            if (child.text or "").strip() != "Active":
                continue
            if reason == "gpu_idle":
                idle = True
            elif reason in BAD_CLOCK_REASONS and reason not in active:
                active.append(reason)
    return tuple(active), idle


def _gpu(index: int, gpu: ET.Element) -> SmiGpu:
    reasons, idle = _clock_reasons(gpu)
    state = re.fullmatch(r"P(\d+)", _text(gpu, "performance_state") or "")
    if state and int(state.group(1)) >= 8:
        idle = True
    link = "pci/pci_gpu_link_info"
    maxima = [gen for gen in (_int(gpu, f"{link}/pcie_gen/max_link_gen"), _int(gpu, f"{link}/pcie_gen/max_host_link_gen"))
              if gen is not None]
    ecc = gpu.find("ecc_errors")
    remap = gpu.find("remapped_rows")
    return SmiGpu(
        index=index,
        bus_id=(gpu.get("id") or _text(gpu, "pci/pci_bus_id") or "?")[:32],
        name=(_text(gpu, "product_name") or "unknown GPU")[:80],
        persistence=_text(gpu, "persistence_mode"),
        mig=_text(gpu, "mig_mode/current_mig"),
        volatile_uncorrectable=_uncorrectable(ecc, "volatile"),
        aggregate_uncorrectable=_uncorrectable(ecc, "aggregate"),
        sram_threshold_exceeded=None if ecc is None else _yes(ecc, "aggregate/sram_threshold_exceeded"),
        retirement_pending=_any_yes(gpu, ("retired_pages/pending_retirement", "retired_pages/pending_blacklist")),
        remap_pending=None if remap is None else _any_yes(remap, ("remapped_row_pending", "pending")),
        remap_failed=None if remap is None else _any_yes(remap, ("remapped_row_failure", "remap_failure_occurred")),
        reset_required=_yes(gpu, "gpu_reset_status/reset_required"),
        drain_and_reset=_yes(gpu, "gpu_reset_status/drain_and_reset_recommended"),
        clock_reasons=reasons,
        idle=idle,
        link_gen=_int(gpu, f"{link}/pcie_gen/current_link_gen"),
        link_gen_max=min(maxima) if maxima else None,
        link_width=_int(gpu, f"{link}/link_widths/current_link_width", "x"),
        link_width_max=_int(gpu, f"{link}/link_widths/max_link_width", "x"),
        fabric_state=_fabric(_text(gpu, "fabric/state")),
        fabric_status=_fabric(_text(gpu, "fabric/status")),
    )


def _fabric(value: str | None) -> str | None:
    return None if value is None or value == "Not Supported" else value[:80]


def _any_yes(element: ET.Element, paths: tuple[str, ...]) -> bool | None:
    answers = [_yes(element, path) for path in paths]
    if any(answer is True for answer in answers):
        return True
    return False if any(answer is False for answer in answers) else None


_NVLINK_GPU = re.compile(r"^GPU (\d+): ")
_NVLINK_LINK = re.compile(r"^\s+Link (\d+): (.*)$")


def nvlink_links(text: str) -> dict[int, tuple[int, int]]:
    """``nvidia-smi nvlink -s`` as (active links, links listed) per GPU index; a GPU
    without NVLink is not listed, or lists no link. Lines that are neither are ignored."""
    found: dict[int, list[bool]] = {}
    current: int | None = None
    for line in text.splitlines()[:10000]:
        gpu = _NVLINK_GPU.match(line)
        if gpu:
            current = int(gpu.group(1))
            found.setdefault(current, [])
            continue
        link = _NVLINK_LINK.match(line)
        if link and current is not None:
            found[current].append("inactive" not in link.group(2).lower())
    return {index: (sum(links), len(links)) for index, links in found.items()}
