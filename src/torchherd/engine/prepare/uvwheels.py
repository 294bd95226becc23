"""The ``uv`` binary for a node of another platform than this machine's: taken out of
the ``uv`` wheel for that node's platform, found in a local wheel directory.

uv is published on PyPI as wheels that hold nothing but its binary
(``uv-<version>.data/scripts/uv``), one per platform: ``manylinux_2_17_x86_64``,
``manylinux_2_28_aarch64``, ``musllinux_1_1_aarch64``, ... A node's platform is what the
venv builder reports (``uname -m``, and glibc with its version or musl). The wheels are
looked for in ``[uv].wheels`` (else ``~/.cache/torchherd/wheels``) and in pip's own wheel
cache; nothing is downloaded here (the fix names the ``pip download`` that fills the
directory). The binary is extracted once, under its hash, beside the wheels' cache.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import tempfile
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_WHEELS = "~/.cache/torchherd/wheels"
"""Where wheels are looked for when ``[uv].wheels`` says nothing."""

WHEEL = re.compile(r"(?P<name>[^-]+)-(?P<version>[^-]+)(?:-(?P<build>\d[^-]*))?-(?P<python>[^-]+)-(?P<abi>[^-]+)-"
                   r"(?P<platform>[^-]+)\.whl\Z")
GLIBC_TAG = re.compile(r"manylinux_(?P<major>\d+)_(?P<minor>\d+)_(?P<arch>.+)\Z")
MUSL_TAG = re.compile(r"musllinux_(?P<major>\d+)_(?P<minor>\d+)_(?P<arch>.+)\Z")
LEGACY_GLIBC = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
"""PEP 513/571/599 tags and the glibc each stands for (PEP 600)."""
MUSL_UNKNOWN = (1, 1)
"""A musl whose version could not be read: the oldest uv has ever been built for."""


@dataclass(frozen=True)
class NodePlatform:
    """What a node runs binaries for, as its venv builder reported it."""

    system: str
    """``platform.system()``: "Linux" (uv's wheels for other systems are not for nodes)."""
    machine: str
    """``uname -m``: x86_64, aarch64, armv7l, ppc64le, s390x, i686."""
    libc: str
    """"glibc", "musl", or "" (neither found)."""
    libc_version: str = ""
    """"2.36" (glibc), "1.2.4" (musl), or "" (not known)."""

    def describe(self) -> str:
        libc = f"{self.libc} {self.libc_version}".strip() or "no known libc"
        return f"{self.system} {self.machine} {libc}"

    def version(self) -> tuple[int, int] | None:
        numbers = re.findall(r"\d+", self.libc_version)
        return (int(numbers[0]), int(numbers[1])) if len(numbers) >= 2 else None

    def download_tag(self) -> str:
        """The tag ``pip download --platform`` takes for this node: pip reads a
        ``manylinux_2_X`` as "glibc 2.X or older", so the node's own glibc picks any wheel
        that runs there; musl: the ``musllinux_1_1`` that uv is built for."""
        machine = "aarch64" if self.machine == "arm64" else self.machine
        if self.libc == "musl":
            return f"musllinux_1_1_{machine}"
        version = self.version() or (2, 17)
        return f"manylinux_{version[0]}_{version[1]}_{machine}"


class MalformedAnswer(Exception):
    """A node's platform answer that is not one a venv builder gives: it names files and
    directories on this machine (the wheelhouse's cache, engine/offline.py), so a value
    outside these shapes fails that node rather than become a path."""


REPORTED = {"system": "Linux", "machine": "[A-Za-z0-9_]{1,32}", "libc": "(glibc|musl)?",
            "libc_version": "([0-9]{1,9}(\\.[0-9]{1,9}){0,2})?", "python": "[0-9]{1,9}\\.[0-9]{1,9}\\.[0-9]{1,9}"}
"""What each reported field may be, in full (``system``: Linux, the only one uv's node
wheels and torchherd's node programs are for; ASCII digits only)."""


def reported(answer: Mapping[str, Any], field: str) -> str:
    """The node's ``field`` when it has its shape (``REPORTED``); else MalformedAnswer
    naming the field, not its value (a hostile value is not printed)."""
    value = answer.get(field, "")
    if not isinstance(value, str) or re.fullmatch(REPORTED[field], value) is None:
        raise MalformedAnswer(f"the venv builder's answer is malformed: its {field} is not {REPORTED[field]}")
    return value


def reported_platform(answer: Mapping[str, Any]) -> NodePlatform:
    """The platform a node's venv builder reported, each field checked (``reported``)."""
    return NodePlatform(*(reported(answer, field) for field in ("system", "machine", "libc", "libc_version")))


@dataclass(frozen=True)
class UvWheel:
    path: Path
    version: tuple[int, ...]
    libc: tuple[int, int]
    """The newest libc among its tags that the node has (the more specific build wins a tie)."""


def tag_fits(tag: str, node: NodePlatform) -> tuple[int, int] | None:
    """The libc version ``tag`` needs when the node can run it, else None."""
    if node.system != "Linux":
        return None
    machine = "aarch64" if node.machine == "arm64" else node.machine
    legacy = re.match(r"(manylinux1|manylinux2010|manylinux2014)_(?P<arch>.+)\Z", tag)
    if legacy is not None:
        needed, arch, kind = LEGACY_GLIBC[legacy.group(1)], legacy.group("arch"), "glibc"
    else:
        match = GLIBC_TAG.match(tag) or MUSL_TAG.match(tag)
        if match is None:
            return None
        needed = (int(match.group("major")), int(match.group("minor")))
        arch, kind = match.group("arch"), "glibc" if tag.startswith("manylinux") else "musl"
    if arch != machine or kind != node.libc:
        return None
    has = node.version() or (MUSL_UNKNOWN if kind == "musl" else None)
    if has is None or needed > has:
        return None
    return needed


def parse_wheel(path: Path, node: NodePlatform) -> UvWheel | None:
    """``path`` when it is a ``uv`` wheel the node can run."""
    match = WHEEL.match(path.name)
    if match is None or match.group("name").lower() != "uv":
        return None
    fits = [needed for tag in match.group("platform").split(".") if (needed := tag_fits(tag, node)) is not None]
    if not fits:
        return None
    return UvWheel(path, tuple(int(part) for part in re.findall(r"\d+", match.group("version"))), max(fits))


def wheel_dirs(configured: str | None) -> list[Path]:
    """Where uv wheels are looked for: ``[uv].wheels`` (else the default), then pip's cache."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    pip = Path(os.environ["PIP_CACHE_DIR"]) if os.environ.get("PIP_CACHE_DIR") else cache / "pip"
    return [Path(configured or DEFAULT_WHEELS).expanduser(), pip / "wheels"]


def find_wheel(dirs: Sequence[Path], node: NodePlatform) -> UvWheel | None:
    """The newest ``uv`` wheel in ``dirs`` (pip's cache: at any depth) that runs on ``node``."""
    found = [wheel for wheel in map(lambda path: parse_wheel(path, node), _candidates(dirs)) if wheel is not None]
    return max(found, key=lambda wheel: (wheel.version, wheel.libc), default=None)


def _candidates(dirs: Sequence[Path]) -> Iterable[Path]:
    for index, directory in enumerate(dirs):
        try:
            yield from (directory.glob("uv-*.whl") if index == 0 else directory.rglob("uv-*.whl"))
        except OSError:
            continue


class WheelError(Exception):
    """A wheel that holds no uv binary, or one that cannot be read."""


def extract_uv(wheel: Path, into: Path) -> tuple[Path, str]:
    """The wheel's ``uv`` binary, written once under its hash in ``into`` (0700, atomically);
    its path and SHA-256. Raises WheelError."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            names = [name for name in archive.namelist() if re.fullmatch(r"[^/]+\.data/scripts/uv", name)]
            if len(names) != 1:
                raise WheelError(f"{wheel.name} holds no uv binary (no *.data/scripts/uv)")
            data = archive.read(names[0])
    except (OSError, zipfile.BadZipFile) as error:
        raise WheelError(f"{wheel}: not a readable wheel ({error})") from None
    if data[:4] != b"\x7fELF":
        raise WheelError(f"{wheel.name}: its uv is not a Linux binary")
    digest = hashlib.sha256(data).hexdigest()
    final = into / f"uv-{digest[:16]}"
    if not _is_extracted(final, digest):
        # The directory private (0700), the binary written under a name no one guessed and
        # renamed over one that was not this very binary (changed, or not the user's).
        into.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(prefix=f".uv-{digest[:16]}.", dir=into)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            os.chmod(partial, 0o700)
            os.replace(partial, final)
        except BaseException:
            os.unlink(partial)
            raise
    return final, digest


def _is_extracted(final: Path, digest: str) -> bool:
    """Whether ``final`` is the user's own file (not a link) holding the binary of ``digest``:
    a uv taken out earlier is reused by its hash, never by its name alone."""
    try:
        info = final.lstat()
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
            return False
        return hashlib.sha256(final.read_bytes()).hexdigest() == digest
    except OSError:
        return False


def missing_wheel(node_name: str, node: NodePlatform, configured: str | None) -> str:
    """One line: the node, its platform, and the download that fixes it."""
    directory = configured or DEFAULT_WHEELS
    where = "" if configured else f" and set [uv] wheels = \"{directory}\" or leave it there (the default)"
    return (f"{node_name} is {node.describe()} and no uv wheel for it is in {directory} or pip's cache: "
            f"pip download uv --no-deps --only-binary=:all: --platform {node.download_tag()} -d {directory}"
            f"{where}")
