"""``--uv-offline`` (``[uv] offline``), the controller's side: the lock's wheels for nodes
that reach no package index, made once here per node platform and python, and relayed
node to node (`torchherd docs environments`, "Nodes without internet").

1. ``export_requirements``: ``uv export`` of the synced project's lock, here (no network):
   every package pinned with the lock's SHA-256 hashes, markers kept.
2. ``make_wheelhouse``: ``~/.cache/torchherd/wheelhouse/<lock hash>-<tag>-<python>`` holds
   ``requirements.txt`` and a wheel for every requirement the nodes' platform needs (its
   marker judged for them), each satisfying the lock **by hash**: first from the local
   wheel directories (``[uv] wheels``, ``~/.cache/torchherd/wheels``, pip's wheel cache),
   and only what is still missing from ``pip download --platform``. A wheelhouse already
   complete for the lock is taken as it is. Made in a new private directory, renamed into
   place once complete. For a package project (``wheelhouse.build_system``), ``build/``
   holds its build backend's wheels too (``build_wheels``), the node installs the project
   editable from them, as ``uv sync`` does.
3. ``relay_wheelhouse``: this machine feeds the directory once to the first node of the
   chain (the master first), and the nodes pass it on over the cluster's network
   (``engine.prepare.relay``, with ``remote/checkpoint.py relay`` on each node): each writes it
   into a private temporary directory beside its venvs, checks the SHA-256 of the whole
   (every file's hash), and renames it to ``wheelhouse-<venv key>``, where the node's venv
   builder (``remote/venv.py``) finds it. Each node says how far it is as it receives
   (``"progress"``): a ``WheelsProgress`` per node, the console's bars.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from torchherd.engine.events import Observer, WheelFetched, WheelsDownloading, WheelsProgress
from torchherd.engine.prepare.relay import Hop, file_feed, run_chain
from torchherd.engine.prepare.staging import job_address
from torchherd.engine.prepare.uvwheels import DEFAULT_WHEELS, NodePlatform
from torchherd.engine.prepare.wheelhouse import (
    BUILD,
    BUILD_REQUIREMENTS,
    REQUIREMENTS,
    BuildSystem,
    Requirement,
    build_download_argv,
    build_download_head,
    build_system,
    cache_name,
    dir_hashes,
    download_argv,
    export_argv,
    fitting_wheel,
    major_minor,
    marker_environment,
    missing,
    normalized,
    parse_requirements,
    pip_fetching,
    requirement_lines,
    requirement_name,
    satisfies,
    wanted,
    wheel_name,
    wheel_requires,
)
from torchherd.plan import NodePlan
from torchherd.remote import command
from torchherd.remote.checkpoint import combined, file_sha256
from torchherd.shell import quote_path
from torchherd.transport import Session

WHEELHOUSES = Path.home() / ".cache" / "torchherd" / "wheelhouse"
"""Where this machine keeps the wheelhouses it made (one per lock, platform and python)."""
EXPORT_SECONDS = 120.0
PROBE_SECONDS = 300.0
"""The backend installed here in a scratch venv, and asked what an editable build needs."""
DOWNLOAD_SECONDS = 3600.0
"""pip's download of a lock's wheels: torch and CUDA's libraries are gigabytes."""


