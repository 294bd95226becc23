"""Stands in for torchrun in the engine's unit tests: prints rank lines as torchrun's
``--tee`` does (``[torchherd-rank N] text``), then sleeps and exits as told.

Arguments are KEY=VALUE: ranks=0,1  lines=3  stderr=TEXT  sleep=SECONDS  exit=CODE
"""

import signal
import sys
import time

spec = dict(arg.split("=", 1) for arg in sys.argv[1:])
ranks = [int(rank) for rank in spec.get("ranks", "0").split(",")]
for index in range(int(spec.get("lines", "1"))):
    for rank in ranks:
        print(f"[torchherd-rank {rank}] line {index} from rank {rank}", flush=True)
if "stderr" in spec:
    print(f"[torchherd-rank {ranks[0]}] {spec['stderr']}", file=sys.stderr, flush=True)
if spec.get("ignore_term") == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(float(spec.get("sleep", "0")))
sys.exit(int(spec.get("exit", "0")))
