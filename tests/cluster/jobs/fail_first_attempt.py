"""A job whose rank ``--fail-rank`` fails in attempt 1 of a run with retries
(``TORCHHERD_ATTEMPT`` = 1) and in no later one. Every other rank of attempt 1 ticks on
for a minute, so only the teardown ends it; in a later attempt every rank prints
``tick RANK I`` ``--count`` times and exits 0. No torch import: the box is small."""

from __future__ import annotations

import argparse
import os
import socket
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--count", type=int, default=3)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    attempt = os.environ["TORCHHERD_ATTEMPT"]
    print(f"rank {rank} in attempt {attempt} on {socket.gethostname()}", flush=True)
    if attempt == "1" and rank == args.fail_rank:
        time.sleep(1)
        raise RuntimeError("fail_first_attempt: failing in attempt 1 on purpose")
    for index in range(args.count if attempt != "1" else 600):
        print(f"tick {rank} {index}", flush=True)
        time.sleep(0.1)


if __name__ == "__main__":
    main()
