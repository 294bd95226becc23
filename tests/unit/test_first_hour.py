"""Issue 41, the first hour (third pass): flags that do what they say, exact text."""

from __future__ import annotations

import socket
import threading
import time
from io import StringIO
from pathlib import Path
from typing import Iterator

import pytest

from torchherd.cli import main
from torchherd.console import make_console


def cli(*args: str) -> tuple[int, list[str]]:
    out = StringIO()
    code = main(list(args), console=make_console(out, width=400))
    return code, out.getvalue().splitlines()


@pytest.fixture
def mute_port() -> Iterator[int]:
    """A port that accepts TCP and never speaks: an sshd that hangs before its banner."""
    import fabric  # noqa: F401  (imported here: its seconds of import on a loaded machine are not the connect's)

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.1)
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    done.set()
    thread.join(5)
    listener.close()
    for connection in held:
        connection.close()


def timed(*args: str) -> tuple[float, int, list[str]]:
    start = time.monotonic()
    code, out = cli(*args)
    return time.monotonic() - start, code, out


def test_ssh_timeout_bounds_the_connect(mute_port: int) -> None:
    seconds, code, out = timed("check", "-H", f"127.0.0.1:{mute_port}", "--ssh-timeout", "1", "--only", "ssh")
    assert code == 1 and "accepted the connection but never answered" in "\n".join(out)
    assert seconds < 5, f"--ssh-timeout 1 took {seconds:.1f} s (the default is 10)"


def test_ssh_timeout_on_the_command_line_wins_over_the_file(mute_port: int, tmp_path: Path) -> None:
    inventory = tmp_path / "hosts.toml"
    inventory.write_text(f'[cluster]\nssh_timeout = 30\n\n[[hosts]]\nname = "n"\naddress = "127.0.0.1"\n'
                         f"ssh_port = {mute_port}\n")
    seconds, code, _ = timed("-i", str(inventory), "check", "--ssh-timeout", "1", "--only", "ssh")
    assert code == 1 and seconds < 5, f"--ssh-timeout 1 over the file's 30 took {seconds:.1f} s"


def test_override_carries_the_timeout_to_the_connector() -> None:
    from torchherd import Cluster
    from torchherd.transport.ssh import SshConnector

    cluster = Cluster(hosts=["192.0.2.1"], ssh_timeout=30).override(ssh_timeout=1.5)
    assert isinstance(cluster.connector, SshConnector) and cluster.connector.timeout == 1.5


@pytest.mark.parametrize("words,flag", [(["--dry-run"], "--dry-run"), (["--lr", "3", "--detach"], "--detach"),
                                        (["--json"], "--json"), (["-H", "b"], "-H"), (["--sync=."], "--sync")])
def test_a_run_flag_after_the_script_is_refused_without_a_separator(words: list[str], flag: str) -> None:
    assert cli("run", "-H", "192.0.2.1", "train.py", *words) == (2, [
        f"error: {flag} after train.py would go to train.py",
        "  hint: put it before the script, or write -- before the script to pass it on"])


@pytest.mark.parametrize("words,script", [
    (["--", "train.py", "--dry-run"], ["train.py", "--dry-run"]),
    (["train.py", "-h", "-i", "x", "-m", "y"], ["train.py", "-h", "-i", "x", "-m", "y"]),
    (["train.py", "--", "--dry-run"], ["train.py", "--", "--dry-run"]),
    (["train.py", "--dry-runs"], ["train.py", "--dry-runs"])])
def test_the_script_keeps_its_own_flags(words: list[str], script: list[str]) -> None:
    from torchherd.cli.dispatch import _parse

    assert _parse(["run", "-H", "192.0.2.1", *words], None).script == script


