"""torchherd smoke job: one rank of a tiny real job under torchrun.

Standard library and torch only. Run by torchrun on every node as
``smoke.py TIMEOUT BACKENDS`` (BACKENDS: "gloo" or "gloo,nccl"). Every step prints
one line ``torchherd-smoke STEP RANK ...`` so the controller can tell which ranks
started, which joined the process group and which finished:
  start RANK HOST    the rank runs (the node's torchrun passed the rendezvous)
  joined RANK        init_process_group returned
  gathered RANK C,C  zlib.crc32 of every rank's hostname, in rank order
  nccl RANK          the NCCL all_reduce was right
  busbw RANK BACKEND BYTES GBIT   (rank 0) an all_reduce of BYTES: its bus bandwidth,
                     algorithm bandwidth x 2(n-1)/n as nccl-tests define it, in Gbit/s
  pair RANK FROM TO GBIT          (the receiving node's local rank 0) FROM's local rank 0
                     sent BYTES to TO's (node ranks), alone with nothing else in flight
  rdma RANK COUNT ACTIVE  (local rank 0) RDMA devices in /sys/class/infiniband on this
                     node, and how many of their ports are ACTIVE
  error RANK TEXT    what went wrong (then exit 1)
  ok RANK            everything worked
"""

import datetime
import os
import socket
import sys
import time
import traceback
import zlib
from typing import Any, List

MARK = "torchherd-smoke"
SIZES = (1 << 20, 8 << 20, 32 << 20)
"""Bytes of the bus-bandwidth all_reduces: latency-bound, then bandwidth-bound."""
PAIR_BYTES = 16 << 20
ITERATIONS = 3
SIZE_BUDGET = 3.0
"""Seconds the next size's all_reduces may be expected to take: on a slow link the larger
sizes are left out (the figure is already plain, and the job must end in its timeout)."""
PAIR_SECONDS = 0.5
"""What one pair's transfer should take at the rate the all_reduces found, at most PAIR_BYTES."""


def say(*words: object) -> None:
    print(MARK, *words, flush=True)


def all_reduce_sum(dist: Any, torch: Any, rank: int, world: int) -> None:
    value = torch.tensor([rank + 1], dtype=torch.int64)
    dist.all_reduce(value)
    expected = world * (world + 1) // 2
    if int(value.item()) != expected:
        raise RuntimeError("gloo all_reduce sum is %d, expected %d" % (int(value.item()), expected))


def gather_hosts(dist: Any, torch: Any, host: str, world: int) -> List[str]:
    mine = torch.tensor([zlib.crc32(host.encode("utf-8"))], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return [str(int(item.item())) for item in every]


def nccl_all_reduce(dist: Any, torch: Any, world: int) -> None:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    group = dist.new_group(backend="nccl")
    value = torch.ones(1, device="cuda")
    dist.all_reduce(value, group=group)
    torch.cuda.synchronize()
    if int(value.item()) != world:
        raise RuntimeError("nccl all_reduce sum is %d, expected %d" % (int(value.item()), world))


def bus_bandwidth(dist: Any, torch: Any, rank: int, world: int, backend: str, group: Any = None) -> float:
    """Each size's all_reduce timed over ITERATIONS after one warm-up; rank 0 says the bus
    bandwidth (nothing on one rank: 2(n-1)/n is 0). A size that would take more than
    SIZE_BUDGET at the rate of the one before is left out, as all ranks agree (the
    slowest rank's time). Returns the bytes per second a node's link carried, so
    measured (infinite on one rank)."""
    device = "cuda" if backend == "nccl" else "cpu"
    rate = float("inf")
    for index, size in enumerate(SIZES):
        tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
        dist.all_reduce(tensor, group=group)
        dist.barrier(group=group)
        started = time.perf_counter()
        for _ in range(ITERATIONS):
            dist.all_reduce(tensor, group=group)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - started) / ITERATIONS
        if rank == 0 and world > 1:
            say("busbw", rank, backend, size, "%.4f" % (size * 8 / seconds / 1e9 * 2 * (world - 1) / world))
        slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        seconds = max(float(slowest.item()), 1e-9)
        if world > 1:
            rate = size * 2 * (world - 1) / world / seconds
        following = SIZES[index + 1] if index + 1 < len(SIZES) else None
        if following is None or seconds * following / size * (ITERATIONS + 1) > SIZE_BUDGET:
            return rate
    return rate


