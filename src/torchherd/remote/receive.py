"""torchherd --sync, on the node: makes a directory the same as the controller's project.

Standard library only, Python >= 3.8. The controller runs it as
``PYTHON -I -S -u -c PROGRAM DEST WITHIN`` (``remote.command``) and talks to it over stdin (length-prefixed
``marshal`` frames, version 4: the controller is trusted, it sends this very code) and
stdout (one JSON line per answer); nothing is installed on the node. It imports
neither ``json`` nor ``typing`` nor, until it hashes, ``hashlib``: on every node, at
every run, their import would cost more than the work of a sync with nothing changed.

1. The controller sends what the project holds (``want``: path, size, mtime, executable
   bit, symlink target). This script answers, per path, whether the node already has it:
   by the manifest kept in the destination (``MANIFEST``: the content hash, both sides'
   size and mtime, and the node's ctime and inode of every file synced before) when the
   file is as the manifest left it (its content hashed again when only its ctime or
   inode differ), else by hashing a small file of the same size. Nothing is changed
   yet, so ``--dry-run`` ends here.
2. On ``go``: files the manifest lists that the project no longer has are deleted (only
   those, and only inside the destination); then every file sent is written beside its
   place and renamed over it; then every file written is read back and its SHA-256
   compared with the controller's; then the new manifest replaces the old.

Only paths inside the destination are ever written or deleted: no absolute path, no
``..``, no symbolic link on the way to a file. The destination, and every directory on
the way to it, is one that no other user can change (``walk``): the user's own, not
writable by group or others (above it, root's too), so nothing checked here can be
swapped or redirected afterwards.
"""

from __future__ import annotations

import errno
import marshal
import os
import stat
import struct
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO, Any, Dict, Iterable, List, Optional, Set, Tuple

MANIFEST = ".torchherd-sync"
MANIFEST_VERSION = 2
"""Version 1's lines had no ctime and inode: they vouch for nothing now."""
MARSHAL_VERSION = 4
"""Readable by every Python from 3.4 on, whichever wrote it."""
LARGE = 1 << 20
"""From this size on a file is not hashed to compare it: the controller would have to
read it twice (once to compare, once to send); it is sent when it is not as the
manifest left it."""
CHUNK = 1 << 20
HEADER = struct.Struct(">I")
DIGEST = 32
EXIT_REFUSED = 2
TOKEN = os.urandom(8).hex()
"""In the names of this receiver's temporary files: not guessable, so no file of the
project (a symbolic link synced just before) can be named as one of them."""


def read_exact(stream: IO[bytes], size: int) -> bytes:
    data = stream.read(size)
    if data is None or len(data) != size:
        raise EOFError("the controller went away")
    return data


def read_message(stream: IO[bytes]) -> Dict[str, Any]:
    (size,) = HEADER.unpack(read_exact(stream, HEADER.size))
    return dict(marshal.loads(read_exact(stream, size)))


