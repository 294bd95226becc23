"""``torchherd hosts``: the resolved inventory, as a table or JSON."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from torchherd.cli.cluster import cluster_of
from torchherd.cli.contract import emit
from torchherd.cli.flags import add_container_flags, add_host_flags, add_place_flags, flag_groups
from torchherd.errors import EXIT_OK

if TYPE_CHECKING:
    from rich.console import Console


def cmd_hosts(args: argparse.Namespace, console: Console) -> int:
    from torchherd.console.hosts import THIS_MACHINE, hosts_rows, render_hosts
    from torchherd.transport.ssh import resolve_target

    inventory = cluster_of(args).inventory
    targets = [THIS_MACHINE if host.transport == "local" else resolve_target(host, inventory.cluster.ssh_config).describe()
               for host in inventory.hosts]
    if args.json:
        emit(args, {"hosts": hosts_rows(inventory, targets)})
    else:
        render_hosts(console, inventory, targets)
    return EXIT_OK


def add_hosts(commands: argparse._SubParsersAction[argparse.ArgumentParser],
              inventory: argparse.ArgumentParser) -> None:
    hosts = commands.add_parser("hosts", parents=[inventory], help="show the resolved inventory",
                                usage="torchherd hosts [options]")
    groups = flag_groups(hosts, "hosts", "job", "output", "environments")
    # hosts connects to no node: what only a connection uses would do nothing here (refused)
    add_host_flags(groups["hosts"], unused=frozenset({"--ssh-timeout", "--accept-new-host-keys"}))
    add_place_flags(groups["job"])
    groups["output"].add_argument("--json", action="store_true", help="print the inventory as JSON")
    add_container_flags(groups["environments"], unused=frozenset({"--pull", "--image-archive"}))
    hosts.set_defaults(handler=cmd_hosts)
