"""Command line: parse, call the library, render. ``main(argv) -> int`` is callable from tests.

Exit codes (the public contract, torchherd docs cli): 0 all good; 1 a check or the job
failed; 2 usage or inventory error; 130 interrupted.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import shlex
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Sequence

from torchherd import __version__, manual, words
from torchherd.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, TorchherdError, UsageError

if TYPE_CHECKING:
    from rich.console import Console

    from torchherd.api import Cluster, DetachedStartFailed
    from torchherd.console.view import ViewOptions
    from torchherd.inventory import Bandwidth, Recovery
    from torchherd.plan import Plan
    from torchherd.results import CheckReport

Handler = Callable[[argparse.Namespace, "Console"], int]


DEFAULT_SSH_CONFIG = "~/.ssh/config"


def _inventory_path(args: argparse.Namespace) -> Path:
    _not_empty(args, "inventory", "-i", "name the file: -i hosts.toml, or leave out -i for "
               "$TORCHHERD_INVENTORY, then ./hosts.toml")
    chosen = getattr(args, "inventory", None) or os.environ.get("TORCHHERD_INVENTORY") or "hosts.toml"
    return Path(chosen).expanduser()


def _not_empty(args: argparse.Namespace, key: str, flag: str, hint: str) -> None:
    """A flag given an empty value (an unset variable: -H "$HOSTS") is an error, never the
    same as the flag left out: that would quietly take ./hosts.toml's hosts instead."""
    value = getattr(args, key, None)
    if value is not None and not value.strip():
        raise UsageError(f"{flag} {value!r}: empty (an unset variable?)", hint)


def _hosts(args: argparse.Namespace) -> Cluster:
    """The hosts: ``-H`` or ``--nodelist`` (no file), else the inventory or hostfile of
    ``-i``; then ``--include``/``--exclude`` and ``--master`` for this run."""
    from torchherd.api import Cluster

    _not_empty(args, "hosts", "-H", "name the hosts: -H node0,node1 (or leave out -H to use the inventory)")
    _not_empty(args, "nodelist", "--nodelist", "name the hosts: --nodelist 'gpu[01-04]' (or leave it out to use "
               "the inventory)")
    hosts, nodelist = getattr(args, "hosts", None), getattr(args, "nodelist", None)
    if hosts and nodelist:
        raise UsageError("-H and --nodelist: give one of them", "-H also takes nodesets: -H 'gpu[01-04]'")
    if (hosts or nodelist) and getattr(args, "inventory", None):
        raise UsageError(f"-i {args.inventory} and {'-H' if hosts else '--nodelist'}: give the hosts one way",
                         "drop -i to use only the hosts given, or --include to pick hosts of the inventory")
    python, workdir = getattr(args, "python", None), getattr(args, "workdir", None)
    nproc = _nproc(getattr(args, "nproc_per_node", None))
    accept = bool(getattr(args, "accept_new_host_keys", False))
    if hosts:
        cluster = Cluster.from_hosts(hosts, python=python, workdir=workdir, nproc_per_node=nproc,
                                     accept_new_host_keys=accept)
    elif nodelist:
        cluster = Cluster.from_nodelist(nodelist, python=python, workdir=workdir, nproc_per_node=nproc,
                                        accept_new_host_keys=accept)
    else:
        cluster = Cluster.from_file(_inventory_path(args), python=python, workdir=workdir, nproc_per_node=nproc,
                                    accept_new_host_keys=accept)
    include, exclude = getattr(args, "include", None), getattr(args, "exclude", None)
    if include is not None or exclude is not None:
        cluster = cluster.select(include, exclude)
    master, port = getattr(args, "master", None), getattr(args, "master_port", None)
    timeout = getattr(args, "ssh_timeout", None)
    if master or port is not None or timeout is not None:
        cluster = cluster.override(master=master, port=port, ssh_timeout=timeout)
    image, runtime, pull, archive = (getattr(args, "image", None), getattr(args, "container_runtime", None),
                                     getattr(args, "pull", None), getattr(args, "image_archive", None))
    if not (image or runtime or pull or archive):
        return cluster
    return cluster.with_container(image, runtime=runtime, pull=pull, archive=archive, where="")


def cmd_init(args: argparse.Namespace, console: Console) -> int:
    from torchherd import hostspec

    _not_empty(args, "hosts", "-H", "name the hosts: -H node0,node1 (or leave out -H for two placeholder hosts)")
    path = _inventory_path(args)
    if path.exists():
        raise UsageError(f"{path}: already exists; init never overwrites a file",
                         "remove it first, or write another: torchherd -i other.toml init ...")
    if args.example:
        return _init_example(args, path, console)
    if args.hosts and args.from_ssh_config:
        raise UsageError("-H and --from-ssh-config: give one of them")
    source, ssh_config = "", None
    entries: list[hostspec.HostEntry] = []
    if args.hosts:
        entries, source = hostspec.host_entries(args.hosts), " from -H"
    elif args.from_ssh_config:
        config = Path(args.ssh_config).expanduser()
        try:
            text = config.read_text(encoding="utf-8")
        except OSError as error:
            raise UsageError(f"--ssh-config {config}: cannot read it ({error.strerror})") from None
        names = hostspec.ssh_config_aliases(text, args.from_ssh_config)
        if not names:
            raise UsageError(f"--from-ssh-config {args.from_ssh_config}: no Host entry of {config} matches",
                             "a glob over Host names, e.g. 'gpu*'")
        entries, source = hostspec.host_entries(",".join(names), "--from-ssh-config"), f" from {config}"
        if config.resolve() != Path(DEFAULT_SSH_CONFIG).expanduser().resolve():
            ssh_config = str(config.resolve())  # its aliases resolve only through it
    nproc = _nproc(args.nproc_per_node)
    named = "" if path == Path("hosts.toml") else f"-i {shlex.quote(str(path))} "
    then = f"torchherd {named}hosts; torchherd {named}check -- train.py"
    text = hostspec.inventory_text(entries, python=args.python, workdir=args.workdir, nproc_per_node=nproc,
                                   master=args.master, source=source, ssh_config=ssh_config, then=then)
    hostspec.load_any(_written(path, text))  # what init writes must load
    count = sum(len(entry.tables()) for entry in entries) if entries else 2
    todo = [key for key, given in (("python", args.python), ("workdir", args.workdir),
                                   ("nproc_per_node", nproc)) if given is None]
    console.print(f"wrote {path}: {words.count(count, 'host')}" + ("" if entries else " (placeholders: node0, node1)"),
                  markup=False, highlight=False)
    if todo or not entries:
        console.print(f"fill in: {', '.join(todo + ([] if entries else ['the hosts']))} (marked FILL IN)",
                      markup=False, highlight=False)
    console.print(f"then: {then}", markup=False, highlight=False)
    return EXIT_OK


