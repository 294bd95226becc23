"""Property-based fuzzing (hypothesis) of everything that reads input torchherd does not
control: the inventory loader, the CLI's value parsers, the record splitter and the
run-record loader. Any input gives a result or a clean error, never another exception."""

from __future__ import annotations

import argparse
import json
import math
from io import StringIO
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchherd import cli
from torchherd.cli import values as converters
from torchherd.console import make_console
from torchherd.engine.records import RecordError, RunRecord
from torchherd.errors import InventoryError, UsageError
from torchherd.inventory import CLUSTER_KEYS, HOST_KEYS, NODE_KEYS, Inventory, loads, parse
from torchherd.plan import check_nnodes, parse_env_assignments
from torchherd.runlog import OutputParser, RecordSplitter, parse_records

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PATH = Path("fuzz.toml")

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12),
                    st.sampled_from(["gpu", "cpu", "auto", "static", "c10d", "ssh", "node0", "~/x", "a[1-3]", ""]))
keys = st.one_of(st.sampled_from(CLUSTER_KEYS + HOST_KEYS + NODE_KEYS + ("hosts", "cluster", "defaults")),
                 st.text(max_size=8))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(keys, inner, max_size=4)), max_leaves=12)
hosts = st.lists(st.dictionaries(keys, values, max_size=5).map(lambda table: {"name": "n", **table}), max_size=4)
documents = st.fixed_dictionaries({}, optional={"cluster": st.dictionaries(keys, values, max_size=5),
                                                "defaults": st.dictionaries(keys, values, max_size=5),
                                                "hosts": st.one_of(hosts, values)})


@FUZZ
@given(documents)
def test_any_inventory_document_parses_or_names_the_key(document: dict[str, Any]) -> None:
    try:
        assert isinstance(parse(document, PATH), Inventory)
    except InventoryError as error:
        assert "\n" not in str(error) and str(error).startswith("fuzz.toml: ")


@FUZZ
@given(st.binary(max_size=400) | st.text(max_size=400).map(str.encode))
def test_any_inventory_bytes_load_or_fail_cleanly(raw: bytes) -> None:
    try:
        loads(raw, PATH)
    except InventoryError as error:
        assert "\n" not in str(error)


@FUZZ
@given(st.text(max_size=20))
def test_the_cli_value_parsers_accept_or_refuse_cleanly(text: str) -> None:
    for parse_flag in (converters.grace, converters.ssh_timeout, converters.count, converters.nnodes):
        try:
            value = parse_flag(text)
        except argparse.ArgumentTypeError:
            continue
        assert not isinstance(value, float) or math.isfinite(value) and value >= 0
    try:
        converters.nproc_count(text)
    except UsageError:
        pass
    try:
        parse_env_assignments([text])
    except UsageError:
        pass
    try:
        check_nnodes(text)
    except ValueError:
        pass


@FUZZ
@given(st.lists(st.binary(max_size=40), max_size=12))
def test_the_record_splitter_keeps_every_byte_and_never_fails(chunks: list[bytes]) -> None:
    splitter = RecordSplitter()
    records = [record for chunk in chunks for record in splitter.feed(chunk)] + splitter.finish()
    assert b"\n".join(records) == b"\n".join(part for part in b"".join(chunks).split(b"\n") if part)
    parser = OutputParser("n0")
    for chunk in chunks:
        parser.feed(chunk)
    parser.finish()
    parse_records("n0", records)


json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10)),
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(st.text(max_size=10), inner, max_size=4)),
                           max_leaves=10)
node = {"name": "n0", "address": "10.0.0.1", "user": None, "ssh_port": None, "identity_file": None,
        "python": "python3", "workdir": "~", "log_file": "~/l", "state_file": "~/s", "supervisor": 4, "pid": 5,
        "pgid": 5}
record = {"run_id": "th-x", "inventory": "/h.toml", "created": 1.0, "command": ["t.py"], "nodes": [node],
          "max_rank": 1, "grace": 2.0, "ssh_config": None, "ssh_timeout": 3.0, "coordinator": None, "extra": {}}


def _damaged(base: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    return {**base, key: value}


records = st.one_of(
    json_values,
    st.builds(_damaged, st.just(record), st.sampled_from(sorted(record)), json_values),
    st.builds(lambda key, value: _damaged(record, "nodes", [_damaged(node, key, value)]),
              st.sampled_from(sorted(node)), json_values),
)


@FUZZ
@given(records)
def test_any_run_record_loads_or_names_the_file(data: Any) -> None:
    try:
        loaded = RunRecord.from_json(json.dumps(data), "th-x.json")
    except RecordError as error:
        assert str(error).startswith("th-x.json") and "\n" not in str(error)
        return
    assert loaded.run_id == data["run_id"]  # a damaged run_id that is still a run id ("0") loads


@FUZZ
@given(st.text(max_size=60))
def test_main_never_shows_a_traceback_for_a_hostile_inventory(tmp_path_factory: Any, text: str) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "hosts.toml"
    path.write_text(f'[[hosts]]\nname = "a"\naddress = "192.0.2.1"\n[defaults]\nworkdir = {json.dumps(text)}\n')
    out = StringIO()
    code = cli.main(["-i", str(path), "run", "--dry-run", "--", "t.py"], console=make_console(out, width=200))
    assert code in (0, 2) and "Traceback" not in out.getvalue() and "internal error" not in out.getvalue()
