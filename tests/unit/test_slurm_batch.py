"""The pure side of SLURM runs (engine.slurm.batch and .commands, checks.analysis.slurm): the batch script a plan becomes (checked
by bash itself, and its node command run for real with a stand-in python), the poll of
the run directory (run by sh on real files), and the parsers of SLURM's answers."""

from __future__ import annotations

import itertools
import os
import re
import shlex
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchherd.api import Cluster
from torchherd.checks.analysis.slurm import NodeInfo, gres_gpus, node_condition, parse_sinfo, slurm_view
from torchherd.checks.results import CheckResult
from torchherd.engine.slurm.batch import (
    Placement,
    batch_job,
    node_command,
    salloc_command,
    shown_script,
    submit_command,
)
from torchherd.engine.slurm.commands import (
    final_state_command,
    parse_exit_file,
    parse_final_state,
    parse_hostnames,
    parse_job_id,
    parse_poll,
    parse_sacct,
    parse_salloc,
    parse_scontrol,
    parse_squeue,
    phase_of,
    poll_command,
)
from torchherd.engine.slurm.settings import SlurmSettings, settings_of
from torchherd.errors import UsageError
from torchherd.plan import Plan
from torchherd.remote import program
from torchherd.transport.srun import step_command


def cluster(hosts: int = 2, slurm: dict[str, object] | None = None, **keys: object) -> Cluster:
    names = [f"node{index}" for index in range(hosts)]
    return Cluster(names, scheduler="slurm", python="/opt/venv/bin/python", workdir="~/proj",
                   slurm={"partition": "main", **(slurm or {})}, **keys)


def plan(hosts: int = 2, *args: str, slurm: dict[str, object] | None = None, **keys: object) -> Plan:
    return cluster(hosts, slurm, **keys).plan("train.py", *args, run_id="th-test", nproc_per_node=2)


# the batch script ----------------------------------------------------------------------


def test_the_script_asks_for_the_inventorys_hosts_one_task_each() -> None:
    job = batch_job(plan(3), SlurmSettings(partition="main", time="1:00:00", extra=("--qos=high",)))
    lines = job.script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for option in ("--job-name=torchherd-th-test", "--ntasks-per-node=1", "--output=batch.out", "--nodes=3",
                   "--nodelist=node0,node1,node2", "--partition=main", "--time=1:00:00", "--cpus-per-task=2",
                   "--qos=high"):
        assert f"#SBATCH {option}" in lines, job.script
    assert job.run_dir == "~/.torchherd/runs/th-test"
    assert job.placement == Placement(3, "node0,node1,node2", "the inventory's hosts")


def test_slurm_nodes_or_nodelist_replace_the_hosts() -> None:
    job = batch_job(plan(2), SlurmSettings(nodes=8))
    assert "#SBATCH --nodes=8" in job.script and "--nodelist" not in job.script
    job = batch_job(plan(2), SlurmSettings(nodelist="gpu[01-04]"))
    assert "#SBATCH --nodelist=gpu[01-04]" in job.script and "#SBATCH --nodes" not in job.script


def test_an_inventory_without_hosts_lets_slurm_pick_them() -> None:
    made = Cluster(scheduler="slurm", python="python3", slurm={"nodes": 4, "gpus_per_node": 8})
    job = batch_job(made.plan("train.py", run_id="th-x", nproc_per_node="gpu"), settings_of(made.inventory))
    assert "#SBATCH --nodes=4" in job.script and "#SBATCH --gpus-per-node=8" in job.script
    assert "--cpus-per-task" not in job.script.split("srun", 1)[0]  # "gpu" is no count


