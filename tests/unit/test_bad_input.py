"""Bad input on the command line or in an inventory: exit 2, one line naming the
file, the key or the flag, a hint, and never a traceback."""

from __future__ import annotations

import json
import os
from io import StringIO
from pathlib import Path

import pytest

from support.cli import assert_one_line, run_cli
from torchherd.cli import main
from torchherd.console import make_console

# 192.0.2.0/24 is TEST-NET-1: nothing answers there, so touching a node would hang.
HOSTS = '[[hosts]]\nname = "a"\naddress = "192.0.2.1"\n[[hosts]]\nname = "b"\naddress = "192.0.2.2"\n'
DRY_RUN = ["run", "--dry-run", "--", "train.py"]


def cluster(line: str) -> str:
    return f"[cluster]\n{line}\n" + HOSTS


def defaults(line: str) -> str:
    return f"[defaults]\n{line}\n" + HOSTS


INVENTORIES = [
    pytest.param('[[hosts]]\nname = "node0\\n"\n', "hosts[0].name", id="host-name-newline"),
    pytest.param(defaults('env = { "A\\n" = "1" }'), "[defaults].env.'A\\n'", id="env-key-newline"),
    pytest.param(cluster("nproc_per_node = 1000000000000000000"), "[cluster].nproc_per_node", id="nproc-huge"),
    pytest.param(cluster("ssh_timeout = nan"), "[cluster].ssh_timeout", id="ssh-timeout-nan"),
    pytest.param(cluster("ssh_timeout = inf"), "[cluster].ssh_timeout", id="ssh-timeout-inf"),
    pytest.param(defaults('env = { A = "x\\u0000y" }'), "[defaults].env.A", id="env-value-nul"),
    pytest.param(defaults('workdir = "/w\\u0000x"'), "[defaults].workdir", id="workdir-nul"),
    pytest.param(defaults('python = "/py\\u0000x"'), "[defaults].python", id="python-nul"),
    pytest.param(defaults('user = "bob\\nroot"'), "[defaults].user", id="user-newline"),
    pytest.param('[[hosts]]\nname = "a"\nlocal_addr = "not an ip;x"\n', "hosts[0].local_addr", id="local-addr"),
    pytest.param("a = " + "[" * 100_000 + "]" * 100_000 + "\n", "hosts.toml", id="toml-deep"),
    pytest.param(b'[[hosts]]\nname = "\xff"\n', "hosts.toml", id="not-utf8"),
    pytest.param('[checks]\nmin_bandwidth = "fast"\n[[hosts]]\nname = "a"\n', "[checks].min_bandwidth",
                 id="min-bandwidth-word"),
    pytest.param('[checks]\nmin_bandwidth = inf\n[[hosts]]\nname = "a"\n', "[checks].min_bandwidth",
                 id="min-bandwidth-inf"),
    pytest.param('[checks]\nslow_ratio = nan\n[[hosts]]\nname = "a"\n', "[checks].slow_ratio",
                 id="slow-ratio-nan"),
    pytest.param("[recovery]\nheartbeat = 0\n" + HOSTS, "[recovery].heartbeat", id="heartbeat-zero"),
    pytest.param("[recovery]\nheartbeat = nan\n" + HOSTS, "[recovery].heartbeat", id="heartbeat-nan"),
    pytest.param('[recovery]\nheartbeat = "1s"\n' + HOSTS, "[recovery].heartbeat", id="heartbeat-text"),
    pytest.param("[recovery]\nheartbeat = 30\n" + HOSTS, "[recovery].heartbeat", id="heartbeat-long"),
    pytest.param("[recovery]\nheartbeat_misses = 1\n" + HOSTS, "[recovery].heartbeat_misses", id="misses-one"),
    pytest.param("[recovery]\nheartbeat_misses = 2.5\n" + HOSTS, "[recovery].heartbeat_misses",
                 id="misses-fraction"),
    pytest.param("[recovery]\nheartbeat = 0.2\nheartbeat_misses = 3\n" + HOSTS, "[recovery].heartbeat_misses",
                 id="lost-after-short"),
]


