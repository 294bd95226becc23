"""Every rank prints numbered lines slowly, with no collectives (detached-run tests).

    torchherd run --detach -- examples/ticker.py 100 0.1

Each line is ``tick <rank> <i>``. ``--exit-rank R --exit-at I --exit-code C``
makes rank R exit with code C before line I; the other ranks tick on, so only
a teardown from outside (fail fast) ends them early.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("count", type=int)
    parser.add_argument("interval", type=float)
    parser.add_argument("--exit-rank", type=int, default=-1)
    parser.add_argument("--exit-at", type=int, default=0)
    parser.add_argument("--exit-code", type=int, default=3)
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "-1"))
    for index in range(args.count):
        if rank == args.exit_rank and index == args.exit_at:
            print(f"rank {rank} exits with code {args.exit_code} on purpose", file=sys.stderr, flush=True)
            sys.exit(args.exit_code)
        print(f"tick {rank} {index}", flush=True)
        time.sleep(args.interval)


if __name__ == "__main__":
    main()
