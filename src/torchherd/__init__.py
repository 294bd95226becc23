"""torchherd: run one PyTorch distributed job on many machines from one command.

The public API (``torchherd docs api``)::

    import torchherd
    cluster = torchherd.Cluster.from_toml("hosts.toml")
    run = cluster.launch(cluster.plan("train.py", nproc_per_node=2))
    print(run.wait().headline)

Names are loaded on first use, so ``torchherd --help`` stays fast and a library
user never imports rich. The public names:

- ``Cluster``: the hosts (``from_toml``, ``from_hosts``, ``from_nodelist``, ``from_file``),
  ``check``, ``plan``, ``launch``.
- ``Run``, ``DetachedRun``, ``RecoveringRun``: what ``launch`` returns; ``runs()`` and
  ``attach(run_id)`` find detached runs again (``damaged_runs()``: the records that could
  not be read); ``new_run_id()``.
- ``Plan``: each node's exact command; ``Recovery``: retries, spares, minimum nodes, the
  checkpoint staged and replicated (``Bandwidth``: the cap on a replica's copy).
- ``RunSummary``, ``NodeOutcome``, ``AttemptRecord``, ``OutputLine``: how a run ended, and
  its lines; ``CheckReport``, ``CheckResult``: what the preflight found.
- ``events``: the typed events an observer (``on_event``) receives; ``events_of(run_id)``:
  a run's history, those events and its nodes' samples with their times; ``report(run_id,
  path)``: that history as one self-contained HTML page (``pip install 'torchherd[report]'``).
- ``TorchherdError`` (``UsageError``, ``TransportError``), ``LaunchAborted``,
  ``DetachedStartFailed``: what can go wrong, each with a hint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_API = {
    "Cluster": "torchherd.api", "Run": "torchherd.api", "DetachedRun": "torchherd.api", "runs": "torchherd.api",
    "damaged_runs": "torchherd.api",
    "attach": "torchherd.api", "new_run_id": "torchherd.api", "LaunchAborted": "torchherd.api",
    "DetachedStartFailed": "torchherd.api", "Plan": "torchherd.plan", "RunSummary": "torchherd.runlog",
    "NodeOutcome": "torchherd.runlog", "OutputLine": "torchherd.runlog", "CheckReport": "torchherd.checks.results",
    "CheckResult": "torchherd.checks.results", "TorchherdError": "torchherd.errors", "UsageError": "torchherd.errors",
    "TransportError": "torchherd.errors", "events": "torchherd.engine.events", "Recovery": "torchherd.inventory",
    "Bandwidth": "torchherd.inventory", "RecoveringRun": "torchherd.api", "AttemptRecord": "torchherd.runlog",
    "report": "torchherd.api", "events_of": "torchherd.api",
}
__all__ = sorted(_API) + ["__version__"]

if TYPE_CHECKING:  # the names __getattr__ loads, for type checkers and editors
    from torchherd.api import (  # noqa: F401
        Cluster,
        DetachedRun,
        DetachedStartFailed,
        LaunchAborted,
        RecoveringRun,  # noqa: F401
        Run,
        attach,
        damaged_runs,
        events_of,
        new_run_id,
        report,
        runs,
    )
    from torchherd.checks.results import CheckReport, CheckResult  # noqa: F401
    from torchherd.engine import events  # noqa: F401
    from torchherd.errors import TorchherdError, TransportError, UsageError  # noqa: F401
    from torchherd.inventory import Bandwidth, Recovery  # noqa: F401
    from torchherd.plan import Plan  # noqa: F401
    from torchherd.runlog import AttemptRecord, NodeOutcome, OutputLine, RunSummary  # noqa: F401


def __dir__() -> list[str]:
    """The public API too (loaded on first use, so not yet in the module's namespace)."""
    return sorted(set(globals()) | set(__all__))


def __getattr__(name: str) -> Any:
    import importlib

    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'torchherd' has no attribute {name!r}")
    if name == "events":
        return importlib.import_module(module)
    return getattr(importlib.import_module(module), name)
