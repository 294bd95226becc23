"""This machine's torchherd state directory: ``$XDG_STATE_HOME/torchherd`` (default
``~/.local/state/torchherd``): the run records, the measured links, the imports of torch."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping


def state_dir(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    base = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "torchherd"


def read_kept(path: Path, max_bytes: int) -> dict[str, Any]:
    """A JSON object kept there; a file that is missing, bigger than ``max_bytes``,
    damaged or not an object keeps nothing (what wrote it writes it anew)."""
    try:
        if path.stat().st_size > max_bytes:
            return {}
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}
