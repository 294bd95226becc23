"""A job whose rank 1 breaks its own node in attempt 1: it drops every packet it sends
to the master port (iptables, in the node's own namespace), then fails. The triage's
port and firewall checks must find the node bad and exclude it."""

from __future__ import annotations

import os
import subprocess
import time

import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ["TORCHHERD_ATTEMPT"])
    print(f"rank {rank} of {dist.get_world_size()} in attempt {attempt}", flush=True)
    if attempt == 1 and rank == 1:
        port = os.environ["MASTER_PORT"]
        subprocess.run(["iptables", "-A", "OUTPUT", "-p", "tcp", "--dport", port, "-j", "DROP"], check=True)
        raise RuntimeError("block_master_port: this node can no longer reach the master port")
    time.sleep(1)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
