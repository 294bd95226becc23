"""One rule per option: each setting a value reaches torchherd by more than one door (a flag
of the command line, a key of ``hosts.toml``, an argument of the API) is described once here,
with its name, flag, key, kind, bounds and rule, and every door asks it. The same value gets
the same verdict wherever it came from, and the error names the door it came through:
``--hang-timeout``, ``hosts.toml: [recovery].hang_timeout``, or ``Recovery(hang_timeout=...)``.

The cross-field rules of ``[recovery]`` are here too (``recovery_problem``): what a run asks
for with a flag or an argument must be something that run can do (a checkpoint is staged
before a new attempt: without retries there is none), while the file's table holds every
run's defaults, to which a run may add its retries.
"""

from __future__ import annotations

import argparse
import math
import shlex
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields, replace
from typing import Any, Generic, Literal, Sequence, TypeVar

from torchherd.errors import UsageError
from torchherd.inventory.model import Recovery
from torchherd.inventory.rules import (
    ENV_NAME,
    HEARTBEAT_HINT,
    HEARTBEAT_RANGE,
    MAX_NPROC,
    MAX_REPLICAS,
    MAX_RETRIES,
    MAX_SECONDS,
    MISSES_RANGE,
    NPROC_WORDS,
    show,
)

V = TypeVar("V", covariant=True)

Door = Literal["flag", "file", "argument"]
"""The command line, ``hosts.toml``, the API."""

MAX_INTERVAL = 86400.0
"""A day: the longest interval, grace or timeout taken (a larger one is a typo)."""
MAX_RESTARTS = 1_000_000
"""torchrun restarts of one attempt: more than any run makes."""
MIN_STRAGGLER_WINDOW = 10.0
"""The shortest straggler window: a node is judged on five samples in it, and its busy share
comes every 2 s (engine.watch.straggler)."""


class Kind(ABC, Generic[V]):
    """What an option's values are: ``value`` is the value normalised, or None where the rule
    refuses it; ``of_text`` is what a flag's text stands for (the text itself where it stands
    for nothing, so that ``value`` refuses it)."""

    @abstractmethod
    def expected(self, door: Door) -> str:
        """What the rule takes, in ``door``'s words."""

    def of_text(self, text: str) -> object:
        return text

    @abstractmethod
    def value(self, given: object) -> V | None:
        """``given`` normalised, or None: the rule refuses it."""


def _integer(given: object) -> int | None:
    return given if isinstance(given, int) and not isinstance(given, bool) else None


def _digits(text: str) -> object:
    # isascii: "²".isdigit() is True, and int("²") raises
    return int(text) if text.isascii() and text.isdigit() else text


@dataclass(frozen=True)
class Integer(Kind[int]):
    low: int
    high: int | None = None
    note: str = ""
    """Said after the bounds, e.g. "(0: no replication)"."""

    def expected(self, door: Door) -> str:
        if self.high is None:
            bounds = "a positive integer" if self.low == 1 else f"an integer of {self.low} or more"
        else:
            bounds = f"an integer from {self.low} to {self.high}"
        return bounds + (f" {self.note}" if self.note else "")

    def of_text(self, text: str) -> object:
        return _digits(text)

    def value(self, given: object) -> int | None:
        number = _integer(given)
        if number is None or number < self.low or (self.high is not None and number > self.high):
            return None
        return number


@dataclass(frozen=True)
class Seconds(Kind[float]):
    low: float
    high: float
    above: bool = False
    """The low bound itself excluded: seconds above it."""
    what: str = "seconds"

    def expected(self, door: Door) -> str:
        if self.above:
            return f"{self.what} above {self.low:g}, at most {self.high:g}"
        return f"{self.what} from {self.low:g} to {self.high:g}"

    def of_text(self, text: str) -> object:
        try:
            return float(text)
        except ValueError:
            return text

    def value(self, given: object) -> float | None:
        if isinstance(given, bool) or not isinstance(given, (int, float)) or not math.isfinite(given):
            return None
        inside = self.low < given if self.above else self.low <= given
        return float(given) if inside and given <= self.high else None


