"""The rules a value of the inventory must keep, whichever door it came through (the
TOML reader, a flag, an API argument): the limits, the patterns, and the functions that
say what is wrong with a value (``*_problem``) or parse it (``parse_*``)."""

from __future__ import annotations

import re
from typing import Any

from torchherd.inventory.model import DEFAULT_REPLICATE_BANDWIDTH, Bandwidth, Recovery

NPROC_WORDS = ("gpu", "cpu", "auto")
RDZV_BACKENDS = ("static", "c10d")
HOST_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")  # \Z: "$" takes a final newline
ADDRESS_PATTERN = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9._-]{0,252}|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*)\Z")  # \Z: "$" takes a final newline
"""A host name, an IPv4 or IPv6 address, or an ssh_config alias: nothing a shell would
read as more (an address reaches ssh_config's `Match exec` and `ProxyCommand` tokens)."""

MAX_NPROC = 4096
"""More processes than any node runs: a larger count is a typo (or 10**18)."""
MAX_SECONDS = 3600.0
MAX_INVENTORY_BYTES = 16 << 20
"""Far above 50,000 hosts (3 MB); a larger "inventory" (``-i /dev/zero``) is refused."""
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
"""Never in a one-line value (a name, a path, a user): a newline or NUL there splits or
cuts what the shell, ssh or the terminal sees."""
SHELL_USER_CHARS = frozenset("'`\";&<>|(){}")
SHELL_HOST_CHARS = frozenset("'`\"$\\;&<>|(){},")
C_SPACE = frozenset(" \t\n\v\f\r")


def valid_ruser(user: str) -> bool:
    """OpenSSH's ``ssh_valid_ruser`` (readconf.c): a user name that ssh_config's ``%r`` can
    put into a ``Match exec`` or ``ProxyCommand`` shell line without the shell acting on
    it (CVE-2023-51385). Not empty, no leading '-', no control character, none of
    ``'`";&<>|(){}``, no '-' after a space, no '\\' at the end."""
    if not user or user.startswith("-"):
        return False
    for index, char in enumerate(user):
        following = user[index + 1:index + 2]
        if CONTROL.match(char) or char in SHELL_USER_CHARS:
            return False
        if (char in C_SPACE and following == "-") or (char == "\\" and not following):
            return False
    return True


def valid_hostname(host: str) -> bool:
    """OpenSSH's ``ssh_valid_hostname`` (readconf.c), for ``%h``: not empty, no leading '-',
    no space or control character, none of ``'`"$\\;&<>|(){},``."""
    if not host or host.startswith("-"):
        return False
    return not any(CONTROL.match(char) or char in C_SPACE or char in SHELL_HOST_CHARS for char in host)


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
LOCAL_ADDR = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,252}\Z|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*\Z")

USER_HINT = "a user name is letters, digits, '.', '_' and '-' (OpenSSH refuses the others too)"

HEARTBEAT_RANGE = (0.1, 5.0)
"""Seconds between heartbeats: below 0.1 s the beats cost more than they tell; above 5 s a lost
node goes unnoticed for half a minute or more."""
MISSES_RANGE = (2, 60)
"""Heartbeats missed in a row before a node whose link does not answer is lost: one late beat
is never a loss."""
MIN_LOST_AFTER = 1.0
"""``heartbeat`` x ``heartbeat_misses`` at least: a shorter silence is a busy scheduler, not a lost node."""
MAX_REPLICAS = 64
"""More copies of a checkpoint than any run keeps: a larger count is a typo."""
MAX_RETRIES = 1000
"""More attempts than any run makes: a larger count is a typo."""
RATE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT]?)(?:bit|b)?(?:/s|ps)?\s*\Z")
RATE_UNITS = {"": 1e9, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
"""A rate without a unit is in Gbit/s."""

HEARTBEAT_HINT = "heartbeat = 0.5 with heartbeat_misses = 5 (the default) notices a lost node in 2.5 s"


def heartbeat_problem(recovery: Recovery) -> str | None:
    """Why ``recovery``'s heartbeat settings cannot be used, or None (the inventory's reader
    and ``Cluster.launch(recovery=...)`` both ask)."""
    low, high = HEARTBEAT_RANGE
    if not low <= recovery.heartbeat <= high:
        return f"heartbeat is {recovery.heartbeat:g} s; expected seconds between heartbeats, from {low:g} to {high:g}"
    low_misses, high_misses = MISSES_RANGE
    if not low_misses <= recovery.heartbeat_misses <= high_misses:
        return f"heartbeat_misses is {recovery.heartbeat_misses}; expected an integer from {low_misses} to {high_misses}"
    if recovery.lost_after < MIN_LOST_AFTER:
        return (f"heartbeat x heartbeat_misses is {recovery.lost_after:g} s: a node would be lost after less than "
                f"{MIN_LOST_AFTER:g} s of silence, which a busy node can take")
    return None


BANDWIDTH = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(%|[kKMGT]?B/s|[kKMGT]?bit/s)\s*\Z")
BANDWIDTH_HINT = ('give "auto" (the default), a share of the link such as "25%", or a rate such as "200MB/s" '
                  'or "800Mbit/s"')



def parse_bandwidth(text: str) -> Bandwidth | None:
    """"auto" (the default), "25%", "200MB/s", "1.5GB/s", "800Mbit/s"; None when it is none
    of these (or 0, or over 100%)."""
    if text.strip() == "auto":
        return DEFAULT_REPLICATE_BANDWIDTH
    match = BANDWIDTH.match(text)
    if match is None or float(match.group(1)) <= 0:
        return None
    number, unit = float(match.group(1)), match.group(2)
    if unit == "%":
        return Bandwidth(share=number / 100) if number <= 100 else None
    scale = RATE_UNITS[unit[0].lower()] if unit[0] in "kKMGT" else 1.0
    return Bandwidth(bytes_per_second=number * scale / (8 if "bit" in unit else 1))


CHECKPOINT_HINT = "give a path inside the job's workdir, relative to it (e.g. snapshot.pt or checkpoints/step-*.pt)"


def checkpoint_problem(path: str) -> str | None:
    """Why ``path`` cannot name a checkpoint (relative to the workdir, staying inside it:
    staging writes it on every node, and nothing outside the workdir is ever written), or None."""
    if not path.strip():
        return "an empty path"
    if CONTROL.search(path):
        return f"{path!r} holds a control character"
    if path.startswith(("/", "~")):
        return f"{path!r} is absolute: a checkpoint is staged inside the workdir only"
    parts = path.split("/")
    if ".." in parts:
        return f"{path!r} leaves the workdir ('..'): a checkpoint is staged inside the workdir only"
    if all(part in ("", ".") for part in parts):
        return f"{path!r} is the workdir itself"
    return None


def parse_rate(text: str) -> float | None:
    """Bits per second from "10Gbit", "100 Mbit/s", "25G" or "40" (Gbit/s); None when it is none of these."""
    match = RATE.match(text)
    if match is None or float(match.group(1)) <= 0:
        return None
    return float(match.group(1)) * RATE_UNITS[match.group(2).lower()]


def show(value: Any) -> str:
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(value), type(value).__name__)
    shown = repr(value) if not isinstance(value, (dict, list)) else ""
    return f"{kind} {shown}".strip()