def leaders(dist: Any, torch: Any, world: int) -> List[int]:
    """The global rank of each node's local rank 0, in node-rank order."""
    mine = torch.tensor([int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("GROUP_RANK", "0"))])
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    found = sorted((int(item[1]), index) for index, item in enumerate(every) if int(item[0]) == 0)
    return [index for _, index in found]


def pair_bandwidth(dist: Any, torch: Any, rank: int, heads: List[int], link_rate: float = float("inf")) -> None:
    """Around the ring of nodes, each node's leader sends PAIR_BYTES to the next one's, one
    pair at a time (every rank waits at the barrier): the receiver says the rate. Fewer
    bytes where the all_reduces found slow links (``link_rate``, bytes per second, the
    same on every rank): about PAIR_SECONDS per pair, 1 MiB at least."""
    count = len(heads)
    size = int(min(PAIR_BYTES, max(1 << 20, link_rate * PAIR_SECONDS))) // 4 * 4
    buffer = torch.ones(size // 4, dtype=torch.float32)
    for node in range(count if count > 2 else count - 1):
        sender, receiver = heads[node], heads[(node + 1) % count]
        dist.barrier()
        started = time.perf_counter()
        if rank == sender:
            dist.send(buffer, receiver)
        elif rank == receiver:
            dist.recv(buffer, sender)
            gbit = size * 8 / (time.perf_counter() - started) / 1e9
            say("pair", rank, node, (node + 1) % count, "%.4f" % gbit)


def rdma_devices() -> "tuple[int, int]":
    """The RDMA devices, and their ports whose state is ACTIVE (a device with no link
    cannot carry NCCL's traffic, so sockets there are no fallback)."""
    base = "/sys/class/infiniband"
    try:
        devices = os.listdir(base)
    except OSError:
        return 0, 0
    active = 0
    for device in devices:
        try:
            ports = os.listdir(os.path.join(base, device, "ports"))
        except OSError:
            continue
        for port in ports:
            try:
                with open(os.path.join(base, device, "ports", port, "state")) as file:
                    active += "ACTIVE" in file.read()
            except OSError:
                continue
    return len(devices), active


def main() -> None:
    timeout, backends = float(sys.argv[1]), sys.argv[2].split(",")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host = socket.gethostname()
    say("start", rank, host)
    try:
        import torch  # type: ignore[import-not-found,unused-ignore]
        import torch.distributed as dist  # type: ignore[import-not-found,unused-ignore]

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
        say("joined", rank)
        all_reduce_sum(dist, torch, rank, world)
        say("gathered", rank, ",".join(gather_hosts(dist, torch, host, world)))
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            say("rdma", rank, *rdma_devices())
        link_rate = bus_bandwidth(dist, torch, rank, world, "gloo")
        pair_bandwidth(dist, torch, rank, leaders(dist, torch, world), link_rate)
        if "nccl" in backends:
            nccl_all_reduce(dist, torch, world)
            say("nccl", rank)
            bus_bandwidth(dist, torch, rank, world, "nccl", dist.new_group(backend="nccl"))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as error:
        text = " ".join(("%s: %s" % (type(error).__name__, error)).split())
        say("error", rank, text[:500])
        traceback.print_exc()
        sys.exit(1)
    say("ok", rank)


main()
# Leave without the interpreter's shutdown (output flushed first): gloo's worker
# threads may still be releasing the last collective's tensors, which takes the GIL
# that a finalizing interpreter no longer gives, and the thread dies inside a C++
# destructor: "terminate called without an active exception", SIGABRT, a failed
# rank after its last line, which would fail a healthy check.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
