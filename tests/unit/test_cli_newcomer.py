"""The command line as a newcomer meets it, exact text: no prefix abbreviations, -V,
torchherd alone, a mistyped command, -H with nothing in it, one address at two ports,
check --help naming the check ids."""

from __future__ import annotations

from io import StringIO
from pathlib import Path

import pytest

from torchherd.cli import main
from torchherd.console import make_console


def cli(*args: str) -> tuple[int, list[str]]:
    out = StringIO()
    code = main(list(args), console=make_console(out, width=400))
    return code, out.getvalue().splitlines()


@pytest.mark.parametrize("flag,meant", [("--nproc", "--nproc-per-node"), ("--nproc=2", "--nproc-per-node"),
                                        ("--no-ch", "--no-check"), ("--dry", "--dry-run")])
def test_an_abbreviated_flag_is_refused_never_taken_for_a_longer_one(flag: str, meant: str) -> None:
    assert cli("run", "-H", "192.0.2.1", flag, "--", "train.py") == (2, [
        f"error: torchherd run: unrecognized arguments: {flag}; did you mean {meant}?",
        "  hint: torchherd run --help lists the options"])


@pytest.mark.parametrize("args,line", [
    (["rn"], "error: torchherd: unknown command 'rn'; did you mean 'run'? "
             "(commands: hosts, check, run, status, logs, report, stop, attach, init, docs, completion)"),
    (["-i", "h.toml", "stauts"], "error: torchherd: unknown command 'stauts'; did you mean 'status'? "
                                 "(commands: hosts, check, run, status, logs, report, stop, attach, init, docs, completion)"),
    (["launch"], "error: torchherd: unknown command 'launch' (commands: hosts, check, run, status, logs, report, "
                 "stop, attach, init, docs, completion)"),
    (["run", "--rdzv-backend", "c01d", "--", "x.py"], "error: torchherd run: argument --rdzv-backend: invalid "
                                                      "choice 'c01d'; did you mean 'c10d'? (choose from static, c10d)"),
    (["run", "--no-chek", "--", "x.py"], "error: torchherd run: unrecognized arguments: --no-chek; did you mean --no-check?"),
    (["run", "--lr", "3e-4", "--", "x.py"], "error: torchherd run: unrecognized arguments: --lr"),
])
def test_a_mistyped_command_or_flag_gets_did_you_mean(args: list[str], line: str) -> None:
    code, out = cli(*args)
    assert (code, out[0]) == (2, line)


def test_torchherd_alone_prints_the_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "usage: torchherd [-h] [-i FILE] [-V] COMMAND ..."
    assert "    run                 check, then launch the job on every node" in out.splitlines()
    assert main(["-i", "hosts.toml"]) == 2 and capsys.readouterr().out == out


