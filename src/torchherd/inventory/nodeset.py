"""Nodesets: ``gpu[01-16]``, ``gpu[1-3,7]``, ``a[1-2]b[1-2]``, as SLURM and pdsh write them,
and ClusterShell's step ranges (``n[1-10/2]``: every second number from 1 to 10).

Pure and standard-library only. ``expand`` turns a comma-separated list of patterns
into names, in order (``fold_names``, the way back: names into one nodeset); each bracket
group is a comma-separated list of numbers and ranges, and keeps the zero padding of its
numbers (``[08-10]`` gives ``08 09 10``).
Several groups in one pattern expand as a product, the leftmost varying slowest.
"""

from __future__ import annotations

import itertools
import re
from typing import Sequence

MAX_NAMES = 1_000_000
"""More names than any cluster has: a typo like ``[1-10000000]`` fails instead of eating memory."""

_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+)(?:/([0-9]+))?)?")
"""``7``, ``1-4``, or ``1-10/2`` (ClusterShell's step; a step needs a range, as there)."""


class NodesetError(ValueError):
    """The text is not a nodeset; the message says where and why (callers add the key)."""


def split_top(text: str) -> list[str]:
    """Splits on commas outside brackets: ``gpu[1-3,7],cpu1`` -> ``gpu[1-3,7]``, ``cpu1``."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise NodesetError(f"{text!r}: ']' without '['")
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth:
        raise NodesetError(f"{text!r}: '[' without ']'")
    parts.append("".join(current))
    return [part.strip() for part in parts]


def expand(text: str) -> list[str]:
    """Every name ``text`` stands for, in order. Raises NodesetError for empty items,
    unbalanced brackets, a range whose end is below its start, or too many names."""
    parts = split_top(text)
    count = 0
    for part in parts:  # the whole text is counted before anything expands
        if not part:
            raise NodesetError(f"{text!r}: empty item (two commas, or one at an end)")
        count += pattern_size(part, MAX_NAMES - count)
    return [name for part in parts for name in expand_pattern(part)]


def pattern_size(pattern: str, limit: int = MAX_NAMES) -> int:
    """How many names one pattern stands for, counted without making them; more than
    ``limit`` is refused (NodesetError)."""
    count = 1
    for _, group in _tokens(pattern):
        if group is not None:
            count *= _group_size(pattern, group, limit)
            if count > limit:
                raise NodesetError(f"{pattern!r}: more than {MAX_NAMES:,} names")
    return count


def expand_pattern(pattern: str) -> list[str]:
    """One pattern without top-level commas: ``a[1-2]b[1-2]`` -> a1b1 a1b2 a2b1 a2b2.
    Refused before anything is made when it stands for more than ``MAX_NAMES``."""
    pattern_size(pattern)
    pieces: list[list[str]] = []
    for literal, group in _tokens(pattern):
        if literal:
            pieces.append([literal])
        if group is not None:
            pieces.append(_group(pattern, group))
    return ["".join(combination) for combination in itertools.product(*pieces)]


def _tokens(pattern: str) -> list[tuple[str, str | None]]:
    """(literal text, the bracket group after it or None), left to right."""
    tokens: list[tuple[str, str | None]] = []
    rest = pattern
    while rest:
        opened = rest.find("[")
        if opened < 0:
            if "]" in rest:
                raise NodesetError(f"{pattern!r}: ']' without '['")
            tokens.append((rest, None))
            break
        closed = rest.find("]", opened)
        if closed < 0:
            raise NodesetError(f"{pattern!r}: '[' without ']'")
        literal = rest[:opened]
        if "]" in literal:
            raise NodesetError(f"{pattern!r}: ']' without '['")
        tokens.append((literal, rest[opened + 1:closed]))
        rest = rest[closed + 1:]
    return tokens


MAX_DIGITS = 18
"""The longest number of a range: beyond, ``int()`` of thousands of digits is slow and
then refused by Python itself (4300 digits), and no node is numbered so."""


def _items(pattern: str, group: str) -> list[tuple[str, str | None, int]]:
    """Each item of a bracket group, checked: (start, end or None, step)."""
    items: list[tuple[str, str | None, int]] = []
    for item in group.split(","):
        match = _RANGE.fullmatch(item.strip())
        if match is None:
            raise NodesetError(f"{pattern!r}: [{group}]: {item.strip()!r} is not a number or a range "
                               "like 1-4 or 1-9/2")
        low, high, step = match.group(1), match.group(2), match.group(3) or "1"
        if high is not None and max(len(low), len(high), len(step)) > MAX_DIGITS:
            raise NodesetError(f"{pattern!r}: [{group}]: the range {item.strip()} has a number of more than "
                               f"{MAX_DIGITS} digits")
        if high is not None and int(high) < int(low):
            raise NodesetError(f"{pattern!r}: [{group}]: the range {item.strip()} ends below its start")
        if int(step) < 1:
            raise NodesetError(f"{pattern!r}: [{group}]: the range {item.strip()} has a step below 1")
        items.append((low, high, int(step)))
    return items


def _group_size(pattern: str, group: str, limit: int) -> int:
    """How many values the group has, counted without making them; refused past ``limit``."""
    count = 0
    for low, high, step in _items(pattern, group):
        count += 1 if high is None else (int(high) - int(low)) // step + 1
        if count > limit:
            raise NodesetError(f"{pattern!r}: [{group}]: more than {MAX_NAMES:,} names")
    return count


def _group(pattern: str, group: str) -> list[str]:
    values: list[str] = []
    for low, high, step in _items(pattern, group):
        if high is None:
            values.append(low)
            continue
        # The start's width is the padding: [08-10] -> 08 09 10, [8-10] -> 8 9 10.
        width = len(low)
        values.extend(str(number).zfill(width) for number in range(int(low), int(high) + 1, step))
    return values


# -- folding: names back into one nodeset --------------------------------------------

_NUMBERED = re.compile(r"^(.*?)(\d+)(\D*)$")


def fold_numbers(numbers: Sequence[int], width: int = 0) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``0-3,8`` (each number padded to ``width``)."""
    ordered = sorted(set(numbers))
    parts: list[str] = []
    start = 0
    for index in range(1, len(ordered) + 1):
        if index == len(ordered) or ordered[index] != ordered[index - 1] + 1:
            low, high = str(ordered[start]).zfill(width), str(ordered[index - 1]).zfill(width)
            parts.append(low if start == index - 1 else f"{low}-{high}")
            start = index
    return ",".join(parts)


