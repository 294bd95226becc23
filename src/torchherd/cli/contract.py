"""The JSON contract: every ``--json`` command prints one document on stdout, ``schema``
first, in success and in failure alike (torchherd docs cli)."""

from __future__ import annotations

import argparse
import json
from typing import Sequence

JSON_SCHEMA = 1
"""The ``schema`` of every JSON document the CLI prints: raised only when a key changes
meaning or goes (keys are added without a change)."""


def emit(args: argparse.Namespace, document: dict[str, object]) -> None:
    """Prints ``document`` as the command's one JSON document on stdout, ``schema`` first."""
    print(json.dumps({"schema": JSON_SCHEMA, **document}, indent=2))
    args.json_printed = True


def json_wanted(args: argparse.Namespace | None, argv: Sequence[str]) -> bool:
    """Whether the command promised one JSON document on stdout: ``--json`` parsed, or,
    where parsing failed, ``--json`` among the words before ``--``."""
    if args is not None:
        return bool(getattr(args, "json", False))
    words = list(argv)
    return "--json" in (words[:words.index("--")] if "--" in words else words)


def failure_json(error: BaseException, exit_code: int) -> dict[str, object]:
    """The one JSON document of a command that ended without its result: the error and its
    hint as the terminal shows them, and for an aborted launch the checks or nodes behind it."""
    from torchherd.api import LaunchAborted

    message = "interrupted" if isinstance(error, KeyboardInterrupt) else str(error)
    document: dict[str, object] = {"ok": False, "exit_code": exit_code, "error": message,
                                   "hint": getattr(error, "hint", "")}
    if isinstance(error, LaunchAborted):
        if error.report is not None:
            document["checks"] = error.report.as_json()["checks"]
        if error.errors:
            document["unreachable"] = [{"node": failure.node, "kind": failure.kind, "error": str(failure),
                                        "hint": failure.hint} for failure in error.errors]
    return document
