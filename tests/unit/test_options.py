"""One rule per option (``inventory/options.py``): the same value gets the same verdict from
every door (a flag, a key of hosts.toml, an argument of the API), and the error names the
door it came through. Each case here was a disagreement between the doors."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from support.cli import THREE_HOSTS
from support.cli import option_lines as cli
from torchherd import Cluster, Recovery
from torchherd.errors import UsageError
from torchherd.inventory.options import (
    FINAL_EXIT_CODES,
    HANG_TIMEOUT,
    HEARTBEAT,
    HEARTBEAT_MISSES,
    MIN_NODES,
    NPROC_PER_NODE,
    REPLICATE,
    RETRIES,
    SSH_TIMEOUT,
    Option,
    OptionError,
)
from torchherd.inventory.reader import Reader

HOSTS = THREE_HOSTS



def cluster() -> Cluster:
    return Cluster.from_hosts("192.0.2.1,192.0.2.2,192.0.2.3", python="/p", workdir="/w")


def api_error(recovery: Recovery | None = None, **plan: Any) -> str:
    """What ``plan``, then ``launch`` with ``recovery``, refuse (nothing connects: both
    check before the first connection)."""
    with pytest.raises(UsageError) as raised:
        made = cluster().plan("train.py", **plan)
        cluster().launch(made, recovery=recovery, check=False)
    return str(raised.value)


def test_hang_timeout_half_a_second_is_refused_by_every_door(tmp_path: Path) -> None:
    code, out = cli(tmp_path, ["run", "--hang-timeout", "0.5", "--", "t.py"])
    assert (code, out[0]) == (2, "error: torchherd run: argument --hang-timeout: expected seconds from 1 to 3600, "
                                 "got '0.5'")
    code, out = cli(tmp_path, ["run", "--dry-run", "--", "t.py"], "[recovery]\nhang_timeout = 0.5\n")
    assert (code, out[0]) == (2, "error: hosts.toml: [recovery].hang_timeout: expected seconds from 1 to 3600, "
                                 "got a number 0.5")
    assert api_error(Recovery(hang_timeout=-5.0)) == ("Recovery(hang_timeout=-5.0): expected seconds from 1 to "
                                                      "3600, got -5.0")
    assert HANG_TIMEOUT.from_flag("30") == 30.0 and HANG_TIMEOUT.from_argument(30) == 30.0


def test_a_superscript_digit_is_told_as_what_was_expected_not_an_internal_name(tmp_path: Path) -> None:
    code, out = cli(tmp_path, ["run", "--min-nodes", "²", "--", "t.py"])
    assert (code, out[0]) == (2, "error: torchherd run: argument --min-nodes: expected a positive integer, got '²'")


@pytest.mark.parametrize(("flag", "text", "key", "toml", "argument", "value", "expected"), [
    pytest.param("--retries", "-1", "retries", "-1", "retries", -1, "expected an integer from 0 to 1000",
                 id="retries"),
    pytest.param("--retries", "1001", "retries", "1001", "retries", 1001, "expected an integer from 0 to 1000",
                 id="retries-huge"),
    pytest.param("--min-nodes", "0", "min_nodes", "0", "min_nodes", 0, "expected a positive integer",
                 id="min-nodes"),
    pytest.param("--final-exit-codes", "2,0", "final_exit_codes", "[2, 0]", "final_exit_codes", (2, 0),
                 "exit codes from 1 to 255", id="exit-codes"),
    pytest.param("--replicate", "65", "replicate", "65", "replicate", 65,
                 "expected an integer from 0 to 64 (0: no replication)", id="replicate"),
])
def test_a_recovery_value_gets_one_verdict_from_every_door(tmp_path: Path, flag: str, text: str, key: str, toml: str,
                                                           argument: str, value: object, expected: str) -> None:
    code, out = cli(tmp_path, ["run", "--retries", "1", "--checkpoint", "s.pt", flag, text, "--", "t.py"]
                    if flag != "--retries" else ["run", flag, text, "--", "t.py"])
    assert code == 2 and out[0].startswith(f"error: torchherd run: argument {flag}: ") and expected in out[0], out
    more = 'checkpoint = "s.pt"\n' if key == "replicate" else ""
    code, out = cli(tmp_path, ["run", "--dry-run", "--", "t.py"], f"[recovery]\n{key} = {toml}\n{more}")
    assert code == 2 and out[0].startswith(f"error: hosts.toml: [recovery].{key}: ") and expected in out[0], out
    said = api_error(Recovery(**{argument: value}))
    assert said.startswith(f"Recovery({argument}={value!r}): ") and expected in said, said


def test_processes_per_node_one_verdict(tmp_path: Path) -> None:
    expected = "expected a positive integer (at most 4096), gpu, cpu or auto"
    code, out = cli(tmp_path, ["run", "--nproc-per-node", "0", "--", "t.py"])
    assert (code, out[0]) == (2, f"error: --nproc-per-node '0': {expected}")
    code, out = cli(tmp_path, ["hosts"], "[cluster]\nnproc_per_node = 0\n")
    assert (code, out[0]) == (2, f"error: hosts.toml: [cluster].nproc_per_node: {expected}, got an integer 0")
    assert api_error(nproc_per_node=0) == f"plan(nproc_per_node=0): {expected}, got 0"


def test_monitor_interval_and_max_restarts_one_verdict(tmp_path: Path) -> None:
    code, out = cli(tmp_path, ["run", "--monitor-interval", "0", "--", "t.py"])
    assert out[0] == "error: torchherd run: argument --monitor-interval: expected seconds above 0, at most 86400, got '0'"
    assert api_error(monitor_interval=0) == "plan(monitor_interval=0): expected seconds above 0, at most 86400, got 0"
    code, out = cli(tmp_path, ["run", "--max-restarts", "-1", "--", "t.py"])
    assert out[0] == "error: torchherd run: argument --max-restarts: expected an integer from 0 to 1000000, got '-1'"
    assert api_error(max_restarts=-1) == "plan(max_restarts=-1): expected an integer from 0 to 1000000, got -1"


def test_an_environment_name_one_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    problem = "not a valid environment variable name (ASCII letters, digits and '_', not starting with a digit)"
    code, out = cli(tmp_path, ["run", "--env", "1X=2", "--", "t.py"])
    assert (code, out[0]) == (2, "error: --env '1X=2': expected NAME=VALUE (NAME: ASCII letters, digits, '_')")
    monkeypatch.setenv("ÄÖ", "1")
    code, out = cli(tmp_path, ["run", "--env-pass", "ÄÖ", "--", "t.py"])
    assert (code, out[0]) == (2, f"error: --env-pass 'ÄÖ': {problem}")
    code, out = cli(tmp_path, ["hosts"], '[defaults]\nenv = { "1X" = "2" }\n')
    assert (code, out[0]) == (2, f"error: hosts.toml: [defaults].env.'1X': {problem}")
    assert api_error(env={"1X": "2"}) == f"plan(env={{'1X': ...}}): {problem}"


def test_checkpoint_needs_retries_from_the_api_too() -> None:
    with pytest.raises(OptionError) as raised:
        cluster().launch(cluster().plan("t.py"), recovery=Recovery(checkpoint="s.pt"), check=False)
    assert str(raised.value) == ("Recovery(checkpoint='s.pt'): it is staged before a new attempt, and without "
                                 "retries there is none")
    assert raised.value.hint == "pass Recovery(retries=N) too"
    said = api_error(Recovery(retries=1, replicate=2))
    assert said == "Recovery(replicate=2): replication copies the checkpoint, and none is named"


def test_the_files_checkpoint_without_retries_stays_every_runs_default(tmp_path: Path) -> None:
    """The table holds defaults a run adds its retries to: only a run's own request is refused."""
    code, out = cli(tmp_path, ["run", "--dry-run", "--", "t.py"], '[recovery]\ncheckpoint = "s.pt"\n')
    assert code == 0, out
    code, out = cli(tmp_path, ["run", "--dry-run", "--", "t.py"], "[recovery]\nreplicate = 2\n")
    assert (code, out[0]) == (2, "error: hosts.toml: [recovery].replicate: replication copies the checkpoint, and "
                                 "[recovery].checkpoint names none")


