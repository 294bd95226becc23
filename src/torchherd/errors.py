"""The one public exception root, and the exit codes the CLI maps it to.

Exit codes are part of the command-line contract (torchherd docs cli):
0 all good; 1 a check or the job failed; 2 usage or inventory error; 130 interrupted.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class TorchherdError(Exception):
    """Root of every error torchherd raises on purpose.

    ``str(error)`` is a one-line message meant for the user; ``hint`` is the next
    step to take, shown after it.
    """

    exit_code = EXIT_FAILED

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


class UsageError(TorchherdError):
    """The command line asks for something impossible."""

    exit_code = EXIT_USAGE


class InventoryError(UsageError):
    """The inventory file is missing or wrong; the message names the file and key."""


class Unplaceable(TorchherdError):
    """The scheduler refused the job because it could never place it as asked (SLURM:
    "Requested node configuration is not available"), not because it is busy now."""


class TransportError(TorchherdError):
    """SSH could not reach, authenticate to, or run a command on a node."""

    def __init__(self, node: str, kind: str, message: str, hint: str = "") -> None:
        super().__init__(message, hint)
        self.node = node
        self.kind = kind
        if kind == "ssh-config":  # the user's file is wrong, as an inventory can be: a usage error
            self.exit_code = EXIT_USAGE
