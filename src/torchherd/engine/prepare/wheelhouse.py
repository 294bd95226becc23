"""The lock's wheels for nodes without an index (``--uv-offline``; `torchherd docs
environments`, "Nodes without internet"): what this machine exports and downloads once per
node platform (``engine.prepare.offline`` runs it), the markers judged for the nodes, and how a node
builds its venv from them with no network (``remote/venv.py``, given a ``wheelhouse``).

``uv sync --frozen`` installs a registry package from the URL in ``uv.lock`` and ignores
``--find-links`` for it (tried with uv 0.13: offline it fails on the cache miss of that
URL; astral-sh/uv#9277). So the lock becomes a hashed requirements file (``uv export``),
the wheels are fetched for the nodes' platform (``pip download --platform``), and a node
installs exactly those files (``uv pip sync --offline --no-index --find-links DIR
--require-hashes``): the same names, versions and hashes as the lock, which the ``venv``
check (``uv sync --frozen --offline --check``) then finds in sync.

The export leaves the project out (``--no-emit-project``): ``uv sync`` installs a package
project (one with a ``[build-system]``, or ``tool.uv.package = true``; never with
``tool.uv.package = false``) editable, built by its backend, which the lock does not hold.
So for a package project the wheelhouse also holds the backend's wheels (``build/``: its
``[build-system] requires`` with their dependencies, and what the backend asks for an
editable build), and the node, after the sync, installs the project as ``uv sync`` does:
``uv pip install --offline --no-index --find-links build --no-deps -e PROJECT`` (uv's build
isolation takes the backend from those wheels alone).

Pure but ``dir_hashes`` and ``wheel_requires`` (which read the wheel files).
"""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path
from typing import Any

from packaging.markers import InvalidMarker, Marker, UndefinedComparison, UndefinedEnvironmentName
from packaging.requirements import InvalidRequirement
from packaging.requirements import Requirement as Specified
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import Version

from torchherd.engine.prepare.uvwheels import NodePlatform
from torchherd.remote.checkpoint import file_sha256

REQUIREMENTS = "requirements.txt"
"""In a wheelhouse directory: the lock exported as hashed requirements."""
BUILD = "build"
"""In a wheelhouse directory of a package project: the build backend's wheels, and
``BUILD_REQUIREMENTS`` (what they were gathered for)."""
BUILD_REQUIREMENTS = "requires.txt"
LEGACY_BACKEND = "setuptools.build_meta:__legacy__"
LEGACY_REQUIRES = ("setuptools>=40.8.0",)
"""What uv builds a package project without a ``[build-system]`` with (PEP 517's default)."""


@dataclass(frozen=True)
class BuildSystem:
    """A package project's ``[build-system]``: what uv builds its editable install with."""

    requires: tuple[str, ...]
    backend: str
    backend_path: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """Short, and another when anything in the table changes (the wheelhouse's name holds it)."""
        text = json.dumps([self.requires, self.backend, self.backend_path])
        return hashlib.sha256(text.encode()).hexdigest()[:8]


def build_system(pyproject: Mapping[str, Any]) -> BuildSystem | None:
    """As ``uv sync`` decides whether to install the project itself: a project with a
    ``[build-system]`` is a package unless ``tool.uv.package = false``; one without is not,
    unless ``tool.uv.package = true`` (then built with PEP 517's default, setuptools).
    None: not a package (nothing more is sent or run)."""
    tool = pyproject.get("tool")
    uv = tool.get("uv") if isinstance(tool, Mapping) else None
    package = uv.get("package") if isinstance(uv, Mapping) else None
    table = pyproject.get("build-system")
    if package is False or (not isinstance(table, Mapping) and package is not True):
        return None
    if not isinstance(table, Mapping):
        return BuildSystem(LEGACY_REQUIRES, LEGACY_BACKEND)
    requires = table.get("requires")
    path = table.get("backend-path")
    return BuildSystem(tuple(str(item) for item in requires) if isinstance(requires, list) else LEGACY_REQUIRES,
                       str(table.get("build-backend") or LEGACY_BACKEND),
                       tuple(str(item) for item in path) if isinstance(path, list) else ())


