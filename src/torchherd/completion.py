"""``torchherd completion bash|zsh|fish``: a completion script written from the argparse
parser itself, so a flag added to the parser is completed without a second list to keep.

The scripts are static: pressing TAB runs no Python. They complete the commands, each
command's flags, the choices of a flag that has them (``--rdzv-backend``), and otherwise
leave the word to the shell's file completion (scripts, inventories, directories).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

SHELLS = ("bash", "zsh", "fish")
PROG = "torchherd"
_NAME = re.compile(r"^[A-Za-z0-9_.,:=+@/-]+$")
"""What may stand unquoted in the scripts: every flag, command and choice torchherd has."""


@dataclass(frozen=True)
class Option:
    flags: tuple[str, ...]
    takes_value: bool
    choices: tuple[str, ...]
    help: str


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    options: tuple[Option, ...]
    positional_choices: tuple[str, ...]
    """The choices of a positional argument (``completion``'s SHELL); empty: files."""


def _word(text: str) -> str:
    if not _NAME.match(text):  # a flag or choice that would need quoting in three shells
        raise ValueError(f"{text!r}: not completable as it is")
    return text


def _summary(text: str | None) -> str:
    """The help's first clause, its default left out, one line: for the shells that show
    one beside each word (zsh, fish)."""
    line = re.sub(r"\s*\(default[^)]*\)", "", " ".join((text or "").split()))
    first = line.split("; ", 1)[0].strip()
    return first if len(first) <= 80 else first[:79] + "…"


def _checked_values() -> dict[str, tuple[str, ...]]:
    """The words of the flags whose values are checked after parsing (a comma list, a
    number or a word), not by argparse's choices: taken from the rules that check them."""
    from torchherd.checks.model import CHECK_IDS
    from torchherd.inventory.rules import NPROC_WORDS
    from torchherd.remote.container import PULL_CHOICES, RUNTIMES

    return {"--pull": PULL_CHOICES, "--container-runtime": ("auto", *RUNTIMES), "--nproc-per-node": NPROC_WORDS,
            "--only": tuple(CHECK_IDS), "--skip": tuple(CHECK_IDS)}


def _options(parser: argparse.ArgumentParser) -> tuple[Option, ...]:
    found = []
    checked = _checked_values()
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        words = action.choices or next((checked[flag] for flag in action.option_strings if flag in checked), ())
        choices = tuple(_word(str(choice)) for choice in words)
        found.append(Option(tuple(_word(flag) for flag in action.option_strings), action.nargs != 0, choices,
                            _summary(action.help)))
    return tuple(found)


def commands_of(parser: argparse.ArgumentParser) -> tuple[tuple[Option, ...], tuple[Command, ...]]:
    """The top level's options, and every command with its own."""
    [sub] = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    helps = {choice.dest: choice.help for choice in sub._choices_actions}
    commands = []
    for name, command in sub.choices.items():
        positional = [action for action in command._actions if not action.option_strings and action.choices]
        choices = tuple(_word(str(choice)) for choice in positional[0].choices) if positional else ()
        commands.append(Command(_word(name), _summary(helps.get(name)), _options(command), choices))
    return _options(parser), tuple(commands)


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    top, commands = commands_of(parser)
    if shell == "bash":
        return _bash(top, commands)
    if shell == "zsh":
        return _zsh(top, commands)
    return _fish(top, commands)


def _flags(options: tuple[Option, ...]) -> str:
    return " ".join(flag for option in options for flag in option.flags)


def _value_flags(top: tuple[Option, ...]) -> str:
    """The top-level flags that take a value: the word after one is not the command."""
    return "|".join(flag for option in top if option.takes_value for flag in option.flags)


def _choice_cases(commands: tuple[Command, ...], indent: str, close: str) -> list[str]:
    """``case`` arms (bash and zsh read them alike) completing a flag's choices."""
    seen: dict[str, tuple[str, ...]] = {}
    for command in commands:
        for option in command.options:
            if option.choices:
                for flag in option.flags:
                    seen.setdefault(flag, option.choices)
    return [f"{indent}{flag}) {close.format(words=' '.join(choices))} ;;" for flag, choices in seen.items()]


def _bash(top: tuple[Option, ...], commands: tuple[Command, ...]) -> str:
    names = " ".join(command.name for command in commands)
    arms = [f"        {command.name}) opts=\"{_flags(command.options)}\""
            + (f"; choices=\"{' '.join(command.positional_choices)}\"" if command.positional_choices else "")
            + " ;;" for command in commands]
    choice_arms = _choice_cases(commands, "        ", 'COMPREPLY=($(compgen -W "{words}" -- "$cur")); return 0')
    return "\n".join([
        f"# bash completion for {PROG}: source <({PROG} completion bash)",
        f"_{PROG}() {{",
        '    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}"',
        '    local command="" opts="" choices="" i',
        "    COMPREPLY=()",
        "    for ((i = 1; i < COMP_CWORD; i++)); do",
        '        case "${COMP_WORDS[i]}" in',
        "            --) return 0 ;;  # the script and its arguments: the shell's file completion",
        f'            {_value_flags(top)}) [[ -z "$command" ]] && ((i++)) ;;',
        "            -*) ;;",
        '            *) [[ -z "$command" ]] && command="${COMP_WORDS[i]}" ;;',
        "        esac",
        "    done",
        '    if [[ -z "$command" ]]; then',
        '        case "$prev" in',
        f"            {_value_flags(top)}) return 0 ;;",
        "        esac",
        '        if [[ "$cur" == -* ]]; then',
        f'            COMPREPLY=($(compgen -W "{_flags(top)}" -- "$cur"))',
        "        else",
        f'            COMPREPLY=($(compgen -W "{names}" -- "$cur"))',
        "        fi",
        "        return 0",
        "    fi",
        '    case "$prev" in',
        *choice_arms,
        "    esac",
        '    case "$command" in',
        *arms,
        "    esac",
        '    if [[ "$cur" == -* ]]; then',
        '        COMPREPLY=($(compgen -W "$opts" -- "$cur"))',
        '    elif [[ -n "$choices" ]]; then',
        '        COMPREPLY=($(compgen -W "$choices" -- "$cur"))',
        "    fi",
        "}",
        f"complete -o default -F _{PROG} {PROG}",
        "",
    ])


def _zsh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def _zsh(top: tuple[Option, ...], commands: tuple[Command, ...]) -> str:
    described = " ".join(_zsh_quote(f"{command.name}:{command.help}") for command in commands)
    arms = [f"        {command.name}) opts=({_flags(command.options)})"
            + (f"; choices=({' '.join(command.positional_choices)})" if command.positional_choices else "")
            + " ;;" for command in commands]
    choice_arms = _choice_cases(commands, "        ", "compadd -- {words}; return")
    return "\n".join([
        f"#compdef {PROG}",
        f"# zsh completion for {PROG}: source <({PROG} completion zsh), after compinit",
        f"_{PROG}() {{",
        "    local command='' i",
        "    local -a commands opts choices",
        f"    commands=({described})",
        "    for ((i = 2; i < CURRENT; i++)); do",
        '        case "${words[i]}" in',
        "            --) _files; return ;;",
        f'            {_value_flags(top)}) [[ -z "$command" ]] && ((i++)) ;;',
        "            -*) ;;",
        '            *) [[ -z "$command" ]] && command="${words[i]}" ;;',
        "        esac",
        "    done",
        '    if [[ -z "$command" ]]; then',
        '        case "${words[CURRENT-1]}" in',
        f"            {_value_flags(top)}) _files; return ;;",
        "        esac",
        '        if [[ "${words[CURRENT]}" == -* ]]; then',
        f"            compadd -- {_flags(top)}",
        "        else",
        "            _describe command commands",
        "        fi",
        "        return",
        "    fi",
        '    case "${words[CURRENT-1]}" in',
        *choice_arms,
        "    esac",
        '    case "$command" in',
        *arms,
        "    esac",
        '    if [[ "${words[CURRENT]}" == -* ]]; then',
        '        compadd -- "${opts[@]}"',
        "    elif (( ${#choices} )); then",
        '        compadd -- "${choices[@]}"',
        "    else",
        "        _files",
        "    fi",
        "}",
        'if [[ "${zsh_eval_context[-1]}" == loadautofunc ]]; then',
        f'    _{PROG} "$@"',
        "else",
        f"    compdef _{PROG} {PROG}",
        "fi",
        "",
    ])


def _fish_quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _fish_option(option: Option, condition: str) -> str:
    parts = [f"complete -c {PROG}", f"-n {_fish_quote(condition)}"]
    for flag in option.flags:
        parts.append(f"-l {flag[2:]}" if flag.startswith("--") else f"-s {flag[1:]}")
    if option.choices:
        parts.append(f"-x -a {_fish_quote(' '.join(option.choices))}")
    elif option.takes_value:
        parts.append("-r")
    if option.help:
        parts.append(f"-d {_fish_quote(option.help)}")
    return " ".join(parts)


def _fish(top: tuple[Option, ...], commands: tuple[Command, ...]) -> str:
    lines = [f"# fish completion for {PROG}: {PROG} completion fish | source"]
    for option in top:
        lines.append(_fish_option(option, "__fish_use_subcommand"))
    for command in commands:
        lines.append(f"complete -c {PROG} -n '__fish_use_subcommand' -f -a {command.name} "
                     f"-d {_fish_quote(command.help)}")
    for command in commands:
        condition = f"__fish_seen_subcommand_from {command.name}"
        if command.positional_choices:
            lines.append(f"complete -c {PROG} -n {_fish_quote(condition)} -f -a "
                         f"{_fish_quote(' '.join(command.positional_choices))}")
        lines.extend(_fish_option(option, condition) for option in command.options)
    return "\n".join(lines) + "\n"