def test_the_job_environment_is_exported_in_the_file_quoted_and_shown_hidden() -> None:
    made = plan(2, env={"WANDB_API_KEY": "s3cr'et $HOME", "NCCL_DEBUG": "WARN"})
    job = batch_job(made, settings_of(made.inventory))
    assert f"export WANDB_API_KEY={shlex.quote(chr(115) + '3cr' + chr(39) + 'et $HOME')}" in job.script
    assert "export NCCL_DEBUG=WARN" in job.script
    shown = shown_script(job)
    assert "export WANDB_API_KEY=***" in shown and "s3cr" not in shown
    # sbatch's own command line holds no value of the job's environment: the script is on stdin
    assert "s3cr" not in submit_command(job) and "WANDB" not in submit_command(job)
    assert "umask 077" in submit_command(job) and "set -C" in submit_command(job)


def test_slurm_fills_in_the_node_rank_master_and_node_count() -> None:
    command = node_command(plan(2, "--lr", "it's"), plan(2).nodes)
    assert '--node-rank "$SLURM_NODEID"' in command
    assert '--master-addr "$TORCHHERD_MASTER_ADDR"' in command
    assert '--nnodes "$SLURM_JOB_NUM_NODES"' in command
    assert "--local-addr" not in command
    job = batch_job(plan(2), SlurmSettings())
    assert 'export TORCHHERD_MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"' in job.script
    assert "srun --kill-on-bad-exit=1 " in job.script
    assert "srun --kill-on-bad-exit=0 " in batch_job(plan(2), SlurmSettings(), fail_fast=False).script


def test_a_master_address_given_is_kept_and_c10d_uses_the_first_node() -> None:
    made = plan(2, master_addr="10.9.9.9")
    assert "export TORCHHERD_MASTER_ADDR=10.9.9.9" in batch_job(made, SlurmSettings()).script
    assert "--master-addr 10.9.9.9" in node_command(made, made.nodes)
    c10d = cluster(2).plan("train.py", run_id="th-c", rdzv_backend="c10d", rdzv_conf="timeout=60")
    command = node_command(c10d, c10d.nodes)
    assert '--rdzv-endpoint "$TORCHHERD_MASTER_ADDR:29500"' in command
    assert "--rdzv-conf timeout=60" in command and "is_host" not in command


def test_what_differs_between_hosts_is_refused_but_the_process_count() -> None:
    made = Cluster([{"name": "a"}, {"name": "b", "workdir": "/elsewhere"}], scheduler="slurm", python="python3")
    with pytest.raises(UsageError, match="b: workdir differs from a's"):
        batch_job(made.plan("train.py", run_id="th-w"), settings_of(made.inventory))
    uneven = Cluster([{"name": "a", "nproc_per_node": 1}, {"name": "b", "nproc_per_node": 3}], scheduler="slurm",
                     python="python3")
    uneven_plan = uneven.plan("train.py", run_id="th-u")
    command = node_command(uneven_plan, uneven_plan.nodes)
    assert "a) nproc=1 ;;" in command and "b) nproc=3 ;;" in command
    assert '--nproc-per-node "$nproc"' in command


def test_line_breaks_and_spaces_cannot_reach_the_script() -> None:
    with pytest.raises(UsageError, match=r"\[slurm\]\.extra"):
        batch_job(plan(1), SlurmSettings(extra=("--qos=a\n#SBATCH --x",)))
    with pytest.raises(UsageError, match=r"\[slurm\]\.partition"):
        batch_job(plan(1), SlurmSettings(partition="a b"))


