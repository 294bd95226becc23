"""The local project as ``--sync`` sends it: which directory, which files (``.gitignore``
and ``exclude`` rules honoured, private material and torchherd's logs left out), whether
it is a project at all (``refusal``), and what each node lacks, given its receiver's answer.

Pure: reads the local tree (names and ``lstat`` only; no file's content is read here,
so large files are read once, when they are sent; a uv project's two small files are
hashed, ``uv_lock_hash``), never the network.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from torchherd.remote import uvlock
from torchherd.remote.receive import LARGE, MANIFEST

ALWAYS_LEFT_OUT = (".git", ".torchherd-venvs")
"""Never sent, whatever the rules say: the repository's own database, and the venvs a
uv-locked project gets on a node (should this directory be one a node synced to)."""
LOG_DIR = "torchherd-logs"
"""``run``'s default log directory: a directory of this name is never sent (at any depth:
runs started from a subdirectory leave theirs there), nor is the run's own ``--log-dir``."""
PRIVATE = (".ssh/", ".gnupg/", ".aws/", ".netrc", "*.pem", "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*",
           "id_xmss*", ".env", ".env.*")
"""Left out unless an include pattern names it (gitignore syntax, at any depth): keys,
credentials and secrets that a project directory picks up and no node needs
(``--sync-include PATTERN``, ``[sync].include``)."""
MAX_FILES = 5000
MAX_BYTES = 500 * 10**6
"""Above either, a directory that is not a git repository is refused unless sent on purpose."""
SURVEY_LIMIT = 10_000
"""Files counted at most to say what a refused directory would send: a home holds millions,
and the refusal must come at once."""


@dataclass(frozen=True)
class Entry:
    """One file (or symbolic link) of the project, as the walk found it."""

    path: str
    """Relative to the project's root, with ``/`` between parts."""
    size: int
    mtime_ns: int
    executable: bool
    link: str | None = None
    """A symbolic link's target, kept as written (the link itself is sent, not what it points at)."""

    def want(self) -> list[object]:
        """What the node's receiver is told about it (``remote.receive``: path, size, mtime, x, link)."""
        return [self.path, self.size, self.mtime_ns, self.executable, self.link]


@dataclass(frozen=True)
class Listing:
    root: Path
    entries: tuple[Entry, ...]
    skipped: tuple[str, ...] = ()
    """What the walk could not send, and why (a socket, an unreadable directory)."""
    private: tuple[str, ...] = ()
    """What ``PRIVATE`` left out (a directory with a trailing ``/``)."""
    complete: bool = True
    """False when the walk stopped at its ``limit``: there are more files than listed."""

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.entries)

    def by_path(self) -> dict[str, Entry]:
        return {entry.path: entry for entry in self.entries}


def project_root(start: Path) -> Path:
    """The enclosing git repository's root (a ``.git`` directory or file), else ``start``."""
    start = start.resolve()
    for candidate in (start, *start.parents):
        if (candidate / ".git").exists():
            return candidate
    return start


def in_git_repository(root: Path) -> bool:
    return project_root(root) != root.resolve() or (root / ".git").exists()


# ignore rules --------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One line of a .gitignore (or one ``exclude`` pattern), for paths under ``base``."""

    pattern: str
    regex: re.Pattern[str]
    negated: bool
    dir_only: bool
    anchored: bool
    """A slash at the start or in the middle: matched against the path below ``base``;
    else against the last part only, at any depth."""
    base: str = ""

    def matches(self, path: str, is_dir: bool) -> bool:
        if self.dir_only and not is_dir:
            return False
        if self.base:
            if not path.startswith(self.base + "/"):
                return False
            path = path[len(self.base) + 1:]
        subject = path if self.anchored else path.rsplit("/", 1)[-1]
        return self.regex.fullmatch(subject) is not None


def parse_rules(text: str, base: str = "") -> list[Rule]:
    """The rules of a .gitignore in directory ``base`` (relative to the root, "" for it)."""
    rules = []
    for line in text.splitlines():
        rule = parse_rule(line, base)
        if rule is not None:
            rules.append(rule)
    return rules


def parse_rule(line: str, base: str = "") -> Rule | None:
    if not line.strip() or line.startswith("#"):
        return None
    text = _strip_trailing_spaces(line)
    negated = text.startswith("!")
    if negated:
        text = text[1:]
    elif text.startswith("\\!") or text.startswith("\\#"):
        text = text[1:]
    dir_only = text.endswith("/") and not text.endswith("\\/")
    text = text.rstrip("/") if dir_only else text
    if not text:
        return None
    anchored = "/" in text
    text = text.lstrip("/")
    return Rule(line, re.compile(_glob_to_regex(text)), negated, dir_only, anchored, base)


def _strip_trailing_spaces(line: str) -> str:
    """Trailing spaces are dropped unless escaped with a backslash."""
    stripped = line.rstrip(" ")
    if stripped.endswith("\\") and len(stripped) < len(line):
        return stripped[:-1] + " "
    return stripped