def _init_example(args: argparse.Namespace, path: Path, console: Console) -> int:
    """The example inventory shipped in the package, written as ``path`` (pip users have no
    checkout to copy it from)."""
    from importlib.resources import files

    given = [flag for flag, value in (("-H", args.hosts), ("--from-ssh-config", args.from_ssh_config),
                                      ("--python", args.python), ("--workdir", args.workdir),
                                      ("--nproc-per-node", args.nproc_per_node), ("--master", args.master))
             if value is not None]
    if given:
        raise UsageError(f"--example and {given[0]}: the example is written as it is",
                         "edit the file it writes, or leave --example out to write your hosts")
    _written(path, files("torchherd").joinpath("hosts.example.toml").read_text(encoding="utf-8"))
    console.print(f"wrote {path}: the example inventory, every key explained; edit it for your hosts",
                  markup=False, highlight=False)
    return EXIT_OK


def _written(path: Path, text: str) -> Path:
    """Writes a new private file (0600); an existing one is never replaced."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise UsageError(f"{path}: already exists; init never overwrites a file") from None
    except OSError as error:
        raise UsageError(f"{path}: cannot write it ({error.strerror})") from None
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(text)
    return path


def _cluster(args: argparse.Namespace) -> Cluster:
    cluster = _hosts(args)
    slurm = {key: getattr(args, f"slurm_{key}", None) for key in SLURM_FLAGS}
    return cluster.using(getattr(args, "scheduler", None), slurm)


def cmd_hosts(args: argparse.Namespace, console: Console) -> int:
    from torchherd.console.hosts import hosts_rows, render_hosts
    from torchherd.transport.ssh import resolve_target

    inventory = _cluster(args).inventory
    targets = [resolve_target(host, inventory.cluster.ssh_config).describe() for host in inventory.hosts]
    if args.json:
        _emit(args, {"hosts": hosts_rows(inventory, targets)})
    else:
        render_hosts(console, inventory, targets)
    return EXIT_OK


def _id_list(text: str | None, flag: str, known: Sequence[str]) -> frozenset[str] | None:
    """The check ids of --only or --skip; one it does not know is exit 2 naming the flag."""
    if text is None:
        return None
    ids = frozenset(item.strip() for item in text.split(",") if item.strip())
    unknown = sorted(ids - set(known))
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1, cutoff=0.6)
        raise UsageError(f"{flag} {text}: unknown check id {', '.join(map(repr, unknown))}"
                         + (f"; did you mean {close[0]!r}?" if close else ""), f"known ids: {', '.join(known)}")
    return ids


def _known_checks(cluster: Cluster) -> tuple[str, ...]:
    """The check ids this cluster's checks take: SLURM's own too where SLURM runs the job."""
    from torchherd.checks.model import CHECK_IDS
    from torchherd.engine.backend import SlurmBackend
    from torchherd.engine.slurm.check import SLURM_CHECKS

    return CHECK_IDS + (SLURM_CHECKS if isinstance(cluster.backend, SlurmBackend) else ())


def cmd_check(args: argparse.Namespace, console: Console) -> int:
    from torchherd.console.checks import live_progress, render_report

    cluster = _cluster(args)
    script = args.script[0] if args.script else None
    known = _known_checks(cluster)
    only, skip = _id_list(args.only, "--only", known), _id_list(args.skip, "--skip", known) or frozenset()
    _sync_choices(args, bool(args.sync))  # check syncs only with --sync, [sync] table or not
    more = {"bandwidth": args.bandwidth, "min_bandwidth": args.min_bandwidth, "gpu_diag": args.gpu_diag,
            "sync_include": tuple(args.sync_include), "sync_anyway": args.sync_anyway, "uv": args.uv,
            "uv_system_site_packages": args.uv_system_site_packages, "uv_offline": args.uv_offline}
    cluster.backend.allow("--matrix", args.matrix)
    if args.json:
        from torchherd.console import make_console
        from torchherd.console.sync import SyncPrinter

        report = cluster.check(script, only=only, skip=skip, smoke=args.smoke, mesh=args.mesh, sync=args.sync,
                               on_event=SyncPrinter(make_console(stderr=True)), **more)  # stdout: the JSON
        _emit(args, report.as_json())
    elif not cluster.backend.live_checks:  # the results come at once: no live grid
        report = cluster.check(script, only=only, skip=skip, smoke=args.smoke, mesh=args.mesh, sync=args.sync,
                               on_event=_sync_printer(console), **more)
        render_report(console, report)
    else:
        with live_progress(console, cluster.inventory, args.bandwidth or args.smoke) as progress:
            report = cluster.check(script, only=only, skip=skip, smoke=args.smoke, mesh=args.mesh, on_result=progress,
                                   sync=args.sync, on_event=_sync_printer(console), **more)
        render_report(console, report)
        _render_matrix(console, cluster, report, args.matrix)
    return EXIT_OK if report.ok else EXIT_FAILED


def _render_matrix(console: Console, cluster: Cluster, report: CheckReport, always: bool) -> None:
    """Under the report, the probes as a node x node matrix: when a cross-node connect
    failed, or always with --matrix."""
    from torchherd.console.matrix import failed, render_matrix

    if report.bandwidth is not None and always:
        from torchherd.console.matrix import render_bandwidth

        render_bandwidth(console, report.bandwidth, [host.name for host in cluster.inventory.hosts])
    if report.probes and (always or failed(report.probes)):
        hosts = cluster.inventory.hosts
        render_matrix(console, report.probes, [host.name for host in hosts], hosts[0].name,
                      cluster.inventory.cluster.port)
    elif always:
        console.print("no cross-node probes ran (the port check was not selected, or no node was reached)",
                      markup=False, highlight=False)


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    from torchherd.api import DetachedRun
    from torchherd.console.observer import ConsoleObserver
    from torchherd.console.run import render_description
    from torchherd.engine.launch import sigterm_as_interrupt
    from torchherd.plan import parse_env_assignments

    cluster = _cluster(args)
    if args.spares is not None:
        cluster = cluster.with_spares(args.spares)
    if not args.script:
        raise UsageError("run: no training script given", "torchherd run [options] -- train.py [args...]")
    script, *script_args = args.script
    _sync_choices(args, bool(args.sync) or (args.sync is None and cluster.inventory.sync is not None))
    # --nproc-per-node is already every host's count (_hosts); --include/--exclude slots may have changed some since
    plan = cluster.plan(script, *script_args, nnodes=args.nnodes,
                        module=args.module, env=_extra_env(args.env, args.env_pass, parse_env_assignments),
                        master_addr=args.master_addr, max_restarts=args.max_restarts,
                        monitor_interval=args.monitor_interval, rdzv_conf=args.rdzv_conf,
                        rdzv_backend=args.rdzv_backend, sync=args.sync, sync_include=args.sync_include,
                        sync_anyway=args.sync_anyway, uv=args.uv,
                        uv_system_site_packages=args.uv_system_site_packages, uv_offline=args.uv_offline)
    _ranks_exist(args.ranks, plan)
    only, skip = _run_checks(args, cluster)
    if args.dry_run:
        described = cluster.describe(plan, fail_fast=not args.no_fail_fast)
        if args.json:  # the plan only: what --sync would send needs the nodes asked (run --sync --dry-run)
            from torchherd.console.run import plan_json

            _emit(args, plan_json(described))
            return EXIT_OK
        render_description(console, described)
        return _dry_sync(cluster, plan, console, args.log_dir) if plan.sync is not None else EXIT_OK
    recovery = _recovery(args, cluster)
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
                                  recovery=recovery)
        if isinstance(launched, DetachedRun):
            from torchherd.console.detach import render_started

            render_started(console, launched.record)
            return EXIT_OK
        with sigterm_as_interrupt():
            summary = launched.wait()
        if args.json:
            _emit(args, {"ok": summary.exit_code == EXIT_OK, **summary.as_json()})
        return summary.exit_code
    finally:
        observer.close()  # the panel goes, whichever way the command leaves


JSON_SCHEMA = 1
"""The ``schema`` of every JSON document the CLI prints: raised only when a key changes
meaning or goes (keys are added without a change)."""


def _emit(args: argparse.Namespace, document: dict[str, object]) -> None:
    """Prints ``document`` as the command's one JSON document on stdout, ``schema`` first."""
    print(json.dumps({"schema": JSON_SCHEMA, **document}, indent=2))
    args.json_printed = True


