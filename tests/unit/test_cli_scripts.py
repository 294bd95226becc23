"""The command line as a script meets it, exact text: one JSON document on stdout with a
``schema`` in every ending of a ``--json`` command, the plan as JSON."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from io import StringIO
from pathlib import Path
from typing import Any

import pytest

import torchherd
from torchherd.cli import main
from torchherd.console import make_console
from torchherd.engine.records import NodeRecord, RunRecord, remote_log_file, remote_state_file, save

HOSTS = ["-H", "192.0.2.1,192.0.2.2", "--python", "/opt/py", "--workdir", "/w", "--nproc-per-node", "2"]
"""Two hosts no test reaches (TEST-NET-1): enough for a plan, which touches no network."""
REFUSED = ["-H", "127.0.0.1:1", "--python", "python3", "--workdir", "/tmp", "--nproc-per-node", "1"]
"""A host whose SSH port refuses at once: a run that cannot start, without a cluster."""


def json_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any, list[str]]:
    """The exit code, stdout read as exactly one JSON document, and the lines the console got."""
    out = StringIO()
    code = main(list(args), console=make_console(out, width=400))
    return code, json.loads(capsys.readouterr().out), out.getvalue().splitlines()


@pytest.mark.parametrize("args,error,hint", [
    (["run", "--json", "-i", "missing.toml", "--", "x.py"], "missing.toml: inventory file not found",
     "pass one with -i FILE or set TORCHHERD_INVENTORY; write one with `torchherd init -H HOSTS` (or `torchherd "
     "init --example`: every key, explained); or give the hosts with -H instead"),
    (["run", "--json", "--bogus", "--", "x.py"], "torchherd run: unrecognized arguments: --bogus",
     "torchherd run --help lists the options"),
    (["run", "--json", *HOSTS], "run: no training script given", "torchherd run [options] -- train.py [args...]"),
    (["check", "--json", "-H", ""], "-H '': empty (an unset variable?)",
     "name the hosts: -H node0,node1 (or leave out -H to use the inventory)"),
    (["hosts", "--json", "-i", "missing.toml"], "missing.toml: inventory file not found",
     "pass one with -i FILE or set TORCHHERD_INVENTORY; write one with `torchherd init -H HOSTS` (or `torchherd "
     "init --example`: every key, explained); or give the hosts with -H instead"),
])
def test_json_usage_error_is_one_document_with_the_error_and_its_hint(
        args: list[str], error: str, hint: str, capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, document, lines = json_cli(capsys, *args)
    assert (code, document) == (2, {"schema": 1, "ok": False, "exit_code": 2, "error": error, "hint": hint})
    assert lines == [f"error: {error}", f"  hint: {hint}"]  # the terminal's line as well, on the console


def test_json_after_the_separator_is_the_scripts_own(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--bogus", "--", "x.py", "--json"], console=make_console(StringIO())) == 2
    assert capsys.readouterr().out == ""


def test_run_json_preflight_failed_is_one_document_with_the_checks(capsys: pytest.CaptureFixture[str]) -> None:
    code, document, _ = json_cli(capsys, "run", "--json", *REFUSED, "--", "x.py")
    assert code == 1
    assert {key: document[key] for key in ("schema", "ok", "exit_code", "error", "hint")} == {
        "schema": 1, "ok": False, "exit_code": 1, "error": "the preflight checks failed", "hint": ""}
    first = document["checks"][0]
    assert {key: value for key, value in first.items() if key != "summary"} == {
        "node": "127.0.0.1", "check": "ssh", "status": "fail",
        "fix": "is sshd running on the node and listening on that port?"}
    assert first["summary"].startswith("127.0.0.1: connection refused by ")  # the user is this machine's
    assert {check["status"] for check in document["checks"][1:]} == {"skip"}


def test_run_json_connection_failed_is_one_document_naming_the_node(capsys: pytest.CaptureFixture[str]) -> None:
    code, document, _ = json_cli(capsys, "run", "--no-check", "--json", *REFUSED, "--", "x.py")
    assert code == 1
    assert {key: value for key, value in document.items() if key != "unreachable"} == {
        "schema": 1, "ok": False, "exit_code": 1, "error": "1 of 1 node could not be reached", "hint": ""}
    [node] = document["unreachable"]
    assert (node["node"], node["kind"], node["hint"]) == (
        "127.0.0.1", "refused", "is sshd running on the node and listening on that port?")
    assert node["error"].startswith("127.0.0.1: connection refused by ")


def test_run_json_interrupted_before_the_job_is_one_document(capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from torchherd.api import Cluster

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Cluster, "launch", interrupted)  # Ctrl-C during the preflight
    code, document, lines = json_cli(capsys, "run", "--json", *HOSTS, "--", "x.py")
    assert (code, document) == (130, {"schema": 1, "ok": False, "exit_code": 130, "error": "interrupted",
                                      "hint": ""})
    assert lines == ["interrupted"]


def test_run_dry_run_json_is_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, plan, _ = json_cli(capsys, "run", "--dry-run", "--json", *HOSTS, "--env", "HF_TOKEN=hf_secret",
                             "--", "train.py", "--lr", "3e-4")
    assert code == 0
    run_id = plan["run_id"]
    assert {key: value for key, value in plan.items() if key != "nodes"} == {
        "schema": 1, "dry_run": True, "run_id": run_id, "scheduler": "ssh", "master": "192.0.2.1",
        "master_addr": "192.0.2.1", "port": 29500, "rdzv_backend": "static", "world_size": 4, "sync": None}
    worker = plan["nodes"][1]
    argv = ["/opt/py", "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", "1",
            "--master-addr", "192.0.2.1", "--master-port", "29500", "--local-addr", "192.0.2.2", "--max-restarts",
            "0", "--tee", "3", "--log-dir", f"/tmp/torchherd-{run_id}-192.0.2.2", "--", "train.py", "--lr", "3e-4"]
    assert worker == {
        "name": "192.0.2.2", "node_rank": 1, "address": "192.0.2.2", "local_addr": None, "nproc_per_node": 2,
        "workdir": "/w", "argv": argv,
        "command": "cd /w && env HF_TOKEN=*** PYTHONUNBUFFERED=1 TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[torchherd-rank"
                   f" ${{rank}}] ' TORCHHERD_RUN_ID={run_id} " + " ".join(argv),
        "env": ["HF_TOKEN", "PYTHONUNBUFFERED", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "TORCHHERD_RUN_ID"],
        "notes": ["--local-addr 192.0.2.2",
                  "PYTHONUNBUFFERED=1 so each line reaches the controller as it is printed"]}
    assert [node["name"] for node in plan["nodes"]] == ["192.0.2.1", "192.0.2.2"]
    assert "hf_secret" not in json.dumps(plan)


def test_hosts_json_has_the_schema(capsys: pytest.CaptureFixture[str]) -> None:
    code, document, _ = json_cli(capsys, "hosts", "--json", "-H", "192.0.2.1")
    assert code == 0 and list(document) == ["schema", "hosts"] and document["schema"] == 1


def test_status_json_lists_the_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert json_cli(capsys, "status", "--json")[:2] == (0, {"schema": 1, "runs": []})
    run_id = "th-20240501-120000-abcdef"
    node = NodeRecord(name="node0", address="127.0.0.1", user="u", ssh_port=1, identity_file=None, python="/opt/py",
                      workdir="~/w", log_file=remote_log_file(run_id, "node0"),
                      state_file=remote_state_file(run_id, "node0"), supervisor=40, pid=50, pgid=50)
    save(RunRecord(run_id=run_id, inventory="-H", created=100.0, command=("train.py",), nodes=(node,), max_rank=0,
                   grace=5.0, ssh_timeout=2.0), tmp_path / "torchherd" / "runs")
    code, listed, _ = json_cli(capsys, "status", "--json")
    [run] = listed["runs"]
    [state] = run["nodes"]
    assert code == 0 and state["state"] == "unreachable"
    assert run == {"run_id": run_id, "state": "unknown", "created": 100.0, "command": ["train.py"],
                   "nodes": [state], "recovery": None, "attached": None}
    assert json_cli(capsys, "status", "--json", run_id)[:2] == (0, {"schema": 1, **run})
    assert json_cli(capsys, "status", "--json", "zzz")[:2] == (2, {
        "schema": 1, "ok": False, "exit_code": 2, "error": f"no run 'zzz' in {tmp_path}/torchherd/runs",
        "hint": "torchherd status lists the known runs"})


def cli(*args: str) -> tuple[int, list[str]]:
    out = StringIO()
    code = main(list(args), console=make_console(out, width=400))
    return code, out.getvalue().splitlines()


@pytest.mark.parametrize("args,error,hint", [
    (["--ranks", "0,8-15"], "--ranks 0,8-15: the job has no rank 8 (its ranks are 0 to 3)",
     "name ranks below the world size, 4"),
    (["--ranks", "4"], "--ranks 4: the job has no rank 4 (its ranks are 0 to 3)", "name ranks below the world size, 4"),
    (["--rdzv-conf", "timeout=60"], "--rdzv-conf timeout=60: only the c10d rendezvous takes it, and this run's is "
     "static", "add --rdzv-backend c10d, or leave --rdzv-conf out"),
    (["--rdzv-backend", "static", "--rdzv-conf", "timeout=60"], "--rdzv-conf timeout=60: only the c10d rendezvous "
     "takes it, and this run's is static", "add --rdzv-backend c10d, or leave --rdzv-conf out"),
])
def test_a_rank_the_job_lacks_or_rdzv_conf_with_static_is_refused(args: list[str], error: str, hint: str) -> None:
    assert cli("run", "--dry-run", *HOSTS, *args, "--", "x.py") == (2, [f"error: {error}", f"  hint: {hint}"])


@pytest.mark.parametrize("args", [["--ranks", "0,2-3"], ["--rdzv-backend", "c10d", "--rdzv-conf", "timeout=60"],
                                  ["--nproc-per-node", "gpu", "--ranks", "0,8-15"]])
def test_ranks_the_job_has_and_rdzv_conf_with_c10d_are_taken(args: list[str]) -> None:
    code, out = cli("run", "--dry-run", *HOSTS, *args, "--", "x.py")
    assert code == 0 and out[-1] == "dry run: nothing was started"
    assert ("--rdzv-conf timeout=60,is_host=1" in out[2]) == ("--rdzv-conf" in args)


KNOWN = ("known ids: ssh, ping, hostname, port, firewall, network, env, python, gpu, xid, ib, gpudiag, script, venv, clock, "
         "bandwidth, mtu, smoke, container")


@pytest.mark.parametrize("args,lines", [
    (["--only", "ssh,foo"], ["error: --only ssh,foo: unknown check id 'foo'", f"  hint: {KNOWN}"]),
    (["--skip", "gpuu"], ["error: --skip gpuu: unknown check id 'gpuu'; did you mean 'gpu'?", f"  hint: {KNOWN}"]),
    (["--only", "ssh", "--no-check"], ["error: --only with --no-check: no check runs",
                                       "  hint: leave out --only or --no-check"]),
    (["--scheduler", "slurm", "--skip", "gpu"], [
        "error: --skip: not for SLURM runs (run's preflight there is SLURM's view only: sbatch --test-only)",
        "  hint: leave --skip out, or --no-check to submit unchecked"]),
])
def test_run_only_and_skip_refuse_what_they_cannot_do(args: list[str], lines: list[str]) -> None:
    assert cli("run", "--dry-run", *HOSTS, *args, "--", "x.py") == (2, lines)


@pytest.mark.parametrize("args,checks", [
    (["--only", "ssh,ping"], ["ssh", "ping"]),
    (["--skip", "ping,hostname,port,firewall,network,env,python,gpu,xid,ib"], ["ssh", "script", "clock", "mtu"]),
    ([], ["ssh", "ping", "hostname", "port", "firewall", "network", "env", "python", "gpu", "xid", "ib", "script",
          "clock", "mtu"]),
])
def test_run_only_and_skip_choose_the_preflights_checks(args: list[str], checks: list[str],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, document, _ = json_cli(capsys, "run", "--json", *REFUSED, *args, "--", "x.py")
    assert (code, document["error"]) == (1, "the preflight checks failed")
    assert [check["check"] for check in document["checks"]] == checks


def test_run_help_starts_with_what_a_newcomer_needs(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 41 item 12: the groups of every command (the hosts first, SLURM last), what a
    newcomer needs first in each, and examples at the end."""
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["run", "--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "usage: torchherd run [options] [--] SCRIPT [ARGS...]"
    options = [line.strip().split("  ")[0] for line in lines if line.startswith("  -")]
    assert options[:13] == ["-h, --help", "-i FILE, --inventory FILE", "-H HOSTS, --hosts HOSTS", "--nodelist LIST",
                            "--master HOST", "--master-port PORT", "--include HOSTS", "--exclude HOSTS",
                            "--ssh-timeout S", "--accept-new-host-keys", "--python PATH", "--workdir DIR",
                            "--nproc-per-node N"]
    assert [line for line in lines if line and not line.startswith(" ") and line.endswith(":")] == [
        "positional arguments:", "options:", "hosts:", "the job:", "the job: torchrun's own flags, passed through:",
        "checks:", "output:", "recovery (torchherd docs run: Recovery); each flag overrides [recovery]:",
        "containers and environments:", "SLURM (torchherd docs slurm); each --slurm-KEY overrides [slurm].KEY:",
        "examples:"]
    at = lines.index("the job: torchrun's own flags, passed through:")
    assert lines[at + 1:at + 3] == [
        "  --master-addr ADDR    address the workers reach the master at (default: [cluster].master_addr,",
        "                        else found by the preflight)"]
    assert lines[lines.index("examples:"):] == [
        "examples:",
        "  torchherd run -H localhost --nproc-per-node 2 -- train.py --steps 20   # this machine, no SSH",
        "  torchherd run -H gpu01,gpu02 --python /opt/venv/bin/python --nproc-per-node gpu --sync -- train.py",
        "  torchherd run --dry-run -i hosts.toml -- train.py       # each node's command; nothing starts"]


@pytest.mark.parametrize("command,groups", [
    ("hosts", ["hosts", "the job", "output", "containers and environments"]),
    ("check", ["hosts", "the job", "checks", "output", "containers and environments", "SLURM"]),
    ("run", ["hosts", "the job", "the job: torchrun's own flags, passed through", "checks", "output", "recovery",
             "containers and environments", "SLURM"]),
    ("init", ["hosts", "the job", "output"]), ("status", ["output"]), ("logs", ["output"]), ("report", ["output"]),
    ("stop", ["the job"])])
def test_every_command_groups_its_flags_in_the_same_order(command: str, groups: list[str],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    import re

    assert main([command, "--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    if command in ("hosts", "check", "run", "init"):  # the others' usage lines are short as argparse writes them
        assert lines[0] == f"usage: torchherd {command} [options]" + {"check": " [-- SCRIPT]",
                                                                      "run": " [--] SCRIPT [ARGS...]"}.get(command, "")
    assert len(lines[0]) <= 80, lines[0]
    titles = [re.split(r" \(|:$", line)[0] for line in lines if re.match(r"[A-Za-z].*:$", line)]
    assert [title for title in titles if title not in ("usage", "positional arguments", "options", "examples",
                                                        "check ids for --only and --skip")] == groups


def test_check_help_ends_with_examples_that_parse(capsys: pytest.CaptureFixture[str]) -> None:
    import shlex

    from torchherd.cli import build_parser

    assert main(["check", "--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[lines.index("examples:"):] == [
        "examples:",
        "  torchherd check -H localhost                   # this machine, no SSH",
        "  torchherd check -H 'gpu[01-04]' --python /opt/venv/bin/python -- train.py",
        "  torchherd check --only ssh,port --json         # two checks, one JSON document"]
    assert main(["run", "--help"]) == 0
    run = capsys.readouterr().out.splitlines()
    for line in lines[lines.index("examples:") + 1:] + run[run.index("examples:") + 1:]:
        build_parser().parse_args(shlex.split(line, comments=True)[1:])  # each pastes as it is


def test_run_help_says_every_default() -> None:
    import argparse

    from torchherd.cli import build_parser

    [commands] = [action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction)]
    run = commands.choices["run"]
    silent = [action.option_strings[-1] for group in run._action_groups for action in group._group_actions
              if action.option_strings and action.help != argparse.SUPPRESS and action.dest != "help"
              and "default" not in (action.help or "") and "default" not in (group.description or "")]
    assert silent == []


SRC = str(Path(torchherd.__file__).parent.parent)
"""The torchherd under test, for the shells that run ``python -m torchherd``."""


def shell(program: list[str], script: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC, "TORCHHERD_PY": sys.executable}
    return subprocess.run([*program, script], capture_output=True, text=True, timeout=60, env=env, check=False)


BASH_COMPLETE = """
source <("$TORCHHERD_PY" -m torchherd completion bash)
complete -p torchherd
t() { COMP_WORDS=("$@"); COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); _torchherd; echo "${COMPREPLY[*]}"; }
t torchherd ru
t torchherd -i h.toml ch
t torchherd run --nproc
t torchherd run -H a,b --rdzv-backend ''
t torchherd check --me
t torchherd completion ''
t torchherd run -- --no
t torchherd ''
"""


def test_bash_completion_completes_commands_flags_and_choices() -> None:
    done = shell(["bash", "-c"], BASH_COMPLETE)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines() == [
        "complete -o default -F _torchherd torchherd",
        "run", "check", "--nproc-per-node", "static c10d", "--mesh", "bash zsh fish",
        "",  # after --: the script's own words, left to the shell's file completion
        "hosts check run status logs report stop attach init docs completion"]


@pytest.mark.skipif(shutil.which("fish") is None, reason="fish is not installed")
def test_fish_completion_completes_commands_and_choices() -> None:
    done = shell(["fish", "-c"], '"$TORCHHERD_PY" -m torchherd completion fish | source; complete -C "torchherd ru"; '
                 'complete -C "torchherd run --rdzv-backend "; complete -C "torchherd completion "')
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines() == ["run\tcheck, then launch the job on every node", "c10d\tthe rendezvous",
                                        "static\tthe rendezvous", "bash", "fish", "zsh"]


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
def test_zsh_completion_parses_and_registers_itself(tmp_path: Path) -> None:
    done = shell(["zsh", "-c"], 'autoload -U compinit; compinit -u -D; '
                 'source <("$TORCHHERD_PY" -m torchherd completion zsh); print -r -- $_comps[torchherd]; '
                 'functions _torchherd | grep -c "run) opts=("')
    assert (done.returncode, done.stderr, done.stdout) == (0, "", "_torchherd\n1\n")


@pytest.mark.parametrize("shell_name", ["bash", "zsh", "fish"])
def test_completion_names_every_flag_of_run(shell_name: str, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from torchherd.cli import build_parser

    assert main(["completion", shell_name]) == 0
    text = capsys.readouterr().out
    [commands] = [action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction)]
    flags = [flag for action in commands.choices["run"]._actions for flag in action.option_strings]
    spelled = [flag if shell_name != "fish" else ("-l " + flag[2:] if flag.startswith("--") else "-s " + flag[1:])
               for flag in flags]
    assert [flag for flag in spelled if flag not in text] == []


def test_completion_of_an_unknown_shell_is_exit_2() -> None:
    assert cli("completion", "tcsh") == (2, [
        "error: torchherd completion: argument SHELL: invalid choice 'tcsh' (choose from bash, zsh, fish)",
        "  hint: torchherd completion --help lists the options"])


def saved_run(runs: Path, run_id: str) -> None:
    """A detached run's record whose node refuses SSH at once (status says unreachable)."""
    node = NodeRecord(name="node0", address="127.0.0.1", user="u", ssh_port=1, identity_file=None, python="/opt/py",
                      workdir="~/w", log_file=remote_log_file(run_id, "node0"),
                      state_file=remote_state_file(run_id, "node0"), supervisor=40, pid=50, pgid=50)
    save(RunRecord(run_id=run_id, inventory="-H", created=100.0, command=("train.py",), nodes=(node,), max_rank=0,
                   grace=5.0, ssh_timeout=2.0), runs)


def test_status_and_logs_take_a_unique_prefix_and_list_an_ambiguous_ones_runs(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    runs = tmp_path / "torchherd" / "runs"
    for run_id in ("th-20240501-120000-aaaaaa", "th-20240501-130000-bbbbbb", "th-20240502-090000-cccccc"):
        saved_run(runs, run_id)
    code, document, _ = json_cli(capsys, "status", "--json", "th-20240502")
    assert (code, document["run_id"]) == (0, "th-20240502-090000-cccccc")
    ambiguous = ["error: run id 'th-20240501' is ambiguous: th-20240501-120000-aaaaaa, th-20240501-130000-bbbbbb",
                 "  hint: give more of the run id"]
    assert cli("status", "th-20240501") == (2, ambiguous)
    assert cli("logs", "th-20240501") == (2, ambiguous)
    assert cli("stop", "th-2024") == (2, ["error: run id 'th-2024' is ambiguous: th-20240501-120000-aaaaaa, "
                                          "th-20240501-130000-bbbbbb, th-20240502-090000-cccccc",
                                          "  hint: give more of the run id"])


def test_an_ambiguous_run_id_lists_ten_runs_on_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    ids = [f"th-20240501-1200{second:02d}-abcdef" for second in range(12)]
    for run_id in ids:
        saved_run(tmp_path / "torchherd" / "runs", run_id)
    assert cli("status", "abcdef") == (2, [f"error: run id 'abcdef' is ambiguous: {', '.join(ids[:10])}, ... "
                                           "(12 in all)", "  hint: give more of the run id"])
