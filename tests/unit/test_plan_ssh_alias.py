"""A host whose address is an ssh_config alias: the workers are told the HostName the
alias resolves to (what ``ssh -G`` prints), never the alias, which only the controller's
config defines."""

from __future__ import annotations

import shutil
import subprocess
from io import StringIO
from pathlib import Path

import pytest

from torchherd.api import Cluster
from torchherd.console import make_console
from torchherd.console.run import render_description
from torchherd.inventory import Inventory, parse
from torchherd.plan import NodeNetwork, RunOptions, build_plan


def inventory(**cluster: object) -> Inventory:
    document = {"cluster": {"port": 29500, "nproc_per_node": 2, **cluster},
                "defaults": {"python": "/opt/venv/bin/python", "workdir": "/tmp"},
                "hosts": [{"name": "hn1", "address": "gpu-a"}, {"name": "hn2", "address": "gpu-b"}]}
    return parse(document, Path("hosts.toml"))


HOSTNAMES = {"hn1": "10.1.2.3", "hn2": "10.1.2.4"}


def test_the_master_address_is_the_aliases_hostname_and_workers_bind_theirs() -> None:
    plan = build_plan(inventory(), RunOptions(script="train.py", run_id="r1"), ssh_hostnames=HOSTNAMES)
    assert plan.master_addr == "10.1.2.3"
    master, worker = plan.nodes
    assert worker.argv[worker.argv.index("--master-addr") + 1] == "10.1.2.3"
    assert worker.argv[worker.argv.index("--local-addr") + 1] == "10.1.2.4"
    assert master.argv[master.argv.index("--local-addr") + 1] == "10.1.2.3"
    assert "gpu-a" not in " ".join(worker.argv)
    assert any("HostName of the master's ssh_config alias gpu-a" in note for note in master.notes)
    out = StringIO()
    render_description(make_console(out, width=250), plan)
    assert "master hn1 at 10.1.2.3:29500" in out.getvalue()


def test_c10d_endpoint_is_the_hostname_too() -> None:
    plan = build_plan(inventory(), RunOptions(script="train.py", run_id="r1", rdzv_backend="c10d"),
                      ssh_hostnames=HOSTNAMES)
    worker = plan.nodes[1].argv
    assert worker[worker.index("--rdzv-endpoint") + 1] == "10.1.2.3:29500"


def test_what_the_preflight_found_and_what_the_user_chose_still_win() -> None:
    plan = build_plan(inventory(), RunOptions(script="train.py", run_id="r1"), ssh_hostnames=HOSTNAMES)
    found = plan.with_networks({"hn1": NodeNetwork("10.9.9.1", "eth1", "found on the master"),
                                "hn2": NodeNetwork("10.9.9.2", "eth1", "route")})
    assert found.master_addr == "10.9.9.1" and found.ssh_hostnames == HOSTNAMES
    only_worker = plan.with_networks({"hn2": NodeNetwork("10.9.9.2", "eth1", "route")})
    assert only_worker.master_addr == "10.1.2.3"  # the HostName is kept across the rebuild
    chosen = build_plan(inventory(master_addr="head.example"), RunOptions(script="train.py"),
                        ssh_hostnames=HOSTNAMES)
    assert chosen.master_addr == "head.example"


def test_a_loopback_hostname_says_that_run_no_check_needs_an_address() -> None:
    plan = build_plan(inventory(), RunOptions(script="train.py", run_id="r1"),
                      ssh_hostnames={"hn1": "localhost", "hn2": "127.0.0.1"})
    master, worker = plan.nodes
    assert any("loopback" in note and "--no-check" in note for note in master.notes)
    assert "--local-addr" not in worker.argv  # never a loopback --local-addr from a port forward


def test_an_address_that_is_no_alias_is_kept() -> None:
    plan = build_plan(inventory(), RunOptions(script="train.py", run_id="r1"), ssh_hostnames={"hn1": "GPU-A"})
    assert plan.master_addr == "gpu-a"  # a host name differs from itself in case only
    assert not any("alias" in note for note in plan.nodes[0].notes)


def write_configs(tmp_path: Path) -> Path:
    (tmp_path / "conf.d").mkdir()
    (tmp_path / "conf.d" / "gpus.conf").write_text("Host gpu-b\n    HostName 10.1.2.4\n")
    config = tmp_path / "ssh_config"
    config.write_text(f"Include {tmp_path}/conf.d/*.conf\n\nHost gpu-a\n    HostName 10.1.2.3\n\n"
                      "Host *\n    User root\n")
    return config