def test_a_nodeset_of_a_million_hosts_is_refused_at_once() -> None:
    import torchherd.api  # noqa: F401  (its import is not the refusal's time)

    start = time.monotonic()
    assert cli("run", "-H", "gpu[01-1000000]", "--dry-run", "--", "train.py") == (2, [
        "error: -H 'gpu[01-1000000]': 1,000,000 hosts, more than 10,000 (a typo in a range?)",
        "  hint: check the range; for a cluster that big, set TORCHHERD_MAX_HOSTS=1000000"])
    assert time.monotonic() - start < 0.5


def test_the_host_count_is_of_all_items_and_can_be_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchherd.inventory.hostspec import host_entries

    code, out = cli("hosts", "-H", "a[1-6000],b[1-6000]")
    assert (code, out[0]) == (2, "error: -H 'b[1-6000]': 12,000 hosts, more than 10,000 (a typo in a range?)")
    monkeypatch.setenv("TORCHHERD_MAX_HOSTS", "12000")
    assert len(host_entries("a[1-6000],b[1-6000]")) == 2


def test_a_process_count_given_anywhere_is_known_as_given() -> None:
    from torchherd import Cluster

    assert [cluster.inventory.cluster.nproc_per_node_set for cluster in (
        Cluster(hosts=["a"]), Cluster(hosts=["a"], nproc_per_node=1), Cluster.from_hosts("a", nproc_per_node=1),
        Cluster(hosts=["a"]).override(nproc_per_node=1))] == [False, True, True, True]


@pytest.mark.parametrize("command,flag", [("hosts", "--pull"), ("hosts", "--ssh-timeout"),
                                          ("hosts", "--image-archive"), ("check", "--pull")])
def test_a_flag_the_command_does_not_use_is_refused(command: str, flag: str) -> None:
    assert cli(command, "-H", "192.0.2.1", f"{flag}=x") == (2, [
        f"error: torchherd {command}: unrecognized arguments: {flag}=x",
        f"  hint: torchherd {command} --help lists the options"])