def fitting_wheel(filename: str, python_version: str) -> tuple[str, Version] | None:
    """A wheel file's (canonical name, version) when it installs on any platform with the
    node's python (``py3-none-any``, ``cp311-none-any``: a build backend's usual wheel);
    None for another file, or a wheel built for one platform (those are downloaded for the
    node's own)."""
    try:
        name, version, _, tags = parse_wheel_filename(filename)
    except InvalidWheelFilename:
        return None
    major, minor = (major_minor(python_version).split(".") + ["0"])[:2]
    interpreters = {f"py{major}", f"py{major}{minor}", f"cp{major}{minor}"}
    if any(tag.platform == "any" and tag.abi == "none" and tag.interpreter in interpreters for tag in tags):
        return str(name), version
    return None


def requires_dist(metadata: str, environment: Mapping[str, str]) -> list[str]:
    """A wheel's ``Requires-Dist`` (its METADATA) that hold on the node, without extras."""
    found = []
    for line in HeaderParser().parsestr(metadata).get_all("Requires-Dist") or []:
        try:
            requirement = Specified(line)
        except InvalidRequirement:
            continue
        if requirement.marker is None or applies(str(requirement.marker), environment):
            found.append(str(requirement))
    return found


def wheel_requires(path: Path, environment: Mapping[str, str]) -> list[str]:
    """``requires_dist`` of a wheel file (its ``*.dist-info/METADATA``); none when unreadable."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = [name for name in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", name)]
            return requires_dist(archive.read(names[0]).decode("utf-8", "replace"), environment) if names else []
    except (OSError, zipfile.BadZipFile, KeyError):
        return []


def satisfies(requirement: str, name: str, version: Version) -> bool:
    """Whether a wheel of ``name`` and ``version`` satisfies ``requirement`` (a PEP 508 string)."""
    try:
        specified = Specified(requirement)
    except InvalidRequirement:
        return False
    return canonicalize_name(specified.name) == name and specified.specifier.contains(version, prereleases=True)


def requirement_name(requirement: str) -> str:
    """A PEP 508 requirement's canonical name ("" when it cannot be read)."""
    try:
        return str(canonicalize_name(Specified(requirement).name))
    except InvalidRequirement:
        return ""


def build_download_argv(python: str, requires: Sequence[str], dest: str, node: NodePlatform,
                        python_version: str) -> list[str]:
    """pip's download of a build backend for ``node``: with its dependencies (the lock
    does not pin them), binaries only (nothing is built here for another platform)."""
    return [*build_download_head(python, node, python_version), "-d", dest, *requires]


def build_download_head(python: str, node: NodePlatform, python_version: str) -> list[str]:
    """``build_download_argv`` before its destination and requirements."""
    return [python, "-m", "pip", "download", "--only-binary=:all:", "--progress-bar", "off", "--platform",
            node.download_tag(), "--python-version", major_minor(python_version), "--implementation", "cp"]


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
    return [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
            "--progress-bar", "off", "--platform", node.download_tag(), "--python-version", major_minor(python_version),
            "--implementation", "cp", "-r", requirements, "-d", dest]


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


def cache_name(lock_hash: str, node: NodePlatform, python_version: str, build: BuildSystem | None = None) -> str:
    """This machine's wheelhouse for one lock, node platform and python:
    ``<lock hash>-<download tag>-<major.minor>`` (under ``~/.cache/torchherd/wheelhouse``),
    and ``-b<key>`` for a package project's build backend (what it holds changes with it)."""
    name = f"{lock_hash[:16]}-{node.download_tag()}-{major_minor(python_version)}"
    return f"{name}-b{build.key}" if build is not None else name


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