@dataclass(frozen=True)
class ExitCodes(Kind[tuple[int, ...]]):
    """Exit codes from 1 to 255: a list in the file, ``2,3`` on the command line."""

    def expected(self, door: Door) -> str:
        if door == "flag":
            return "exit codes from 1 to 255, comma-separated (2,3)"
        return "a list of exit codes from 1 to 255"

    def of_text(self, text: str) -> object:
        codes = [_digits(item.strip()) for item in text.split(",")]
        return codes if all(isinstance(code, int) for code in codes) else text

    def value(self, given: object) -> tuple[int, ...] | None:
        if not isinstance(given, (list, tuple)):
            return None
        codes = [_integer(code) for code in given]
        if not all(code is not None and 1 <= code <= 255 for code in codes):
            return None
        return tuple(code for code in codes if code is not None)


@dataclass(frozen=True)
class Nproc(Kind["int | str"]):
    """Processes per node: a count, or gpu, cpu or auto (counted on the node at the start)."""

    def expected(self, door: Door) -> str:
        return f"a positive integer (at most {MAX_NPROC}), {', '.join(NPROC_WORDS[:-1])} or {NPROC_WORDS[-1]}"

    def of_text(self, text: str) -> object:
        return text if text in NPROC_WORDS else _digits(text)

    def value(self, given: object) -> int | str | None:
        if isinstance(given, str):
            return given if given in NPROC_WORDS else None
        number = _integer(given)
        return number if number is not None and 1 <= number <= MAX_NPROC else None


@dataclass(frozen=True)
class Words(Kind[tuple[str, ...]]):
    """Arguments for a command line: one string, split once as a shell splits it (its
    quotes balanced), or the words themselves (a list in the file, a tuple in the API);
    at least one word, none holding a NUL (no command line can)."""

    what: str

    def expected(self, door: Door) -> str:
        if door == "flag":
            return f"{self.what}, as a shell splits them (e.g. --init_from=resume)"
        if door == "file":
            return f"{self.what}: one string, as a shell splits it, or a list of strings"
        return f"{self.what}: a tuple of strings, or one string, as a shell splits it"

    def value(self, given: object) -> tuple[str, ...] | None:
        if isinstance(given, str):
            try:
                words = shlex.split(given)
            except ValueError:  # "No closing quotation", "No escaped character"
                return None
        elif isinstance(given, (list, tuple)) and all(isinstance(word, str) for word in given):
            words = list(given)
        else:
            return None
        if not words or any("\0" in word for word in words):
            return None
        return tuple(words)


@dataclass(frozen=True)
class Elsewhere(Kind[Any]):
    """A value with a rule of its own (``rule`` names it), here for the cross-field rules."""

    rule: str

    def expected(self, door: Door) -> str:
        return self.rule

    def value(self, given: object) -> Any:
        return given


@dataclass(frozen=True)
class Option(Generic[V]):
    """One setting, and how each door names it."""

    name: str
    """The API's argument, and the file's key."""
    kind: Kind[V]
    flag: str | None = None
    table: str | None = None
    """The file's table (``recovery``: ``[recovery].name``); None: no key in the file."""
    owner: str = ""
    """What takes the argument in the API: ``Recovery``, ``plan``."""
    hint: str = ""
    file_hint: str = ""
    """The hint of the file's door, where it needs its own (how to write the key)."""
    file_expected: str = ""
    """What the file's door says was expected, where it words the same bounds its own way."""

    @property
    def key(self) -> str:
        return f"[{self.table}].{self.name}" if self.table else self.name

    def argument(self, value: object) -> str:
        return f"{self.owner}({self.name}={value!r})" if self.owner else f"{self.name}={value!r}"

    def flag_words(self, value: object) -> str:
        """The flag as the command line gave it: with its value, a switch alone."""
        return str(self.flag) if isinstance(value, bool) else f"{self.flag} {value}"

    def expected(self, door: Door, given: object) -> str:
        """What the door's error says: what was expected, and what came."""
        shown = repr(given) if door != "file" else show(given)
        expected = self.file_expected if door == "file" and self.file_expected else self.kind.expected(door)
        return f"expected {expected}, got {shown}"

    def from_flag(self, text: str) -> V:
        """The flag's value (argparse's ``type``: it puts the flag in front of the error)."""
        found = self.kind.value(self.kind.of_text(text))
        if found is None:
            raise argparse.ArgumentTypeError(self.expected("flag", text))
        return found

    def from_argument(self, given: object, owner: str | None = None) -> V:
        """An API argument's value; OptionError names the argument (of ``owner``, where
        another call than the option's own takes it)."""
        found = self.kind.value(given)
        if found is None:
            door = None if owner is None else f"{owner}({self.name}={given!r})"
            raise OptionError(self, given, self.expected("argument", given), self.hint, door)
        return found


