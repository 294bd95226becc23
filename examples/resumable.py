"""A training job that survives a lost node: it checkpoints every few steps and resumes.

    torchherd run --retries 2 --spares node3 -- examples/resumable.py --steps 40

A tiny linear regression on CPU (gloo): every rank draws its batch from a generator
seeded by (step, rank), so the run's loss depends only on the step and the world size,
never on which attempt computed it. Every ``--ckpt-every`` steps each node's local rank
0 writes the model to ``<ckpt-dir>/<run id>/step-<N>.pt`` in its workdir (atomically).
On start, the ranks agree on the newest checkpoint any node holds and that node's rank
sends it to the others: a spare that joins with an empty workdir resumes too. A run that
lost a node on the way therefore ends with the same final loss as one that did not.

``--fail-step S --fail-rank R --fail-attempt A``: rank R raises at step S in attempt A
(``TORCHHERD_ATTEMPT``; 0: every attempt); ``--fail-rank attempt`` picks the rank equal
to the attempt number, so the same error comes from another node each time; with
``--fail-hang`` the other ranks sleep at that step, so only the failing rank errs.
``--hang-rank R --hang-step S``: rank R sleeps at step S, the others wait for it in
``all_reduce`` (what ``--hang-timeout`` finds).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

IMPORTING = time.time()

import torch  # noqa: E402 - after the clock: --timing says what the import took
import torch.distributed as dist  # noqa: E402

IMPORTED = time.time()

FEATURES = 8


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step * 100_003 + rank)
    inputs = torch.randn(32, FEATURES, generator=generator)
    target = inputs @ torch.arange(1.0, FEATURES + 1.0) + 0.5
    return inputs, target


def save(directory: Path, step: int, model: torch.nn.Linear) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step-{step}.pt"
    temporary = directory / f".step-{step}.pt.{os.getpid()}"
    torch.save({"step": step, "model": model.state_dict()}, temporary)
    os.replace(temporary, final)  # a node killed mid-write leaves no half checkpoint


def newest(directory: Path) -> int:
    steps = [int(path.stem.split("-")[1]) for path in directory.glob("step-*.pt")] if directory.is_dir() else []
    return max(steps, default=0)


def resume(directory: Path, model: torch.nn.Linear) -> int:
    """The step to start from: the newest checkpoint of any node, sent by its holder."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.tensor([newest(directory)], dtype=torch.int64)
    best = mine.clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX)
    step = int(best.item())
    if step == 0:
        return 0
    holder = torch.tensor([rank if int(mine.item()) == step else world], dtype=torch.int64)
    dist.all_reduce(holder, op=dist.ReduceOp.MIN)
    if rank == int(holder.item()):
        model.load_state_dict(torch.load(directory / f"step-{step}.pt")["model"])
    for parameter in model.parameters():
        dist.broadcast(parameter.data, src=int(holder.item()))
    return step


def process_started() -> float:
    """When this process began (fork or exec), as wall-clock time: /proc's start tick."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    since = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - since


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument("--ckpt-dir", default="checkpoints")
    parser.add_argument("--step-seconds", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--fail-step", type=int, default=-1)
    parser.add_argument("--fail-rank", default="-1")
    parser.add_argument("--fail-attempt", type=int, default=0)
    parser.add_argument("--fail-exit", type=int, default=0, help="exit with this code instead of raising")
    parser.add_argument("--hang-rank", type=int, default=-1, help="this rank stops at --hang-step and sleeps")
    parser.add_argument("--hang-step", type=int, default=-1)
    parser.add_argument("--fail-hang", action="store_true",
                        help="the other ranks stop at the failing step and sleep (none fails of the failure)")
    parser.add_argument("--timing", action="store_true",
                        help="each rank prints when its process started, imported torch and joined the group")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    if args.timing:
        print(f"timing rank {os.environ.get('RANK')}: process {process_started():.3f} importing {IMPORTING:.3f} "
              f"imported {IMPORTED:.3f} joined {time.time():.3f}", flush=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHHERD_ATTEMPT", "1"))
    run_id = os.environ.get("TORCHHERD_RUN_ID", "local")
    directory = Path(args.ckpt_dir) / run_id
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    start = resume(directory, model)
    fail_rank = attempt % world if args.fail_rank == "attempt" else int(args.fail_rank)
    print(f"rank {rank} of {world}, attempt {attempt}, starting at step {start}", flush=True)
    loss = torch.zeros(())
    for step in range(start, args.steps):
        if rank == args.hang_rank and step == args.hang_step:
            time.sleep(100_000)  # the others wait for it in the next all_reduce: a hung job
        failing = step == args.fail_step and args.fail_attempt in (0, attempt)
        if failing and rank != fail_rank and args.fail_hang:
            while True:
                time.sleep(1)
        if failing and rank == fail_rank:
            if args.fail_exit:
                print(f"resumable: rank {rank} exits with {args.fail_exit}", flush=True)
                os._exit(args.fail_exit)
            raise RuntimeError(f"resumable: failing on purpose at step {step}")
        inputs, target = batch(step, rank)
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs).squeeze(1), target)
        loss.backward()
        for parameter in model.parameters():
            assert parameter.grad is not None
            dist.all_reduce(parameter.grad)
            parameter.grad /= world
        with torch.no_grad():
            for parameter in model.parameters():
                parameter -= args.lr * parameter.grad  # type: ignore[operator]
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step} loss {total.item() / world:.6f}", flush=True)
        if (step + 1) % args.ckpt_every == 0 and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            save(directory, step + 1, model)
        time.sleep(args.step_seconds)
    total = loss.detach().clone()
    dist.all_reduce(total)
    final = sum(float(parameter.detach().double().sum()) for parameter in model.parameters())
    if rank == 0:
        print(f"final loss {total.item() / world:.6f} weights {final:.6f}", flush=True)
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
