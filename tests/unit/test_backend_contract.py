"""What every backend must satisfy, whatever its scheduler: SSH, SLURM, and a scheduler
that exists only in the tests (tests/support/memory_backend.py), registered the way a new
scheduler is, with one line (``register``). Nothing above ``engine.backend`` changes for it:
``Cluster`` launches, describes and follows its runs through the interface alone."""

from __future__ import annotations

import json
import re
from io import StringIO
from pathlib import Path
from typing import Iterator

import pytest
import tomllib

from torchherd.api import Cluster, DetachedRun
from torchherd.checks.model import CHECK_IDS
from torchherd.console import make_console
from torchherd.console.run import plan_json, render_description
from torchherd.engine import schedulers
from torchherd.engine.backend import Backend, backend_class, backend_for, backend_of, own_checks, scheduler_of
from torchherd.engine.events import Collector, Output
from torchherd.engine.run import LaunchOptions, Run
from torchherd.engine.schedulers import SCHEDULERS
from torchherd.errors import UsageError
from torchherd.plan import Plan

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def memory_scheduler(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(schedulers, "SCHEDULERS", dict(SCHEDULERS))
    monkeypatch.setattr(schedulers, "TABLES", dict(schedulers.TABLES))
    schedulers.register("memory", "support.memory_backend:MemoryBackend")  # all a new scheduler takes
    schedulers.TABLES["memory"] = "support.memory_backend:TABLE"  # and its own table, where it has one
    yield


NAMES = ["ssh", "slurm", "memory"]


def _plan(cluster: Cluster) -> Plan:
    return cluster.plan("train.py", "--epochs", "1", nproc_per_node=2, run_id="th-contract", master_addr="10.0.0.1")


@pytest.mark.parametrize("name", NAMES)
def test_the_registry_gives_each_scheduler_its_backend_and_back(name: str) -> None:
    backend = backend_for(name)
    assert isinstance(backend, Backend) and backend.scheduler == name and scheduler_of(backend) == name
    assert type(backend) is backend_class(name) and backend.connector is None
    assert backend.title and re.fullmatch(r"[A-Za-z]+", backend.title)


@pytest.mark.parametrize("name", NAMES)
def test_its_own_check_ids_are_new_and_its_triage_checks_are_known(name: str) -> None:
    kind = backend_class(name)
    assert not set(kind.check_ids) & set(CHECK_IDS)
    assert kind.triage_checks <= set(CHECK_IDS) | set(kind.check_ids)
    assert (kind.title, kind.check_ids) in own_checks() or not kind.check_ids


@pytest.mark.parametrize("name", NAMES)
def test_each_flag_it_refuses_is_refused_with_one_line_naming_it(name: str) -> None:
    backend = backend_for(name)
    for flag, (why, hint) in backend.refuses.items():
        backend.allow(flag, False)
        with pytest.raises(UsageError) as raised:
            backend.allow(flag, True)
        assert str(raised.value) == f"{flag}: {why}" and raised.value.hint == hint
        assert "\n" not in str(raised.value)


@pytest.mark.parametrize("name", NAMES)
def test_its_description_is_what_dry_run_prints_and_its_json(name: str) -> None:
    cluster = Cluster(hosts=["a", "b"])
    plan = _plan(cluster)
    described = backend_for(name).describe(plan)
    assert described.run_id == "th-contract"
    document = plan_json(described)
    assert document["dry_run"] is True and document["run_id"] == "th-contract" and document["scheduler"] == name
    json.dumps(document)
    lines = described.text()
    assert lines and all(isinstance(text, str) for _, text in lines)
    assert all(re.fullmatch(r"|title|note|node:[0-9]+", role) for role, _ in lines)
    assert lines[-1][1].startswith("dry run: nothing was")
    out = StringIO()
    render_description(make_console(out, width=300), described)
    assert out.getvalue().splitlines()[-1] == lines[-1][1]


def test_a_new_scheduler_runs_through_the_cluster_unchanged(tmp_path: Path) -> None:
    cluster = Cluster(hosts=["a", "b"])
    cluster.backend = backend_for("memory", cluster.connector)
    seen = Collector()
    run = cluster.launch(_plan(cluster), on_event=seen, log_dir=tmp_path, check=False)
    assert isinstance(run, Run)
    summary = run.wait(timeout=10)
    assert (summary.exit_code, summary.headline) == (0, "all finished")
    assert [line.node for event in seen.of(Output) for line in event.lines] == ["a", "b"]
    report = cluster.check()
    assert [(result.node, result.check, result.status) for result in report.results] == [
        ("a", "memory-node", "pass"), ("b", "memory-node", "pass")]


def test_a_new_schedulers_own_table_is_read_at_every_door_as_slurms_is(tmp_path: Path) -> None:
    from support.memory_backend import MemorySettings

    inventory = tmp_path / "hosts.toml"
    inventory.write_text('[cluster]\nscheduler = "memory"\n[memory]\nlanes = 3\n[[hosts]]\nname = "a"\n')
    cluster = Cluster.from_toml(inventory)
    assert cluster.scheduler == "memory" and type(cluster.backend) is backend_class("memory")
    assert cluster.inventory.table("memory") == MemorySettings(lanes=3)
    assert cluster.using(memory={"label": "x"}).inventory.table("memory") == MemorySettings(lanes=3, label="x")
    made = Cluster(["a"], scheduler="memory", memory={"lanes": 2})
    assert made.inventory.table("memory") == MemorySettings(lanes=2)
    with pytest.raises(UsageError) as raised:
        Cluster(["a"], memory={"lanes": 0})
    assert str(raised.value).startswith("<torchherd.Cluster>: [memory].lanes:")
    with pytest.raises(UsageError) as raised:
        Cluster(["a"]).using(memory={"lanes": 2})
    assert str(raised.value) == "--memory-lanes: only for in-memory runs"


def test_a_detached_run_of_a_new_scheduler_is_found_again_from_its_record() -> None:
    cluster = Cluster(hosts=["a", "b"])
    record = backend_for("memory").start_detached(_plan(cluster), LaunchOptions())
    assert record.extra["scheduler"] == "memory"
    assert type(backend_of(record)) is backend_class("memory")
    detached = DetachedRun(record)
    assert [(state.node, state.state, state.code) for state in detached.status()] == [("a", "exited", 0),
                                                                                       ("b", "exited", 0)]
    assert detached.stop() == {"a": [], "b": []}


def test_the_import_contract_names_every_module_but_the_backends_and_the_registry() -> None:
    """A module left out of the contract could import a backend's package unseen."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    contract = next(c for c in contracts if c["name"].startswith("Nothing but engine.schedulers imports"))
    package = ROOT / "src" / "torchherd"
    top = {f"torchherd.{path.stem}" for path in package.iterdir()
           if (path.suffix == ".py" and path.stem not in ("__init__", "__main__")) or (path / "__init__.py").exists()}
    engine = {f"torchherd.engine.{path.stem}" for path in (package / "engine").iterdir()
              if (path.suffix == ".py" and path.stem != "__init__") or (path / "__init__.py").exists()}
    expected = (top - {"torchherd.engine"}) | (engine - {"torchherd.engine.ssh", "torchherd.engine.slurm",
                                                         "torchherd.engine.schedulers"})
    assert set(contract["source_modules"]) == expected
    assert contract["forbidden_modules"] == ["torchherd.engine.ssh", "torchherd.engine.slurm"]
