"""A local multi-host test cluster: one network namespace and one real sshd per node.

Each node of a :class:`LocalCluster` is

* a network namespace ``{prefix}-node{i}`` with loopback up and an ``eth0`` that is
  one end of a veth pair; the other end (``{prefix}-v{i}``) is a port of the
  bridge ``{prefix}-br``, which holds the ``.1`` address of the cluster's private
  /24 subnet (a /23 or wider past 253 nodes; the controller, this machine, reaches
  the nodes through it);
* an ``/etc/netns/{ns}/hosts`` naming ``localhost`` and every node (by its IPv4
  address, and by its IPv4-mapped IPv6 one for c10d's reverse lookups), which
  ``ip netns exec`` bind-mounts over ``/etc/hosts`` for everything on the node;
* a real ``sshd -D`` started under ``ip netns exec NS unshare --uts --mount --pid
  --fork --mount-proc``: the node has its own hostname (``node{i}``), its own
  process table (sshd is its PID 1), and private tmpfs directories (``/tmp`` and
  ``/dev/shm`` by default). Everything else is the real filesystem of this machine.

The controller side (client key, ``known_hosts``, an OpenSSH ``ssh_config`` with
one ``Host node{i}`` block per node, and a torchherd inventory ``hosts.toml``) is
written into ``workdir``. Topologies: ``jump_hosts=1`` puts a bastion ``jump0`` with
sshd's stock limits in front of the nodes (which then drop SSH from anyone else),
``jump_hosts=2`` a chain ``jump0,jump1``; ``include_aliases=True`` moves the Host
blocks into an ``Include``d file and hashes ``known_hosts``. The node side (sshd configs, host keys, the authorized
key) lives in ``/run/torchherd-cluster/{prefix}/``, outside the nodes' private
directories, so a workdir under ``/tmp`` works.

Everything the cluster creates is named after its prefix, so clusters with
different prefixes coexist and :func:`teardown` finds everything of one prefix
again, even from another process (``scripts/local-cluster down``).

Needs root, ``ip netns``, ``unshare``, OpenSSH's ``sshd``, ``ssh`` and
``ssh-keygen``; otherwise :class:`ClusterUnavailable` says what is missing.
Standard library only.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import fcntl
import hashlib
import hmac
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

__all__ = [
    "STATE_ROOT",
    "ClusterError",
    "ClusterUnavailable",
    "LocalCluster",
    "NodeInfo",
    "leftovers",
    "list_clusters",
    "teardown",
    "unavailable_reason",
]

#: Node-side files of every cluster: ``STATE_ROOT/{prefix}/``.
STATE_ROOT = Path("/run/torchherd-cluster")
NETNS_RUN = Path("/run/netns")
NETNS_ETC = Path("/etc/netns")
SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/local/sbin/sshd")
IFNAMSIZ = 15
PREFIX_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*(?:-[A-Za-z0-9_]+)*")
STATE_FILE = "cluster.json"
# The controller-side files up() writes into workdir and down() removes again.
CONTROLLER_FILES = (
    "id_ed25519",
    "id_ed25519.pub",
    "known_hosts",
    "ssh_config",
    "hosts.toml",
    STATE_FILE,
)


REPO_ROOT = Path(__file__).resolve().parents[2]
ROOT_BASHRC = Path("/root/.bashrc")
"""The SSH user's (root's) ``~/.bashrc``, which each node replaces by one of its own."""
PRIVATE_COPIES = ((Path("/root/.pyenv/shims"), ".pyenv-shim"),)
"""Directories of the shared home that each node gets a private copy of, and the lock
file in each that the copy leaves out (one held or left stale at the moment of the copy
would never be released there: every shell on the node would wait 60 s). pyenv's
``rehash``, which a ``.bashrc`` with ``pyenv init`` runs in every shell (every SSH
command), takes a lock in its shims directory and waits up to 60 s for it: nodes sharing
one home queued every SSH command behind each other's (64 parallel ``ssh nodeN true``
took 35-62 s each; 15 s without the wait), and behind this machine's own shells. Real
nodes have a home each."""


def _under_any(path: str, directories: Sequence[str]) -> bool:
    resolved = os.path.realpath(path)
    return any(resolved == d or resolved.startswith(d.rstrip("/") + "/") for d in directories)


class ClusterUnavailable(RuntimeError):
    """This machine cannot run a local cluster (not root, no ``ip netns``, ...)."""


class ClusterError(RuntimeError):
    """Building, using or tearing down a local cluster failed."""


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """One node: its hostname, its network namespace and its address."""

    name: str
    namespace: str
    ip: str


# --------------------------------------------------------------------------- names


def bridge_name(prefix: str) -> str:
    return f"{prefix}-br"


def namespace_name(prefix: str, index: int) -> str:
    return f"{prefix}-node{index}"


def veth_name(prefix: str, index: int) -> str:
    return f"{prefix}-v{index}"


def state_dir(prefix: str) -> Path:
    return STATE_ROOT / prefix


def _namespace_re(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"{re.escape(prefix)}-node\d+")


def _veth_re(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"{re.escape(prefix)}-v\d+")


def validate_prefix(prefix: str, n: int = 1) -> None:
    """Raise ValueError unless ``prefix`` gives valid names for ``n`` nodes."""
    if not PREFIX_RE.fullmatch(prefix):
        raise ValueError(
            f"cluster prefix {prefix!r}: use a letter, then letters, digits, '_' "
            "or single '-' (it names interfaces and namespaces)"
        )
    longest = max(len(bridge_name(prefix)), len(veth_name(prefix, max(n - 1, 0))))
    if longest > IFNAMSIZ:
        raise ValueError(
            f"cluster prefix {prefix!r} is too long for {n} nodes: interface "
            f"names would have {longest} characters, Linux allows {IFNAMSIZ}"
        )


# --------------------------------------------------------------------------- helpers


def _run(
    argv: Sequence[str],
    *,
    check: bool = True,
    timeout: float = 30.0,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        list(argv),
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
        stdin=None if input is not None else subprocess.DEVNULL,
    )
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()
        raise ClusterError(
            f"`{shlex.join(argv)}` failed with exit code {proc.returncode}: {detail}"
        )
    return proc


def _sshd_path() -> str | None:
    for candidate in SSHD_CANDIDATES:
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("sshd")


_unavailable_cache: list[str | None] = []


def unavailable_reason() -> str | None:
    """Why a local cluster cannot run here, or None when it can (cached)."""
    if not _unavailable_cache:
        _unavailable_cache.append(_compute_unavailable_reason())
    return _unavailable_cache[0]


def _compute_unavailable_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return (
            f"the local cluster needs Linux network namespaces (this is {sys.platform})"
        )
    if os.geteuid() != 0:
        return "the local cluster needs root (network namespaces, bridge, sshd)"
    for tool in ("ip", "unshare", "nsenter", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"the local cluster needs `{tool}` on PATH"
    if _sshd_path() is None:
        return "the local cluster needs OpenSSH's sshd (Debian: openssh-server)"
    try:
        probe = _run(["ip", "netns", "list"], check=False, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"`ip netns list` does not run: {exc}"
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    try:
        with open("/etc/shadow", encoding="utf-8") as shadow:
            for line in shadow:
                fields = line.split(":")
                if (
                    fields[0] == "root"
                    and len(fields) > 1
                    and fields[1].startswith("!")
                ):
                    return (
                        "root's account is locked in /etc/shadow ('!'), and sshd "
                        "with UsePAM no refuses locked accounts even for keys"
                    )
    except OSError:
        pass
    return None


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rpartition(")")[2].split()
    return bool(fields) and fields[0] not in ("Z", "X")


def _cmdline(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")


def _all_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _netns_pids(namespace: str) -> list[int]:
    proc = _run(["ip", "netns", "pids", namespace], check=False, timeout=10)
    if proc.returncode != 0:
        return []
    return sorted(int(tok) for tok in proc.stdout.split() if tok.isdigit())


def _pids_in_netns_inodes(inodes: Iterable[int], started_by: Mapping[int, float] | None = None) -> list[int]:
    """Processes in the network namespaces of ``inodes``; where ``started_by`` gives an
    inode a time (seconds since boot), only those in it that had started by then."""
    limits = started_by or {}
    wanted = {f"net:[{inode}]": limits.get(inode) for inode in inodes}
    if not wanted:
        return []
    found = []
    for pid in _all_pids():
        try:
            namespace = os.readlink(f"/proc/{pid}/ns/net")
            if namespace in wanted and ((limit := wanted[namespace]) is None or _started(pid) <= limit):
                found.append(pid)
        except OSError:
            continue
    return found


_DELETED_AT: dict[int, float] = {}
"""Per network namespace inode, when this process deleted the namespace that had it
(seconds since boot, read just before ``ip netns del``). The kernel reuses an inode number
once the namespace is gone: a namespace made since (a headless chromium's, another worker's
``unshare --net``) may carry a recorded number, and its processes, started after the
deletion, are none of the cluster's leftovers. Kept per inode, not per cluster: a cluster
whose prefix is brought up again (its leftovers cleaned) has inodes deleted at two times,
and the later time would take a namespace made in between for the cluster's (CI, stop 53:
another worker's ``check -H localhost`` in an unnamed namespace)."""


