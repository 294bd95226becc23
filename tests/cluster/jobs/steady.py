"""A steady distributed job: every ``--step`` seconds the ranks all_reduce (gloo, CPU)
and each prints ``--lines`` lines (``step N rank R ...``), for ``--seconds`` seconds, then
exits 0. What detection's tests run while they cut a link, load a node or stall the
terminal: its ranks keep talking to each other, and its output keeps coming."""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--step", type=float, default=0.2)
    parser.add_argument("--lines", type=int, default=1)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pad = "." * 80
    step, ends = 0, time.monotonic() + args.seconds
    # rank 0 decides when to stop, so that every rank leaves the loop at the same step
    while True:
        more = torch.tensor([1.0 if time.monotonic() < ends else 0.0])
        dist.broadcast(more, 0)
        if not more.item():
            break
        total = torch.tensor([float(rank)])
        dist.all_reduce(total)
        for line in range(args.lines):
            print(f"step {step} rank {rank} line {line} sum {int(total.item())} {pad}", flush=True)
        step += 1
        time.sleep(args.step)
    print(f"rank {rank} done after {step} steps on pid {os.getpid()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
