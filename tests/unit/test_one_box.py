"""This machine as a node without SSH: which hosts ``-H`` and an inventory reach in-process,
which keep SSH, what ``hosts`` and a detached run's record say, and the docs/api.md
example run as written (with ``recovery=`` set) on one box, with no sshd."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from support.cli import assert_one_line, cli, run_cli
from torchherd.api import Cluster
from torchherd.engine.bookkeeping import node_record
from torchherd.engine.records.model import NodeRecord, RunRecord
from torchherd.inventory import load as parse_file
from torchherd.inventory import parse
from torchherd.transport.local import LocalSession
from torchherd.transport.ssh import SshConnector

ROOT = Path(__file__).resolve().parents[2]


def reached(hosts: str) -> list[tuple[str, str, str]]:
    return [(host.name, host.address, host.transport) for host in Cluster.from_hosts(hosts).inventory.hosts]


@pytest.mark.parametrize(("given", "expected"), [
    ("localhost", [("localhost", "localhost", "local")]),
    ("127.0.0.1", [("127.0.0.1", "127.0.0.1", "local")]),
    ("::1", [("localhost", "::1", "local")]),
    ("[::1]", [("localhost", "::1", "local")]),
    ("ssh://localhost", [("localhost", "localhost", "ssh")]),
    ("ubuntu@localhost", [("localhost", "localhost", "ssh")]),
    ("localhost:2222", [("localhost", "localhost", "ssh")]),
    ("ssh://ubuntu@127.0.0.1:2222", [("127.0.0.1", "127.0.0.1", "ssh")]),
    ("node1", [("node1", "node1", "ssh")]),
    ("localhost,node1", [("localhost", "localhost", "local"), ("node1", "node1", "ssh")]),
])
def test_which_hosts_are_this_machine(given: str, expected: list[tuple[str, str, str]]) -> None:
    assert reached(given) == expected


def test_this_machine_s_own_name_is_this_machine_only_as_the_only_host() -> None:
    own = socket.gethostname()
    assert reached(own) == [(own, own, "local")]
    assert reached(f"{own},node1") == [(own, own, "ssh"), ("node1", "node1", "ssh")]


def test_this_machine_runs_in_the_current_directory_unless_told_otherwise(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert [host.workdir for host in Cluster.from_hosts("localhost,node1").inventory.hosts] == [str(tmp_path), "~"]
    assert [host.workdir for host in Cluster.from_hosts("localhost", workdir="/srv").inventory.hosts] == ["/srv"]


def test_an_inventory_chooses_the_transport_per_host() -> None:
    inventory = parse({"hosts": [{"name": "a", "address": "127.0.0.1"}, {"name": "b", "address": "127.0.0.1",
                                                                           "transport": "ssh"},
                                 {"name": "c", "address": "10.0.0.3", "transport": "local"},
                                 {"name": "d", "address": "127.0.0.1", "identity_file": __file__}]}, Path("hosts.toml"))
    assert [host.transport for host in inventory.hosts] == ["local", "ssh", "local", "ssh"]


def test_a_bad_transport_exits_2_naming_the_key(tmp_path: Path) -> None:
    code, out = run_cli(tmp_path, '[[hosts]]\nname = "a"\ntransport = "telnet"\n', ["hosts"])
    assert_one_line(code, out, "hosts[0].transport")
    assert "hosts[0].transport: expected one of 'auto', 'ssh', 'local', got a string 'telnet'" in out


def test_hosts_says_how_each_host_is_reached(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = cli("hosts", "-H", "localhost,ubuntu@node1", cwd=tmp_path)
    assert code == 0, out
    assert re.search(r"(?m)^localhost \(master\) +this machine, no SSH +0 ", out), out
    assert re.search(r"(?m)^node1 +ubuntu@node1 +1 ", out), out
    capsys.readouterr()
    code, _ = cli("hosts", "-H", "localhost,ubuntu@node1", "--json", cwd=tmp_path)
    rows = json.loads(capsys.readouterr().out)["hosts"]
    assert [(row["ssh"], row["reached"]) for row in rows] == [(None, "this machine, no SSH"), ("ubuntu@node1", "ssh")]


def test_the_ssh_connector_reaches_this_machine_in_process() -> None:
    [host] = Cluster.from_hosts("localhost").inventory.hosts
    session = SshConnector().connect(host)
    try:
        assert isinstance(session, LocalSession)
        assert session.run("echo $$ >/dev/null; echo here").stdout == b"here\n"
    finally:
        session.close()


def test_a_detached_run_s_record_keeps_the_transport_and_an_old_record_is_ssh() -> None:
    [host] = Cluster.from_hosts("localhost").inventory.hosts
    record = node_record(host, "/tmp/log", "/tmp/state")
    assert record.transport == "local" and record.host().transport == "local"
    document = json.loads(RunRecord(run_id="th-20261128-000000-abcdef", inventory="-H", created=1.0, command=("x",),
                                    nodes=(record,), max_rank=1, grace=10.0).to_json())
    assert document["nodes"][0]["transport"] == "local"
    del document["nodes"][0]["transport"]
    old = RunRecord.from_json(json.dumps(document), "old.json")
    assert [node.transport for node in old.nodes] == ["ssh"]
    assert NodeRecord.__dataclass_fields__["transport"].default == "ssh"


API_HOSTS = """\
[cluster]
nproc_per_node = 2
port = {port}

[[hosts]]
name = "localhost"
"""


@pytest.mark.timeout(240)
def test_the_documented_api_example_runs_on_one_box_with_recovery_set(tmp_path: Path) -> None:
    """docs/api.md's example as written, ``recovery=`` added to its launch: a RecoveringRun,
    whose lines() streams as a plain run's does; ``localhost`` is this machine, no sshd."""
    example = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "api.md").read_text(encoding="utf-8"), re.S)[0]
    launch = 'run = cluster.launch(plan, log_dir="logs")'
    assert launch in example
    example = example.replace(launch, 'run = cluster.launch(plan, log_dir="logs", '
                                      'recovery=torchherd.Recovery(retries=1, hang_timeout=120))\n'
                                      'assert type(run).__name__ == "RecoveringRun"')
    example = "import torchherd\n" + example
    with socket.socket() as probe:  # a free port: other runs on this machine may hold 29500
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (tmp_path / "hosts.toml").write_text(API_HOSTS.format(port=port))
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
           "XDG_STATE_HOME": str(tmp_path / "state")}
    done = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=220)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"(?m)^localhost:0 rank 0 done: loss", done.stdout), done.stdout
    assert "the node finished (exit 0)" in done.stdout
    assert re.search(r"(?m)^localhost ok 0$", done.stdout), done.stdout


def test_init_keeps_ssh_for_a_host_given_as_ssh_url(tmp_path: Path) -> None:
    code, out = cli("init", "-H", "ssh://localhost,127.0.0.1", cwd=tmp_path)
    assert code == 0, out
    inventory = parse_file(tmp_path / "hosts.toml")
    assert [(host.name, host.transport) for host in inventory.hosts] == [("localhost", "ssh"), ("127.0.0.1", "local")]
