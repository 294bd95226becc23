"""The node side of the gpu, xid and ib checks: remote/facts.py run as a node runs it
(the in-process transport, the real script), with stand-ins for nvidia-smi, dmesg and
journalctl on its PATH and a made-up /sys and /proc under its root, then the analyses
on what it sent back."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from support.gpu import gather, stand_ins, tool
from support.gpu import gathered_observed as observed
from torchherd.checks.analysis import gpu, ib, xid

DATA = Path(__file__).parent / "data" / "gpu"


def sysfs(root: Path, ports: dict[str, dict[str, str]], peermem: bool) -> None:
    for name, values in ports.items():
        device, number = name.split("/")
        directory = root / "sys/class/infiniband" / device / "ports" / number
        directory.mkdir(parents=True)
        for key, value in values.items():
            (directory / key).write_text(value + "\n", encoding="utf-8")
    if peermem:
        (root / "sys/module/nvidia_peermem").mkdir(parents=True)


ACTIVE = {"state": "4: ACTIVE", "phys_state": "5: LinkUp", "rate": "400 Gb/sec (4X NDR)", "link_layer": "InfiniBand"}


@pytest.mark.timeout(60)
def test_a_gpu_node_gathers_and_reads_its_health(tmp_path: Path) -> None:
    xml = (DATA / "nvidia-smi" / "dual_a5000-v13.xml").read_text(encoding="utf-8")
    xml = xml.replace("<remapped_row_pending>No", "<remapped_row_pending>Yes", 1)
    log = (DATA / "kernel-log" / "nvsentinel-155-fallen-off-bus.txt").read_text(encoding="utf-8")
    root = tmp_path / "root"
    sysfs(root, {"mlx5_0/1": ACTIVE, "mlx5_1/1": dict(ACTIVE, state="1: DOWN", phys_state="2: Polling")},
          peermem=True)
    facts = gather(stand_ins(tmp_path, xml, log), root)
    assert facts.get("gpu")["query"]["code"] == 0
    assert facts.get("kernel_xids")["source"] == "dmesg"
    assert [port["state"] for port in facts.get("infiniband")["ports"]] == ["4: ACTIVE", "1: DOWN"]
    seen = observed(facts)
    (found,) = gpu.analyse(seen)
    assert (found.status, found.summary) == ("fail", "node0 GPU 0 (00000000:81:00.0): a row remapping pending")
    (kernel,) = xid.analyse(seen)
    assert kernel.status == "fail" and "Xid 79 on 0000:b3:00: the GPU has fallen off the bus" in kernel.summary
    (ports,) = ib.analyse(seen)
    assert (ports.status, ports.summary) == (
        "pass", "1 of 2 RDMA port(s) active (400 Gb/sec (4X NDR)); mlx5_1 port 1 down (not active on any node: unused)")


@pytest.mark.timeout(60)
def test_a_kernel_log_this_user_may_not_read_is_a_skip(tmp_path: Path) -> None:
    bin_dir = stand_ins(tmp_path, (DATA / "nvidia-smi" / "3090-v13.xml").read_text(encoding="utf-8"), "")
    tool(bin_dir, "dmesg", "echo 'dmesg: read kernel buffer failed: Operation not permitted' >&2; exit 1\n")
    # journalctl exits 0 when it may not read the system journal, and says so on stderr.
    tool(bin_dir, "journalctl", "echo 'No journal files were opened due to insufficient permissions.' >&2\n")
    facts = gather(bin_dir, tmp_path / "empty-root")
    (kernel,) = xid.analyse(observed(facts))
    assert kernel.status == "skip"
    assert kernel.summary == ("the kernel log could not be read on node0 (dmesg: dmesg: read kernel buffer "
                              "failed: Operation not permitted; journalctl: No journal files were opened due to "
                              "insufficient permissions.): Xids not checked")
    (ports,) = ib.analyse(observed(facts))
    assert (ports.status, ports.summary) == ("skip", "no InfiniBand or RoCE device here")


@pytest.mark.timeout(60)
def test_a_node_without_nvidia_smi_gathers_nothing_gpu(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    facts = gather(empty, tmp_path / "empty-root")
    assert facts.get("gpu") == {} and facts.get("kernel_xids") is None
    assert facts.get("infiniband")["ports"] == []


def pci_device(root: Path, address: str, vendor: str = "0x10de", cls: str = "0x030200",
               driver: str | None = "nvidia", virtual: bool = False) -> None:
    device = root / "sys/bus/pci/devices" / address
    device.mkdir(parents=True)
    (device / "vendor").write_text(vendor + "\n", encoding="utf-8")
    (device / "class").write_text(cls + "\n", encoding="utf-8")
    if driver is not None:
        target = root / "sys/bus/pci/drivers" / driver
        target.mkdir(parents=True, exist_ok=True)
        (device / "driver").symlink_to(target)
    if virtual:
        (device / "physfn").symlink_to(device)


@pytest.mark.timeout(60)
def test_a_gpu_on_the_pci_bus_that_nvidia_smi_does_not_list_fails(tmp_path: Path) -> None:
    root = tmp_path / "root"
    pci_device(root, "0000:81:00.0")
    pci_device(root, "0000:c1:00.0")
    pci_device(root, "0000:e1:00.0", driver=None)  # its probe failed: no driver bound
    pci_device(root, "0000:e2:00.0", driver="vfio-pci")  # passed through to a VM on purpose
    pci_device(root, "0000:e3:00.4", virtual=True)  # an SR-IOV virtual function (vGPU)
    pci_device(root, "0000:e4:00.0", cls="0x068000")  # an NVSwitch
    pci_device(root, "0000:05:00.0", vendor="0x15b3", cls="0x020700", driver="mlx5_core")  # a ConnectX HCA
    xml = (DATA / "nvidia-smi" / "dual_a5000-v13.xml").read_text(encoding="utf-8")  # GPUs 81:00.0 and C1:00.0
    facts = gather(stand_ins(tmp_path, xml, ""), root)
    assert facts.get("gpu")["pci"] == [{"bus": "0000:81:00.0", "driver": "nvidia"},
                                       {"bus": "0000:c1:00.0", "driver": "nvidia"},
                                       {"bus": "0000:e1:00.0", "driver": None},
                                       {"bus": "0000:e2:00.0", "driver": "vfio-pci"}]
    (found,) = gpu.analyse(observed(facts))
    assert (found.status, found.summary) == (
        "fail", "node0: the PCI bus lists 1 NVIDIA GPU(s) that nvidia-smi does not: 0000:e1:00.0 (no driver)")
    assert found.fix.startswith("drain node0 and power-cycle it")


@pytest.mark.timeout(60)
def test_an_nvidia_smi_that_never_answers_leaves_the_other_facts_whole(tmp_path: Path) -> None:
    """nvidia-smi stuck where its timeout cannot end it (here: its child holds the output
    open after the kill, as one stuck in the kernel would never exit): the facts still
    come back, the gpu check warns instead of the node's checks going missing."""
    bin_dir = stand_ins(tmp_path, "", "")
    tool(bin_dir, "nvidia-smi", f"sleep 30 & echo $! >> {tmp_path}/held; wait\n")
    try:
        started = time.monotonic()
        facts = gather(bin_dir, tmp_path / "empty-root", gpu_seconds=2)
        assert time.monotonic() - started < 10
    finally:
        for pid in (tmp_path / "held").read_text().split() if (tmp_path / "held").exists() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    assert facts.get("gpu") == {"error": "no answer within 2 s"}
    assert facts.get("hostname")  # the other facts are whole
    (found,) = gpu.analyse(observed(facts))
    assert (found.status, found.summary) == (
        "warn", "node0: nvidia-smi gave no answer within 2 s; GPU health not read (a GPU in a bad state can leave "
                "nvidia-smi stuck)")
