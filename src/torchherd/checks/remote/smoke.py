"""torchherd smoke job: one rank of a tiny real job under torchrun.

Standard library and torch only. Run by torchrun on every node as
``smoke.py TIMEOUT BACKENDS`` (BACKENDS: "gloo" or "gloo,nccl"). Every step prints
one line ``torchherd-smoke STEP RANK ...`` so the controller can tell which ranks
started, which joined the process group and which finished:
  start RANK HOST    the rank runs (the node's torchrun passed the rendezvous)
  joined RANK        init_process_group returned
  gathered RANK C,C  zlib.crc32 of every rank's hostname, in rank order
  nccl RANK          the NCCL all_reduce was right
  error RANK TEXT    what went wrong (then exit 1)
  ok RANK            everything worked
"""

import datetime
import os
import socket
import sys
import traceback
import zlib
from typing import Any, List

MARK = "torchherd-smoke"


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
        if "nccl" in backends:
            nccl_all_reduce(dist, torch, world)
            say("nccl", rank)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as error:
        text = " ".join(("%s: %s" % (type(error).__name__, error)).split())
        say("error", rank, text[:500])
        traceback.print_exc()
        sys.exit(1)
    say("ok", rank)


main()