class WheelhouseError(Exception):
    """The lock's wheels could not be gathered here: what is missing, and the fix."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.hint = hint


@dataclass(frozen=True)
class Wheelhouse:
    """A complete wheelhouse on this machine: its files (relative path, size) in the order
    they are sent, and the SHA-256 a node checks the copy against."""

    path: Path
    files: tuple[tuple[str, int], ...]
    sha256: str
    downloaded: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        return sum(size for _, size in self.files)


def controller_uv() -> str | None:
    """The uv that exports the lock here: beside this python (the ``uv`` package's), else on PATH."""
    beside = Path(sys.executable).parent / "uv"
    return str(beside) if os.access(beside, os.X_OK) else shutil.which("uv")


def export_requirements(project: Path, uv: str | None = None) -> str:
    """The lock as hashed requirements. Raises WheelhouseError."""
    uv = uv or controller_uv()
    if uv is None:
        raise WheelhouseError("this machine has no uv to export uv.lock with (--uv-offline)",
                              f"{sys.executable} -m pip install uv")
    try:
        done = subprocess.run(export_argv(uv), cwd=project, env={**os.environ, "UV_OFFLINE": "1"},
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=EXPORT_SECONDS,
                              check=False)
    except (OSError, subprocess.SubprocessError) as error:
        raise WheelhouseError(f"uv export in {project} failed: {error}", f"run {shlex.join(export_argv(uv))} "
                              f"in {project} to see why") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise WheelhouseError(f"uv export in {project} failed (exit {done.returncode}): {last}",
                              f"run {shlex.join(export_argv(uv))} in {project} to see why")
    return done.stdout


def project_build(project: Path) -> BuildSystem | None:
    """The synced project's build system when ``uv sync`` would install it (a package
    project), else None; a pyproject.toml that cannot be read: None (uv export reads it
    first, and says why)."""
    try:
        return build_system(tomllib.loads((project / "pyproject.toml").read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None


def local_dirs(configured: str | None) -> list[Path]:
    """Where the lock's wheels are looked for here, in order: ``[uv] wheels``, the default
    wheel directory, pip's wheel cache."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    pip = Path(os.environ["PIP_CACHE_DIR"]) if os.environ.get("PIP_CACHE_DIR") else cache / "pip"
    found = [Path(configured).expanduser()] if configured else []
    return list(dict.fromkeys([*found, Path(DEFAULT_WHEELS).expanduser(), pip / "wheels"]))


Listing = list[tuple[str, int, str]]
"""A wheelhouse's files: name, size and SHA-256, in the order the relay sends them."""


def make_wheelhouse(exported: str, lock_hash: str, node: NodePlatform, python_version: str,
                    configured: str | None, *, root: Path | None = None,
                    pip_python: str = sys.executable, observer: Observer = lambda event: None,
                    build: BuildSystem | None = None, project: Path | None = None,
                    uv: str | None = None) -> Wheelhouse:
    """The wheelhouse for ``node``'s platform and python, complete by hash (module doc, 2),
    under ``root`` (default ``WHEELHOUSES``); with ``build`` (the package ``project``'s
    build system), its backend's wheels in ``build/`` too (``build_wheels``, with ``uv``).
    ``observer`` is told ``WheelsDownloading`` and a ``WheelFetched`` per file when pip
    must fetch some (a download of gigabytes is minutes: the user sees what runs). Raises
    WheelhouseError naming what is missing and the download that fixes it."""
    root = root or WHEELHOUSES
    requirements = parse_requirements(exported)
    environment = marker_environment(node, python_version)
    needed = wanted(requirements, environment)
    final = root / cache_name(lock_hash, node, python_version, build)
    if final.parent != root or final.name in ("", ".", ".."):
        # The name is made of what a node reported (checked where it is read, uvwheels.reported):
        # whatever it holds, nothing outside the cache is renamed aside or removed.
        raise WheelhouseError(f"the wheelhouse name {cache_name(lock_hash, node, python_version, build)!r} is not "
                              f"one directory in {root}", "the node's platform answer is malformed")
    listing = _listing(final)
    if _complete(final, exported, needed, listing) and (build is None or (final / BUILD / BUILD_REQUIREMENTS).is_file()):
        return _house(final, listing)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))  # 0700, a name no one guessed
    try:
        looked = local_dirs(configured)
        have = _gather(needed, [final, *looked], partial)
        still = missing(needed, have)
        downloaded: tuple[str, ...] = ()
        if still:
            observer(WheelsDownloading(node.download_tag(), major_minor(python_version), tuple(still),
                                       ", ".join(str(directory) for directory in looked)))
            _download(needed, still, node, python_version, partial, configured, pip_python,
                      lambda line: _fetched(line, observer))
            have = dir_hashes(partial)
            left = missing(needed, have)
            if left:
                raise WheelhouseError(
                    f"pip download for {node.download_tag()} python {major_minor(python_version)} brought no wheel "
                    f"with the lock's hash for {', '.join(left)}", fix(left, node, python_version, configured, pip_python))
            downloaded = tuple(still)
        if build is not None:
            downloaded += build_wheels(build, project or Path("."), node, python_version,
                                       [final / BUILD, *looked], partial / BUILD, configured,
                                       pip_python=pip_python, uv=uv, observer=observer)
        (partial / REQUIREMENTS).write_text(exported, encoding="utf-8")
        _put_in_place(partial, final)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return _house(final, _listing(final), downloaded)


def _complete(final: Path, exported: str, needed: Sequence[Requirement], listing: Listing) -> bool:
    """Whether ``final`` is this lock's wheelhouse with a wheel for every needed
    requirement, judged from ``listing`` (its files hashed once)."""
    try:
        if (final / REQUIREMENTS).read_text(encoding="utf-8") != exported:
            return False
    except OSError:
        return False
    return not missing(needed, {sha for name, _, sha in listing if name.endswith(".whl")})


def _gather(needed: Sequence[Requirement], dirs: Sequence[Path], into: Path) -> set[str]:
    """Every needed wheel found in ``dirs`` whose hash is the lock's, linked (else copied)
    into ``into``; the hashes gathered. Only files named as a needed package and version
    are read (a wheel directory may hold gigabytes of others)."""
    by_name = {(normalized(item.name), item.version): set(item.hashes) for item in needed}
    have: set[str] = set()
    for path in _wheels_in(dirs):
        named = wheel_name(path.name)
        hashes = by_name.get(named) if named is not None else None
        if not hashes or hashes & have or (into / path.name).exists():
            continue
        try:
            digest = file_sha256(str(path))
            if digest not in hashes:
                continue  # the same name and version built otherwise: not the lock's
            _link(path, into / path.name)
        except OSError:
            continue
        have.add(digest)
    return have


def _wheels_in(dirs: Sequence[Path]) -> Iterator[Path]:
    """The wheel files of ``dirs``, in order: at the top of each, at any depth in the last
    (pip's cache); a directory that cannot be read is passed over."""
    for index, directory in enumerate(dirs):
        try:
            yield from sorted(directory.rglob("*.whl") if index == len(dirs) - 1 else directory.glob("*.whl"))
        except OSError:
            continue


def build_wheels(build: BuildSystem, project: Path, node: NodePlatform, python_version: str,
                 dirs: Sequence[Path], into: Path, configured: str | None, *, pip_python: str = sys.executable,
                 uv: str | None = None, observer: Observer = lambda event: None) -> tuple[str, ...]:
    """``into`` (made here) filled with the wheels uv's isolated build of the project's
    editable install takes on the node: the ``[build-system] requires`` with their
    dependencies, then what the backend's ``get_requires_for_build_editable`` adds (an
    older setuptools asks for ``wheel``). Each from ``dirs`` first (``gather_build``),
    checked by installing them here with no index (``_probe``; the backend is asked in that
    scratch venv); what does not install from them is downloaded with its dependencies for
    the node's platform. Returns the requirements downloaded. Raises WheelhouseError."""
    into.mkdir(mode=0o700)
    environment = marker_environment(node, python_version)
    uv = uv or controller_uv()
    fetched: list[str] = []
    asked: list[str] = []
    with tempfile.TemporaryDirectory(prefix=".probe-", dir=into.parent) as scratch:
        venv = Path(scratch) / "venv"
        made = uv is not None and _run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)])[0] == 0

        def supply(requires: Sequence[str]) -> bool:
            """``requires`` in ``into``, from ``dirs`` else downloaded; whether they install here."""
            if not requires:
                return made
            gather_build(requires, dirs, into, environment)
            if made and _probe(uv, venv, into, requires):
                return True
            _download_build(requires, node, python_version, into, configured, pip_python, looked=dirs,
                            observer=observer)
            fetched.extend(requires)
            # Downloaded for the node's platform: a backend with binary parts may not install here.
            return made and _probe(uv, venv, into, requires)

        if supply(build.requires):
            names = {requirement_name(item) for item in build.requires}
            asked = [item for item in _backend_asks(venv, build, project) if requirement_name(item) not in names]
            if asked:
                supply(asked)
    lines = [f"# build-backend = {build.backend}", *build.requires, *(f"{item}  # asked by the backend" for item in asked)]
    (into / BUILD_REQUIREMENTS).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return tuple(fetched)


