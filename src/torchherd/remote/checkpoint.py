"""torchherd checkpoint staging, on a node: find the newest checkpoint, relay it node to node.

Standard library only, Python >= 3.8, Linux. Run as ``PYTHON -I -S -u -c PROGRAM MODE WORKDIR PATH``
(``remote.command``); PATH is relative to WORKDIR (``~`` is the node's home) and may be a
glob, of which the newest match (by mtime) counts. MODE is one of:

``find``: prints one JSON line, the newest copy here: ``{"path": REL, "kind": "file" or
  "dir", "size": BYTES, "mtime": SECONDS, "sha256": HEX}`` (a directory: its files' total
  size, its newest file's mtime, the SHA-256 of its listing of ``relpath NUL size NUL
  sha256`` lines), or ``{"path": null}`` when there is none, or ``{"error": TEXT}``.

``relay``: one link of the chain (``relay.py`` has its protocol) that carries a copy from
  the node that has it (the source) to the nodes that lack it. The controller's first line
  adds ``"expect": COPY`` and ``"source": BOOL``; the source sends its copy, its files'
  sizes and mtimes in the header. A receiver writes each file into a temporary name in the
  target's own directory (0600, a directory 0700), checks the SHA-256 against the
  controller's ``expect``, sets the source's mtimes and renames it into place (a
  directory: the old one renamed aside, then removed). Its last line is ``{"ok": true,
  "bytes": N, "seconds": S}`` or ``{"error": TEXT}``. Nothing is written outside WORKDIR:
  the controller refuses an absolute PATH or one with ``..``, and this
  program refuses it again.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import socket
import sys
import time

from torchherd.remote import relay as chain

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO, Any, Dict, Iterator, List, Optional, Tuple

TEMPORARY = ".torchherd-stage-"
"""In the names of the files and directories being received (never a glob's match)."""


def safe_relative(path: str) -> str:
    """``path`` as written when it stays inside the workdir, else ValueError."""
    parts = path.split("/")
    if not path or path.startswith("/") or "\0" in path or ".." in parts or path.startswith("~"):
        raise ValueError(f"refused path {path!r}: it must stay inside the workdir")
    return path


def listing(full: str) -> List[Tuple[str, int, float]]:
    """The files of a checkpoint (relative to it; a file: itself, as ""), sorted: path,
    size, mtime. Symbolic links inside a directory are left out (never followed)."""
    if not os.path.isdir(full):
        info = os.stat(full)
        return [("", info.st_size, info.st_mtime)]
    files = []
    for folder, names, found in os.walk(full):
        names[:] = sorted(name for name in names if TEMPORARY not in name)
        for name in found:
            path = os.path.join(folder, name)
            info = os.lstat(path)
            if os.path.isfile(path) and not os.path.islink(path) and TEMPORARY not in name:
                files.append((os.path.relpath(path, full), info.st_size, info.st_mtime))
    return sorted(files)


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while True:
            block = file.read(chain.CHUNK)
            if not block:
                return digest.hexdigest()
            digest.update(block)


def combined(kind: str, hashes: List[Tuple[str, int, str]]) -> str:
    """A file's own SHA-256; a directory's: that of its listing with each file's hash."""
    if kind == "file":
        return hashes[0][2]
    digest = hashlib.sha256()
    for path, size, sha in hashes:
        digest.update(f"{path}\0{size}\0{sha}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def newest(workdir: str, pattern: str) -> Optional[str]:
    """The newest match of ``pattern`` under ``workdir`` (relative), or None."""
    matches = [path for path in glob.glob(os.path.join(workdir, pattern)) if TEMPORARY not in path]
    best = None
    best_mtime = -1.0
    for path in sorted(matches):
        try:
            files = listing(path)
        except OSError:
            continue
        mtime = max([mtime for _, _, mtime in files] + [os.stat(path).st_mtime])
        if mtime > best_mtime:
            best, best_mtime = path, mtime
    return None if best is None else os.path.relpath(best, workdir)


def find(workdir: str, pattern: str) -> Dict[str, Any]:
    relative = newest(workdir, pattern)
    if relative is None:
        return {"path": None}
    full = os.path.join(workdir, relative)
    kind = "dir" if os.path.isdir(full) else "file"
    files = listing(full)
    hashes = [(path, size, file_sha256(os.path.join(full, path) if path else full)) for path, size, _ in files]
    mtime = max([mtime for _, _, mtime in files] + [os.stat(full).st_mtime])
    return {"path": relative, "kind": kind, "size": sum(size for _, size, _ in files), "mtime": mtime,
            "sha256": combined(kind, hashes), "files": len(files)}


def place(workdir: str, relative: str) -> Tuple[str, str]:
    """The target's full path, and a new temporary name beside it (its directory made 0700)."""
    target = os.path.join(workdir, safe_relative(relative))
    folder, name = os.path.split(target)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return target, os.path.join(folder, f".{name}{TEMPORARY}{os.urandom(6).hex()}")


def put_in_place(temporary: str, target: str, kind: str) -> None:
    if kind == "file" or not os.path.lexists(target):
        os.replace(temporary, target)
        return
    aside = temporary + "-old"
    os.rename(target, aside)
    os.rename(temporary, target)
    if os.path.isdir(aside) and not os.path.islink(aside):
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.unlink(aside)


CLEANUP: List[str] = []
"""The temporary file or directory being received, removed if the controller goes away."""


def cleanup() -> None:
    for path in CLEANUP:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            os.unlink(path)


def relay(workdir: str, config: Dict[str, Any], stdin: chain.Link) -> Dict[str, Any]:
    token = str(config["token"]).encode("ascii")
    expect = config["expect"]
    relative = safe_relative(str(expect["path"]))
    listener = chain.listen(config)
    started = time.monotonic()
    try:
        if config["source"]:
            chain.watch_controller(cleanup)
            return send_own(workdir, relative, listener, token, started)
        upstream = chain.upstream(token, stdin)
        chain.watch_controller(cleanup)
        return receive(workdir, relative, expect, upstream, listener, token, started)
    finally:
        if listener is not None:
            listener.close()


def send_own(workdir: str, relative: str, listener: Optional[socket.socket], token: bytes,
             started: float) -> Dict[str, Any]:
    assert listener is not None
    full = os.path.join(workdir, relative)
    files = listing(full)
    sent = chain.send(chain.accept(listener, token), files, lambda path: os.path.join(full, path) if path else full)
    return {"ok": True, "bytes": sent, "seconds": round(time.monotonic() - started, 3)}


def receive(workdir: str, relative: str, expect: Dict[str, Any], upstream: chain.Link,
            listener: Optional[socket.socket], token: bytes, started: float) -> Dict[str, Any]:
    raw = upstream.line()
    header = json.loads(raw)
    downstream = chain.accept(listener, token) if listener is not None else None
    kind = str(expect["kind"])
    target, temporary = place(workdir, relative)
    CLEANUP.append(temporary)
    try:
        if kind == "dir":
            os.mkdir(temporary, 0o700)
        hashes, received = chain.pass_on(upstream, downstream, raw, outputs(temporary, kind, header["files"]), False)
        found = combined(kind, hashes)
        if found != expect["sha256"]:
            raise ValueError(f"the copy received has SHA-256 {found[:12]}..., not the {str(expect['sha256'])[:12]}... "
                             "found on the source (did it change on the way?)")
        put_in_place(temporary, target, kind)
    except BaseException:
        cleanup()
        raise
    finally:
        upstream.close()
        if downstream is not None:
            downstream.close()
    return {"ok": True, "bytes": received, "seconds": round(time.monotonic() - started, 3)}


def outputs(temporary: str, kind: str, files: List[List[Any]]) -> Iterator[Tuple[str, int, float, IO[bytes]]]:
    """Each file of the header opened for writing under ``temporary``; once written, given
    its source's mtime (the copy is not newer than the original)."""
    for path, size, mtime in files:
        if kind == "dir":
            inner = os.path.join(temporary, safe_relative(path))
            os.makedirs(os.path.dirname(inner), mode=0o700, exist_ok=True)
        else:
            inner = temporary
        with chain.write_file(inner) as output:
            yield path, int(size), float(mtime), output
        os.utime(inner, (mtime, mtime))


def main() -> int:
    mode, workdir, pattern = sys.argv[1:4]
    workdir = os.path.expanduser(workdir)
    try:
        safe_relative(pattern)
        if mode == "find":
            chain.emit(find(workdir, pattern))
            return 0
        stdin = chain.Link(None)
        try:
            line = stdin.line()
        except EOFError:
            return 1
        chain.emit(relay(workdir, json.loads(line), stdin))
        return 0
    except (OSError, ValueError, EOFError, KeyError, TypeError) as error:
        chain.emit({"error": str(error) or type(error).__name__})
        return 1


if __name__ == "__main__":
    sys.exit(main())
