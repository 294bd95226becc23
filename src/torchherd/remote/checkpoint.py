"""torchherd checkpoint staging, on a node: find the newest checkpoint, relay it node to node.

Standard library only, Python >= 3.8, Linux. Run as ``PYTHON -I -S -u -c PROGRAM MODE WORKDIR PATH [low]``
(``remote.command``; ``low``: at the lowest CPU and I/O priority, ``lower_priority``); PATH is relative to WORKDIR (``~`` is the node's home) and may be a
glob, of which the newest match (by mtime) counts. MODE is one of:

``find`` (``look``: the same without the hash, ``"sha256": null``): prints one JSON line,
  the newest copy here: ``{"path": REL, "kind": "file" or
  "dir", "size": BYTES, "mtime": SECONDS, "sha256": HEX}`` (a directory: its files' total
  size, its newest file's mtime, the SHA-256 of its listing of ``relpath NUL size NUL
  sha256`` lines), or ``{"path": null}`` when there is none, or ``{"error": TEXT}``.

``relay``: one link of the chain (``relay.py`` has its protocol) that carries a copy from
  the node that has it (the source), or from the controller (``{"upstream": null}``: a
  venv's wheelhouse, ``engine/prepare/offline.py``), to the nodes that lack it. The controller's first line
  adds ``"expect": COPY`` and ``"source": BOOL``; the source sends its copy, its files'
  sizes and mtimes in the header. A receiver writes each file into a temporary name in the
  target's own directory (0600, a directory 0700), checks the SHA-256 against the
  controller's ``expect``, sets the source's mtimes and renames it into place (a
  directory: the old one renamed aside, then removed). Its last line is ``{"ok": true,
  "bytes": N, "seconds": S}`` or ``{"error": TEXT}``. Nothing is written outside WORKDIR:
  the controller refuses an absolute PATH or one with ``..``, and this
  program refuses it again.

  Replication (``[recovery] replicate``) runs the same chain while the job runs, every
  program with ``low``, and three more keys: ``"rate"`` (the source sends at most so
  fast: ``{"bytes": B}`` per second, or ``{"share": F}`` of its link's speed as the kernel
  states it for the interface the copy leaves by, ``LINK_ASSUMED`` where it states none,
  and with ``"per_core": B`` at most B per second per core it may run on, to begin with;
  ``"link": B``: the link's speed as ``check --bandwidth`` measured it, used instead of the
  stated one; ``"pace": [RUN_ID, NODE]``: the rate is then kept to the job's pace, as the
  node's supervisor counts it, by ``pace.Governor``, between an eighth of the starting
  rate and four times it, never above the link's share; a line before the last then says
  how: ``{"governed": {"start": B, "rate": B, "slowed": N, "raised": N, ...}}``),
  ``"keep_newer": true`` (a receiver whose own copy at the path is newer than the one
  sent keeps it: a replica never passes for a newer checkpoint than the original), and
  ``"trailer": true``: the source was not hashed beforehand (``look``, not ``find``: that
  would read the whole checkpoint at full speed before the paced copy), ``expect``'s
  ``sha256`` is null, and the source hashes what it sends and sends the hash after the
  bytes (``relay.py``); each receiver checks its copy against that. The source's last
  line adds ``"sha256"``.

  With ``"progress": true`` (a venv's wheelhouse) each receiver also prints
  ``{"progress": BYTES}`` lines as it receives (``relay.py``): the controller's bars.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import shutil
import socket
import stat
import sys
import time

from torchherd.remote import relay as chain
from torchherd.remote.pace import GovernedPace, Governor, pace_path, read_pace

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO, Any, Dict, Iterator, List, Optional, Tuple

TEMPORARY = ".torchherd-stage-"
"""In the names of the files and directories being received (never a glob's match)."""
LINK_ASSUMED = 125e6
"""Bytes per second of a link whose speed the kernel does not state (a virtual NIC, a
tunnel): 1 Gb/s, the slowest link a cluster still runs distributed training over."""
BURST_SECONDS = 0.05
"""A paced sender may send this much ahead of its rate (in seconds of it): short enough
that the job's own traffic never queues behind a long burst."""
SIOCGIFADDR = 0x8915
FUTURE_SKEW = 300.0
"""How far past this node's clock a copy's mtime may be (the nodes' clocks differ a little)."""


class Pace:
    """A token bucket: ``take(n)`` returns how long to wait before sending ``n`` more bytes
    so that the sending never runs ahead of ``rate`` bytes per second (beyond a burst of
    ``BURST_SECONDS``). ``rate`` <= 0: no limit."""

    def __init__(self, rate: float, now: float) -> None:
        self.rate = rate
        self.burst = rate * BURST_SECONDS
        self.tokens = self.burst
        self.last = now

    def take(self, size: int, now: float) -> float:
        if self.rate <= 0:
            return 0.0
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        self.tokens -= size
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


def interface_of(address: str) -> Optional[str]:
    """The network interface that holds the IPv4 ``address`` (None: none found, or IPv6)."""
    import fcntl
    import struct

    try:
        names = os.listdir("/sys/class/net")
    except OSError:
        return None
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for name in names:
            try:
                answer = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    finally:
        probe.close()
    return None


def link_speed(interface: Optional[str]) -> Optional[float]:
    """The interface's speed as the kernel states it, in bytes per second (None: unknown)."""
    if interface is None:
        return None
    try:
        with open(os.path.join("/sys/class/net", interface, "speed")) as file:
            megabits = int(file.read().strip())
    except (OSError, ValueError):
        return None
    return megabits * 125000.0 if megabits > 0 else None


def rates_of(spec: Optional[Dict[str, Any]], sock: socket.socket) -> Tuple[float, float]:
    """Bytes per second the source starts sending at over ``sock``, and the most it may
    ever send at (0: no limit). The link's speed is the one measured (``"link"``, from
    ``check --bandwidth``) where there is one, else what the kernel states."""
    if not spec:
        return 0.0, 0.0
    if "bytes" in spec:
        return float(spec["bytes"]), float(spec["bytes"])
    measured = spec.get("link")
    speed = float(measured) if measured else link_speed(interface_of(sock.getsockname()[0]))
    ceiling = float(spec["share"]) * (speed if speed is not None else LINK_ASSUMED)
    if "per_core" in spec:
        return min(ceiling, float(spec["per_core"]) * cores()), ceiling
    return ceiling, ceiling


def cores() -> int:
    """The CPU cores this program may run on (its affinity: a container's or a cgroup's
    cpuset, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def lower_priority() -> None:
    """This program at the lowest CPU priority, and the idle I/O class where ``ionice``
    exists: it copies only when the job leaves the CPU and the disk idle."""
    import shutil as tools
    import subprocess

    try:
        os.nice(19)
    except OSError:
        pass
    try:
        # Below nice 19: the scheduler runs it only on a CPU nothing else wants (measured
        # with scripts/bench-replication: the job's steps slowed by a fifth less).
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):
        pass
    ionice = tools.which("ionice")
    if ionice is not None:
        subprocess.run([ionice, "-c", "3", "-p", str(os.getpid())], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


def safe_relative(path: str) -> str:
    """``path`` as written when it stays inside the workdir, else ValueError."""
    parts = path.split("/")
    if not path or path.startswith("/") or "\0" in path or ".." in parts or path.startswith("~"):
        raise ValueError(f"refused path {path!r}: it must stay inside the workdir")
    return path


def own(info: os.stat_result) -> bool:
    """A file or directory this user made (another user's, in a checkpoint directory others
    can write, is never "the newest checkpoint")."""
    return info.st_uid == os.geteuid()


def listing(full: str) -> List[Tuple[str, int, float]]:
    """The files of a checkpoint (relative to it; a file: itself, as ""), sorted: path,
    size, mtime. Symbolic links are left out (never followed, the match itself neither:
    ValueError), and so are files of another user's."""
    top = os.lstat(full)
    if stat.S_ISLNK(top.st_mode) or not own(top):
        raise ValueError(f"{full} is {'a symbolic link' if stat.S_ISLNK(top.st_mode) else 'not yours'}: not a "
                         "checkpoint of this run")
    if not stat.S_ISDIR(top.st_mode):
        return [("", top.st_size, top.st_mtime)]
    files = []
    for folder, names, found in os.walk(full):
        names[:] = sorted(name for name in names if TEMPORARY not in name)
        for name in found:
            path = os.path.join(folder, name)
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode) and own(info) and TEMPORARY not in name:
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
            files = listing(path)  # a link, or another user's match: passed over
            mtime = max([mtime for _, _, mtime in files] + [os.lstat(path).st_mtime])
        except (OSError, ValueError):
            continue
        if mtime > best_mtime:
            best, best_mtime = path, mtime
    return None if best is None else os.path.relpath(best, workdir)