def gather_build(requires: Sequence[str], dirs: Sequence[Path], into: Path, environment: Mapping[str, str]) -> None:
    """For each requirement (and, read from the wheel chosen, each of its dependencies that
    holds on the node), the newest wheel in ``dirs`` that satisfies it and installs on any
    platform with the node's python, linked (else copied) into ``into``."""
    found: dict[str, list[tuple[Any, Path]]] = {}
    for path in _wheels_in(dirs):
        fits = fitting_wheel(path.name, environment["python_full_version"])
        if fits is not None:
            found.setdefault(fits[0], []).append((fits[1], path))
    queue = list(requires)
    done: set[str] = set()
    while queue:
        requirement = queue.pop(0)
        name = requirement_name(requirement)
        if not name or name in done:
            continue
        done.add(name)
        fitting = [(version, path) for version, path in found.get(name, []) if satisfies(requirement, name, version)]
        if not fitting:
            continue
        _, best = max(fitting, key=lambda item: item[0])
        if not (into / best.name).exists():
            try:
                _link(best, into / best.name)
            except OSError:
                continue
        queue.extend(wheel_requires(best, environment))


def _run(argv: list[str], cwd: Path | None = None) -> tuple[int, str]:
    try:
        done = subprocess.run(argv, cwd=cwd, env={**os.environ, "UV_OFFLINE": "1"}, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=PROBE_SECONDS, check=False)
    except (OSError, subprocess.SubprocessError) as error:
        return -1, str(error)
    return done.returncode, done.stdout


