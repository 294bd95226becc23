"""The launch plan: ranks, addresses, the exact torchrun command, env quoting (no sockets)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest

from torchherd.console import make_console
from torchherd.console.run import render_description
from torchherd.errors import UsageError
from torchherd.inventory import Inventory, parse
from torchherd.plan import NodeNetwork, RunOptions, build_plan, parse_env_assignments


def inventory() -> Inventory:
    document = {
        "cluster": {"master": "b", "port": 29511, "nproc_per_node": 2},
        "defaults": {"python": "/opt/venv/bin/python", "workdir": "~/proj dir",
                     "env": {"NCCL_DEBUG": "WARN"}},
        "hosts": [{"name": "a", "address": "10.0.0.1"}, {"name": "b", "address": "10.0.0.2"},
                  {"name": "c", "address": "gpu-c", "setup": "source ~/venv/bin/activate"}],
    }
    return parse(document, Path("hosts.toml"))


def test_master_first_and_node_ranks_in_order() -> None:
    plan = build_plan(inventory(), RunOptions(script="train.py", run_id="r1"))
    assert [(node.host.name, node.node_rank) for node in plan.nodes] == [("b", 0), ("a", 1), ("c", 2)]
    assert plan.master == "b"
    assert plan.master_addr == "10.0.0.2"


def test_static_command_line_is_exact() -> None:
    plan = build_plan(inventory(), RunOptions(script="train.py", script_args=("--lr", "0.1"), run_id="r1"))
    assert plan.nodes[1].argv == (
        "/opt/venv/bin/python", "-m", "torch.distributed.run", "--nnodes", "3", "--nproc-per-node", "2",
        "--node-rank", "1", "--master-addr", "10.0.0.2", "--master-port", "29511",
        "--local-addr", "10.0.0.1", "--max-restarts", "0", "--tee", "3", "--log-dir", "/tmp/torchherd-r1-a",
        "--", "train.py", "--lr", "0.1")


def test_c10d_master_hosts_the_store() -> None:
    plan = build_plan(inventory(), RunOptions(script="train.py", run_id="r1", rdzv_backend="c10d",
                                              nnodes="2:3"))
    master, worker = plan.nodes[0].argv, plan.nodes[1].argv
    assert "--rdzv-conf" in master and master[master.index("--rdzv-conf") + 1] == "is_host=1"
    assert "--rdzv-conf" not in worker
    assert worker[worker.index("--rdzv-endpoint") + 1] == "10.0.0.2:29511"
    assert worker[worker.index("--nnodes") + 1] == "2:3"


def test_elastic_range_needs_c10d() -> None:
    with pytest.raises(UsageError, match="c10d"):
        build_plan(inventory(), RunOptions(script="train.py", nnodes="1:3"))


def test_networks_choose_addresses_and_interfaces_with_reasons() -> None:
    networks = {"b": NodeNetwork("192.168.5.2", "eth1", "routes to the master"),
                "c": NodeNetwork("192.168.5.3", "eth1", "route to 192.168.5.2")}
    plan = build_plan(inventory(), RunOptions(script="train.py", run_id="r1"), networks)
    assert plan.master_addr == "192.168.5.2"
    node_c = plan.nodes[2]
    assert node_c.argv[node_c.argv.index("--local-addr") + 1] == "192.168.5.3"
    assert node_c.env["GLOO_SOCKET_IFNAME"] == node_c.env["NCCL_SOCKET_IFNAME"] == "eth1"
    assert "GLOO_SOCKET_IFNAME=eth1: the interface that routes to the master" in node_c.notes


def test_user_env_wins_and_run_id_is_always_set() -> None:
    plan = build_plan(inventory(), RunOptions(script="t.py", run_id="r9",
                                              extra_env={"NCCL_DEBUG": "INFO", "GLOO_SOCKET_IFNAME": "lo"}),
                      {"a": NodeNetwork("10.0.0.1", "eth0")})
    env = plan.nodes[1].env
    assert env["NCCL_DEBUG"] == "INFO"
    assert env["GLOO_SOCKET_IFNAME"] == "lo"
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert env["TORCHHERD_RUN_ID"] == "r9"
    assert env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == "[torchherd-rank ${rank}] "


NASTY = "a b'c\"$(touch /tmp/pwned) `id` ; \\ $HOME * \n end"


def test_env_assignment_keeps_the_value_byte_for_byte() -> None:
    assert parse_env_assignments([f"X={NASTY}", "Y=k=v"]) == {"X": NASTY, "Y": "k=v"}
    with pytest.raises(UsageError):
        parse_env_assignments(["no-equals"])


def test_shell_line_round_trips_through_a_real_shell(tmp_path: Path) -> None:
    plan = build_plan(inventory(), RunOptions(script="t.py", run_id="r1", extra_env={"X": NASTY}))
    line = plan.nodes[0].shell_line()
    assert line.startswith("cd ~/'proj dir' && env ")
    # Replace the command with one that prints X, keep the env assignments as planned.
    env_part = line.split(" && ", 1)[1].split(" /opt/venv/bin/python ")[0]
    script = f"{env_part} {shlex.quote(sys.executable)} -c 'import os; print(repr(os.environ[\"X\"]))'"
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, cwd=tmp_path, check=True).stdout
    assert out.strip() == repr(NASTY)
    assert not Path("/tmp/pwned").exists()


def test_render_plan_shows_every_command_and_note() -> None:
    out = StringIO()
    render_description(make_console(out, width=300), build_plan(inventory(), RunOptions(script="t.py", run_id="r1")))
    text = out.getvalue()
    assert text.splitlines()[0] == "run r1: 3 nodes, master b at 10.0.0.2:29511, rendezvous static"
    assert "b (node_rank 0)" in text and "a (node_rank 1)" in text and "c (node_rank 2)" in text
    # the setup on lines of its own, its output to stderr, exactly as the launch sends it
    assert "  $ cd ~/'proj dir' && { source ~/venv/bin/activate\n} >&2 && env NCCL_DEBUG=WARN " in text
    assert "  - master address 10.0.0.2: the master's SSH address" in text
    assert "  - --local-addr 10.0.0.1" in text
    assert text.rstrip().endswith("dry run: nothing was started")