@pytest.mark.parametrize("inventory,named", INVENTORIES)
def test_a_bad_inventory_is_one_line_naming_the_key(tmp_path: Path, inventory: str | bytes, named: str) -> None:
    assert_one_line(*run_cli(tmp_path, inventory, DRY_RUN), named)


SSH_CONFIGS = [
    pytest.param(None, id="directory"),
    pytest.param(b"Host *\n  Port\n", id="bad-syntax"),
    pytest.param(b"Host *\n  User \xff\n", id="not-utf8"),
    pytest.param(b"Host *\n  Port abc\n", id="port-abc"),
]


@pytest.mark.parametrize("content", SSH_CONFIGS)
def test_a_bad_ssh_config_is_one_line_naming_it(tmp_path: Path, content: bytes | None) -> None:
    config = tmp_path / "ssh_config"
    if content is None:
        config.mkdir()
    else:
        config.write_bytes(content)
    assert_one_line(*run_cli(tmp_path, cluster('ssh_config = "ssh_config"'), ["hosts"]), "ssh_config")


def test_an_endless_inventory_file_is_refused(tmp_path: Path) -> None:
    out = StringIO()
    code = main(["-i", "/dev/zero", *DRY_RUN], console=make_console(out, width=400))
    assert_one_line(code, out.getvalue(), "/dev/zero")


FLAGS = [
    pytest.param(["run", "--grace", "-1", "--dry-run", "--", "t.py"], "--grace", id="grace-negative"),
    pytest.param(["run", "--grace", "nan", "--dry-run", "--", "t.py"], "--grace", id="grace-nan"),
    pytest.param(["run", "--grace", "inf", "--dry-run", "--", "t.py"], "--grace", id="grace-inf"),
    pytest.param(["run", "--straggler-window", "5", "--dry-run", "--", "t.py"], "--straggler-window",
                 id="straggler-window-short"),
    pytest.param(["run", "--straggler-window", "nan", "--dry-run", "--", "t.py"], "--straggler-window",
                 id="straggler-window-nan"),
    pytest.param(["run", "--straggler-window", "40", "--detach", "--", "t.py"], "--straggler-window with a plain --detach",
                 id="straggler-window-plain-detach"),
    pytest.param(["run", "--monitor-interval", "nan", "--dry-run", "--", "t.py"], "--monitor-interval",
                 id="monitor-interval-nan"),
    pytest.param(["run", "--max-restarts", "-5", "--dry-run", "--", "t.py"], "--max-restarts", id="max-restarts"),
    pytest.param(["run", "--max-restarts", "x", "--dry-run", "--", "t.py"], "--max-restarts",
                 id="max-restarts-word"),
    pytest.param(["run", "--nnodes", "abc", "--dry-run", "--", "t.py"], "--nnodes", id="nnodes-abc"),
    pytest.param(["run", "--nnodes", "3:1", "--rdzv-backend", "c10d", "--dry-run", "--", "t.py"], "--nnodes",
                 id="nnodes-backwards"),
    pytest.param(["run", "--env", "ÄÖ=2", "--dry-run", "--", "t.py"], "--env", id="env-unicode"),
    pytest.param(["run", "--env", "A=x\0y", "--dry-run", "--", "t.py"], "--env", id="env-nul"),
    pytest.param(["run", "--nproc-per-node", "²", "--dry-run", "--", "t.py"], "--nproc-per-node",
                 id="nproc-superscript"),
    pytest.param(["run", "--nproc-per-node", "99999999999", "--dry-run", "--", "t.py"], "--nproc-per-node",
                 id="nproc-huge"),
    pytest.param(["run", "--dry-run", "--", "t\0.py"], "script", id="script-nul"),
    pytest.param(["stop", "--grace", "nan", "th-x"], "--grace", id="stop-grace-nan"),
    pytest.param(["logs", "--rank", "x", "th-x"], "--rank", id="logs-rank-word"),
    pytest.param(["status", "../../etc/x"], "run id", id="status-path"),
    pytest.param(["run", "--bogus"], "--bogus", id="unknown-flag"),
    pytest.param(["run", "--json", "--detach", "--", "t.py"], "--json with --detach", id="json-detach"),
    pytest.param(["check", "--bandwidth", "--min-bandwidth", "fast"], "--min-bandwidth", id="min-bandwidth-word"),
    pytest.param(["check", "--min-bandwidth", "-1Gbit"], "--min-bandwidth", id="min-bandwidth-negative"),
]


