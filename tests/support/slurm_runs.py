"""The SLURM runs' directories on the submit host (``~/.torchherd/runs/<run id>``, the
batch script inside), which a SLURM test removes afterwards: only its own cluster's, never
those of a SLURM run that a test of another module runs beside it on the other worker
(removing that run's directory while its tasks still wrote their exit files there left the
run waiting for a node forever)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slurmcluster import SlurmCluster

RUNS = Path.home() / ".torchherd" / "runs"


def run_ids(slurm: SlurmCluster, state_home: Path) -> set[str]:
    """The runs this cluster's SLURM ran (each job is named ``torchherd-<run id>``; slurmctld
    remembers a job for MinJobAge, five minutes), and those the test's own run history
    names (``<id>.json``, ``<id>.controller.lock``): a run stopped before it submitted."""
    jobs = slurm.client("scontrol", "show", "job", "-o", check=False).stdout
    history = state_home / "torchherd" / "runs"
    return set(re.findall(r"\bJobName=torchherd-(\S+)", jobs)) | (
        {path.name.split(".", 1)[0] for path in history.iterdir()} if history.is_dir() else set())


def remove_run_dirs(slurm: SlurmCluster, state_home: Path) -> None:
    for run_id in run_ids(slurm, state_home):
        directory = RUNS / run_id
        if any(directory.glob("job.sbatch")) or any(directory.glob("attempt-*/job.sbatch")):
            shutil.rmtree(directory, ignore_errors=True)
