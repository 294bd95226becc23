"""A tqdm progress bar on every rank of a small gloo job, meant to be started by torchrun.

Each rank steps through ``--epochs`` x ``--steps``: an all_reduce per step (so the ranks
move together), a tqdm bar redrawn with ``\\r``, and at each epoch's end one line that
every rank prints alike (the loss is averaged over the ranks):

    epoch 1/2: mean loss 0.5123

    torchherd run -- examples/tqdm_demo.py --epochs 2 --steps 40

Uses tqdm when the node has it, else a stand-in that draws the same way (standard
library only).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist


class PlainBar:
    """Enough of tqdm for this demo: ``\\r`` + the bar on stderr, a newline at the end."""

    def __init__(self, iterable: Iterable[int], total: int, desc: str, **_: Any) -> None:
        self.iterable, self.total, self.desc, self.postfix = iterable, total, desc, ""
        self.started, self.closed = time.monotonic(), False

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def __iter__(self) -> Iterator[int]:
        for done, item in enumerate(self.iterable):
            self._draw(done)
            yield item
        self._draw(self.total)
        self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            sys.stderr.write("\n")

    def _draw(self, done: int) -> None:
        filled = 20 * done // max(1, self.total)
        rate = done / max(1e-9, time.monotonic() - self.started)
        sys.stderr.write(f"\r{self.desc}: {100 * done // max(1, self.total):3d}%|{'#' * filled:<20}| "
                         f"{done}/{self.total} [{rate:.1f}it/s, {self.postfix}]")
        sys.stderr.flush()


def progress(iterable: Iterable[int], total: int, desc: str) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return PlainBar(iterable, total, desc)
    return tqdm(iterable, total=total, desc=desc, mininterval=0.2, ascii=True, ncols=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--delay", type=float, default=0.05, help="seconds of work per step (a sleep)")
    parser.add_argument("--compute", type=int, default=0, metavar="N",
                        help="N products of 128x128 matrices per step instead of the sleep: real work, "
                             "which a node with less CPU does more slowly (a straggler)")
    parser.add_argument("--seconds", type=float, default=0.0, metavar="S",
                        help="end the epoch once S seconds have passed (rank 0's clock, told to every rank in "
                             "the step's all_reduce), --steps at most: a run as long on a slow node as on a fast one")
    args = parser.parse_args()
    # One thread per rank: torchrun sets OMP_NUM_THREADS=1 only with several ranks per
    # node, and a rank's threads spinning for CPUs its peers need make every step crawl.
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank}/{world} on {os.uname().nodename}: {args.epochs} epochs of {args.steps} steps", flush=True)
    loss = torch.tensor(1.0 + rank / 10)
    matrix = torch.full((128, 128), 1.0 / 128)
    for epoch in range(1, args.epochs + 1):
        started = time.monotonic()
        bar = progress(range(args.steps), args.steps, f"rank {rank} epoch {epoch}")
        for _ in bar:
            if args.compute:
                product = matrix
                for _ in range(args.compute):
                    product = product @ matrix
            else:
                time.sleep(args.delay)
            loss = loss * 0.97
            # The loss and rank 0's verdict on the time travel together: every rank leaves
            # the epoch after the same step, so no rank waits in an all_reduce alone.
            out_of_time = float(rank == 0 and args.seconds > 0 and time.monotonic() - started >= args.seconds)
            both = torch.stack([loss, torch.tensor(out_of_time)])
            dist.all_reduce(both)
            mean = both[0] / world
            bar.set_postfix_str(f"loss={mean.item():.4f}")
            if both[1].item() > 0:
                break
        bar.close()
        print(f"epoch {epoch}/{args.epochs}: mean loss {mean.item():.4f}", flush=True)
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