def test_the_script_is_valid_bash() -> None:
    job = batch_job(plan(3, "--x", "a b'c", env={"A": "x\ny"}), SlurmSettings())
    checked = subprocess.run(["bash", "-n"], input=job.script, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def _fake_python(tmp_path: Path, code: int) -> str:
    fake = tmp_path / "fake-python"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{tmp_path}/argv"\nexit {code}\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return str(fake)


@pytest.mark.parametrize("code", [0, 3])
def test_the_node_command_runs_torchrun_and_records_how_it_ended(tmp_path: Path, code: int) -> None:
    made = Cluster(["n0", "n1"], scheduler="slurm", python=_fake_python(tmp_path, code), workdir=str(tmp_path))
    the_plan = made.plan("train.py", "--lr", "it's 1", run_id="th-n", nproc_per_node=2)
    env = {**os.environ, "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "2", "TORCHHERD_MASTER_ADDR": "n0",
           "TORCHHERD_DIR": str(tmp_path), "SLURMD_NODENAME": "n1"}
    ran = subprocess.run(["bash", "-c", node_command(the_plan, the_plan.nodes)], env=env, capture_output=True)
    assert ran.returncode == code
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[argv.index("--node-rank") + 1] == "1"
    assert argv[argv.index("--master-addr") + 1] == "n0"
    assert argv[argv.index("--nnodes") + 1] == "2"
    assert argv[-3:] == ["train.py", "--lr", "it's 1"]
    record = parse_exit_file("n1", (tmp_path / "n1.exit").read_text())
    assert record is not None and (record.phase, record.code) == ("job", code) and record.at > 0


def test_a_warm_node_command_starts_torchrun_through_the_warm_start_and_a_container_stays_cold(
        tmp_path: Path) -> None:
    """The same torchrun, its python told to run zygote.py's ``start`` first (the program
    as one argument, whole); in a container (the image's python) as before."""
    made = Cluster(["n0", "n1"], scheduler="slurm", python=_fake_python(tmp_path, 0), workdir=str(tmp_path))
    the_plan = made.plan("train.py", "--lr", "it's 1", run_id="th-n", nproc_per_node=2)
    env = {**os.environ, "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "2", "TORCHHERD_MASTER_ADDR": "n0",
           "TORCHHERD_DIR": str(tmp_path), "SLURMD_NODENAME": "n1"}
    argvs = []
    for warm in (False, True):
        ran = subprocess.run(["bash", "-c", node_command(the_plan, the_plan.nodes, warm=warm)], env=env,
                             capture_output=True, text=True)
        assert ran.returncode == 0, ran.stderr
        argvs.append(re.sub(r"th-n-n1--\w+", "LOGS", (tmp_path / "argv").read_text()))  # mktemp's own name
    cold, warm_argv = argvs  # the program holds line breaks: the whole argument list, not its lines
    assert warm_argv == f"-c\n{program('zygote.py')}\nstart\n" + cold
    assert cold.startswith("-m\ntorch.distributed.run\n")
    boxed = plan(2, container={"image": "img:1"})
    assert node_command(boxed, boxed.nodes, warm=True) == node_command(boxed, boxed.nodes)
    assert batch_job(boxed, SlurmSettings(), warm=True).script == batch_job(boxed, SlurmSettings()).script


def test_a_failed_cd_is_recorded_as_the_setup_phase(tmp_path: Path) -> None:
    made = Cluster(["n0"], scheduler="slurm", python="python3", workdir=str(tmp_path / "missing"))
    the_plan = made.plan("train.py", run_id="th-s")
    env = {**os.environ, "TORCHHERD_DIR": str(tmp_path), "SLURMD_NODENAME": "n0"}
    ran = subprocess.run(["bash", "-c", node_command(the_plan, the_plan.nodes)], env=env, capture_output=True)
    assert ran.returncode != 0
    record = parse_exit_file("n0", (tmp_path / "n0.exit").read_text())
    assert record is not None and record.phase == "setup"


def test_a_log_directory_someone_else_made_first_is_never_used_nor_refused(tmp_path: Path) -> None:
    """The name has the run id and the job id, both public: made first by someone else, the
    task neither uses it nor fails on it (that burnt every retry on that node): torchrun
    gets a fresh private directory (``mktemp -d``), theirs is left as it was."""
    made = Cluster(["n0"], scheduler="slurm", python=_fake_python(tmp_path, 0), workdir=str(tmp_path))
    the_plan = made.plan("train.py", run_id=f"th-taken-{os.getpid()}")
    planted = Path(f"{the_plan.nodes[0].remote_log_dir}-42")  # the job id follows the node's name
    planted.mkdir(mode=0o777)
    try:
        (planted / "theirs").write_text("kept")
        env = {**os.environ, "TORCHHERD_DIR": str(tmp_path), "SLURMD_NODENAME": "n0", "SLURM_JOB_ID": "42"}
        ran = subprocess.run(["bash", "-c", node_command(the_plan, the_plan.nodes)], env=env, capture_output=True)
        assert ran.returncode == 0, ran.stderr
        argv = (tmp_path / "argv").read_text().splitlines()
        used = argv[argv.index("--log-dir") + 1]
        assert used.startswith(f"{planted}-") and len(used) > len(str(planted)) + 5, used
        assert not Path(used).exists(), "removed after"
        record = parse_exit_file("n0", (tmp_path / "n0.exit").read_text())
        assert record is not None and record.phase == "job" and record.code == 0
        assert (planted / "theirs").read_text() == "kept"
    finally:
        shutil.rmtree(planted)


def test_the_log_directory_torchrun_gets_is_new_private_and_removed_after(tmp_path: Path) -> None:
    fake = tmp_path / "fake-python"
    fake.write_text(f'#!/bin/sh\nwhile [ "$1" != --log-dir ]; do shift; done\nstat -c %a "$2" > "{tmp_path}/mode"\n')
    fake.chmod(0o755)
    made = Cluster(["n0"], scheduler="slurm", python=str(fake), workdir=str(tmp_path))
    the_plan = made.plan("train.py", run_id=f"th-fresh-{os.getpid()}")
    env = {**os.environ, "TORCHHERD_DIR": str(tmp_path), "SLURMD_NODENAME": "n0", "SLURM_JOB_ID": "43"}
    # The next attempt of the run (a job of its own) meets what a killed task left behind.
    left = Path(f"{the_plan.nodes[0].remote_log_dir}-42")
    left.mkdir(mode=0o700)
    try:
        ran = subprocess.run(["bash", "-c", node_command(the_plan, the_plan.nodes)], env=env, capture_output=True)
    finally:
        left.rmdir()
    assert ran.returncode == 0, ran.stderr
    assert (tmp_path / "mode").read_text() == "700\n"
    named = Path(f"{the_plan.nodes[0].remote_log_dir}-43")
    assert not list(named.parent.glob(f"{named.name}*"))


# the poll of the run directory -----------------------------------------------------------


names = st.sampled_from(["node0.out", "node0.err", "node1.out", "gpu-7.err", "node0.exit", "batch.out"])
contents = st.binary(max_size=300)


@settings(max_examples=25, deadline=None)
@given(st.dictionaries(names, st.tuples(contents, contents), max_size=4))
def test_the_poll_reads_what_each_file_gained_since_its_offset(tmp_path_factory: pytest.TempPathFactory,
                                                               files: dict[str, tuple[bytes, bytes]]) -> None:
    directory = tmp_path_factory.mktemp("run")
    for name, (old, _) in files.items():
        (directory / name).write_bytes(old)
    offsets = {name: len(old) for name, (old, _) in files.items()}
    for name, (old, new) in files.items():
        (directory / name).write_bytes(old + new)
    out = subprocess.run(["sh", "-c", poll_command(str(directory), offsets, None)], capture_output=True).stdout
    got = {chunk.name: (chunk.offset, chunk.data) for chunk in parse_poll(out).chunks}
    assert got == {name: (len(old), new) for name, (old, new) in files.items() if new}


@given(st.lists(st.tuples(st.sampled_from(["a.out", "b.err"]), st.integers(0, 10**9), contents), max_size=5),
       st.integers(0, 2000))
def test_a_poll_cut_short_keeps_only_whole_frames(frames: list[tuple[str, int, bytes]], cut: int) -> None:
    data = b"".join(b"== file %s %d %d\n" % (name.encode(), offset, len(body)) + body for name, offset, body in frames)
    whole = parse_poll(data).chunks
    assert [(chunk.name, chunk.offset, chunk.data) for chunk in whole] == frames
    partial = parse_poll(data[:cut]).chunks
    assert list(partial) == list(whole[:len(partial)])


def test_the_poll_carries_squeues_answer_after_the_files() -> None:
    data = b"== file a.out 0 3\nx\ny== squeue\n42|RUNNING|2|n[0-1]|None\n"
    polled = parse_poll(data)
    assert [chunk.data for chunk in polled.chunks] == [b"x\ny"]
    assert polled.queue is not None and parse_squeue(polled.queue, "42") is not None
    assert "squeue -h -t all -j 42" in poll_command("~/r", {}, "42")
    assert "squeue" not in poll_command("~/r", {}, None)


def test_a_missing_run_directory_is_an_empty_poll() -> None:
    out = subprocess.run(["sh", "-c", poll_command("/nonexistent/torchherd", {}, None)], capture_output=True)
    assert out.returncode == 0 and parse_poll(out.stdout).chunks == ()


# SLURM's answers --------------------------------------------------------------------------


def test_job_ids_hostnames_and_exit_records() -> None:
    assert parse_job_id("42\n") == "42"
    assert parse_job_id("sbatch: warning: x\n1234;cluster\n") == "1234"
    with pytest.raises(ValueError):
        parse_job_id("sbatch: error: Batch job submission failed")
    assert parse_hostnames("node0\nnode1\n\n") == ("node0", "node1")
    assert parse_exit_file("n", "job 3 1700000000.123\n") is not None
    assert parse_exit_file("n", "job 3 1700000000.N\n").at == 1700000000.0  # type: ignore[union-attr]
    assert parse_exit_file("n", "garbage") is None


@pytest.mark.parametrize("state,phase", [("PENDING", "pending"), ("RUNNING", "running"), ("COMPLETING", "ending"),
                                         ("COMPLETED", "done"), ("CANCELLED by 0", "done"), ("FAILED", "done"),
                                         ("NODE_FAIL", "done"), ("", "unknown"), ("WHATEVER", "unknown")])
def test_job_states(state: str, phase: str) -> None:
    assert phase_of(state) == phase


def test_squeue_lines() -> None:
    found = parse_squeue("41|RUNNING|1|n0|None\n42|PENDING|2|(null)|ReqNodeNotAvail, UnavailableNodes:n1\n", "42")
    assert found is not None
    assert (found.state, found.reason, found.nodelist) == ("PENDING", "ReqNodeNotAvail, UnavailableNodes:n1", "")
    assert parse_squeue("slurm_load_jobs error: Invalid job id specified\n", "42") is None


@given(st.text(alphabet=st.characters(blacklist_characters="\n\r", blacklist_categories=("Cs",)), max_size=40))
def test_a_squeue_reason_may_hold_anything_but_a_line_break(reason: str) -> None:
    found = parse_squeue(f"7|PENDING|1|n0|{reason}\n", "7")
    assert found is not None and found.nodelist == "n0"
    assert found.reason == ("" if reason.strip() in ("None", "(null)") else reason.strip())


def test_sacct_then_scontrol() -> None:
    sacct = parse_sacct("42|CANCELLED by 0|0:15|node[0-2]\n", "42")
    assert sacct is not None and (sacct.state, sacct.exit_code, sacct.signal) == ("CANCELLED by 0", 0, 15)
    scontrol = ("JobId=42 JobName=torchherd-th-x UserId=root(0) JobState=FAILED Reason=NonZeroExitCode "
                "Dependency=(null) ExitCode=1:0 NodeList=node[0-2] Command=/root/a b/job.sbatch WorkDir=/root/a b")
    final = parse_final_state(scontrol, "42")
    assert final is not None
    assert (final.state, final.reason, final.exit_code, final.nodelist) == ("FAILED", "NonZeroExitCode", 1, "node[0-2]")
    assert parse_final_state("slurm_load_jobs error: Invalid job id specified", "42") is None
    assert "sacct -n -P -X -j 42" in final_state_command("42") and "scontrol show job -o 42" in final_state_command("42")


keys = st.from_regex(r"[A-Z][A-Za-z0-9_:/]{0,12}", fullmatch=True)
values = st.one_of(st.just(""), st.from_regex(r"[a-z0-9()\[\],.:/-]{1,10}( [a-z0-9()]{1,6})?", fullmatch=True))


@given(st.dictionaries(keys, values, min_size=1, max_size=8))
def test_scontrol_pairs_round_trip(pairs: dict[str, str]) -> None:
    text = " ".join(f"{key}={value}" for key, value in pairs.items())
    assert parse_scontrol(text) == pairs


# SLURM's own view, for check --------------------------------------------------------------


SINFO = """node0|main*|up|idle|2|(null)|none
node1|main*|up|drained|8|gpu:a100:4(S:0-1)|fan failure, ticket 42
node2|main*|up|mixed|2|gpu:2,mps:100|none
node3|debug|down|down*|8|(null)|Not responding
"""


def test_sinfo_rows_and_gres() -> None:
    rows = parse_sinfo(SINFO)
    assert [row.node for row in rows] == ["node0", "node1", "node2", "node3"]
    assert rows[0].default and not rows[3].default and rows[3].partition == "debug"
    assert [row.gpus for row in rows] == [0, 4, 2, 0]
    assert rows[1].reason == "fan failure, ticket 42" and rows[0].reason == ""
    assert gres_gpus("gpu:tesla:2,gpu:k80:1") == 3
    assert [node_condition(state) for state in ("idle", "mixed", "allocated", "drained", "draining", "down*",
                                                "idle*", "completing")] == [
        "usable", "busy", "busy", "bad", "bad", "bad", "bad", "busy"]


def _by(results: list[CheckResult], node: str, check: str) -> CheckResult:
    return next(result for result in results if (result.node, result.check) == (node, check))


def test_a_drained_node_the_job_names_fails_with_slurms_reason() -> None:
    results = slurm_view(parse_sinfo(SINFO), SlurmSettings(partition="main"), Placement(3, "node[0-2]", "[slurm]"), 2)
    drained = _by(results, "node1", "slurm-node")
    assert drained.status == "fail" and drained.summary == "node1 is drained (fan failure, ticket 42)"
    assert _by(results, "node2", "slurm-node").status == "warn"
    assert _by(results, "cluster", "slurm").summary.startswith("partition main is up: 3 nodes")


def test_with_a_count_only_slurm_picks_around_a_drained_node() -> None:
    results = slurm_view(parse_sinfo(SINFO), SlurmSettings(), Placement(2, None, "[slurm]"), 2)
    assert _by(results, "node1", "slurm-node").status == "warn"
    assert not any(result.status == "fail" for result in results), results
    too_many = slurm_view(parse_sinfo(SINFO), SlurmSettings(), Placement(3, None, "[slurm]"), 2)
    assert any(result.status == "fail" and "needs 3 nodes; 2" in result.summary for result in too_many)


def test_partitions_gres_and_cpus() -> None:
    rows = parse_sinfo(SINFO)
    assert _by(slurm_view(rows, SlurmSettings(partition="gpu"), Placement(1, None, "x"), 1), "cluster",
               "slurm").status == "fail"
    assert _by(slurm_view(rows, SlurmSettings(partition="debug"), Placement(1, None, "x"), 1), "cluster",
               "slurm").summary == "partition debug is down"
    gres = slurm_view(rows, SlurmSettings(gpus_per_node=4), Placement(None, "node[1-2]", "x"), 4)
    assert _by(gres, "node1", "gres").status == "pass"
    assert _by(gres, "node2", "gres").status == "fail"
    assert _by(slurm_view(rows, SlurmSettings(), Placement(None, "node0", "x"), 4), "node0", "gres").status == "fail"
    assert _by(slurm_view(rows, SlurmSettings(), Placement(None, "node0", "x"), "gpu"), "node0",
               "gres").status == "fail"
    unknown = slurm_view(rows, SlurmSettings(), Placement(None, "node9", "x"), 1)
    assert _by(unknown, "node9", "slurm-node").status == "fail"


def test_node_info_is_frozen() -> None:
    row = NodeInfo("n", "p", True, "up", "idle", 2, 0, "")
    with pytest.raises(AttributeError):
        row.state = "down"  # type: ignore[misc]


def test_checks_allocation_is_shaped_like_the_job_and_its_steps_overlap() -> None:
    job = batch_job(plan(2), SlurmSettings(partition="main", account="ml"))
    command = shlex.split(salloc_command(job, 30))
    assert command[:4] == ["salloc", "--no-shell", "--immediate=30", "--job-name=torchherd-check-th-test"]
    assert "--partition=main" in command and "--account=ml" in command and "--nodelist=node0,node1" in command
    assert "--time=5" in command and not any(item.startswith("--output=") for item in command)
    timed = batch_job(plan(2), SlurmSettings(time="1:00"))
    assert "--time=5" not in salloc_command(timed, 30) and "--time=1:00" in salloc_command(timed, 30)
    assert parse_salloc("salloc: Granted job allocation 43\n") == "43"
    assert parse_salloc("salloc: error: Unable to allocate resources: Requested nodes are busy\n") is None
    step = shlex.split(step_command("43", "node1", "echo 'a b'", unbuffered=True))
    assert step[:7] == ["srun", "--jobid=43", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=node1", "--quiet"]
    assert step[-4:] == ["--unbuffered", "bash", "-c", "echo 'a b'"]


@pytest.mark.parametrize("argument", ["1\n#SBATCH --partition=evil", "1\r\n#SBATCH --partition=evil",
                                      "1\u2028#SBATCH --partition=evil", "1\x85#SBATCH --partition=evil"])
def test_a_line_break_in_an_argument_cannot_add_an_sbatch_directive(argument: str) -> None:
    cluster = Cluster(["node0", "node1"], python="/venv/bin/python", scheduler="slurm")
    job = batch_job(cluster.plan("train.py", "--lr", argument, run_id="th-test"), SlurmSettings())
    # sbatch reads directives up to the first line that is not a comment; a line ends at "\n"
    header = list(itertools.takewhile(lambda line: line.startswith("#") or not line.strip(), job.script.split("\n")))
    assert not any("--partition=evil" in line for line in header if line.startswith("#SBATCH"))
    comment = next(line for line in header if line.startswith("# torchherd run th-test: "))
    assert "#SBATCH --partition=evil" in comment  # shown, escaped, on the comment's own line
    assert "\r" not in comment and "\u2028" not in comment and "\x85" not in comment


@pytest.mark.parametrize("nodelist, message, hint", [
    pytest.param("gpu[01-02],gpu02", "h.toml: [slurm].nodelist: node 'gpu02' is listed twice", "list every node once",
                 id="listed-twice"),
    pytest.param("n[1-3],n[2-4]", "h.toml: [slurm].nodelist: node 'n2' is listed twice", "list every node once",
                 id="ranges-overlap"),
    pytest.param("/shared/nodes.txt", "h.toml: [slurm].nodelist: '/shared/nodes.txt' names a file (sbatch reads it "
                 "as one); torchherd needs the nodes themselves", 'write them as a nodeset, e.g. "gpu[01-04],cpu7"',
                 id="a-file"),
])
def test_a_nodelist_sbatch_would_read_otherwise_is_refused_in_one_line(nodelist: str, message: str,
                                                                     hint: str) -> None:
    """sbatch counts a node listed twice once (a retry that excludes gpu01 would ask for
    --nodes=3 --nodelist=gpu02,gpu02), and reads a nodelist with a "/" as a file of names."""
    from torchherd.engine.slurm.settings import parse_slurm
    from torchherd.errors import InventoryError

    with pytest.raises(InventoryError) as refused:
        parse_slurm({"nodelist": nodelist}, Path("h.toml"), "[slurm].")
    assert (str(refused.value), refused.value.hint) == (message, hint)
    assert parse_slurm({"nodelist": "gpu[01-02],gpu03"}, Path("h.toml"), "[slurm].").nodelist == "gpu[01-02],gpu03"
