"""The local run record of detached runs, and the pure parsing around it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchherd.console.detach import run_state, state_text
from torchherd.engine.records import (
    CoordinatorRecord,
    NodeRecord,
    NodeState,
    RunRecord,
    describe_since,
    load,
    load_all,
    parse_node_state,
    remote_log_file,
    remote_state_file,
    runs_dir,
    save,
)
from torchherd.errors import UsageError


def record(run_id: str = "th-20240501-120000-abcdef", created: float = 100.0) -> RunRecord:
    nodes = tuple(NodeRecord(name=f"node{i}", address=f"10.0.0.{i}", user="u", ssh_port=2222, identity_file="~/.k",
                             python="/opt/py", workdir="~/w", log_file=remote_log_file(run_id, f"node{i}"),
                             state_file=remote_state_file(run_id, f"node{i}"), supervisor=40 + i, pid=50 + i,
                             pgid=50 + i) for i in range(2))
    return RunRecord(run_id=run_id, inventory="/x/hosts.toml", created=created, command=("train.py", "--lr", "1"),
                     nodes=nodes, max_rank=3, grace=5.0, ssh_config="/x/ssh_config", ssh_timeout=7.0,
                     coordinator=CoordinatorRecord("node0", 4000, 77, "~/.torchherd/runs/r/coordinator.json"))


def test_runs_dir_honours_xdg_state_home(tmp_path: Path) -> None:
    assert runs_dir({"XDG_STATE_HOME": str(tmp_path)}) == tmp_path / "torchherd" / "runs"
    assert runs_dir({}).parts[-4:] == (".local", "state", "torchherd", "runs")


def test_record_round_trips_through_json(tmp_path: Path) -> None:
    original = record()
    path = save(original, tmp_path)
    assert path == tmp_path / f"{original.run_id}.json"
    assert load(original.run_id, tmp_path) == original
    data = json.loads(path.read_text())
    assert data["nodes"][1]["log_file"] == "~/.torchherd/runs/th-20240501-120000-abcdef/node1.log"
    assert data["nodes"][1]["state_file"] == "~/.torchherd/runs/th-20240501-120000-abcdef/node1.state.json"
    assert [path.name for path in tmp_path.iterdir()] == [f"{original.run_id}.json"]


def test_record_host_reconnects_with_the_resolved_settings() -> None:
    host = record().nodes[1].host()
    assert (host.name, host.address, host.user, host.ssh_port, host.identity_file, host.python) == (
        "node1", "10.0.0.1", "u", 2222, "~/.k", "/opt/py")


def test_load_by_unique_part_and_errors(tmp_path: Path) -> None:
    save(record("th-20240501-120000-aaaaaa", 2.0), tmp_path)
    save(record("th-20240501-120000-bbbbbb", 1.0), tmp_path)
    assert load("aaaaaa", tmp_path).run_id == "th-20240501-120000-aaaaaa"
    with pytest.raises(UsageError, match="ambiguous"):
        load("th-2024", tmp_path)
    with pytest.raises(UsageError, match="no run 'zzz'"):
        load("zzz", tmp_path)
    (tmp_path / "broken.json").write_text("{")
    assert [r.run_id for r in load_all(tmp_path)] == ["th-20240501-120000-bbbbbb", "th-20240501-120000-aaaaaa"]
    assert load_all(tmp_path / "missing") == []


def test_unknown_node_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="has no node 'node9'"):
        record().node("node9")


def test_parse_node_state() -> None:
    running = json.dumps({"state": "running", "started": 10.5, "supervisor": 4})
    exited = json.dumps({"state": "exited", "code": 3, "started": 10.5, "ended": 20.0})
    assert parse_node_state("n", running, True) == NodeState("n", "running", since=10.5)
    assert parse_node_state("n", exited, False) == NodeState("n", "exited", 3, 20.0)
    assert parse_node_state("n", exited, True).state == "exited"
    stopped = json.dumps({"state": "exited", "code": 1, "ended": 20.0, "stopped": "signal SIGTERM"})
    assert parse_node_state("n", stopped, False) == NodeState("n", "exited", 1, 20.0, "stopped (signal SIGTERM)",
                                                              stopped=True)
    gone = parse_node_state("n", running, False)
    assert gone.state == "gone" and "without recording an exit" in gone.detail
    assert parse_node_state("n", "", True).state == "running"
    assert parse_node_state("n", "not json", False).state == "unknown"


def test_describe_since_and_run_state() -> None:
    assert describe_since(None) == "-"
    assert describe_since(1000.0, now=1005.0).endswith("(5s ago)")
    assert describe_since(1000.0, now=1000.0 + 600).endswith("(10m ago)")
    assert describe_since(1000.0, now=1000.0 + 3 * 3600).endswith("(3h ago)")
    ok = [NodeState("a", "exited", 0), NodeState("b", "exited", 0)]
    assert run_state(ok) == "ok"
    assert run_state([NodeState("a", "running"), NodeState("b", "exited", 1)]) == "running"
    assert run_state([NodeState("a", "exited", 0), NodeState("b", "exited", 143)]) == "failed"
    # stopped by torchherd (stop, a teardown), whatever code the job chose on the way out
    assert run_state([NodeState("a", "exited", 0), NodeState("b", "exited", 1, stopped=True)]) == "stopped"
    assert run_state([NodeState("a", "exited", 3), NodeState("b", "exited", 143, stopped=True)]) == "failed"
    assert run_state([NodeState("a", "unreachable")]) == "unknown"
    assert state_text(NodeState("a", "exited", 143)) == "exited (143)"
    assert state_text(NodeState("a", "gone")) == "gone"


def test_a_run_id_matches_by_its_start_or_its_end_never_its_middle(tmp_path: Path) -> None:
    """``stop 1200`` must not stop whichever run started at 12:00."""
    save(record("th-20240501-120000-aaaaaa", 2.0), tmp_path)
    assert load("th-20240501-12", tmp_path).run_id == "th-20240501-120000-aaaaaa"
    assert load("0-aaaaaa", tmp_path).run_id == "th-20240501-120000-aaaaaa"
    for middle in ("1200", "20240501", "120000"):
        with pytest.raises(UsageError) as refused:
            load(middle, tmp_path)
        assert str(refused.value) == f"no run {middle!r} in {tmp_path}"


def test_a_thousand_failed_attempts_with_long_lines_keep_the_record_loadable(tmp_path: Path) -> None:
    """Each attempt's headline quotes the job's first error line (here 4 KiB of bytes that
    are not UTF-8: six bytes of JSON each): the record keeps a short one per attempt, for the
    first and the last attempts, and stays far under its limit."""
    from torchherd.engine.records import (
        ATTEMPT_HEADLINES,
        ATTEMPT_TEXT_CHARS,
        MAX_RECORD_BYTES,
        RecoveryRecord,
        recovery_of,
        with_recovery,
    )

    line = b"\xff" * 4096
    recovery = RecoveryRecord(4242, 77, 1000)
    for number in range(1, 1001):
        recovery = recovery.started(number, ("node0", "node1")).failed(
            number, f"node1 rank 1 failed first (exit 1): {line.decode('utf-8', 'surrogateescape')}")
    path = save(with_recovery(record(), recovery), tmp_path)
    assert path.stat().st_size < MAX_RECORD_BYTES // 16, path.stat().st_size
    loaded = recovery_of(load(record().run_id, tmp_path))
    assert loaded is not None and [attempt.number for attempt in loaded.attempts] == list(range(1, 1001))
    assert all(attempt.ended == "failed" and attempt.nodes == ("node0", "node1") for attempt in loaded.attempts)
    kept = [attempt.number for attempt in loaded.attempts if attempt.headline]
    assert len(kept) == ATTEMPT_HEADLINES and kept[0] == 1 and kept[-1] == 1000
    assert loaded.attempts[-1].headline == ("node1 rank 1 failed first (exit 1): "
                                            + "\ufffd" * (ATTEMPT_TEXT_CHARS - 36)
                                            + " [cut: the node's log has the whole line]")