def test_check_says_what_it_may_change(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert ("check preflight checks only; changes nothing (--sync and --uv do: the project, its venvs) "
            "run") in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("item,address", [("fe80::1", "fe80::1"), ("fe80::1%eth0", "fe80::1%eth0"), ("::", "::"),
                                          ("[fe80::1]", "fe80::1"), ("root@[fe80::1]:22", "fe80::1"),
                                          ("2001:db8::2", "2001:db8::2")])
def test_an_ipv6_address_in_h_gets_one_message(item: str, address: str) -> None:
    assert cli("hosts", "-H", item) == (2, [
        f"error: -H {item!r}: -H does not take IPv6 addresses",
        f'  hint: name the host in an inventory: name = "node3", address = "{address}"'])


@pytest.mark.parametrize("item,name,address", [("[1-2]", "1", "0.0.0.1"), ("2", "2", "0.0.0.2"),
                                               ("root@167772161", "167772161", "10.0.0.1")])
def test_an_all_digit_host_name_is_refused(item: str, name: str, address: str) -> None:
    assert cli("hosts", "-H", item) == (2, [
        f"error: -H {item!r}: {name!r} is all digits, an address ({address}) to ssh, not a name",
        "  hint: name hosts with a letter in them: node1, gpu[01-04]"])


def test_one_address_at_two_ports_names_the_master_by_its_address() -> None:
    code, out = cli("run", "-H", "127.0.0.1:2222,127.0.0.1:2223", "--dry-run", "--no-check", "--", "x.py")
    assert code == 0 and "master 127.0.0.1-2222 at 127.0.0.1:29500" in out[0]


def test_init_names_a_master_not_among_the_hosts_by_its_flag(tmp_path: Path) -> None:
    path = tmp_path / "m.toml"
    assert cli("-i", str(path), "init", "-H", "a1,b1", "--master", "c1") == (2, [
        "error: --master c1: not one of the hosts given with -H (a1, b1)", "  hint: the hosts are a1, b1"])
    assert not path.exists()


def test_a_misplaced_master_in_a_file_says_hosts_not_keys(tmp_path: Path) -> None:
    path = tmp_path / "m.toml"
    path.write_text('[cluster]\nmaster = "zz"\n[[hosts]]\nname = "a1"\n[[hosts]]\nname = "b1"\n')
    assert cli("-i", str(path), "hosts") == (2, [f"error: {path}: [cluster].master: 'zz' is not one of the hosts "
                                                 "(a1, b1)", "  hint: known hosts: a1, b1"])


@pytest.mark.parametrize("text,where", [('[[hosts]]\nname = "a"\nssh_timeout = 3\n', "hosts[0]."),
                                        ('[defaults]\nssh_timeout = 3\n[[hosts]]\nname = "a"\n', "[defaults].")])
def test_a_cluster_key_in_a_host_table_says_where_it_belongs(tmp_path: Path, text: str, where: str) -> None:
    path = tmp_path / "t.toml"
    path.write_text(text)
    assert cli("-i", str(path), "hosts") == (2, [
        f"error: {path}: {where}ssh_timeout: not a key of this table",
        "  hint: ssh_timeout belongs in [cluster]: one value for every host"])


@pytest.mark.parametrize("hosts,port,line", [
    ("node0", "22", "error: --master-port 22: 22 is SSH's port"),
    ("127.0.0.1:2222,127.0.0.1:2223", "2223", "error: --master-port 2223: 2223 is the SSH port of 127.0.0.1-2223, at "
                                              "the master's address")])
def test_a_master_port_sshd_uses_is_refused(hosts: str, port: str, line: str) -> None:
    assert cli("run", "-H", hosts, "--master-port", port, "--dry-run", "--no-check", "--", "x.py") == (2, [
        line, "  hint: choose a free port for the rendezvous (torchrun's default is 29500)"])


def test_a_master_port_of_another_machine_s_sshd_is_fine() -> None:
    assert cli("run", "-H", "a:2222,b:2223", "--master-port", "2223", "--dry-run", "--no-check", "--", "x.py")[0] == 0


def test_the_file_s_port_is_refused_as_the_flag_is(tmp_path: Path) -> None:
    path = tmp_path / "h.toml"
    path.write_text('[cluster]\nport = 22\n[[hosts]]\nname = "a"\n')
    assert cli("-i", str(path), "hosts") == (2, [f"error: {path}: [cluster].port: 22 is SSH's port",
                                                 "  hint: choose a free port for the rendezvous (torchrun's default "
                                                 "is 29500)"])


@pytest.mark.parametrize("image,fixed", [("UPPER/Case:tag", "upper/case:tag"), ("localhost/Foo", "localhost/foo")])
def test_an_upper_case_repository_is_refused(image: str, fixed: str) -> None:
    from torchherd.remote.container import image_problem

    assert image_problem(image) == (f"{image!r}: docker and podman take only lower case in a repository name "
                                    f"({image.split(':')[0].split('localhost/')[-1]!r}); write {fixed!r}")


@pytest.mark.parametrize("image", ["nvcr.io/nvidia/pytorch:24.05-py3", "Registry.IO:5000/a/b:TAG", "ubuntu:Latest",
                                   "/data/My.sif", "docker://X/Y", "pytorch@sha256:abc"])
def test_a_registry_host_tag_or_file_may_have_upper_case(image: str) -> None:
    from torchherd.remote.container import image_problem

    assert image_problem(image) is None


def test_a_topic_in_the_wrong_case_gets_its_suggestion() -> None:
    assert cli("docs", "RUN")[1][0].startswith("error: torchherd docs: argument TOPIC: invalid choice 'RUN'; did you "
                                               "mean 'run'?")


@pytest.mark.parametrize("command", ["status", "logs", "report", "stop", "attach"])
def test_the_run_argument_says_a_part_of_the_id_will_do(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "--help"]) == 0
    assert "RUN run id, or a unique start or end of it (e7c180 for th-20260101-120000-e7c180)" in " ".join(
        capsys.readouterr().out.split())


