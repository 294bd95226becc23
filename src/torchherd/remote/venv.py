"""Makes a uv-locked project's venv on a node (standard library only; run with the node's
configured python, which becomes the venv's base interpreter).

Reads its config, one JSON line, on stdin (the job's environment travels there, never on a
command line): ``path`` (the venv), ``key``, ``project`` (the synced project), ``uv``
(where to look for uv, in order), ``system_site_packages``, ``env``, and optionally
``wheelhouse`` (a directory holding the lock's wheels and ``requirements.txt``, the lock
exported with hashes: the venv is built from those files alone, offline; with a ``build/``
directory in it, the project's build backend's wheels, the project is then installed
editable from them, as ``uv sync`` installs a package project; the directory is
removed after the build, built or not). When the venv's
marker holds ``key`` the venv is as the lock made it: nothing runs, not even uv. Else it
finds uv, runs ``uv sync --frozen`` into the venv and writes the marker last, so a build
cut short is built again. Prints one JSON line: ``{"cached": true}``, ``{"built": true,
"uv": PATH, "seconds": S}``, or ``{"error": TEXT}`` (with ``"editable": true`` when the
project's own editable install failed); with no uv found, ``"uv_missing": true`` and the
node's ``system``, ``machine``, ``libc`` (glibc, musl or "") and ``libc_version`` (the
controller may send a uv that runs there); with a ``wheelhouse`` not there (yet),
``"wheelhouse_missing": true``, the same four and ``python`` (the configured python's
version: the controller makes the wheelhouse for that platform and python, and relays it).

Nodes that share a home build one venv: uv locks it while it syncs (the others wait, then
find it in sync); the marker is replaced atomically.

Before anything is read or run, the directory holding the venv (the venv_dir) is walked
as a sync's destination is (``receive.walk``: the user's own, no group or other write,
above it root's or sticky), and the venv, the wheelhouse and a uv sent there are each
``lstat``-ed (the user's own, not a link, not writable by group or others): one another
user planted in a shared ``/scratch`` is refused in one line naming it, never trusted.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from typing import Any, Optional

from torchherd.remote.receive import walk
from torchherd.remote.uvlock import MARKER

TAIL_LINES = 6
"""uv's last lines of output shown when it fails (it says what it could not get)."""


def find_uv(candidates: list[str], search_path: str | None) -> str | None:
    """The first candidate that is an executable file (a bare name: looked up on the job's PATH)."""
    for candidate in candidates:
        path = os.path.expanduser(candidate)
        if "/" not in path:
            path = shutil.which(path, path=search_path) or ""
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def read_marker(path: str) -> object:
    try:
        with open(os.path.join(path, MARKER), encoding="utf-8") as file:
            return json.load(file)
    except (OSError, ValueError):
        return None


def built(path: str, key: str) -> bool:
    """Whether the venv at ``path`` is as the lock of ``key`` made it (its marker, and its python)."""
    marker = read_marker(path)
    return isinstance(marker, dict) and marker.get("key") == key and os.path.exists(os.path.join(path, "bin", "python"))


def write_marker(path: str, content: dict[str, str]) -> None:
    final = os.path.join(path, MARKER)
    partial = f"{final}.{os.getpid()}"
    with open(partial, "w", encoding="utf-8") as file:
        json.dump(content, file)
    os.replace(partial, final)


def tail(output: bytes) -> str:
    """uv's last lines on one line; an indented line continues the one before (uv wraps its hints)."""
    lines: list[str] = []
    for line in output.decode("utf-8", "replace").splitlines():
        if not line.strip():
            continue
        if lines and line[:1].isspace():
            lines[-1] += " " + line.strip()
        else:
            lines.append(line.strip())
    return " | ".join(lines[-TAIL_LINES:]) or "no output"


