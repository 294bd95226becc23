"""Scripts that resume their own way (``[recovery] resume_args``, ``run --resume-args``):
an attempt that starts from a staged checkpoint adds the words to the script's arguments
(nanoGPT's ``--init_from=resume``, which fails on a first start), and every rank of it
gets the checkpoint's path in ``TORCHHERD_CHECKPOINT``, on each node that holds it.

Never on attempt 1, nor on an attempt with no checkpoint (none found on any node, or no
scheduler to stage it): the job then starts as it did the first time. The words go into
the attempt's plan as script arguments (``RunOptions.script_args``), so each backend
renders them as it renders the script's own (SSH: the supervisor's argv; SLURM: shell
words of the batch script, each shlex-quoted): nothing reads a command line back.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace
from typing import Final, Sequence

from torchherd.engine.events import CheckpointMissing, CheckpointStaged
from torchherd.inventory import Host, Recovery
from torchherd.plan import RunOptions
from torchherd.remote import wire

CHECKPOINT_ENV: Final = "TORCHHERD_CHECKPOINT"
"""The staged checkpoint's path on the node (relative to the workdir, the job's working
directory; a glob's: the match staged), on an attempt that starts from it."""


@dataclass(frozen=True)
class Resume:
    """How an attempt starts from the staged checkpoint: the words added after the script's
    own arguments, the checkpoint's path (relative to the workdir), and the nodes that hold
    it (those the copy failed to reach do not)."""

    args: tuple[str, ...]
    path: str
    holders: frozenset[str]


def resume_of(staged: CheckpointStaged | CheckpointMissing | None, recovery: Recovery,
              nodes: Sequence[str]) -> Resume | None:
    """How the attempt on ``nodes`` starts after ``staged`` (the staging before it): from the
    checkpoint where one was found, else (None) as the first did."""
    if not isinstance(staged, CheckpointStaged):
        return None
    failed = {node for node, _why in staged.failed}
    return Resume(recovery.resume_args, staged.path, frozenset(node for node in nodes if node not in failed))


def resumed_host(host: Host, resume: Resume | None) -> Host:
    """``host`` with ``TORCHHERD_CHECKPOINT`` in its ranks' environment where it holds the checkpoint."""
    if resume is None or host.name not in resume.holders:
        return host
    return replace(host, env={**host.env, CHECKPOINT_ENV: resume.path})


def resumed_options(options: RunOptions, resume: Resume | None) -> RunOptions:
    """``options`` with the resume words after the script's own arguments."""
    if resume is None or not resume.args:
        return options
    return replace(options, script_args=(*options.script_args, *resume.args))


def resume_lines(options: RunOptions, recovery: Recovery) -> tuple[str, ...]:
    """What ``run --dry-run`` adds under the plan, for a run with retries: each attempt's
    variables, and the script's command line on an attempt that starts from the checkpoint."""
    if not recovery.retries:
        return ()
    lines = [f"with retries: every rank gets {wire.ATTEMPT_ENV} (1, 2, ...)"]
    if recovery.checkpoint is None:
        return tuple(lines)
    line = (f"an attempt that starts from the staged checkpoint ({recovery.checkpoint}) also gets {CHECKPOINT_ENV} "
            "(the copy's path, relative to the workdir)")
    if recovery.resume_args:
        words = [*(["-m"] if options.module else []), options.script, *options.script_args, *recovery.resume_args]
        line += f", and runs {shlex.join(words)}"
    return (*lines, line)
