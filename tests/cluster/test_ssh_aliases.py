"""Hosts whose inventory address is an ssh_config alias (``Host gpu-a`` / ``HostName
10.x``), written in the config itself or in an ``Include``d file: the most common way
people name their machines. The alias is the controller's name for a node; the nodes
cannot resolve it (their /etc/hosts knows node0..node2 only), so the master address
the workers are told must be what ssh_config resolves the alias to.

``check`` is clean, ``run --dry-run`` names the HostName, and a 3-node x 2-rank data-parallel
run (``ALLREDUCE_DEMO``) is correct, with and without ``--no-check`` (trained once, with the aliases in the
config itself: through an Include the plan is the same).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from io import StringIO
from pathlib import Path

import pytest
from localcluster import LocalCluster

from support.cluster_runs import SKIP_TORCH
from support.cluster_topologies import ALLREDUCE_DEMO, DDP_DEMO, assert_clean
from torchherd.cli import main
from torchherd.console import make_console

pytestmark = pytest.mark.cluster
ALIASES = ("gpu-a", "gpu-b", "gpu-c")


def aliased_inventory(cluster: LocalCluster, directory: Path, include: bool, bastion: bool = False) -> Path:
    """An inventory whose hosts are reached as gpu-a..gpu-c, aliases of the cluster's nodes
    that only the ssh_config (or a file it includes) defines; with ``bastion``, through jump0."""
    directory.mkdir(parents=True, exist_ok=True)
    common = (f"    User root\n    IdentityFile {cluster.identity_file}\n    IdentitiesOnly yes\n"
              f"    UserKnownHostsFile {cluster.known_hosts}\n    GlobalKnownHostsFile /dev/null\n"
              "    StrictHostKeyChecking yes\n    BatchMode yes\n    ConnectTimeout 10\n")
    via = "    ProxyJump jump0\n" if bastion else ""
    blocks = "".join(f"Host {alias}\n    HostName {cluster.node(name).ip}\n{via}\n"
                     for alias, name in zip(ALIASES, cluster.names))
    if bastion:
        blocks += f"Host jump0\n    HostName {cluster.node('jump0').ip}\n\n"
    config = directory / "ssh_config"
    if include:
        (directory / "conf.d").mkdir(exist_ok=True)
        (directory / "conf.d" / "gpus.conf").write_text(blocks)
        config.write_text(f"Include {directory}/conf.d/*.conf\n\nHost *\n{common}")
    else:
        config.write_text(blocks + f"Host *\n{common}")
    lines = ["[cluster]", f'ssh_config = "{config}"', "port = 29500", "nproc_per_node = 2", "",
             "[defaults]", f'python = "{cluster.python}"', 'workdir = "/tmp"']
    for alias, name in zip(ALIASES, cluster.names):
        lines += ["", "[[hosts]]", f'name = "{name}"', f'address = "{alias}"']
    inventory = directory / "hosts.toml"
    inventory.write_text("\n".join(lines) + "\n")
    return inventory


def cli(*args: str) -> tuple[int, str]:
    out = StringIO()
    code = main(list(args), console=make_console(out, width=250))
    return code, out.getvalue()


def assert_trained(code: int, out: str) -> None:
    assert code == 0, out
    losses: dict[int, list[float]] = {}
    for line in out.splitlines():
        match = re.match(r"node(\d+):(\d+): .*step \d+ loss ([0-9.]+)", line)  # piped: node:rank: text
        if match:
            assert int(match.group(2)) // 2 == int(match.group(1)), line
            losses.setdefault(int(match.group(2)), []).append(float(match.group(3)))
    assert sorted(losses) == list(range(6)), out
    assert len({round(values[-1], 4) for values in losses.values()}) == 1, losses
    assert "all 3 nodes finished (exit 0)" in out


def assert_dry_run_names_the_hostname(inventory: Path, master_ip: str) -> None:
    code, out = cli("-i", str(inventory), "run", "--dry-run", "--", DDP_DEMO)
    assert code == 0, out
    assert f"at {master_ip}:29500" in out and "gpu-a:" not in out, out
    assert "--master-addr gpu-a" not in out and "--rdzv-endpoint gpu-a" not in out, out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("include", [False, True], ids=["in-config", "included"])
def test_aliased_hosts_check_clean_and_run_with_and_without_the_checks(
        cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str], include: bool) -> None:
    inventory = aliased_inventory(cluster, tmp_path / "conf", include)
    for alias in ALIASES:  # the nodes cannot resolve an alias: only the controller's config names it
        assert cluster.ssh("node1", f"getent hosts {alias}").returncode != 0
    assert_dry_run_names_the_hostname(inventory, cluster.node("node0").ip)

    # In the config itself, every check but those whose facts import torch (python, gpu: 2 s of
    # CPU a node, each check and checked run): the facts program and its session are the same
    # for every check, and the included variant (and test_ssh_topologies.py's) checks in full.
    skip = () if include else SKIP_TORCH
    code = main(["check", "-i", str(inventory), "--json", *skip])
    document = json.loads(capsys.readouterr().out)
    assert_clean(document, cluster.names)
    assert code == 0
    assert not any("gpu-a" in f"{entry['summary']} {entry.get('fix') or ''}" for entry in document["checks"]), \
        document

    if include:
        # The runs would repeat in-config's: the plan above tells the workers the same
        # HostName through the Include, and test_ssh_topologies.py's
        # test_aliases_from_an_included_file trains through an Include.
        return
    assert_trained(*cli("-i", str(inventory), "run", *skip, "--log-dir", str(tmp_path / "logs"), "--", ALLREDUCE_DEMO))
    assert_trained(*cli("-i", str(inventory), "run", "--no-check", "--log-dir", str(tmp_path / "logs"),
                        "--", ALLREDUCE_DEMO))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_aliased_hosts_behind_a_bastion_run_without_the_checks(
        make_cluster: Callable[..., LocalCluster], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Behind a bastion the HostName is the bastion's view of the node: the nodes' private
    address, which the nodes behind it share, so the workers reach the master there."""
    cluster = make_cluster(3, jump_hosts=1)
    inventory = aliased_inventory(cluster, tmp_path / "conf", include=False, bastion=True)
    assert_dry_run_names_the_hostname(inventory, cluster.node("node0").ip)
    code = main(["check", "-i", str(inventory), "--json"])
    document = json.loads(capsys.readouterr().out)
    assert_clean(document, cluster.names)
    assert code == 0
    assert_trained(*cli("-i", str(inventory), "run", "--no-check", "--log-dir", str(tmp_path / "logs"),
                        "--", ALLREDUCE_DEMO))
