"""The gpu, xid and ib analyses on real node outputs (tests/unit/data/gpu, sources in its
README): every real nvidia-smi document read, faults derived from them by one visible
substitution, hostile documents refused without a fail."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from support.gpu import by_node, node_facts, observed, smi, xid_result
from torchherd.checks.analysis import gpu, ib, nvsmi, xid
from torchherd.checks.model import NodeFacts, Observed
from torchherd.inventory import parse

DATA = Path(__file__).parent / "data" / "gpu"
SMI = sorted((DATA / "nvidia-smi").glob("*.xml"))
KERNEL = DATA / "kernel-log"


# --- nvidia-smi -q -x -------------------------------------------------------------------

@pytest.mark.parametrize("path", SMI, ids=[path.name for path in SMI])
def test_every_real_document_is_read(path: Path) -> None:
    report = nvsmi.parse(path.read_text(encoding="utf-8"))
    assert report.gpus and all(gpu.bus_id.startswith("00000000:") for gpu in report.gpus)
    for found in report.gpus:
        assert found.volatile_uncorrectable in (0, None) and not found.remap_pending and not found.remap_failed
        assert found.clock_reasons == ()


def test_the_documents_span_three_driver_generations() -> None:
    drivers = {nvsmi.parse(path.read_text(encoding="utf-8")).driver for path in SMI}
    majors = {int(driver.split(".")[0]) for driver in drivers if driver}
    assert {418, 515, 535, 590}.issubset(majors), majors


EXPECTED_WARNINGS = {
    # Persistence mode off is a setting of these machines, not a fault of the GPU: a warn.
    "a100-sxm4-v12.xml": ["persistence mode off", "MIG mode on"],
    "a10g.xml": ["persistence mode off"], "gtx-1660-ti.xml": ["persistence mode off"],
    "quadro-p400.xml": ["persistence mode off"], "rtx-3080-v13.xml": ["persistence mode off"],
    "tesla-t4.xml": ["persistence mode off"],
}


@pytest.mark.parametrize("path", SMI, ids=[path.name for path in SMI])
def test_healthy_documents_never_fail_and_warn_only_for_their_settings(path: Path) -> None:
    report = nvsmi.parse(path.read_text(encoding="utf-8"))
    findings = gpu.health_findings("n0", report)
    assert all(finding.status == "warn" for finding in findings)
    wanted = EXPECTED_WARNINGS.get(path.name, [])
    assert [next(word for word in wanted if word in finding.text) for finding in findings] == wanted


def test_the_old_and_new_ecc_schemas_are_both_counted() -> None:
    old = smi("quadro-p400.xml")  # 418: volatile/double_bit/total
    assert nvsmi.parse(old).gpus[0].volatile_uncorrectable is None  # N/A on a Quadro without ECC
    t4 = smi("tesla-t4.xml")  # 515: sram_uncorrectable + dram_uncorrectable
    assert nvsmi.parse(t4).gpus[0].volatile_uncorrectable == 0
    broken = t4.replace("<dram_uncorrectable>0</dram_uncorrectable>", "<dram_uncorrectable>2</dram_uncorrectable>", 1)
    assert nvsmi.parse(broken).gpus[0].volatile_uncorrectable == 2
    assert nvsmi.parse(broken).gpus[0].aggregate_uncorrectable == 0


def test_a_volatile_ecc_error_fails_naming_the_gpu_and_the_reset() -> None:
    xml = smi("a100-sxm4-v12.xml").replace("<dram_uncorrectable>0</dram_uncorrectable>",
                                           "<dram_uncorrectable>2</dram_uncorrectable>", 1)
    result = by_node(gpu.analyse(observed(node0=node_facts(xml, 1))))["node0"]
    assert result.status == "fail"
    assert result.summary.startswith("node0 GPU 0 (00000000:01:00.0): 2 uncorrectable ECC error(s) since the last "
                                     "reset; ")
    assert result.fix.startswith("drain node0 and reset GPU 0: `sudo nvidia-smi -r -i 0` once no process uses it "
                                 "(or reboot node0)")


def test_a_pending_remap_on_the_second_gpu_names_it() -> None:
    xml = smi("dual_a5000-v13.xml")
    first = xml.index("<remapped_row_pending>No")
    second = xml.index("<remapped_row_pending>No", first + 1)
    xml = xml[:second] + xml[second:].replace("<remapped_row_pending>No", "<remapped_row_pending>Yes", 1)
    result = by_node(gpu.analyse(observed(2, node0=node_facts(xml, 2))))["node0"]
    assert (result.status, result.summary) == ("fail", "node0 GPU 1 (00000000:C1:00.0): a row remapping pending")
    assert result.fix == ("drain node0 and reset GPU 1: `sudo nvidia-smi -r -i 1` once no process uses it "
                          "(or reboot node0)")


def test_a_failed_remap_asks_for_a_new_gpu() -> None:
    xml = smi("rtx-4000-sff-ada-v13.xml").replace("<remapped_row_failure>No", "<remapped_row_failure>Yes")
    result = by_node(gpu.analyse(observed(node0=node_facts(xml, 1))))["node0"]
    assert result.summary == "node0 GPU 0 (00000000:06:00.0): row remapping failed, its memory cannot repair itself"
    assert result.fix == "take node0 out of service: GPU 0 (00000000:06:00.0) needs replacing"


def test_a_pending_page_retirement_fails() -> None:
    xml = smi("tesla-t4.xml").replace("<pending_retirement>No", "<pending_retirement>Yes")
    result = by_node(gpu.analyse(observed(node0=node_facts(xml, 1))))["node0"]
    assert result.status == "fail" and "GPU 0 (00000000:00:1E.0): a page retirement pending" in result.summary


def test_a_lifetime_ecc_count_alone_warns() -> None:
    xml = smi("tesla-t4.xml")
    aggregate = xml.index("<aggregate>")
    xml = xml[:aggregate] + xml[aggregate:].replace("<dram_uncorrectable>0", "<dram_uncorrectable>3", 1)
    findings = gpu.health_findings("n0", nvsmi.parse(xml))
    assert [(f.status, f.text) for f in findings if "ECC" in f.text] == [
        ("warn", "n0 GPU 0 (00000000:00:1E.0): 3 uncorrectable ECC error(s) in its lifetime, none since the last "
                 "reset")]


def test_a_thermal_slowdown_warns() -> None:
    xml = smi("3090-v13.xml").replace(
        "<clocks_event_reason_hw_thermal_slowdown>Not Active", "<clocks_event_reason_hw_thermal_slowdown>Active")
    result = by_node(gpu.analyse(observed(node0=node_facts(xml, 1))))["node0"]
    assert (result.status, result.summary) == (
        "warn", "node0 GPU 0 (00000000:09:00.0): clocks held down (hardware thermal slowdown)")
    assert result.fix.startswith("check cooling and power on node0")


def test_the_old_throttle_schema_is_read_too() -> None:
    xml = smi("tesla-t4.xml").replace("<clocks_throttle_reason_hw_slowdown>Not Active",
                                      "<clocks_throttle_reason_hw_slowdown>Active")
    assert nvsmi.parse(xml).gpus[0].clock_reasons == ("hw_slowdown",)


def test_a_link_narrower_than_its_siblings_warns_but_a_narrow_slot_everywhere_does_not() -> None:
    healthy = smi("dual_a5000-v13.xml")
    narrow = healthy.replace("<current_link_width>16x", "<current_link_width>8x", 1)
    results = by_node(gpu.analyse(observed(2, node0=node_facts(healthy, 2), node1=node_facts(narrow, 2))))
    assert results["node0"].status == "pass"
    assert results["node1"].summary == ("node1 GPU 0 (00000000:81:00.0): PCIe link x8 where the other NVIDIA RTX "
                                        "A5000 GPUs run x16")
    # The A10G and T4 run x8 of x16 on every AWS host: no sibling runs wider, nothing to say.
    assert not [f for f in gpu.health_findings("n0", nvsmi.parse(smi("a10g.xml"))) if "PCIe" in f.text]


def test_an_idle_gpu_trained_down_in_generation_is_not_a_fault() -> None:
    report = nvsmi.parse(smi("dual_a5000-v13.xml"))
    assert [(g.idle, g.link_gen, g.link_gen_max) for g in report.gpus] == [(True, 1, 4), (True, 1, 4)]
    assert gpu.health_findings("n0", report) == []


def test_the_odd_driver_out_is_named_by_majority() -> None:
    xml = smi("dual_2070-v13.xml")
    odd = xml.replace("<driver_version>590.44.01", "<driver_version>580.95.05")
    results = by_node(gpu.analyse(observed(2, node0=node_facts(xml, 2), node1=node_facts(xml, 2),
                                           node2=node_facts(odd, 2))))
    assert results["node0"].status == results["node1"].status == "pass"
    assert (results["node2"].status, results["node2"].summary) == (
        "warn", "node2 has driver 580.95.05; 2 of 3 nodes have 590.44.01")


def test_two_nodes_that_differ_are_both_named() -> None:
    results = by_node(gpu.analyse(observed(2, node0=node_facts(smi("dual_2070-v13.xml"), 2),
                                           node1=node_facts(smi("dual_2080-v13.xml"), 2))))
    assert results["node0"].summary == ("node0 has GPU model NVIDIA GeForce RTX 2070; the nodes differ: node1 NVIDIA "
                                        "GeForce RTX 2080")


def test_the_pass_names_driver_cuda_and_model() -> None:
    result = by_node(gpu.analyse(observed(2, node0=node_facts(smi("dual_a5000-v13.xml"), 2))))["node0"]
    assert (result.status, result.summary) == (
        "pass", "2 GPU(s) visible for nproc_per_node = 2 (driver 590.44.01, CUDA 13.1, NVIDIA RTX A5000)")


def test_fewer_gpus_than_processes_still_fails_as_before() -> None:
    result = by_node(gpu.analyse(observed(4, node0=node_facts(smi("dual_a5000-v13.xml"), 2))))["node0"]
    assert (result.status, result.summary) == ("fail", "node0 sees 2 GPU(s), nproc_per_node = 4")


def test_a_cpu_node_without_nvidia_smi_skips_as_before() -> None:
    result = by_node(gpu.analyse(observed(2, node0=node_facts(None, 0))))["node0"]
    assert (result.status, result.summary) == ("skip", "CPU-only node: nproc_per_node = 2 runs on CPU (gloo)")


HOSTILE = [
    ('<?xml version="1.0"?><!DOCTYPE l [<!ENTITY a "aaaa"><!ENTITY b "&a;&a;&a;">]><nvidia_smi_log>&b;'
     '</nvidia_smi_log>', "it declares a DTD or entities, which nvidia-smi never does"),
    ('<!DOCTYPE nvidia_smi_log SYSTEM "x.dtd"><!ENTITY x "y"><nvidia_smi_log/>',
     "it declares a DTD or entities, which nvidia-smi never does"),
    ("<nvidia_smi_log><gpu>", "not well-formed XML (no element found: line 1, column 21)"),
    ("<html/>", "its root element is <html>, not <nvidia_smi_log>"),
    ("<a>" * 10 + "x" * (nvsmi.MAX_XML_BYTES + 1), "over 8 MiB"),
]


@pytest.mark.parametrize("text,reason", HOSTILE, ids=["entities", "entity-after-doctype", "truncated", "root",
                                                      "size"])
def test_hostile_documents_are_refused_and_only_warn(text: str, reason: str) -> None:
    with pytest.raises(nvsmi.SmiParseError) as raised:
        nvsmi.parse(text)
    assert str(raised.value) == reason
    result = by_node(gpu.analyse(observed(node0=node_facts(text, 1))))["node0"]
    assert result.status == "warn"
    assert result.summary == f"node0: nvidia-smi -q -x could not be read: {reason}; ECC, remapping and clocks not checked"


def test_unparseable_values_are_unknown_never_a_fault() -> None:
    xml = smi("tesla-t4.xml").replace("<dram_uncorrectable>0</dram_uncorrectable>",
                                      "<dram_uncorrectable>lots</dram_uncorrectable>", 1)
    xml = xml.replace("<pending_retirement>No", "<pending_retirement>Maybe")
    report = nvsmi.parse(xml)
    assert report.gpus[0].volatile_uncorrectable == 0 and report.gpus[0].retirement_pending is False  # pending_blacklist: No
    assert all(finding.status == "warn" for finding in gpu.health_findings("n0", report))


def test_a_failing_nvidia_smi_is_said() -> None:
    facts = NodeFacts(raw={"torch": {"gpus": 1}, "gpu": {"query": {"code": 9, "out": "",
                                                                   "err": "NVIDIA-SMI has failed because it couldn't "
                                                                          "communicate with the NVIDIA driver.\n"}}},
                      sent=0.0, received=0.0)
    result = by_node(gpu.analyse(observed(node0=facts)))["node0"]
    assert result.status == "warn" and "couldn't communicate with the NVIDIA driver" in result.summary


# --- Xid --------------------------------------------------------------------------------

def kernel(name: str) -> list[str]:
    return (KERNEL / name).read_text(encoding="utf-8").splitlines()


def test_application_xids_pass_and_say_so() -> None:
    result = xid_result(kernel("tinygrad-6947-dmesg.txt"))
    assert (result.status, result.summary) == (
        "pass", "node0: Xid 31 on 0000:01:00 x2: GPU memory page fault (usually the application) (since boot, dmesg)")


def test_a_gpu_off_the_bus_fails_in_both_spellings() -> None:
    result = xid_result(kernel("nvsentinel-155-fallen-off-bus.txt"))
    assert result.status == "fail"
    assert result.summary == ("node0: Xid 79 on 0000:44:00: the GPU has fallen off the bus (the GPU, its slot, riser "
                              "or power); Xid 79 on 0000:b3:00: the GPU has fallen off the bus (the GPU, its slot, "
                              "riser or power) (since boot, dmesg)")
    assert result.fix.startswith("drain node0 and power-cycle it")


def test_an_xid_is_named_by_the_gpu_index_nvidia_smi_gives() -> None:
    xml = smi("rtx-3060-v12.xml")  # bus 00000000:2D:00.0
    result = xid_result(["[  99.1] NVRM: Xid (PCI:0000:2d:00): 79, pid=0, GPU has fallen off the bus."], xml)
    assert result.summary.startswith("node0: Xid 79 on GPU 0 (0000:2d:00): the GPU has fallen off the bus")


def test_memory_and_driver_xids_warn_and_point_at_the_gpu_check() -> None:
    result = xid_result(kernel("gpud-1174-xid94.txt"))
    assert result.status == "warn"
    assert result.summary == ("node0: Xid 94 on 0000:9b:00: contained ECC error (the process using the memory was "
                              "stopped) (memory); Xid 145 on 0018:01:00: NVLink error (the NVLink connection) "
                              "(since boot, dmesg)")
    assert result.fix.startswith("memory errors: the gpu check says whether a GPU still needs a reset")


@pytest.mark.parametrize("name,codes", [
    ("gpud-46-dmesg-ctime.txt", [13, 13, 13, 109]),
    ("chia-gigahorse-301-dmesg.txt", [31, 62, 45, 45, 45]),
    ("open-gpu-kernel-modules-1150-journal.txt", [45] * 5),
    ("nvidia-forum-371272-gsp.txt", [62, 154]),
])
def test_every_real_log_is_read(name: str, codes: list[int]) -> None:
    assert [found.code for found in xid.parse_lines(kernel(name))] == codes


def test_an_unreadable_kernel_log_is_a_skip_saying_why() -> None:
    said = "dmesg: dmesg: read kernel buffer failed: Operation not permitted; journalctl: No journal files were opened"
    facts = node_facts(None, 1, kernel_xids={"error": said})
    result = by_node(xid.analyse(observed(node0=facts)))["node0"]
    assert result.status == "skip"
    assert result.summary == f"the kernel log could not be read on node0 ({said}): Xids not checked"


def test_no_driver_no_xid_check() -> None:
    result = by_node(xid.analyse(observed(node0=node_facts(None, 0, kernel_xids=None))))["node0"]
    assert (result.status, result.summary) == ("skip", "no NVIDIA driver here")


# --- InfiniBand -------------------------------------------------------------------------
# sysfs's own spellings (drivers/infiniband/core/sysfs.c), as a real inventory printed them:
# "4: ACTIVE" / "5: LinkUp" / "400 Gb/sec (4X NDR)"; a port without a link reads "1: DOWN",
# "2: Polling", "10 Gb/sec (4X SDR)".

def port(device: str, state: str = "4: ACTIVE", phys: str = "5: LinkUp", rate: str = "400 Gb/sec (4X NDR)",
         layer: str = "InfiniBand", number: str = "1") -> dict[str, str]:
    return {"device": device, "port": number, "state": state, "phys_state": phys, "rate": rate, "link_layer": layer}


def ib_facts(*ports: dict[str, str], gpus: int = 8, peermem: bool = True, env: dict[str, str] | None = None,
             **extra: Any) -> NodeFacts:
    found = {"ports": list(ports), "peermem": ["nvidia_peermem"] if peermem else [], "kernel": "5.15.0",
             "open_driver": False, **extra}
    return node_facts(None, gpus, infiniband=found, env=env or {})


DOWN = {"state": "1: DOWN", "phys": "2: Polling", "rate": "10 Gb/sec (4X SDR)"}


def test_healthy_ports_pass() -> None:
    results = by_node(ib.analyse(observed(node0=ib_facts(port("mlx5_0"), port("mlx5_1")),
                                          node1=ib_facts(port("mlx5_0"), port("mlx5_1")))))
    assert results["node1"].status == "pass"
    assert results["node1"].summary == "2 of 2 RDMA port(s) active (400 Gb/sec (4X NDR))"


def test_a_port_down_where_the_others_are_up_fails_on_that_node_alone() -> None:
    results = by_node(ib.analyse(observed(node0=ib_facts(port("mlx5_0"), port("mlx5_1")),
                                          node1=ib_facts(port("mlx5_0"), port("mlx5_1", **DOWN)),
                                          node2=ib_facts(port("mlx5_0"), port("mlx5_1")))))
    assert results["node0"].status == results["node2"].status == "pass"
    assert results["node1"].status == "fail"
    assert results["node1"].summary == "node1 mlx5_1 port 1 is DOWN (Polling); active on node0, node2"
    assert results["node1"].fix == "check the cable and the switch port of mlx5_1 on node1 (`ibstat mlx5_1`)"


def test_a_port_down_everywhere_is_unused_not_a_fault() -> None:
    results = by_node(ib.analyse(observed(node0=ib_facts(port("mlx5_0"), port("mlx5_0", number="2", **DOWN)),
                                          node1=ib_facts(port("mlx5_0"), port("mlx5_0", number="2", **DOWN)))))
    assert results["node0"].status == "pass"
    assert results["node0"].summary == ("1 of 2 RDMA port(s) active (400 Gb/sec (4X NDR)); mlx5_0 port 2 down "
                                        "(not active on any node: unused)")


def test_a_port_at_a_lower_rate_warns_naming_the_faster_nodes() -> None:
    results = by_node(ib.analyse(observed(node0=ib_facts(port("mlx5_0")),
                                          node1=ib_facts(port("mlx5_0", rate="200 Gb/sec (2X NDR)")))))
    assert results["node0"].status == "pass"
    assert (results["node1"].status, results["node1"].summary) == (
        "warn", "node1 mlx5_0 port 1 runs at 200 Gb/sec (2X NDR), node0 at 400 Gb/sec")


def test_init_means_no_subnet_manager() -> None:
    results = by_node(ib.analyse(observed(node0=ib_facts(port("mlx5_0")),
                                          node1=ib_facts(port("mlx5_0", state="2: INIT")))))
    assert results["node1"].fix.startswith("mlx5_0 port 1 on node1 is up but not configured: is a subnet manager")


def test_nccl_ib_hca_must_name_ports_the_node_has() -> None:
    env = {"NCCL_IB_HCA": "=mlx5_0:1,mlx5_4:1"}
    results = by_node(ib.analyse(observed(node0=ib_facts(port("mlx5_0"), env=env))))
    assert results["node0"].status == "fail"
    assert results["node0"].summary == "NCCL_IB_HCA==mlx5_0:1,mlx5_4:1: mlx5_4:1 names no port on node0 (it has mlx5_0)"
    prefix = by_node(ib.analyse(observed(node0=ib_facts(port("mlx5_0"), port("mlx5_1"),
                                                         env={"NCCL_IB_HCA": "mlx5"}))))
    assert prefix["node0"].status == "pass"
    excluded = by_node(ib.analyse(observed(node0=ib_facts(port("mlx5_0"), env={"NCCL_IB_HCA": "^mlx5_9"}))))
    assert excluded["node0"].status == "pass"


def test_a_port_nccl_is_told_to_use_must_be_up_even_if_no_other_node_has_it_up() -> None:
    results = by_node(ib.analyse(observed(node0=ib_facts(port("mlx5_0", **DOWN), env={"NCCL_IB_HCA": "mlx5_0"}))))
    assert results["node0"].summary == "node0 mlx5_0 port 1 is DOWN (Polling); NCCL_IB_HCA=mlx5_0"


def test_gpus_and_rdma_without_peermem_warn_unless_dmabuf_serves() -> None:
    results = by_node(ib.analyse(observed(node0=ib_facts(port("mlx5_0"), peermem=False))))
    assert results["node0"].status == "warn"
    assert results["node0"].summary.startswith("node0 has GPUs and active RDMA ports but nvidia_peermem is not loaded")
    raw = dict(ib_facts(port("mlx5_0"), peermem=False, kernel="6.8.0-45-generic", open_driver=True).raw)
    raw["torch"] = {"gpus": 8, "nccl": "2.21.5"}
    dmabuf = by_node(ib.analyse(observed(node0=NodeFacts(raw=raw, sent=0.0, received=0.0))))
    assert dmabuf["node0"].status == "pass"
    cpu = by_node(ib.analyse(observed(node0=ib_facts(port("mlx5_0"), peermem=False, gpus=0))))
    assert cpu["node0"].status == "pass"


def test_no_rdma_no_gpu_is_a_skip_never_a_fail() -> None:
    results = by_node(ib.analyse(observed(node0=ib_facts(gpus=0))))
    assert (results["node0"].status, results["node0"].summary) == ("skip", "no InfiniBand or RoCE device here")


# --- NVLink -----------------------------------------------------------------------------

def nvlink(name: str) -> str:
    return (DATA / "nvlink" / name).read_text(encoding="utf-8")


def test_nvlink_listings_are_counted() -> None:
    assert nvsmi.nvlink_links(nvlink("azhpc-diagnostics-73-v100-inactive.txt")) == {3: (4, 6)}
    assert nvsmi.nvlink_links(nvlink("k8s-test-infra-371-gb200.txt")) == {0: (18, 18), 1: (2, 2)}
    assert nvsmi.nvlink_links("NVML: Unable to retrieve NVLink information as all links are inActive\n") == {}


def test_a_gpu_with_fewer_active_nvlinks_than_its_sibling_warns() -> None:
    broken = nvlink("azhpc-diagnostics-73-v100-inactive.txt").replace("GPU 3:", "GPU 1:")
    healthy = broken.replace("GPU 1:", "GPU 0:").replace("<inactive>", "25.781 GB/s")
    facts = node_facts(smi("dual_a5000-v13.xml"), 2)
    raw = dict(facts.raw, gpu=dict(facts.raw["gpu"], nvlink={"code": 0, "out": healthy + broken, "err": ""}))
    result = by_node(gpu.analyse(observed(2, node0=NodeFacts(raw=raw, sent=0.0, received=0.0))))["node0"]
    assert (result.status, result.summary) == (
        "warn", "node0 GPU 1 (00000000:C1:00.0): 2 of its 6 NVLinks inactive (other NVIDIA RTX A5000 GPUs have 6 "
                "active)")
    assert result.fix.startswith("drain node0 and reset GPU 1")
    alone = dict(facts.raw, gpu=dict(facts.raw["gpu"], nvlink={"code": 0, "out": broken, "err": ""}))
    result = by_node(gpu.analyse(observed(2, node0=NodeFacts(raw=alone, sent=0.0, received=0.0))))["node0"]
    assert result.status == "pass"  # no sibling with more links: nothing to compare with


def test_an_nvlink_fabric_not_started_fails_and_asks_for_the_fabric_manager() -> None:
    xml = smi("3090-v13.xml")
    assert nvsmi.parse(xml).gpus[0].fabric_state is None  # N/A: no NVSwitch
    stuck = xml.replace("<state>N/A</state>", "<state>Not Started</state>", 1)
    result = by_node(gpu.analyse(observed(node0=node_facts(stuck, 1))))["node0"]
    assert (result.status, result.summary) == (
        "fail", "node0 GPU 0 (00000000:09:00.0): NVLink fabric not started, CUDA cannot start on it")
    assert result.fix.startswith("start the fabric manager on node0: `sudo systemctl enable --now "
                                 "nvidia-fabricmanager`")
    done = xml.replace("<state>N/A</state>", "<state>Completed</state>", 1).replace(
        "<status>N/A</status>", "<status>Success</status>", 1)
    assert gpu.health_findings("n0", nvsmi.parse(done)) == []


def test_a_cpu_build_of_torch_on_a_gpu_node_is_said_and_the_gpus_still_judged() -> None:
    xml = smi("dual_a5000-v13.xml").replace("<remapped_row_pending>No", "<remapped_row_pending>Yes", 1)
    raw = dict(node_facts(xml).raw, torch={"version": "2.13.0+cpu", "cuda": None, "nccl": None, "gpus": 0})
    result = by_node(gpu.analyse(observed(2, node0=NodeFacts(raw=raw, sent=0.0, received=0.0))))["node0"]
    assert result.status == "fail"
    assert result.summary == ("node0 GPU 0 (00000000:81:00.0): a row remapping pending; node0: torch sees no GPU, "
                              "nvidia-smi lists 2 (torch is a CPU build)")
    assert result.fix.endswith("; install a CUDA build of torch on node0")


def test_a_node_without_the_rdma_devices_the_others_use_is_named() -> None:
    results = by_node(ib.analyse(observed(node0=ib_facts(port("mlx5_0"), port("mlx5_1")),
                                          node1=ib_facts(port("mlx5_0")),
                                          node2=ib_facts())))
    assert (results["node1"].status, results["node1"].summary) == (
        "warn", "node1 lacks mlx5_1 port 1, active on other nodes")
    assert (results["node2"].status, results["node2"].summary) == (
        "fail", "node2 has no RDMA device, while node0, node1 have active ports")
    assert results["node0"].status == "pass"


def test_a_context_switch_timeout_beside_application_xids_warns() -> None:
    result = xid_result(kernel("gpud-46-dmesg-ctime.txt"))
    assert result.status == "warn"
    assert result.summary == ("node0: Xid 109 on 0000:cb:00: context switch timeout (the application, the driver or "
                              "the GPU); Xid 13 on 0000:cb:00 x3: graphics engine exception (usually the application) "
                              "(since boot, dmesg)")


def test_fewer_processes_than_gpus_given_explicitly_warns_naming_nproc_gpu() -> None:
    result = by_node(gpu.analyse(observed(1, node0=node_facts(smi("dual_a5000-v13.xml"), 2))))["node0"]
    assert (result.status, result.summary, result.fix) == (
        "warn", "2 GPU(s) visible, nproc_per_node = 1: 1 GPU(s) idle unless each process uses several",
        '--nproc-per-node gpu (nproc_per_node = "gpu") starts one process per GPU')


def test_the_default_single_process_on_a_gpu_node_is_no_warning() -> None:
    inventory = parse({"hosts": [{"name": "node0"}]}, Path("hosts.toml"))
    seen = Observed(inventory=inventory, master_target="node0")
    seen.facts = {"node0": node_facts(smi("dual_a5000-v13.xml"), 2)}
    assert (gpu.analyse(seen)[0].status, inventory.cluster.nproc_per_node) == ("pass", 1)


def hostfile_node(slots: int, gpus: int, cpus: int) -> Observed:
    inventory = parse({"hosts": [{"name": "gpu01", "nproc_per_node": slots}]}, Path("hostfile"))
    seen = Observed(inventory=inventory, master_target="gpu01", node_nproc={"gpu01": slots})
    xml = smi("dual_a5000-v13.xml") if gpus else None
    seen.facts = {"gpu01": node_facts(xml, gpus, cpu_contention={"cpus": cpus, "load": 0.0})}
    return seen


def test_a_hostfile_count_above_the_node_says_which_reading_was_taken() -> None:
    result = gpu.analyse(hostfile_node(2222, 0, 16))[0]
    assert (result.status, result.summary, result.fix) == (
        "warn", "nproc_per_node = 2222 is above gpu01's 16 CPU(s) and 0 GPU(s) (a hostfile's gpu01:2222 is read as "
                "2222 processes, MPICH's host:N, not an SSH port)",
        "for an SSH port, write ssh_port = 2222 in hosts.toml (or -H gpu01:2222); for processes, slots=N")
    assert gpu.analyse(hostfile_node(2222, 2, 16))[0].summary.endswith("not an SSH port)")


def test_a_hostfile_count_within_the_cpus_is_no_warning() -> None:
    assert gpu.analyse(hostfile_node(16, 0, 16))[0].status == "skip"
    assert gpu.analyse(hostfile_node(2, 2, 16))[0].status == "pass"
