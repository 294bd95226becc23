"""The lock's wheels for nodes without an index (design: `torchherd docs environments`, "Nodes
without internet"): what this machine exports and downloads once per node platform, and
how a node builds its venv from them with no network (``remote/venv.py``, given a
``wheelhouse``).

``uv sync --frozen`` installs a registry package from the URL in ``uv.lock`` and ignores
``--find-links`` for it (tried with uv 0.13: offline it fails on the cache miss of that
URL; astral-sh/uv#9277). So the lock becomes a hashed requirements file (``uv export``),
the wheels are fetched for the nodes' platform (``pip download --platform``), and a node
installs exactly those files (``uv pip sync --offline --no-index --find-links DIR
--require-hashes``): the same names, versions and hashes as the lock, which the ``venv``
check (``uv sync --frozen --offline --check``) then finds in sync.

Pure but ``dir_hashes`` (which reads the wheel files).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from torchherd.engine.uvwheels import NodePlatform

REQUIREMENTS = "requirements.txt"
"""In a wheelhouse directory: the lock exported as hashed requirements."""


@dataclass(frozen=True)
class Requirement:
    """One pinned line of ``uv export``: ``name==version`` with its allowed hashes, or a
    direct reference (a path or URL: a wheel of the project's own, sent by ``--sync``)."""

    name: str
    version: str
    hashes: tuple[str, ...]
    direct: str = ""


def export_argv(uv: str) -> list[str]:
    """The lock as hashed requirements (run in the project, on this machine: no network)."""
    return [uv, "export", "--frozen", "--format", "requirements-txt", "--no-emit-project", "--no-header"]


def parse_requirements(text: str) -> list[Requirement]:
    """``uv export``'s requirements: continuation lines joined, comments and markers kept
    out of the name (a marker line is kept: pip and uv judge it per node)."""
    joined = re.sub(r"\\\n\s*", " ", text)
    found: list[Requirement] = []
    for line in joined.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        hashes = tuple(re.findall(r"--hash=sha256:([0-9a-f]{64})", line))
        head = line.split(" --hash", 1)[0].split(";", 1)[0].strip()
        pinned = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;]+)\Z", head)
        if pinned is not None:
            found.append(Requirement(pinned.group(1).lower(), pinned.group(2), hashes))
        else:
            found.append(Requirement("", "", hashes, direct=head))
    return found


def download_argv(python: str, requirements: str, dest: str, node: NodePlatform, python_version: str) -> list[str]:
    """pip's download of exactly the lock's files for ``node`` (its machine, libc and the
    python the venv is built with): binaries only, each checked against the lock's hashes."""
    major_minor = ".".join(python_version.split(".")[:2])
    return [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
            "--platform", node.download_tag(), "--python-version", major_minor, "--implementation", "cp",
            "-r", requirements, "-d", dest]


def dir_hashes(directory: Path) -> set[str]:
    """The SHA-256 of every wheel in ``directory``."""
    found = set()
    for wheel in sorted(directory.glob("*.whl")):
        found.add(hashlib.sha256(wheel.read_bytes()).hexdigest())
    return found


def missing(requirements: Iterable[Requirement], have: set[str]) -> list[str]:
    """The pinned requirements no file of ``have`` satisfies (by hash), as ``name==version``:
    an empty list means the wheelhouse is complete and no download is needed."""
    return [f"{item.name}=={item.version}" for item in requirements
            if not item.direct and not (set(item.hashes) & have)]


def platforms(nodes: Sequence[tuple[str, NodePlatform, str]]) -> dict[tuple[str, str], list[str]]:
    """Nodes grouped by what their wheels depend on: (download tag, python major.minor) ->
    node names. One download per group, whatever the number of nodes."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name, node, python_version in nodes:
        key = (node.download_tag(), ".".join(python_version.split(".")[:2]))
        groups.setdefault(key, []).append(name)
    return groups
