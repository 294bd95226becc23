"""The lock's wheels for nodes without an index (``--uv-offline``; `torchherd docs
environments`, "Nodes without internet"): what this machine exports and downloads once per
node platform (``engine.offline`` runs it), the markers judged for the nodes, and how a node
builds its venv from them with no network (``remote/venv.py``, given a ``wheelhouse``).

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

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import InvalidMarker, Marker, UndefinedComparison, UndefinedEnvironmentName

from torchherd.engine.uvwheels import NodePlatform
from torchherd.remote.checkpoint import file_sha256

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
    marker: str = ""
    """Its environment marker (``platform_machine == 'x86_64'``), "": on every node."""


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
        head, _, marker = line.split(" --hash", 1)[0].partition(";")
        head, marker = head.strip(), marker.strip()
        pinned = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;]+)\Z", head)
        if pinned is not None:
            found.append(Requirement(pinned.group(1).lower(), pinned.group(2), hashes, marker=marker))
        else:
            found.append(Requirement("", "", hashes, direct=head, marker=marker))
    return found


def download_argv(python: str, requirements: str, dest: str, node: NodePlatform, python_version: str) -> list[str]:
    """pip's download of exactly the lock's files for ``node`` (its machine, libc and the
    python the venv is built with): binaries only, each checked against the lock's hashes."""
    major_minor = ".".join(python_version.split(".")[:2])
    return [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
            "--progress-bar", "off", "--platform", node.download_tag(), "--python-version", major_minor, "--implementation", "cp",
            "-r", requirements, "-d", dest]


FETCHING = re.compile(r"^\s*(Downloading|Using cached) (\S+)(?: \(([^()]*)\))?\s*$")
"""pip's line as it begins a file (``pip/_internal/network/download.py``): the URL (its
credentials already redacted by pip) or, from PyPI, the file's name, and its size when known."""


def pip_fetching(line: str) -> tuple[str, str, bool] | None:
    """The file a line of pip's output says it begins: its name, its size as pip says it
    ("" when the server gave none) and whether it comes from pip's own cache; None for
    any other line."""
    match = FETCHING.match(line)
    if match is None:
        return None
    url = match.group(2).split("#", 1)[0].split("?", 1)[0]
    return url.rstrip("/").rsplit("/", 1)[-1], match.group(3) or "", match.group(1) == "Using cached"


def dir_hashes(directory: Path) -> set[str]:
    """The SHA-256 of every wheel in ``directory`` (read a block at a time: torch's is GBs)."""
    return {file_sha256(str(wheel)) for wheel in sorted(directory.glob("*.whl"))}


def missing(requirements: Iterable[Requirement], have: set[str]) -> list[str]:
    """The pinned requirements no file of ``have`` satisfies (by hash), as ``name==version``:
    an empty list means the wheelhouse is complete and no download is needed."""
    return [f"{item.name}=={item.version}" for item in requirements
            if not item.direct and not (set(item.hashes) & have)]


def wanted(requirements: Iterable[Requirement], environment: Mapping[str, str]) -> list[Requirement]:
    """The pinned requirements a node of ``environment`` (``marker_environment``) installs:
    those whose marker holds there (uv leaves the others out on that node)."""
    return [item for item in requirements if not item.direct and applies(item.marker, environment)]


def platforms(nodes: Sequence[tuple[str, NodePlatform, str]]) -> dict[tuple[str, str], list[str]]:
    """Nodes grouped by what their wheels depend on: (download tag, python major.minor) ->
    node names. One download per group, whatever the number of nodes."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name, node, python_version in nodes:
        key = (node.download_tag(), ".".join(python_version.split(".")[:2]))
        groups.setdefault(key, []).append(name)
    return groups


def cache_name(lock_hash: str, node: NodePlatform, python_version: str) -> str:
    """This machine's wheelhouse for one lock, node platform and python:
    ``<lock hash>-<download tag>-<major.minor>`` (under ``~/.cache/torchherd/wheelhouse``)."""
    return f"{lock_hash[:16]}-{node.download_tag()}-{major_minor(python_version)}"


def node_dir(venv_path: str, key: str) -> str:
    """Where a node receives the wheelhouse for its venv: beside its venvs (as local, or as
    shared, as they are), named by the venv's key (one lock, python and kind)."""
    parent = venv_path.rstrip("/").rsplit("/", 1)[0] if "/" in venv_path.rstrip("/") else "."
    return f"{parent}/wheelhouse-{key}"


def major_minor(python_version: str) -> str:
    return ".".join(python_version.split(".")[:2])


def marker_environment(node: NodePlatform, python_version: str) -> dict[str, str]:
    """PEP 508's marker variables for a node, from what its venv builder reported."""
    return {"platform_machine": node.machine, "sys_platform": node.system.lower(), "platform_system": node.system,
            "os_name": "posix", "python_version": major_minor(python_version),
            "python_full_version": python_version, "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "extra": ""}


UNREPORTED = re.compile(r"\b(platform_version|platform_release|implementation_version)\b")
"""Marker variables a node's venv builder does not report: a marker naming one counts as
true (this machine's values would say nothing of the node's)."""


def applies(marker: str, environment: Mapping[str, str]) -> bool:
    """Whether ``marker`` (PEP 508, judged by ``packaging`` as pip and uv judge it) holds in
    ``environment``. A marker that cannot be read, or that names a variable the node did not
    report, counts as true: a wheel fetched that is not needed costs a download; one left
    out would fail the node's build."""
    if not marker or UNREPORTED.search(marker):
        return True
    try:
        return Marker(marker).evaluate(dict(environment))
    except (InvalidMarker, UndefinedComparison, UndefinedEnvironmentName):
        return True


NO_NETWORK = ("failed to fetch", "dns error", "could not connect", "connection refused", "network is unreachable",
              "no route to host", "name or service not known", "temporary failure in name resolution",
              "offline mode", "network connectivity is disabled", "error sending request", "connect error",
              "operation timed out")
"""What uv says when it cannot reach an index (or is offline and misses its cache)."""


def looks_offline(message: str) -> bool:
    """Whether a failed ``uv sync`` looks like a node without a package index."""
    lowered = message.lower()
    return any(words in lowered for words in NO_NETWORK)


def requirement_lines(requirements: Iterable[Requirement], names: Iterable[str]) -> str:
    """The requirements named (``name==version``) as a requirements file without markers:
    what ``pip download --platform`` fetches (pip judges markers for this machine, not the
    nodes'; they were judged for the nodes already)."""
    wanted = set(names)
    lines = [f"{item.name}=={item.version} " + " ".join(f"--hash=sha256:{digest}" for digest in item.hashes)
             for item in requirements if f"{item.name}=={item.version}" in wanted]
    return "".join(line.rstrip() + "\n" for line in lines)


def wheel_name(filename: str) -> tuple[str, str] | None:
    """A wheel file's (normalized name, version), or None for another file."""
    match = re.match(r"([^-]+)-([^-]+)-.+\.whl\Z", filename)
    if match is None:
        return None
    return re.sub(r"[-_.]+", "-", match.group(1)).lower(), match.group(2)


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