@pytest.mark.parametrize("args,named", FLAGS)
def test_a_bad_flag_is_one_line_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str],
                                          named: str) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert_one_line(*run_cli(tmp_path, HOSTS, args), named)


@pytest.mark.parametrize("command", [["stop"], ["logs"], ["status"], ["attach"]])
@pytest.mark.parametrize("content", [
    pytest.param("{", id="not-json"),
    pytest.param("[]", id="not-an-object"),
    pytest.param('{"run_id": "th-x"}', id="missing-keys"),
    pytest.param(None, id="hostile-supervisor"),
])
def test_a_corrupt_run_record_is_one_line_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    command: list[str], content: str | None) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    runs = tmp_path / "state" / "torchherd" / "runs"
    runs.mkdir(parents=True)
    if content is None:
        node = {"name": "a", "address": "192.0.2.1", "user": None, "ssh_port": None, "identity_file": None,
                "python": "python3", "workdir": "~", "log_file": "~/.torchherd/runs/th-x/a.log",
                "state_file": "~/.torchherd/runs/th-x/a.state.json", "supervisor": "1; touch /tmp/x",
                "pid": None, "pgid": None}
        content = json.dumps({"run_id": "th-x", "inventory": "/h.toml", "created": 1.0, "command": ["t.py"],
                              "nodes": [node], "max_rank": 0, "grace": 1.0})
    (runs / "th-x.json").write_text(content)
    code, output = run_cli(tmp_path, HOSTS, [*command, "th-x"])
    assert_one_line(code, output, "th-x.json")


# A user or host name reaches ssh_config's `Match exec` and
# `ProxyCommand` as %r / %h, unquoted, in the controller's shell (as in OpenSSH: the
# pattern of CVE-2023-51385). Every source is checked as OpenSSH's valid_ruser /
# valid_hostname do, before any ssh_config is read.

MATCH_EXEC = 'Match exec "echo %r %h >/dev/null"\n  Port 22\n'


def _marker(tmp_path: Path) -> Path:
    return tmp_path / "ran"


def _evil(tmp_path: Path) -> str:
    return f"$(touch {_marker(tmp_path)})"


def test_match_exec_really_runs_what_the_user_holds(tmp_path: Path) -> None:
    """The control: a name with $(...) that got as far as ssh_config would have run."""
    from torchherd.inventory import Host
    from torchherd.transport.ssh import resolve_target

    (tmp_path / "ssh_config").write_text(MATCH_EXEC)
    host = Host(name="a", address="192.0.2.1", user="a" + _evil(tmp_path), ssh_port=None, identity_file=None,
                python="python3", workdir="~", env={}, setup="", local_addr=None)
    resolve_target(host, tmp_path / "ssh_config")
    assert _marker(tmp_path).exists()


SHELL_NAMES = [
    pytest.param('[defaults]\nuser = "a{evil}"\n' + HOSTS, "[defaults].user", id="defaults-user"),
    pytest.param('[[hosts]]\nname = "a"\naddress = "192.0.2.1"\nuser = "b{evil}"\n', "hosts[0].user",
                 id="host-user"),
    pytest.param('[[hosts]]\nname = "a"\naddress = "192.0.2.1"\nuser = "a`id`"\n', "hosts[0].user",
                 id="backquote"),
    pytest.param('[[hosts]]\nname = "a"\naddress = "192.0.2.1"\nuser = "-oProxyCommand=x"\n', "hosts[0].user",
                 id="option-user"),
    pytest.param('[[hosts]]\nname = "a"\naddress = "192.0.2.1"\nuser = "a; id"\n', "hosts[0].user", id="semicolon"),
    pytest.param('[cluster]\nscheduler = "slurm"\n[slurm]\nlogin = "login1{evil}"\nnodes = 2\n', "[slurm].login",
                 id="slurm-login"),
    pytest.param('[cluster]\nscheduler = "slurm"\n[slurm]\nlogin = "-oProxyCommand=x"\nnodes = 2\n',
                 "[slurm].login", id="slurm-login-option"),
]


