"""A job whose step time is measured, that saves one checkpoint: each step a few matrix
products and an all_reduce (gloo, CPU), rank 0 printing ``STEP N START END`` (wall clock);
at step ``--save-at`` rank 0 writes ``--mb`` MB of random bytes to ``--path`` (aside, then
renamed into place, as a careful job saves), and the loop goes on for ``--seconds`` seconds
in all, then exits 0. What replication's cluster test copies while it runs.

``--until-copied-on RANK``: the loop also goes on until RANK's node holds the whole file (the
replica, renamed into place complete) and ``--after-copy`` seconds more, ``--at-most`` seconds
in all: a copy kept to the job's pace on a loaded machine may take longer than the job would
have run, and the controller reads the copy's end from the relays after the rename (a run that
ends first gives the copy up, unreported)."""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist


def holds(path: str, mb: int) -> bool:
    try:
        return os.path.getsize(path) == mb << 20
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--save-at", type=int, default=50)
    parser.add_argument("--mb", type=int, default=8)
    parser.add_argument("--path", default="paced.ckpt")
    parser.add_argument("--until-copied-on", type=int, default=None, metavar="RANK")
    parser.add_argument("--after-copy", type=float, default=5.0)
    parser.add_argument("--at-most", type=float, default=120.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    weights, grads = torch.randn(128, 128), torch.randn(1 << 16)
    step, ends, latest = 0, time.time() + args.seconds, time.time() + args.at_most
    held_since: float | None = None
    while True:
        started = time.time()
        for _ in range(4):
            weights = torch.tanh(weights @ weights) * 0.5
        dist.all_reduce(grads)
        if args.until_copied_on == rank and held_since is None and holds(args.path, args.mb):
            held_since = time.time()
        copied = held_since is not None and time.time() - held_since >= args.after_copy
        waiting = torch.tensor([1.0 if args.until_copied_on == rank and not copied else 0.0])
        dist.all_reduce(waiting)
        now = time.time()
        more = torch.tensor([1.0 if now < ends or (waiting.item() and now < latest) else 0.0])
        dist.broadcast(more, 0)
        if rank == 0:
            print(f"STEP {step} {started:.6f} {time.time():.6f}", flush=True)
            if step == args.save_at:
                with open(args.path + ".tmp", "wb") as file:
                    file.write(os.urandom(args.mb << 20))
                os.replace(args.path + ".tmp", args.path)
        step += 1
        if not more.item():
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