def _glob_to_regex(glob: str) -> str:
    out: list[str] = []
    index = 0
    while index < len(glob):
        if glob.startswith("**/", index) and (index == 0 or glob[index - 1] == "/"):
            out.append("(?:.*/)?")
            index += 3
        elif glob.startswith("**", index) and index + 2 == len(glob) and (index == 0 or glob[index - 1] == "/"):
            out.append(".*")
            index += 2
        else:
            piece, index = _glob_piece(glob, index)
            out.append(piece)
    return "".join(out)


def _glob_piece(glob: str, index: int) -> tuple[str, int]:
    char = glob[index]
    if char == "*":
        return "[^/]*", index + 1
    if char == "?":
        return "[^/]", index + 1
    if char == "\\" and index + 1 < len(glob):
        return re.escape(glob[index + 1]), index + 2
    if char == "[":
        closing = glob.find("]", index + 2 if glob[index + 1:index + 2] in ("!", "^") else index + 1)
        if closing > index:
            body = glob[index + 1:closing]
            if body[:1] in ("!", "^"):
                body = "^" + body[1:]
            return "[" + body.replace("\\", "\\\\") + "]", closing + 1
    return re.escape(char), index + 1


def ignored(rules: Sequence[Rule], path: str, is_dir: bool) -> bool:
    """The last rule that matches decides, as in git."""
    rule = deciding(rules, path, is_dir)
    return rule is not None and not rule.negated


def deciding(rules: Sequence[Rule], path: str, is_dir: bool) -> Rule | None:
    """The last rule that matches ``path``, if any."""
    verdict = None
    for rule in rules:
        if rule.matches(path, is_dir):
            verdict = rule
    return verdict


def exclude_rules(exclude: Iterable[str] = (), include: Iterable[str] = ()) -> tuple[list[Rule], set[int]]:
    """``PRIVATE``, then the ``exclude`` patterns, then each ``include`` pattern negated: as
    in a .gitignore the last match decides, so an include pattern takes a file back from
    either list. Also the ids of the private rules (to tell what they left out)."""
    private = [rule for pattern in PRIVATE if (rule := parse_rule(pattern)) is not None]
    rules = private + [rule for pattern in exclude if (rule := parse_rule(pattern)) is not None]
    rules += [rule for pattern in include if (rule := parse_rule("!" + pattern.lstrip("!"))) is not None]
    return rules, {id(rule) for rule in private}


# the walk ----------------------------------------------------------------------------------


class _Enough(Exception):
    """The walk reached its limit."""


@dataclass
class _Walk:
    root: Path
    exclude: list[Rule]
    gitignore: bool
    private_rules: set[int] = field(default_factory=set)
    leave_out: frozenset[str] = frozenset()
    """Directories never sent, relative to the root (the run's log directory)."""
    limit: int | None = None
    entries: list[Entry] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    private: list[str] = field(default_factory=list)

    def directory(self, relative: str, rules: list[Rule]) -> None:
        folder = self.root / relative if relative else self.root
        if self.gitignore:
            rules = rules + _read_rules(folder / ".gitignore", relative)
        try:
            with os.scandir(folder) as scan:
                items = sorted(scan, key=lambda item: item.name)
        except OSError as error:
            self.skipped.append(f"{relative or '.'}/: cannot read it ({error.strerror})")
            return
        for item in items:
            self.item(item, f"{relative}/{item.name}" if relative else item.name, rules)

    def item(self, item: os.DirEntry[str], path: str, rules: list[Rule]) -> None:
        if item.name in ALWAYS_LEFT_OUT or path == MANIFEST:
            return
        try:
            info = item.stat(follow_symlinks=False)
        except OSError as error:
            self.skipped.append(f"{path}: cannot stat it ({error.strerror})")
            return
        is_dir = stat.S_ISDIR(info.st_mode)
        if is_dir and (item.name == LOG_DIR or path in self.leave_out):
            return
        if ignored(rules, path, is_dir):
            return
        rule = deciding(self.exclude, path, is_dir)
        if rule is not None and not rule.negated:
            if id(rule) in self.private_rules:
                self.private.append(path + "/" if is_dir else path)
            return
        if self.limit is not None and len(self.entries) >= self.limit:
            raise _Enough
        if is_dir:
            self.directory(path, rules)
        elif stat.S_ISLNK(info.st_mode):
            try:
                target = os.readlink(item.path)
            except OSError as error:  # another user's /proc/PID/cwd, say: listed as skipped
                self.skipped.append(f"{path}: cannot read the link ({error.strerror})")
                return
            self.entries.append(Entry(path, 0, info.st_mtime_ns, False, target))
        elif stat.S_ISREG(info.st_mode):
            self.entries.append(Entry(path, info.st_size, info.st_mtime_ns, bool(info.st_mode & stat.S_IXUSR)))
        else:
            self.skipped.append(f"{path}: not a file, directory or symbolic link")