@pytest.mark.parametrize("inventory,named", SHELL_NAMES)
def test_an_inventory_name_a_shell_would_run_is_refused(tmp_path: Path, inventory: str, named: str) -> None:
    (tmp_path / "ssh_config").write_text(MATCH_EXEC)
    text = '[cluster]\nssh_config = "ssh_config"\n' + inventory if "[cluster]" not in inventory else \
        inventory.replace("[cluster]\n", '[cluster]\nssh_config = "ssh_config"\n')
    for args in (["hosts"], ["check", "--only", "ssh"]):
        assert_one_line(*run_cli(tmp_path, text.format(evil=_evil(tmp_path)), args), named)
    assert not _marker(tmp_path).exists()


@pytest.mark.parametrize("args,named", [
    pytest.param(["-H", "x{evil}@192.0.2.1"], "-H", id="hosts-flag"),
    pytest.param(["-H", "a|b@192.0.2.1"], "-H", id="hosts-flag-pipe"),
    pytest.param(["-H", "192.0.2.1", "--scheduler", "slurm", "--slurm-login", "login1{evil}"], "--slurm-login",
                 id="slurm-login-flag"),
])
def test_a_command_line_name_a_shell_would_run_is_refused(tmp_path: Path, args: list[str], named: str) -> None:
    out = StringIO()
    code = main(["hosts", *(arg.format(evil=_evil(tmp_path)) for arg in args)], console=make_console(out, width=400))
    assert_one_line(code, out.getvalue(), named)
    assert not _marker(tmp_path).exists()


def test_a_hostfile_user_a_shell_would_run_is_refused(tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"worker-1 slots=2\nx{_evil(tmp_path)}@worker-2 slots=2\n")
    out = StringIO()
    code = main(["-i", str(hostfile), "hosts"], console=make_console(out, width=400))
    assert_one_line(code, out.getvalue(), f"{hostfile}:2")
    assert not _marker(tmp_path).exists()


@pytest.mark.parametrize("where,field,value", [
    pytest.param("node", "address", "192.0.2.1{evil}", id="address"),
    pytest.param("node", "address", "-oProxyCommand=x", id="address-option"),
    pytest.param("node", "user", "a{evil}", id="user"),
    pytest.param("login", "address", "login1{evil}", id="slurm-login-address"),
    pytest.param("login", "user", "a{evil}", id="slurm-login-user"),
])
@pytest.mark.parametrize("command", [["status"], ["stop"], ["logs"]])
def test_a_run_record_name_a_shell_would_run_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        command: list[str], where: str, field: str,
                                                        value: str) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    (tmp_path / "ssh_config").write_text(MATCH_EXEC)
    runs = tmp_path / "state" / "torchherd" / "runs"
    runs.mkdir(parents=True)
    node = {"name": "a", "address": "192.0.2.1", "user": None, "ssh_port": None, "identity_file": None,
            "python": "python3", "workdir": "~", "log_file": "~/.torchherd/runs/th-x/a.log",
            "state_file": "~/.torchherd/runs/th-x/a.state.json", "supervisor": None, "pid": None, "pgid": None}
    login = {**node, "name": "login1", "address": "login1"}
    (node if where == "node" else login)[field] = value.format(evil=_evil(tmp_path))
    extra = {"scheduler": "slurm", "job_id": "7", "run_dir": "~/r", "login": login} if where == "login" else {}
    (runs / "th-x.json").write_text(json.dumps({
        "run_id": "th-x", "inventory": "/h.toml", "created": 1.0, "command": ["t.py"], "nodes": [node],
        "max_rank": 0, "grace": 1.0, "ssh_config": str(tmp_path / "ssh_config"), "ssh_timeout": 1.0,
        "extra": extra}))
    code, output = run_cli(tmp_path, HOSTS, [*command, "th-x"])
    assert_one_line(code, output, f"th-x.json: {'nodes[0]' if where == 'node' else 'extra.login'}.{field}")
    assert not _marker(tmp_path).exists()


