"""The observer nobody watches, apart from the event types (``engine.events``): ``check``
and the backends' signatures take it as a default without building the run's events."""

from __future__ import annotations


def ignore(event: object) -> None:
    """The observer of a run nobody watches."""
