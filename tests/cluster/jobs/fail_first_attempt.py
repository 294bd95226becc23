"""A job whose rank ``--fail-rank`` fails in attempt 1 of a run with retries
(``TORCHHERD_ATTEMPT`` = 1) and in no later one. Every other rank of a failing attempt
ticks on for a minute, so only the teardown ends it; in a later attempt every rank prints
``tick RANK I`` ``--count`` times and exits 0. No torch import: the box is small.

``--exit-code C``: the failing rank exits with C instead of raising (1). ``--every-attempt``:
every attempt fails, on the next rank each time (attempt 2 on ``--fail-rank`` + 1), with
the same error: a bug in the job, not a bad node."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--count", type=int, default=3)
    parser.add_argument("--exit-code", type=int, default=None)
    parser.add_argument("--every-attempt", action="store_true")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    attempt = int(os.environ["TORCHHERD_ATTEMPT"])
    print(f"rank {rank} in attempt {attempt} on {socket.gethostname()}", flush=True)
    failing = attempt == 1 or args.every_attempt
    if failing and rank == (args.fail_rank + attempt - 1) % int(os.environ["WORLD_SIZE"]):
        time.sleep(1)
        if args.exit_code is not None:
            print(f"rank {rank} exits with code {args.exit_code} on purpose", file=sys.stderr, flush=True)
            sys.exit(args.exit_code)
        raise RuntimeError("fail_first_attempt: failing on purpose")
    for index in range(600 if failing else args.count):
        print(f"tick {rank} {index}", flush=True)
        time.sleep(0.1)


if __name__ == "__main__":
    main()