def _json_wanted(args: argparse.Namespace | None, argv: Sequence[str]) -> bool:
    """Whether the command promised one JSON document on stdout: ``--json`` parsed, or,
    where parsing failed, ``--json`` among the words before ``--``."""
    if args is not None:
        return bool(getattr(args, "json", False))
    words = list(argv)
    return "--json" in (words[:words.index("--")] if "--" in words else words)


def _failure_json(error: BaseException, exit_code: int) -> dict[str, object]:
    """The one JSON document of a command that ended without its result: the error and its
    hint as the terminal shows them, and for an aborted launch the checks or nodes behind it."""
    from torchherd.api import LaunchAborted

    message = "interrupted" if isinstance(error, KeyboardInterrupt) else str(error)
    document: dict[str, object] = {"ok": False, "exit_code": exit_code, "error": message,
                                   "hint": getattr(error, "hint", "")}
    if isinstance(error, LaunchAborted):
        if error.report is not None:
            document["checks"] = error.report.as_json()["checks"]
        if error.errors:
            document["unreachable"] = [{"node": failure.node, "kind": failure.kind, "error": str(failure),
                                        "hint": failure.hint} for failure in error.errors]
    return document


def _recovery(args: argparse.Namespace, cluster: Cluster) -> Recovery:
    """The inventory's [recovery] table, each flag given overriding its key."""
    from dataclasses import replace

    recovery = cluster.recovery
    given = {key: value for key, value in (("retries", args.retries), ("final_exit_codes", args.final_exit_codes),
                                           ("min_nodes", args.min_nodes), ("hang_timeout", args.hang_timeout),
                                           ("checkpoint", args.checkpoint), ("replicate", args.replicate),
                                           ("replicate_bandwidth", args.replicate_bandwidth))
             if value is not None}
    recovery = replace(recovery, **given) if given else recovery
    if args.checkpoint is not None and not recovery.retries:
        raise UsageError("--checkpoint: it is staged before a new attempt, and without retries there is none",
                         "add --retries N (or retries in [recovery])")
    for flag, value in (("--replicate", args.replicate), ("--replicate-bandwidth", args.replicate_bandwidth)):
        if value is None or flag == "--replicate" and not value:
            continue
        if recovery.checkpoint is None:
            raise UsageError(f"{flag}: replication copies the checkpoint, and none is named",
                             "add --checkpoint PATH (or checkpoint in [recovery])")
        if not recovery.retries:  # no controller copies it (a plain --detach has none), nor stages it
            raise UsageError(f"{flag}: a replica is there for a new attempt, and without retries there is none",
                             "add --retries N (or retries in [recovery])")
    return recovery


def _dry_sync(cluster: Cluster, plan: Plan, console: Console, log_dir: str) -> int:
    """``run --sync --dry-run``: asks every node what it has (changing nothing) and lists
    what would be sent and deleted; 1 when a node could not answer."""
    from torchherd.console.sync import render_sync_plan

    done = cluster.sync(plan=plan, dry_run=True, log_dir=log_dir)
    render_sync_plan(console, done)
    return EXIT_OK if done.ok else EXIT_FAILED


def _sync_printer(console: Console) -> Callable[[object], None]:
    from torchherd.console.sync import SyncPrinter

    return SyncPrinter(console)


def _add_sync_flag(parser: argparse.ArgumentParser, run: bool) -> None:
    parser.add_argument("--sync", nargs="?", const=True, default=None, metavar="DIR",
                        help="first make the local project (DIR, else [sync].dir, else the enclosing git repository, "
                             "else .) identical on every node under its workdir; only changed files travel. "
                             "Never sent: .git, the log directory, and unless included: .ssh/ .gnupg/ .aws/ .netrc "
                             "*.pem id_rsa* id_ed25519* (SSH keys) .env .env.* (default: "
                             + ("with a [sync] table in the inventory" if run else "off") + ")")
    if run:
        parser.add_argument("--no-sync", dest="sync", action="store_const", const=False,
                            help="do not sync, even with a [sync] table in the inventory (default: off)")
    parser.add_argument("--sync-include", metavar="PATTERN", action="append", default=[],
                        help="send what matches although the private list or [sync].exclude leaves it out, "
                             "e.g. .env (gitignore syntax; repeatable; adds to [sync].include; default: none)")
    parser.add_argument("--sync-anyway", action="store_true",
                        help="send the home directory, or a directory outside git with over 5000 files or 500 MB, "
                             "which --sync otherwise refuses (default: off)")
    parser.add_argument("--uv", action="store_true", default=None,
                        help="run the job in a venv that uv sync --frozen builds on every node from the synced "
                             "project's uv.lock, kept while the lock is unchanged (on by itself when the project "
                             "has pyproject.toml and uv.lock; default: that)")
    parser.add_argument("--no-uv", dest="uv", action="store_false",
                        help="the node's configured python, even for a project with uv.lock (default: off)")
    parser.add_argument("--uv-system-site-packages", action="store_true",
                        help="the venv also sees the packages of the node's configured python (a torch installed "
                             "there; default: off)")
    parser.add_argument("--uv-offline", action="store_true", default=None,
                        help="nodes without a package index: a node that must build its venv gets the lock's "
                             "wheels from this machine (downloaded once per node platform, relayed node to node) "
                             "and builds with no network (default: [uv] offline, else off)")


def _sync_choices(args: argparse.Namespace, syncs: bool) -> None:
    """--sync-include and --sync-anyway mean nothing when nothing is synced: said, not ignored."""
    given = [flag for flag, value in (("--sync-include", args.sync_include), ("--sync-anyway", args.sync_anyway))
             if value]
    if given and not syncs:
        raise UsageError(f"{given[0]} without --sync: nothing is synced", "add --sync [DIR]")


