"""SLURM's commands and its answers: what asks SLURM about a job (rendered, then parsed:
pure), and running them through one ``Session``: this machine (``sbatch`` on PATH) or
the login host over SSH (``[slurm].login``).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import shutil
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, Mapping, Sequence

from torchherd.engine.slurm.batch import (
    ERR,
    EXIT,
    OUT,
    BatchJob,
    submit_command,
)
from torchherd.engine.slurm.container import PYXIS_PROBE, has_pyxis
from torchherd.engine.slurm.settings import settings_of
from torchherd.errors import TorchherdError, TransportError, Unplaceable, UsageError
from torchherd.inventory import Host, Inventory
from torchherd.shell import quote_path
from torchherd.transport import Connector, Session
from torchherd.transport.local import LocalSession

SQUEUE_FORMAT = "%i|%T|%D|%N|%r"


SACCT_FIELDS = "JobID,State,ExitCode,NodeList"


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


def parse_salloc(stderr: str) -> str | None:
    """The job id of ``salloc: Granted job allocation 42``; None when none was granted."""
    match = re.search(r"Granted job allocation (\d+)", stderr)
    return match.group(1) if match else None


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
        if not header.startswith("== file ") or len(parts) != 3 or not (parts[1] + parts[2]).isascii() or not parts[1].isdigit() or not parts[2].isdigit():
            break
        name, offset, length = parts[0][len("== file "):], int(parts[1]), int(parts[2])
        body = data[end + 1:end + 1 + length]
        if len(body) < length:
            break
        chunks.append(FileChunk(name, offset, body))
        position = end + 1 + length
    return Poll(tuple(chunks), None)


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
    if len(parts) != 3 or parts[0] not in ("setup", "job") or not (parts[1].isascii() and parts[1].isdigit()):
        return None
    # GNU date writes nanoseconds; another date may leave "%N" as it is.
    at = re.match(r"\d+(\.\d+)?", parts[2])
    return NodeExit(node, parts[0], int(parts[1]), float(at.group(0)) if at else 0.0)


# running them ----------------------------------------------------------------------


COMMAND_TIMEOUT = 60.0


LEAVE_TIMEOUT = 120.0
"""After scancel: how long to wait for the job to leave the queue (beyond SLURM's KillWait)."""


def login_host(inventory: Inventory) -> Host:
    """The login host as a node: the [defaults] user, port and key apply."""
    login = settings_of(inventory).login
    assert login is not None
    return dataclasses.replace(inventory.hosts[0], name=login, address=login, env=MappingProxyType({}), setup="",
                               local_addr=None)


def frontend(inventory: Inventory, connector: Connector) -> Session:
    """The session SLURM's commands run in: the login host over SSH, or this machine."""
    if settings_of(inventory).login:
        return connector.connect(login_host(inventory))
    if shutil.which("sbatch") is None:
        raise UsageError("sbatch is not on this machine's PATH",
                         'set login = "HOST" in [slurm] (or --slurm-login HOST): the host you submit jobs from')
    return LocalSession("localhost")


def ask(session: Session, command: str, what: str, stdin: bytes = b"") -> str:
    """Runs a SLURM command; its stdout, or TorchherdError with SLURM's own words."""
    result = session.run(command, stdin=stdin, timeout=COMMAND_TIMEOUT)
    if result.exit_code != 0:
        said = (result.stderr or result.stdout).decode("utf-8", "replace").strip().splitlines()
        raise TorchherdError(f"{what} failed on {session.node}: {said[-1] if said else f'exit {result.exit_code}'}")
    return result.stdout.decode("utf-8", "replace")


def pyxis_installed(session: Session) -> bool:
    """Whether the submit host's srun has pyxis's ``--container-image`` (``srun --help``);
    an srun that does not answer has no pyxis to offer."""
    try:
        result = session.run(PYXIS_PROBE, timeout=COMMAND_TIMEOUT)
    except TransportError:
        return False
    return result.exit_code == 0 and has_pyxis(result.stdout.decode("utf-8", "replace"))


NEVER_PLACED = "Requested node configuration is not available"
"""sbatch's words for a job the partition could never run as asked (too many nodes once
some are excluded), as opposed to one that waits for nodes busy now."""


def submit(session: Session, job: BatchJob) -> str:
    """Writes the script (0600, from stdin: never on a command line) and sbatch's it; the
    job id. Unplaceable when SLURM could never run it as asked."""
    try:
        answer = ask(session, submit_command(job), "sbatch", job.script.encode("utf-8"))
    except TorchherdError as error:
        if NEVER_PLACED in str(error):
            raise Unplaceable(str(error), error.hint) from None
        raise
    try:
        return parse_job_id(answer)
    except ValueError as error:
        raise TorchherdError(f"sbatch on {session.node}: {error}") from None


def queue_state(session: Session, job_id: str) -> JobState | None:
    """The job as squeue sees it; None when SLURM no longer lists it."""
    result = session.run(squeue_command(job_id), timeout=COMMAND_TIMEOUT)
    return parse_squeue(result.stdout.decode("utf-8", "replace"), job_id)


def final_state(session: Session, job_id: str) -> JobState | None:
    result = session.run(final_state_command(job_id), timeout=COMMAND_TIMEOUT)
    return parse_final_state(result.stdout.decode("utf-8", "replace"), job_id)


def hostnames(session: Session, nodelist: str) -> tuple[str, ...]:
    return parse_hostnames(ask(session, hostnames_command(nodelist), "scontrol show hostnames"))


def cancel_and_wait(session: Session, job_id: str, kill: bool = False,
                    timeout: float = LEAVE_TIMEOUT) -> JobState | None:
    """scancel, then wait until the job has left the queue; what SLURM still shows
    when it has not (None: it has)."""
    ask(session, cancel_command(job_id, kill), "scancel")
    deadline = time.monotonic() + timeout
    while True:
        state = queue_state(session, job_id)
        if state is None or state.phase == "done" or time.monotonic() > deadline:
            return None if state is None or state.phase == "done" else state
        time.sleep(0.5)
