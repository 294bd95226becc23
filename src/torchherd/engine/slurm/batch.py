"""The batch script a plan becomes for SLURM, and the allocation ``check`` asks for
in its shape.

Pure: no processes, no sockets, no clock; ``--dry-run`` prints the script. Every value
that reaches a shell goes through ``shlex.quote``; the job's environment is exported
inside the script (a 0600 file), never on a command line.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, replace
from typing import Sequence

from torchherd.engine.slurm.container import PYXIS_RUNTIMES, node_run_command, pyxis_options, uses_pyxis
from torchherd.engine.slurm.settings import SlurmSettings
from torchherd.errors import UsageError
from torchherd.inventory.nodeset import expand
from torchherd.plan import NodePlan, Plan, Torchrun, looks_secret, node_log_dir
from torchherd.remote import program
from torchherd.remote.container import NAME_PREFIX, RUNTIMES, ContainerSpec
from torchherd.shell import quote_path

BATCH_SCRIPT = "job.sbatch"


BATCH_OUTPUT = "batch.out"
"""What the batch step itself prints (srun's own errors): in the run directory."""


OUT, ERR, EXIT = ".out", ".err", ".exit"
"""Per node, in the run directory: its stdout, its stderr, and how its torchrun ended."""


RUNS_DIR = "~/.torchherd/runs"
"""On the submit host: ``<this>/<run-id>/``. It must be on a filesystem the nodes share
(SLURM's own output files need the same), as home directories on clusters are."""

# The variables the node command reads; the batch script sets them for every task.


DIR_VAR = "TORCHHERD_DIR"


MASTER_VAR = "TORCHHERD_MASTER_ADDR"


@dataclass(frozen=True)
class Placement:
    """Which nodes SLURM is asked for: a count, a nodeset, or both."""

    nodes: int | None
    nodelist: str | None
    source: str
    """Where it came from, for --dry-run and errors."""


@dataclass(frozen=True)
class BatchJob:
    """The job as SLURM gets it: the script, and where it goes on the submit host."""

    run_id: str
    script: str
    run_dir: str
    placement: Placement
    notes: tuple[str, ...]
    options: tuple[str, ...] = ()
    """The script's ``#SBATCH`` options (an allocation for check asks for the same)."""
    exclude: tuple[str, ...] = ()
    """Nodes sbatch is told to leave out (``--exclude``): a recovering run's excluded nodes."""
    node_range: str | None = None
    """``--nodes=K-N`` on sbatch's command line (over the script's ``--nodes=N``): an attempt
    of a recovering run where SLURM picks the nodes may start on fewer (``--min-nodes``)."""

    def as_json(self) -> dict[str, object]:
        """``run --dry-run --json`` (``engine.backend.Description``): the script with secrets as ***."""
        return {"run_id": self.run_id, "scheduler": "slurm", "batch_script": shown_script(self),
                "run_dir": self.run_dir, "notes": list(self.notes)}

    def text(self) -> tuple[tuple[str, str], ...]:
        """What ``run --dry-run`` prints (``engine.backend.Description``): the batch script SLURM
        would get (secrets as ***), and why each choice was made."""
        return (("title", f"run {self.run_id}: SLURM batch script ({self.run_dir}/{BATCH_SCRIPT}), "
                          "submitted with sbatch --parsable"),
                # the job's arguments and environment as given, its lines kept
                ("", shown_script(self).rstrip("\n")),
                *(("note", f"  - {note}") for note in self.notes),
                ("", "dry run: nothing was submitted"))


def run_dir(run_id: str, attempt: int = 0) -> str:
    """The run's directory on the submit host; an attempt after the first gets one of its
    own inside it, so that no file of an earlier attempt (its ``.exit`` records above all)
    is read as this attempt's."""
    return f"{RUNS_DIR}/{run_id}" + (f"/attempt-{attempt}" if attempt > 1 else "")


_EXCLUDE = re.compile(r"^(?:--exclude[= ]|-x ?)(?P<nodes>\S+)$")


def for_attempt(job: BatchJob, attempt: int, exclude: Sequence[str], shrink_to: int | None = None) -> BatchJob:
    """``job`` as attempt ``attempt`` of a run with retries submits it: its own run
    directory, ``exclude`` for sbatch's ``--exclude``, and where SLURM picks ``N`` nodes
    and the run may shrink, ``--nodes=shrink_to-N``. An ``--exclude`` of ``[slurm].extra``
    is kept in it: sbatch's command line overrides the script's."""
    count = job.placement.nodes
    node_range = f"{shrink_to}-{count}" if shrink_to is not None and count is not None and shrink_to < count else None
    given = [match.group("nodes") for match in map(_EXCLUDE.match, job.options) if match is not None]
    excluded = tuple(dict.fromkeys([*given, *exclude])) if exclude else job.exclude
    return replace(job, run_dir=run_dir(job.run_id, attempt), exclude=excluded, node_range=node_range)


def attempt_settings(settings: SlurmSettings, exclude: Sequence[str]) -> SlurmSettings:
    """``[slurm]`` for an attempt of a recovering run where SLURM picks the nodes: the
    excluded nodes out of ``nodelist`` (sbatch refuses a node both listed and excluded),
    and the node count fixed where only ``nodelist`` gave it, so that SLURM picks a
    replacement for each node left out instead of starting on fewer."""
    if settings.nodelist is None or not exclude:
        return settings
    listed = expand(settings.nodelist)
    kept = [node for node in listed if node not in exclude]
    return replace(settings, nodelist=",".join(kept) or None,
                   nodes=settings.nodes if settings.nodes is not None else len(listed))


def picked_count(settings: SlurmSettings) -> int | None:
    """How many nodes SLURM is asked to pick (``[slurm].nodes``, else the size of
    ``nodelist``); None when the inventory's hosts name them."""
    if settings.nodes is not None:
        return settings.nodes
    return len(expand(settings.nodelist)) if settings.nodelist is not None else None


def placement(plan: Plan, settings: SlurmSettings) -> Placement:
    """``[slurm].nodes``/``nodelist`` when given; else the inventory's hosts, by name."""
    if settings.nodes is not None or settings.nodelist is not None:
        return Placement(settings.nodes, settings.nodelist, "[slurm]")
    names = [node.host.name for node in plan.nodes]
    return Placement(len(names), ",".join(names), "the inventory's hosts")


def _with_own_pull(node: NodePlan) -> ContainerSpec | None:
    """The node's container with the host's pull policy: over SSH the run pulls before its
    launch (engine/prepare/pull.py) and the container never does; a SLURM task has no such step,
    so its container pulls as the inventory says."""
    spec = node.container
    if spec is None or node.host.container is None:
        return spec
    return spec._replace(pull=node.host.container.pull)


def batch_job(plan: Plan, settings: SlurmSettings, fail_fast: bool = True, pyxis: bool | None = False,
              warm: bool = False) -> BatchJob:
    """The batch script for ``plan``: one task per node, each running the plan's torchrun
    with SLURM's node id as its node rank. With a container: inside it, through pyxis
    (``pyxis``: the submit host's srun lists ``--container-image``), else with the runtime
    found on each node; None: not asked (``--dry-run``), the runtime's script with a note.
    ``warm`` (``LaunchOptions.warm_start``): torchrun, where it runs on the node's own
    python, starts warm (``remote/zygote.py``'s ``start``: torch imported once, its ranks
    forked). Raises UsageError for what SLURM cannot run."""
    where = placement(plan, settings)
    nodes = plan.nodes if where.source != "[slurm]" else plan.nodes[:1]
    _same_everywhere(nodes)
    spec = _with_own_pull(nodes[0])
    in_pyxis = spec is not None and uses_pyxis(spec, bool(pyxis))
    notes = [f"nodes: {_describe(where)} (from {where.source}); node_rank = $SLURM_NODEID, "
             f"master = the first node of the allocation"]
    options = sbatch_options(plan, settings, where, notes)
    step: list[str] = []
    if spec is not None and in_pyxis:
        step = pyxis_options(spec, nodes[0].workdir, notes)
    elif spec is not None:
        notes.append(f"container: {spec.runtime} on each node (the first of {', '.join(RUNTIMES)} found there for "
                     f"auto), named {NAME_PREFIX}{plan.run_id}-<node>-<job id>, removed when the task ends or is "
                     "cancelled" + ("; where srun --help lists --container-image (pyxis), srun runs the image "
                                    "instead (asked at submission)" if pyxis is None and spec.runtime in
                                    PYXIS_RUNTIMES else ""))
    lines = ["#!/bin/bash"] + [f"#SBATCH {option}" for option in options] + [
        f"# torchherd run {plan.run_id}: {one_line(shlex.join((plan.options.script, *plan.options.script_args)))}",
        "# Made by torchherd (torchherd docs slurm). The job's environment is in this file only (0600),",
        "# never on a command line.",
    ]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in nodes[0].env.items()]
    lines += [f'export {DIR_VAR}="$SLURM_SUBMIT_DIR"', _master_line(plan)]
    srun = ["srun", f"--kill-on-bad-exit={1 if fail_fast else 0}", "--ntasks-per-node=1",
            '--nodes="$SLURM_JOB_NUM_NODES"', '${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"}',
            f'--output="${DIR_VAR}/%N{OUT}"', f'--error="${DIR_VAR}/%N{ERR}"', *step, "bash", "-c",
            shlex.quote(node_command(plan, nodes, in_pyxis, warm))]
    lines.append(" ".join(srun))
    return BatchJob(plan.run_id, "\n".join(lines) + "\n", run_dir(plan.run_id), where, tuple(notes), tuple(options))


