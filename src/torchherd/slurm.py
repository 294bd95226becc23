"""SLURM as data: the batch script a plan becomes, the commands that ask SLURM about
the job, and SLURM's answers parsed.

Pure: no processes, no sockets, no clock. ``engine.slurm`` runs what this renders
(on this machine or on the login host) and hands the answers back here; ``--dry-run``
prints the script. Every value that reaches a shell goes through ``shlex.quote``; the
job's environment is exported inside the script (a 0600 file), never on a command line.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

from torchherd.errors import UsageError
from torchherd.inventory import SlurmSettings
from torchherd.nodeset import NodesetError
from torchherd.nodeset import expand as expand_nodeset
from torchherd.plan import NodePlan, Plan, looks_secret, node_log_dir, quote_path
from torchherd.results import CLUSTER, CheckResult, CheckStatus

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

SQUEUE_FORMAT = "%i|%T|%D|%N|%r"
SACCT_FIELDS = "JobID,State,ExitCode,NodeList"
SINFO_FORMAT = "%N|%P|%a|%T|%c|%G|%E"

JobPhase = Literal["pending", "running", "ending", "done", "unknown"]
ACTIVE: dict[str, JobPhase] = {"PENDING": "pending", "CONFIGURING": "pending", "REQUEUED": "pending", "REQUEUE_HOLD": "pending",
          "REQUEUE_FED": "pending", "RESV_DEL_HOLD": "pending", "RUNNING": "running", "SUSPENDED": "running",
          "STOPPED": "running", "RESIZING": "running", "SIGNALING": "ending", "COMPLETING": "ending",
          "STAGE_OUT": "ending"}
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "SPECIAL_EXIT", "REVOKED")


def phase_of(state: str) -> JobPhase:
    """A SLURM job state (``CANCELLED by 0`` included) as the engine cares about it."""
    word = state.split()[0].rstrip("+") if state.strip() else ""
    if word in ACTIVE:
        return ACTIVE[word]
    return "done" if word in FINAL else "unknown"


# the batch script ------------------------------------------------------------------


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


def run_dir(run_id: str) -> str:
    return f"{RUNS_DIR}/{run_id}"


def placement(plan: Plan, settings: SlurmSettings) -> Placement:
    """``[slurm].nodes``/``nodelist`` when given; else the inventory's hosts, by name."""
    if settings.nodes is not None or settings.nodelist is not None:
        return Placement(settings.nodes, settings.nodelist, "[slurm]")
    names = [node.host.name for node in plan.nodes]
    return Placement(len(names), ",".join(names), "the inventory's hosts")


def batch_job(plan: Plan, settings: SlurmSettings, fail_fast: bool = True) -> BatchJob:
    """The batch script for ``plan``: one task per node, each running the plan's torchrun
    with SLURM's node id as its node rank. Raises UsageError for what SLURM cannot run."""
    where = placement(plan, settings)
    nodes = plan.nodes if where.source != "[slurm]" else plan.nodes[:1]
    _same_everywhere(nodes)
    notes = [f"nodes: {_describe(where)} (from {where.source}); node_rank = $SLURM_NODEID, "
             f"master = the first node of the allocation"]
    options = sbatch_options(plan, settings, where, notes)
    lines = ["#!/bin/bash"] + [f"#SBATCH {option}" for option in options] + [
        f"# torchherd run {plan.run_id}: {shlex.join((plan.options.script, *plan.options.script_args))}",
        "# Made by torchherd (docs/slurm.md). The job's environment is in this file only (0600),",
        "# never on a command line.",
    ]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in nodes[0].env.items()]
    lines += [f'export {DIR_VAR}="$SLURM_SUBMIT_DIR"', _master_line(plan)]
    srun = ["srun", f"--kill-on-bad-exit={1 if fail_fast else 0}", "--ntasks-per-node=1",
            '--nodes="$SLURM_JOB_NUM_NODES"', '${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"}',
            f'--output="${DIR_VAR}/%N{OUT}"', f'--error="${DIR_VAR}/%N{ERR}"', "bash", "-c",
            shlex.quote(node_command(plan, nodes))]
    lines.append(" ".join(srun))
    return BatchJob(plan.run_id, "\n".join(lines) + "\n", run_dir(plan.run_id), where, tuple(notes), tuple(options))


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
                                  ("env", dict(node.env), dict(first.env))):
            if mine != theirs:
                raise UsageError(f"{node.host.name}: {key} differs from {first.host.name}'s; a SLURM job runs "
                                 "the same command on every node",
                                 f"set {key} once, in [defaults]")


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


