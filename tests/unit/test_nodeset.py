"""Nodesets: examples, and properties checked against a plain reading of the same ranges."""

from __future__ import annotations

import itertools
import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from torchherd.inventory.nodeset import NodesetError, expand, split_top


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


# ClusterShell's step ranges (``x-y/step``). The cases and their expansions are facts from
# ClusterShell's own suite (cea-hpc/clustershell tests/RangeSetTest.py testStepSimple,
# testStepAdvanced, test_bad_syntax; tests/NodeSetTest.py testBadRangeUsages, the leading
# digits and getitem cases), written out as names; the test code is this project's.


def _numbers(low: int, high: int, step: int = 1, width: int = 0) -> list[str]:
    return [str(number).zfill(width) for number in range(low, high + 1, step)]


@pytest.mark.parametrize("group,values", [
    ("0-4/2", ["0", "2", "4"]),
    ("1-4/2", ["1", "3"]),
    ("1-4/3", ["1", "4"]),
    ("1-4/4", ["1"]),
    ("1-17/01", _numbers(1, 17)),  # a zero-padded step is the number
    ("1-17/02", _numbers(1, 17, 2)),
    ("1-17/03", _numbers(1, 16, 3)),
    ("6-24/6,9-21/6", ["6", "12", "18", "24", "9", "15", "21"]),
    ("101-121/4,1-225/112", ["101", "105", "109", "113", "117", "121", "1", "113", "225"]),
])
def test_clustershell_step_ranges(group: str, values: list[str]) -> None:
    assert expand(f"n[{group}]") == [f"n{value}" for value in values]


@pytest.mark.parametrize("text,names", [
    ("prod-000[0-8/2]", ["prod-0000", "prod-0002", "prod-0004", "prod-0006", "prod-0008"]),
    ("n1[01-40/4]", [f"n1{value}" for value in _numbers(1, 37, 4, 2)]),  # ClusterShell: n[101-137/4]
    ("node-1[0-48/16]", ["node-10", "node-116", "node-132", "node-148"]),  # no padding: not node-[10-148/16]
    ("node-1[00-48/16]", ["node-100", "node-116", "node-132", "node-148"]),
    ("0[3-9/2]abc", ["03abc", "05abc", "07abc", "09abc"]),
    ("prune[003-034,349-353/2]", [f"prune{value}" for value in _numbers(3, 34, width=3) + ["349", "351", "353"]]),
])
def test_clustershell_steps_keep_the_padding(text: str, names: list[str]) -> None:
    assert expand(text) == names


def test_clustershell_step_counts() -> None:
    assert len(expand("prune[003-034,349-353/2]")) == 35
    yeti = expand("yeti[10-98/2]")
    assert yeti[1:9:3] == ["yeti12", "yeti18", "yeti24"] and yeti[::17] == ["yeti10", "yeti44", "yeti78"]
    union = expand("prod-000[0-8/2],prod-000[1-9/2]")
    assert sorted(union) == [f"prod-{value}" for value in _numbers(0, 9, width=4)] and len(union) == 10
    assert expand("n[1-10/2]") == ["n1", "n3", "n5", "n7", "n9"]


@pytest.mark.parametrize("group", ["2-5/a", "3/2", "3-/2", "-/2", "4-a/2", "4-3/2", "4-5/-2", "4-2/-2",
                                   "004-002", "3-59/2,102a", "3-59/2,,102", "1-4/0"])
def test_clustershell_bad_steps_are_refused(group: str) -> None:
    for text in (f"nova[{group}]", f"nova[{group}]p0", f"x4nova[{group}]p0"):
        with pytest.raises(NodesetError):
            expand(text)


@given(st.integers(0, 300), st.integers(0, 300), st.integers(1, 40), st.integers(1, 4))
def test_a_step_range_is_every_step_th_number(low: int, span: int, step: int, width: int) -> None:
    group = f"{low:0{width}d}-{low + span:0{width}d}/{step}"
    assert expand(f"n[{group}]") == [f"n{number:0{width}d}" for number in range(low, low + span + 1, step)]


@pytest.mark.parametrize("text", [
    pytest.param("n[0-999999,0-999999,0-999999]", id="ranges-of-one-group"),
    pytest.param("a[0-999999],b[0-999999],c[0-999999]", id="patterns-of-one-list"),
    pytest.param("n[0-1]x[0-999999]", id="product"),
    pytest.param("n[1-" + "9" * 5000 + "]", id="a-range-to-a-number-of-5000-digits"),
])
def test_too_many_names_are_refused_before_they_are_made(text: str) -> None:
    """A short text must not cost hundreds of MiB (30 characters once took 180 MiB):
    the limit is a running count over the whole text, checked before anything expands."""
    tracemalloc.start()
    try:
        with pytest.raises(NodesetError, match="more than 1,000,000 names|digits"):
            expand(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak >> 20} MiB"