def find(workdir: str, pattern: str, hashed: bool = True) -> Dict[str, Any]:
    """``find``'s answer; without ``hashed`` (mode ``look``) its ``sha256`` is null: a
    replication asks so of the nodes it copies to, whose older copy is worth no hash."""
    relative = newest(workdir, pattern)
    if relative is None:
        return {"path": None}
    full = os.path.join(workdir, relative)
    files = listing(full)
    kind = "dir" if stat.S_ISDIR(os.lstat(full).st_mode) else "file"
    mtime = max([mtime for _, _, mtime in files] + [os.lstat(full).st_mtime])
    sha256 = None
    if hashed:
        hashes = [(path, size, file_sha256(os.path.join(full, path) if path else full)) for path, size, _ in files]
        sha256 = combined(kind, hashes)
    return {"path": relative, "kind": kind, "size": sum(size for _, size, _ in files), "mtime": mtime,
            "sha256": sha256, "files": len(files)}


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
            return send_own(workdir, relative, listener, token, started, config.get("rate"),
                            bool(config.get("trailer")))
        upstream = chain.upstream(token, stdin)
        fed = upstream is stdin
        if not fed:
            chain.watch_controller(cleanup)
        return receive(workdir, relative, expect, upstream, listener, token, started, bool(config.get("keep_newer")),
                       watch_after=fed, progress=bool(config.get("progress")))
    finally:
        if listener is not None:
            listener.close()