def node_command(plan: Plan, nodes: Sequence[NodePlan]) -> str:
    """What each task runs: the plan's cd, setup and torchrun (node rank, master and node
    count from SLURM), then its exit status into ``<node>.exit`` for the controller."""
    first = nodes[0]
    parts = ["\n".join(_nproc_case(nodes))] if _uneven(nodes) else []
    # torchrun would take an existing directory as its own: on a shared /tmp another user
    # could have made it first. mkdir without -p is atomic: ours, private, or the task fails.
    parts.append('mkdir -m 700 "$logs" && logs_made=1')
    parts.append(f"cd {quote_path(first.workdir)}")
    if first.setup.strip():
        parts.append("{ " + first.setup.strip() + "\n}")
    parts.append("{ phase=job; " + " ".join(torchrun_words(plan, first)) + "; }")
    return "\n".join([
        "phase=setup",
        f"logs={_log_dir_word(plan)}",
        " && ".join(parts),
        "code=$?",
        'if [ -n "${logs_made-}" ]; then rm -rf "$logs"; fi',  # only the directory it made
        f'printf "%s %s %s\\n" "$phase" "$code" "$(date +%s.%N)" > "${DIR_VAR}/$SLURMD_NODENAME{EXIT}"',
        'exit "$code"'])


def _log_dir_word(plan: Plan) -> str:
    """The plan's torchrun log directory with the node's name as SLURM gives it: nodes
    that share a /tmp (the test cluster, a node with several tasks) each have their own."""
    return shlex.quote(node_log_dir(plan.run_id, "")) + '"$SLURMD_NODENAME"'


def _uneven(nodes: Sequence[NodePlan]) -> bool:
    return len({str(node.nproc_per_node) for node in nodes}) > 1


def _nproc_case(nodes: Sequence[NodePlan]) -> list[str]:
    arms = [f"  {shlex.quote(node.host.name)}) nproc={shlex.quote(str(node.nproc_per_node))} ;;" for node in nodes]
    return ['case "$SLURMD_NODENAME" in', *arms,
            '  *) echo "torchherd: $SLURMD_NODENAME is not in the inventory" >&2; false ;;', "esac"]


def torchrun_words(plan: Plan, node: NodePlan) -> list[str]:
    """The node's torchrun argv as shell words: quoted values, and SLURM's own variables
    where each node differs (node rank, master, node count). ``--local-addr`` is left
    out: it names an inventory host, and SLURM picks the hosts."""
    argv = list(node.argv)
    script_at = len(argv) - len(plan.options.script_args) - 1
    words = [quote_path(argv[0])]
    index = 1
    while index < len(argv):
        item = argv[index]
        value = argv[index + 1] if index + 1 < script_at else None
        if index >= script_at or value is None:
            words.append(shlex.quote(item))
            index += 1
            continue
        replaced = _replace(plan, item, value)
        if replaced is None:
            words.append(shlex.quote(item))
            index += 1
            continue
        words += list(replaced)
        index += 2
    return words


def _replace(plan: Plan, option: str, value: str) -> tuple[str, ...] | None:
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
        # is_host=1 is the SSH plan's word for its rank-0 node; SLURM's first node is
        # the endpoint by name, which torch recognises as its own.
        kept = [item for item in value.split(",") if item and item != "is_host=1"]
        return (option, shlex.quote(",".join(kept))) if kept else ()
    return None