class OptionError(UsageError):
    """A value an option's rule refuses. ``door``: the words of the door that refused it, final;
    None: the door is the caller's to name (``first`` until then: the engine's own callers
    see the flag, ``Cluster`` names its argument with ``as_argument``, the CLI its flag or
    the file's key with ``through``). ``flag_hint`` and ``flag_problem``: the flag's door's
    words, where they name other flags."""

    def __init__(self, option: Option[Any], value: object, problem: str, hint: str = "",
                 door: str | None = None, flag_hint: str | None = None, first: Door = "argument",
                 flag_problem: str | None = None) -> None:
        self.option, self.value, self.problem = option, value, problem
        self.flag_hint, self.flag_problem = flag_hint, flag_problem
        self.final = door is not None
        if door is None:
            door = option.argument(value) if first == "argument" else option.flag_words(value)
            if first == "flag":
                problem, hint = flag_problem or problem, flag_hint or hint
        self.door = door
        super().__init__(f"{door}: {problem}", hint)

    def through(self, door: str, flag: bool = False) -> OptionError:
        """The error as ``door`` words it, final (``flag``: in the flag's words)."""
        if flag:
            return OptionError(self.option, self.value, self.flag_problem or self.problem,
                               self.flag_hint or self.hint, door)
        return OptionError(self.option, self.value, self.problem, self.hint, door)

    def as_argument(self) -> OptionError:
        """The error naming the API's argument, for the caller to name again (the CLI)."""
        return OptionError(self.option, self.value, self.problem, self.hint, flag_hint=self.flag_hint,
                           flag_problem=self.flag_problem)


RETRIES = Option("retries", Integer(0, MAX_RETRIES), "--retries", "recovery", "Recovery")
FINAL_EXIT_CODES = Option("final_exit_codes", ExitCodes(), "--final-exit-codes", "recovery", "Recovery",
                          file_hint="write final_exit_codes = [2]")
MIN_NODES = Option("min_nodes", Integer(1), "--min-nodes", "recovery", "Recovery")
HANG_TIMEOUT = Option("hang_timeout", Seconds(1.0, MAX_SECONDS), "--hang-timeout", "recovery", "Recovery")
REPLICATE = Option("replicate", Integer(0, MAX_REPLICAS, "(0: no replication)"), "--replicate", "recovery",
                   "Recovery")
CHECKPOINT = Option("checkpoint", Elsewhere("checkpoint_problem"), "--checkpoint", "recovery", "Recovery")
REPLICATE_BANDWIDTH = Option("replicate_bandwidth", Elsewhere("parse_bandwidth"), "--replicate-bandwidth", "recovery",
                             "Recovery")
RESUME_ARGS = Option("resume_args", Words("the script's arguments on a resumed attempt"), "--resume-args", "recovery",
                     "Recovery", hint='e.g. "--init_from=resume" (quoted as a shell quotes: its quotes balanced)',
                     file_hint='write resume_args = "--init_from=resume"')
NPROC_PER_NODE = Option("nproc_per_node", Nproc(), "--nproc-per-node", "cluster", "plan")
MONITOR_INTERVAL = Option("monitor_interval", Seconds(0.0, MAX_INTERVAL, above=True), "--monitor-interval",
                          owner="plan")