def libc_of(glibc: tuple[str, str]) -> tuple[str, str]:
    """This node's C library and its version: glibc as Python reads it, else musl from its
    loader (``/lib/ld-musl-<arch>.so.1``, which prints its version when run bare), else none."""
    if glibc[0]:
        return glibc[0], glibc[1]
    import glob

    loaders = sorted(glob.glob("/lib/ld-musl-*.so.1"))
    if not loaders:
        return "", ""
    try:
        said = subprocess.run([loaders[0]], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=10, check=False).stdout.decode("ascii", "replace")
    except (OSError, subprocess.SubprocessError):
        said = ""
    found = [line.split()[-1] for line in said.splitlines() if line.startswith("Version ")]
    return "musl", found[0] if found else ""


def run(argv: list[str], cwd: str, env: dict[str, str]) -> tuple[int, bytes]:
    done = subprocess.run(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, check=False)
    return done.returncode, done.stdout


def editable_argv(uv: str, build_wheels: str, project: str, python: str) -> list[str]:
    """The project installed as ``uv sync`` installs a package project: editable, without
    its dependencies (the lock's, installed already), built by uv in isolation with the
    backend taken from ``build_wheels`` alone (no index, no network)."""
    return [uv, "pip", "install", "--offline", "--no-index", "--find-links", build_wheels, "--no-deps",
            "--editable", project, "--python", python]


VENVS = ("venvs", "what is built and run there", "a venv_dir")
"""A venv_dir's refusal (``receive.distrust``'s words)."""