def _since_boot() -> float:
    with open("/proc/uptime") as file:
        return float(file.read().split()[0])


def _started(pid: int) -> float:
    """When ``pid`` started, in seconds since boot (``/proc/PID/stat``'s starttime); raises OSError."""
    with open(f"/proc/{pid}/stat", "rb") as file:
        fields = file.read().rsplit(b")", 1)[1].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _pids_mentioning(text: str) -> list[int]:
    me = os.getpid()
    found = []
    for pid in _all_pids():
        if pid == me:
            continue
        cmd = _cmdline(pid)
        if cmd is not None and text in cmd:
            found.append(pid)
    return found


def _kill_and_wait(pids: Iterable[int], timeout: float = 5.0) -> list[int]:
    """SIGTERM ``pids``, then SIGKILL what is left; return what still lives."""
    me = os.getpid()
    targets = {pid for pid in pids if pid > 1 and pid != me}
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 3.0)):
        for pid in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while True:
            targets = {pid for pid in targets if _alive(pid)}
            if not targets or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        if not targets:
            break
    return sorted(targets)


def _list_netns() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_RUN))
    except OSError:
        return []


def _list_links() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/net"))
    except OSError:
        proc = _run(["ip", "-o", "link", "show"], check=False)
        return sorted(
            line.split(":")[1].strip().split("@")[0]
            for line in proc.stdout.splitlines()
            if line.count(":") >= 2
        )


def _netns_inode(namespace: str) -> int | None:
    try:
        return os.stat(NETNS_RUN / namespace).st_ino
    except OSError:
        return None


