"""``torchherd init``: writes a commented ``hosts.toml`` (from ``-H`` or ~/.ssh/config),
or the documented example; never overwrites a file."""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from torchherd import words
from torchherd.cli.cluster import inventory_path, not_empty
from torchherd.cli.flags import flag_groups
from torchherd.cli.values import nproc_count
from torchherd.errors import EXIT_OK, UsageError

if TYPE_CHECKING:
    from rich.console import Console


DEFAULT_SSH_CONFIG = "~/.ssh/config"


def cmd_init(args: argparse.Namespace, console: Console) -> int:
    from torchherd.inventory import hostspec, writer

    not_empty(args, "hosts", "-H", "name the hosts: -H node0,node1 (or leave out -H for two placeholder hosts)")
    if args.example_script is not None:
        return _init_example_script(args, Path(args.example_script), console)
    path = inventory_path(args)
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
        names = writer.ssh_config_aliases(text, args.from_ssh_config)
        if not names:
            raise UsageError(f"--from-ssh-config {args.from_ssh_config}: no Host entry of {config} matches",
                             "a glob over Host names, e.g. 'gpu*'")
        entries, source = hostspec.host_entries(",".join(names), "--from-ssh-config"), f" from {config}"
        if config.resolve() != Path(DEFAULT_SSH_CONFIG).expanduser().resolve():
            ssh_config = str(config.resolve())  # its aliases resolve only through it
    if entries and args.master is not None:  # named as the flag, before a file is written
        hostspec.document([table for entry in entries for table in entry.tables()], master=args.master,
                          flag="-H" if args.hosts else "--from-ssh-config")
    nproc = nproc_count(args.nproc_per_node)
    named = "" if path == Path("hosts.toml") else f"-i {shlex.quote(str(path))} "
    then = f"torchherd {named}hosts; torchherd {named}check -- train.py"
    text = writer.inventory_text(entries, python=args.python, workdir=args.workdir, nproc_per_node=nproc,
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


EXAMPLE_SCRIPT_RUN = "torchherd run -H localhost --nproc-per-node 2 -- {script}"
"""The first run of the example script: this machine, no SSH."""


def _init_example_script(args: argparse.Namespace, path: Path, console: Console) -> int:
    """The example DDP training script shipped in the package (examples/ddp_demo.py), written
    as ``path``: a pip user's first job, on CPU (gloo) or GPU (nccl)."""
    from importlib.resources import files

    given = [flag for flag, value in (("-H", args.hosts), ("--from-ssh-config", args.from_ssh_config),
                                      ("--python", args.python), ("--workdir", args.workdir),
                                      ("--nproc-per-node", args.nproc_per_node), ("--master", args.master),
                                      ("--example", args.example or None)) if value is not None]
    if given:
        raise UsageError(f"--example-script and {given[0]}: the script is written alone",
                         "write the script first, then the inventory: torchherd init --example-script; torchherd init -H ...")
    if path.exists() or path.is_symlink():
        raise UsageError(f"--example-script {path}: already exists; init never overwrites a file",
                         "name another file: torchherd init --example-script other.py")
    _written(path, files("torchherd").joinpath("train.example").read_text(encoding="utf-8"))
    run = EXAMPLE_SCRIPT_RUN.format(script=shlex.quote(str(path)))
    console.print(f"wrote {path}: a small DDP training script (CPU or GPU, torch only); run it here: {run}",
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


def add_init(commands: argparse._SubParsersAction[argparse.ArgumentParser],
              inventory: argparse.ArgumentParser) -> None:
    init = commands.add_parser("init", parents=[inventory],
                               help="write a commented hosts.toml (from -H or ~/.ssh/config); never overwrites",
                               usage="torchherd init [options]")
    groups = flag_groups(init, "hosts", "job", "output")
    hosts = groups["hosts"]
    hosts.add_argument("-H", "--hosts", metavar="HOSTS", help="[user@]host[:port],... (nodesets: gpu[01-16])")
    hosts.add_argument("--from-ssh-config", metavar="PATTERN",
                       help="the Host entries of ~/.ssh/config matching this glob, e.g. 'gpu*'")
    hosts.add_argument("--ssh-config", metavar="FILE", default=DEFAULT_SSH_CONFIG,
                       help="the OpenSSH config --from-ssh-config reads (default: ~/.ssh/config)")
    hosts.add_argument("--master", metavar="HOST", help="the host with node_rank 0 (default: the first)")
    job = groups["job"]
    job.add_argument("--python", metavar="PATH", help="the interpreter with torch on the nodes")
    job.add_argument("--workdir", metavar="DIR", help="where the job runs on the nodes")
    job.add_argument("--nproc-per-node", metavar="N", help="processes per node (int, gpu, cpu, auto)")
    output = groups["output"]
    output.add_argument("--example", action="store_true",
                        help="write the documented example inventory instead (every key, explained)")
    output.add_argument("--example-script", metavar="FILE", nargs="?", const="train.py",
                        help="write instead a small DDP training script (CPU or GPU) as FILE (default: train.py), "
                             "to run first: torchherd run -H localhost -- train.py")
    init.set_defaults(handler=cmd_init)