def test_cluster_plan_reads_the_alias_from_the_config_and_an_included_file(tmp_path: Path) -> None:
    config = write_configs(tmp_path)
    cluster = Cluster(hosts=[{"name": "hn2", "address": "gpu-b"}, {"name": "hn1", "address": "gpu-a"}],
                      ssh_config=str(config), python="/opt/venv/bin/python", workdir="/tmp")
    plan = cluster.plan("train.py", run_id="r1")
    assert plan.master_addr == "10.1.2.4"  # hn2 is the master, its alias in the Included file
    assert plan.nodes[1].argv[plan.nodes[1].argv.index("--local-addr") + 1] == "10.1.2.3"


@pytest.mark.skipif(shutil.which("ssh") is None, reason="OpenSSH's ssh is not installed")
def test_the_master_address_is_what_ssh_dash_g_prints(tmp_path: Path) -> None:
    config = write_configs(tmp_path)
    for alias in ("gpu-a", "gpu-b"):
        printed = subprocess.run(["ssh", "-G", "-F", str(config), alias], capture_output=True, text=True,
                                 check=True).stdout
        hostname = next(line.split()[1] for line in printed.splitlines() if line.startswith("hostname "))
        cluster = Cluster(hosts=[{"name": "hn", "address": alias}], ssh_config=str(config),
                          python="/opt/venv/bin/python", workdir="/tmp")
        assert cluster.plan("train.py").master_addr == hostname


def test_a_master_addr_given_as_an_alias_fails_the_hostname_check_with_the_hostname_as_fix() -> None:
    from torchherd.checks.analysis import hostname
    from torchherd.checks.model import NodeFacts, Observed

    def facts(name: str, address: str, resolve: dict[str, object]) -> NodeFacts:
        return NodeFacts(raw={"hostname": name, "gloo": {"address": address}, "etc_hosts": "", "resolve": resolve,
                              "interfaces": [{"name": "eth0", "addresses": [address]}]}, sent=0.0, received=0.0)

    plan = build_plan(inventory(master_addr="gpu-a"), RunOptions(script="train.py"), ssh_hostnames=HOSTNAMES)
    assert plan.master_addr == "gpu-a"  # the user's choice is kept, and checked
    seen = Observed(inventory=plan.inventory, master_target=plan.master_addr, master_given="[cluster].master_addr",
                    ssh_hostnames=plan.ssh_hostnames)
    seen.facts = {"hn1": facts("hn1", "10.1.2.3", {"gpu-a": {"error": "Name or service not known"}}),
                  "hn2": facts("hn2", "10.1.2.4", {"gpu-a": {"error": "Name or service not known"}})}
    result = hostname.analyse(seen)[1]
    assert (result.node, result.status) == ("hn2", "fail")
    assert "it is an ssh_config alias, which only the controller knows" in result.summary
    assert result.fix == 'give its HostName instead: master_addr = "10.1.2.3" in [cluster] (or --master-addr ' \
                         '10.1.2.3), or leave master_addr out'
    assert "/etc/hosts" not in result.fix


def test_an_alias_that_is_also_the_masters_hostname_gets_the_etc_hosts_fix() -> None:
    from torchherd.checks.analysis import hostname
    from torchherd.checks.model import NodeFacts, Observed

    def facts(name: str, address: str) -> NodeFacts:
        return NodeFacts(raw={"hostname": name, "fqdn": name, "gloo": {"address": address}, "etc_hosts": "",
                              "resolve": {"gpu-a": {"error": "Name or service not known"}},
                              "interfaces": [{"name": "eth0", "addresses": [address]}]}, sent=0.0, received=0.0)

    plan = build_plan(inventory(master_addr="gpu-a"), RunOptions(script="train.py"), ssh_hostnames=HOSTNAMES)
    seen = Observed(inventory=plan.inventory, master_target="gpu-a", master_given="[cluster].master_addr",
                    ssh_hostnames=plan.ssh_hostnames)
    seen.facts = {"hn1": facts("gpu-a", "10.1.2.3"), "hn2": facts("hn2", "10.1.2.4")}
    result = hostname.analyse(seen)[1]
    assert result.status == "fail" and result.fix.startswith("add this line to /etc/hosts on hn2: ")
