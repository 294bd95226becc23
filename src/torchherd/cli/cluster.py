"""Which hosts a command runs on: ``-H`` or ``--nodelist`` (no file), else the inventory
or hostfile of ``-i``; then ``--include``/``--exclude``, ``--master`` and the container and
SLURM flags for this run."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from torchherd.cli.flags import table_flags
from torchherd.cli.values import nproc_count
from torchherd.errors import UsageError

if TYPE_CHECKING:
    from torchherd.api import Cluster


def inventory_path(args: argparse.Namespace) -> Path:
    not_empty(args, "inventory", "-i", "name the file: -i hosts.toml, or leave out -i for "
               "$TORCHHERD_INVENTORY, then ./hosts.toml")
    chosen = getattr(args, "inventory", None) or os.environ.get("TORCHHERD_INVENTORY") or "hosts.toml"
    return Path(chosen).expanduser()


def not_empty(args: argparse.Namespace, key: str, flag: str, hint: str) -> None:
    """A flag given an empty value (an unset variable: -H "$HOSTS") is an error, never the
    same as the flag left out: that would quietly take ./hosts.toml's hosts instead."""
    value = getattr(args, key, None)
    if value is not None and not value.strip():
        raise UsageError(f"{flag} {value!r}: empty (an unset variable?)", hint)


def hosts_of(args: argparse.Namespace) -> Cluster:
    """The hosts: ``-H`` or ``--nodelist`` (no file), else the inventory or hostfile of
    ``-i``; then ``--include``/``--exclude`` and ``--master`` for this run."""
    from torchherd.api import Cluster

    not_empty(args, "hosts", "-H", "name the hosts: -H node0,node1 (or leave out -H to use the inventory)")
    not_empty(args, "nodelist", "--nodelist", "name the hosts: --nodelist 'gpu[01-04]' (or leave it out to use "
               "the inventory)")
    hosts, nodelist = getattr(args, "hosts", None), getattr(args, "nodelist", None)
    if hosts and nodelist:
        raise UsageError("-H and --nodelist: give one of them", "-H also takes nodesets: -H 'gpu[01-04]'")
    if (hosts or nodelist) and getattr(args, "inventory", None):
        raise UsageError(f"-i {args.inventory} and {'-H' if hosts else '--nodelist'}: give the hosts one way",
                         "drop -i to use only the hosts given, or --include to pick hosts of the inventory")
    python, workdir = getattr(args, "python", None), getattr(args, "workdir", None)
    nproc = nproc_count(getattr(args, "nproc_per_node", None))
    accept = bool(getattr(args, "accept_new_host_keys", False))
    if hosts:
        cluster = Cluster.from_hosts(hosts, python=python, workdir=workdir, nproc_per_node=nproc,
                                     accept_new_host_keys=accept)
    elif nodelist:
        cluster = Cluster.from_nodelist(nodelist, python=python, workdir=workdir, nproc_per_node=nproc,
                                        accept_new_host_keys=accept)
    else:
        cluster = Cluster.from_file(inventory_path(args), python=python, workdir=workdir, nproc_per_node=nproc,
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
    # `is None`, not falsiness: an empty --image '' (an unset $IMAGE) is refused, not ignored
    if image is None and runtime is None and pull is None and archive is None:
        return cluster
    return cluster.with_container(image, runtime=runtime, pull=pull, archive=archive, where="")


def cluster_of(args: argparse.Namespace) -> Cluster:
    cluster = hosts_of(args)
    return cluster.using(getattr(args, "scheduler", None), **table_flags(args))