def shown_script(job: BatchJob) -> str:
    """The script as ``--dry-run`` prints it: variables named like a secret show ***."""
    def hide(line: str) -> str:
        match = re.match(r"export ([A-Za-z_][A-Za-z0-9_]*)=", line)
        if match and looks_secret(match.group(1)):
            return f"export {match.group(1)}=***"
        return line
    return "\n".join(hide(line) for line in job.script.splitlines()) + "\n"


# commands ---------------------------------------------------------------------------


def submit_command(job: BatchJob) -> str:
    """Writes the script from stdin into a new 0600 file of a new 0700 run directory and
    submits it; prints the job id (``sbatch --parsable``)."""
    directory = quote_path(job.run_dir)
    return (f"umask 077 && mkdir -p {directory} && cd {directory} && set -C && cat > {BATCH_SCRIPT} && "
            f"sbatch --parsable {BATCH_SCRIPT}")


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


def parse_salloc(stderr: str) -> str | None:
    """The job id of ``salloc: Granted job allocation 42``; None when none was granted."""
    match = re.search(r"Granted job allocation (\d+)", stderr)
    return match.group(1) if match else None


def step_command(job_id: str, node: str, command: str, unbuffered: bool = False) -> str:
    """``command`` as a step of allocation ``job_id`` on ``node``, beside its other steps."""
    flags = ["srun", f"--jobid={job_id}", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--quiet"]
    if unbuffered:
        flags.append("--unbuffered")
    return shlex.join([*flags, "bash", "-c", command])


def squeue_command(job_id: str) -> str:
    return f"squeue -h -t all -j {shlex.quote(job_id)} -o {shlex.quote(SQUEUE_FORMAT)}"


def final_state_command(job_id: str) -> str:
    """sacct when accounting is on; else what slurmctld still remembers (MinJobAge)."""
    job = shlex.quote(job_id)
    return (f"sacct -n -P -X -j {job} -o {SACCT_FIELDS} 2>/dev/null | grep . || "
            f"scontrol show job -o {job}")


def hostnames_command(nodelist: str) -> str:
    return f"scontrol show hostnames {shlex.quote(nodelist)}"


def cancel_command(job_id: str, kill: bool = False) -> str:
    return f"scancel {'--full --signal=KILL ' if kill else ''}{shlex.quote(job_id)}"


POLL_LIMIT = 4 << 20
"""Bytes of one file read per poll."""


def poll_command(directory: str, offsets: Mapping[str, int], job_id: str | None, limit: int = POLL_LIMIT,
                 suffixes: Sequence[str] = (OUT, ERR, EXIT)) -> str:
    """One round trip: what every output file of the run directory (ending in one of
    ``suffixes``) gained since ``offsets`` (framed ``== file NAME OFFSET LENGTH`` + the
    bytes), then, with ``job_id``, the job's line of squeue after ``== squeue``."""
    arms = "".join(f" {shlex.quote(name)}) o={int(offset)} ;;" for name, offset in sorted(offsets.items()))
    patterns = " ".join(f"*{shlex.quote(suffix)}" for suffix in suffixes)
    reader = (f"cd {quote_path(directory)} 2>/dev/null || exit 0; "
              f"for f in {patterns}; do [ -f \"$f\" ] || continue; "
              f"case \"$f\" in{arms} *) o=0 ;; esac; "
              "s=$(wc -c < \"$f\"); n=$((s - o)); "
              f"[ \"$n\" -gt {int(limit)} ] && n={int(limit)}; "
              "[ \"$n\" -gt 0 ] || continue; "
              "printf '== file %s %s %s\\n' \"$f\" \"$o\" \"$n\"; "
              "tail -c +\"$((o + 1))\" \"$f\" | head -c \"$n\"; done")
    if job_id is None:
        return reader
    return f"{reader}; printf '== squeue\\n'; {squeue_command(job_id)} 2>&1"


@dataclass(frozen=True)
class FileChunk:
    name: str
    offset: int
    data: bytes


@dataclass(frozen=True)
class Poll:
    chunks: tuple[FileChunk, ...]
    queue: str | None
    """squeue's answer (None when not asked)."""


def parse_poll(data: bytes) -> Poll:
    """``poll_command``'s output; a frame cut short keeps what arrived whole."""
    chunks: list[FileChunk] = []
    position = 0
    while position < len(data):
        end = data.find(b"\n", position)
        if end < 0:
            break
        header = data[position:end].decode("utf-8", "replace")
        if header == "== squeue":
            return Poll(tuple(chunks), data[end + 1:].decode("utf-8", "replace"))
        parts = header.rsplit(" ", 2)
        if not header.startswith("== file ") or len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            break
        name, offset, length = parts[0][len("== file "):], int(parts[1]), int(parts[2])
        body = data[end + 1:end + 1 + length]
        if len(body) < length:
            break
        chunks.append(FileChunk(name, offset, body))
        position = end + 1 + length
    return Poll(tuple(chunks), None)


# answers ----------------------------------------------------------------------------


def parse_job_id(stdout: str) -> str:
    """``sbatch --parsable``: ``42`` or ``42;cluster``; raises ValueError otherwise."""
    for line in reversed(stdout.strip().splitlines()):
        job_id = line.strip().split(";", 1)[0]
        if re.fullmatch(r"\d+(_\d+)?", job_id):
            return job_id
    raise ValueError(f"no job id in sbatch's answer: {stdout.strip()[-200:]!r}")


def parse_hostnames(stdout: str) -> tuple[str, ...]:
    """``scontrol show hostnames``: one host per line."""
    return tuple(line.strip() for line in stdout.split("\n") if line.strip())


@dataclass(frozen=True)
class JobState:
    """One job as squeue, sacct or scontrol describe it."""

    job_id: str
    state: str
    """SLURM's word (``RUNNING``, ``CANCELLED by 0``, ...)."""
    reason: str = ""
    nodelist: str = ""
    exit_code: int | None = None
    signal: int | None = None

    @property
    def phase(self) -> JobPhase:
        return phase_of(self.state)


def parse_squeue(stdout: str, job_id: str) -> JobState | None:
    """The job's line of ``squeue -o SQUEUE_FORMAT``; None when it is not (or no longer) there."""
    for line in stdout.split("\n"):
        fields = line.strip().split("|", 4)
        if len(fields) == 5 and fields[0] == job_id:
            nodelist = "" if fields[3] in ("", "(null)") else fields[3]
            reason = "" if fields[4].strip() in ("None", "(null)") else fields[4].strip()
            return JobState(job_id, fields[1], reason, nodelist)
    return None


def parse_exit_code(text: str) -> tuple[int | None, int | None]:
    """SLURM's ``CODE:SIGNAL``."""
    match = re.fullmatch(r"\s*(\d+):(\d+)\s*", text)
    return (int(match.group(1)), int(match.group(2))) if match else (None, None)


def parse_sacct(stdout: str, job_id: str) -> JobState | None:
    """The allocation's line of ``sacct -P -X -o SACCT_FIELDS``."""
    for line in stdout.split("\n"):
        fields = line.strip().split("|")
        if len(fields) >= 3 and fields[0] == job_id:
            code, signal = parse_exit_code(fields[2])
            return JobState(job_id, fields[1], "", fields[3] if len(fields) > 3 else "", code, signal)
    return None


_SCONTROL_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=")


def parse_scontrol(stdout: str) -> dict[str, str]:
    """``scontrol show job -o`` (or node): ``Key=value`` pairs; a value may hold spaces."""
    text = stdout.strip()
    matches = list(_SCONTROL_KEY.finditer(text))
    return {match.group(1): text[match.end():(matches[index + 1].start() if index + 1 < len(matches) else len(text))]
            .strip() for index, match in enumerate(matches)}


def parse_final_state(stdout: str, job_id: str) -> JobState | None:
    """``final_state_command``'s answer: sacct's line, else scontrol's."""
    found = parse_sacct(stdout, job_id)
    if found is not None:
        return found
    fields = parse_scontrol(stdout)
    if fields.get("JobId") != job_id or "JobState" not in fields:
        return None
    code, signal = parse_exit_code(fields.get("ExitCode", ""))
    reason = fields.get("Reason", "")
    return JobState(job_id, fields["JobState"], "" if reason == "None" else reason,
                    fields.get("NodeList", "").replace("(null)", ""), code, signal)


@dataclass(frozen=True)
class NodeExit:
    """A node's ``<node>.exit``: whether torchrun ran (``phase`` "job") or the cd or
    setup before it failed ("setup"), its exit status, and when (epoch seconds)."""

    node: str
    phase: str
    code: int
    at: float


def parse_exit_file(node: str, text: str) -> NodeExit | None:
    parts = text.split()
    if len(parts) != 3 or parts[0] not in ("setup", "job") or not parts[1].isdigit():
        return None
    # GNU date writes nanoseconds; another date may leave "%N" as it is.
    at = re.match(r"\d+(\.\d+)?", parts[2])
    return NodeExit(node, parts[0], int(parts[1]), float(at.group(0)) if at else 0.0)


# SLURM's own view, for check ---------------------------------------------------------


@dataclass(frozen=True)
class NodeInfo:
    """One node of one partition, as ``sinfo -N -o SINFO_FORMAT`` lists it."""

    node: str
    partition: str
    default: bool
    available: str
    state: str
    cpus: int | None
    gpus: int
    reason: str


def parse_sinfo(stdout: str) -> list[NodeInfo]:
    rows = []
    for line in stdout.split("\n"):
        fields = line.strip().split("|", 6)
        if len(fields) != 7 or not fields[0]:
            continue
        node, partition, available, state, cpus, gres, reason = fields
        rows.append(NodeInfo(node, partition.rstrip("*"), partition.endswith("*"), available, state,
                             int(cpus) if cpus.isdigit() else None, gres_gpus(gres),
                             "" if reason in ("none", "(null)") else reason))
    return rows


def gres_gpus(gres: str) -> int:
    """GPUs in a GRES string: ``gpu:4``, ``gpu:a100:4(S:0-1)``, ``gpu:2,mps:100``, ``(null)``."""
    total = 0
    for item in re.split(r",(?![^(]*\))", gres):
        parts = re.sub(r"\(.*\)$", "", item.strip()).split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


BAD_STATES = ("down", "drain", "fail", "maint", "inval", "not_responding", "future", "unknown", "power")
BUSY_STATES = ("alloc", "mixed", "completing", "reserved", "planned")


def node_condition(state: str) -> Literal["usable", "busy", "bad"]:
    """``idle``: usable; allocated or mixed: busy (the job queues); drained, down, ...: bad."""
    word = state.lower()
    if word.endswith("*") or any(bad in word for bad in BAD_STATES):
        return "bad"
    return "busy" if any(busy in word for busy in BUSY_STATES) else "usable"


def slurm_view(rows: Sequence[NodeInfo], settings: SlurmSettings, where: Placement,
               nproc: int | str) -> list[CheckResult]:
    """SLURM's own view of the job: the partition, each node it may run on, and GPUs
    against the processes per node. Pure: the rows are ``sinfo``'s."""
    partition = settings.partition or next((row.partition for row in rows if row.default), None)
    if partition is None:
        return [CheckResult(CLUSTER, "slurm", "fail", "no partition given and SLURM has no default one",
                            "set partition in [slurm] (sinfo lists them)")]
    in_partition = [row for row in rows if row.partition == partition]
    if not in_partition:
        known = sorted({row.partition for row in rows})
        return [CheckResult(CLUSTER, "slurm", "fail", f"partition {partition!r} does not exist",
                            f"known partitions: {', '.join(known) or 'none'}")]
    results = [_partition_result(partition, in_partition)]
    wanted = _wanted(where, in_partition, results)
    results += [_node_result(row, wanted is not None) for row in in_partition
                if wanted is None or row.node in wanted]
    results += _count_result(where, in_partition)
    results += _gres_results(in_partition if wanted is None else [row for row in in_partition if row.node in wanted],
                             settings, nproc)
    return results


def _partition_result(partition: str, rows: Sequence[NodeInfo]) -> CheckResult:
    if rows[0].available != "up":
        return CheckResult(CLUSTER, "slurm", "fail", f"partition {partition} is {rows[0].available}",
                           "ask the cluster's admins, or pick another partition")
    counts: dict[str, int] = {}
    for row in rows:
        counts[node_condition(row.state)] = counts.get(node_condition(row.state), 0) + 1
    shown = ", ".join(f"{count} {word}" for word, count in sorted(counts.items()))
    return CheckResult(CLUSTER, "slurm", "pass", f"partition {partition} is up: {len(rows)} nodes ({shown})")


def _wanted(where: Placement, rows: Sequence[NodeInfo], results: list[CheckResult]) -> set[str] | None:
    if where.nodelist is None:
        return None
    try:
        names = set(expand_nodeset(where.nodelist))
    except NodesetError as error:
        results.append(CheckResult(CLUSTER, "slurm", "fail", f"nodelist {where.nodelist!r}: {error}"))
        return set()
    known = {row.node for row in rows}
    for name in sorted(names - known):
        results.append(CheckResult(name, "slurm-node", "fail", f"{name} is not in the partition",
                                   "check the nodelist (sinfo -N lists the nodes)"))
    return names


def _node_result(row: NodeInfo, named: bool) -> CheckResult:
    condition = node_condition(row.state)
    reason = f" ({row.reason})" if row.reason else ""
    if condition == "usable":
        return CheckResult(row.node, "slurm-node", "pass", f"{row.node} is {row.state}")
    if condition == "busy":
        return CheckResult(row.node, "slurm-node", "warn" if named else "pass",
                           f"{row.node} is {row.state}" + (": the job waits for it" if named else ""))
    status: CheckStatus = "fail" if named else "warn"
    return CheckResult(row.node, "slurm-node", status, f"{row.node} is {row.state}{reason}",
                       "the job cannot start until an admin resumes it (scontrol update nodename=... state=resume)"
                       if named else "SLURM will not place the job there")


def _count_result(where: Placement, rows: Sequence[NodeInfo]) -> list[CheckResult]:
    if where.nodes is None:
        return []
    fit = [row for row in rows if node_condition(row.state) != "bad"]
    if len(fit) < where.nodes:
        return [CheckResult(CLUSTER, "slurm", "fail",
                            f"the job needs {where.nodes} nodes; {len(fit)} of the partition can take it",
                            "resume the drained or down nodes, or ask for fewer")]
    return []


def _gres_results(rows: Sequence[NodeInfo], settings: SlurmSettings, nproc: int | str) -> list[CheckResult]:
    results = []
    for row in rows:
        asked = settings.gpus_per_node
        if asked is not None and row.gpus < asked:
            results.append(CheckResult(row.node, "gres", "fail", f"{row.node} has {row.gpus} GPUs; "
                                       f"gpus_per_node is {asked}", "lower gpus_per_node, or pick other nodes"))
        elif nproc == "gpu" and row.gpus == 0:
            results.append(CheckResult(row.node, "gres", "fail", f"{row.node} has no GPU in its GRES; "
                                       "nproc_per_node is \"gpu\"", "set nproc_per_node to a number"))
        elif isinstance(nproc, int) and row.gpus and nproc > row.gpus:
            results.append(CheckResult(row.node, "gres", "warn", f"{row.node} has {row.gpus} GPUs for "
                                       f"{nproc} processes: ranks would share GPUs"))
        elif isinstance(nproc, int) and row.cpus is not None and nproc > row.cpus:
            results.append(CheckResult(row.node, "gres", "fail", f"{row.node} has {row.cpus} CPUs for "
                                       f"{nproc} processes", "lower nproc_per_node"))
        else:
            have = f"{row.gpus} GPUs" if row.gpus else "no GPUs"
            results.append(CheckResult(row.node, "gres", "pass", f"{row.node}: {have}, {row.cpus} CPUs "
                                       f"for {nproc} processes"))
    return results
