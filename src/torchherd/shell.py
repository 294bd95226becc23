"""Words for a remote POSIX shell: the quoting every layer shares (the plan's commands,
the transports' own, the checks' and the engine's)."""

from __future__ import annotations

import shlex


def quote_path(path: str) -> str:
    """Quotes a path for a remote shell but keeps a leading ``~`` expandable."""
    if path == "~":
        return "~"
    if path.startswith("~/"):
        return "~/" + shlex.quote(path[2:])
    return shlex.quote(path)