def test_logs_node_says_it_is_a_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["logs", "--help"]) == 0
    assert "--node N only this node, by its name (as `torchherd status RUN` lists it)" in " ".join(
        capsys.readouterr().out.split())


def every_flag() -> list[tuple[str, str]]:
    import argparse

    from torchherd.cli.parser import build_parser

    commands = next(action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction))
    return [(name, flag) for name, command in commands._name_parser_map.items()
            for flag in command._option_string_actions if flag not in ("-h", "--help")]


def test_docs_cli_lists_every_flag_of_every_help() -> None:
    import re

    text = (Path(__file__).parents[2] / "docs" / "cli.md").read_text(encoding="utf-8")
    missing = sorted({f"{name} {flag}" for name, flag in every_flag()
                      if not re.search(re.escape(flag) + r"(?![\w-])", text)})
    assert len(every_flag()) > 100 and missing == []


@pytest.mark.parametrize("command,page", [("run", "run.md"), ("check", "checks.md")])
def test_the_synopsis_of_run_md_and_checks_md_lists_every_flag_in_the_help_s_groups(command: str, page: str) -> None:
    """Item 11: the page's synopsis (its first block) names each flag of the command's help
    (SLURM's as --slurm-KEY), in the help's groups and their order."""
    import re

    text = (Path(__file__).parents[2] / "docs" / page).read_text(encoding="utf-8")
    synopsis = text.split("```\n", 2)[1]
    assert synopsis.startswith(f"torchherd {command} [options]")
    missing = [flag for name, flag in every_flag() if name == command and not flag.startswith("--slurm-")
               and not re.search(re.escape(flag) + r"(?![\w-])", synopsis)]
    assert missing == [] and "--slurm-KEY" in synopsis
    titles = [line.split(":")[0] for line in synopsis.splitlines()[2:] if re.match(r"[A-Za-z]", line)]
    assert titles == {"run": ["hosts", "the job", "torchrun's", "checks", "output", "recovery",
                              "containers and environments", "SLURM"],
                      "check": ["hosts", "the job", "checks", "output", "containers and environments", "SLURM"]}[command]


@pytest.mark.parametrize("flag,words", [("--pull", "missing always never"),
                                        ("--container-runtime", "auto podman docker apptainer enroot"),
                                        ("--nproc-per-node", "gpu cpu auto"), ("--only", "ssh ping hostname port"),
                                        ("--skip", "ssh ping hostname port")])
def test_completion_completes_the_values_of_checked_flags(flag: str, words: str, capsys: pytest.CaptureFixture[str]) \
        -> None:
    assert main(["completion", "bash"]) == 0
    assert f'        {flag}) COMPREPLY=($(compgen -W "{words}' in capsys.readouterr().out


def test_a_folded_failure_of_plain_names_reads_as_several_hosts() -> None:
    from torchherd.checks.results import CheckResult
    from torchherd.console.checks import _coalesced

    results = [CheckResult(name, "ssh", "fail", f"{name}: cannot resolve {name!r}", "fix the address") for name in "ab"]
    assert [(result.node, result.summary, count) for result, count in _coalesced(results)] == [
        ("a, b", "a, b: cannot resolve 'a, b'", 2)]


def test_an_unresolvable_host_s_fix_names_h_too() -> None:
    import socket

    from torchherd.transport.sshfailures import explain
    from torchherd.transport.sshtarget import SshTarget

    target = SshTarget(node="a", hostname="a", port=22, user="me", key_files=(), known_hosts=(), proxy_jump=None,
                       proxy_command=None, identities_only=False)
    error = explain(target, socket.gaierror(-2, "Name or service not known"))
    assert getattr(error, "hint", None) == (
        "fix the address (in -H or the inventory) or ~/.ssh/config, or the controller's DNS")


