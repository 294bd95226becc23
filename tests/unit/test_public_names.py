"""The package's public face: what dir() and help() show before anything is loaded."""

from __future__ import annotations

import pydoc
import subprocess
import sys

import pytest

import torchherd


def test_dir_lists_the_public_api_before_it_is_loaded() -> None:
    names = dir(torchherd)
    for name in ("Cluster", "Run", "DetachedRun", "RecoveringRun", "attach", "runs", "Plan", "RunSummary",
                 "CheckReport", "events", "TorchherdError", "__version__"):
        assert name in names, name
    assert set(torchherd.__all__) <= set(names)


def test_help_names_every_public_name() -> None:
    text = pydoc.render_doc(torchherd, renderer=pydoc.plaintext)
    missing = [name for name in torchherd.__all__ if name != "__version__" and f"``{name}" not in text]
    assert missing == [], missing


def test_importing_the_package_loads_neither_rich_nor_the_api() -> None:
    code = "import sys, torchherd; dir(torchherd); print(sorted(m for m in ('rich', 'torchherd.api') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


RUN_ONLY = ("torchherd.engine.events", "torchherd.engine.run", "torchherd.engine.recovery.runner",
            "torchherd.engine.records", "torchherd.engine.ssh.launch", "torchherd.engine.ssh.job",
            "torchherd.engine.prepare.staging", "torchherd.console.run", "torchherd.console.collapse",
            "torchherd.runlog", "torchherd.tree")


@pytest.mark.parametrize("output", [[], ["--json"]])
def test_check_loads_none_of_a_runs_modules(output: list[str]) -> None:
    """A run's events, records and launch are a third of what a start imported (issue 43):
    ``check`` never needs them, with its grid or its JSON."""
    code = ("import sys\n"
            "from torchherd.cli import main\n"
            f"code = main(['check', '-H', 'localhost', '--only', 'ssh', *{output!r}])\n"
            f"print(sorted(m for m in {RUN_ONLY!r} if m in sys.modules), code, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stderr.strip().splitlines()[-1] == "[] 0", done.stderr