def untrusted(path: str, kind: str) -> Optional[str]:
    """Why ``path`` (in a checked venv_dir) is not to be trusted, or None (not there is
    fine: it is made here). ``kind``: "dir" or "file"."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode):
        why = "a symbolic link"
    elif not (stat.S_ISDIR(info.st_mode) if kind == "dir" else stat.S_ISREG(info.st_mode)):
        why = "not a " + ("directory" if kind == "dir" else "file")
    elif info.st_uid != os.geteuid():
        why = "not yours"
    elif info.st_mode & 0o022:
        why = "writable by group or others"
    else:
        return None
    return (f"{path} is {why} (mode {stat.S_IMODE(info.st_mode):04o}): refused, another user could have put it "
            "there (remove it and run again)")


def trusted_home(config: dict[str, Any]) -> tuple[str, Optional[str]]:
    """The venv's path in its checked directory (``walk``, made 0700 when missing), and
    why it is refused (its directory, the venv or the wheelhouse), or None."""
    path = os.path.abspath(os.path.expanduser(config["path"]))
    try:
        home, _ = walk(os.path.dirname(path), True, VENVS)
    except (ValueError, OSError) as error:
        return path, str(error)
    path = os.path.join(home, os.path.basename(path))
    # the wheelhouse lies beside the venvs (engine/wheelhouse.py node_dir)
    wheelhouse = [os.path.join(home, os.path.basename(config["wheelhouse"]))] if config.get("wheelhouse") else []
    for item in [path, *wheelhouse]:
        problem = untrusted(item, "dir")
        if problem:
            return path, problem
    return path, None


def trusted_uv(uv: str, home: str) -> Optional[str]:
    """Why a uv found in the venv's own directory (one sent there, engine/venvs.py) is
    not to be run, or None (one elsewhere: the user's PATH or inventory says so)."""
    folder = os.path.realpath(os.path.dirname(os.path.abspath(uv)))
    if folder != home:
        return None
    return untrusted(os.path.join(home, os.path.basename(uv)), "file")


def build(config: dict[str, Any]) -> dict[str, object]:
    path, problem = trusted_home(config)
    if problem:
        return {"error": problem}
    if built(path, config["key"]):
        return {"cached": True}
    env = dict(os.environ)
    env.update(config.get("env") or {})
    uv = find_uv(config["uv"], env.get("PATH"))
    if uv is None:
        return {"error": "uv not found (looked for " + ", ".join(config["uv"]) + ")", "uv_missing": True,
                **node_platform()}
    problem = trusted_uv(uv, os.path.dirname(path))
    if problem:
        return {"error": problem}
    wheelhouse = os.path.expanduser(config["wheelhouse"]) if config.get("wheelhouse") else None
    if wheelhouse and not os.path.isfile(os.path.join(wheelhouse, "requirements.txt")):
        return {"error": f"the lock's wheels are not in {wheelhouse}", "wheelhouse_missing": True,
                "python": "%d.%d.%d" % sys.version_info[:3], **node_platform()}
    if wheelhouse:
        try:
            return from_wheelhouse(config, path, uv, wheelhouse, env)
        finally:
            # The wheelhouse only carries the lock's files here (torch and CUDA's wheels: GBs
            # on every node); the venv holds them installed. Removed after a failed build
            # too: the next run sends a new one made from what the controller then has,
            # never one that failed.
            shutil.rmtree(wheelhouse, ignore_errors=True)
    return build_with(config, path, uv, None, env)


def node_platform() -> dict[str, str]:
    """What the controller needs to send a uv, or wheels, that run on this node."""
    import platform  # only here: a cached venv never needs it

    libc, version = libc_of(platform.libc_ver())
    return {"system": platform.system(), "machine": platform.machine(), "libc": libc, "libc_version": version}


def from_wheelhouse(config: dict[str, Any], path: str, uv: str, wheelhouse: str,
                    env: dict[str, str]) -> dict[str, object]:
    """The build from the wheelhouse, under a lock beside the venv: nodes that share the
    venv (a shared home) build it once; the others wait, then find it marked."""
    import fcntl

    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    with open(f"{path}.lock", "a", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if built(path, config["key"]):
            return {"cached": True}
        return build_with(config, path, uv, wheelhouse, env)


def build_with(config: dict[str, Any], path: str, uv: str, wheelhouse: str | None,
               env: dict[str, str]) -> dict[str, object]:
    project = os.path.expanduser(config["project"])
    env.pop("VIRTUAL_ENV", None)  # uv warns, and would compare it with the project's environment
    env["UV_PROJECT_ENVIRONMENT"] = path
    started = time.monotonic()
    system = bool(config.get("system_site_packages"))
    if (system or wheelhouse) and not os.path.exists(os.path.join(path, "pyvenv.cfg")):
        # uv sync keeps an existing venv's settings: made here with the system's packages
        # visible, it stays so (uv sync alone makes an isolated one).
        code, output = run([uv, "venv", "--allow-existing", *(["--system-site-packages"] if system else []),
                            "--python", sys.executable, path], project, env)
        if code != 0:
            return {"error": f"uv venv failed (exit {code}): {tail(output)}"}
    if wheelhouse:
        # uv sync --frozen takes a registry package from the lock's URL, never from
        # --find-links: the lock's own files (exported with their hashes) are installed.
        argv = [uv, "pip", "sync", "--offline", "--no-index", "--find-links", wheelhouse, "--require-hashes",
                "--python", os.path.join(path, "bin", "python"), os.path.join(wheelhouse, "requirements.txt")]
        code, output = run(argv, project, env)
        if code != 0:
            return {"error": f"uv pip sync from {wheelhouse} failed (exit {code}): {tail(output)}"}
        build_wheels = os.path.join(wheelhouse, "build")
        if os.path.isdir(build_wheels):
            code, output = run(editable_argv(uv, build_wheels, project, os.path.join(path, "bin", "python")),
                               project, env)
            if code != 0:
                return {"error": f"uv pip install --editable {project} with the build backend from {build_wheels} "
                                 f"failed (exit {code}): {tail(output)}", "editable": True}
    else:
        code, output = run([uv, "sync", "--frozen", "--python", sys.executable], project, env)
        if code != 0:
            return {"error": f"uv sync --frozen failed (exit {code}): {tail(output)}"}
    write_marker(path, {"key": config["key"], "uv": uv, "python": sys.executable})
    return {"built": True, "uv": uv, "seconds": round(time.monotonic() - started, 3)}


def main() -> None:
    config = json.loads(sys.stdin.readline())
    try:
        answer = build(config)
    except OSError as error:
        answer = {"error": f"{error.filename or 'uv'}: {error.strerror}"}
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
