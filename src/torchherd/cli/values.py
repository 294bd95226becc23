"""The command line's value converters: text in, a value out, or one line saying what was
expected (argparse puts the flag in front; those called directly name it themselves)."""

from __future__ import annotations

import argparse
import difflib
import math
import os
from typing import TYPE_CHECKING, Callable, Sequence

from torchherd.errors import UsageError

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
        if name not in os.environ:
            raise UsageError(f"--env-pass {name}: not set in this shell", f"export {name}=... first, or use --env")
        env[name] = os.environ[name]
    env.update(parse(assignments))
    return env


def nproc_count(text: str | None) -> int | str | None:
    from torchherd.inventory import MAX_NPROC

    if text is None:
        return None
    if text in ("gpu", "cpu", "auto"):
        return text
    # isascii: "²".isdigit() is True, and int("²") raises
    if text.isascii() and text.isdigit() and 0 < int(text) <= MAX_NPROC:
        return int(text)
    raise UsageError(f"--nproc-per-node {text!r}: expected a positive integer (at most {MAX_NPROC}), gpu, cpu or auto")


MAX_GRACE = 86400.0


def number(text: str) -> float:
    """The number ``text`` says, or nan, which no range holds."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def grace(text: str) -> float:
    """Seconds from SIGTERM to SIGKILL: finite, 0 or more ("nan" and "-1" parse as floats)."""
    value = number(text)
    if not 0 <= value <= MAX_GRACE:
        raise argparse.ArgumentTypeError(f"expected seconds from 0 to {MAX_GRACE:g}, got {text!r}")
    return value


def interval(text: str) -> float:
    value = number(text)
    if not 0 < value <= MAX_GRACE:
        raise argparse.ArgumentTypeError(f"expected seconds above 0, at most {MAX_GRACE:g}, got {text!r}")
    return value


def count(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) > 1_000_000:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 1000000, got {text!r}")
    return int(text)


def exit_codes(text: str) -> tuple[int, ...]:
    codes = [item.strip() for item in text.split(",")]
    if not all(code.isascii() and code.isdigit() and 1 <= int(code) <= 255 for code in codes):
        raise argparse.ArgumentTypeError(f"expected exit codes from 1 to 255, comma-separated (2,3), got {text!r}")
    return tuple(int(code) for code in codes)


def hang_timeout(text: str) -> float:
    from torchherd.inventory import MAX_SECONDS

    value = number(text)
    if not 1 <= value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"expected seconds from 1 to {MAX_SECONDS:g}, got {text!r}")
    return value


def retries(text: str) -> int:
    from torchherd.inventory import MAX_RETRIES

    if not (text.isascii() and text.isdigit()) or int(text) > MAX_RETRIES:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to {MAX_RETRIES}, got {text!r}")
    return int(text)


def checkpoint(text: str) -> str:
    from torchherd.inventory import CHECKPOINT_HINT, checkpoint_problem

    problem = checkpoint_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{problem} ({CHECKPOINT_HINT})")
    return text


def replicate(text: str) -> int:
    from torchherd.inventory import replicate_problem

    value = int(text) if text.isascii() and text.isdigit() else text
    problem = replicate_problem(value)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return int(value)


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


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)
