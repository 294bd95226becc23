"""known_hosts as OpenSSH keeps it: what a host's presented key means.

A line is ``[@marker] hosts keytype base64 [comment]``. ``hosts`` is a comma list of
patterns (``*``, ``?``, ``!`` negation, ``[host]:port``) or one hashed name
(``|1|salt|hmac``). ``@revoked`` keys are refused wherever they turn up;
``@cert-authority`` lines trust a CA for host certificates.

``HostKeys.verdict`` decides, as OpenSSH's ``check_key_in_hostkeys`` does, with two
refusals more: a key of a type not on record while another type is (OpenSSH would
offer to accept it as new), and a host pinned only through a CA (paramiko cannot
verify host certificates). The caller turns a verdict into a connection or an error.

Standard library only: keys are compared as their wire-format blobs.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Sequence

from torchherd.transport.sshlines import match_hostname

HASH_MAGIC = "|1|"
MARKERS = {"@cert-authority": "cert-authority", "@revoked": "revoked"}
_append_lock = threading.Lock()


@dataclass(frozen=True)
class KnownKey:
    """One usable line of a known_hosts file."""

    path: str
    line: int
    marker: str
    """``""``, ``"cert-authority"`` or ``"revoked"``."""
    hosts: str
    blob: bytes

    @property
    def key_type(self) -> str:
        return key_type_of(self.blob)

    @property
    def fingerprint(self) -> str:
        """As ``ssh-keygen -l`` shows it: ``SHA256:`` and the unpadded base64 digest."""
        return "SHA256:" + base64.b64encode(hashlib.sha256(self.blob).digest()).decode().rstrip("=")

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    def matches(self, name: str) -> bool:
        """Whether this line speaks of ``name`` (``host`` or ``[host]:port``, lowercase)."""
        if self.hosts.startswith(HASH_MAGIC):
            return hashed_matches(self.hosts, name)
        if not any(char in self.hosts for char in "*?!"):  # plain names: the glob is equality
            return name.lower() in self.hosts.lower().split(",")
        return match_hostname(name, self.hosts) == 1


def key_type_of(blob: bytes) -> str:
    """The key type named at the start of a public key's wire format."""
    if len(blob) < 4:
        return ""
    length = int.from_bytes(blob[:4], "big")
    return blob[4:4 + length].decode("ascii", "replace")


def hash_name(name: str, salt: bytes) -> str:
    """``|1|salt|hmac``: how ``HashKnownHosts yes`` records a name."""
    digest = hmac.new(salt, name.encode(), hashlib.sha1).digest()
    return f"{HASH_MAGIC}{base64.b64encode(salt).decode()}|{base64.b64encode(digest).decode()}"


def hashed_matches(field: str, name: str) -> bool:
    parts = field[len(HASH_MAGIC):].split("|")
    if len(parts) != 2:
        return False
    try:
        salt, expected = base64.b64decode(parts[0], validate=True), base64.b64decode(parts[1], validate=True)
    except (binascii.Error, ValueError):
        return False
    return hmac.compare_digest(hmac.new(salt, name.encode(), hashlib.sha1).digest(), expected)


def host_key_name(hostname: str, port: int) -> str:
    """The name a host is recorded under: ``host``, or ``[host]:port`` off port 22."""
    return hostname.lower() if port == 22 else f"[{hostname.lower()}]:{port}"


def parse(text: str, path: str) -> tuple[KnownKey, ...]:
    """The usable lines; others are skipped, as OpenSSH skips them."""
    keys = []
    for number, raw in enumerate(text.splitlines(), start=1):
        fields = raw.split()
        if not fields or fields[0].startswith("#"):
            continue
        marker = ""
        if fields[0].startswith("@"):
            if fields[0] not in MARKERS:
                continue
            marker = MARKERS[fields[0]]
            fields = fields[1:]
        if len(fields) < 3:
            continue
        try:
            blob = base64.b64decode(fields[2], validate=True)
        except (binascii.Error, ValueError):
            continue
        if key_type_of(blob) != fields[1]:
            continue
        keys.append(KnownKey(path, number, marker, fields[0], blob))
    return tuple(keys)


def load(paths: Iterable[str]) -> tuple[KnownKey, ...]:
    """Every line of every file that exists, in order (a missing file is no error). The
    same tuple while the files stay unchanged: ``for_name`` keeps its index by it."""
    found: list[tuple[str, tuple[int, int]]] = []
    for path in paths:
        try:
            status = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            continue
        found.append((path, (status.st_mtime_ns, status.st_size)))
    return _joined(tuple(found))


@lru_cache(maxsize=64)
def _joined(files: tuple[tuple[str, tuple[int, int]], ...]) -> tuple[KnownKey, ...]:
    keys: list[KnownKey] = []
    for path, stamp in files:
        keys.extend(_parsed_file(path, stamp))
    return tuple(keys)


