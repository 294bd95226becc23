"""Property-based fuzzing (hypothesis) of what a GPU node sends back: any nvidia-smi
output, kernel log or sysfs listing, and any shape of the facts a hostile node could
send, gives results or a clean SmiParseError, never another exception; and a fault
cannot come from text that is not a value."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchherd.checks.analysis import gpu, ib, nvsmi, xid
from torchherd.checks.model import NodeFacts, Observed
from torchherd.checks.results import STATUSES
from torchherd.inventory import parse

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DATA = Path(__file__).parent / "data" / "gpu"
T4 = (DATA / "nvidia-smi" / "tesla-t4.xml").read_text(encoding="utf-8")

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
FIELDS = ("gpu", "torch", "kernel_xids", "infiniband", "env")
shaped = st.fixed_dictionaries({}, optional={
    "gpu": st.one_of(values, st.fixed_dictionaries({}, optional={
        "query": st.one_of(values, st.fixed_dictionaries({"code": st.sampled_from([0, 1, None]),
                                                          "out": st.one_of(st.text(max_size=200), values)})),
        "nvlink": values, "pci": st.one_of(values, st.lists(st.dictionaries(st.sampled_from(["bus", "driver"]),
                                                                            values, max_size=2), max_size=3)),
        "compute_apps": values, "nvidia_smi": values})),
    "torch": values,
    "kernel_xids": st.one_of(values, st.fixed_dictionaries({"lines": st.one_of(values, st.lists(st.text(max_size=80),
                                                                                                  max_size=4))})),
    "infiniband": st.one_of(values, st.fixed_dictionaries({"ports": st.one_of(values, st.lists(values, max_size=3)),
                                                           "peermem": values})),
    "env": values,
})


def observed(*raws: dict[str, Any]) -> Observed:
    names = [f"node{index}" for index in range(len(raws))]
    inventory = parse({"cluster": {"nproc_per_node": 2}, "hosts": [{"name": name} for name in names]},
                      Path("hosts.toml"))
    seen = Observed(inventory=inventory, master_target=names[0])
    seen.facts = {name: NodeFacts(raw=raw, sent=0.0, received=0.0) for name, raw in zip(names, raws)}
    return seen


@FUZZ
@given(shaped, shaped)
def test_any_facts_give_results_never_a_traceback(first: dict[str, Any], second: dict[str, Any]) -> None:
    seen = observed(first, second)
    for analyse in (gpu.analyse, xid.analyse, ib.analyse):
        results = analyse(seen)
        assert len(results) == 2 and all(result.status in STATUSES for result in results)


@FUZZ
@given(st.text(max_size=400))
def test_any_text_is_read_or_refused_cleanly(text: str) -> None:
    try:
        nvsmi.parse(text)
    except nvsmi.SmiParseError:
        pass
    xid.parse_lines(text.splitlines())
    nvsmi.nvlink_links(text)


@FUZZ
@given(st.sampled_from(["dram_uncorrectable", "sram_uncorrectable", "pending_retirement", "pending_blacklist",
                        "current_link_width", "max_link_width", "persistence_mode", "performance_state"]),
       st.text(alphabet=st.characters(blacklist_characters="<>&", blacklist_categories=("Cs", "Cc")), max_size=12))
def test_a_field_that_is_not_a_value_is_never_a_fault(field: str, junk: str) -> None:
    """Any text in a field of a healthy GPU's document: never a fail (only a number or Yes
    can be evidence)."""
    start = T4.index(f"<{field}>") + len(f"<{field}>")
    end = T4.index(f"</{field}>", start)
    mutated = T4[:start] + junk + T4[end:]
    findings = gpu.health_findings("n0", nvsmi.parse(mutated))
    count = re.fullmatch(r"[0-9]+", junk.strip())
    if not (count and int(junk) > 0 and "uncorrectable" in field) and junk.strip().lower() != "yes":
        assert all(finding.status != "fail" for finding in findings), (field, junk, findings)
