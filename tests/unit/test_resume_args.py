"""Scripts that resume their own way (``[recovery] resume_args``, ``run --resume-args``,
``Recovery(resume_args=...)``): one rule from every door, the words on an attempt that
starts from the staged checkpoint only (the attempts' plans on a fake backend), rendered
by each backend as the script's own arguments, and shown by ``--dry-run``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from io import StringIO
from pathlib import Path
from typing import Callable, Sequence

import pytest
from tests.support.recovery import FakeBackend, ended, plan_of, recover

from support.cli import THREE_HOSTS
from support.cli import option_lines as cli
from torchherd import Cluster, Recovery
from torchherd.cli import main
from torchherd.cli.run import glued
from torchherd.console import make_console
from torchherd.engine.events import CheckpointMissing, CheckpointStaged
from torchherd.engine.recovery.resume import CHECKPOINT_ENV, Resume, resume_of
from torchherd.engine.recovery.runner import attempt_plan
from torchherd.engine.slurm.batch import batch_job
from torchherd.engine.slurm.settings import SlurmSettings
from torchherd.errors import UsageError
from torchherd.inventory.options import RESUME_ARGS
from torchherd.plan import Plan

HOSTS = THREE_HOSTS
EXPECTED = {"flag": "expected the script's arguments on a resumed attempt, as a shell splits them (e.g. "
                    "--init_from=resume)",
            "file": "expected the script's arguments on a resumed attempt: one string, as a shell splits it, or a "
                    "list of strings",
            "argument": "expected the script's arguments on a resumed attempt: a tuple of strings, or one string, as "
                        "a shell splits it"}



def api_error(recovery: Recovery) -> UsageError:
    made = Cluster.from_hosts("192.0.2.1,192.0.2.2", python="/p", workdir="/w")
    with pytest.raises(UsageError) as raised:
        made.launch(made.plan("t.py"), recovery=recovery, check=False)
    return raised.value


# ------------------------------------------------------------------ one rule, every door


def test_unbalanced_quotes_get_one_verdict_from_every_door(tmp_path: Path) -> None:
    code, out = cli(tmp_path, ["run", "--retries", "1", "--checkpoint", "s.pt", "--resume-args", '--a "b', "--",
                               "t.py"])
    assert (code, out[0]) == (2, f"error: torchherd run: argument --resume-args: {EXPECTED['flag']}, got '--a \"b'")
    code, out = cli(tmp_path, ["run", "--dry-run", "--", "t.py"],
                    '[recovery]\ncheckpoint = "s.pt"\nresume_args = \'--a "b\'\n')
    assert (code, out) == (2, [f"error: hosts.toml: [recovery].resume_args: {EXPECTED['file']}, got a string "
                               "'--a \"b'", '  hint: write resume_args = "--init_from=resume"'])
    error = api_error(Recovery(retries=1, checkpoint="s.pt", resume_args='--a "b'))  # type: ignore[arg-type]
    assert str(error) == f"Recovery(resume_args='--a \"b'): {EXPECTED['argument']}, got '--a \"b'"
    assert error.hint == 'e.g. "--init_from=resume" (quoted as a shell quotes: its quotes balanced)'


@pytest.mark.parametrize("value", ["", "   ", [], ["--x", 3], 7, ["a\0b"]])
def test_no_words_or_a_word_no_command_line_can_hold_is_refused(value: object) -> None:
    assert RESUME_ARGS.kind.value(value) is None


def test_the_same_words_from_every_door(tmp_path: Path) -> None:
    words = ("--init_from=resume", "--out_dir", "out dir")
    text = "--init_from=resume --out_dir 'out dir'"
    assert RESUME_ARGS.from_flag(text) == RESUME_ARGS.from_argument(text) == RESUME_ARGS.from_argument(words) == words
    for inventory in (f'[recovery]\nresume_args = "{text}"\n', f"[recovery]\nresume_args = {json.dumps(words)}\n"):
        path = tmp_path / "hosts.toml"
        path.write_text('[recovery]\ncheckpoint = "s.pt"\n' + inventory.removeprefix("[recovery]\n") + HOSTS,
                        encoding="utf-8")
        assert Cluster.from_toml(path).recovery.resume_args == words


def test_they_need_a_checkpoint_and_from_a_run_retries(tmp_path: Path) -> None:
    code, out = cli(tmp_path, ["run", "--retries", "1", "--resume-args", "--init_from=resume", "--", "t.py"])
    assert (code, out) == (2, ["error: --resume-args: they are added on an attempt that starts from the staged "
                               "checkpoint, and none is named",
                               "  hint: add --checkpoint PATH (or checkpoint in [recovery])"])
    code, out = cli(tmp_path, ["run", "--dry-run", "--resume-args", "--init_from=resume", "--", "t.py"],
                    '[recovery]\ncheckpoint = "s.pt"\n')
    assert (code, out) == (2, ["error: --resume-args: they are added on a new attempt, and without retries there is "
                               "none", "  hint: add --retries N (or retries in [recovery])"])
    code, out = cli(tmp_path, ["hosts"], '[recovery]\nresume_args = "--init_from=resume"\n')
    assert (code, out[:2]) == (2, ["error: hosts.toml: [recovery].resume_args: they are added on an attempt that "
                                   "starts from the staged checkpoint, and [recovery].checkpoint names none",
                                   '  hint: add checkpoint = "PATH" to [recovery] (e.g. "snapshot.pt"), or remove '
                                   "resume_args"])
    error = api_error(Recovery(retries=1, resume_args="--init_from=resume"))  # type: ignore[arg-type]
    assert str(error) == ("Recovery(resume_args='--init_from=resume'): they are added on an attempt that starts from "
                          "the staged checkpoint, and none is named")
    assert error.hint == "pass Recovery(checkpoint=PATH) too"


def test_a_value_starting_with_a_dash_is_the_flags_and_after_the_separator_all_is_the_scripts() -> None:
    assert glued(["run", "--resume-args", "--init_from=resume", "--", "t.py", "--resume-args", "--x"]) == [
        "run", "--resume-args=--init_from=resume", "--", "t.py", "--resume-args", "--x"]
    assert glued(["run", "--resume-args", "resume", "t.py"]) == ["run", "--resume-args", "resume", "t.py"]
    assert glued(["run", "--resume-args"]) == ["run", "--resume-args"]


# ------------------------------------------------------------------ the attempts


@dataclass
class Staging(FakeBackend):
    """Each staging answers ``answer`` (the nodes it reached, those it did not)."""

    answer: Callable[[int, Sequence[str]], CheckpointStaged | CheckpointMissing] = (
        lambda attempt, receivers: CheckpointStaged(attempt, "ckpt/step-7.pt", 10, "node0", (), 0.1))

    def stage_checkpoint(self, plan: Plan, sources: Sequence[str], receivers: Sequence[str], path: str,
                         attempt: int, stopping: Callable[[], bool] = lambda: False,
                         ) -> CheckpointStaged | CheckpointMissing:
        return self.answer(attempt, receivers)


def tail(plan: Plan, node: int = 0) -> tuple[str, ...]:
    argv = plan.nodes[node].argv
    return argv[argv.index("--"):]


def test_attempt_1_runs_without_them_and_an_attempt_from_the_checkpoint_with_them() -> None:
    failed = CheckpointStaged(2, "ckpt/step-7.pt", 10, "node0", ("node2",), 0.1, (("node1", "disk full"),))
    backend = Staging([lambda plan: ended(plan, "node1"), lambda plan: ended(plan, None)],
                      answer=lambda attempt, receivers: failed)
    summary, _ = recover(backend, plan_of(), Recovery(retries=1, checkpoint="ckpt/step-*.pt",
                                                      resume_args=("--init_from=resume", "a b")))
    assert summary.exit_code == 0
    first, second = backend.launched
    assert tail(first) == ("--", "train.py")
    assert [node.env.get(CHECKPOINT_ENV) for node in first.nodes] == [None, None, None]
    assert [node.env["TORCHHERD_ATTEMPT"] for node in first.nodes + second.nodes] == ["1"] * 3 + ["2"] * 3
    assert [tail(second, index) for index in range(3)] == [("--", "train.py", "--init_from=resume", "a b")] * 3
    # the node the copy did not reach holds none: no path for it
    assert [node.env.get(CHECKPOINT_ENV) for node in second.nodes] == ["ckpt/step-7.pt", None, "ckpt/step-7.pt"]
    assert "'a b'" in second.nodes[0].shell_line()


def test_an_attempt_with_no_checkpoint_found_starts_as_the_first() -> None:
    backend = Staging([lambda plan: ended(plan, "node1"), lambda plan: ended(plan, "node2", error="rank 2: OSError"),
                       lambda plan: ended(plan, None)],
                      answer=lambda attempt, receivers: (CheckpointMissing(attempt, "found on none") if attempt == 2
                                                         else CheckpointStaged(attempt, "s.pt", 10, "node0", (), 0.1)))
    summary, _ = recover(backend, plan_of(), Recovery(retries=2, checkpoint="s.pt", resume_args=("--resume",)))
    assert summary.exit_code == 0
    assert [tail(plan) for plan in backend.launched] == [("--", "train.py"), ("--", "train.py"),
                                                         ("--", "train.py", "--resume")]
    assert [plan.nodes[0].env.get(CHECKPOINT_ENV) for plan in backend.launched] == [None, None, "s.pt"]


def test_without_resume_args_the_checkpoint_is_still_named() -> None:
    backend = Staging([lambda plan: ended(plan, "node1"), lambda plan: ended(plan, None)])
    recover(backend, plan_of(), Recovery(retries=1, checkpoint="ckpt/step-*.pt"))
    assert tail(backend.launched[1]) == ("--", "train.py")
    assert backend.launched[1].nodes[2].env[CHECKPOINT_ENV] == "ckpt/step-7.pt"


def test_resume_of_reads_the_staging() -> None:
    recovery = Recovery(retries=1, checkpoint="s.pt", resume_args=("--r",))
    assert resume_of(None, recovery, ("a",)) is None
    assert resume_of(CheckpointMissing(2, "none"), recovery, ("a",)) is None
    staged = CheckpointStaged(2, "s.pt", 1, "a", ("b",), 0.1, (("c", "full"),))
    assert resume_of(staged, recovery, ("a", "b", "c")) == Resume(("--r",), "s.pt", frozenset({"a", "b"}))


# ------------------------------------------------------------------ each backend renders them


def test_the_slurm_batch_script_has_them_as_shell_quoted_words() -> None:
    made = Cluster(["node0", "node1"], scheduler="slurm", python="/opt/venv/bin/python", workdir="/proj",
                   slurm={"partition": "main"})
    base = made.plan("train.py", "--x", run_id="th-test", nproc_per_node=1)
    resume = Resume(("--init_from=resume", "$(touch /tmp/pwned)", "a b"), "s.pt", frozenset())
    job = batch_job(attempt_plan(base, ("node0", "node1"), 2, resume=resume), SlurmSettings(partition="main"))
    assert ("-- train.py --x --init_from=resume '\"'\"'$(touch /tmp/pwned)'\"'\"' '\"'\"'a b'\"'\"'"
            in job.script), job.script
    assert "export TORCHHERD_ATTEMPT=2\n" in job.script


# ------------------------------------------------------------------ --dry-run


def test_dry_run_shows_them_under_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = cli(tmp_path, ["run", "--dry-run", "--retries", "2", "--checkpoint", "s.pt", "--resume-args",
                               "--init_from=resume", "--", "train.py", "config/a b.py"])
    assert code == 0 and out[-4:] == [
        "  - PYTHONUNBUFFERED=1 so each line reaches the controller as it is printed",
        "  - with retries: every rank gets TORCHHERD_ATTEMPT (1, 2, ...)",
        "  - an attempt that starts from the staged checkpoint (s.pt) also gets TORCHHERD_CHECKPOINT (the copy's "
        "path, relative to the workdir), and runs train.py 'config/a b.py' --init_from=resume",
        "dry run: nothing was started"], out
    capsys.readouterr()
    code, out = cli(tmp_path, ["run", "--dry-run", "--json", "--retries", "2", "--checkpoint", "s.pt",
                               "--resume-args=--init_from=resume", "--", "train.py"])
    assert code == 0 and json.loads(capsys.readouterr().out)["recovery"] == {
        "retries": 2, "attempt_env": "TORCHHERD_ATTEMPT", "checkpoint": "s.pt", "checkpoint_env": "TORCHHERD_CHECKPOINT",
        "resume_args": ["--init_from=resume"]}
    code, out = cli(tmp_path, ["run", "--dry-run", "--", "train.py"])
    assert code == 0 and out[-1] == "dry run: nothing was started" and "TORCHHERD_ATTEMPT" not in "\n".join(out)


def test_slurm_refuses_them_first_from_the_flag_and_the_api(tmp_path: Path) -> None:
    """No checkpoint is staged on SLURM: the refusal comes before the rule's hint, which would
    ask for a --checkpoint that SLURM refuses in turn."""
    path = tmp_path / "hosts.toml"
    path.write_text('[cluster]\nscheduler = "slurm"\n[slurm]\nlogin = "login1"\nnodes = 2\n'
                    '[defaults]\npython = "/p"\nworkdir = "/w"\n', encoding="utf-8")
    out = StringIO()
    code = main(["-i", str(path), "run", "--retries", "1", "--resume-args", "--init_from=resume", "--", "t.py"],
                console=make_console(out, width=400))
    refused = ["error: --resume-args: not for SLURM runs (they are added on an attempt from a checkpoint torchherd "
               "staged, and it stages none there)",
               "  hint: leave --resume-args out; the script can read TORCHHERD_ATTEMPT (2 and up: a new attempt) and "
               "look for its checkpoint on the shared filesystem"]
    assert (code, out.getvalue().splitlines()) == (2, refused)
    made = Cluster.from_toml(path)
    with pytest.raises(UsageError) as raised:
        made.launch(made.plan("t.py"), recovery=Recovery(retries=1, resume_args=("--r",)), check=False)
    assert str(raised.value) == refused[0].removeprefix("error: ")
