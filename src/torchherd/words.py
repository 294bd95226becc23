"""Small helpers for the words torchherd prints: no "1 nodes" anywhere."""

from __future__ import annotations


def count(number: int, noun: str, plural: str | None = None) -> str:
    """``1 node``, ``2 nodes``, ``0 nodes`` (``plural`` where adding an s is wrong)."""
    return f"{number} {noun if number == 1 else plural or noun + 's'}"


def size(count: int) -> str:
    """Bytes as people say them: "12.3 MB", "512 B"."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"
