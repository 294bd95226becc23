"""A small real DDP training run, meant to be started by torchrun.

Every rank builds the same MLP (fixed seed) and trains it with
DistributedDataParallel on its own shard of one synthetic regression data
set. The loss printed is averaged over all ranks with all_reduce, so every
rank prints the same value:

    rank R/W host HOSTNAME step S loss L
    ...
    rank R done: loss FIRST -> LAST

Run on this machine, 2 ranks (`torchherd init --example-script` writes this file as train.py):

    torchherd run -H localhost --nproc-per-node 2 -- train.py
    python -m torch.distributed.run --standalone --nproc-per-node 2 train.py   # the same, by hand

Without torchrun it runs as a single rank on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

FEATURES = 16
HIDDEN = 64
SAMPLES = 4096
KEPT: list[object] = []
"""The DDP model, referenced until the process ends (the end of this file says why)."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--log-every", type=int, default=10, help="print every N steps")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def say(line: str) -> None:
    """One write per line: ranks share the pipe, so a line must not be split
    into the text and its newline (print does two writes when unbuffered)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def synthetic_data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same data set on every rank: y = sin(x . w1) + 0.5 * (x . w2) + noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    w1 = torch.randn(FEATURES, 1, generator=g) / FEATURES**0.5
    w2 = torch.randn(FEATURES, 1, generator=g) / FEATURES**0.5
    y = torch.sin(x @ w1) + 0.5 * (x @ w2) + 0.05 * torch.randn(SAMPLES, 1, generator=g)
    return x, y


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))

    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    host = socket.gethostname()

    torch.manual_seed(args.seed)
    model = nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, 1),
    ).to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    KEPT.append(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.MSELoss()

    x, y = synthetic_data(args.seed)
    x, y = x[rank::world].to(device), y[rank::world].to(device)
    g = torch.Generator().manual_seed(args.seed + 1000 + rank)

    first = last = float("nan")
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, x.shape[0], (args.batch_size,), generator=g).to(device)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x[idx]), y[idx])
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.SUM)
        last = mean.item() / world
        if step == 1:
            first = last
        if step % args.log_every == 0 or step == 1 or step == args.steps:
            say(f"rank {rank}/{world} host {host} step {step} loss {last:.6f}")

    say(f"rank {rank} done: loss {first:.6f} -> {last:.6f}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's shutdown (output flushed first): gloo's worker
    # threads may still be releasing the last collective's tensors, which takes the GIL
    # that a finalizing interpreter no longer gives, and the thread dies inside a C++
    # destructor: "terminate called without an active exception", SIGABRT, a failed
    # rank after its last line (about 1 run in 20 of this demo with torch 2.13). And without
    # freeing the DDP model (KEPT): freed as main() returns, it frees the gloo process group
    # with the GIL held, whose destructor joins gloo's worker thread while that thread may be
    # waiting for the GIL to free the last collective's tensors, and the rank never ends (4 of
    # 36 runs of this demo where torch._dynamo was imported before DDP, as torch.compile does).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