def test_a_page_on_a_terminal_names_other_pages_as_commands() -> None:
    from rich.console import Console

    from torchherd.console.manual import render_page

    out = StringIO()
    render_page(Console(file=out, force_terminal=True, width=80, color_system=None),
                "See docs/cli.md and docs/nosuch.md.\n", ("cli",))
    assert "See torchherd docs cli and docs/nosuch.md." in out.getvalue()


def test_a_page_on_a_terminal_goes_through_the_pager(monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.console import Console

    from torchherd.console.manual import render_page

    paged: list[str] = []
    monkeypatch.setattr("pydoc.pager", lambda text, *rest: paged.append(text))
    monkeypatch.delenv("LESS", raising=False)
    out = StringIO()
    render_page(Console(file=out, force_terminal=True, width=80, color_system=None), "# Title\n", page=True)
    import os

    assert out.getvalue() == "" and "Title" in paged[0] and os.environ["LESS"] == "FRX"


@pytest.mark.parametrize("path,fix", [
    ("-H", "fix the address given to -H or ~/.ssh/config, or the controller's DNS"),
    ("--nodelist", "fix the address given to --nodelist or ~/.ssh/config, or the controller's DNS"),
    ("cluster/hosts.toml", "fix the address in cluster/hosts.toml or ~/.ssh/config, or the controller's DNS")])
def test_an_unresolvable_address_s_fix_names_where_the_hosts_were_given(path: str, fix: str) -> None:
    """Item 17: "the inventory" only when there is one; -H's hosts are fixed in -H."""
    import socket
    from types import SimpleNamespace

    from torchherd.checks.analysis.ssh import analyse
    from torchherd.transport.sshfailures import explain
    from torchherd.transport.sshtarget import SshTarget

    target = SshTarget(node="a", hostname="a.invalid", port=22, user="me", key_files=(), known_hosts=(),
                       proxy_jump=None, proxy_command=None, identities_only=False)
    error = explain(target, socket.gaierror(socket.EAI_NONAME, "Name or service not known"))
    host = SimpleNamespace(name="a", address="a.invalid", transport="ssh")
    observed = SimpleNamespace(inventory=SimpleNamespace(path=Path(path), hosts=[host]), ssh_errors={"a": error})
    [result] = analyse(observed)  # type: ignore[arg-type]
    assert (result.summary, result.fix) == ("a: cannot resolve 'a.invalid' (Name or service not known)", fix)


def test_folded_failures_keep_each_host_s_reason_where_they_differ() -> None:
    from torchherd.checks.results import CheckResult
    from torchherd.console.checks import _coalesced

    results = [CheckResult("a", "ssh", "fail", "a: cannot resolve 'a' (Name or service not known)", "fix"),
               CheckResult("b", "ssh", "fail", "b: cannot resolve 'b' (Temporary failure in name resolution)", "fix"),
               CheckResult("c", "ssh", "fail", "c: cannot resolve 'c' (Name or service not known)", "fix")]
    assert [(result.node, result.summary, count) for result, count in _coalesced(results)] == [
        ("a, c", "a, c: cannot resolve 'a, c' (Name or service not known)", 2),
        ("b", "b: cannot resolve 'b' (Temporary failure in name resolution)", 1)]


def test_an_internal_error_says_where_to_report_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 29: "report the traceback" names the page that says what to send and where."""
    from torchherd import manual

    def broken(args: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr("torchherd.cli.hosts.cluster_of", broken)
    assert cli("hosts", "-H", "a") == (1, [
        "error: internal error: RuntimeError: boom",
        "  hint: rerun with TORCHHERD_DEBUG=1 and report the traceback (what to send, and where: torchherd docs "
        "contributing)"])
    assert "## Reporting a bug" in manual.read("contributing")


def test_run_sync_refuses_a_script_the_synced_project_lacks_before_sending(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 23: the job runs from the project's root on every node; said here, before the sync."""
    (tmp_path / "proj" / "sub").mkdir(parents=True)
    (tmp_path / "proj" / "sub" / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    project = tmp_path.resolve() / "proj"
    assert cli("run", "-H", "a", "--sync", "proj", "--dry-run", "--", "nosuch.py") == (2, [
        f"error: nosuch.py: not in the synced project {project}",
        f"  hint: the job runs from the project's root on every node: name the script relative to {project}"])
    assert cli("run", "-H", "a", "--sync", "proj", "--dry-run", "--", "proj/sub/train.py") == (2, [
        f"error: proj/sub/train.py: not in the synced project {project}",
        "  hint: the job runs from the project's root on every node: name it sub/train.py"])
    code, out = cli("run", "-H", "a", "--sync", "proj", "--dry-run", "--", "sub/train.py")
    assert any(line.endswith(" -- sub/train.py") for line in out), out  # planned (node a then cannot be asked)


def test_a_dry_run_sync_says_why_it_exits_1_when_a_node_cannot_answer(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 22: --dry-run --sync asks the nodes; an unreachable one is said as such, and why exit 1."""
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    code, out = cli("run", "-H", "127.0.0.1:1,127.0.0.1:2", "--ssh-timeout", "2", "--sync", "proj", "--dry-run", "--",
                    "train.py")
    assert code == 1 and [line.split(":")[0] for line in out[-3:-1]] == ["sync to 127.0.0.1-1", "sync to 127.0.0.1-2"]
    assert out[-1] == "2 nodes could not be asked what they lack: the run would stop there (exit 1; the dry run " \
                      "changed nothing)", out


def test_run_help_says_a_dry_run_sync_asks_the_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--help"]) == 0
    assert ("--dry-run print each node's command; start nothing; with --sync also ask every node what it lacks, "
            "changing nothing (exit 1 when a node cannot answer: the run would stop there; default: off)") in " ".join(
        capsys.readouterr().out.split())


@pytest.mark.parametrize("runtime,said,shown", [
    (None, "(runtime auto: each node uses the first of podman, docker, apptainer, enroot it has; the command shows "
           "podman's)", "podman run"),
    ("docker", "(runtime docker)", "docker run")])
def test_a_dry_run_says_the_runtime_auto_picks_is_each_node_s(runtime: str | None, said: str, shown: str) -> None:
    """Item 26: with runtime auto the podman line is one node's possibility, said as such."""
    flags = ["--container-runtime", runtime] if runtime else []
    code, out = cli("run", "-H", "a", "--image", "pytorch/pytorch:2.5", *flags, "--dry-run", "--", "train.py")
    assert code == 0, out
    assert any(f" {shown} " in line for line in out if line.startswith("  $ ")), out
    assert [line for line in out if "in container" in line][0].startswith(
        f"  - in container torchherd-{out[0].split()[1].rstrip(':')}-a of image pytorch/pytorch:2.5 {said}; "), out


def test_a_peer_that_closes_before_ssh_starts_is_not_only_blamed_on_maxstartups() -> None:
    """Item 16: 5 drops before the banner may be something else than sshd on the port."""
    from torchherd.transport.sshfailures import ATTEMPTS, explain
    from torchherd.transport.sshtarget import SshTarget

    target = SshTarget(node="a", hostname="10.0.0.1", port=2222, user="me", key_files=(), known_hosts=(),
                       proxy_jump=None, proxy_command=None, identities_only=False)
    error = explain(target, EOFError())
    assert str(error).startswith(f"a: me@10.0.0.1:2222 dropped the connection before login, {ATTEMPTS} times")
    assert error.hint == ("sshd's MaxStartups may be turning connections away: too many at once to one host (a "  # type: ignore[attr-defined]
                          "bastion?), or it is overloaded; or something on port 2222 closes the connection before "
                          "SSH starts (not sshd? a proxy or load balancer?)")
