"""torchherd --sync, on the node: makes a directory the same as the controller's project.

Standard library only, Python >= 3.8. The controller runs it as
``PYTHON -S -c SOURCE DEST WITHIN`` and talks to it over stdin (length-prefixed
``marshal`` frames, version 4: the controller is trusted, it sends this very code) and
stdout (one JSON line per answer); nothing is installed on the node. It imports
neither ``json`` nor ``typing`` nor, until it hashes, ``hashlib``: on every node, at
every run, their import would cost more than the work of a sync with nothing changed.

1. The controller sends what the project holds (``want``: path, size, mtime, executable
   bit, symlink target). This script answers, per path, whether the node already has it:
   by the manifest kept in the destination (``MANIFEST``: the content hash and both
   sides' size and mtime of every file synced before) when the file is as the manifest
   left it, else by hashing a small file of the same size. Nothing is changed yet, so
   ``--dry-run`` ends here.
2. On ``go``: files the manifest lists that the project no longer has are deleted (only
   those, and only inside the destination); then every file sent is written beside its
   place and renamed over it; then every file written is read back and its SHA-256
   compared with the controller's; then the new manifest replaces the old.

Only paths inside the destination are ever written or deleted: no absolute path, no
``..``, no symbolic link on the way to a file.
"""

from __future__ import annotations

import marshal
import os
import stat
import struct
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO, Any, Dict, List, Optional, Set, Tuple

MANIFEST = ".torchherd-sync"
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


def resolve(dest: str, within: str) -> str:
    """The destination's real path; refuses one outside ``within`` (the workdir), the
    home directory itself, and the root."""
    real = os.path.realpath(os.path.expanduser(dest))
    limit = os.path.realpath(os.path.expanduser(within))
    home = os.path.realpath(os.path.expanduser("~"))
    if real == "/" or real == home:
        raise ValueError(f"{dest} is {'the root' if real == '/' else 'the home directory'} itself: "
                         "a sync needs a directory of its own")
    if real != limit and not real.startswith(limit.rstrip("/") + "/"):
        raise ValueError(f"{dest} ({real}) is outside the workdir {within} ({limit})")
    return real


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
        return target, os.path.join(folder, f".{parts[-1]}.torchherd-{os.getpid()}-{self.counter}")

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
    with open(path, "rb") as file:
        while True:
            block = file.read(CHUNK)
            if not block:
                return digest.hexdigest()
            digest.update(block)


def load_manifest(root: str) -> Dict[str, List[Any]]:
    """path -> [sha256 or "link:TARGET", source size, source mtime_ns, node size, node mtime_ns]."""
    try:
        with open(os.path.join(root, MANIFEST), "rb") as file:
            data = marshal.loads(file.read())
    except (OSError, ValueError, EOFError, TypeError):
        return {}
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict):
        return {}
    # A line that is not what this script writes vouches for nothing: its file is compared again.
    return {path: known for path, known in files.items() if isinstance(known, list) and len(known) == 5}


def classify(tree: Tree, want: List[List[Any]], manifest: Dict[str, List[Any]]) -> Dict[str, Any]:
    """Per wanted path: unchanged (as the manifest left it), have (a small file of the
    same size, with its hash), or need; and the manifest's paths no longer wanted."""
    need: List[str] = []
    have: Dict[str, str] = {}
    same: Dict[str, List[Any]] = {}
    for path, size, mtime, executable, link in want:
        info = tree.lstat(path)
        known = manifest.get(path)
        if info is not None and known is not None and is_unchanged(info, known, size, mtime, executable, link):
            same[path] = known
        elif link is None and info is not None and stat.S_ISREG(info.st_mode) and info.st_size == size < LARGE \
                and bool(info.st_mode & stat.S_IXUSR) == bool(executable):
            have[path] = file_hash(os.path.join(tree.root, path))
        else:
            need.append(path)
    wanted = {entry[0] for entry in want}
    stale = sorted(path for path in manifest if path not in wanted)
    return {"need": need, "have": have, "same": same, "delete": stale}


def is_unchanged(info: os.stat_result, known: List[Any], size: int, mtime: int, executable: bool,
                 link: Optional[str]) -> bool:
    if link is not None:
        return stat.S_ISLNK(info.st_mode) and known[0] == "link:" + link
    return (stat.S_ISREG(info.st_mode) and known[1:5] == [size, mtime, info.st_size, info.st_mtime_ns]
            and bool(info.st_mode & stat.S_IXUSR) == bool(executable) and not str(known[0]).startswith("link:"))


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
    manifest[path] = [digest if link is None else "link:" + link, size, mtime, info.st_size, info.st_mtime_ns]
    return None


def write_manifest(root: str, files: Dict[str, List[Any]]) -> None:
    temporary = os.path.join(root, f".{MANIFEST}.{os.getpid()}")
    with os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as file:
        file.write(marshal.dumps({"version": 1, "files": files}, MARSHAL_VERSION))
    os.replace(temporary, os.path.join(root, MANIFEST))


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
    if written or deleted or go["equal"] or failed:
        write_manifest(tree.root, manifest)
    return {"ok": not failed, "written": len(written), "bytes": received, "deleted": deleted,
            "failed": failed, "verify_seconds": round(time.monotonic() - started, 3)}


def main() -> int:
    stream = sys.stdin.buffer
    try:
        root = resolve(sys.argv[1], sys.argv[2])
    except ValueError as error:
        reply({"error": str(error)})
        return EXIT_REFUSED
    try:
        want = read_message(stream)["want"]
        tree = Tree(root)
        found = classify(tree, want, load_manifest(root) if os.path.isdir(root) else {})
        reply({"dest": root, "need": found["need"], "have": found["have"], "same": len(found["same"]),
               "delete": found["delete"]})
        try:
            go = read_message(stream)
        except EOFError:  # the controller needs nothing more: in sync already, or a dry run
            return 0
        if not go.get("go"):
            return 0
        os.makedirs(root, 0o700, exist_ok=True)
        reply(apply(tree, stream, want, found, go))
    except EOFError:
        return 1  # the controller went away or stopped (a dry run closes without "go")
    except (OSError, ValueError) as error:
        reply({"error": str(error)})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