MAX_RESTARTS_OPTION = Option("max_restarts", Integer(0, MAX_RESTARTS), "--max-restarts", owner="plan")
GRACE = Option("grace", Seconds(0.0, MAX_INTERVAL), "--grace", owner="launch")
STRAGGLER_WINDOW = Option("straggler_window", Seconds(MIN_STRAGGLER_WINDOW, MAX_INTERVAL), "--straggler-window",
                          owner="launch", hint="a node is judged on five busy records, one every 2 s")
NNODES = Option("nnodes", Elsewhere("check_nnodes"), "--nnodes", owner="plan")
RDZV_CONF = Option("rdzv_conf", Elsewhere("c10d's K=V,..."), "--rdzv-conf", owner="plan")
UV = Option("uv", Elsewhere("a switch"), "--uv", owner="plan")
UV_SYSTEM_SITE_PACKAGES = Option("uv_system_site_packages", Elsewhere("a switch"), "--uv-system-site-packages",
                                 owner="plan")
UV_OFFLINE = Option("uv_offline", Elsewhere("a switch"), "--uv-offline", owner="plan")
SSH_TIMEOUT = Option("ssh_timeout", Seconds(0.0, MAX_INTERVAL, above=True), "--ssh-timeout", "cluster", "override",
                     file_expected=f"a positive number of seconds (at most {MAX_INTERVAL:g})")

HEARTBEAT = Option("heartbeat", Seconds(*HEARTBEAT_RANGE, what="seconds between heartbeats,"), table="recovery",
                   owner="Recovery", hint=HEARTBEAT_HINT)
HEARTBEAT_MISSES = Option("heartbeat_misses", Integer(*MISSES_RANGE), table="recovery", owner="Recovery",
                          hint=HEARTBEAT_HINT)

RECOVERY_OPTIONS: tuple[Option[Any], ...] = (RETRIES, FINAL_EXIT_CODES, MIN_NODES, HANG_TIMEOUT, REPLICATE, HEARTBEAT,
                                             HEARTBEAT_MISSES, RESUME_ARGS)
"""The ``Recovery`` fields with a rule of their own (the heartbeat's product too: ``heartbeat_problem``)."""


def env_problem(name: str, value: str = "") -> str | None:
    """Why ``name=value`` cannot be put into a job's environment, or None. ENV_NAME, not
    str.isidentifier: that takes "ÄÖ", which no shell takes as a name."""
    if not ENV_NAME.match(name):
        return "not a valid environment variable name (ASCII letters, digits and '_', not starting with a digit)"
    if "\0" in value:
        return "holds a NUL character, which no environment can"
    return None


def checked_recovery(recovery: Recovery) -> Recovery:
    """``recovery`` as an API caller gave it (``Cluster.launch(recovery=...)``), each field
    through its option's rule, normalised (``resume_args`` given as one string: its words);
    OptionError names the argument."""
    for option in RECOVERY_OPTIONS:
        given = getattr(recovery, option.name)
        if option is RESUME_ARGS and given == ():
            continue  # the default: nothing added
        if given is not None:  # None: the field's "not set" (min_nodes, hang_timeout, replicate)
            found = option.from_argument(given)
            if found != given:
                recovery = replace(recovery, **{option.name: found})
    return recovery


@dataclass(frozen=True)
class Needs:
    """A cross-field rule: ``option``, asked for, needs ``needed`` (``why``)."""

    option: Option[Any]
    needed: Option[Any]
    why: str
    metavar: str

    def applies(self, recovery: Recovery) -> bool:
        value = getattr(recovery, self.option.name)
        if self.option in (REPLICATE, RESUME_ARGS) and not value:  # 0, (): none asked for, nothing to need
            return False
        return not getattr(recovery, self.needed.name)

    def error(self, recovery: Recovery, door: Door) -> OptionError:
        """The error as ``door`` words it (the file's reader puts the file and key in front)."""
        option, needed, value = self.option, self.needed, getattr(recovery, self.option.name)
        if needed is RETRIES:
            problem = f"{self.why}, and without retries there is none"
        else:
            problem = f"{self.why}, and {needed.key if door == 'file' else 'none'} " + (
                "names none" if door == "file" else "is named")
        if door == "flag":
            hint = f"add {needed.flag} {self.metavar} (or {needed.name} in [{needed.table}])"
            return OptionError(option, value, problem, hint, door=str(option.flag))
        if door == "file":
            hint = (f'add {needed.name} = "{self.metavar}" to [{needed.table}] (e.g. "snapshot.pt"), '
                    f"or remove {option.name}")
            return OptionError(option, value, problem, hint, door=option.key)
        return OptionError(option, value, problem, f"pass {needed.owner}({needed.name}={self.metavar}) too")