def _sync_took_the_script(args: argparse.Namespace, extra: Sequence[str]) -> None:
    """``--sync train.py --lr 3e-4``: --sync's optional DIR took the script (and argparse
    would only say that ``--lr`` is unknown)."""
    value = getattr(args, "sync", None)
    if not isinstance(value, str):
        return
    path = Path(value).expanduser()
    if path.is_dir():
        return
    if extra or path.is_file() or (not path.exists() and not getattr(args, "script", None)):
        raise UsageError(f"--sync took {value!r} as its DIR; write `--sync -- {shlex.quote(value)}`",
                         "--sync takes an optional DIR: --sync DIR -- SCRIPT [ARGS...] names the project, "
                         "--sync -- SCRIPT [ARGS...] syncs the enclosing git repository")


def _view_options(args: argparse.Namespace, console: Console) -> ViewOptions:
    """The live panel on a terminal (not with --plain), duplicates collapsed where it is
    (--collapse / --no-collapse decide), and the terminal's rank filter."""
    from torchherd.console.collapse import parse_ranks
    from torchherd.console.view import ViewOptions

    ranks = parse_ranks(args.ranks) if args.ranks is not None else None
    return ViewOptions.choose(console, plain=args.plain, collapse=args.collapse, ranks=ranks)


def _run_checks(args: argparse.Namespace, cluster: Cluster) -> tuple[frozenset[str] | None, frozenset[str]]:
    """run's --only and --skip: the preflight's check ids (SLURM's view takes neither)."""
    from torchherd.checks.model import CHECK_IDS

    given = [flag for flag, value in (("--only", args.only), ("--skip", args.skip)) if value is not None]
    if given and args.no_check:
        raise UsageError(f"{given[0]} with --no-check: no check runs", f"leave out {given[0]} or --no-check")
    for flag in given:
        cluster.backend.allow(flag, True)
    return _id_list(args.only, "--only", CHECK_IDS), _id_list(args.skip, "--skip", CHECK_IDS) or frozenset()


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


def cmd_status(args: argparse.Namespace, console: Console) -> int:
    from torchherd.api import DetachedRun, attach, damaged_runs, runs
    from torchherd.console.detach import ListedRun, render_runs, render_status, run_json

    def listed(run: DetachedRun) -> ListedRun:
        recovery = run.recovery()  # first: it reads the record again (a later attempt's nodes)
        states = run.status()
        return ListedRun(run.record, states, recovery, run.controller())

    if args.run:
        row = listed(attach(args.run))
        if args.json:
            _emit(args, run_json(row))
        else:
            render_status(console, row.record, row.states, row.recovery, row.attached)
    elif args.json:
        _emit(args, {"runs": [run_json(listed(run)) for run in runs()]})
    else:
        render_runs(console, [listed(run) for run in runs()], damaged_runs())
    return EXIT_OK


def _follow(args: argparse.Namespace, console: Console, follow: bool) -> int:
    """Renders the run's logs; 0 when every node that finished exited 0."""
    from torchherd.api import attach
    from torchherd.console.observer import ConsoleObserver
    from torchherd.console.run import LiveRenderer

    run = attach(args.run)
    renderer = LiveRenderer(console, [node.name for node in run.record.nodes], run.record.max_rank)
    codes = run.follow(ConsoleObserver(console, renderer), follow=follow, node=getattr(args, "node", None),
                       rank=getattr(args, "rank", None))
    return EXIT_OK if all(code == 0 for code in codes.values()) else EXIT_FAILED


def cmd_logs(args: argparse.Namespace, console: Console) -> int:
    if args.events:
        return _events(args, console)
    return _follow(args, console, args.follow)


def _events(args: argparse.Namespace, console: Console) -> int:
    """``logs RUN --events``: the run's history, one record a line."""
    from torchherd.api import events_of
    from torchherd.console.report import render_events

    for flag, given in (("-f", args.follow), ("--node", args.node), ("--rank", args.rank)):
        if given:
            raise UsageError(f"--events and {flag}: the history is printed whole, as recorded",
                             "leave one of them out (filter with grep)")
    render_events(console, events_of(args.run))
    return EXIT_OK


def cmd_report(args: argparse.Namespace, console: Console) -> int:
    """``report RUN``: the HTML page (``-o FILE``); ``--text``: a few lines."""
    from torchherd.api import report, report_text
    from torchherd.console.report import render_story

    if args.text:
        if args.output is not None:
            raise UsageError("--text and -o: the text goes to the terminal", "leave one of them out")
        render_story(console, report_text(args.run))
        return EXIT_OK
    path = report(args.run, args.output)
    render_story(console, f"report: {path}")
    return EXIT_OK


def cmd_attach(args: argparse.Namespace, console: Console) -> int:
    try:
        return _follow(args, console, True)
    except KeyboardInterrupt:
        from torchherd.api import attach

        # an attached run's own terminal stops it (attach only followed its logs)
        how = "Ctrl-C in its own terminal" if attach(args.run).attached else f"torchherd stop {args.run}"
        console.print(f"detached; the run goes on ({how} stops it)", markup=False, highlight=False)
        return EXIT_OK


def cmd_stop(args: argparse.Namespace, console: Console) -> int:
    from torchherd.api import attach
    from torchherd.console.detach import render_stopped

    run = attach(args.run)
    recovery = run.recovery()
    left = run.stop(args.grace)
    return EXIT_OK if render_stopped(console, run.record, left, recovery) else EXIT_FAILED


def _extra_env(assignments: Sequence[str], passed: Sequence[str],
               parse: Callable[[Sequence[str]], dict[str, str]]) -> dict[str, str]:
    env = {}
    for name in passed:
        if name not in os.environ:
            raise UsageError(f"--env-pass {name}: not set in this shell", f"export {name}=... first, or use --env")
        env[name] = os.environ[name]
    env.update(parse(assignments))
    return env


def _nproc(text: str | None) -> int | str | None:
    from torchherd.inventory import MAX_NPROC

    if text is None:
        return None
    if text in ("gpu", "cpu", "auto"):
        return text
    # isascii: "²".isdigit() is True, and int("²") raises
    if text.isascii() and text.isdigit() and 0 < int(text) <= MAX_NPROC:
        return int(text)
    raise UsageError(f"--nproc-per-node {text!r}: expected a positive integer (at most {MAX_NPROC}), gpu, cpu or auto")


MAX_GRACE = 86400.0


