"""Typed values out of one TOML table (or the command line's container flags), each
error naming the file and the key (or the flag), what was expected and how to fix it."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Callable, Mapping, NoReturn, TypeVar

from torchherd.errors import InventoryError
from torchherd.imagearchive import HINT as ARCHIVE_HINT
from torchherd.imagearchive import ImageArchive, read_archive
from torchherd.inventory.model import Bandwidth
from torchherd.inventory.nodeset import NodesetError, expand
from torchherd.inventory.options import Option, env_problem
from torchherd.inventory.rules import (
    ADDRESS_PATTERN,
    BANDWIDTH_HINT,
    CHECKPOINT_HINT,
    CONTROL,
    LOCAL_ADDR,
    USER_HINT,
    checkpoint_problem,
    parse_bandwidth,
    parse_rate,
    show,
    valid_hostname,
    valid_ruser,
)
from torchherd.remote import container as containers

T = TypeVar("T")


class Reader:
    """Reads typed values out of one TOML table, naming the key in every error."""

    def __init__(self, path: Path, where: str, table: Mapping[str, Any], allowed: tuple[str, ...],
                 elsewhere: Mapping[str, str] | None = None):
        """``elsewhere``: the table each key of another table belongs in (``ssh_timeout``:
        ``[cluster]``), said instead of a guess at a key of this one."""
        self.path = path
        self.where = where
        self.table = table
        for key in table:
            if key in (elsewhere or {}) and key not in allowed:
                self.fail(key, "not a key of this table", f"{key} belongs in {(elsewhere or {})[key]}: one value "
                          "for every host")
            if key not in allowed:
                self.fail(key, "unknown key", did_you_mean(key, allowed))

    def fail(self, key: str, problem: str, hint: str = "") -> NoReturn:
        shown = repr(key) if CONTROL.search(key) else key  # the error stays one line
        raise InventoryError(f"{self.path}: {self.where}{shown}: {problem}", hint)

    def get(self, key: str, default: T, convert: Callable[[str, Any], T]) -> T:
        if key not in self.table:
            return default
        return convert(key, self.table[key])

    def text(self, key: str, value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            self.fail(key, f"expected a non-empty string, got {show(value)}")
        if CONTROL.search(value):
            self.fail(key, f"{value!r} holds a control character (a newline, a NUL, ...)", "write it on one line")
        return str(value)

    def user(self, key: str, value: Any) -> str:
        text = self.text(key, value)
        if not valid_ruser(text):
            self.fail(key, f"{text!r} is not a user name: ssh would hand it to a shell", USER_HINT)
        return text

    def host(self, key: str, value: Any) -> str:
        text = self.text(key, value)
        if not (ADDRESS_PATTERN.match(text) and valid_hostname(text)):
            self.fail(key, f"{text!r} is not a host name, an IP address or an ssh_config alias",
                      "use letters, digits, '.', '-' and '_' (or an IP address); put the user in [defaults].user")
        return text

    def local_addr(self, key: str, value: Any) -> str:
        text = self.text(key, value)
        if not LOCAL_ADDR.match(text):
            self.fail(key, f"{text!r} is not an IP address or a host name",
                      "the address the other nodes reach this node at, e.g. 10.0.0.5")
        return text

    def address(self, key: str, value: Any) -> str:
        text = self.text(key, value)
        if not ADDRESS_PATTERN.match(text):
            self.fail(key, f"{text!r} is not a host name, an IP address or an ssh_config alias",
                      "use letters, digits, '.', '-' and '_' (or an IP address); put users and ports "
                      "in user and ssh_port")
        return text

    def existing_file(self, key: str, value: Any) -> str:
        text = self.text(key, value)
        if not Path(text).expanduser().is_file():
            self.fail(key, f"{text!r}: no such file", "fix the path, or leave the key out")
        return text

    def script(self, key: str, value: Any) -> str:
        if not isinstance(value, str):
            self.fail(key, f"expected a string, got {show(value)}")
        if "\0" in value:
            self.fail(key, "holds a NUL character, which no shell can run")
        return str(value)

    def port(self, key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
            self.fail(key, f"expected a port number from 1 to 65535, got {show(value)}")
        return int(value)

    def rate(self, key: str, value: Any) -> float:
        found = parse_rate(str(value)) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else None
        if found is None:
            self.fail(key, f"expected a rate such as \"10Gbit\" or \"800Mbit\", got {show(value)}")
        return found

    def ratio(self, key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
            self.fail(key, f"expected a share of the median between 0 and 1 (0.5: half), got {show(value)}")
        return float(value)

    def option(self, option: Option[T]) -> Callable[[str, Any], T]:
        """The converter of ``option``'s key: its rule, the one every door asks."""
        def convert(key: str, value: Any) -> T:
            found = option.kind.value(value)
            if found is None:
                self.fail(key, option.expected("file", value), option.file_hint or option.hint)
            return found
        return convert

    def count(self, key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            self.fail(key, f"expected a positive integer, got {show(value)}")
        return int(value)

    def flag(self, key: str, value: Any) -> bool:
        if not isinstance(value, bool):
            self.fail(key, f"expected true or false, got {show(value)}")
        return value

    def checkpoint(self, key: str, value: Any) -> str:
        text = self.text(key, value)
        problem = checkpoint_problem(text)
        if problem is not None:
            self.fail(key, problem, CHECKPOINT_HINT)
        return text

    def bandwidth(self, key: str, value: Any) -> Bandwidth:
        found = parse_bandwidth(value) if isinstance(value, str) else None
        if found is None:
            self.fail(key, f"expected a share or a rate, got {show(value)}", BANDWIDTH_HINT)
        return found

    def nodeset(self, key: str, value: Any) -> str:
        text = self.text(key, value)
        if "/" in text:  # sbatch reads a nodelist with a "/" as a file of names: torchherd would count one name
            self.fail(key, f"{text!r} names a file (sbatch reads it as one); torchherd needs the nodes themselves",
                      'write them as a nodeset, e.g. "gpu[01-04],cpu7"')
        try:
            names = expand(text)
        except NodesetError as error:
            self.fail(key, f"not a nodeset: {error}", 'write it as SLURM does, e.g. "gpu[01-04],cpu7"')
        seen: set[str] = set()
        for name in names:  # sbatch counts a node once: a retry that leaves one out would ask for too many
            if name in seen:
                self.fail(key, f"node {name!r} is listed twice", "list every node once")
            seen.add(name)
        return text

    def options(self, key: str, value: Any) -> tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(item, str) and item.startswith("-") for item in value):
            self.fail(key, f"expected a list of sbatch options, got {show(value)}",
                      'write extra = ["--qos=high", "--exclusive"]')
        return tuple(value)

    def image(self, key: str, value: Any) -> str:
        problem = containers.image_problem(value)
        if problem:
            self.fail(key, problem, "quote nothing: write the reference as docker pull takes it")
        return str(value)

    def archive(self, key: str, value: Any) -> ImageArchive:
        text = self.text(key, value)
        path = Path(text).expanduser()
        if not path.is_absolute() and self.path.is_file():
            path = self.path.parent / path  # as [sync].dir: relative to the inventory
        try:
            return read_archive(str(path))
        except ValueError as error:
            self.fail(key, f"{path}: {error}", ARCHIVE_HINT)

    def mounts(self, key: str, value: Any) -> tuple[str, ...]:
        return self._items(key, value, "mounts", containers.mount_problem, 'write mounts = ["/data:/data:ro"]',
                           'write mounts = ["/data:/data:ro"]')

    def runtime_options(self, key: str, value: Any) -> tuple[str, ...]:
        return self._items(key, value, "options", containers.option_problem,
                           'write options = ["--cap-add=SYS_PTRACE"]', "one option per item, as one word: --name=value")

    def _items(self, key: str, value: Any, what: str, problem_of: Callable[[Any], str | None], shape_hint: str,
               item_hint: str) -> tuple[str, ...]:
        """A list whose every item ``problem_of`` passes (it names what is wrong with one)."""
        if not isinstance(value, list):
            self.fail(key, f"expected a list of {what}, got {show(value)}", shape_hint)
        for item in value:
            problem = problem_of(item)
            if problem:
                self.fail(key, problem, item_hint)
        return tuple(value)

    def choice(self, choices: tuple[str, ...]) -> Callable[[str, Any], str]:
        def convert(key: str, value: Any) -> str:
            if value not in choices:
                self.fail(key, f"expected one of {', '.join(map(repr, choices))}, got {show(value)}")
            return str(value)
        return convert

    def env(self, key: str, value: Any) -> Mapping[str, str]:
        if not isinstance(value, dict):
            self.fail(key, f"expected a table of NAME = \"value\", got {show(value)}",
                      'write env = { NCCL_DEBUG = "WARN" }')
        result: dict[str, str] = {}
        for name, item in value.items():
            problem = env_problem(name)
            if problem is not None:
                self.fail(f"{key}.{name!r}", problem)
            if isinstance(item, bool) or not isinstance(item, (str, int, float)):
                self.fail(f"{key}.{name}", f"expected a string, got {show(item)}", "quote the value")
            problem = env_problem(name, str(item))
            if problem is not None:
                self.fail(f"{key}.{name}", problem)
            result[name] = str(item)
        return result


def did_you_mean(key: str, allowed: tuple[str, ...], kind: str = "keys") -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    if close:
        return f"did you mean {close[0]!r}?"
    return f"known {kind}: {', '.join(allowed)}"



CONTAINER_FLAGS = {"image": "--image", "runtime": "--container-runtime", "pull": "--pull",
                   "archive": "--image-archive"}
"""The command line's flag for each container key."""


class FlagReader(Reader):
    """The container keys as the command line gave them: errors name the flag."""

    def fail(self, key: str, problem: str, hint: str = "") -> NoReturn:
        raise InventoryError(f"{CONTAINER_FLAGS.get(key, key)}: {problem}", hint)