def to_json(value: Any) -> str:
    """JSON of dicts, lists, strings, numbers, booleans and None (what the answers hold),
    ASCII only whatever the node's locale."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{to_json(str(key))}:{to_json(item)}" for key, item in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(to_json(item) for item in value) + "]"
    if isinstance(value, str):
        if value.isascii() and value.isprintable() and '"' not in value and "\\" not in value:
            return f'"{value}"'
        return '"' + "".join(map(json_char, value)) + '"'
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value)


ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def json_char(char: str) -> str:
    if char in ESCAPES:
        return ESCAPES[char]
    if " " <= char <= "~":
        return char
    code = ord(char)
    if code > 0xFFFF:  # a surrogate pair, as JSON writes it
        code -= 0x10000
        return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"
    return f"\\u{code:04x}"


def reply(message: Dict[str, Any]) -> None:
    sys.stdout.write(to_json(message) + "\n")
    sys.stdout.flush()


DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
LINKS = 40
"""Symbolic links followed on the way to the destination at most (the kernel's own limit)."""


def owner(uid: int) -> str:
    import pwd  # only to say whose a refused directory is

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


SYNC = ("a sync", "what is synced", "a workdir")
"""What a checked directory is for, in the refusal: its use, what another user could swap
there, and what to use instead (``venv.py`` walks a venv_dir with its own words)."""


def distrust(path: str, info: os.stat_result, inside: bool, purpose: Tuple[str, str, str] = SYNC) -> Optional[str]:
    """Why nobody but the user (and root) is known to control what ``path`` holds, or
    None. Above the destination a directory of root's that no one else can write, or a
    sticky one (``/tmp``: others may add entries there, never replace ours), is fine, as
    OpenSSH's StrictModes has it; at the destination and inside it only the user's own
    directories that group and others cannot write are."""
    uid = os.geteuid()
    writable = info.st_mode & 0o022
    if not inside and info.st_uid == 0 and (not writable or info.st_mode & stat.S_ISVTX):
        return None
    if info.st_uid == uid and not writable:
        return None
    if info.st_uid == uid:
        why = f"writable by group or others (chmod go-w {path})"
    elif info.st_uid == 0:
        why = "root's and writable by group or others"
    else:
        why = f"{owner(info.st_uid)}'s, not yours"
    return (f"{path} cannot hold {purpose[0]}: it is {why} (mode {stat.S_IMODE(info.st_mode):04o}); another user "
            f"could swap or redirect {purpose[1]} (use {purpose[2]} only you can write)")


def trusted_link(holder: os.stat_result, link: os.stat_result) -> bool:
    """A symbolic link in a trusted directory was put there by the user or root; in a
    sticky one (``/tmp``) only when it is theirs (as the kernel's protected_symlinks)."""
    return not holder.st_mode & 0o022 or link.st_uid in (os.geteuid(), 0)


class Walk:
    """The directories walked so far, each open (O_NOFOLLOW) and checked."""

    def __init__(self, purpose: Tuple[str, str, str] = SYNC) -> None:
        self.purpose = purpose
        self.fds: List[int] = []
        self.names: List[str] = []
        self.infos: List[os.stat_result] = []
        self.links = 0
        try:
            self.enter("/", os.open("/", DIRECTORY))
        except ValueError:
            self.close()
            raise

    def enter(self, name: str, fd: int) -> None:
        self.fds.append(fd)
        if name != "/":
            self.names.append(name)
        self.infos.append(os.fstat(fd))
        problem = distrust(self.path(), self.infos[-1], inside=False, purpose=self.purpose)
        if problem:
            raise ValueError(problem)

    def up(self) -> None:
        if self.names:
            os.close(self.fds.pop())
            self.names.pop()
            self.infos.pop()

    def path(self, *more: str) -> str:
        return "/" + "/".join(self.names + list(more))

    def link(self, name: str) -> List[str]:
        """The components a symbolic link here stands for; refused where it is not the
        user's (or root's) own doing. An absolute target starts again at the root."""
        info = os.stat(name, dir_fd=self.fds[-1], follow_symlinks=False)
        if not stat.S_ISLNK(info.st_mode):
            raise ValueError(f"{self.path(name)} is a file on the node, not a directory")
        self.links += 1
        if self.links > LINKS or not trusted_link(self.infos[-1], info):
            raise ValueError(f"{self.path(name)} is a symbolic link that another user could have put there: "
                             "refused, not followed")
        target = os.readlink(name, dir_fd=self.fds[-1])
        if target.startswith("/"):
            while self.names:
                self.up()
        return [part for part in target.split("/") if part not in ("", ".")]

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


def walk(path: str, create: bool, purpose: Tuple[str, str, str] = SYNC) -> Tuple[str, bool]:
    """The destination's path with its symbolic links followed, and whether it exists;
    with ``create``, its missing directories made (0700). Walked from the root one
    directory at a time through file descriptors opened with O_NOFOLLOW: a directory
    on the way that someone other than the user (or root, above the destination) could
    change is refused before anything in it is used, and a symbolic link is followed
    only where it lies in such a trusted directory (so no other user can have put it
    there). Every directory of the path returned is trusted: no one else can swap
    anything in it afterwards, and the sync then works on that path."""
    parts = [part for part in path.split("/") if part not in ("", ".")]
    parts.reverse()  # a stack: the next component last
    where = Walk(purpose)
    try:
        while parts:
            name = parts.pop()
            if name == "..":
                where.up()
                continue
            try:
                fd = os.open(name, DIRECTORY, dir_fd=where.fds[-1])
            except FileNotFoundError:
                if not create:
                    return lexical(where.names + [name], reversed(parts)), False
                os.mkdir(name, 0o700, dir_fd=where.fds[-1])
                fd = os.open(name, DIRECTORY, dir_fd=where.fds[-1])
            except OSError as error:
                if error.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                parts.extend(reversed(where.link(name)))
                continue
            where.enter(name, fd)
        problem = distrust(where.path(), where.infos[-1], inside=True, purpose=purpose)  # the destination: the user's own
        if problem:
            raise ValueError(problem)
        return where.path(), True
    finally:
        where.close()


def lexical(names: List[str], rest: Iterable[str]) -> str:
    """The path of a destination not made yet: its missing part taken as written."""
    names = list(names)
    for name in rest:
        if name != "..":
            names.append(name)
        elif names:
            names.pop()
    return "/" + "/".join(names)


def resolve(dest: str, within: str, create: bool = False) -> Tuple[str, bool]:
    """The destination, checked and walked (``walk``), and whether it exists; refuses
    one outside ``within`` (the workdir), the home directory itself, and the root."""
    real, exists = walk(os.path.abspath(os.path.expanduser(dest)), create)
    limit = os.path.realpath(os.path.expanduser(within))
    home = os.path.realpath(os.path.expanduser("~"))
    if real == "/" or real == home:
        raise ValueError(f"{dest} is {'the root' if real == '/' else 'the home directory'} itself: "
                         "a sync needs a directory of its own")
    if real != limit and not real.startswith(limit.rstrip("/") + "/"):
        raise ValueError(f"{dest} ({real}) is outside the workdir {within} ({limit})")
    return real, exists


UNSAFE_PARTS = frozenset(("", ".", ".."))


def safe_parts(path: str) -> List[str]:
    parts = path.split("/")
    if not path or path[0] == "/" or "\0" in path or not UNSAFE_PARTS.isdisjoint(parts):
        raise ValueError(f"refused path {path!r}")
    if parts[0] == MANIFEST:
        raise ValueError(f"refused path {path!r}: the manifest's own name")
    return parts


class Tree:
    """The destination: every write and delete goes through here."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.dirs: Set[str] = {root}
        self.folders: Dict[str, Optional[str]] = {}
        """Per directory part of a path (``a/b``), its real directory here, None when missing."""
        self.counter = 0

    def parent(self, parts: List[str], create: bool) -> Optional[str]:
        """The directory a path lives in, checked to be a real directory (no symlink)
        at every level below the root; created (0700) when ``create``."""
        current = self.root
        for name in parts[:-1]:
            current = os.path.join(current, name)
            if current in self.dirs:
                continue
            try:
                info = os.lstat(current)
            except FileNotFoundError:
                if not create:
                    return None
                os.mkdir(current, 0o700)
                info = os.lstat(current)
            if not stat.S_ISDIR(info.st_mode):
                kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "a file"
                raise ValueError(f"{os.path.relpath(current, self.root)} is {kind} on the node, not a directory")
            problem = distrust(current, info, inside=True)
            if problem:
                raise ValueError(problem)
            self.dirs.add(current)
        return current

    def lstat(self, path: str) -> Optional[os.stat_result]:
        """The file as it is here; None when it, or a directory on its way, is missing
        or not a real directory. Each directory is checked once (thousands of files)."""
        parts = safe_parts(path)
        where = path.rpartition("/")[0]
        if where not in self.folders:
            try:
                self.folders[where] = self.parent(parts, create=False)
            except ValueError:
                self.folders[where] = None
        folder = self.folders[where]
        if folder is None:
            return None
        try:
            return os.lstat(folder + "/" + parts[-1])
        except OSError:
            return None

    def temporary(self, parts: List[str]) -> Tuple[str, str]:
        self.folders.clear()  # directories may be made now
        folder = self.parent(parts, create=True)
        assert folder is not None
        target = os.path.join(folder, parts[-1])
        try:
            if stat.S_ISDIR(os.lstat(target).st_mode):
                raise ValueError(f"{'/'.join(parts)} is a directory on the node")
        except FileNotFoundError:
            pass
        self.counter += 1
        return target, os.path.join(folder, f".{parts[-1]}.torchherd-{TOKEN}-{self.counter}")

    def delete(self, path: str) -> bool:
        self.folders.clear()  # directories may go now
        parts = safe_parts(path)
        folder = self.parent(parts, create=False)
        if folder is None:
            return False
        target = os.path.join(folder, parts[-1])
        try:
            info = os.lstat(target)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(info.st_mode):
            return False  # never a directory: only files this sync put there
        os.unlink(target)
        while folder != self.root:  # directories the deletion left empty
            try:
                os.rmdir(folder)
            except OSError:
                break
            self.dirs.discard(folder)
            folder = os.path.dirname(folder)
        return True


def file_hash(path: str) -> str:
    import hashlib  # only a sync that hashes pays for OpenSSL's start

    digest = hashlib.sha256()
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as file:
        while True:
            block = file.read(CHUNK)
            if not block:
                return digest.hexdigest()
            digest.update(block)


LINE_TYPES = (str, int, int, int, int, int, int)
"""A manifest line: sha256 or "link:TARGET", the controller's size and mtime_ns, the
node's size, mtime_ns, ctime_ns and inode."""


def load_manifest(root: str) -> Dict[str, List[Any]]:
    """path -> the manifest's line (``LINE_TYPES``). A manifest that is not exactly what
    this script writes (damaged, hand-edited, another version's, not the user's own
    private file) is no manifest: every file is compared again, and a damaged file never
    stops a sync."""
    try:
        fd = os.open(os.path.join(root, MANIFEST), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return {}
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
            return {}
        try:
            data = marshal.loads(file.read())
        except (OSError, ValueError, EOFError, TypeError):
            return {}
    files = data.get("files") if isinstance(data, dict) and data.get("version") == MANIFEST_VERSION else None
    if not isinstance(files, dict) or not all(is_line(path, line) for path, line in files.items()):
        return {}
    return files


def is_line(path: Any, line: Any) -> bool:
    return (isinstance(path, str) and isinstance(line, list) and len(line) == len(LINE_TYPES)
            and all(type(value) is kind for value, kind in zip(line, LINE_TYPES)))


def classify(tree: Tree, want: List[List[Any]], manifest: Dict[str, List[Any]]) -> Dict[str, Any]:
    """Per wanted path: unchanged (as the manifest left it), have (a small file of the
    same size, with its hash), or need; and the manifest's paths no longer wanted."""
    need: List[str] = []
    have: Dict[str, str] = {}
    same: Dict[str, List[Any]] = {}
    for path, size, mtime, executable, link in want:
        info = tree.lstat(path)
        known = manifest.get(path)
        if info is not None and known is not None and is_unchanged(tree, path, info, known, size, mtime, executable,
                                                                   link):
            same[path] = known[:5] + [info.st_ctime_ns, info.st_ino]
        elif link is None and info is not None and stat.S_ISREG(info.st_mode) and info.st_size == size < LARGE \
                and bool(info.st_mode & stat.S_IXUSR) == bool(executable):
            have[path] = file_hash(os.path.join(tree.root, path))
        else:
            need.append(path)
    wanted = {entry[0] for entry in want}
    stale = sorted(path for path in manifest if path not in wanted)
    return {"need": need, "have": have, "same": same, "delete": stale,
            "refreshed": any(same[path][5:] != manifest[path][5:] for path in same)}


def is_unchanged(tree: Tree, path: str, info: os.stat_result, known: List[Any], size: int, mtime: int,
                 executable: bool, link: Optional[str]) -> bool:
    """Whether the node's file is the one the manifest recorded for this source file.
    Size and mtime alone do not say it: another hand can write a file and set its mtime
    back. Its ctime and inode do (no one but root can set a ctime, and a file put in its
    place is another inode): when they are as recorded the file is untouched; when only
    they differ (a chmod, a copy back, a restore), its content decides."""
    if link is not None:
        return stat.S_ISLNK(info.st_mode) and known[0] == "link:" + link \
            and os.readlink(os.path.join(tree.root, path)) == link
    if not (stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022
            and known[1:5] == [size, mtime, info.st_size, info.st_mtime_ns]
            and bool(info.st_mode & stat.S_IXUSR) == bool(executable) and not known[0].startswith("link:")):
        return False
    if known[5:] == [info.st_ctime_ns, info.st_ino]:
        return True
    try:
        return file_hash(os.path.join(tree.root, path)) == str(known[0])
    except OSError:
        return False


def receive_file(tree: Tree, stream: IO[bytes], header: Dict[str, Any]) -> Tuple[str, str, Optional[str]]:
    """Writes one file (or link) beside its place and renames it over; returns
    (path, the controller's digest, why it failed or None). The stream is always read
    to the end of the file, failed or not."""
    path, size, link = header["path"], int(header["size"]), header.get("link")
    problem: Optional[str] = None
    output = None
    target = temporary = ""
    try:
        target, temporary = tree.temporary(safe_parts(path))
        if link is None:
            mode = 0o700 if header.get("x") else 0o600
            output = os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb")
        else:
            os.symlink(link, temporary)
    except (OSError, ValueError) as error:
        problem = str(error)
    left = size
    while left:
        block = read_exact(stream, min(left, CHUNK))
        left -= len(block)
        if output is not None and problem is None:
            try:
                output.write(block)
            except OSError as error:
                problem = f"cannot write: {error.strerror}"
    digest = read_exact(stream, DIGEST).hex()
    if output is not None:
        try:
            output.close()
        except OSError as error:
            problem = problem or f"cannot write: {error.strerror}"
    if problem is None:
        try:
            os.replace(temporary, target)
        except OSError as error:
            problem = f"cannot put it in place: {error.strerror}"
    if problem is not None and temporary:
        try:
            os.unlink(temporary)
        except OSError:
            pass
    return path, digest, problem


def verify(tree: Tree, path: str, digest: str, link: Optional[str]) -> Optional[str]:
    """Reads the file back as the node has it now: None when it is what was sent."""
    full = os.path.join(tree.root, path)
    try:
        if link is not None:
            return None if os.readlink(full) == link else "the link on the node is not the one sent"
        if file_hash(full) != digest:
            return "its SHA-256 on the node differs from the controller's (did it change during the sync?)"
    except OSError as error:
        return f"cannot read it back: {error.strerror}"
    return None


def record(tree: Tree, manifest: Dict[str, List[Any]], entry: List[Any], digest: str) -> Optional[str]:
    """The manifest's line for a file as the node has it now (its size and mtime there)."""
    path, size, mtime, _, link = entry
    info = tree.lstat(path)
    if info is None:
        return "gone after writing"
    manifest[path] = [digest if link is None else "link:" + link, size, mtime, info.st_size, info.st_mtime_ns,
                      info.st_ctime_ns, info.st_ino]
    return None


def write_manifest(root: str, files: Dict[str, List[Any]]) -> None:
    """Written beside the manifest under a name no one can guess, created (never opened
    through a symbolic link or over a file already there), then renamed over it."""
    temporary = os.path.join(root, f".{MANIFEST}.{TOKEN}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        with os.fdopen(os.open(temporary, flags, 0o600), "wb") as file:
            file.write(marshal.dumps({"version": MANIFEST_VERSION, "files": files}, MARSHAL_VERSION))
        os.replace(temporary, os.path.join(root, MANIFEST))
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


def apply(tree: Tree, stream: IO[bytes], want: List[List[Any]], found: Dict[str, Any],
          go: Dict[str, Any]) -> Dict[str, Any]:
    manifest: Dict[str, List[Any]] = dict(found["same"])
    by_path = {entry[0]: entry for entry in want}
    deleted, failed = [], []
    for path in found["delete"]:
        try:
            if tree.delete(path):
                deleted.append(path)
        except (OSError, ValueError) as error:
            failed.append([path, f"cannot delete: {error}"])
    written: List[Tuple[str, str]] = []
    received = 0
    for _ in range(int(go["files"])):
        header = read_message(stream)
        path, digest, problem = receive_file(tree, stream, header)
        received += int(header["size"])
        if problem is None:
            written.append((path, digest))
        else:
            failed.append([path, problem])
    started = time.monotonic()
    for path, digest in written:
        problem = verify(tree, path, digest, by_path[path][4])
        if problem is None:
            problem = record(tree, manifest, by_path[path], digest)
        if problem is not None:
            failed.append([path, problem])
    for path in go["equal"]:  # hashed on the node already, and found equal by the controller
        problem = record(tree, manifest, by_path[path], found["have"][path])
        if problem is not None:
            failed.append([path, problem])
    if written or deleted or go["equal"] or failed or found["refreshed"]:
        write_manifest(tree.root, manifest)
    return {"ok": not failed, "written": len(written), "bytes": received, "deleted": deleted,
            "failed": failed, "verify_seconds": round(time.monotonic() - started, 3)}


def main() -> int:
    stream = sys.stdin.buffer
    try:
        root, exists = resolve(sys.argv[1], sys.argv[2])
    except (OSError, ValueError) as error:
        reply({"error": str(error)})
        return EXIT_REFUSED
    try:
        want = read_message(stream)["want"]
        tree = Tree(root)
        found = classify(tree, want, load_manifest(root) if exists else {})
        reply({"dest": root, "need": found["need"], "have": found["have"], "same": len(found["same"]),
               "delete": found["delete"]})
        try:
            go = read_message(stream)
        except EOFError:  # the controller needs nothing more: in sync already, or a dry run
            return 0
        if not go.get("go"):
            return 0
        if resolve(sys.argv[1], sys.argv[2], create=True)[0] != root:
            raise ValueError(f"{sys.argv[1]} changed on the node during the sync")
        reply(apply(tree, stream, want, found, go))
    except EOFError:
        return 1  # the controller went away or stopped (a dry run closes without "go")
    except (OSError, ValueError) as error:
        reply({"error": str(error)})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
