"""Every rank prints many numbered lines as fast as it can (log completeness tests).

    torchherd run -- examples/chatty.py 50000

Each line is ``chatty <rank> <i>``; a ``\\r`` progress line at the end checks that
carriage returns do not garble the output.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    rank = os.environ.get("RANK", "?")
    out = sys.stdout
    for index in range(count):
        out.write(f"chatty {rank} {index}\n")
    out.write("progress 10%\rprogress 50%\rprogress 100%\n")
    out.flush()


if __name__ == "__main__":
    main()