def fold_names(names: Sequence[str]) -> str:
    """Names as one nodeset: ``node0 node1 node2 gpu01 gpu02`` -> ``node[0-2],gpu[01-02]``.
    Names that share the text around their last number fold together; the zero padding
    is kept; a name alone stays as it is."""
    groups: dict[tuple[str, str], list[str]] = {}
    plain: dict[str, None] = {}
    for name in dict.fromkeys(names):
        match = _NUMBERED.match(name)
        if match is None:
            plain[name] = None
        else:
            groups.setdefault((match.group(1), match.group(3)), []).append(match.group(2))
    parts: list[str] = []
    for (head, tail), digits in groups.items():
        for width, members in _by_width(digits).items():
            if len(members) == 1:
                parts.append(f"{head}{members[0]}{tail}")
            else:
                parts.append(f"{head}[{fold_numbers([int(d) for d in members], width)}]{tail}")
    return ",".join(parts + list(plain))


def _by_width(digits: list[str]) -> dict[int, list[str]]:
    """Unpadded numbers fold together (width 0); padded ones only with their own width."""
    if not any(len(d) > 1 and d.startswith("0") for d in digits):
        return {0: digits}
    widths: dict[int, list[str]] = {}
    for d in digits:
        widths.setdefault(len(d), []).append(d)
    return widths
