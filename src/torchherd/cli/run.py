"""``torchherd run``: check, then launch the job on every node (or describe it:
``--dry-run``), with torchrun's flags, the output's and recovery's."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Sequence

from torchherd.cli.cluster import cluster_of
from torchherd.cli.contract import emit
from torchherd.cli.flags import (
    add_container_flags,
    add_host_flags,
    add_place_flags,
    add_scheduler_flags,
    add_sync_flag,
    flag_groups,
    sync_choices,
)
from torchherd.cli.values import (
    bandwidth,
    checkpoint,
    exit_codes,
    extra_env,
    grace,
    hang_timeout,
    id_list,
    max_restarts,
    min_nodes,
    monitor_interval,
    nnodes,
    replicate,
    resume_args,
    retries,
    straggler_window,
)
from torchherd.errors import EXIT_FAILED, EXIT_OK, UsageError
from torchherd.inventory.options import recovery_problem

if TYPE_CHECKING:
    from rich.console import Console

    from torchherd.api import Cluster
    from torchherd.console.view import ViewOptions
    from torchherd.inventory import Recovery
    from torchherd.plan import Plan


RESUME_ARGS_FLAG = "--resume-args"


def glued(words: Sequence[str]) -> list[str]:
    """``--resume-args VALUE`` as ``--resume-args=VALUE`` where VALUE starts with a dash
    (``"--init_from=resume"``, nanoGPT's): argparse takes such a word for a flag of its own
    and says the flag has no value. Only before a ``--``: after it all is the script's."""
    given = list(words)
    for index, word in enumerate(given[:-1]):
        if word == "--":
            break
        if word == RESUME_ARGS_FLAG and given[index + 1].startswith("-"):
            return given[:index] + [f"{word}={given[index + 1]}"] + glued(given[index + 2:])
    return given


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    from torchherd.api import DetachedRun
    from torchherd.console.observer import ConsoleObserver
    from torchherd.console.run import render_description
    from torchherd.engine.run import sigterm_as_interrupt
    from torchherd.plan import parse_env_assignments

    cluster = cluster_of(args)
    if args.spares is not None:
        cluster = cluster.with_spares(args.spares)
    if not args.script:
        raise UsageError("run: no training script given", "torchherd run [options] -- train.py [args...]")
    script, *script_args = args.script
    sync_choices(args, bool(args.sync) or (args.sync is None and cluster.inventory.sync is not None))
    # --nproc-per-node is already every host's count (hosts_of); --include/--exclude slots may have changed some since
    plan = cluster.plan(script, *script_args, nnodes=args.nnodes,
                        module=args.module, env=extra_env(args.env, args.env_pass, parse_env_assignments),
                        master_addr=args.master_addr, max_restarts=args.max_restarts,
                        monitor_interval=args.monitor_interval, rdzv_conf=args.rdzv_conf,
                        rdzv_backend=args.rdzv_backend, sync=args.sync, sync_include=args.sync_include,
                        sync_anyway=args.sync_anyway, uv=args.uv,
                        uv_system_site_packages=args.uv_system_site_packages, uv_offline=args.uv_offline)
    _ranks_exist(args.ranks, plan)
    _script_in_project(plan, cluster)
    only, skip = _run_checks(args, cluster)
    recovery = _recovery(args, cluster)
    if args.dry_run:
        from torchherd.engine.recovery.resume import resume_lines

        described = cluster.describe(plan, fail_fast=not args.no_fail_fast)
        if args.json:  # the plan only: what --sync would send needs the nodes asked (run --sync --dry-run)
            from torchherd.console.run import plan_json

            emit(args, {**plan_json(described), **_recovery_json(recovery)})
            return EXIT_OK
        render_description(console, described, resume_lines(plan.options, recovery))
        return _dry_sync(cluster, plan, console, args.log_dir) if plan.sync is not None else EXIT_OK
    if args.json:
        from torchherd.console import make_console

        if args.detach:
            raise UsageError("--json with --detach: a detached run has no summary yet when run returns",
                             "leave out --json, and read the run with `torchherd status RUN`")
        console = make_console(stderr=True)  # stdout: the JSON summary only
    observer = ConsoleObserver(console, view=_view_options(args, console))
    try:
        launched = cluster.launch(plan, log_dir=args.log_dir, on_event=observer, check=not args.no_check,
                                  only=only, skip=skip,
                                  grace=args.grace, fail_fast=not args.no_fail_fast, detach=bool(args.detach),
                                  recovery=recovery, straggler_window=args.straggler_window)
        if isinstance(launched, DetachedRun):
            from torchherd.console.detach import render_started

            render_started(console, launched.record)
            return EXIT_OK
        with sigterm_as_interrupt():
            summary = launched.wait()
        if args.json:
            emit(args, {"ok": summary.exit_code == EXIT_OK, **summary.as_json()})
        return summary.exit_code
    finally:
        observer.close()  # the panel goes, whichever way the command leaves


def _script_in_project(plan: Plan, cluster: Cluster) -> None:
    """With --sync the job runs from the synced project's root on every node: a script the
    project does not hold is said here, before anything is sent (not by every node after);
    a backend that takes no --sync says so first."""
    import os
    from pathlib import Path

    script = plan.script
    if plan.sync is None or script is None or os.path.isabs(script):
        return
    cluster.backend.allow("--sync", True)
    source = Path(plan.sync.source)
    if (source / script).is_file():
        return
    here = Path(script).resolve()
    hint = (f"the job runs from the project's root on every node: name it {os.path.relpath(here, source)}"
            if here.is_file() and here.is_relative_to(source) else
            f"the job runs from the project's root on every node: name the script relative to {source}")
    raise UsageError(f"{script}: not in the synced project {source}", hint)


def _recovery(args: argparse.Namespace, cluster: Cluster) -> Recovery:
    """The inventory's [recovery] table, each flag given overriding its key."""
    from dataclasses import replace

    recovery = cluster.recovery
    given = {key: value for key, value in (("retries", args.retries), ("final_exit_codes", args.final_exit_codes),
                                           ("min_nodes", args.min_nodes), ("hang_timeout", args.hang_timeout),
                                           ("checkpoint", args.checkpoint), ("replicate", args.replicate),
                                           ("replicate_bandwidth", args.replicate_bandwidth),
                                           ("resume_args", args.resume_args), ("warm", args.warm))
             if value is not None}
    recovery = replace(recovery, **given) if given else recovery
    # A scheduler that cannot honour them says so first: the rule's hint would ask for a
    # --checkpoint it refuses in turn.
    cluster.backend.allow("--resume-args", "resume_args" in given or bool(recovery.resume_args and recovery.retries))
    problem = recovery_problem(recovery, tuple(given), "flag", detached=bool(args.detach))
    if problem is not None:
        raise problem
    return recovery


def _recovery_json(recovery: Recovery) -> dict[str, object]:
    """``run --dry-run --json``'s word on the attempts after the first (with retries only):
    the variables each rank gets, and the words added on an attempt from the checkpoint."""
    if not recovery.retries:
        return {}
    from torchherd.engine.recovery.resume import CHECKPOINT_ENV
    from torchherd.remote.wire import ATTEMPT_ENV

    return {"recovery": {"retries": recovery.retries, "attempt_env": ATTEMPT_ENV, "checkpoint": recovery.checkpoint,
                         "checkpoint_env": CHECKPOINT_ENV if recovery.checkpoint is not None else None,
                         "resume_args": list(recovery.resume_args)}}


def _dry_sync(cluster: Cluster, plan: Plan, console: Console, log_dir: str) -> int:
    """``run --sync --dry-run``: asks every node what it has (changing nothing) and lists
    what would be sent and deleted; 1 when a node could not answer."""
    from torchherd.console.sync import render_sync_plan

    done = cluster.sync(plan=plan, dry_run=True, log_dir=log_dir)
    render_sync_plan(console, done)
    return EXIT_OK if done.ok else EXIT_FAILED


def _view_options(args: argparse.Namespace, console: Console) -> ViewOptions:
    """The live panel on a terminal (not with --plain), duplicates collapsed where it is
    (--collapse / --no-collapse decide), and the terminal's rank filter."""
    from torchherd.console.collapse import parse_ranks
    from torchherd.console.view import ViewOptions

    ranks = parse_ranks(args.ranks) if args.ranks is not None else None
    return ViewOptions.choose(console, plain=args.plain, collapse=args.collapse, ranks=ranks,
                              straggler_window=args.straggler_window)


def _run_checks(args: argparse.Namespace, cluster: Cluster) -> tuple[frozenset[str] | None, frozenset[str]]:
    """run's --only and --skip: the preflight's check ids (SLURM's view takes neither)."""
    from torchherd.checks.model import CHECK_IDS

    given = [flag for flag, value in (("--only", args.only), ("--skip", args.skip)) if value is not None]
    if given and args.no_check:
        raise UsageError(f"{given[0]} with --no-check: no check runs", f"leave out {given[0]} or --no-check")
    for flag in given:
        cluster.backend.allow(flag, True)
    return id_list(args.only, "--only", CHECK_IDS), id_list(args.skip, "--skip", CHECK_IDS) or frozenset()


def _ranks_exist(text: str | None, plan: Plan) -> None:
    """--ranks naming a rank the job does not have would show nothing of it, silently: refused
    where the plan knows the world size (not where a node counts its GPUs at the start)."""
    from torchherd.console.collapse import parse_ranks

    size = plan.world_size
    if text is None or size is None:
        return
    missing = sorted(rank for rank in parse_ranks(text) if rank >= size)
    if missing:
        raise UsageError(f"--ranks {text}: the job has no rank {missing[0]} (its ranks are 0 to {size - 1})",
                         f"name ranks below the world size, {size}")


def _add_recovery_flags(group: argparse._ActionsContainer) -> None:
    group.add_argument("--retries", type=retries, metavar="N",
                       help="after a failed attempt, triage the nodes and try again, up to N times (default: 0)")
    group.add_argument("--final-exit-codes", type=exit_codes, metavar="CODE,...",
                       help="exit codes that end the run at once, without a retry, e.g. 2 for bad arguments "
                            "(default: none)")
    group.add_argument("--spares", metavar="NODESET",
                       help="these hosts are spares: checked, not launched, until one takes an excluded node's place "
                            "(default: none)")
    group.add_argument("--min-nodes", type=min_nodes, metavar="K",
                       help="with no spare left, go on with fewer nodes, down to K (default: never shrink)")
    group.add_argument("--hang-timeout", type=hang_timeout, metavar="S",
                       help="no rank printed and none used CPU for S seconds: the job is hung; every rank's stack is "
                            "taken and the summary names the rank that differs (default: off)")
    group.add_argument("--checkpoint", type=checkpoint, metavar="PATH",
                       help="before each new attempt, put the newest copy of PATH (relative to the workdir; a glob: "
                            "its newest match) on every node that lacks it, copied node to node (default: "
                            "[recovery].checkpoint, else none)")
    group.add_argument("--replicate", type=replicate, metavar="K",
                       help="copy each new checkpoint, once complete, to the next K nodes in the ring while the job "
                            "runs, so losing the node that wrote it loses nothing (default: 1 with a checkpoint; "
                            "0: off)")
    group.add_argument("--replicate-bandwidth", type=bandwidth, metavar="CAP",
                       help='the most a replica\'s copy takes of the link: "25%%" of its speed, or a rate such as '
                            '"200MB/s" (default: auto, 25%% of the link and at most 5 MB/s per CPU core)')
    group.add_argument(RESUME_ARGS_FLAG, type=resume_args, metavar="ARGS",
                       help='add these to the script\'s arguments on an attempt that starts from the staged checkpoint, '
                            'split as a shell splits them, e.g. "--init_from=resume" (never on attempt 1, nor without '
                            'a checkpoint; default: [recovery].resume_args, else none)')
    group.add_argument("--no-warm", dest="warm", action="store_const", const=False, default=None,
                       help="start cold: no warm Python per node (torch imported beside the preflight, or by "
                            "torchrun itself) from which the torchrun and ranks of the run (each attempt's) fork "
                            "(default: [recovery].warm, else warm)")


RUN_EXAMPLES = """\
examples:
  torchherd run -H localhost --nproc-per-node 2 -- train.py --steps 20   # this machine, no SSH
  torchherd run -H gpu01,gpu02 --python /opt/venv/bin/python --nproc-per-node gpu --sync -- train.py
  torchherd run --dry-run -i hosts.toml -- train.py       # each node's command; nothing starts"""


def add_run(commands: argparse._SubParsersAction[argparse.ArgumentParser],
             inventory: argparse.ArgumentParser) -> None:
    """``run``: its flags in every command's groups (flags.GROUPS: the hosts first, SLURM
    last), what a newcomer needs first in each, every default said; examples at the end."""
    run = commands.add_parser("run", parents=[inventory], help="check, then launch the job on every node",
                              usage="torchherd run [options] [--] SCRIPT [ARGS...]", epilog=RUN_EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)  # the examples as written
    run.add_argument("script", nargs=argparse.REMAINDER, help="[--] SCRIPT [ARGS...]: the training script, run "
                     "by torchrun on every node")
    groups = flag_groups(run, "hosts", "job", "torchrun", "checks", "output", "recovery", "environments")
    add_host_flags(groups["hosts"])
    job = groups["job"]
    add_place_flags(job)
    add_sync_flag(job, groups["environments"], run=True)
    job.add_argument("--env", metavar="K=V", action="append", default=[],
                     help="set a variable on every rank (repeatable; default: the inventory's env only)")
    job.add_argument("--env-pass", metavar="NAME", action="append", default=[],
                     help="pass this variable from the controller's environment (repeatable; default: none)")
    job.add_argument("--dry-run", action="store_true",
                     help="print each node's command; start nothing; with --sync also ask every node what it lacks, "
                          "changing nothing (exit 1 when a node cannot answer: the run would stop there; "
                          "default: off)")
    job.add_argument("--detach", action="store_true",
                     help="start the job so it outlives this command; print the run id and return (default: off)")
    job.add_argument("--grace", type=grace, metavar="S", help="SIGTERM to SIGKILL, in seconds (default: 10)")
    job.add_argument("--straggler-window", type=straggler_window, metavar="S",
                     help="judge each node's progress over the last S seconds for the straggler: longer for a job "
                          "whose steps take many seconds (default: 30, at least 10)")
    job.add_argument("--no-fail-fast", action="store_true",
                     help="let the other nodes go on when one fails (default: tear them down at once)")

    torchrun = groups["torchrun"]
    torchrun.add_argument("--master-addr", metavar="ADDR",
                          help="address the workers reach the master at (default: [cluster].master_addr, else "
                               "found by the preflight)")
    torchrun.add_argument("--rdzv-backend", choices=("static", "c10d"),
                          help="the rendezvous (default: [cluster].rdzv_backend, else static; c10d where the "
                               "nodes' process counts differ)")
    torchrun.add_argument("--nnodes", type=nnodes, metavar="N|MIN:MAX",
                          help="torchrun --nnodes; MIN:MAX is elastic, c10d only (default: the number of hosts)")
    torchrun.add_argument("--max-restarts", type=max_restarts, default=0, metavar="N",
                          help="torchrun --max-restarts (default: 0)")
    torchrun.add_argument("--monitor-interval", type=monitor_interval, metavar="S",
                          help="torchrun --monitor-interval (default: torchrun's)")
    torchrun.add_argument("--rdzv-conf", metavar="K=V,...",
                          help="torchrun --rdzv-conf, c10d only (default: none)")
    torchrun.add_argument("-m", "--module", action="store_true",
                          help="SCRIPT is a module name, python -m (default: a file)")

    checks = groups["checks"]
    checks.add_argument("--no-check", action="store_true",
                        help="skip the preflight checks; only connect (default: check)")
    checks.add_argument("--only", metavar="ID,...",
                        help="the preflight runs only these checks (ids: check --help; default: all)")
    checks.add_argument("--skip", metavar="ID,...", help="the preflight leaves these checks out (default: none)")

    output = groups["output"]
    output.add_argument("--log-dir", metavar="DIR", default="torchherd-logs",
                        help="where <run-id>/<node>.log go (default: torchherd-logs)")
    output.add_argument("--plain", action="store_true",
                        help="plain lines, no live panel (default: the panel on a terminal, plain lines otherwise)")
    output.add_argument("--json", action="store_true",
                        help="the job's lines on stderr, and on stdout one JSON document at the end: the summary, "
                             "every node and attempt, the slowest node; the error where the run never started; "
                             "with --dry-run the plan (default: off)")
    output.add_argument("--collapse", dest="collapse", action="store_true", default=None,
                        help="show a line many ranks print within half a second once, with who printed it "
                             "(default: on a terminal)")
    output.add_argument("--no-collapse", dest="collapse", action="store_false",
                        help="show every rank's every line on the terminal (the logs always keep them all; "
                             "default: when not on a terminal)")
    output.add_argument("--ranks", metavar="R,...", help="show only these global ranks on the terminal, e.g. 0,8-15 "
                        "(the logs keep them all; default: every rank)")
    _add_recovery_flags(groups["recovery"])
    add_container_flags(groups["environments"])
    add_scheduler_flags(run)  # each scheduler's group, last
    run.set_defaults(handler=cmd_run)
