"""``smoke``: a real tiny job on every node, started exactly as ``run`` starts one.

The plan comes from ``plan.build_plan`` with the preflight's networks, the job from
``launch.run_quietly`` (the same supervisor, teardown and output parsing). The
script (remote/smoke.py) is written into the run's directory under /tmp by the
same SSH command that starts the job, and removed afterwards. What each rank
printed, and how each node's part ended, is judged in ``smoke_verdicts``.
"""

from __future__ import annotations

import secrets
import shlex
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Mapping

from torchherd.checks.gather import remote_source
from torchherd.checks.model import Observed
from torchherd.checks.analysis.smoke import SmokeContext, SmokeRun, smoke_verdicts
from torchherd.plan import NodePlan, Plan, RunOptions, build_plan
from torchherd.results import CheckResult
from torchherd.transport import Connection

INIT_TIMEOUT = 30
"""Seconds: init_process_group's timeout, and the c10d rendezvous join/read timeouts."""
JOB_TIMEOUT = 60.0
"""Seconds: the controller stops every node after this, whatever the job is doing."""


def run_smoke(observed: Observed, connections: Mapping[str, Connection]) -> list[CheckResult]:
    missing = [host.name for host in observed.inventory.hosts if host.name not in connections]
    if missing:
        return [CheckResult(host.name, "smoke", "skip", f"not run: no SSH connection to {', '.join(missing)}")
                for host in observed.inventory.hosts]
    from torchherd.launch import run_quietly

    plan = smoke_plan(observed)
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="torchherd-smoke-") as log_dir:
            ran = run_quietly(plan, connections, Path(log_dir), JOB_TIMEOUT)
    finally:
        _clean(plan, connections)
    context = SmokeContext(observed.inventory, _hostnames(observed), backends(observed), JOB_TIMEOUT,
                           time.monotonic() - started)
    return smoke_verdicts(context, SmokeRun(ran.summary, ran.lines, ran.timed_out))


def backends(observed: Observed) -> tuple[str, ...]:
    """gloo always; NCCL as well when every node has a GPU torch can use."""
    gpus = [int((facts.get("torch") or {}).get("gpus") or 0) for facts in observed.facts.values()]
    everyone = len(gpus) == len(observed.inventory.hosts)
    return ("gloo", "nccl") if everyone and all(count > 0 for count in gpus) else ("gloo",)


def _hostnames(observed: Observed) -> dict[str, str]:
    return {name: str(facts.get("hostname")) for name, facts in observed.facts.items() if facts.get("hostname")}


def smoke_plan(observed: Observed) -> Plan:
    """``run``'s plan for the smoke script, each node writing the script first."""
    run_id = time.strftime("th-smoke-%Y%m%d-%H%M%S-") + secrets.token_hex(3)
    script = f"/tmp/torchherd-{run_id}/smoke.py"
    options = RunOptions(script=script, script_args=(str(INIT_TIMEOUT), ",".join(backends(observed))),
                         run_id=run_id, rdzv_conf=f"join_timeout={INIT_TIMEOUT},read_timeout={INIT_TIMEOUT}")
    plan = build_plan(observed.inventory, options, observed.networks)
    return replace(plan, nodes=tuple(_writing_script(node, script) for node in plan.nodes))


def _writing_script(node: NodePlan, script: str) -> NodePlan:
    directory = script.rsplit("/", 1)[0]
    write = (f"mkdir -p {shlex.quote(directory)} && "
             f"printf '%s' {shlex.quote(remote_source('smoke.py'))} > {shlex.quote(script)}")
    setup = f"{node.setup.strip()}\n{write}" if node.setup.strip() else write
    return replace(node, setup=setup)


def _clean(plan: Plan, connections: Mapping[str, Connection]) -> None:
    def remove(node: NodePlan) -> None:
        try:
            connections[node.host.name].run(f"rm -rf {shlex.quote(node.remote_log_dir)}", timeout=10.0)
        except Exception:  # a node that went away keeps its /tmp files; the verdict says why
            pass

    with ThreadPoolExecutor(max_workers=max(1, len(plan.nodes))) as pool:
        list(pool.map(remove, plan.nodes))