def _number(text: str) -> float:
    """The number ``text`` says, or nan, which no range holds."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def _grace(text: str) -> float:
    """Seconds from SIGTERM to SIGKILL: finite, 0 or more ("nan" and "-1" parse as floats)."""
    value = _number(text)
    if not 0 <= value <= MAX_GRACE:
        raise argparse.ArgumentTypeError(f"expected seconds from 0 to {MAX_GRACE:g}, got {text!r}")
    return value


def _interval(text: str) -> float:
    value = _number(text)
    if not 0 < value <= MAX_GRACE:
        raise argparse.ArgumentTypeError(f"expected seconds above 0, at most {MAX_GRACE:g}, got {text!r}")
    return value


def _count(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) > 1_000_000:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 1000000, got {text!r}")
    return int(text)


def _exit_codes(text: str) -> tuple[int, ...]:
    codes = [item.strip() for item in text.split(",")]
    if not all(code.isascii() and code.isdigit() and 1 <= int(code) <= 255 for code in codes):
        raise argparse.ArgumentTypeError(f"expected exit codes from 1 to 255, comma-separated (2,3), got {text!r}")
    return tuple(int(code) for code in codes)


def _hang_timeout(text: str) -> float:
    from torchherd.inventory import MAX_SECONDS

    value = _number(text)
    if not 1 <= value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"expected seconds from 1 to {MAX_SECONDS:g}, got {text!r}")
    return value


def _retries(text: str) -> int:
    from torchherd.inventory import MAX_RETRIES

    if not (text.isascii() and text.isdigit()) or int(text) > MAX_RETRIES:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to {MAX_RETRIES}, got {text!r}")
    return int(text)


def _checkpoint(text: str) -> str:
    from torchherd.inventory import CHECKPOINT_HINT, checkpoint_problem

    problem = checkpoint_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{problem} ({CHECKPOINT_HINT})")
    return text


def _replicate(text: str) -> int:
    from torchherd.inventory import replicate_problem

    value = int(text) if text.isascii() and text.isdigit() else text
    problem = replicate_problem(value)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return int(value)


def _bandwidth(text: str) -> Bandwidth:
    from torchherd.inventory import BANDWIDTH_HINT, parse_bandwidth

    found = parse_bandwidth(text)
    if found is None:
        raise argparse.ArgumentTypeError(f"expected a share or a rate, got {text!r} ({BANDWIDTH_HINT})")
    return found


def _add_recovery_flags(run: argparse.ArgumentParser) -> None:
    group = run.add_argument_group("recovery (torchherd docs run: Recovery); each flag overrides [recovery]")
    group.add_argument("--retries", type=_retries, metavar="N",
                       help="after a failed attempt, triage the nodes and try again, up to N times (default: 0)")
    group.add_argument("--final-exit-codes", type=_exit_codes, metavar="CODE,...",
                       help="exit codes that end the run at once, without a retry, e.g. 2 for bad arguments "
                            "(default: none)")
    group.add_argument("--spares", metavar="NODESET",
                       help="these hosts are spares: checked, not launched, until one takes an excluded node's place "
                            "(default: none)")
    group.add_argument("--min-nodes", type=_positive, metavar="K",
                       help="with no spare left, go on with fewer nodes, down to K (default: never shrink)")
    group.add_argument("--hang-timeout", type=_hang_timeout, metavar="S",
                       help="no rank printed and none used CPU for S seconds: the job is hung; every rank's stack is "
                            "taken and the summary names the rank that differs (default: off)")
    group.add_argument("--checkpoint", type=_checkpoint, metavar="PATH",
                       help="before each new attempt, put the newest copy of PATH (relative to the workdir; a glob: "
                            "its newest match) on every node that lacks it, copied node to node (default: "
                            "[recovery].checkpoint, else none)")
    group.add_argument("--replicate", type=_replicate, metavar="K",
                       help="copy each new checkpoint, once complete, to the next K nodes in the ring while the job "
                            "runs, so losing the node that wrote it loses nothing (default: 1 with a checkpoint; "
                            "0: off)")
    group.add_argument("--replicate-bandwidth", type=_bandwidth, metavar="CAP",
                       help='the most a replica\'s copy takes of the link: "25%%" of its speed, or a rate such as '
                            '"200MB/s" (default: auto, 25%% of the link and at most 5 MB/s per CPU core)')


def _check_ids() -> str:
    """``check --help``'s list of the ids --only and --skip take (imported only for the help:
    the checks package is slow to import)."""
    from torchherd.checks.model import CHECK_IDS, OPT_IN
    from torchherd.engine.slurm.check import SLURM_CHECKS

    plain = ", ".join(check for check in CHECK_IDS if check not in OPT_IN)
    measured = ", ".join(check for check in CHECK_IDS if check in OPT_IN and check not in ("smoke", "gpudiag"))
    text = (f"check ids for --only and --skip: {plain}; with --bandwidth or --smoke (or named by --only): "
            f"{measured}; with --smoke: smoke; with --gpu-diag: gpudiag; SLURM runs also: {', '.join(SLURM_CHECKS)}. "
            "What each establishes: torchherd docs checks.")
    return textwrap.fill(text, width=79, break_on_hyphens=False)  # an id is never cut at its hyphen


def _rate(text: str) -> float:
    from torchherd.inventory import parse_rate

    found = parse_rate(text)
    if found is None:
        raise argparse.ArgumentTypeError(f"expected a rate such as 10Gbit or 800Mbit, got {text!r}")
    return found


def _nnodes(text: str) -> str:
    from torchherd.plan import check_nnodes

    try:
        return check_nnodes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


class _Parser(argparse.ArgumentParser):
    """argparse's own errors as the CLI's others: one line and a hint, exit 2 (``main``).
    No prefix abbreviations (``--nproc`` is not ``--nproc-per-node``): a flag added later
    must never change what an abbreviation in someone's script meant."""

    lazy_epilog: Callable[[], str] | None = None
    """Text under the help that needs modules --help should not import otherwise."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def format_help(self) -> str:
        if self.lazy_epilog is not None:
            self.epilog = self.lazy_epilog()
        return super().format_help()

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        """A value outside the choices (a mistyped command above all) gets the closest one."""
        choices = action.choices
        if choices is None or value in choices:
            return
        known = [str(choice) for choice in choices]
        close = difflib.get_close_matches(str(value), known, n=1, cutoff=0.6)
        guess = f"; did you mean {close[0]!r}?" if close else ""
        if isinstance(action, argparse._SubParsersAction):
            raise argparse.ArgumentError(None, f"unknown command {value!r}{guess} (commands: {', '.join(known)})")
        raise argparse.ArgumentError(action, f"invalid choice {value!r}{guess} (choose from {', '.join(known)})")

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}", f"{self.prog} --help lists the options")


SLURM_FLAGS = ("login", "partition", "account", "nodes", "nodelist", "gpus_per_node", "time", "extra")
"""Every [slurm] key, as --slurm-KEY on the command line."""


def _port(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port, 1 to 65535, got {text!r}")
    return int(text)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _scheduler_flags() -> argparse.ArgumentParser:
    flags = argparse.ArgumentParser(add_help=False)
    _add_scheduler_flags(flags)
    return flags


def _add_scheduler_flags(parser: argparse.ArgumentParser) -> None:
    from torchherd.inventory import SCHEDULERS

    group = parser.add_argument_group("SLURM (torchherd docs slurm); each --slurm-KEY overrides [slurm].KEY",
                                      "default for each --slurm-KEY: [slurm].KEY, else sbatch's own")
    group.add_argument("--scheduler", choices=SCHEDULERS,
                       help="who starts the job on the nodes (default: [cluster].scheduler, else ssh)")
    group.add_argument("--slurm-login", metavar="HOST", help="submit on this host over SSH (default: here)")
    group.add_argument("--slurm-partition", metavar="NAME", help="sbatch --partition")
    group.add_argument("--slurm-account", metavar="NAME", help="sbatch --account")
    group.add_argument("--slurm-nodes", metavar="N", type=_positive, help="sbatch --nodes")
    group.add_argument("--slurm-nodelist", metavar="NODESET", help="sbatch --nodelist, e.g. 'gpu[01-04]'")
    group.add_argument("--slurm-gpus-per-node", metavar="N", type=_positive, help="sbatch --gpus-per-node")
    group.add_argument("--slurm-time", metavar="LIMIT", help="sbatch --time")
    group.add_argument("--slurm-extra", metavar="OPTION", action="append",
                       help="one more sbatch option, e.g. --slurm-extra=--qos=high (repeatable)")


def _add_host_flags(parser: argparse.ArgumentParser, nproc: bool = False) -> None:
    """Hosts without an inventory file, and the choices that override it for one run."""
    group = parser.add_argument_group("hosts without an inventory, and choices for this run")
    _add_first_host_flags(group)
    _add_more_host_flags(group)
    if nproc:
        group.add_argument("--nproc-per-node", metavar="N", help=NPROC_HELP)


def _add_first_host_flags(group: argparse._ActionsContainer) -> None:
    """The hosts, and where and with what the job runs on them."""
    group.add_argument("-H", "--hosts", metavar="HOSTS",
                       help="[user@]host[:port],... (nodesets: gpu[01-16]); no inventory file needed "
                            "(default: the inventory's hosts)")
    group.add_argument("--nodelist", metavar="LIST",
                       help="hosts as a SLURM nodelist: gpu[01-04],cpu1 (default: the inventory's hosts)")
    group.add_argument("--python", metavar="PATH",
                       help="the interpreter with torch on every node (default: the inventory's python, else python3)")
    group.add_argument("--workdir", metavar="DIR",
                       help="where the job runs on every node (default: the inventory's workdir, else ~)")


def _add_more_host_flags(group: argparse._ActionsContainer) -> None:
    """The master, SSH's patience, and a subset of the hosts, for one command."""
    group.add_argument("--master", metavar="HOST", help="the host with node_rank 0 (default: the first)")
    group.add_argument("--master-port", metavar="PORT", type=_port,
                       help="the master (rendezvous) port, torchrun's --master-port (default: [cluster].port, "
                            "else 29500)")
    group.add_argument("--ssh-timeout", metavar="S", type=_interval,
                       help="seconds to connect and authenticate to a node (default: [cluster].ssh_timeout, else 10)")
    group.add_argument("--include", metavar="HOSTS", help="only these hosts (names, nodesets, globs; default: all)")
    group.add_argument("--exclude", metavar="HOSTS", help="leave these hosts out (names, nodesets, globs; default: "
                       "none)")
    group.add_argument("--image", metavar="IMAGE",
                       help="run the job inside this container image on every node (torchherd docs containers; default: "
                            "[container].image, else none)")
    group.add_argument("--container-runtime", metavar="RUNTIME",
                       help="auto, podman, docker, apptainer or enroot (default: [container].runtime, auto)")
    group.add_argument("--pull", metavar="POLICY",
                       help="never (default), missing or always: run pulls the image on every node at once before "
                            "its preflight, a bar per node (check never pulls)")
    group.add_argument("--image-archive", metavar="FILE",
                       help="a docker save / podman save tar of the image: sent once, relayed node to node and loaded "
                            "on every node that lacks the image, before the launch (default: [container].archive)")


