"""A DDP job that says where it runs: its rank, the world, the node's hostname, the test
image's mark (/etc/torchherd-mark exists only inside the image), its uid:gid, and the owner
of a file it writes into the workdir (it must be the SSH user's, not the image's user), and
whether torch was imported before it began (forked from a warm torchrun: ``preloaded True``)."""

from __future__ import annotations

import os
import socket
import sys

PRELOADED = "torch" in sys.modules

import torch  # noqa: E402 - after the look at what was imported before
import torch.distributed as dist  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    path = f"written-by-rank-{rank}"
    with open(path, "w") as f:
        f.write("x")
    owner = os.stat(path)
    os.unlink(path)
    mark = os.path.exists("/etc/torchherd-mark")
    print(f"rank {rank} of {world} on {socket.gethostname()} in-image {mark} uid {os.getuid()}:{os.getgid()} "
          f"file {owner.st_uid}:{owner.st_gid} sum {total.item():g} preloaded {PRELOADED}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
