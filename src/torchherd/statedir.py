"""This machine's torchherd state directory: ``$XDG_STATE_HOME/torchherd`` (default
``~/.local/state/torchherd``): the run records, the measured links, the imports of torch."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping


def state_dir(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    base = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "torchherd"
