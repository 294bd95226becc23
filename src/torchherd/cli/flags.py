"""Flag groups more than one command takes: the hosts and this run's choices, each
scheduler table's ``--NAME-KEY`` (as the scheduler declares them), and ``--sync`` with its
uv flags."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from torchherd.cli.values import port, positive, ssh_timeout
from torchherd.errors import UsageError

if TYPE_CHECKING:
    from rich.console import Console


def sync_printer(console: Console) -> Callable[[object], None]:
    from torchherd.console.sync import SyncPrinter

    return SyncPrinter(console)


def add_sync_flag(parser: argparse._ActionsContainer, environments: argparse._ActionsContainer, run: bool) -> None:
    """--sync and what it sends, in ``parser`` (the job's group); the uv flags in ``environments``."""
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
    environments.add_argument("--uv", action="store_true", default=None,
                        help="run the job in a venv that uv sync --frozen builds on every node from the synced "
                             "project's uv.lock, kept while the lock is unchanged (on by itself when the project "
                             "has pyproject.toml and uv.lock; default: that)")
    environments.add_argument("--no-uv", dest="uv", action="store_false",
                        help="the node's configured python, even for a project with uv.lock (default: off)")
    environments.add_argument("--uv-system-site-packages", action="store_true",
                        help="the venv also sees the packages of the node's configured python (a torch installed "
                             "there; default: off)")
    environments.add_argument("--uv-offline", action="store_true", default=None,
                        help="nodes without a package index: a node that must build its venv gets the lock's "
                             "wheels from this machine (downloaded once per node platform, relayed node to node) "
                             "and builds with no network (default: [uv] offline, else off)")


def sync_choices(args: argparse.Namespace, syncs: bool) -> None:
    """--sync-include and --sync-anyway mean nothing when nothing is synced: said, not ignored."""
    given = [flag for flag, value in (("--sync-include", args.sync_include), ("--sync-anyway", args.sync_anyway))
             if value]
    if given and not syncs:
        raise UsageError(f"{given[0]} without --sync: nothing is synced", "add --sync [DIR]")


def sync_took_the_script(args: argparse.Namespace, extra: Sequence[str]) -> None:
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


GROUPS = {
    "hosts": "hosts",
    "job": "the job",
    "torchrun": "the job: torchrun's own flags, passed through",
    "checks": "checks",
    "output": "output",
    "recovery": "recovery (torchherd docs run: Recovery); each flag overrides [recovery]",
    "environments": "containers and environments",
}
"""Every command's --help groups its flags so, in this order (the ones it has), each
scheduler's own last (``add_scheduler_flags``): a flag is found in the same place whichever
command's help it is read in."""


def flag_groups(parser: argparse.ArgumentParser, *names: str) -> dict[str, argparse._ArgumentGroup]:
    """The command's groups ``names``, created in GROUPS's order (argparse shows them in the
    order they were made); "hosts" is the one ``-i`` came in with, from the inventory parent."""
    made: dict[str, argparse._ArgumentGroup] = {}
    for name, title in GROUPS.items():
        if name in names:
            found = [group for group in parser._action_groups if group.title == title]
            made[name] = found[0] if found else parser.add_argument_group(title)
    return made


def add_scheduler_flags(parser: argparse.ArgumentParser) -> None:
    """``--scheduler``, and each scheduler table's keys as ``--NAME-KEY`` (``engine.schedulers``),
    in a group per table; ``--scheduler`` heads the first."""
    from torchherd.engine.schedulers import known, names

    groups = [parser.add_argument_group(f"{table.title} (torchherd docs {table.name}); each --{table.name}-KEY "
                                        f"overrides [{table.name}].KEY",
                                        f"default for each --{table.name}-KEY: [{table.name}].KEY, else "
                                        f"{table.flags_default}") for table in known().tables]
    (groups[0] if groups else parser).add_argument(
        "--scheduler", choices=names(), help="who starts the job on the nodes (default: [cluster].scheduler, else ssh)")
    for table, group in zip(known().tables, groups):
        for flag in table.flags:
            options: dict[str, Any] = {"metavar": flag.metavar, "help": flag.help}
            if flag.kind == "count":
                options["type"] = positive
            elif flag.kind == "repeat":
                options["action"] = "append"
            group.add_argument(f"--{table.name}-{flag.key.replace('_', '-')}", **options)


def table_flags(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """What the command line gave each scheduler table (``Cluster.using``'s keywords)."""
    from torchherd.engine.schedulers import known

    return {table.name: {key: getattr(args, f"{table.name}_{key}", None) for key in table.keys}
            for table in known().tables}


def add_host_flags(hosts: argparse._ActionsContainer, unused: frozenset[str] = frozenset()) -> None:
    """Hosts without an inventory file, and the choices that override it for one command; a
    command leaves out the ``unused`` flags, which would do nothing there (refused, not ignored)."""
    group = _Without(hosts, unused)
    group.add_argument("-H", "--hosts", metavar="HOSTS",
                       help="[user@]host[:port],... (nodesets: gpu[01-16]); no inventory file needed "
                            "(default: the inventory's hosts)")
    group.add_argument("--nodelist", metavar="LIST",
                       help="hosts as a SLURM nodelist: gpu[01-04],cpu1 (default: the inventory's hosts)")
    group.add_argument("--master", metavar="HOST", help="the host with node_rank 0 (default: the first)")
    group.add_argument("--master-port", metavar="PORT", type=port,
                       help="the master (rendezvous) port, torchrun's --master-port (default: [cluster].port, "
                            "else 29500)")
    group.add_argument("--include", metavar="HOSTS", help="only these hosts (names, nodesets, globs; default: all)")
    group.add_argument("--exclude", metavar="HOSTS", help="leave these hosts out (names, nodesets, globs; default: "
                       "none)")
    group.add_argument("--ssh-timeout", metavar="S", type=ssh_timeout,
                       help="seconds to connect and authenticate to a node (default: [cluster].ssh_timeout, else 10)")
    group.add_argument("--accept-new-host-keys", action="store_true",
                       help="trust and record unknown SSH host keys (changed keys are always refused; default: off)")


def add_place_flags(job: argparse._ActionsContainer) -> None:
    """Where and with what the job runs on every node, and how many processes."""
    job.add_argument("--python", metavar="PATH",
                     help="the interpreter with torch on every node (default: the inventory's python, else python3)")
    job.add_argument("--workdir", metavar="DIR",
                     help="where the job runs on every node (default: the inventory's workdir, else ~)")
    job.add_argument("--nproc-per-node", metavar="N", help=NPROC_HELP)


def add_container_flags(environments: argparse._ActionsContainer, unused: frozenset[str] = frozenset()) -> None:
    """The image the job runs in; a command leaves out the ``unused`` flags."""
    group = _Without(environments, unused)
    group.add_argument("--image", metavar="IMAGE",
                       help="run the job inside this container image on every node (torchherd docs containers; default: "
                            "[container].image, else none)")
    group.add_argument("--container-runtime", metavar="RUNTIME",
                       help="auto, podman, docker, apptainer or enroot (default: [container].runtime, auto)")
    group.add_argument("--pull", metavar="POLICY",
                       help="never (default), missing or always: run pulls the image on every node at once before "
                            "its preflight, a bar per node")
    group.add_argument("--image-archive", metavar="FILE",
                       help="a docker save / podman save tar of the image: sent once, relayed node to node and loaded "
                            "on every node that lacks the image, before the launch (default: [container].archive)")


class _Without:
    """A group that adds every flag but the ``unused`` ones."""

    def __init__(self, group: argparse._ActionsContainer, unused: frozenset[str]) -> None:
        self.group, self.unused = group, unused

    def add_argument(self, *names: str, **options: Any) -> None:
        if not self.unused.intersection(names):
            self.group.add_argument(*names, **options)


NPROC_HELP = "processes per node: an int, gpu, cpu or auto (default: each host's nproc_per_node, else 1)"