def test_the_engine_names_the_door_the_value_came_through(tmp_path: Path) -> None:
    """min_nodes above the run's nodes is known only once the plan is: the API's words for an
    API caller, the flag or the file's key on the command line."""
    assert api_error(Recovery(retries=1, min_nodes=9)) == "Recovery(min_nodes=9): more than the 3 nodes of the run"
    code, out = cli(tmp_path, ["run", "--retries", "1", "--min-nodes", "9", "--no-check", "--", "t.py"])
    assert (code, out[0]) == (2, "error: --min-nodes 9: more than the 3 nodes of the run")
    code, out = cli(tmp_path, ["run", "--retries", "1", "--no-check", "--", "t.py"], "[recovery]\nmin_nodes = 9\n")
    assert (code, out[0]) == (2, "error: hosts.toml: [recovery].min_nodes = 9: more than the 3 nodes of the run")
    assert api_error(nnodes="1:3") == "plan(nnodes='1:3'): an elastic range needs the c10d rendezvous"
    code, out = cli(tmp_path, ["run", "--nnodes", "1:3", "--", "t.py"])
    assert out == ["error: --nnodes 1:3: an elastic range needs the c10d rendezvous",
                   '  hint: add --rdzv-backend c10d, or set rdzv_backend = "c10d" in [cluster]']


def test_rdzv_conf_without_c10d_names_the_door() -> None:
    assert api_error(rdzv_conf="timeout=60") == ("plan(rdzv_conf='timeout=60'): only the c10d rendezvous takes it, "
                                                 "and this run's is static")


