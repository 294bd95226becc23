"""Prints ``repr()`` of the environment variables named on the command line, one per line.

    torchherd run --env 'X=a b' -- examples/env_echo.py X

Used to check that values reach every rank byte for byte.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    for name in sys.argv[1:]:
        print(f"{name}={os.environ.get(name)!r}")


if __name__ == "__main__":
    main()
