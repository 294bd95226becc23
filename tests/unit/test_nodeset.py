"""Nodesets: examples, and properties checked against a plain reading of the same ranges."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from torchherd.nodeset import NodesetError, expand, split_top


@pytest.mark.parametrize("text,names", [
    ("node0", ["node0"]),
    ("gpu[01-04]", ["gpu01", "gpu02", "gpu03", "gpu04"]),
    ("gpu[1-3,7]", ["gpu1", "gpu2", "gpu3", "gpu7"]),
    ("a[1-2]b[1-2]", ["a1b1", "a1b2", "a2b1", "a2b2"]),
    ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
    ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),
    ("n[1-2],cpu1, x[3]", ["n1", "n2", "cpu1", "x3"]),
    ("10.0.0.[1-3]", ["10.0.0.1", "10.0.0.2", "10.0.0.3"]),
    ("[1-2]x", ["1x", "2x"]),
])
def test_examples(text: str, names: list[str]) -> None:
    assert expand(text) == names


@pytest.mark.parametrize("text,problem", [
    ("gpu[1-", "'[' without ']'"),
    ("gpu1-3]", "']' without '['"),
    ("gpu[3-1]", "ends below its start"),
    ("gpu[a-b]", "is not a number or a range"),
    ("gpu[]", "is not a number or a range"),
    ("a,,b", "empty item"),
    ("a,", "empty item"),
    ("n[0-99999999]", "more than"),
    ("a[0-9999]b[0-9999]", "more than"),
])
def test_errors_say_why(text: str, problem: str) -> None:
    with pytest.raises(NodesetError, match=problem.replace("[", r"\[").replace("]", r"\]")):
        expand(text)


ranges = st.lists(st.tuples(st.integers(0, 120), st.integers(0, 5), st.integers(1, 3)), min_size=1, max_size=3)
prefixes = st.text(alphabet="abcxyz-.", min_size=0, max_size=4)


def _write(group: list[tuple[int, int, int]]) -> tuple[str, list[str]]:
    """A bracket group and the names it must give, computed the plain way."""
    items, values = [], []
    for low, span, width in group:
        high = low + span
        items.append(f"{low:0{width}d}" if span == 0 else f"{low:0{width}d}-{high:0{width}d}")
        values.extend(f"{number:0{width}d}" for number in range(low, high + 1))
    return "[" + ",".join(items) + "]", values


@given(st.lists(st.tuples(prefixes, ranges), min_size=1, max_size=3), prefixes)
def test_a_pattern_is_the_product_of_its_groups(parts: list[tuple[str, list[tuple[int, int, int]]]],
                                                 tail: str) -> None:
    pattern, pieces = "", []
    for prefix, group in parts:
        written, values = _write(group)
        pattern += prefix + written
        pieces += [[prefix], values]
    pattern += tail
    expected = ["".join(combination) + tail for combination in itertools.product(*pieces)]
    assert expand(pattern) == expected


@given(st.lists(st.tuples(prefixes.filter(bool), ranges), min_size=1, max_size=4))
def test_a_list_is_its_patterns_in_order(parts: list[tuple[str, list[tuple[int, int, int]]]]) -> None:
    patterns = [prefix + _write(group)[0] for prefix, group in parts]
    assert split_top(",".join(patterns)) == patterns
    assert expand(",".join(patterns)) == [name for pattern in patterns for name in expand(pattern)]


@given(st.text(alphabet="ab1[]-,", max_size=12))
def test_any_text_either_expands_or_says_why(text: str) -> None:
    try:
        names = expand(text)
    except NodesetError as error:  # it names the item at fault, as written
        named = str(error).split(": ")[0]
        assert named.startswith("'") and named.strip("'") in text
    else:
        assert names and all("[" not in name and "]" not in name for name in names)


@given(st.integers(0, 500), st.integers(0, 500))
def test_padding_is_the_start_width(low: int, span: int) -> None:
    names = expand(f"n[{low:03d}-{low + span:03d}]")
    assert len(names) == span + 1
    assert all(len(name) == 1 + max(3, len(str(low + span))) for name in names[-1:])
    assert names[0] == f"n{low:03d}"
