"""examples/ddp_demo.py's training with its two library pieces written out: the gradients
averaged by one ``all_reduce`` of a flat bucket after each backward (what
DistributedDataParallel's reducer does), and SGD with momentum applied by hand (what
``torch.optim.SGD`` does). The same model, data and output lines as the demo, and the same
losses on every rank (measured: both end at 0.022924 with 2 ranks on one machine), for the
tests whose subject is how the job is reached (a topology, an alias, the API), not DDP.

Why: DDP's constructor and ``torch.optim``'s optimizers each import ``torch._dynamo``, 1.2-1.8
s of CPU per rank on this 2-core machine (torch's own import takes 1.5-2). The demo itself
still trains in test_run.py, the getting-started page, the API's documented example and
SLURM's 3x2 run.

    torchrun ... allreduce_demo.py [--steps N] [--log-every N]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

# The demo's model sizes, data and output, from the demo itself (importing it builds nothing).
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from ddp_demo import FEATURES, HIDDEN, say, synthetic_data  # noqa: E402

LR = 0.05
MOMENTUM = 0.9


def averaged_gradients(model: nn.Module, world: int) -> None:
    grads = [parameter.grad for parameter in model.parameters() if parameter.grad is not None]
    bucket = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(bucket, op=dist.ReduceOp.SUM)
    bucket /= world
    for grad, averaged in zip(grads, bucket.split([grad.numel() for grad in grads])):
        grad.copy_(averaged.view_as(grad))


@torch.no_grad()
def sgd_step(model: nn.Module, buffers: dict[int, torch.Tensor]) -> None:
    """torch.optim.SGD(lr=LR, momentum=MOMENTUM): the first step's buffer is the gradient."""
    for index, parameter in enumerate(model.parameters()):
        if parameter.grad is None:
            continue
        if index in buffers:
            buffers[index].mul_(MOMENTUM).add_(parameter.grad)
        else:
            buffers[index] = parameter.grad.clone()
        parameter.add_(buffers[index], alpha=-LR)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    host = socket.gethostname()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                          nn.Linear(HIDDEN, 1))
    for parameter in model.parameters():  # rank 0's weights everywhere, as DDP's constructor does
        dist.broadcast(parameter.data, src=0)
    buffers: dict[int, torch.Tensor] = {}
    loss_fn = nn.MSELoss()
    x, y = synthetic_data(0)
    x, y = x[rank::world], y[rank::world]
    g = torch.Generator().manual_seed(1000 + rank)

    first = last = float("nan")
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, x.shape[0], (args.batch_size,), generator=g)
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(x[idx]), y[idx])
        loss.backward()
        averaged_gradients(model, world)
        sgd_step(model, buffers)
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
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as the demo leaves: never through gloo's teardown at the interpreter's exit