@pytest.mark.parametrize("flag", ["-V", "--version"])
def test_version(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    from torchherd import __version__

    assert main([flag]) == 0
    assert capsys.readouterr().out == f"torchherd {__version__}\n"


@pytest.mark.parametrize("args,line", [
    (["hosts", "-H", ""], "error: -H '': empty (an unset variable?)"),
    (["run", "--dry-run", "-H", " ", "--", "x.py"], "error: -H ' ': empty (an unset variable?)"),
    (["hosts", "--nodelist", ""], "error: --nodelist '': empty (an unset variable?)"),
    (["-i", "", "hosts"], "error: -i '': empty (an unset variable?)"),
    (["init", "-H", ""], "error: -H '': empty (an unset variable?)"),
])
def test_an_empty_host_flag_is_exit_2_never_the_hosts_toml_here(
        args: list[str], line: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts.toml").write_text('[[hosts]]\nname = "fallback"\naddress = "192.0.2.1"\n')
    code, out = cli(*args)
    assert (code, out[0]) == (2, line)
    assert out[1].startswith("  hint: ") and "fallback" not in "\n".join(out)


def test_one_address_at_two_ports_is_two_hosts(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from torchherd.inventory.hostspec import HostEntry, host_entries

    assert host_entries("127.0.0.1:2222,127.0.0.1:2223,other") == [
        HostEntry("127.0.0.1-2222", None, 2222, "127.0.0.1"), HostEntry("127.0.0.1-2223", None, 2223, "127.0.0.1"),
        HostEntry("other")]
    assert host_entries("a,a:2222") == [HostEntry("a"), HostEntry("a-2222", None, 2222, "a")]
    assert main(["hosts", "--json", "-H", "127.0.0.1:2222,127.0.0.1:2223"]) == 0
    rows = json.loads(capsys.readouterr().out)["hosts"]
    assert [(row["name"], row["ssh"].split("@")[-1]) for row in rows] == [("127.0.0.1-2222", "127.0.0.1:2222"),
                                                                          ("127.0.0.1-2223", "127.0.0.1:2223")]
    assert cli("hosts", "-H", "a:2222,a:2222") == (2, ["error: -H: host 'a-2222' is listed twice",
                                                       "  hint: list every host once"])
    monkeypatch.chdir(tmp_path)
    assert main(["init", "-H", "127.0.0.1:2222,127.0.0.1:2223"]) == 0
    written = (tmp_path / "hosts.toml").read_text()
    assert 'name = "127.0.0.1-2223"' in written and 'address = "127.0.0.1"\nssh_port = 2223' in written


def test_check_help_lists_the_ids_only_and_skip_take(capsys: pytest.CaptureFixture[str]) -> None:
    import re

    from torchherd.checks.model import CHECK_IDS
    from torchherd.engine.slurm.check import SLURM_CHECKS

    assert main(["check", "--help"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    ids = lines[lines.index("examples:") - 6:lines.index("examples:") - 1]  # the examples come last (their test:
    assert lines[lines.index("examples:") - 1] == ""                          # test_cli_scripts.py)
    assert ids == [
        "check ids for --only and --skip: ssh, ping, hostname, port, firewall, network,",
        "env, python, gpu, xid, ib, script, venv, clock, mtu, container; with",
        "--bandwidth or --smoke (or named by --only): bandwidth; with --smoke: smoke;",
        "with --gpu-diag: gpudiag; SLURM runs also: slurm, slurm-node, gres, sbatch.",
        "What each establishes: torchherd docs checks."]
    listed = re.findall(r"[a-z-]+", " ".join(ids).split(":", 1)[1])
    assert set(CHECK_IDS) | set(SLURM_CHECKS) <= set(listed)  # a check added later is listed too


def test_master_port_overrides_the_inventory_s_port(tmp_path: Path) -> None:
    inventory = tmp_path / "hosts.toml"
    inventory.write_text('[cluster]\nport = 29500\n[[hosts]]\nname = "a"\naddress = "192.0.2.1"\n'
                         '[[hosts]]\nname = "b"\naddress = "192.0.2.2"\n')
    code, out = cli("-i", str(inventory), "run", "--dry-run", "--master-port", "29611", "--", "train.py")
    assert code == 0, out
    commands = [line for line in out if "torch.distributed.run" in line]
    assert len(commands) == 2 and all("--master-addr 192.0.2.1 --master-port 29611 " in line for line in commands)
    code, out = cli("run", "--dry-run", "-H", "192.0.2.1", "--master-port", "29612", "--", "train.py")
    assert code == 0 and "--master-port 29612 " in "\n".join(out)
    assert cli("run", "-H", "192.0.2.1", "--master-port", "70000", "--", "train.py") == (2, [
        "error: torchherd run: argument --master-port: expected a TCP port, 1 to 65535, got '70000'",
        "  hint: torchherd run --help lists the options"])


def test_ssh_timeout_overrides_the_inventory_s(tmp_path: Path) -> None:
    from torchherd.cli import build_parser
    from torchherd.cli.cluster import hosts_of

    inventory = tmp_path / "hosts.toml"
    inventory.write_text('[cluster]\nssh_timeout = 30\n[[hosts]]\nname = "a"\naddress = "192.0.2.1"\n')
    parse = build_parser().parse_args
    assert hosts_of(parse(["-i", str(inventory), "check", "--ssh-timeout", "2.5"])).inventory.cluster.ssh_timeout == 2.5
    assert hosts_of(parse(["-i", str(inventory), "check"])).inventory.cluster.ssh_timeout == 30
    assert hosts_of(parse(["check", "-H", "192.0.2.1", "--ssh-timeout", "4"])).inventory.cluster.ssh_timeout == 4
    assert cli("check", "-H", "192.0.2.1", "--ssh-timeout", "0")[1][0] == (
        "error: torchherd check: argument --ssh-timeout: expected seconds above 0, at most 86400, got '0'")