NPROC_HELP = "processes per node: an int, gpu, cpu or auto (default: each host's nproc_per_node, else 1)"


def _add_init(commands: argparse._SubParsersAction[argparse.ArgumentParser],
              inventory: argparse.ArgumentParser) -> None:
    init = commands.add_parser("init", parents=[inventory],
                               help="write a commented hosts.toml (from -H or ~/.ssh/config); never overwrites")
    init.add_argument("-H", "--hosts", metavar="HOSTS", help="[user@]host[:port],... (nodesets: gpu[01-16])")
    init.add_argument("--from-ssh-config", metavar="PATTERN",
                      help="the Host entries of ~/.ssh/config matching this glob, e.g. 'gpu*'")
    init.add_argument("--ssh-config", metavar="FILE", default=DEFAULT_SSH_CONFIG,
                      help="the OpenSSH config --from-ssh-config reads (default: ~/.ssh/config)")
    init.add_argument("--python", metavar="PATH", help="the interpreter with torch on the nodes")
    init.add_argument("--workdir", metavar="DIR", help="where the job runs on the nodes")
    init.add_argument("--nproc-per-node", metavar="N", help="processes per node (int, gpu, cpu, auto)")
    init.add_argument("--master", metavar="HOST", help="the host with node_rank 0 (default: the first)")
    init.add_argument("--example", action="store_true",
                      help="write the documented example inventory instead (every key, explained)")
    init.set_defaults(handler=cmd_init)