def send_own(workdir: str, relative: str, listener: Optional[socket.socket], token: bytes,
             started: float, rate: Optional[Dict[str, Any]] = None, trailed: bool = False) -> Dict[str, Any]:
    assert listener is not None
    full = os.path.join(workdir, relative)
    files = listing(full)
    downstream = chain.accept(listener, token)
    start, ceiling = rates_of(rate, downstream.sock)
    now = time.monotonic()
    pace = Pace(start, now)
    governed = None
    if rate and start > 0 and rate.get("pace"):
        # kept to the job's pace, as the node's supervisor counts it (remote/pace.py)
        where = pace_path(str(rate["pace"][0]), str(rate["pace"][1]))
        governed = GovernedPace(Governor(start, ceiling, now), lambda first: Pace(first, now), lambda: read_pace(where))
    take = governed.take if governed is not None else pace.take
    kind = "dir" if stat.S_ISDIR(os.lstat(full).st_mode) else "file"
    said: List[Dict[str, Any]] = []

    def trailer(hashes: List[str], changed: Optional[str]) -> Dict[str, Any]:
        if changed is not None:  # the job saved again in place: what was sent is torn
            said.append({"error": f"{os.path.join(relative, changed) if changed else relative} changed while "
                                  "it was sent"})
        else:
            said.append({"sha256": combined(kind, [(path, size, sha) for (path, size, _), sha in zip(files, hashes)])})
        return said[0]

    sent = chain.send(downstream, files, lambda path: os.path.join(full, path) if path else full,
                      (lambda size: take(size, time.monotonic())) if rate else None,
                      trailer if trailed else None)
    if said and "error" in said[0]:
        return said[0]
    if governed is not None:  # a line before the last: the controller tells it with the copy
        chain.emit({"governed": {**governed.governor.summary(), "start": round(start), "ceiling": round(ceiling),
                                 "link": "measured" if rate and rate.get("link") else "stated"}})
    return {"ok": True, "bytes": sent, "seconds": round(time.monotonic() - started, 3), **(said[0] if said else {})}


def newer_here(target: str, mtime: float) -> bool:
    """Whether the copy at ``target`` is newer than one of ``mtime`` (kept, with ``keep_newer``)."""
    try:
        files = listing(target)  # another user's copy, or a link, is no copy of this run's: replaced
        return max([when for _, _, when in files] + [os.lstat(target).st_mtime]) > mtime
    except (OSError, ValueError):
        return False


