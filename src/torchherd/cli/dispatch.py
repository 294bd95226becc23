"""``main(argv) -> int``: parses, runs the command, and maps every ending to its exit code
(the one place that does): 0 all good; 1 a check or the job failed; 2 usage or
inventory error; 130 interrupted."""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from typing import TYPE_CHECKING, Callable, Sequence

from torchherd.cli.cluster import inventory_path
from torchherd.cli.contract import JSON_SCHEMA, failure_json, json_wanted
from torchherd.cli.flags import sync_took_the_script
from torchherd.cli.init import cmd_init
from torchherd.cli.parser import build_parser, cmd_completion
from torchherd.cli.run import glued
from torchherd.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, TorchherdError, UsageError
from torchherd.inventory.options import OptionError

if TYPE_CHECKING:
    from rich.console import Console

    from torchherd.api import DetachedStartFailed


Handler = Callable[[argparse.Namespace, "Console"], int]


def _strip_separator(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    script = getattr(args, "script", None)
    if script and script[0] == "--":
        args.script = script[1:]
    elif script:
        _own_flag_after_script(_command_parser(parser, args.command), script)


SCRIPT_FLAGS_TOO = frozenset({"-h", "-i", "-m"})
"""Short flags of run's that scripts take as often (their help, an input, a model): passed on."""


def _own_flag_after_script(command: argparse.ArgumentParser, script: Sequence[str]) -> None:
    """``run -H a train.py --dry-run`` hands --dry-run to train.py (the script and all after
    it are the script's): refused without an explicit ``--``, which says the user meant it."""
    for word in script[1:]:
        if word == "--":
            return
        flag = word.split("=", 1)[0]
        if flag in command._option_string_actions and flag not in SCRIPT_FLAGS_TOO:
            raise UsageError(f"{flag} after {script[0]} would go to {script[0]}",
                             "put it before the script, or write -- before the script to pass it on")


def _command_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    commands = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    command: argparse.ArgumentParser = commands[0]._name_parser_map[name]
    return command


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
        if json_wanted(args, words) and not getattr(args, "json_printed", False):
            print(json.dumps({"schema": JSON_SCHEMA, **failure_json(ended.error, ended.exit_code)}, indent=2))
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
        args, extra = parser.parse_known_args(glued(words))
        sync_took_the_script(args, extra)
        if extra:  # named by the command that refused them: torchherd run --help has its flags
            command = _command_parser(parser, args.command) if args.command else parser
            command.error(f"unrecognized arguments: {' '.join(extra)}{_did_you_mean(parser, args, extra[0])}")
        _strip_separator(parser, args)
    except UsageError as error:
        render_error(_error_console(console), error)
        raise _Ended(error, EXIT_USAGE) from None
    return args


def _run(args: argparse.Namespace, given: Console | None) -> int:
    from torchherd.console import make_console, render_error

    console = given or make_console()
    error_console = _error_console(console)
    handler: Handler = args.handler
    try:
        _warn_unfilled(args, error_console)
        return handler(args, console)
    except OptionError as error:
        named = _named_here(error, args)
        render_error(error_console, named)
        raise _Ended(named, named.exit_code) from None
    except TorchherdError as error:
        # The run's errors are imported once one is raised: `check` and `--help` never load them.
        from torchherd.api import DetachedStartFailed, LaunchAborted

        if isinstance(error, LaunchAborted):  # the observer has shown why (the report, the unreachable nodes)
            raise _Ended(error, EXIT_FAILED) from None
        if isinstance(error, DetachedStartFailed):
            _render_detached_failure(error_console, error)
            raise _Ended(error, EXIT_FAILED) from None
        render_error(error_console, error)
        raise _Ended(error, error.exit_code) from None
    except KeyboardInterrupt as error:
        error_console.print("interrupted")
        raise _Ended(error, EXIT_INTERRUPTED) from None
    except Exception as error:  # a bug: one line, never a traceback (TORCHHERD_DEBUG=1 shows it)
        if os.environ.get("TORCHHERD_DEBUG"):
            raise
        internal = TorchherdError(f"internal error: {type(error).__name__}: {error}",
                                  "rerun with TORCHHERD_DEBUG=1 and report the traceback "
                                  "(what to send, and where: torchherd docs contributing)")
        render_error(error_console, internal)
        raise _Ended(internal, EXIT_FAILED) from None


def _named_here(error: OptionError, args: argparse.Namespace) -> OptionError:
    """An option's error the library words for an API caller (``Recovery(min_nodes=9)``),
    named as this command took the value: by its flag where the flag was given, else by the
    inventory's key."""
    option = error.option
    if error.final or option.flag is None:
        return error
    given = getattr(args, option.flag.lstrip("-").replace("-", "_"), None) is not None
    from_file = option.table is not None and not (getattr(args, "hosts", None) or getattr(args, "nodelist", None))
    if from_file and not given:
        return error.through(f"{inventory_path(args)}: {option.key} = {error.value!r}")
    return error.through(option.flag_words(error.value), flag=True)


def _warn_unfilled(args: argparse.Namespace, console: Console) -> None:
    """An inventory that still carries init's FILL IN markers holds guesses: one warning
    line naming them (on stderr, so --json's stdout stays one document)."""
    from rich.text import Text

    from torchherd.inventory import MAX_INVENTORY_BYTES, writer

    if args.handler in (cmd_init, cmd_completion) or getattr(args, "hosts", None) or getattr(args, "nodelist", None):
        return
    path = inventory_path(args)
    try:
        # A regular file of an inventory's size only (-i /dev/zero, a FIFO): the command's own
        # load names what is wrong with anything else.
        if not path.is_file() or path.stat().st_size > MAX_INVENTORY_BYTES:
            return
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return
    marked = writer.unfilled(text)
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
    command = _command_parser(parser, args.command)
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
