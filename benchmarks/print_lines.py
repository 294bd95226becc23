"""Log-throughput payload: print N numbered lines as fast as possible."""

import os
import sys

count = int(sys.argv[1])
rank = os.environ.get("RANK", "?")
out = sys.stdout
for index in range(count):
    out.write(f"rank {rank} line {index} the quick brown fox jumps over the lazy dog\n")
out.flush()
