"""One plan, checked then launched: what the preflight verifies is the plan the
command line asked for (its master address, processes per node, script, env), and
the plan the launch runs keeps what the user chose when the networks are found."""

from __future__ import annotations

from pathlib import Path

from torchherd.api import Cluster
from torchherd.checks.runner import observe
from torchherd.plan import NodeNetwork


def cluster() -> Cluster:
    return Cluster(["node0", "node1"], python="/opt/venv/bin/python", nproc_per_node=2, env={"NCCL_DEBUG": "WARN"})


def test_the_checks_see_the_command_lines_master_address_nproc_script_and_env() -> None:
    plan = cluster().plan("train.py", master_addr="10.9.9.9", nproc_per_node=8, env={"GLOO_SOCKET_IFNAME": "ib0"})
    observed = observe(plan, ("network", "gpu", "port"))
    assert observed.master_target == "10.9.9.9" and observed.master_given == "--master-addr"
    assert observed.nproc == 8
    assert observed.script == "train.py"
    node1 = plan.inventory.host("node1")
    assert observed.env_of(node1)["GLOO_SOCKET_IFNAME"] == "ib0"
    assert observed.env_of(node1)["NCCL_DEBUG"] == "WARN"


def test_without_options_the_checks_see_the_inventorys_job() -> None:
    plan = cluster().plan("", run_id="check")
    observed = observe(plan, ("gpu",))
    assert (observed.master_target, observed.master_given, observed.nproc, observed.script) == (
        "node0", None, 2, None)
    assert observed.with_torch, "the gpu check reads torch on the node"
    assert observe(plan, ("ssh",)).with_torch is False


def test_the_launched_plan_is_the_checked_one_with_the_networks_found() -> None:
    plan = cluster().plan("train.py", "--lr", "3e-4", master_addr="10.9.9.9", run_id="r1")
    networks = {"node0": NodeNetwork("10.0.0.1", "eth0", "found"), "node1": NodeNetwork("10.0.0.2", "eth0", "found")}
    launched = plan.with_networks(networks)
    assert launched.master_addr == "10.9.9.9", "a master address the user chose is kept"
    assert launched.run_id == plan.run_id and launched.options == plan.options
    assert [node.argv[node.argv.index("--local-addr") + 1] for node in launched.nodes] == ["10.0.0.1", "10.0.0.2"]
    assert launched.nodes[1].env["GLOO_SOCKET_IFNAME"] == "eth0"
    assert plan.with_networks({}) is plan
    assert Path(launched.inventory.path).name == "<torchherd.Cluster>"
