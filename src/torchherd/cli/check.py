"""``torchherd check``: the preflight checks only, live on a terminal, or one JSON document."""

from __future__ import annotations

import argparse
import textwrap
from typing import TYPE_CHECKING, Callable

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
    sync_printer,
)
from torchherd.cli.values import id_list, rate
from torchherd.errors import EXIT_FAILED, EXIT_OK

if TYPE_CHECKING:
    from rich.console import Console

    from torchherd.api import Cluster
    from torchherd.checks.results import CheckReport


def _known_checks(cluster: Cluster) -> tuple[str, ...]:
    """The check ids this cluster's checks take: SLURM's own too where SLURM runs the job."""
    from torchherd.checks.model import CHECK_IDS

    return CHECK_IDS + cluster.backend.check_ids


def cmd_check(args: argparse.Namespace, console: Console) -> int:
    from torchherd.console.checks import live_progress, render_report

    cluster = cluster_of(args)
    script = args.script[0] if args.script else None
    known = _known_checks(cluster)
    only, skip = id_list(args.only, "--only", known), id_list(args.skip, "--skip", known) or frozenset()
    sync_choices(args, bool(args.sync))  # check syncs only with --sync, [sync] table or not
    more = {"bandwidth": args.bandwidth, "min_bandwidth": args.min_bandwidth, "gpu_diag": args.gpu_diag,
            "sync_include": tuple(args.sync_include), "sync_anyway": args.sync_anyway, "uv": args.uv,
            "uv_system_site_packages": args.uv_system_site_packages, "uv_offline": args.uv_offline}
    cluster.backend.allow("--matrix", args.matrix)
    if args.json:
        report = cluster.check(script, only=only, skip=skip, smoke=args.smoke, mesh=args.mesh, sync=args.sync,
                               on_event=_sync_events(args, None), **more)  # stdout: the JSON
        emit(args, report.as_json())
    elif not cluster.backend.live_checks:  # the results come at once: no live grid
        report = cluster.check(script, only=only, skip=skip, smoke=args.smoke, mesh=args.mesh, sync=args.sync,
                               on_event=_sync_events(args, console), **more)
        render_report(console, report)
    else:
        with live_progress(console, cluster.inventory, args.bandwidth or args.smoke) as progress:
            report = cluster.check(script, only=only, skip=skip, smoke=args.smoke, mesh=args.mesh, on_result=progress,
                                   sync=args.sync, on_event=_sync_events(args, console), **more)
        render_report(console, report)
        _render_matrix(console, cluster, report, args.matrix)
    return EXIT_OK if report.ok else EXIT_FAILED


def _sync_events(args: argparse.Namespace, console: Console | None) -> Callable[[object], None] | None:
    """The sync's progress (to ``console``, else stderr: stdout holds the JSON), where check
    syncs (``--sync``): it reports no other event, and without a sync the printer and the
    events it renders are never loaded."""
    if not args.sync:
        return None
    if console is None:
        from torchherd.console import make_console

        console = make_console(stderr=True)
    return sync_printer(console)


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


def check_ids() -> str:
    """``check --help``'s list of the ids --only and --skip take (imported only for the help:
    the checks package is slow to import)."""
    from torchherd.checks.model import CHECK_IDS, OPT_IN
    from torchherd.engine.backend import own_checks

    plain = ", ".join(check for check in CHECK_IDS if check not in OPT_IN)
    measured = ", ".join(check for check in CHECK_IDS if check in OPT_IN and check not in ("smoke", "gpudiag"))
    own = "".join(f"; {title} runs also: {', '.join(ids)}" for title, ids in own_checks())
    text = (f"check ids for --only and --skip: {plain}; with --bandwidth or --smoke (or named by --only): "
            f"{measured}; with --smoke: smoke; with --gpu-diag: gpudiag{own}. "
            "What each establishes: torchherd docs checks.")
    return textwrap.fill(text, width=79, break_on_hyphens=False) + "\n\n" + CHECK_EXAMPLES  # an id is never cut at its hyphen


CHECK_EXAMPLES = """\
examples:
  torchherd check -H localhost                   # this machine, no SSH
  torchherd check -H 'gpu[01-04]' --python /opt/venv/bin/python -- train.py
  torchherd check --only ssh,port --json         # two checks, one JSON document"""


def add_check(commands: argparse._SubParsersAction[argparse.ArgumentParser],
              inventory: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``check``'s flags; the parser, for the help's list of check ids (``build_parser``)."""
    check = commands.add_parser("check", parents=[inventory], help="preflight checks only; changes nothing (--sync and --uv do: the project, its venvs)",
                                usage="torchherd check [options] [-- SCRIPT]",
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # the epilog comes wrapped
    check.add_argument("script", nargs=argparse.REMAINDER, help="[--] SCRIPT: also check the training script")
    groups = flag_groups(check, "hosts", "job", "checks", "output", "environments")
    add_host_flags(groups["hosts"])
    add_place_flags(groups["job"])
    add_sync_flag(groups["job"], groups["environments"], run=False)
    group = groups["checks"]
    group.add_argument("--only", metavar="ID,...", help="run only these checks (the ids are listed below)")
    group.add_argument("--skip", metavar="ID,...", help="skip these checks (the ids are listed below)")
    group.add_argument("--smoke", action="store_true", help="also run a tiny real all_reduce on every node")
    group.add_argument("--gpu-diag", action="store_true",
                       help="also run DCGM's level-1 GPU diagnostic (dcgmi diag -r 1) where DCGM is installed")
    group.add_argument("--bandwidth", action="store_true",
                       help="also measure the links' throughput and path MTU between the nodes (--smoke does too)")
    group.add_argument("--min-bandwidth", type=rate, metavar="RATE",
                       help="with --bandwidth: a link or node below RATE (10Gbit, 800Mbit) fails "
                            "(default: [checks] min_bandwidth, else no floor)")
    group.add_argument("--mesh", choices=("auto", "full"), default="auto",
                       help="probe every pair of nodes (full), or beyond 32 nodes a sampled set that still "
                            "covers every node and subnet (auto, the default)")
    groups["output"].add_argument("--json", action="store_true", help="print one JSON document on stdout")
    groups["output"].add_argument("--matrix", action="store_true",
                                  help="always show the probes as a node x node matrix (shown anyway when one failed)")
    add_container_flags(groups["environments"], unused=frozenset({"--pull"}))  # check never pulls
    add_scheduler_flags(check)  # each scheduler's group, last
    check.set_defaults(handler=cmd_check)
    return check
