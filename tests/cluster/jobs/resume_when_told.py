"""A job that resumes only when told, as nanoGPT's ``train.py`` does with
``--init_from=resume``: every rank prints what it was given (its arguments,
``TORCHHERD_ATTEMPT``, ``TORCHHERD_CHECKPOINT``) as ``given {json}``; told to resume, it
reads the checkpoint ``--ckpt`` and fails without it (FileNotFoundError, as nanoGPT on a
first start). In attempt 1 rank 0 writes the checkpoint into its node's workdir and then
exits 3 (the other ranks tick on until the teardown); a later attempt ends 0. No torch
import: the box is small."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--init_from", default="scratch")
    args = parser.parse_args()
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHHERD_ATTEMPT"])
    print("given " + json.dumps({"rank": rank, "argv": sys.argv[1:], "attempt": attempt,
                                 "checkpoint": os.environ.get("TORCHHERD_CHECKPOINT")}), flush=True)
    if args.init_from == "resume":
        with open(args.ckpt, encoding="utf-8") as file:
            print(f"rank {rank} resumed from step {file.read().strip()}", flush=True)
    if attempt > 1:
        return
    if rank == 0:
        with open(args.ckpt + ".part", "w", encoding="utf-8") as file:
            file.write("7\n")
        os.replace(args.ckpt + ".part", args.ckpt)
        print("rank 0 saved step 7, and fails", file=sys.stderr, flush=True)
        sys.exit(3)
    time.sleep(120)


if __name__ == "__main__":
    main()
