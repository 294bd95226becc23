"""``smoke``: a real tiny job on every node, started exactly as ``run`` starts one.

The plan comes from ``plan.build_plan`` with the preflight's networks; the engine
runs it quietly (the same supervisor, teardown and output parsing as ``run``) and
hands back what it saw. The script (remote/smoke.py, as ``gather.node_program`` ships
every node script) is written into the run's directory under /tmp by the same SSH command that starts the job, and removed
afterwards (``cleanup_command``). What each rank printed, and how each node's part
ended, is judged in ``smoke_verdicts``.
"""

from __future__ import annotations

import secrets
import shlex
import time
from dataclasses import replace

from torchherd.checks.analysis.smoke import SmokeContext, SmokeRun, smoke_verdicts
from torchherd.checks.gather import node_program
from torchherd.checks.model import Observed
from torchherd.checks.results import CheckResult
from torchherd.plan import NodePlan, Plan, RunOptions, build_plan

INIT_TIMEOUT = 30
"""Seconds: init_process_group's timeout, and the c10d rendezvous join/read timeouts."""
JOB_TIMEOUT = 60.0
"""Seconds: the controller stops every node after this, whatever the job is doing."""


def unreachable(observed: Observed, connected: set[str]) -> list[CheckResult]:
    """Skips for every node when the job cannot start everywhere; empty when it can."""
    missing = [host.name for host in observed.inventory.hosts if host.name not in connected]
    if not missing:
        return []
    return [CheckResult(host.name, "smoke", "skip", f"not run: no SSH connection to {', '.join(missing)}")
            for host in observed.inventory.hosts]


def verdicts(observed: Observed, ran: SmokeRun, seconds: float) -> list[CheckResult]:
    """What the engine's quiet run of ``smoke_plan`` shows, node by node."""
    context = SmokeContext(observed.inventory, _hostnames(observed), backends(observed), JOB_TIMEOUT, seconds)
    return smoke_verdicts(context, ran)


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
    args = (str(INIT_TIMEOUT), ",".join(backends(observed)))
    # NCCL's channel lines say which transport it chose (analysis.smoke reads them).
    nccl_env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"} if "nccl" in backends(observed) else {}
    options = RunOptions(script="smoke.py", script_args=args, run_id=run_id, extra_env=nccl_env)
    plan = build_plan(observed.inventory, options, observed.networks, observed.ssh_hostnames)
    if plan.rdzv_backend == "c10d":  # the static rendezvous takes no --rdzv-conf (build_plan refuses it)
        options = replace(options, rdzv_conf=f"join_timeout={INIT_TIMEOUT},read_timeout={INIT_TIMEOUT}")
        plan = build_plan(observed.inventory, options, observed.networks, observed.ssh_hostnames)
    return replace(plan, nodes=tuple(_writing_script(node) for node in plan.nodes))


def script_dir(node: NodePlan) -> str:
    """Where the node's copy of the script goes: its own directory (nodes may share a /tmp)."""
    return f"{node.remote_log_dir}-smoke"


def _writing_script(node: NodePlan) -> NodePlan:
    """The node writes the script first, into a directory only it can have made, and runs that copy."""
    directory = script_dir(node)
    script = f"{directory}/smoke.py"
    # mkdir without -p, mode 0700: a directory another user made first (to swap the script) is refused.
    write = (f"mkdir -m 700 {shlex.quote(directory)} && "
             f"printf '%s' {shlex.quote(node_program('smoke.py'))} > {shlex.quote(script)}")
    setup = f"{node.setup.strip()}\n{write}" if node.setup.strip() else write
    torchrun = replace(node.torchrun, script=script)
    return replace(node, setup=setup, argv=torchrun.argv(), torchrun=torchrun)


def cleanup_command(node: NodePlan) -> str:
    """Removes the smoke script's directory (the supervisor removes torchrun's own, which it made)."""
    return f"rm -rf {shlex.quote(script_dir(node))}"