REPLICATION_NEEDS = (Needs(REPLICATE, CHECKPOINT, "replication copies the checkpoint", "PATH"),
                     Needs(REPLICATE_BANDWIDTH, CHECKPOINT, "replication copies the checkpoint", "PATH"),
                     Needs(RESUME_ARGS, CHECKPOINT, "they are added on an attempt that starts from the staged "
                           "checkpoint", "PATH"))
ATTEMPT_NEEDS = (Needs(CHECKPOINT, RETRIES, "it is staged before a new attempt", "N"),
                 Needs(REPLICATE, RETRIES, "a replica is there for a new attempt", "N"),
                 Needs(REPLICATE_BANDWIDTH, RETRIES, "a replica is there for a new attempt", "N"),
                 Needs(RESUME_ARGS, RETRIES, "they are added on a new attempt", "N"))
"""A run that asks for these by a flag or an argument must make a new attempt (no
controller copies a replica, nor stages a checkpoint, without one). Not the file's
table: it holds every run's defaults, to which a run may add --retries."""


def recovery_problem(recovery: Recovery, given: Sequence[str], door: Door, detached: bool = False) -> OptionError | None:
    """What ``recovery`` cannot do for the fields asked for (``given``: by a flag, an
    argument that differs from the file's, or the file's keys), as ``door`` words it; None
    when it can. For each field asked for, in the order the rules list them, the first rule
    it breaks. A ``detached`` run replicates without retries (its controller in the
    background copies while the job runs): no attempt is needed for its checkpoint and
    replicas (its resume arguments still need one)."""
    rules = REPLICATION_NEEDS + (tuple(rule for rule in ATTEMPT_NEEDS if not detached or rule.option is RESUME_ARGS)
                                 if door != "file" else ())
    for option in (CHECKPOINT, REPLICATE, REPLICATE_BANDWIDTH, RESUME_ARGS):
        if option.name not in given:
            continue
        for rule in rules:
            if rule.option is option and rule.applies(recovery):
                return rule.error(recovery, door)
    return None


def given_fields(recovery: Recovery, defaults: Recovery) -> tuple[str, ...]:
    """The fields of ``recovery`` an API caller set for this run: those that differ from the
    file's ``[recovery]`` (``defaults``)."""
    return tuple(item.name for item in fields(Recovery) if getattr(recovery, item.name) != getattr(defaults, item.name))


__all__ = ["ATTEMPT_NEEDS", "CHECKPOINT", "Door", "Elsewhere", "ExitCodes", "FINAL_EXIT_CODES", "GRACE",
           "HANG_TIMEOUT", "HEARTBEAT", "HEARTBEAT_MISSES", "Integer", "Kind", "MAX_INTERVAL", "MAX_RESTARTS",
           "MAX_RESTARTS_OPTION", "MIN_NODES", "MONITOR_INTERVAL", "NNODES", "NPROC_PER_NODE", "Needs", "Nproc",
           "Option", "OptionError", "RDZV_CONF", "RECOVERY_OPTIONS", "REPLICATE", "REPLICATE_BANDWIDTH",
           "REPLICATION_NEEDS", "RESUME_ARGS", "RETRIES", "SSH_TIMEOUT", "STRAGGLER_WINDOW", "Seconds", "UV", "UV_OFFLINE", "UV_SYSTEM_SITE_PACKAGES",
           "Words", "checked_recovery", "env_problem", "given_fields", "recovery_problem"]