def one_line(text: str) -> str:
    """``text`` for a comment line of the script: a line break (or any character that is
    not printable) shown escaped, so that an argument can never end the comment and put
    a line of its own (``#SBATCH ...``) among the script's directives."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def _describe(where: Placement) -> str:
    parts = ([f"{where.nodes}"] if where.nodes is not None else []) + ([where.nodelist] if where.nodelist else [])
    return " on ".join(parts)


def _same_everywhere(nodes: Sequence[NodePlan]) -> None:
    """One script runs on every node: what differs per host cannot be honoured (but
    the process count, which the node command picks by the node's name)."""
    first = nodes[0]
    for node in nodes[1:]:
        for key, mine, theirs in (("python", node.host.python, first.host.python),
                                  ("workdir", node.workdir, first.workdir), ("setup", node.setup, first.setup),
                                  ("env", dict(node.env), dict(first.env)),
                                  ("container", _unnamed(node), _unnamed(first))):
            if mine != theirs:
                raise UsageError(f"{node.host.name}: {key} differs from {first.host.name}'s; a SLURM job runs "
                                 "the same command on every node",
                                 f"set {key} once, in [defaults]")


def _unnamed(node: NodePlan) -> object:
    """The node's container but its node-scoped name (one script names it per node)."""
    return node.container._replace(name="") if node.container is not None else None


def sbatch_options(plan: Plan, settings: SlurmSettings, where: Placement, notes: list[str]) -> list[str]:
    options = [f"--job-name=torchherd-{plan.run_id}", "--ntasks-per-node=1", f"--output={BATCH_OUTPUT}"]
    if where.nodes is not None:
        options.append(f"--nodes={where.nodes}")
    if where.nodelist is not None:
        options.append(f"--nodelist={_word('nodelist', where.nodelist)}")
    for key, value in (("partition", settings.partition), ("account", settings.account),
                       ("time", settings.time)):
        if value is not None:
            options.append(f"--{key}={_word(key, value)}")
    if settings.gpus_per_node is not None:
        options.append(f"--gpus-per-node={settings.gpus_per_node}")
    nproc = plan.nproc_per_node
    if isinstance(nproc, int) and not any(re.match(r"(--cpus-per-task|-c)\b", item) for item in settings.extra):
        # One task per node runs every rank of the node: it needs a CPU for each.
        options.append(f"--cpus-per-task={nproc}")
        notes.append(f"--cpus-per-task={nproc}: the node's one task runs its {nproc} ranks "
                     "(more with extra = [\"--cpus-per-task=N\"])")
    for item in settings.extra:
        if "\n" in item or "\r" in item:
            raise UsageError(f"[slurm].extra: {item!r} holds a line break", "one sbatch option per item")
    return options + list(settings.extra)


def _word(key: str, value: str) -> str:
    if not value or any(char.isspace() for char in value):
        raise UsageError(f"[slurm].{key}: {value!r} is empty or holds whitespace", f"give {key} as SLURM writes it")
    return value


def _master_line(plan: Plan) -> str:
    given = plan.options.master_addr or plan.inventory.cluster.master_addr
    if given:
        return f"export {MASTER_VAR}={shlex.quote(given)}"
    return f'export {MASTER_VAR}="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"'


# Each replaced torchrun option, and the shell word SLURM's task fills in.


_SLURM_VALUES = {"--node-rank": '"$SLURM_NODEID"', "--master-addr": f'"${MASTER_VAR}"'}


def node_command(plan: Plan, nodes: Sequence[NodePlan], in_pyxis: bool = False, warm: bool = False) -> str:
    """What each task runs: the plan's cd, setup and torchrun (node rank, master and node
    count from SLURM; started warm with ``warm`` where no container runs it), then its exit
    status into ``<node>.exit`` for the controller. With a container and no pyxis, torchrun
    runs in it with the runtime the node has (the cd and setup on the node); pyxis runs the
    whole task in the image."""
    first = nodes[0]
    parts = ["\n".join(_nproc_case(nodes))] if _uneven(nodes) else []
    # torchrun would take an existing directory as its own: on a shared /tmp another user
    # could have made it first (its name, with the job id, is public). mktemp -d makes a
    # fresh, random, private one, atomically: never theirs, and never a reason to fail.
    parts.append('logs="$(mktemp -d "$logs-XXXXXXXXXX")" && logs_made=1')
    parts.append(f"cd {quote_path(first.workdir)}")
    if first.setup.strip():
        parts.append("{ " + first.setup.strip() + "\n}")
    words = torchrun_words(plan, first)
    if warm and first.container is None:
        words[1:1] = ["-c", shlex.quote(program("zygote.py")), "start"]
    if first.container is not None and not in_pyxis:
        inside = node_run_command(_with_own_pull(first) or first.container, words, list(first.env), first.workdir)
        parts.append("{ phase=job\n" + inside + "\n}")
    else:
        parts.append("{ phase=job; " + " ".join(words) + "; }")
    return "\n".join([
        "phase=setup",
        f"logs={_log_dir_word(plan)}",
        " && ".join(parts),
        "code=$?",
        'if [ -n "${logs_made-}" ]; then rm -rf "$logs"; fi',  # only the directory it made
        f'printf "%s %s %s\\n" "$phase" "$code" "$(date +%s.%N)" > "${DIR_VAR}/$SLURMD_NODENAME{EXIT}"',
        'exit "$code"'])


def _log_dir_word(plan: Plan) -> str:
    """The plan's torchrun log directory with the node's name as SLURM gives it (nodes
    that share a /tmp, the test cluster or a node with several tasks, each have their
    own) and the job's id: each attempt of a run with retries is a job of its own, and a
    task that SLURM killed never removed its directory (the mkdir must not meet it)."""
    return shlex.quote(node_log_dir(plan.run_id, "")) + '"$SLURMD_NODENAME-$SLURM_JOB_ID"'


def _uneven(nodes: Sequence[NodePlan]) -> bool:
    return len({str(node.nproc_per_node) for node in nodes}) > 1


def _nproc_case(nodes: Sequence[NodePlan]) -> list[str]:
    arms = [f"  {shlex.quote(node.host.name)}) nproc={shlex.quote(str(node.nproc_per_node))} ;;" for node in nodes]
    return ['case "$SLURMD_NODENAME" in', *arms,
            '  *) echo "torchherd: $SLURMD_NODENAME is not in the inventory" >&2; false ;;', "esac"]


def torchrun_words(plan: Plan, node: NodePlan) -> list[str]:
    """The node's torchrun command as shell words, from its settings: quoted values, and
    SLURM's own variables where each node differs (node rank, master, node count).
    ``--local-addr`` is left out: it names an inventory host, and SLURM picks the hosts."""
    torchrun = node.torchrun
    words = [quote_path(torchrun.python), "-m", "torch.distributed.run"]
    for option, value in torchrun.options():
        replaced = _replace(plan, torchrun, option, value)
        words += [shlex.quote(option), shlex.quote(value)] if replaced is None else list(replaced)
    return words + [shlex.quote(word) for word in torchrun.target()]


def _replace(plan: Plan, torchrun: Torchrun, option: str, value: str) -> tuple[str, ...] | None:
    """The option and its new value as shell words (``()`` drops it); None: keep as is."""
    given_master = bool(plan.options.master_addr or plan.inventory.cluster.master_addr)
    if option == "--local-addr":
        return ()
    if option == "--log-dir":
        return option, '"$logs"'
    if option == "--nnodes" and not plan.options.nnodes:
        return option, '"$SLURM_JOB_NUM_NODES"'
    if option == "--nproc-per-node" and _uneven(plan.nodes):
        return option, '"$nproc"'
    if option == "--node-rank" or (option == "--master-addr" and not given_master):
        return option, _SLURM_VALUES[option]
    if option == "--rdzv-endpoint" and not given_master:
        return option, f'"${MASTER_VAR}:{plan.port}"'
    if option == "--rdzv-conf":
        # Only the user's settings: is_host=1 is the SSH plan's word for its rank-0 node;
        # SLURM's first node is the endpoint by name, which torch recognises as its own.
        return (option, shlex.quote(torchrun.rdzv_conf)) if torchrun.rdzv_conf else ()
    return None


def shown_script(job: BatchJob) -> str:
    """The script as ``--dry-run`` prints it: variables named like a secret show ***."""
    def hide(line: str) -> str:
        match = re.match(r"export ([A-Za-z_][A-Za-z0-9_]*)=", line)
        if match and looks_secret(match.group(1)):
            return f"export {match.group(1)}=***"
        return line
    return "\n".join(hide(line) for line in job.script.splitlines()) + "\n"


def submit_command(job: BatchJob) -> str:
    """Writes the script from stdin into a new 0600 file of a new 0700 run directory and
    submits it (with ``--exclude`` when the job leaves nodes out); prints the job id
    (``sbatch --parsable``)."""
    directory = quote_path(job.run_dir)
    exclude = f"{shlex.quote('--exclude=' + ','.join(job.exclude))} " if job.exclude else ""
    nodes = f"{shlex.quote('--nodes=' + job.node_range)} " if job.node_range else ""
    return (f"umask 077 && mkdir -p {directory} && cd {directory} && set -C && cat > {BATCH_SCRIPT} && "
            f"sbatch --parsable {exclude}{nodes}{BATCH_SCRIPT}")


ALLOCATION_TIME = "5"
"""Minutes an allocation for check asks for, when [slurm].time says nothing."""


def salloc_command(job: BatchJob, wait: int) -> str:
    """An allocation like the job's own (same nodes, partition, account, GPUs), with no
    shell, for ``check``'s steps; SLURM gives up after ``wait`` seconds (--immediate)."""
    kept = [option for option in job.options if not option.startswith(("--job-name=", "--output="))]
    if not any(option.startswith(("--time=", "-t")) for option in kept):
        kept.append(f"--time={ALLOCATION_TIME}")
    return shlex.join(["salloc", "--no-shell", f"--immediate={int(wait)}", f"--job-name=torchherd-check-{job.run_id}",
                       *kept])
