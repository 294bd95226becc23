"""A uv-locked project as both ends see it (standard library only, Python >= 3.8): the
files that make it one, the hash a node's venv is keyed by, and the marker a built venv
holds. The controller (``tree``, ``plan``), the venv builder (``venv.py``) and the
checks' facts script import these, so the two ends cannot disagree on a key.
"""

from __future__ import annotations

import hashlib
import os
from typing import Optional

UV_FILES = ("pyproject.toml", "uv.lock")
"""What makes the synced project a uv-locked one, and what its environment is keyed by."""
MARKER = ".torchherd-venv"
"""The file a built venv holds (written last, atomically): its key, the uv and python that built it."""


def uv_lock_hash(project: str) -> Optional[str]:
    """The SHA-256 of the project's ``pyproject.toml`` and ``uv.lock`` (each file's name and
    length, then its bytes), or None when it lacks either: what a node's venv is keyed by, so
    an edited lock (or project table) builds a new venv and an unchanged one reuses its own."""
    digest = hashlib.sha256()
    for name in UV_FILES:
        try:
            with open(os.path.join(project, name), "rb") as file:
                data = file.read()
        except OSError:
            return None
        digest.update(f"{name} {len(data)}\n".encode())
        digest.update(data)
    return digest.hexdigest()