def _probe(uv: str | None, venv: Path, wheels: Path, requires: Sequence[str]) -> bool:
    """Whether ``requires`` install here from ``wheels`` alone (no index, no network), into
    the scratch ``venv``: then the node's uv finds them there too (a backend is pure Python,
    the same wheels install on every platform)."""
    if uv is None:
        return False
    argv = [uv, "pip", "install", "--quiet", "--offline", "--no-index", "--find-links", str(wheels),
            "--python", str(venv / "bin" / "python"), *requires]
    return _run(argv)[0] == 0


BACKEND_ASKS = (
    "import importlib, json, sys\n"
    "module, _, attribute = sys.argv[1].partition(':')\n"
    "backend = importlib.import_module(module)\n"
    "for part in filter(None, attribute.split('.')):\n"
    "    backend = getattr(backend, part)\n"
    "hook = getattr(backend, 'get_requires_for_build_editable', None)\n"
    "print(json.dumps(list(hook({}) if hook else [])))\n")
"""Run in the scratch venv: what the backend asks, beyond its ``requires``, to build an
editable install (PEP 660), as uv asks it on the node."""


def _backend_asks(venv: Path, build: BuildSystem, project: Path) -> list[str]:
    """The backend's ``get_requires_for_build_editable``, asked in a scratch copy of the
    project's build configuration (the backend may write there: setuptools writes an
    egg-info); none when it cannot be asked (an in-tree backend, a setup.py that reads the
    sources): the node's build then says what it lacks."""
    if build.backend_path:
        return []
    with tempfile.TemporaryDirectory(prefix=".backend-", dir=venv.parent) as copy:
        for name in ("pyproject.toml", "setup.py", "setup.cfg"):
            if (project / name).is_file():
                shutil.copyfile(project / name, Path(copy) / name)
        code, output = _run([str(venv / "bin" / "python"), "-c", BACKEND_ASKS, build.backend], cwd=Path(copy))
    lines = output.strip().splitlines()
    try:
        asked = json.loads(lines[-1]) if code == 0 and lines else []
    except ValueError:
        return []
    return [str(item) for item in asked] if isinstance(asked, list) else []