SLURM_TOOLS = ("scancel", "squeue", "sacct", "scontrol", "sbatch")


@pytest.mark.parametrize("damage,named", [
    pytest.param({"job_id": "--partition=gpu"}, "extra.job_id", id="job-id-option"),
    pytest.param({"job_id": 42}, "extra.job_id", id="job-id-type"),
    pytest.param({"run_dir": "/etc"}, "extra.run_dir", id="run-dir-elsewhere"),
    pytest.param({"run_dir": "~/.torchherd/runs/th-x/../../.ssh"}, "extra.run_dir", id="run-dir-up"),
    pytest.param({"scheduler": "pbs"}, "extra.scheduler", id="scheduler"),
])
@pytest.mark.parametrize("command", [["status"], ["stop"], ["logs"]])
def test_a_damaged_slurm_record_is_reported_never_acted_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           command: list[str], damage: dict[str, object],
                                                           named: str) -> None:
    """A run record whose job id is ``--partition=gpu`` once made ``stop`` run ``scancel
    --partition=gpu`` (every job of the user there). The SLURM tools here only leave a
    marker: none runs."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in SLURM_TOOLS:
        (tools / tool).write_text(f"#!/bin/sh\necho \"$0 $*\" >> {_marker(tmp_path)}\n")
        (tools / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}:{os.environ['PATH']}")
    runs = tmp_path / "state" / "torchherd" / "runs"
    runs.mkdir(parents=True)
    node = {"name": "a", "address": "a", "user": None, "ssh_port": None, "identity_file": None,
            "python": "python3", "workdir": "~", "log_file": "~/.torchherd/runs/th-x/a.out",
            "state_file": "~/.torchherd/runs/th-x/a.exit", "supervisor": None, "pid": None, "pgid": None}
    extra = {"scheduler": "slurm", "job_id": "7", "run_dir": "~/.torchherd/runs/th-x", "login": None, **damage}
    (runs / "th-x.json").write_text(json.dumps({
        "run_id": "th-x", "inventory": "/h.toml", "created": 1.0, "command": ["t.py"], "nodes": [node],
        "max_rank": 0, "grace": 1.0, "ssh_config": None, "ssh_timeout": 1.0, "extra": extra}))
    code, output = run_cli(tmp_path, HOSTS, [*command, "th-x"])
    assert_one_line(code, output, f"th-x.json: {named}")
    assert not _marker(tmp_path).exists(), _marker(tmp_path).read_text()


def test_a_slurm_record_as_torchherd_writes_it_loads() -> None:
    """The control: the values the damaged ones replace are those of a real record."""
    from torchherd.engine.records import RunRecord

    node = {"name": "a", "address": "a", "python": "python3", "workdir": "~", "log_file": "x", "state_file": "y"}
    for job_id, directory in [("", "~/.torchherd/runs/th-x"), ("7", "~/.torchherd/runs/th-x"),
                              ("12_3", "~/.torchherd/runs/th-x/attempt-2")]:
        record = RunRecord.from_json(json.dumps({
            "run_id": "th-x", "inventory": "/h.toml", "created": 1.0, "command": ["t.py"], "nodes": [node],
            "max_rank": 0, "grace": 1.0, "extra": {"scheduler": "slurm", "job_id": job_id, "run_dir": directory}}))
        assert record.extra["job_id"] == job_id and record.extra["run_dir"] == directory
