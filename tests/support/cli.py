"""The CLI on an inventory written here: ``run_cli`` gives its exit code and output;
``assert_one_line`` holds the bad-input contract (exit 2, one line naming the key or flag)."""

from __future__ import annotations

import os
from io import StringIO
from pathlib import Path

from torchherd.cli import main
from torchherd.console import make_console


def run_cli(tmp_path: Path, inventory: str | bytes, args: list[str]) -> tuple[int, str]:
    path = tmp_path / "hosts.toml"
    if isinstance(inventory, bytes):
        path.write_bytes(inventory)
    else:
        path.write_text(inventory, encoding="utf-8")
    out = StringIO()
    code = main(["-i", str(path), *args], console=make_console(out, width=400))
    return code, out.getvalue()


def assert_one_line(code: int, output: str, named: str) -> None:
    assert code == 2, output
    assert "Traceback" not in output
    lines = output.splitlines()
    errors = [line for line in lines if not line.startswith("  hint:")]
    assert len(errors) == 1, output
    assert errors[0].startswith("error: "), output
    assert named in errors[0], output


def cli(*args: str, cwd: Path | None = None) -> tuple[int, str]:
    out = StringIO()
    previous = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        code = main(list(args), console=make_console(out, width=300))
    finally:
        os.chdir(previous)
    return code, out.getvalue()


THREE_HOSTS = "".join(f'[[hosts]]\nname = "node{index}"\naddress = "192.0.2.{index + 1}"\n' for index in range(3))
"""Three hosts in documentation addresses (TEST-NET-1): an inventory's ``[[hosts]]`` tables."""


def option_lines(tmp_path: Path, args: list[str], inventory: str = "") -> tuple[int, list[str]]:
    """The exit code and the output's lines (an error's hint too) of ``torchherd -i hosts.toml
    ARGS``, where hosts.toml is ``inventory`` then THREE_HOSTS; its path shown as hosts.toml."""
    path = tmp_path / "hosts.toml"
    path.write_text(inventory + THREE_HOSTS, encoding="utf-8")
    out = StringIO()
    code = main(["-i", str(path), *args], console=make_console(out, width=400))
    return code, [line.replace(str(path), "hosts.toml") for line in out.getvalue().splitlines()]
