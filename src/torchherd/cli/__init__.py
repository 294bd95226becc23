"""Command line: parse, call the library, render. ``main(argv) -> int`` is callable from tests.

Exit codes (the public contract, torchherd docs cli): 0 all good; 1 a check or the job
failed; 2 usage or inventory error; 130 interrupted.

``dispatch``: ``main``, and every ending mapped to its exit code; ``parser``: the commands
and their flags; one module per command group (``init``, ``hosts``, ``check``, ``run``,
``runs``: status, logs, attach, stop); ``cluster``: which hosts; ``flags``: the flag groups
commands share; ``values``: the value converters; ``contract``: the JSON documents.
"""

from torchherd.cli.dispatch import entry, main
from torchherd.cli.parser import build_parser

__all__ = ["build_parser", "entry", "main"]
