"""A uv-locked project that resolves offline: its one dependency is a wheel built here,
named by path in ``[tool.uv.sources]`` (no index, no build backend, no network), and
``uv lock --offline`` writes its lock. Shared by the unit and the cluster tests."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path


def uv_binary() -> str:
    """The uv the test extra installs (beside this python, or on PATH)."""
    beside = Path(sys.executable).parent / "uv"
    found = str(beside) if os.access(beside, os.X_OK) else shutil.which("uv")
    assert found, "uv is not installed: pip install uv (it is in the test extra)"
    return found


def wheel(directory: Path, name: str, version: str = "0.1.0", value: str = "from the lock") -> Path:
    """A pure-Python wheel of one module ``name`` whose ``VALUE`` is ``value``."""
    files = {
        f"{name}/__init__.py": f"VALUE = {value!r}\n",
        f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{name}-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: torchherd-tests\nRoot-Is-Purelib: true\n"
                                               "Tag: py3-none-any\n",
    }

    def digest(text: str) -> str:
        raw = hashlib.sha256(text.encode()).digest()
        return "sha256=" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    record = "".join(f"{path},{digest(text)},{len(text.encode())}\n" for path, text in files.items())
    record += f"{name}-{version}.dist-info/RECORD,,\n"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in files.items():
            archive.writestr(member, text)
        archive.writestr(f"{name}-{version}.dist-info/RECORD", record)
    return path


def locked_project(root: Path, script: str = "", dependency: str = "thdemo", value: str = "from the lock") -> Path:
    """``root`` made a uv project that depends on the wheel ``dependency`` (in ``wheels/``),
    locked; ``script`` written as ``train.py`` when given."""
    root.mkdir(parents=True, exist_ok=True)
    built = wheel(root / "wheels", dependency, value=value)
    (root / "pyproject.toml").write_text(
        '[project]\nname = "demo"\nversion = "0.1.0"\nrequires-python = ">=3.8"\n'
        f'dependencies = ["{dependency}"]\n\n[tool.uv.sources]\n'
        f'{dependency} = {{ path = "wheels/{built.name}" }}\n')
    if script:
        (root / "train.py").write_text(script)
    subprocess.run([uv_binary(), "lock", "--offline", "--quiet"], cwd=root, check=True,
                   env={**os.environ, "UV_PYTHON": sys.executable})
    return root


def registry_project(root: Path, script: str = "") -> tuple[Path, Path]:
    """A project whose one dependency is locked from PyPI (its URL there, its real hash),
    and that dependency's wheel in a directory of this machine's (``root/downloads``):
    nothing is downloaded. ``script`` written as ``train.py`` when given."""
    built = wheel(root / "downloads", "thdemo", value="from the wheelhouse")
    if script:
        (root / "train.py").write_text(script)
    digest = hashlib.sha256(built.read_bytes()).hexdigest()
    (root / "pyproject.toml").write_text('[project]\nname = "demo"\nversion = "0.1.0"\nrequires-python = ">=3.8"\n'
                                         'dependencies = ["thdemo"]\n')
    (root / "uv.lock").write_text(
        'version = 1\nrequires-python = ">=3.8"\n\n[[package]]\nname = "demo"\nversion = "0.1.0"\n'
        'source = { virtual = "." }\ndependencies = [\n    { name = "thdemo" },\n]\n\n[package.metadata]\n'
        'requires-dist = [{ name = "thdemo" }]\n\n[[package]]\nname = "thdemo"\nversion = "0.1.0"\n'
        'source = { registry = "https://pypi.org/simple" }\nwheels = [\n    { url = "https://files.pythonhosted.org/'
        f'packages/00/00/{built.name}", hash = "sha256:{digest}", size = {built.stat().st_size} }},\n]\n')
    return root, built


def package_project(root: Path, value: str = "mine") -> tuple[Path, Path]:
    """``registry_project`` made a src-layout package project (``mypkg``, built by
    ``setuptools.build_meta``), which ``uv sync`` installs editable; its lock says so."""
    root, built = registry_project(root)
    (root / "src" / "mypkg").mkdir(parents=True)
    (root / "src" / "mypkg" / "__init__.py").write_text(f"import thdemo\n\nVALUE = {value!r}\nDEP = thdemo.VALUE\n")
    pyproject = (root / "pyproject.toml").read_text().replace('name = "demo"', 'name = "mypkg"')
    (root / "pyproject.toml").write_text(pyproject + '\n[build-system]\nrequires = ["setuptools>=61"]\n'
                                         'build-backend = "setuptools.build_meta"\n')
    lock = (root / "uv.lock").read_text().replace('name = "demo"', 'name = "mypkg"')
    (root / "uv.lock").write_text(lock.replace('source = { virtual = "." }', 'source = { editable = "." }'))
    return root, built


def backend_wheels(directory: Path) -> bool:
    """setuptools' wheel as Python bundles it (ensurepip), and ``wheel`` with its dependencies
    (what that setuptools asks for an editable build) from pip's configured index: this
    machine's own. False when pip cannot have them (no index reachable)."""
    import ensurepip

    directory.mkdir(parents=True, exist_ok=True)
    for bundled in (Path(ensurepip.__file__).parent / "_bundled").glob("setuptools-*.whl"):
        shutil.copyfile(bundled, directory / bundled.name)
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--retries", "0",
                           "--timeout", "10", "-d", str(directory), "wheel"], capture_output=True, check=False)
    return done.returncode == 0 and any(directory.glob("setuptools-*.whl"))