@contextlib.contextmanager
def _global_lock() -> Iterator[None]:
    """Serialise subnet choice among clusters built at the same time."""
    STATE_ROOT.mkdir(mode=0o755, parents=True, exist_ok=True)
    with open(STATE_ROOT / ".lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _used_networks() -> list[ipaddress.IPv4Network]:
    used: list[ipaddress.IPv4Network] = []
    addrs = _run(["ip", "-4", "-o", "addr", "show"], check=False)
    for match in re.finditer(r"\binet (\d+\.\d+\.\d+\.\d+/\d+)", addrs.stdout):
        used.append(ipaddress.IPv4Interface(match.group(1)).network)
    routes = _run(["ip", "-4", "route", "show", "table", "all"], check=False)
    for line in routes.stdout.splitlines():
        tokens = line.split()
        if tokens and tokens[0] in (
            "local",
            "broadcast",
            "unicast",
            "blackhole",
            "unreachable",
            "prohibit",
        ):
            tokens = tokens[1:]
        if not tokens or tokens[0] == "default":
            continue
        with contextlib.suppress(ValueError):
            used.append(ipaddress.IPv4Network(tokens[0], strict=False))
    for info in list_clusters():
        with contextlib.suppress(KeyError, TypeError, ValueError):
            used.append(ipaddress.IPv4Network(str(info["subnet"])))
    return used


NEIGHBOURS = Path("/proc/sys/net/ipv4/neigh/default")


def make_room_for_neighbours(nodes: int) -> list[str]:
    """Every network namespace on one kernel shares one neighbour (ARP) table, capped by
    gc_thresh3 (1024 by default). A full mesh of 32 namespaces needs 32 x 31 entries;
    past the cap the kernel drops packets ('neighbor table overflow' in dmesg), and the
    checks' probes rightly report them as timeouts: a fault of this test rig, which real
    nodes (a table each) never share. Raises the thresholds, never lowers them: other
    clusters may be using the room. Returns what it changed."""
    changed = []
    for name, value in (("gc_thresh3", 4 * nodes * nodes), ("gc_thresh2", 2 * nodes * nodes),
                        ("gc_thresh1", nodes * nodes)):
        try:
            current = int((NEIGHBOURS / name).read_text())
            if current < value:
                (NEIGHBOURS / name).write_text(f"{value}\n")
                changed.append(f"{name} {current} -> {value}")
        except OSError:  # not root, or no such knob: the small clusters still fit
            pass
    return changed


def subnet_prefixlen(hosts: int) -> int:
    """The prefix length of the smallest subnet that holds ``hosts`` nodes beside its
    network, bridge (.1) and broadcast addresses; never narrower than a /24, so clusters
    of up to 253 nodes keep the /24 they always had (256 nodes take a /23)."""
    return min(24, 32 - (hosts + 2).bit_length())


def choose_subnet(prefix: str, prefixlen: int = 24) -> ipaddress.IPv4Network:
    """A free aligned 10.X.Y.0/prefixlen in 10.128.0.0 - 10.254.255.255, derived from a
    hash of the prefix (for a /24, X in 128..254 as it always was)."""
    used = _used_networks()
    seed = int.from_bytes(hashlib.sha256(prefix.encode()).digest()[:8], "big")
    size = 1 << (32 - prefixlen)
    space = 127 * 256 * 256 // size
    base = int(ipaddress.IPv4Address("10.128.0.0"))
    for step in range(space):
        index = (seed + step * 7919) % space  # 7919 is prime: visits every slot
        net = ipaddress.IPv4Network((base + index * size, prefixlen))
        if not any(net.overlaps(other) for other in used):
            return net
    raise ClusterError(f"no free /{prefixlen} subnet in 10.128.0.0/9 for a local cluster")


def _toml_str(value: str) -> str:
    out = ['"']
    for ch in value:
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"':
            out.append('\\"')
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _ssh_banner_ready(ip: str, port: int = 22, timeout: float = 0.3) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            return sock.recv(4).startswith(b"SSH-")
    except OSError:
        return False


def _listening(pid: int, port: int) -> bool:
    """Whether something listens on TCP ``port`` in the network namespace of ``pid``."""
    try:
        table = Path(f"/proc/{pid}/net/tcp").read_text()
    except OSError:
        return False
    wanted = f":{port:04X}"
    return any(
        fields[1].endswith(wanted) and fields[3] == "0A"  # 0A: LISTEN
        for fields in (line.split() for line in table.splitlines()[1:])
        if len(fields) > 3
    )


def _hashed(name: str) -> str:
    """A known_hosts name as ``HashKnownHosts yes`` writes it (``|1|salt|hmac-sha1``)."""
    salt = os.urandom(20)
    digest = hmac.new(salt, name.encode(), hashlib.sha1).digest()
    return f"|1|{base64.b64encode(salt).decode()}|{base64.b64encode(digest).decode()}"


# --------------------------------------------------------------------------- discovery


def list_clusters() -> list[dict[str, Any]]:
    """The state records of every cluster whose node side exists on this machine."""
    found: list[dict[str, Any]] = []
    try:
        entries = sorted(STATE_ROOT.iterdir())
    except OSError:
        return found
    for entry in entries:
        with contextlib.suppress(OSError, ValueError):
            data = json.loads((entry / STATE_FILE).read_text())
            if isinstance(data, dict):
                found.append(data)
    return found


def _recorded_inodes(prefix: str) -> list[int]:
    with contextlib.suppress(OSError, ValueError, TypeError):
        data = json.loads((state_dir(prefix) / STATE_FILE).read_text())
        return [int(inode) for inode in data.get("netns_inodes", [])]
    return []


def _foreign_inodes(prefix: str) -> set[int]:
    """Inodes of the named network namespaces that are not this cluster's.

    Namespace inode numbers are reused once a namespace is gone: a recorded
    inode may by now belong to someone else's namespace.
    """
    ns_re = _namespace_re(prefix)
    return {
        inode
        for ns in _list_netns()
        if not ns_re.fullmatch(ns) and (inode := _netns_inode(ns)) is not None
    }


def leftovers(prefix: str, netns_inodes: Iterable[int] = ()) -> list[str]:
    """Everything of cluster ``prefix`` that still exists, one line each.

    ``netns_inodes`` (see :attr:`LocalCluster.netns_inodes`) also finds
    processes in the cluster's namespaces after the names were deleted.
    """
    inodes = (set(netns_inodes) | set(_recorded_inodes(prefix))) - _foreign_inodes(
        prefix
    )
    found: list[str] = []
    ns_re, veth_re = _namespace_re(prefix), _veth_re(prefix)
    found += [f"network namespace {ns}" for ns in _list_netns() if ns_re.fullmatch(ns)]
    found += [
        f"link {link}"
        for link in _list_links()
        if veth_re.fullmatch(link) or link == bridge_name(prefix)
    ]
    with contextlib.suppress(OSError):
        found += [
            f"directory {NETNS_ETC / d}"
            for d in sorted(os.listdir(NETNS_ETC))
            if ns_re.fullmatch(d)
        ]
    if state_dir(prefix).exists():
        found.append(f"directory {state_dir(prefix)}")
    pids = set(_pids_mentioning(f"{state_dir(prefix)}/")) | set(
        _pids_in_netns_inodes(inodes, _DELETED_AT)
    )
    for pid in sorted(pids):
        if _alive(pid):
            found.append(f"process {pid}: {_cmdline(pid)}")
    return found


def teardown(prefix: str, netns_inodes: Iterable[int] = ()) -> list[str]:
    """Remove everything of cluster ``prefix``; return what could not be removed.

    Kills every process in the cluster's namespaces (and any process naming its
    state directory), then deletes veth pairs, the bridge, the namespaces,
    ``/etc/netns/<ns>`` and the state directory. Safe to call any number of
    times and on a half-built cluster. ``netns_inodes`` only widens the final
    report: processes are killed only in namespaces that still carry this
    cluster's names, never by a recorded inode number that may have been reused.
    """
    validate_prefix(prefix)
    ns_re, veth_re = _namespace_re(prefix), _veth_re(prefix)
    namespaces = [ns for ns in _list_netns() if ns_re.fullmatch(ns)]
    live_inodes = {
        inode for ns in namespaces if (inode := _netns_inode(ns)) is not None
    }
    inodes = set(netns_inodes) | set(_recorded_inodes(prefix)) | live_inodes
    pids: set[int] = set(_pids_mentioning(f"{state_dir(prefix)}/"))
    for ns in namespaces:
        pids.update(_netns_pids(ns))
    pids.update(_pids_in_netns_inodes(live_inodes))
    _kill_and_wait(pids)
    for link in _list_links():
        if veth_re.fullmatch(link) or link == bridge_name(prefix):
            _run(["ip", "link", "del", link], check=False)
    for ns in namespaces:
        inode, deleting = _netns_inode(ns), _since_boot()
        _run(["ip", "netns", "del", ns], check=False)
        if inode is not None:
            _DELETED_AT[inode] = deleting
    now = _since_boot()
    for gone in inodes - live_inodes:  # deleted before now, by whoever did it
        _DELETED_AT.setdefault(gone, now)
    with contextlib.suppress(OSError):
        for entry in os.listdir(NETNS_ETC):
            if ns_re.fullmatch(entry):
                shutil.rmtree(NETNS_ETC / entry, ignore_errors=True)
    if not any(item.startswith("process ") for item in leftovers(prefix, inodes)):
        shutil.rmtree(state_dir(prefix), ignore_errors=True)
    return leftovers(prefix, inodes)


# --------------------------------------------------------------------------- cluster

_Cluster = TypeVar("_Cluster", bound="LocalCluster")


IMAGE_TAG = "localhost/torchherd-test:1"
"""The test image's name on the nodes of a cluster with ``containers``."""


def write_image_archive(path: Path, mark: str = "") -> Path:
    """A ``docker save`` archive of a tiny image, made offline and the same byte for byte each
    time (so its id is the same on every node that loads it): the root directories of a
    merged-/usr Debian, an /etc/passwd whose default user is ``nobody`` (files a job writes
    as the image's user would not be the SSH user's), and ``mark`` in /etc/torchherd-mark
    (another mark: another image under the same tag). The job's Python, torch and the
    system's libraries come from the host, mounted read-only (``image_mounts``)."""
    import io
    import tarfile

    def add(tar: tarfile.TarFile, name: str, data: bytes | None = None, link: str = "", mode: int = 0o755) -> None:
        info = tarfile.TarInfo(name)
        info.mtime, info.mode = 0, mode
        if link:
            info.type, info.linkname = tarfile.SYMTYPE, link
        elif data is None:
            info.type = tarfile.DIRTYPE
        else:
            info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data) if data is not None else None)

    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for directory in ("etc", "usr", "proc", "sys", "dev", "root", "run", "var", "home", "opt", "srv", "mnt"):
            add(tar, directory)
        add(tar, "tmp", mode=0o1777)
        for name in ("bin", "lib", "lib64", "sbin"):
            add(tar, name, link="usr/" + name)
        add(tar, "etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n")
        add(tar, "etc/group", b"root:x:0:\nnogroup:x:65534:\n")
        add(tar, "etc/torchherd-mark", mark.encode())
    layer_bytes = layer.getvalue()
    diff_id = hashlib.sha256(layer_bytes).hexdigest()
    config = json.dumps({"architecture": "amd64", "os": "linux", "created": "2026-01-01T00:00:00Z",
                         "config": {"User": "65534:65534", "Env": ["PATH=/usr/local/bin:/usr/bin:/bin"]},
                         "rootfs": {"type": "layers", "diff_ids": [f"sha256:{diff_id}"]}},
                        sort_keys=True).encode()
    config_id = hashlib.sha256(config).hexdigest()
    manifest = json.dumps([{"Config": f"{config_id}.json", "RepoTags": [IMAGE_TAG],
                            "Layers": [f"{diff_id}/layer.tar"]}]).encode()
    with tarfile.open(path, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        add(tar, diff_id)
        add(tar, f"{diff_id}/layer.tar", layer_bytes)
        add(tar, f"{config_id}.json", config)
        add(tar, "manifest.json", manifest)
    return path


def image_mounts() -> list[str]:
    """What the test image borrows from the host, read-only: /usr (the system's libraries and
    tools), this Python's installation (torch with it) and the checkout (the test jobs)."""
    paths = ["/usr"]
    for path in (os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), str(REPO_ROOT)):
        if not any(path == p or path.startswith(p.rstrip("/") + "/") for p in paths):
            paths.append(path)
    return [f"{path}:{path}:ro" for path in paths]


