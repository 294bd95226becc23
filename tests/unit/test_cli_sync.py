"""--sync's refusals on the command line, exact text: the script taken as --sync's DIR, a
home directory or a large directory outside git, --sync-include without --sync. Exit 2,
one line and a hint, before any node is contacted."""

from __future__ import annotations

from io import StringIO
from pathlib import Path

import pytest

from torchherd.api import Cluster
from torchherd.cli import main
from torchherd.console import make_console
from torchherd.errors import UsageError

# 192.0.2.0/24 is TEST-NET-1: nothing answers there, so touching a node would hang.
HOSTS = ["-H", "192.0.2.1,192.0.2.2", "--python", "/usr/bin/python3", "--workdir", "/w"]
ANYWAY = ("  hint: to send it on purpose add --sync-anyway; else name the project: --sync DIR "
          "(a git repository's .gitignore is honoured)")


def cli(*args: str) -> tuple[int, list[str]]:
    out = StringIO()
    code = main(list(args), console=make_console(out, width=400))
    return code, out.getvalue().splitlines()


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "proj"
    root.mkdir()
    (root / "train.py").write_text("print(1)\n")
    monkeypatch.chdir(root)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return root


@pytest.mark.parametrize("args", [
    ["run", *HOSTS, "--sync", "train.py", "--lr", "3e-4"],
    ["run", *HOSTS, "--sync", "train.py"],
    ["check", *HOSTS, "--sync", "train.py"],
    ["run", *HOSTS, "--sync", "missing.py", "--lr", "3e-4"],
])
def test_the_script_taken_as_the_sync_dir_is_named(project: Path, args: list[str]) -> None:
    script = args[args.index("--sync") + 1]
    assert cli(*args) == (2, [
        f"error: --sync took '{script}' as its DIR; write `--sync -- {script}`",
        "  hint: --sync takes an optional DIR: --sync DIR -- SCRIPT [ARGS...] names the project, "
        "--sync -- SCRIPT [ARGS...] syncs the enclosing git repository"])


def test_an_unknown_flag_without_sync_is_still_argparse_s_message(project: Path) -> None:
    assert cli("run", *HOSTS, "--lr", "3e-4", "--", "train.py") == (2, [
        "error: torchherd run: unrecognized arguments: --lr", "  hint: torchherd run --help lists the options"])


def test_a_missing_sync_dir_before_the_script_is_not_a_directory(project: Path) -> None:
    assert cli("run", *HOSTS, "--dry-run", "--sync", "nodir", "--", "train.py") == (2, [
        "error: --sync nodir: not a directory",
        "  hint: write --sync DIR -- train.py, or --sync -- train.py for the enclosing git repository"])


@pytest.mark.parametrize("flag", [["--sync-include", ".env"], ["--sync-anyway"]])
def test_sync_choices_without_sync_are_refused(project: Path, flag: list[str]) -> None:
    assert cli("run", *HOSTS, "--dry-run", *flag, "--", "train.py") == (2, [
        f"error: {flag[0]} without --sync: nothing is synced", "  hint: add --sync [DIR]"])


def test_the_home_directory_is_refused_saying_what_it_would_send(project: Path, monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    home = project.parent / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("never counted, never sent")
    (home / "notes.txt").write_text("123456789")
    monkeypatch.chdir(home)
    assert cli("run", *HOSTS, "--dry-run", "--sync", "--", "train.py") == (2, [
        f"error: --sync: {home} is your home directory; it would send 1 file (9 B) to every node", ANYWAY])
    plan = Cluster.from_hosts("192.0.2.1", python="/p", workdir="/w").plan("train.py", sync=True, sync_anyway=True)
    assert plan.sync is not None and plan.sync.source == str(home)


def test_a_large_directory_outside_git_is_refused_unless_on_purpose(project: Path) -> None:
    big = project / "data"
    big.mkdir()
    for index in range(5001):
        (big / f"{index}.txt").write_bytes(b"")
    assert cli("run", *HOSTS, "--dry-run", "--sync", str(big), "--", "train.py") == (2, [
        f"error: --sync: {big} is not in a git repository and would send 5,001 files (0 B) to every node", ANYWAY])
    cluster = Cluster.from_hosts("192.0.2.1", python="/p", workdir="/w")
    with pytest.raises(UsageError):
        cluster.plan("train.py", sync=big)
    (big / ".git").mkdir()
    assert cluster.plan("train.py", sync=big).sync is not None


def test_include_patterns_add_to_the_inventory_s(project: Path) -> None:
    inventory = project / "hosts.toml"
    inventory.write_text('[sync]\ninclude = [".env"]\n[[hosts]]\nname = "a"\naddress = "192.0.2.1"\n')
    plan = Cluster.from_file(inventory).plan("train.py", sync=str(project), sync_include=["*.pem"])
    assert plan.sync is not None and plan.sync.include == (".env", "*.pem")
    inventory.write_text('[sync]\ninclude = ".env"\n[[hosts]]\nname = "a"\n')
    assert cli("-i", str(inventory), "hosts") == (2, [
        f"error: {inventory}: [sync].include: expected a list of patterns, got a string '.env'",
        '  hint: write include = [".env"]'])
