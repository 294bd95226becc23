"""The commented ``hosts.toml`` that ``torchherd init`` writes, and the FILL IN markers it
leaves for the user (``unfilled`` finds those still there)."""

from __future__ import annotations

import fnmatch
import time
from typing import Sequence

from torchherd.inventory.hostspec import HostEntry
from torchherd.inventory.nodeset import expand


def ssh_config_aliases(text: str, pattern: str) -> list[str]:
    """The ``Host`` aliases of an OpenSSH config matching the glob ``pattern`` (wildcard
    entries such as ``Host *`` stand for no host and are left out)."""
    aliases: list[str] = []
    for raw in text.splitlines():
        words = raw.split("#", 1)[0].replace("=", " ").split()
        if len(words) < 2 or words[0].lower() != "host":
            continue
        for alias in words[1:]:
            plain = not any(char in alias for char in "*?!")
            if plain and fnmatch.fnmatchcase(alias, pattern) and alias not in aliases:
                aliases.append(alias)
    return aliases


FILL = "FILL IN"


def unfilled(text: str) -> list[tuple[int, str]]:
    """The lines of an inventory that still carry init's FILL IN marker after a value: (line
    number, key). A key with a marker holds init's guess, not the user's answer."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        assignment, _, comment = line.partition("#")
        if "=" in assignment and comment.strip().startswith(FILL):
            found.append((number, assignment.split("=", 1)[0].strip()))
    return found


def inventory_text(entries: Sequence[HostEntry], *, python: str | None = None, workdir: str | None = None,
                   nproc_per_node: int | str | None = None, master: str | None = None, source: str = "",
                   ssh_config: str | None = None, then: str = "torchherd hosts; torchherd check -- train.py") -> str:
    """A commented ``hosts.toml``: one ``[[hosts]]`` table per entry (a nodeset stays one
    table); what the user gave is filled in, the rest is marked FILL IN. ``ssh_config``: the
    OpenSSH config the hosts' aliases come from, where it is not ~/.ssh/config; ``then``:
    the commands to run next, as this file must be named in them."""
    def line(key: str, given: object, default: object, comment: str) -> str:
        assignment = f"{key} = {_toml(default if given is None else given)}"
        return _commented(assignment, f"{FILL + ': ' if given is None else ''}{comment}")

    first = expand(entries[0].name)[0] if entries else "node0"
    lines = [
        f"# torchherd inventory, written by `torchherd init`{source} on {time.strftime('%Y-%m-%d')}.",
        f"# Fill in what is marked {FILL}, then: {then}",
        "# Every key is explained in the example `torchherd init --example -i example.toml` writes.",
        "",
        "[cluster]",
        _commented("master = " + _toml(master or first), "node_rank 0 (the first host unless you change it)"),
        _commented("port = 29500", "the master port: every worker must reach it on the master"),
        line("nproc_per_node", nproc_per_node, 1, 'processes per node (its GPUs), or "gpu"; a [[hosts]] table '
             "may set its own"),
        *([_commented("ssh_config = " + _toml(ssh_config), "the OpenSSH config the hosts' aliases come from")]
          if ssh_config else []),
        "",
        "[defaults]",
        line("python", python, "python3", 'the interpreter on the nodes that has torch, e.g. "/opt/venv/bin/python"'),
        line("workdir", workdir, "~", "where the job runs on each node (`torchherd run --sync` sends your project "
             "there)"),
    ]
    for entry in entries or [HostEntry("node0"), HostEntry("node1")]:
        names = expand(entry.name)
        about = f"{len(names)} hosts: {names[0]} ... {names[-1]}" if len(names) > 1 else "how logs and reports call it"
        lines += ["", "[[hosts]]", _commented("name = " + _toml(entry.name), about)]
        if not entries:
            lines[-1] = _commented("name = " + _toml(entry.name), f"{FILL}: the host's name (or a nodeset: gpu[01-16])")
        if entry.address is not None:
            lines.append(f"address = {_toml(entry.address)}")
        if entry.user:
            lines.append(f"user = {_toml(entry.user)}")
        if entry.ssh_port is not None:
            lines.append(f"ssh_port = {entry.ssh_port}")
    return "\n".join(lines) + "\n"


COMMENT_COLUMN = 28


def _commented(assignment: str, comment: str) -> str:
    """``key = value`` and its comment at COMMENT_COLUMN, or two spaces after a longer
    value (TOML style; the comment never touches the value)."""
    return f"{assignment.ljust(COMMENT_COLUMN - 2)}  # {comment}"


def _toml(value: object) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)
