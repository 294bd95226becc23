"""Per-node process counts: each node its own --nproc-per-node; uneven counts need c10d."""

from __future__ import annotations

from io import StringIO
from pathlib import Path
from typing import Any

import pytest

from torchherd.console import make_console
from torchherd.console.run import render_description
from torchherd.errors import UsageError
from torchherd.inventory import Inventory, parse
from torchherd.plan import RunOptions, build_plan


def inventory(cluster: dict[str, Any] | None = None, b_nproc: int | str = 3) -> Inventory:
    return parse({"cluster": {"nproc_per_node": 1, **(cluster or {})},
                  "hosts": [{"name": "a", "address": "10.0.0.1"},
                            {"name": "b", "address": "10.0.0.2", "nproc_per_node": b_nproc}]},
                 Path("hosts.toml"))


def flag(argv: tuple[str, ...], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_each_node_gets_its_own_count_and_uneven_counts_switch_to_c10d() -> None:
    plan = build_plan(inventory(), RunOptions(script="train.py", run_id="r1"))
    assert [node.nproc_per_node for node in plan.nodes] == [1, 3]
    assert [flag(node.argv, "--nproc-per-node") for node in plan.nodes] == ["1", "3"]
    assert plan.rdzv_backend == "c10d"
    assert all(flag(node.argv, "--rdzv-backend") == "c10d" and "--node-rank" not in node.argv
               for node in plan.nodes)
    assert plan.world_size == 4
    assert any("rendezvous c10d: the nodes run different process counts (a 1, b 3)" in note
               for note in plan.nodes[0].notes)


def test_dry_run_says_why_c10d() -> None:
    out = StringIO()
    render_description(make_console(out, width=300), build_plan(inventory(), RunOptions(script="train.py", run_id="r1")))
    assert "rendezvous c10d" in out.getvalue()
    assert "static rendezvous needs the same count everywhere" in out.getvalue()


def test_even_counts_keep_static() -> None:
    plan = build_plan(inventory(b_nproc=1), RunOptions(script="train.py", run_id="r1"))
    assert plan.rdzv_backend == "static" and plan.world_size == 2
    assert not any("rendezvous" in note for note in plan.nodes[0].notes)


def test_the_command_line_count_wins_for_every_node() -> None:
    plan = build_plan(inventory(), RunOptions(script="train.py", run_id="r1", nproc_per_node=2))
    assert [flag(node.argv, "--nproc-per-node") for node in plan.nodes] == ["2", "2"]
    assert plan.rdzv_backend == "static" and plan.world_size == 4


def test_a_count_found_on_the_node_has_no_world_size() -> None:
    plan = build_plan(inventory(b_nproc="gpu"), RunOptions(script="train.py", run_id="r1"))
    assert plan.world_size is None and plan.rdzv_backend == "c10d"


@pytest.mark.parametrize("cluster,options,where", [
    ({}, {"rdzv_backend": "static"}, "--rdzv-backend static"),
    ({"rdzv_backend": "static"}, {}, '[cluster].rdzv_backend = "static"'),
])
def test_forced_static_with_uneven_counts_is_refused(cluster: dict[str, Any], options: dict[str, Any],
                                                      where: str) -> None:
    with pytest.raises(UsageError) as caught:
        build_plan(inventory(cluster), RunOptions(script="train.py", run_id="r1", **options))
    assert str(caught.value).startswith(f"{where}: the nodes run different process counts (a 1, b 3)")
    assert "--rdzv-backend c10d" in caught.value.hint


def test_the_gpu_check_compares_each_node_with_its_own_count() -> None:
    from torchherd.checks.analysis import gpu
    from torchherd.checks.runner import observe

    plan = build_plan(inventory(), RunOptions(script="train.py", run_id="r1"))
    observed = observe(plan, ("gpu",))
    observed.facts = {"a": {"torch": {"gpus": 1}}, "b": {"torch": {"gpus": 2}}}
    verdicts = {result.node: result for result in gpu.analyse(observed)}
    assert verdicts["a"].status == "pass" and "nproc_per_node = 1" in verdicts["a"].summary
    assert verdicts["b"].status == "fail" and verdicts["b"].summary == "b sees 2 GPU(s), nproc_per_node = 3"


def test_max_rank_is_the_sum_of_the_nodes_counts() -> None:
    from torchherd.engine.bookkeeping import max_rank

    assert max_rank(build_plan(inventory(), RunOptions(script="train.py", run_id="r1"))) == 3
    assert max_rank(build_plan(inventory(b_nproc="gpu"), RunOptions(script="train.py", run_id="r1"))) == 99