def build_parser() -> argparse.ArgumentParser:
    inventory = argparse.ArgumentParser(add_help=False)
    inventory.add_argument("-i", "--inventory", metavar="FILE", default=argparse.SUPPRESS,
                           help="host inventory (default: $TORCHHERD_INVENTORY, then ./hosts.toml)")
    parser: argparse.ArgumentParser = _Parser(  # its subparsers are _Parsers too
        prog="torchherd", parents=[inventory],
        description="Run one PyTorch distributed job on many machines: check, launch, stream, tear down.")
    parser.add_argument("-V", "--version", action="version", version=f"torchherd {__version__}")
    # not required: torchherd alone prints this help (main), where argparse would say only
    # that COMMAND is missing
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    hosts = commands.add_parser("hosts", parents=[inventory], help="show the resolved inventory")
    hosts.add_argument("--json", action="store_true", help="print the inventory as JSON")
    hosts.set_defaults(handler=cmd_hosts)
    _add_host_flags(hosts, nproc=True)

    scheduler = _scheduler_flags()
    check = commands.add_parser("check", parents=[inventory, scheduler], help="preflight checks only; changes nothing",
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # the epilog comes wrapped
    check.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    check.add_argument("--only", metavar="ID,...", help="run only these checks (the ids are listed below)")
    check.add_argument("--skip", metavar="ID,...", help="skip these checks (the ids are listed below)")
    check.add_argument("--smoke", action="store_true", help="also run a tiny real all_reduce on every node")
    check.add_argument("--gpu-diag", action="store_true",
                       help="also run DCGM's level-1 GPU diagnostic (dcgmi diag -r 1) where DCGM is installed")
    check.add_argument("--bandwidth", action="store_true",
                       help="also measure the links' throughput and path MTU between the nodes (--smoke does too)")
    check.add_argument("--min-bandwidth", type=_rate, metavar="RATE",
                       help="with --bandwidth: a link or node below RATE (10Gbit, 800Mbit) fails "
                            "(default: [checks] min_bandwidth, else no floor)")
    check.add_argument("--mesh", choices=("auto", "full"), default="auto",
                       help="probe every pair of nodes (full), or beyond 32 nodes a sampled set that still "
                            "covers every node and subnet (auto, the default)")
    check.add_argument("--accept-new-host-keys", action="store_true",
                       help="trust and record unknown SSH host keys (changed keys are always refused)")
    check.add_argument("--matrix", action="store_true",
                       help="always show the probes as a node x node matrix (shown anyway when one failed)")
    check.add_argument("script", nargs=argparse.REMAINDER, help="[--] SCRIPT: also check the training script")
    check.set_defaults(handler=cmd_check)
    if isinstance(check, _Parser):
        check.lazy_epilog = _check_ids
    _add_host_flags(check, nproc=True)
    _add_sync_flag(check, run=False)

    _add_run(commands, inventory)
    _add_detached_commands(commands)
    _add_init(commands, inventory)
    docs = commands.add_parser("docs", help="print the documentation of TOPIC (no TOPIC: the topics)")
    docs.add_argument("topic", metavar="TOPIC", nargs="?", choices=_Topics(manual.topics()),
                      help="one of: " + ", ".join(manual.topics()))
    docs.set_defaults(handler=cmd_docs)

    completion = commands.add_parser("completion", help="print a shell completion script: "
                                     "source <(torchherd completion bash)")
    completion.add_argument("shell", metavar="SHELL", choices=("bash", "zsh", "fish"), help="bash, zsh or fish")
    completion.set_defaults(handler=cmd_completion)
    return parser


class _Topics(tuple[str, ...]):
    """The topics as ``docs``'s choices: listed by completion and the help; None (no
    topic) is one of them, as argparse checks the default of an optional positional."""

    def __contains__(self, item: object) -> bool:
        return item is None or super().__contains__(item)


def cmd_docs(args: argparse.Namespace, console: Console) -> int:
    from torchherd.console.manual import render_page, render_topics

    if args.topic is None:
        render_topics(console, [(topic, manual.title(manual.read(topic))) for topic in manual.topics()])
    else:
        render_page(console, manual.read(args.topic))
    return EXIT_OK


def cmd_completion(args: argparse.Namespace, console: Console) -> int:
    from torchherd.completion import script

    sys.stdout.write(script(build_parser(), args.shell))
    return EXIT_OK


def _add_run(commands: argparse._SubParsersAction[argparse.ArgumentParser],
             inventory: argparse.ArgumentParser) -> None:
    """``run``: what a newcomer needs first (the hosts, python, workdir, processes, --sync),
    every default said; torchrun's own flags, the output, recovery and SLURM in groups after."""
    run = commands.add_parser("run", parents=[inventory], help="check, then launch the job on every node",
                              usage="torchherd run [options] [--] SCRIPT [ARGS...]")
    run.add_argument("script", nargs=argparse.REMAINDER, help="[--] SCRIPT [ARGS...]: the training script, run "
                     "by torchrun on every node")
    _add_first_host_flags(run)
    run.add_argument("--nproc-per-node", metavar="N", help=NPROC_HELP)
    _add_sync_flag(run, run=True)
    run.add_argument("--env", metavar="K=V", action="append", default=[],
                     help="set a variable on every rank (repeatable; default: the inventory's env only)")
    run.add_argument("--env-pass", metavar="NAME", action="append", default=[],
                     help="pass this variable from the controller's environment (repeatable; default: none)")
    run.add_argument("--dry-run", action="store_true", help="print each node's command; start nothing (default: off)")
    run.add_argument("--no-check", action="store_true", help="skip the preflight checks; only connect (default: check)")
    run.add_argument("--only", metavar="ID,...",
                     help="the preflight runs only these checks (ids: check --help; default: all)")
    run.add_argument("--skip", metavar="ID,...", help="the preflight leaves these checks out (default: none)")
    run.add_argument("--detach", action="store_true",
                     help="start the job so it outlives this command; print the run id and return (default: off)")
    run.add_argument("--accept-new-host-keys", action="store_true",
                     help="trust and record unknown SSH host keys (changed keys are always refused; default: off)")
    run.add_argument("--grace", type=_grace, metavar="S", help="SIGTERM to SIGKILL, in seconds (default: 10)")
    run.add_argument("--no-fail-fast", action="store_true",
                     help="let the other nodes go on when one fails (default: tear them down at once)")
    _add_more_host_flags(run)

    torchrun = run.add_argument_group("torchrun's own flags, passed through")
    torchrun.add_argument("--master-addr", metavar="ADDR",
                          help="address the workers reach the master at (default: [cluster].master_addr, else "
                               "found by the preflight)")
    torchrun.add_argument("--rdzv-backend", choices=("static", "c10d"),
                          help="the rendezvous (default: [cluster].rdzv_backend, else static; c10d where the "
                               "nodes' process counts differ)")
    torchrun.add_argument("--nnodes", type=_nnodes, metavar="N|MIN:MAX",
                          help="torchrun --nnodes; MIN:MAX is elastic, c10d only (default: the number of hosts)")
    torchrun.add_argument("--max-restarts", type=_count, default=0, metavar="N",
                          help="torchrun --max-restarts (default: 0)")
    torchrun.add_argument("--monitor-interval", type=_interval, metavar="S",
                          help="torchrun --monitor-interval (default: torchrun's)")
    torchrun.add_argument("--rdzv-conf", metavar="K=V,...",
                          help="torchrun --rdzv-conf, c10d only (default: none)")
    torchrun.add_argument("-m", "--module", action="store_true",
                          help="SCRIPT is a module name, python -m (default: a file)")

    output = run.add_argument_group("output")
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
    run.set_defaults(handler=cmd_run)
    _add_recovery_flags(run)
    _add_scheduler_flags(run)


def _add_detached_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    status = commands.add_parser("status", help="state of runs (detached, and the attached ones of the history), per node")
    status.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    status.add_argument("run", nargs="?", metavar="RUN", help="run id (default: every known run)")
    status.set_defaults(handler=cmd_status)

    logs = commands.add_parser("logs", help="a run's output (detached or attached), with node:rank prefixes")
    logs.add_argument("-f", "--follow", action="store_true", help="follow until the run ends")
    logs.add_argument("--node", metavar="N", help="only this node")
    logs.add_argument("--rank", metavar="R", type=_count, help="only this global rank")
    logs.add_argument("--events", action="store_true",
                      help="the run's history instead: every event and node sample, one a line (UTC)")
    logs.add_argument("run", metavar="RUN", help="run id")
    logs.set_defaults(handler=cmd_logs)

    report = commands.add_parser("report", help="a run's history as one self-contained HTML page "
                                 "(timeline, progress, GPUs); --text: in a few lines")
    report.add_argument("-o", "--output", metavar="FILE", type=Path,
                        help="where to write the page (default: report.html in the run's log directory)")
    report.add_argument("--text", action="store_true", help="the story in a few lines on the terminal instead")
    report.add_argument("run", metavar="RUN", help="run id")
    report.set_defaults(handler=cmd_report)

    stop = commands.add_parser("stop", help="stop a detached run on every node, and confirm nothing is left")
    stop.add_argument("--grace", type=_grace, metavar="S", help="SIGTERM to SIGKILL (default: the run's)")
    stop.add_argument("run", metavar="RUN", help="run id")
    stop.set_defaults(handler=cmd_stop)

    attach = commands.add_parser("attach", help="follow a detached run live; Ctrl-C detaches, never stops")
    attach.add_argument("run", metavar="RUN", help="run id")
    attach.set_defaults(handler=cmd_attach)


def _strip_separator(args: argparse.Namespace) -> None:
    script = getattr(args, "script", None)
    if script and script[0] == "--":
        args.script = script[1:]


def main(argv: Sequence[str] | None = None, console: Console | None = None) -> int:
    """Parses, runs the command, and maps every ending to its exit code (the one place that
    does); a command given ``--json`` prints one JSON document on stdout in each of them."""
    words = sys.argv[1:] if argv is None else list(argv)
    args: argparse.Namespace | None = None
    try:
        args = _parse(words, console)
        if args.command is None:  # torchherd alone: the help, as git does, and a usage error's 2 (git's too)
            sys.stdout.write(build_parser().format_help())
            return EXIT_USAGE
        return _run(args, console)
    except SystemExit as stop:  # --help, --version
        return int(stop.code) if isinstance(stop.code, int) else EXIT_USAGE
    except _Ended as ended:
        if _json_wanted(args, words) and not getattr(args, "json_printed", False):
            print(json.dumps({"schema": JSON_SCHEMA, **_failure_json(ended.error, ended.exit_code)}, indent=2))
        return ended.exit_code


class _Ended(Exception):
    """A command that ended without its result, already told on stderr: ``main`` adds the
    JSON document, where one was asked for, and returns the exit code."""

    def __init__(self, error: BaseException, exit_code: int) -> None:
        super().__init__(str(error))
        self.error = error
        self.exit_code = exit_code


def _parse(words: Sequence[str], console: Console | None) -> argparse.Namespace:
    from torchherd.console import render_error

    parser = build_parser()
    try:
        # parse_known_args, then parse_args' own check: an unknown argument after --sync
        # is told as what it most likely is (the script taken as --sync's DIR)
        args, extra = parser.parse_known_args(words)
        _sync_took_the_script(args, extra)
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}{_did_you_mean(parser, args, extra[0])}")
    except UsageError as error:
        render_error(_error_console(console), error)
        raise _Ended(error, EXIT_USAGE) from None
    _strip_separator(args)
    return args