@lru_cache(maxsize=64)
def _parsed_file(path: str, stamp: tuple[int, int]) -> tuple[KnownKey, ...]:
    """A file parsed once while it stays unchanged: every node's connection loads the same
    files, and at 256 nodes parsing them anew each time cost several ms per node. A key
    recorded since (accept-new) changes the stamp."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return parse(handle.read(), path)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return ()


@dataclass(frozen=True)
class Verdict:
    kind: str
    """``known`` (on record), ``revoked``, ``changed`` (another key of this type is on
    record), ``other-type`` (only keys of other types are), ``cert-authority`` (only a CA
    vouches for this host) or ``unknown``."""
    entry: KnownKey | None = None
    """The line behind the verdict: the key that matched, was revoked, or differs."""
    revoked_by: str = ""
    """For ``revoked-file``: the ``RevokedHostKeys`` file that lists the key."""


@dataclass(frozen=True)
class HostKeys:
    """Everything known_hosts says about one name."""

    name: str
    keys: tuple[KnownKey, ...]
    """Plain keys on record for the name, revoked ones left out."""
    revoked: tuple[KnownKey, ...]
    authorities: tuple[KnownKey, ...]

    def verdict(self, blob: bytes) -> Verdict:
        for entry in self.revoked:
            if entry.blob == blob:
                return Verdict("revoked", entry)
        kind = key_type_of(blob)
        same_type = [entry for entry in self.keys if entry.key_type == kind]
        for entry in same_type:
            if entry.blob == blob:
                return Verdict("known", entry)
        if same_type:
            return Verdict("changed", same_type[0])
        if self.keys:
            return Verdict("other-type", self.keys[0])
        if self.authorities:
            return Verdict("cert-authority", self.authorities[0])
        return Verdict("unknown")


def for_name(entries: Sequence[KnownKey], name: str) -> HostKeys:
    matching = _matching(entries, name)
    revoked = tuple(entry for entry in matching if entry.marker == "revoked")
    revoked_blobs = {entry.blob for entry in revoked}
    return HostKeys(
        name=name,
        keys=tuple(entry for entry in matching if not entry.marker and entry.blob not in revoked_blobs),
        revoked=revoked,
        authorities=tuple(entry for entry in matching if entry.marker == "cert-authority"),
    )


def _matching(entries: Sequence[KnownKey], name: str) -> list[KnownKey]:
    """The lines that speak of ``name``, in file order. Every node looked at every line,
    O(nodes^2) with a known_hosts holding them all (a cluster's is): a tuple's plain names
    are indexed once, and only hashed and patterned lines are tried one by one."""
    if not isinstance(entries, tuple):
        return [entry for entry in entries if entry.matches(name)]
    plain, other = _index(entries)
    positions = plain.get(name.lower(), []) + [position for position in other if entries[position].matches(name)]
    return [entries[position] for position in sorted(positions)]


_INDEXES: dict[int, tuple[tuple[KnownKey, ...], dict[str, list[int]], list[int]]] = {}
"""By the id of a ``load`` tuple (kept alive in the value, so the id stays its own)."""


def _index(entries: tuple[KnownKey, ...]) -> tuple[dict[str, list[int]], list[int]]:
    """Positions of the plain lines by name (lowercase), and of every other line."""
    known = _INDEXES.get(id(entries))
    if known is not None and known[0] is entries:
        return known[1], known[2]
    plain: dict[str, list[int]] = {}
    other: list[int] = []
    for position, entry in enumerate(entries):
        if entry.hosts.startswith(HASH_MAGIC) or any(char in entry.hosts for char in "*?!"):
            other.append(position)
            continue
        for host in dict.fromkeys(entry.hosts.lower().split(",")):
            plain.setdefault(host, []).append(position)
    if len(_INDEXES) >= 16:  # a few files' states per run; never grows without bound
        _INDEXES.clear()
    _INDEXES[id(entries)] = (entries, plain, other)
    return plain, other


def entry_line(name: str, blob: bytes, hashed: bool, salt: bytes | None = None) -> str:
    """The line that records ``blob`` for ``name`` (hashed with a fresh salt when asked)."""
    written = hash_name(name, salt if salt is not None else os.urandom(20)) if hashed else name
    return f"{written} {key_type_of(blob)} {base64.b64encode(blob).decode()}\n"


def append(path: str, line: str, home: str) -> None:
    """Adds a line to a known_hosts file. A missing ``~/.ssh`` is created 0700, as OpenSSH
    does (no other missing directory is). Appends from threads of one process never interleave.
    Raises OSError when the file cannot be written."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent) and parent == os.path.abspath(os.path.join(home, ".ssh")):
        os.makedirs(parent, mode=0o700, exist_ok=True)
        os.chmod(parent, 0o700)
    with _append_lock:
        needs_newline = False
        if os.path.exists(path) and os.path.getsize(path) > 0:
            with open(path, "rb") as handle:
                handle.seek(-1, os.SEEK_END)
                needs_newline = handle.read(1) != b"\n"
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(("\n" if needs_newline else "") + line)


# ---------------------------------------------------------------- RevokedHostKeys

KRL_MAGIC = b"SSHKRL\n\0"
KRL_EXPLICIT_KEY, KRL_SHA1, KRL_SIGNATURE, KRL_SHA256, KRL_EXTENSION = 2, 3, 4, 5, 255
KRL_CERTIFICATES = 1


class RevokedKeysError(ValueError):
    """A ``RevokedHostKeys`` file that cannot be read: OpenSSH then refuses the connection."""


@dataclass(frozen=True)
class RevokedKeys:
    """One ``RevokedHostKeys`` file: a KRL (``ssh-keygen -k``) or public keys, one a line."""

    path: str
    blobs: frozenset[bytes]
    sha1: frozenset[bytes] = frozenset()
    sha256: frozenset[bytes] = frozenset()

    def revokes(self, blob: bytes) -> bool:
        return (blob in self.blobs or hashlib.sha1(blob).digest() in self.sha1
                or hashlib.sha256(blob).digest() in self.sha256)


def load_revoked(path: str) -> RevokedKeys:
    """The keys a ``RevokedHostKeys`` file revokes; RevokedKeysError when it cannot be read
    (missing, unreadable, or not a KRL nor a list of keys), as OpenSSH's ``sshkey_check_revoked``."""
    try:
        status = os.stat(path)
        return _revoked_file(path, (status.st_mtime_ns, status.st_size))
    except OSError as error:
        raise RevokedKeysError(f"{path}: {error.strerror or error}") from None


@lru_cache(maxsize=16)
def _revoked_file(path: str, stamp: tuple[int, int]) -> RevokedKeys:
    with open(path, "rb") as handle:
        data = handle.read()
    if data.startswith(KRL_MAGIC):
        return _parse_krl(data, path)
    return _parse_key_list(data, path)


def _parse_key_list(data: bytes, path: str) -> RevokedKeys:
    blobs = set()
    for number, raw in enumerate(data.decode("utf-8", "replace").splitlines(), start=1):
        fields = raw.split()
        if not fields or fields[0].startswith("#"):
            continue
        # As sshkey_read: a line that is no public key makes the whole file unusable.
        try:
            blob = base64.b64decode(fields[1], validate=True) if len(fields) > 1 else b""
        except (binascii.Error, ValueError):
            blob = b""
        if not blob or key_type_of(blob) != fields[0]:
            raise RevokedKeysError(f"{path} line {number}: not a public key")
        blobs.add(blob)
    return RevokedKeys(path, frozenset(blobs))


class _Reader:
    """SSH wire format: uint32/uint64 big-endian, strings with a uint32 length."""

    def __init__(self, data: bytes, path: str) -> None:
        self.data, self.offset, self.path = data, 0, path

    def take(self, size: int) -> bytes:
        if self.offset + size > len(self.data):
            raise RevokedKeysError(f"{self.path}: truncated KRL")
        chunk = self.data[self.offset:self.offset + size]
        self.offset += size
        return chunk

    def integer(self, size: int) -> int:
        return int.from_bytes(self.take(size), "big")

    def string(self) -> bytes:
        return self.take(self.integer(4))

    def done(self) -> bool:
        return self.offset >= len(self.data)


def _parse_krl(data: bytes, path: str) -> RevokedKeys:
    """PROTOCOL.krl: the plain-key sections (explicit keys, SHA1 and SHA256 fingerprints);
    certificate sections are skipped (torchherd verifies no host certificates), a signature
    or a critical extension refuses the file (OpenSSH 9.4 and later refuse KRL signatures)."""
    reader = _Reader(data, path)
    reader.take(len(KRL_MAGIC))
    if reader.integer(4) != 1:
        raise RevokedKeysError(f"{path}: unsupported KRL format version")
    reader.take(8 + 8 + 8)  # krl_version, generated_date, flags
    reader.string(), reader.string()  # reserved, comment
    found: dict[int, set[bytes]] = {KRL_EXPLICIT_KEY: set(), KRL_SHA1: set(), KRL_SHA256: set()}
    while not reader.done():
        kind, section = reader.integer(1), _Reader(reader.string(), path)
        if kind in found:
            while not section.done():
                found[kind].add(section.string())
        elif kind == KRL_EXTENSION:
            section.string()
            if section.integer(1):
                raise RevokedKeysError(f"{path}: a critical KRL extension torchherd does not know")
        elif kind != KRL_CERTIFICATES:
            raise RevokedKeysError(f"{path}: KRL section {kind} is not supported" +
                                   (" (a signature)" if kind == KRL_SIGNATURE else ""))
    return RevokedKeys(path, frozenset(found[KRL_EXPLICIT_KEY]), frozenset(found[KRL_SHA1]),
                       frozenset(found[KRL_SHA256]))
