"""Small helpers for the words torchherd prints: no "1 nodes" anywhere."""

from __future__ import annotations


def count(number: int, noun: str, plural: str | None = None) -> str:
    """``1 node``, ``2 nodes``, ``0 nodes`` (``plural`` where adding an s is wrong)."""
    return f"{number} {noun if number == 1 else plural or noun + 's'}"