def _run(args: argparse.Namespace, given: Console | None) -> int:
    from torchherd.api import DetachedStartFailed, LaunchAborted  # after --help: it must stay fast
    from torchherd.console import make_console, render_error

    console = given or make_console()
    error_console = _error_console(console)
    handler: Handler = args.handler
    try:
        _warn_unfilled(args, error_console)
        return handler(args, console)
    except LaunchAborted as error:  # the observer has shown why (the report, the unreachable nodes)
        raise _Ended(error, EXIT_FAILED) from None
    except DetachedStartFailed as error:
        _render_detached_failure(error_console, error)
        raise _Ended(error, EXIT_FAILED) from None
    except TorchherdError as error:
        render_error(error_console, error)
        raise _Ended(error, error.exit_code) from None
    except KeyboardInterrupt as error:
        error_console.print("interrupted")
        raise _Ended(error, EXIT_INTERRUPTED) from None
    except Exception as error:  # a bug: one line, never a traceback (TORCHHERD_DEBUG=1 shows it)
        if os.environ.get("TORCHHERD_DEBUG"):
            raise
        internal = TorchherdError(f"internal error: {type(error).__name__}: {error}",
                                  "rerun with TORCHHERD_DEBUG=1 and report the traceback")
        render_error(error_console, internal)
        raise _Ended(internal, EXIT_FAILED) from None


def _warn_unfilled(args: argparse.Namespace, console: Console) -> None:
    """An inventory that still carries init's FILL IN markers holds guesses: one warning
    line naming them (on stderr, so --json's stdout stays one document)."""
    from rich.text import Text

    from torchherd import hostspec
    from torchherd.inventory import MAX_INVENTORY_BYTES

    if args.handler in (cmd_init, cmd_completion) or getattr(args, "hosts", None) or getattr(args, "nodelist", None):
        return
    path = _inventory_path(args)
    try:
        # A regular file of an inventory's size only (-i /dev/zero, a FIFO): the command's own
        # load names what is wrong with anything else.
        if not path.is_file() or path.stat().st_size > MAX_INVENTORY_BYTES:
            return
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return
    marked = hostspec.unfilled(text)
    if marked:
        shown = ", ".join(f"{key} (line {number})" for number, key in marked)
        console.print(Text(f"warning: {path}: still marked FILL IN: {shown}; check each value, then delete "
                           "the marker", style="yellow"), soft_wrap=True)


def _did_you_mean(parser: argparse.ArgumentParser, args: argparse.Namespace, unknown: str) -> str:
    """The command's flag that ``unknown`` most likely meant: the one it begins (flags are
    never abbreviated, but the user should learn the full name), else the closest."""
    if not unknown.startswith("--") or args.command is None:
        return ""
    flag = unknown.split("=", 1)[0]
    commands = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    command = commands[0]._name_parser_map[args.command]
    known = [option for option in command._option_string_actions if option.startswith("--")]
    begun = [option for option in known if option.startswith(flag)]
    close = begun if len(begun) == 1 else difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
    return f"; did you mean {close[0]}?" if close else ""


def _error_console(console: Console | None) -> Console:
    from torchherd.console import make_console

    if console is not None and console.file is not sys.stdout:
        return console
    return make_console(stderr=True)


def _render_detached_failure(console: Console, error: DetachedStartFailed) -> None:
    from rich.text import Text

    from torchherd.console import printable

    for message in error.start.errors:  # what the nodes said: escapes shown, never acted on
        console.print(Text(printable(message), style="bold red"), soft_wrap=True)
    left = error.start.left or {}
    clean = all(not processes for processes in left.values())
    console.print(Text(printable(str(error)) + ("" if clean else " (some processes are left)"), style="bold red"),
                  soft_wrap=True)


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