def _read_rules(path: Path, base: str) -> list[Rule]:
    try:
        return parse_rules(path.read_text(encoding="utf-8", errors="replace"), base)
    except OSError:
        return []


def walk(root: Path, exclude: Iterable[str] = (), include: Iterable[str] = (), leave_out: Iterable[Path] = (),
         limit: int | None = None) -> Listing:
    """Every file of the project under ``root``, sorted by path. In a git repository its
    ``.gitignore`` files (and ``.git/info/exclude``) are honoured; ``exclude`` patterns
    (gitignore syntax, relative to the root) always are, and so is ``PRIVATE`` unless an
    ``include`` pattern takes a path back. ``.git``, directories named ``LOG_DIR`` and the
    ``leave_out`` directories (absolute, e.g. the run's log directory) are never sent.
    ``limit``: stop after that many files (the listing is then not ``complete``)."""
    root = root.resolve()
    gitignore = in_git_repository(root)
    base_rules = _read_rules(root / ".git" / "info" / "exclude", "") if gitignore else []
    rules, private = exclude_rules(exclude, include)
    walker = _Walk(root, rules, gitignore, private, _below(root, leave_out), limit)
    complete = True
    try:
        walker.directory("", base_rules)
    except _Enough:
        complete = False
    return Listing(root, tuple(walker.entries), tuple(walker.skipped), tuple(walker.private), complete)


def _below(root: Path, directories: Iterable[Path]) -> frozenset[str]:
    """The directories that lie under ``root``, relative to it."""
    found = set()
    for directory in directories:
        try:
            relative = directory.expanduser().resolve().relative_to(root)
        except ValueError:
            continue
        if relative.parts:
            found.add("/".join(relative.parts))
    return frozenset(found)


# is it a project? ------------------------------------------------------------------------


def refusal(root: Path, exclude: Iterable[str] = (), include: Iterable[str] = (), *, home: Path,
            max_files: int = MAX_FILES, max_bytes: int = MAX_BYTES) -> str | None:
    """Why ``root`` is not sent to every node unless asked on purpose, or None: it is the
    home directory ``home`` (or holds it), or it is not in a git repository and would send
    more than ``max_files`` files or ``max_bytes`` bytes. The reason says what would travel."""
    root, home = root.resolve(), home.expanduser().resolve()
    if root.parent == root:  # walking the whole filesystem only to count it would take minutes
        return f"{root} is the filesystem's root; it would send every file of this machine to every node"
    is_home = root == home or root in home.parents
    if not is_home and in_git_repository(root):
        return None
    listing = walk(root, exclude, include, limit=max(SURVEY_LIMIT, max_files + 1))
    over = "" if listing.complete else "over "
    count = len(listing.entries)
    what = f"{over}{count:,} file{'' if count == 1 else 's'} ({over}{_size(listing.total_bytes)})"
    if is_home:
        where = "your home directory" if root == home else f"above your home directory {home}"
        return f"{root} is {where}; it would send {what} to every node"
    if len(listing.entries) > max_files or listing.total_bytes > max_bytes:
        return f"{root} is not in a git repository and would send {what} to every node"
    return None


def _size(count: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


# what a node lacks ---------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeHas:
    """A node's receiver's answer: where the project goes there, and per path whether
    the node has it already."""

    dest: str
    need: tuple[str, ...]
    have: Mapping[str, str]
    """Small files of the same size there, not as the manifest left them, with their SHA-256."""
    same: int
    """Files as the manifest left them: not sent."""
    delete: tuple[str, ...]
    """Files synced before that the project no longer has."""


@dataclass(frozen=True)
class Transfer:
    """What one node gets."""

    send: frozenset[str]
    equal: tuple[str, ...]
    """Files the node had already, found equal by hash: recorded, not sent."""
    delete: tuple[str, ...]

    def bytes(self, listing: Mapping[str, Entry]) -> int:
        return sum(listing[path].size for path in self.send)

    @property
    def empty(self) -> bool:
        """Nothing to send, record or delete: the node is in sync."""
        return not (self.send or self.equal or self.delete)


def candidates(answers: Iterable[NodeHas]) -> set[str]:
    """The files to hash locally (all small) to compare with what the nodes have."""
    return {path for answer in answers for path in answer.have}


def decide(answer: NodeHas, local: Mapping[str, str]) -> Transfer:
    """``local``: the SHA-256 of every file in ``candidates``."""
    equal = tuple(sorted(path for path, digest in answer.have.items() if local.get(path) == digest))
    differing = {path for path in answer.have if path not in equal}
    return Transfer(frozenset(answer.need) | differing, equal, answer.delete)


def is_large(entry: Entry) -> bool:
    return entry.size >= LARGE


# a uv-locked project ---------------------------------------------------------------------

def uv_lock_hash(root: Path) -> str | None:
    """The SHA-256 of the project's ``pyproject.toml`` and ``uv.lock``, or None when it lacks
    either (``remote.uvlock``: the node computes the same)."""
    return uvlock.uv_lock_hash(str(root))
