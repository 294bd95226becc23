"""Stands in for ``torchrun --redirects 3 --log-dir DIR``: starts one worker per local rank
with torchrun's environment (RANK, LOCAL_RANK, TORCHELASTIC_RESTART_COUNT), each writing
straight to DIR/<id>_<random>/attempt_0/<local rank>/{stdout,stderr}.log, and exits with
the highest worker exit code.

    fake_redirects.py DIR base=4 nproc=2 lines=3 bar=5 linger=0.5 anonymous=0

``bar``: redraws of a progress bar on stderr (``\\r`` each), then a newline. ``linger``:
seconds each worker stays alive before it prints. ``anonymous=1``: the workers carry
no RANK (their global rank cannot be learned).
"""

import os
import subprocess
import sys
import time


def worker(spec):
    rank = os.environ.get("RANK", "?")
    time.sleep(float(spec.get("linger", "0.5")))
    for index in range(int(spec.get("lines", "3"))):
        sys.stdout.write("line %d from rank %s\n" % (index, rank))
    sys.stdout.flush()
    steps = int(spec.get("bar", "0"))
    for step in range(steps + 1 if steps else 0):
        sys.stderr.write("\rrank %s %3d%%|%s" % (rank, step * 100 // max(steps, 1), "#" * step))
        sys.stderr.flush()
        time.sleep(0.1)
    if steps:
        sys.stderr.write("\n")
    sys.stdout.write("no newline at the end from rank %s" % rank)


def main():
    if sys.argv[1] == "--worker":
        worker(dict(arg.split("=", 1) for arg in sys.argv[2:]))
        return 0
    log_dir, args = sys.argv[1], sys.argv[2:]
    spec = dict(arg.split("=", 1) for arg in args)
    attempt = os.path.join(log_dir, "none_x1y2", "attempt_0")
    workers = []
    for local in range(int(spec.get("nproc", "2"))):
        os.makedirs(os.path.join(attempt, str(local)))
    for local in range(int(spec.get("nproc", "2"))):
        env = dict(os.environ, LOCAL_RANK=str(local), TORCHELASTIC_RESTART_COUNT="0")
        if spec.get("anonymous") != "1":
            env["RANK"] = str(int(spec.get("base", "0")) + local)
        folder = os.path.join(attempt, str(local))
        with open(os.path.join(folder, "stdout.log"), "w") as out, open(os.path.join(folder, "stderr.log"), "w") as err:
            workers.append(subprocess.Popen([sys.executable, __file__, "--worker"] + args, stdout=out, stderr=err,
                                            env=env))
    print("fake torchrun: %d workers" % len(workers), flush=True)
    return max(worker.wait() for worker in workers)


if __name__ == "__main__":
    sys.exit(main())