def _download_build(requires: Sequence[str], node: NodePlatform, python_version: str, into: Path,
                    configured: str | None, pip_python: str, *, looked: Sequence[Path], observer: Observer) -> None:
    observer(WheelsDownloading(node.download_tag(), major_minor(python_version), tuple(requires),
                               ", ".join(str(directory) for directory in looked[1:]), backend=True))
    code, output = _pip(build_download_argv(pip_python, requires, str(into), node, python_version),
                        lambda line: _fetched(line, observer))
    if code != 0:
        raise WheelhouseError(
            f"the project's build backend for {node.download_tag()} python {major_minor(python_version)}: "
            f"{', '.join(requires)} not in {configured or DEFAULT_WHEELS} and pip download failed (exit {code}): "
            f"{_pip_error(output)}",
            _fix_command(build_download_head(pip_python, node, python_version), configured, requires))


def _link(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _fetched(line: str, observer: Observer) -> None:
    fetching = pip_fetching(line)
    if fetching is not None:
        observer(WheelFetched(*fetching))


def _download(needed: Sequence[Requirement], names: Sequence[str], node: NodePlatform, python_version: str,
              into: Path, configured: str | None, pip_python: str, on_line: Callable[[str], None]) -> None:
    with tempfile.NamedTemporaryFile("w", prefix=".download-", suffix=".txt", dir=into.parent,
                                     encoding="utf-8") as listing:
        listing.write(requirement_lines(needed, names))
        listing.flush()
        code, output = _pip(download_argv(pip_python, listing.name, str(into), node, python_version), on_line)
    if code != 0:
        raise WheelhouseError(
            f"the lock's wheels for {node.download_tag()} python {major_minor(python_version)}: {', '.join(names)} "
            f"not in {configured or DEFAULT_WHEELS} and pip download failed (exit {code}): {_pip_error(output)}",
            fix(names, node, python_version, configured, pip_python))


def _pip_error(output: str) -> str:
    """What pip said went wrong: its first ``ERROR`` line, else its last line."""
    said = [line.strip() for line in output.splitlines() if line.strip().startswith("ERROR")] or \
        output.splitlines()[-1:] or ["no output"]
    return said[0][:300]


def _pip(argv: list[str], on_line: Callable[[str], None]) -> tuple[int, str]:
    """pip's exit status and output (both streams, as they came), each line told to
    ``on_line`` as pip writes it; killed after ``DOWNLOAD_SECONDS``."""
    lines: list[str] = []
    expired = threading.Event()
    try:
        with subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace") as process:

            def expire() -> None:
                expired.set()
                process.kill()

            timer = threading.Timer(DOWNLOAD_SECONDS, expire)
            timer.start()
            try:
                assert process.stdout is not None
                for line in process.stdout:
                    lines.append(line.rstrip())
                    on_line(line)
            finally:
                timer.cancel()
            code = process.wait()
    except OSError as error:
        return -1, str(error)
    if expired.is_set():
        lines.append(f"no end after {DOWNLOAD_SECONDS:.0f} s")
    return code, "\n".join(lines).strip()


def fix(names: Sequence[str], node: NodePlatform, python_version: str, configured: str | None,
        pip_python: str = sys.executable) -> str:
    """The download, on a machine with internet, that puts the missing wheels where they are looked for."""
    argv = [pip_python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--platform",
            node.download_tag(), "--python-version", major_minor(python_version), "--implementation", "cp"]
    return _fix_command(argv, configured, names)


def _fix_command(argv: Sequence[str], configured: str | None, names: Sequence[str]) -> str:
    """``argv`` into the directory where the wheels are looked for, for ``names``."""
    return f"{shlex.join(argv)} -d {quote_path(configured or DEFAULT_WHEELS)} {shlex.join(names)}"


def _put_in_place(partial: Path, final: Path) -> None:
    """``partial`` becomes ``final``; an older (incomplete) ``final`` is removed first.
    Another run that put a complete one there meanwhile: theirs is kept."""
    if final.exists():
        aside = Path(tempfile.mkdtemp(prefix=f".{final.name}-old-", dir=final.parent))
        try:
            os.replace(final, aside / "old")
        except OSError:
            pass
        shutil.rmtree(aside, ignore_errors=True)
    try:
        os.rename(partial, final)
    except OSError:
        if not final.is_dir():
            raise


def _listing(final: Path) -> Listing:
    """``final``'s files (not the hidden ones; ``build/``'s too), by relative path in the
    order a node lists its copy, each read and hashed once; none when it is not there."""
    try:
        names = sorted(str(path.relative_to(final)) for path in final.rglob("*")
                       if path.is_file() and not path.is_symlink()
                       and not any(part.startswith(".") for part in path.relative_to(final).parts))
        return [(name, (final / name).stat().st_size, file_sha256(str(final / name))) for name in names]
    except OSError:
        return []


def _house(final: Path, listing: Listing, downloaded: tuple[str, ...] = ()) -> Wheelhouse:
    """The wheelhouse as it is sent: its files, and their combined SHA-256
    (``remote/checkpoint.py``'s for a directory: what each node checks its copy against)."""
    return Wheelhouse(final, tuple((name, size) for name, size, _ in listing), combined("dir", listing), downloaded)


def relay_program(node: NodePlan, folder: str, name: str) -> str:
    """``checkpoint.py relay`` into ``folder/name`` on the node, with its configured python
    (the venv's does not exist yet)."""
    python = node.venv.python if node.venv is not None else node.host.python
    return f"{quote_path(python)} {command('checkpoint.py')} relay {shlex.quote(folder)} {shlex.quote(name)}"


def relay_wheelhouse(house: Wheelhouse, targets: Sequence[tuple[NodePlan, str]], sessions: Mapping[str, Session],
                     stopping: Callable[[], bool] = lambda: False,
                     observer: Observer = lambda event: None) -> tuple[dict[str, str | None], int]:
    """The chain this machine -> targets[0] -> targets[1] ...: each node's copy at its
    target path (the same name in each node's own folder). Per node None (there, verified)
    or why not; and the bytes this machine sent (the wheelhouse once). ``observer`` is told
    each node's ``WheelsProgress`` as it receives."""
    name = targets[0][1].rstrip("/").rsplit("/", 1)[-1]
    hops = [Hop(node.host.name, sessions[node.host.name], relay_program(node, _folder(target), name),
                job_address(node)) for node, target in targets]
    sent = [0]
    feed = file_feed([(path, str(house.path / path), size) for path, size in house.files], sent)

    def on_message(node: str, message: Mapping[str, Any]) -> None:
        if "progress" in message:
            observer(WheelsProgress(node, int(message["progress"]), house.size))

    expect = {"path": name, "kind": "dir", "sha256": house.sha256, "size": house.size}
    results = run_chain(hops, {"expect": expect, "progress": True}, house.size, feed=feed, on_message=on_message,
                        stopping=stopping)
    return results, sent[0]


def _folder(target: str) -> str:
    stripped = target.rstrip("/")
    return stripped.rsplit("/", 1)[0] if "/" in stripped else "."