def receive(workdir: str, relative: str, expect: Dict[str, Any], upstream: chain.Link,
            listener: Optional[socket.socket], token: bytes, started: float,
            keep_newer: bool = False, watch_after: bool = False, progress: bool = False) -> Dict[str, Any]:
    """``watch_after``: the controller itself is the upstream (it feeds the copy on stdin,
    as for a venv's wheelhouse), so its stdin is watched for its end only once the copy is
    in: a watch started earlier would read the copy's own bytes. ``progress``: the config's
    ``"progress"``, ``{"progress": BYTES}`` lines as it receives (a wheelhouse's bars)."""
    raw = upstream.signed_line(b"header")
    header = json.loads(raw)
    newest_mtime = checked_header(header, expect)
    downstream = chain.accept(listener, token) if listener is not None else None
    kind = str(expect["kind"])
    target, temporary = place(workdir, relative)
    CLEANUP.append(temporary)
    try:
        if kind == "dir":
            os.mkdir(temporary, 0o700)
        trailed = expect["sha256"] is None
        hashes, received, end = chain.pass_on(upstream, downstream, raw, outputs(temporary, kind, header["files"]),
                                              progress, trailer=trailed)
        if watch_after:
            chain.watch_controller(cleanup)
        found = combined(kind, hashes)
        if end is not None and "error" in end:
            raise ValueError(f"the source gave up: {end['error']}")
        wanted = end.get("sha256") if end is not None else expect["sha256"]
        if found != wanted:
            raise ValueError(f"the copy received has SHA-256 {found[:12]}..., not the {str(wanted)[:12]}... "
                             "found on the source (did it change on the way?)")
        if kind == "dir":  # its own mtime counts too when the newest copy is picked: the source's
            os.utime(temporary, (newest_mtime, newest_mtime))
        if keep_newer and newer_here(target, newest_mtime):
            cleanup()
            return {"ok": True, "bytes": received, "seconds": round(time.monotonic() - started, 3),
                    "kept": "a newer copy is here"}
        put_in_place(temporary, target, kind)
    except BaseException:
        cleanup()
        raise
    finally:
        upstream.close()
        if downstream is not None:
            downstream.close()
    return {"ok": True, "bytes": received, "seconds": round(time.monotonic() - started, 3)}


def checked_header(header: Dict[str, Any], expect: Dict[str, Any]) -> float:
    """The stream's header as it must be: its files' sizes add up to the copy's (so the
    stream ends there, whatever follows), its mtimes not past now by more than
    ``FUTURE_SKEW`` (a copy dated 2100 would pass for the newest ever after). Its newest
    mtime; else ValueError."""
    files = header.get("files")
    if not isinstance(files, list) or not all(isinstance(item, list) and len(item) == 3 for item in files):
        raise ValueError("the upstream's header is malformed")
    sizes = [size for _, size, _ in files]
    mtimes = [mtime for _, _, mtime in files]
    if not all(type(size) is int and size >= 0 for size in sizes) or \
            not all(type(mtime) in (int, float) and math.isfinite(mtime) for mtime in mtimes):
        raise ValueError("the upstream's header is malformed: a size or an mtime that is not one")
    if "size" in expect and sum(sizes) != int(expect["size"]):
        raise ValueError(f"the upstream sends {sum(sizes)} bytes, the copy is {expect['size']}")
    newest_mtime = float(max(mtimes or [0.0]))
    if newest_mtime > time.time() + FUTURE_SKEW:
        raise ValueError(f"the upstream dates the copy {time.strftime('%Y-%m-%d', time.gmtime(newest_mtime))}, "
                         "in the future: refused")
    return newest_mtime


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
    if "low" in sys.argv[4:]:
        lower_priority()
    try:
        safe_relative(pattern)
        if mode in ("find", "look"):
            chain.emit(find(workdir, pattern, hashed=mode == "find"))
            return 0
        return chain.serve(lambda config, stdin: relay(workdir, config, stdin))
    except (OSError, ValueError, EOFError, KeyError, TypeError) as error:
        chain.emit({"error": str(error) or type(error).__name__})
        return 1


if __name__ == "__main__":
    sys.exit(main())
