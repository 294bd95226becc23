"""ssh_config's lexical layer, as OpenSSH reads it: a line's keyword and words (quotes,
escapes, ``Port=22``), the files' lines (parsed once while unchanged), and the glob
patterns of ``Host`` and ``Match``. ``sshconfig`` evaluates them for a host."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import lru_cache

WHITESPACE = " \t\r\n"


class SshConfigError(ValueError):
    """The configuration is one ``ssh`` would refuse; the message names the file and line."""


# ---------------------------------------------------------------- patterns


@lru_cache(maxsize=4096)
def _glob_regex(pattern: str) -> re.Pattern[str]:
    parts = [".*" if char == "*" else "." if char == "?" else re.escape(char) for char in pattern]
    return re.compile("".join(parts), re.DOTALL)


def match_pattern(text: str, pattern: str) -> bool:
    """OpenSSH's glob: ``*`` and ``?`` only, case-sensitive, the whole text."""
    if "*" not in pattern and "?" not in pattern:
        # Most Host lines name one node: a regex compiled per name cost every lookup
        # O(nodes) compiles and matches (about 3 ms a node's two lookups at 1,000 nodes).
        return text == pattern
    return _glob_regex(pattern).fullmatch(text) is not None


def match_pattern_list(text: str, patterns: str, lower: bool = False) -> int:
    """1 when a pattern of the comma list matches, -1 when a negated (``!``) one does
    (whatever else matched), 0 when none does: OpenSSH's ``match_pattern_list``."""
    found = 0
    for pattern in patterns.split(","):
        negated = pattern.startswith("!")
        pattern = pattern[1:] if negated else pattern
        if match_pattern(text, pattern.lower() if lower else pattern):
            if negated:
                return -1
            found = 1
    return found


def match_hostname(host: str, patterns: str) -> int:
    """``match_pattern_list`` for host names: case-insensitive."""
    return match_pattern_list(host.lower(), patterns, lower=True)


# ---------------------------------------------------------------- lines


@dataclass(frozen=True)
class Line:
    keyword: str
    """Lowercased."""
    args: tuple[str, ...]
    rest: str
    """The text after the keyword, unsplit (ProxyCommand takes it whole)."""
    file: str
    number: int


def split_args(text: str) -> list[str]:
    """OpenSSH's ``argv_split``: whitespace-separated, ``"`` and ``'`` quote, ``\\`` escapes
    a quote, a backslash or (outside quotes) a space, and a word starting with ``#`` ends the line."""
    args: list[str] = []
    i, n = 0, len(text)
    while i < n:
        if text[i] in " \t":
            i += 1
            continue
        if text[i] == "#":
            break
        word: list[str] = []
        quote = ""
        while i < n:
            char = text[i]
            if char == "\\" and i + 1 < n and (text[i + 1] in "'\"\\" or (not quote and text[i + 1] == " ")):
                word.append(text[i + 1])
                i += 2
                continue
            if not quote and char in " \t":
                break
            if not quote and char in "\"'":
                quote = char
            elif quote and char == quote:
                quote = ""
            else:
                word.append(char)
            i += 1
        if quote:
            raise ValueError("invalid quotes")
        args.append("".join(word))
    return args


def split_line(text: str) -> tuple[str, str] | None:
    """The keyword (lowercased) and the rest of a line; None for a blank line or a comment.
    The keyword ends at whitespace or one ``=`` (``Port=22``, ``Port = 22``), as OpenSSH's ``strdelim``."""
    text = text.rstrip(WHITESPACE + "\f").lstrip(WHITESPACE)
    if not text or text.startswith("#"):
        return None
    end = next((i for i, char in enumerate(text) if char in WHITESPACE + "="), len(text))
    keyword, rest = text[:end], text[end:]
    if rest.startswith("="):
        rest = rest[1:]
    else:
        rest = rest.lstrip(WHITESPACE)
        if rest.startswith("="):
            rest = rest[1:]
    return keyword.lower(), rest.lstrip(WHITESPACE)


def parse_lines(text: str, file: str) -> tuple[Line, ...]:
    """Every option line of one file (Include not yet followed: it depends on the host)."""
    lines = []
    for number, raw in enumerate(text.splitlines(), start=1):
        split = split_line(raw)
        if split is None:
            continue
        keyword, rest = split
        if not rest:
            raise SshConfigError(f"{file} line {number}: no argument after keyword {keyword!r}")
        try:
            args = tuple(split_args(rest))
        except ValueError:
            raise SshConfigError(f"{file} line {number}: invalid quotes") from None
        if keyword == "canonicaldomains":  # checked on every line, applied or not, as OpenSSH does
            _check_domains(args, f"{file} line {number}")
        lines.append(Line(keyword, args, rest, file, number))
    return tuple(lines)


def _check_domains(args: tuple[str, ...], where: str) -> None:
    for domain in args:
        if domain.lower() == "none" and len(args) > 1:
            raise SshConfigError(f"{where}: CanonicalDomains \"none\" must appear alone")
        check_domain(domain, where)


@lru_cache(maxsize=256)
def _parsed_file(path: str, stamp: tuple[int, int]) -> tuple[Line, ...]:
    with open(path, "rb") as handle:
        data = handle.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:  # undecodable bytes would reach ssh and the terminal as they are
        line = data.count(b"\n", 0, error.start) + 1
        raise SshConfigError(f"{path} line {line}: not UTF-8 text") from None
    return parse_lines(text, path)


def read_lines(path: str) -> tuple[Line, ...] | None:
    """The lines of a config file (parsed once while it stays unchanged); None when it is missing."""
    try:
        status = os.stat(path)
        return _parsed_file(path, (status.st_mtime_ns, status.st_size))
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise SshConfigError(f"{path}: is a directory, not an ssh_config file") from None
    except OSError as error:
        raise SshConfigError(f"{path}: cannot read: {error.strerror}") from None


def check_domain(domain: str, where: str) -> None:
    """OpenSSH's ``valid_domain``, as it checks every ``CanonicalDomains`` value."""
    lowered = domain.lower()
    if not lowered or not lowered[0].isascii() or not lowered[0].isalnum():
        raise SshConfigError(f"{where}: domain name {domain!r} starts with invalid character")
    if ".." in lowered:
        raise SshConfigError(f"{where}: domain name {domain!r} contains consecutive separators")
    if any(not (char.isascii() and (char.isalnum() or char in ".-_")) for char in lowered):
        raise SshConfigError(f"{where}: domain name {domain!r} contains invalid characters")
