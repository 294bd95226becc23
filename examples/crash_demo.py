"""A gloo job that all-reduces once per step, and can crash one rank on purpose.

    torchherd run -- examples/crash_demo.py --steps 20 --crash-rank 3 --crash-step 5

Every rank prints one line per step. ``--crash-rank R`` makes rank R raise at
``--crash-step``; the other ranks are then stuck in (or failing out of) the next
all_reduce, which is what torchherd's fail-fast teardown is for. With
``--crash-rank -1`` (the default) nobody crashes: a long run for interrupt tests.
``--hang`` makes the other ranks stop talking to each other at the crash step and
just sleep, as a rank stuck in I/O would: only a teardown from outside ends them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--crash-rank", type=int, default=-1)
    parser.add_argument("--crash-step", type=int, default=3)
    parser.add_argument("--step-seconds", type=float, default=0.2)
    parser.add_argument("--hang", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"rank {rank} of {dist.get_world_size()} on {os.uname().nodename} pid {os.getpid()}")
    for step in range(args.steps):
        if rank == args.crash_rank and step == args.crash_step:
            raise RuntimeError(f"crash_demo: rank {rank} crashes on purpose at step {step}")
        if args.hang and step == args.crash_step:
            print("hanging", flush=True)
            while True:
                time.sleep(1)
        value = torch.ones(1) * (rank + 1)
        dist.all_reduce(value)
        print(f"step {step} sum {value.item():.0f}")
        time.sleep(args.step_seconds)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without the interpreter's shutdown (output flushed first): gloo's worker
    # threads may still be releasing the last collective's tensors, which takes the GIL
    # that a finalizing interpreter no longer gives, and the thread dies inside a C++
    # destructor: "terminate called without an active exception", SIGABRT, a failed
    # rank after its last line (about 1 run in 20 of this demo with torch 2.13).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
