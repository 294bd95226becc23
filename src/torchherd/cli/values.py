"""The command line's value converters: text in, a value out, or one line saying what was
expected (argparse puts the flag in front; those called directly name it themselves)."""

from __future__ import annotations

import argparse
import difflib
import os
from typing import TYPE_CHECKING, Callable, Sequence

from torchherd.errors import UsageError
from torchherd.inventory.options import (
    FINAL_EXIT_CODES,
    GRACE,
    HANG_TIMEOUT,
    MAX_RESTARTS,
    MAX_RESTARTS_OPTION,
    MIN_NODES,
    MONITOR_INTERVAL,
    NPROC_PER_NODE,
    REPLICATE,
    RESUME_ARGS,
    RETRIES,
    SSH_TIMEOUT,
    STRAGGLER_WINDOW,
    Integer,
    Option,
    env_problem,
)

if TYPE_CHECKING:
    from torchherd.inventory import Bandwidth


def id_list(text: str | None, flag: str, known: Sequence[str]) -> frozenset[str] | None:
    """The check ids of --only or --skip; one it does not know is exit 2 naming the flag."""
    if text is None:
        return None
    ids = frozenset(item.strip() for item in text.split(",") if item.strip())
    unknown = sorted(ids - set(known))
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1, cutoff=0.6)
        raise UsageError(f"{flag} {text}: unknown check id {', '.join(map(repr, unknown))}"
                         + (f"; did you mean {close[0]!r}?" if close else ""), f"known ids: {', '.join(known)}")
    return ids


def extra_env(assignments: Sequence[str], passed: Sequence[str],
               parse: Callable[[Sequence[str]], dict[str, str]]) -> dict[str, str]:
    env = {}
    for name in passed:
        problem = env_problem(name)
        if problem is not None:
            raise UsageError(f"--env-pass {name!r}: {problem}")
        if name not in os.environ:
            raise UsageError(f"--env-pass {name}: not set in this shell", f"export {name}=... first, or use --env")
        env[name] = os.environ[name]
    env.update(parse(assignments))
    return env


def nproc_count(text: str | None) -> int | str | None:
    """--nproc-per-node (read where the hosts are, not by argparse: its error names the flag itself)."""
    if text is None:
        return None
    found = NPROC_PER_NODE.kind.value(NPROC_PER_NODE.kind.of_text(text))
    if found is None:
        raise UsageError(f"--nproc-per-node {text!r}: expected {NPROC_PER_NODE.kind.expected('flag')}")
    return found


# Each flag of an option with a rule (inventory.options) is that rule's door: argparse calls
# ``from_flag`` and puts the flag in front of what it says was expected.
grace = GRACE.from_flag
straggler_window = STRAGGLER_WINDOW.from_flag
hang_timeout = HANG_TIMEOUT.from_flag
retries = RETRIES.from_flag
exit_codes = FINAL_EXIT_CODES.from_flag
min_nodes = MIN_NODES.from_flag
replicate = REPLICATE.from_flag
resume_args = RESUME_ARGS.from_flag
monitor_interval = MONITOR_INTERVAL.from_flag
max_restarts = MAX_RESTARTS_OPTION.from_flag
count = Option("count", Integer(0, MAX_RESTARTS)).from_flag
"""A count of something else (--rank)."""
ssh_timeout = SSH_TIMEOUT.from_flag
positive = Option("positive", Integer(1)).from_flag
"""A count of something else (a scheduler table's counts: ``inventory.tables.Flag``)."""


def checkpoint(text: str) -> str:
    from torchherd.inventory import CHECKPOINT_HINT, checkpoint_problem

    problem = checkpoint_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{problem} ({CHECKPOINT_HINT})")
    return text


def bandwidth(text: str) -> Bandwidth:
    from torchherd.inventory import BANDWIDTH_HINT, parse_bandwidth

    found = parse_bandwidth(text)
    if found is None:
        raise argparse.ArgumentTypeError(f"expected a share or a rate, got {text!r} ({BANDWIDTH_HINT})")
    return found


def rate(text: str) -> float:
    from torchherd.inventory import parse_rate

    found = parse_rate(text)
    if found is None:
        raise argparse.ArgumentTypeError(f"expected a rate such as 10Gbit or 800Mbit, got {text!r}")
    return found


def nnodes(text: str) -> str:
    from torchherd.plan import check_nnodes

    try:
        return check_nnodes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def port(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port, 1 to 65535, got {text!r}")
    return int(text)
