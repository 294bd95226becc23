"""The commands about runs already started: ``status``, ``logs``, ``report``, ``attach`` and ``stop``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from torchherd.cli.contract import emit
from torchherd.cli.flags import flag_groups
from torchherd.cli.values import count, grace
from torchherd.errors import EXIT_FAILED, EXIT_OK, UsageError

if TYPE_CHECKING:
    from rich.console import Console


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
            emit(args, run_json(row))
        else:
            render_status(console, row.record, row.states, row.recovery, row.attached)
    elif args.json:
        emit(args, {"runs": [run_json(listed(run)) for run in runs()]})
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


RUN_HELP = "run id, or a unique start or end of it (e7c180 for th-20260101-120000-e7c180)"


def add_detached_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    status = commands.add_parser("status", help="state of runs (detached, and the attached ones of the history), per node")
    flag_groups(status, "output")["output"].add_argument("--json", action="store_true", help="print one JSON document on stdout")
    status.add_argument("run", nargs="?", metavar="RUN", help=RUN_HELP + " (default: every known run)")
    status.set_defaults(handler=cmd_status)

    logs = commands.add_parser("logs", help="a run's output (detached or attached), with node:rank prefixes")
    output = flag_groups(logs, "output")["output"]
    output.add_argument("-f", "--follow", action="store_true", help="follow until the run ends")
    output.add_argument("--node", metavar="N", help="only this node, by its name (as `torchherd status RUN` lists it)")
    output.add_argument("--rank", metavar="R", type=count, help="only this global rank")
    output.add_argument("--events", action="store_true",
                      help="the run's history instead: every event and node sample, one a line (UTC)")
    logs.add_argument("run", metavar="RUN", help=RUN_HELP)
    logs.set_defaults(handler=cmd_logs)

    report = commands.add_parser("report", help="a run's history as one self-contained HTML page "
                                 "(timeline, progress, GPUs); --text: in a few lines")
    written = flag_groups(report, "output")["output"]
    written.add_argument("-o", "--output", metavar="FILE", type=Path,
                        help="where to write the page (default: report.html in the run's log directory)")
    written.add_argument("--text", action="store_true", help="the story in a few lines on the terminal instead")
    report.add_argument("run", metavar="RUN", help=RUN_HELP)
    report.set_defaults(handler=cmd_report)

    stop = commands.add_parser("stop", help="stop a detached run on every node, and confirm nothing is left")
    flag_groups(stop, "job")["job"].add_argument("--grace", type=grace, metavar="S", help="SIGTERM to SIGKILL (default: the run's)")
    stop.add_argument("run", metavar="RUN", help=RUN_HELP)
    stop.set_defaults(handler=cmd_stop)

    attach = commands.add_parser("attach", help="follow a detached run live; Ctrl-C detaches, never stops")
    attach.add_argument("run", metavar="RUN", help=RUN_HELP)
    attach.set_defaults(handler=cmd_attach)
