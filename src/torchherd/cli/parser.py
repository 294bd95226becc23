"""The parser: every command and its flags (each command group adds its own), argparse's
errors as the CLI's others, and the commands about the tool itself (``docs``,
``completion``)."""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import TYPE_CHECKING, Any, Callable, NoReturn

from torchherd import __version__, manual
from torchherd.cli.check import add_check, check_ids
from torchherd.cli.flags import GROUPS
from torchherd.cli.hosts import add_hosts
from torchherd.cli.init import add_init
from torchherd.cli.run import add_run
from torchherd.cli.runs import add_detached_commands
from torchherd.errors import EXIT_OK, UsageError

if TYPE_CHECKING:
    from rich.console import Console


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
        close = [choice for choice in known if choice.lower() == str(value).lower()] or difflib.get_close_matches(
            str(value), known, n=1, cutoff=0.6)  # RUN for run first: case, then spelling
        guess = f"; did you mean {close[0]!r}?" if close else ""
        if isinstance(action, argparse._SubParsersAction):
            raise argparse.ArgumentError(None, f"unknown command {value!r}{guess} (commands: {', '.join(known)})")
        raise argparse.ArgumentError(action, f"invalid choice {value!r}{guess} (choose from {', '.join(known)})")

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}", f"{self.prog} --help lists the options")


def build_parser() -> argparse.ArgumentParser:
    inventory = argparse.ArgumentParser(add_help=False)
    # in the group "hosts": a command's help shows its hosts first, -i with them (flags.GROUPS)
    inventory.add_argument_group(GROUPS["hosts"]).add_argument(
        "-i", "--inventory", metavar="FILE", default=argparse.SUPPRESS,
        help="host inventory (default: $TORCHHERD_INVENTORY, then ./hosts.toml)")
    parser: argparse.ArgumentParser = _Parser(  # its subparsers are _Parsers too
        prog="torchherd", parents=[inventory],
        description="Run one PyTorch distributed job on many machines: check, launch, stream, tear down.")
    parser.add_argument("-V", "--version", action="version", version=f"torchherd {__version__}")
    # not required: torchherd alone prints this help (main), where argparse would say only
    # that COMMAND is missing
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    add_hosts(commands, inventory)
    check = add_check(commands, inventory)
    if isinstance(check, _Parser):  # subparsers are of the parser's class
        check.lazy_epilog = check_ids
    add_run(commands, inventory)
    add_detached_commands(commands)
    add_init(commands, inventory)
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
        # paged only on this process's own terminal (a console handed in by a caller is theirs)
        render_page(console, manual.read(args.topic), manual.topics(), page=console.file is sys.stdout)
    return EXIT_OK


def cmd_completion(args: argparse.Namespace, console: Console) -> int:
    from torchherd.completion import script

    sys.stdout.write(script(build_parser(), args.shell))
    return EXIT_OK