def test_the_ssh_timeout_one_verdict(tmp_path: Path) -> None:
    """The file took at most an hour, the flag a day: a day, from each door."""
    code, out = cli(tmp_path, ["check", "--ssh-timeout", "86401"])
    assert out[0] == "error: torchherd check: argument --ssh-timeout: expected seconds above 0, at most 86400, got '86401'"
    code, out = cli(tmp_path, ["hosts"], "[cluster]\nssh_timeout = 86401\n")
    assert out[0] == ("error: hosts.toml: [cluster].ssh_timeout: expected a positive number of seconds (at most 86400), "
                      "got an integer 86401")
    code, out = cli(tmp_path, ["hosts"], "[cluster]\nssh_timeout = 7200\n")
    assert code == 0 and not any(line.startswith("error") for line in out), out
    with pytest.raises(UsageError) as raised:
        cluster().override(ssh_timeout=0)
    assert str(raised.value) == "override(ssh_timeout=0): expected seconds above 0, at most 86400, got 0"
    with pytest.raises(UsageError) as raised:
        cluster().override(nproc_per_node="all")
    assert str(raised.value) == ("override(nproc_per_node='all'): expected a positive integer (at most 4096), gpu, "
                                 "cpu or auto, got 'all'")


def test_a_uv_switch_names_the_argument_or_the_flag(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as raised:
        cluster().plan("t.py", uv=True)
    assert str(raised.value) == ("plan(uv=True): the venv is built from the synced project's uv.lock, and nothing "
                                 "is synced")
    assert raised.value.hint == "pass sync=True too (or add a [sync] table) to send the project with its lock"
    with pytest.raises(UsageError) as raised:
        cluster().plan("t.py", uv=False, uv_offline=True)
    assert str(raised.value) == "plan(uv_offline=True): not with uv=False"
    code, out = cli(tmp_path, ["run", "--no-uv", "--uv-offline", "--dry-run", "--", "t.py"])
    assert (code, out) == (2, ["error: --uv-offline: not with --no-uv", "  hint: leave one of them out"])
    code, out = cli(tmp_path, ["run", "--uv", "--dry-run", "--", "t.py"])
    assert (code, out) == (2, ["error: --uv: the venv is built from the synced project's uv.lock, and nothing is "
                               "synced", "  hint: add --sync (or a [sync] table) to send the project with its lock"])


def test_the_heartbeat_one_verdict(tmp_path: Path) -> None:
    code, out = cli(tmp_path, ["hosts"], "[recovery]\nheartbeat = 0.05\n")
    assert out[0] == "error: hosts.toml: [recovery].heartbeat: expected seconds between heartbeats, from 0.1 to 5, got a number 0.05"
    assert api_error(Recovery(heartbeat=0.05)) == ("Recovery(heartbeat=0.05): expected seconds between heartbeats, from "
                                                   "0.1 to 5, got 0.05")
    assert api_error(Recovery(heartbeat_misses=1)) == "Recovery(heartbeat_misses=1): expected an integer from 2 to 60, got 1"


SCALARS = st.one_of(st.integers(-5, 5000), st.floats(-1.0, 90000.0), st.just(math.nan), st.booleans(),
                    st.sampled_from(["gpu", "cpu", "auto", "all", "²", ""]))
OPTIONS = [RETRIES, MIN_NODES, HANG_TIMEOUT, REPLICATE, NPROC_PER_NODE, SSH_TIMEOUT, HEARTBEAT, HEARTBEAT_MISSES]


def verdicts(option: Option[Any], value: object, text: str) -> tuple[object, object, object]:
    """What the file's reader, the API and the flag make of one value (None: refused)."""
    def door(take: Any, *given: object) -> object:
        try:
            return take(*given)
        except (UsageError, __import__("argparse").ArgumentTypeError):
            return None

    read = Reader(Path("hosts.toml"), "[t].", {}, ())
    return (door(read.option(option), option.name, value), door(option.from_argument, value),
            door(option.from_flag, text))


@given(st.sampled_from(OPTIONS), SCALARS)
def test_every_door_gives_a_value_the_same_verdict(option: Option[Any], value: object) -> None:
    """The file's value, the API's, and the flag's text that writes it: one verdict, one value."""
    text = str(value).lower() if isinstance(value, bool) else repr(value) if isinstance(value, float) else str(value)
    from_file, from_api, from_flag = verdicts(option, value, text)
    assert from_file == from_api, (from_file, from_api)
    if not isinstance(value, bool):  # a flag's "true" is text, as the file's "true" string would be
        assert from_flag == from_api, (from_flag, from_api)


@given(st.lists(st.integers(-2, 300), min_size=1, max_size=4))
def test_exit_codes_one_verdict(codes: list[int]) -> None:
    assert verdicts(FINAL_EXIT_CODES, codes, ",".join(map(str, codes))) in (
        (None, None, None), (tuple(codes), tuple(codes), tuple(codes)))