class LocalCluster:
    """N hosts on this machine, each a network namespace with its own sshd.

    >>> with LocalCluster(3, Path("/tmp/c")) as cluster:   # doctest: +SKIP
    ...     print(cluster.ssh("node1", "hostname").stdout)
    node1
    """

    def __init__(
        self,
        n: int,
        workdir: Path,
        prefix: str = "th",
        *,
        python: str | None = None,
        master_port: int = 29500,
        nproc_per_node: int = 2,
        private_dirs: Sequence[str] = ("/tmp", "/dev/shm"),
        shared_paths: Sequence[str] | None = None,
        ready_timeout: float = 15.0,
        jump_hosts: int = 0,
        include_aliases: bool = False,
        containers: bool = False,
        node_path: str | None = None,
    ) -> None:
        if n < 1:
            raise ValueError(f"a cluster needs at least one node, got n={n}")
        if jump_hosts < 0:
            raise ValueError(f"jump_hosts must be 0 or more, got {jump_hosts}")
        validate_prefix(prefix, n + jump_hosts)
        for directory in private_dirs:
            if not directory.startswith("/") or any(c.isspace() for c in directory):
                raise ValueError(
                    f"private directory {directory!r}: use an absolute path without spaces"
                )
        self.n = n
        # Jump hosts in a chain in front of the nodes: jump0 (a bastion with sshd's stock
        # limits) takes SSH from anywhere, jump{i} only from jump{i-1}, the nodes only from
        # the last jump host (iptables in their namespaces); the ssh_config says
        # ProxyJump jump0[,jump1...]. Their namespaces come after the nodes'.
        self.jump_hosts = jump_hosts
        # The Host blocks in an Included file (ssh_config.d/nodes.conf), with hashed
        # known_hosts entries, as Debian's stock ssh_config (Include, HashKnownHosts yes)
        # leaves them: this machine cannot resolve "node0", only that file says where it is.
        self.include_aliases = include_aliases
        # podman on every node (docs/containers.md): a cgroup2 hierarchy in the node's own
        # mount namespace (ip netns exec mounts a /sys without one), crun with cgroups
        # disabled, and a storage and /etc/containers of the node's own, so that two nodes
        # can hold different images under one name, as real machines can.
        self.containers = containers
        # The PATH of every SSH session on the nodes (sshd's SetEnv), where the default
        # would find the wrong program first (this machine's /usr/local/bin/docker).
        self.node_path = node_path
        self.prefix = prefix
        self.workdir = Path(workdir).absolute()
        self.python = python or sys.executable
        self.master_port = master_port
        self.nproc_per_node = nproc_per_node
        self.private_dirs = tuple(private_dirs)
        # What must stay visible on the nodes although it lies under a private dir
        # (a checkout or a venv under /tmp, as CI may clone there): the nodes share
        # this machine's filesystem like a cluster with a shared home.
        if shared_paths is None:
            shared_paths = (str(REPO_ROOT), sys.prefix)
        self.shared_paths = tuple(
            path for path in shared_paths if _under_any(path, self.private_dirs) and os.path.isdir(path)
        )
        self.ready_timeout = ready_timeout

        self.bridge = bridge_name(prefix)
        self.state_dir = state_dir(prefix)
        self.ssh_config = self.workdir / "ssh_config"
        self.known_hosts = self.workdir / "known_hosts"
        self.identity_file = self.workdir / "id_ed25519"
        self.inventory = self.workdir / "hosts.toml"
        self.include_dir = self.workdir / "ssh_config.d"
        self.state_file = self.workdir / STATE_FILE
        self.log_dir = self.workdir / "logs"

        self.hosts: list[NodeInfo] = []
        self._subnet: ipaddress.IPv4Network | None = None
        self._netns_inodes: list[int] = []
        self._sshd: dict[str, subprocess.Popen[bytes]] = {}
        self._by_name: dict[str, NodeInfo] = {}

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self: _Cluster) -> _Cluster:  # typing.Self is 3.11+
        return self.up()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()

    def __repr__(self) -> str:
        return f"LocalCluster(n={self.n}, workdir={str(self.workdir)!r}, prefix={self.prefix!r})"

    @property
    def is_up(self) -> bool:
        return self._subnet is not None and bool(self.hosts)

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        if self._subnet is None:
            raise ClusterError(f"{self!r} is not up")
        return self._subnet

    @property
    def bridge_ip(self) -> str:
        """The controller's address on the cluster network (the bridge, ``.1``)."""
        return str(self.subnet.network_address + 1)

    @property
    def netns_inodes(self) -> tuple[int, ...]:
        """Inode numbers of the nodes' network namespaces (to find their processes
        even after the namespaces lost their names)."""
        return tuple(self._netns_inodes)

    @property
    def names(self) -> list[str]:
        """The nodes (what the inventory lists), without the jump hosts."""
        return [host.name for host in self.hosts[: self.n]]

    @property
    def jump_names(self) -> list[str]:
        return [host.name for host in self.hosts[self.n :]]

    def up(self: _Cluster) -> _Cluster:  # typing.Self is 3.11+
        """Build the cluster (after removing leftovers of the same prefix)."""
        reason = unavailable_reason()
        if reason is not None:
            raise ClusterUnavailable(reason)
        self.down()
        try:
            self._build()
        except BaseException:
            with contextlib.suppress(ClusterError):
                self.down()
            raise
        return self

    def down(self) -> None:
        """Remove everything of this cluster; idempotent, safe after a failed up()."""
        for proc in self._sshd.values():
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        left = teardown(self.prefix, self._netns_inodes)
        for proc in self._sshd.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._sshd.clear()
        for name in CONTROLLER_FILES:
            with contextlib.suppress(FileNotFoundError):
                (self.workdir / name).unlink()
        shutil.rmtree(self.include_dir, ignore_errors=True)
        self.hosts = []
        self._by_name = {}
        self._subnet = None
        self._netns_inodes = []
        if left:
            raise ClusterError(
                f"cluster {self.prefix!r} left behind: " + "; ".join(left)
            )

    @classmethod
    def attach(cls, workdir: Path, prefix: str | None = None) -> LocalCluster:
        """A handle on a cluster that another process brought up into ``workdir``.

        Reads ``workdir/cluster.json`` (or, without it, the state of ``prefix``).
        The handle can use and ``down()`` the cluster.
        """
        data: dict[str, Any] | None = None
        with contextlib.suppress(OSError, ValueError):
            data = json.loads((Path(workdir) / STATE_FILE).read_text())
        if data is None and prefix is not None:
            with contextlib.suppress(OSError, ValueError):
                data = json.loads((state_dir(prefix) / STATE_FILE).read_text())
        if data is None:
            if prefix is None:
                raise ClusterError(f"no cluster state in {workdir} and no prefix given")
            return cls(1, Path(workdir), prefix)
        if prefix is not None and data.get("prefix") != prefix:
            raise ClusterError(
                f"{workdir} holds cluster {data.get('prefix')!r}, not {prefix!r}"
            )
        cluster = cls(
            int(data["n"]),
            Path(data.get("workdir", workdir)),
            str(data["prefix"]),
            python=str(data.get("python", sys.executable)),
            private_dirs=tuple(data.get("private_dirs", ("/tmp",))),
            jump_hosts=int(data.get("jump_hosts", 0)),
            include_aliases=bool(data.get("include_aliases", False)),
        )
        cluster._subnet = ipaddress.IPv4Network(str(data["subnet"]))
        cluster._set_hosts([NodeInfo(**host) for host in data["hosts"]])
        cluster._netns_inodes = [int(i) for i in data.get("netns_inodes", [])]
        return cluster

    # ------------------------------------------------------------------ build

    def _set_hosts(self, hosts: list[NodeInfo]) -> None:
        self.hosts = hosts
        self._by_name = {host.name: host for host in hosts}

    def _node_dir(self, name: str) -> Path:
        return self.state_dir / name

    def _build(self) -> None:
        make_room_for_neighbours(self.n + self.jump_hosts)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(exist_ok=True)
        STATE_ROOT.mkdir(mode=0o755, parents=True, exist_ok=True)
        self.state_dir.mkdir(mode=0o700)
        names = [f"node{i}" for i in range(self.n)] + [f"jump{i}" for i in range(self.jump_hosts)]
        for name in names:
            self._node_dir(name).mkdir(mode=0o700)

        # Keys first, in parallel with the network set-up.
        keygens = [
            self._keygen(self.identity_file, f"{self.prefix}-controller"),
            *(
                self._keygen(
                    self._node_dir(name) / "ssh_host_ed25519_key",
                    f"{self.prefix}-{name}",
                )
                for name in names
            ),
        ]

        with _global_lock():
            subnet = choose_subnet(self.prefix, subnet_prefixlen(len(names)))
            self._subnet = subnet
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            # Bridged frames must not go through this machine's iptables FORWARD
            # chain (Docker sets it to DROP); not every kernel has the knob.
            _run(
                [
                    "ip",
                    "link",
                    "set",
                    self.bridge,
                    "type",
                    "bridge",
                    "forward_delay",
                    "0",
                    "nf_call_iptables",
                    "0",
                    "nf_call_ip6tables",
                    "0",
                    "nf_call_arptables",
                    "0",
                ],
                check=False,
            )
            _run(
                [
                    "ip",
                    "addr",
                    "add",
                    f"{subnet.network_address + 1}/{subnet.prefixlen}",
                    "dev",
                    self.bridge,
                ]
            )
            _run(["ip", "link", "set", self.bridge, "up"])

        hosts = [
            NodeInfo(
                name,
                namespace_name(self.prefix, i),
                str(subnet.network_address + 2 + i),
            )
            for i, name in enumerate(names)
        ]
        self._set_hosts(hosts)
        # Each node also under its IPv4-mapped IPv6 address: torch's c10d store listens
        # dual-stack, sees a peer as ::ffff:a.b.c.d and looks that up, which glibc's files
        # backend answers only from such a line (else every rank logs "The hostname of the
        # client socket cannot be retrieved. err=-3"). After the IPv4 lines, so forward
        # lookups still give the IPv4 address first.
        hosts_file = "".join(
            ["127.0.0.1\tlocalhost\n", "::1\tlocalhost ip6-localhost ip6-loopback\n"]
            + [f"{host.ip}\t{host.name}\n" for host in hosts]
            + [f"::ffff:{host.ip}\t{host.name}\n" for host in hosts]
        )
        host_batch = []
        for i, host in enumerate(hosts):
            host_batch += [
                f"netns add {host.namespace}",
                f"link add {veth_name(self.prefix, i)} type veth peer name eth0 netns {host.namespace}",
                f"link set {veth_name(self.prefix, i)} master {self.bridge} up",
            ]
        _run(["ip", "-batch", "-"], input="\n".join(host_batch) + "\n")
        for host in hosts:
            inode = _netns_inode(host.namespace)
            if inode is not None:
                self._netns_inodes.append(inode)
                _DELETED_AT.pop(inode, None)  # a number reused: this namespace is alive
            netns_etc = NETNS_ETC / host.namespace
            netns_etc.mkdir(parents=True, exist_ok=True)
            (netns_etc / "hosts").write_text(hosts_file)
        node_batches = [
            subprocess.Popen(
                ["ip", "-n", host.namespace, "-batch", "-"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for host in hosts
        ]
        for host, proc in zip(hosts, node_batches):
            out, _ = proc.communicate(
                f"addr add {host.ip}/{subnet.prefixlen} dev eth0\n"
                "link set eth0 up\n"
                "link set lo up\n",
                timeout=30,
            )
            if proc.returncode != 0:
                raise ClusterError(
                    f"configuring {host.namespace} failed: {out.strip()}"
                )

        for keygen in keygens:
            _, err = keygen.communicate(timeout=30)
            if keygen.returncode != 0:
                raise ClusterError(f"ssh-keygen failed: {err.strip()}")
        self._write_node_configs()
        self._write_controller_files()
        self._write_state()
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privsep directory
        self._restrict_ssh()
        for host in hosts:
            self._start_sshd(host)
        self.wait_ready([host.name for host in hosts], timeout=self.ready_timeout)

    @staticmethod
    def _keygen(path: Path, comment: str) -> subprocess.Popen[str]:
        for stale in (path, path.with_name(path.name + ".pub")):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        return subprocess.Popen(
            [
                "ssh-keygen",
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-C",
                comment,
                "-f",
                str(path),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def _write_node_configs(self) -> None:
        authorized = self.state_dir / "authorized_keys"
        authorized.write_text(self.identity_file.with_suffix(".pub").read_text())
        authorized.chmod(0o600)
        for host in self.hosts:
            node_dir = self._node_dir(host.name)
            (node_dir / "sshd_config").write_text(
                "\n".join(
                    [
                        f"# sshd of {host.name} in local cluster {self.prefix!r}",
                        "Port 22",
                        "ListenAddress 0.0.0.0",
                        f"HostKey {node_dir / 'ssh_host_ed25519_key'}",
                        "PidFile none",
                        "PermitRootLogin prohibit-password",
                        "PubkeyAuthentication yes",
                        f"AuthorizedKeysFile {authorized}",
                        "PasswordAuthentication no",
                        "KbdInteractiveAuthentication no",
                        "UsePAM no",
                        "UseDNS no",
                        "StrictModes yes",
                        "PrintMotd no",
                        "PrintLastLog no",
                        "X11Forwarding no",
                        "AllowTcpForwarding yes",
                        # A jump host keeps sshd's stock limits (MaxStartups 10:30:100,
                        # MaxSessions 10), as real bastions do.
                        *(
                            []
                            if host.name in self.jump_names
                            else ["MaxStartups 200:30:400", "MaxSessions 100"]
                        ),
                        *([f"SetEnv PATH={self.node_path}"] if self.node_path else []),
                        "LogLevel INFO",
                        "Subsystem sftp internal-sftp",
                        "",
                    ]
                )
            )

    def _write_controller_files(self) -> None:
        known = []
        for host in self.hosts:
            key = (
                (self._node_dir(host.name) / "ssh_host_ed25519_key.pub")
                .read_text()
                .split()
            )
            if self.include_aliases:
                known += [f"{_hashed(name)} {key[0]} {key[1]}\n" for name in (host.name, host.ip)]
            else:
                known.append(f"{host.name},{host.ip} {key[0]} {key[1]}\n")
        self.known_hosts.write_text("".join(known))
        header = (
            f"# Local test cluster {self.prefix!r} ({self.subnet}); "
            "made by tests/cluster/localcluster.py\n"
        )
        common = (
            "    User root\n"
            "    Port 22\n"
            f"    IdentityFile {self.identity_file}\n"
            "    IdentitiesOnly yes\n"
            f"    UserKnownHostsFile {self.known_hosts}\n"
            "    GlobalKnownHostsFile /dev/null\n"
            "    StrictHostKeyChecking yes\n"
            "    UpdateHostKeys no\n"
            "    BatchMode yes\n"
            "    ConnectTimeout 10\n"
            "    LogLevel ERROR\n"
        )
        jumps = ",".join(self.jump_names)
        blocks = []
        for host in self.hosts:
            via = f"    ProxyJump {jumps}\n" if jumps and host.name in self.names else ""
            if host.name in self.jump_names[1:]:  # reached through the hops before it
                via = f"    ProxyJump {','.join(self.jump_names[: self.jump_names.index(host.name)])}\n"
            blocks.append(f"\nHost {host.name}\n    HostName {host.ip}\n{via}")
        if self.include_aliases:
            self.include_dir.mkdir(exist_ok=True)
            (self.include_dir / "nodes.conf").write_text(header + "".join(blocks))
            self.ssh_config.write_text(header + f"\nInclude {self.include_dir}/*.conf\n\nHost *\n" + common)
        else:
            self.ssh_config.write_text(header + "".join(block + common for block in blocks))
        lines = [
            f"# torchherd inventory of local test cluster {self.prefix!r} ({self.subnet})",
            "[cluster]",
            f"master = {_toml_str(self.hosts[0].name)}",
            f"port = {self.master_port}",
            f"nproc_per_node = {self.nproc_per_node}",
            'ssh_config = "ssh_config"      # relative to this file',
            "",
            "[defaults]",
            f"python = {_toml_str(self.python)}",
            'workdir = "/tmp"',
        ]
        for host in self.hosts[: self.n]:
            lines += ["", "[[hosts]]", f"name = {_toml_str(host.name)}"]
        self.inventory.write_text("\n".join(lines) + "\n")

    def _restrict_ssh(self) -> None:
        """Behind jump hosts: each machine takes SSH only from the hop in front of it."""
        for index, host in enumerate(self.hosts):
            if host.name == "jump0" or not self.jump_hosts:
                continue
            front = self.hosts[index - 1] if host.name in self.jump_names else self.hosts[-1]
            self.netns_exec(host.name, ["iptables", "-A", "INPUT", "-p", "tcp", "--dport", "22",
                                        "-s", front.ip, "-j", "ACCEPT"])
            self.netns_exec(host.name, ["iptables", "-A", "INPUT", "-p", "tcp", "--dport", "22", "-j", "DROP"])

    def _write_state(self) -> None:
        data = {
            "prefix": self.prefix,
            "n": self.n,
            "jump_hosts": self.jump_hosts,
            "include_aliases": self.include_aliases,
            "subnet": str(self.subnet),
            "bridge": self.bridge,
            "workdir": str(self.workdir),
            "python": self.python,
            "private_dirs": list(self.private_dirs),
            "hosts": [dataclasses.asdict(host) for host in self.hosts],
            "netns_inodes": self._netns_inodes,
            "owner_pid": os.getpid(),
            "created": time.time(),
        }
        text = json.dumps(data, indent=2) + "\n"
        self.state_file.write_text(text)
        (self.state_dir / STATE_FILE).write_text(text)

    def _start_sshd(self, host: NodeInfo) -> None:
        sshd = _sshd_path()
        assert sshd is not None
        config = self._node_dir(host.name) / "sshd_config"
        keep = [(path, self._node_dir(host.name) / f"keep{index}") for index, path in enumerate(self.shared_paths)]
        for _, stash in keep:
            stash.mkdir(exist_ok=True)
        mounts = " && ".join(
            [f"mount --bind {shlex.quote(path)} {shlex.quote(str(stash))}" for path, stash in keep]
            + [
                f"mount -t tmpfs -o mode=1777,nosuid,nodev {shlex.quote(self.prefix + '-' + host.name)} {d}"
                for d in self.private_dirs
            ]
            + [f"mkdir -p {shlex.quote(path)} && mount --move {shlex.quote(str(stash))} {shlex.quote(path)}"
               for path, stash in keep]
            + self._private_copies(host)
            + self._login_shell(host)
            + self._container_mounts(host)
        )
        script = f"hostname {host.name} && {mounts + ' && ' if mounts else ''}exec {sshd} -D -e -f {config}"
        with open(self.log_dir / f"{host.name}-sshd.log", "ab") as log:
            self._sshd[host.name] = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    host.namespace,
                    "unshare",
                    "--uts",
                    "--mount",
                    "--pid",
                    "--fork",
                    "--kill-child",
                    "--mount-proc",
                    "--propagation",
                    "private",
                    "sh",
                    "-c",
                    script,
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )

    def _container_mounts(self, host: NodeInfo) -> list[str]:
        """With ``containers``: the node's podman configuration, storage and cgroup2 mount."""
        if not self.containers or host.name in self.jump_names:
            return []
        etc = self._node_dir(host.name) / "containers"
        etc.mkdir(exist_ok=True)
        root = self._node_dir(host.name)
        (etc / "containers.conf").write_text(
            "[containers]\ndefault_ulimits = []\ncgroups = \"disabled\"\n"
            "[engine]\nruntime = \"crun\"\ncgroup_manager = \"cgroupfs\"\nevents_logger = \"file\"\n"
            f"tmp_dir = \"{root}/libpod-tmp\"\n"
        )
        (etc / "storage.conf").write_text(
            f"[storage]\ndriver = \"vfs\"\ngraphroot = \"{root}/storage\"\nrunroot = \"{root}/runroot\"\n"
        )
        (etc / "policy.json").write_text('{"default": [{"type": "insecureAcceptAnything"}]}\n')
        (etc / "registries.conf").write_text("")
        return ["mount -t cgroup2 cgroup2 /sys/fs/cgroup",
                f"mkdir -p /etc/containers && mount --bind {shlex.quote(str(etc))} /etc/containers"]

    def load_image(self, name: str, archive: Path) -> str:
        """``podman load`` of a ``docker save`` archive on node ``name``; its image id."""
        done = self.ssh(name, f"podman load -q -i {shlex.quote(str(archive))} >/dev/null && "
                              f"podman image inspect --format '{{{{.Id}}}}' {IMAGE_TAG}", timeout=120)
        if done.returncode != 0:
            raise ClusterError(f"{name}: podman load failed: {done.stderr.strip()}")
        return done.stdout.strip()

    def containers_left(self) -> dict[str, str]:
        """Every container on any node, with its labels (the nodes' podman storage is this
        cluster's own: any is a leftover); nodes without one are left out."""
        left = {}
        for name in self.names:
            done = self.ssh(name, "podman ps -a --format '{{.Names}} {{.Labels}}'", timeout=60)
            assert done.returncode == 0, done.stderr
            if done.stdout.strip():
                left[name] = done.stdout.strip()
        return left

    def _login_shell(self, host: NodeInfo) -> list[str]:
        """A shell command that gives the node a ``~/.bashrc`` of its own (bound over the
        shared one in the node's mount namespace) that sets PATH and nothing else. bash
        reads ~/.bashrc for every command sshd starts, and this machine's runs ``pyenv
        init`` and ``pyenv virtualenv-init``: 145 ms of CPU a command (a plain sshd
        command costs 24 ms), paid by every SSH command of every test. A node's shell
        finds the same programs: ahead of sshd's PATH (its default, or the cluster's
        ``node_path``), this Python's directory and what the rc files put there (the
        PATH entries under the home directory: pyenv's, cargo's), as before."""
        bashrc = ROOT_BASHRC
        if not bashrc.is_file():
            return []
        own = self._node_dir(host.name) / "bashrc"
        home = str(bashrc.parent)
        ahead = [os.path.dirname(sys.executable)] + [
            entry for entry in os.environ.get("PATH", "").split(os.pathsep) if entry.startswith(home + "/")]
        own.write_text(f"# {host.name}'s own ~/.bashrc (tests/cluster/localcluster.py)\n"
                       f"export PATH={shlex.quote(os.pathsep.join(dict.fromkeys(ahead)))}:\"$PATH\"\n")
        return [f"mount --bind {shlex.quote(str(own))} {shlex.quote(str(bashrc))}"]

    def _private_copies(self, host: NodeInfo) -> list[str]:
        """Shell commands that give the node its own copy of each of PRIVATE_COPIES (a
        tmpfs over it, filled from the original), so a lock taken there is the node's."""
        commands = []
        for index, (path, lock) in enumerate((path, lock) for path, lock in PRIVATE_COPIES if path.is_dir()):
            stash = self._node_dir(host.name) / f"original{index}"
            stash.mkdir(exist_ok=True)
            original, copy = shlex.quote(str(stash)), shlex.quote(str(path))
            commands.append(f"mount --bind {copy} {original} && mount -t tmpfs -o mode=755 "
                            f"{shlex.quote(f'{self.prefix}-{host.name}-copy{index}')} {copy} && "
                            f"cp -a {original}/. {copy}/ && umount {original} && "
                            f"rm -f {shlex.quote(str(path / lock))}")
        return commands

    # ------------------------------------------------------------------ nodes

    def node(self, name: str) -> NodeInfo:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(
                f"no node {name!r} in {self!r} (nodes: {', '.join(self.names) or 'none'})"
            ) from None

    def _sshd_log_tail(self, name: str, lines: int = 10) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(
                (self.log_dir / f"{name}-sshd.log")
                .read_text(errors="replace")
                .splitlines()[-lines:]
            )
        return ""

    def wait_ready(
        self, names: Iterable[str] | None = None, timeout: float = 15.0
    ) -> None:
        """Wait until each node's sshd answers with its SSH banner (probed from inside
        its namespace, where no filter keeps the controller out)."""
        pending = {
            self.node(name) for name in (names if names is not None else self.names)
        }
        deadline = time.monotonic() + timeout
        while pending:
            for host in sorted(pending, key=lambda h: h.name):
                proc = self._sshd.get(host.name)
                if proc is not None and proc.poll() is not None:
                    raise ClusterError(
                        f"sshd of {host.name} exited with {proc.returncode}:\n{self._sshd_log_tail(host.name)}"
                    )
                if self._sshd_ready(host, proc):
                    pending.discard(host)
            if pending:
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"sshd not ready after {timeout:.0f}s on "
                        + ", ".join(sorted(h.name for h in pending))
                    )
                time.sleep(0.02)

    def _sshd_ready(self, host: NodeInfo, proc: subprocess.Popen[bytes] | None) -> bool:
        if not self.jump_hosts or host.name == "jump0":
            return _ssh_banner_ready(host.ip)
        # SSH from the controller is dropped here: ask the node's own TCP table instead.
        return proc is not None and _listening(proc.pid, 22)

    def ssh_argv(self, name: str, command: str, *extra_options: str) -> list[str]:
        """The OpenSSH client command line that runs ``command`` on node ``name``."""
        self.node(name)
        return ["ssh", "-F", str(self.ssh_config), *extra_options, name, command]

    def ssh(
        self,
        name: str,
        command: str,
        timeout: float = 60.0,
        *,
        input: str | None = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``command`` on node ``name`` with the plain OpenSSH client."""
        proc = subprocess.run(
            self.ssh_argv(name, command),
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
        )
        if check and proc.returncode != 0:
            raise ClusterError(
                f"ssh {name} {command!r} failed with {proc.returncode}: {proc.stderr.strip()}"
            )
        return proc

    def netns_exec(
        self,
        name: str,
        argv: Sequence[str],
        timeout: float = 30.0,
        *,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in node ``name``'s network namespace (e.g. iptables).

        Only the network (and ``/etc/hosts``) is the node's: the filesystem is the
        real one, not the node's private directories, and the process is not in
        the node's process table. Use :meth:`node_exec` for the full node view.
        """
        return _run(
            ["ip", "netns", "exec", self.node(name).namespace, *argv],
            check=check,
            timeout=timeout,
        )

    def node_exec(
        self,
        name: str,
        argv: Sequence[str],
        timeout: float = 30.0,
        *,
        check: bool = True,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside node ``name`` exactly as its sshd sees the world
        (network, hostname, private directories, process table), without SSH."""
        pid = self.sshd_pid(name)
        if pid is None:
            raise ClusterError(f"sshd of {name} is not running")
        return _run(
            [
                "nsenter",
                "--target",
                str(pid),
                "--mount",
                "--uts",
                "--net",
                "--pid",
                "--",
                *argv,
            ],
            check=check,
            timeout=timeout,
            input=input,
        )

    def node_pids(self, name: str) -> list[int]:
        """Host pids of every process in node ``name``'s network namespace."""
        return _netns_pids(self.node(name).namespace)

    def sshd_pid(self, name: str) -> int | None:
        """Host pid of node ``name``'s listening sshd (PID 1 of the node)."""
        config = f"{self._node_dir(name) / 'sshd_config'}"
        for pid in self.node_pids(name):
            cmd = _cmdline(pid) or ""
            if "sshd" in cmd and config in cmd and not cmd.startswith("unshare"):
                return pid
        return None

    def processes(self, name: str, *, include_sshd: bool = False) -> list[str]:
        """Command lines of the processes on node ``name``.

        Left out: the ``unshare`` wrapper, zombies and, unless ``include_sshd``,
        sshd itself (the listener and its per-connection ``sshd: ...``
        processes). What is left is what a job put there.
        """
        out = []
        for pid in self.node_pids(name):
            if not _alive(pid):
                continue
            cmd = _cmdline(pid)
            if not cmd:
                continue
            if cmd.startswith("unshare ") and str(self.state_dir) in cmd:
                continue
            if not include_sshd and (
                cmd.startswith(("sshd:", "sshd-session", "/usr/sbin/sshd"))
                or "/sshd_config" in cmd
            ):
                continue
            out.append(cmd)
        return out

    def wait_no_processes(self, name: str, timeout: float = 10.0) -> list[str]:
        """Poll :meth:`processes` until it is empty; return what is left then."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.processes(name)
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.05)

    def stop_sshd(self, name: str, timeout: float = 10.0) -> None:
        """Stop node ``name``'s sshd, which ends every process of the node.

        Kills what ``ip netns pids`` lists (sshd is the node's PID 1: its death
        kills the node's whole process table); never ``kill 1``.
        """
        left = _kill_and_wait(self.node_pids(name), timeout=timeout)
        proc = self._sshd.pop(name, None)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        if left:
            raise ClusterError(f"processes of {name} survived SIGKILL: {left}")

    def start_sshd(self, name: str, timeout: float = 15.0) -> None:
        """Start node ``name``'s sshd again (fresh private directories, like a reboot)."""
        if self.sshd_pid(name) is not None:
            return
        self._start_sshd(self.node(name))
        self.wait_ready([name], timeout=timeout)

    def cut_network(self, name: str) -> None:
        """Unplug node ``name``: its veth goes down on the bridge side."""
        index = self.hosts.index(self.node(name))
        _run(["ip", "link", "set", veth_name(self.prefix, index), "down"])

    def restore_network(self, name: str) -> None:
        """Plug node ``name`` back in."""
        index = self.hosts.index(self.node(name))
        _run(["ip", "link", "set", veth_name(self.prefix, index), "up"])

    def write_file(
        self, name: str, path: str, content: str, mode: int | None = None
    ) -> None:
        """Write ``content`` to ``path`` as node ``name`` sees its filesystem
        (through SSH, so a path in the node's private ``/tmp`` lands there)."""
        quoted = shlex.quote(path)
        command = f'mkdir -p -- "$(dirname -- {quoted})" && cat > {quoted}'
        if mode is not None:
            command += f" && chmod {mode:o} {quoted}"
        self.ssh(name, command, input=content, check=True)

    def read_file(self, name: str, path: str) -> str:
        """The content of ``path`` as node ``name`` sees its filesystem."""
        return self.ssh(name, f"cat -- {shlex.quote(path)}", check=True).stdout

    def env(self) -> dict[str, str]:
        """``os.environ`` plus ``TORCHHERD_INVENTORY`` pointing at this cluster."""
        return {**os.environ, "TORCHHERD_INVENTORY": str(self.inventory)}
