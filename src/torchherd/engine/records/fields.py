"""The run record's reader: typed reads out of one JSON object, each error naming the file
and the key (a record's values reach remote shells and file paths: nothing is taken on trust)."""

from __future__ import annotations

import math
import re
from typing import NoReturn, TypeVar

from torchherd.errors import UsageError
from torchherd.inventory import ADDRESS_PATTERN, valid_hostname, valid_ruser
from torchherd.remote.wire import is_run_id

T = TypeVar("T")


class RecordError(UsageError):
    """A run record that is not what torchherd writes (damaged, or written by hand)."""


DAMAGED = "the run record is damaged: remove the file (torchherd status lists the other runs)"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class Fields:
    """Typed reads out of one JSON object of a record, naming the file and the key."""

    def __init__(self, source: str, where: str, data: object) -> None:
        self.source, self.where = source, where
        if not isinstance(data, dict):
            raise RecordError(f"{source}: {where or 'the record'} is not a JSON object", DAMAGED)
        self.data: dict[str, object] = data

    def fail(self, key: str, problem: str) -> NoReturn:
        raise RecordError(f"{self.source}: {self.where}{key}: {problem}", DAMAGED)

    def value(self, key: str, kind: type[T]) -> T:
        value = self.data.get(key)
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            self.fail(key, f"expected {kind.__name__}, got {type(value).__name__}")
        return value

    def optional(self, key: str, kind: type[T]) -> T | None:
        return None if self.data.get(key) is None else self.value(key, kind)

    def text(self, key: str) -> str:
        value = self.value(key, str)
        if CONTROL.search(value):
            self.fail(key, "holds a control character")
        return value

    def optional_text(self, key: str) -> str | None:
        return None if self.data.get(key) is None else self.text(key)

    def texts(self, key: str) -> tuple[str, ...]:
        values = self.value(key, list)
        if not all(isinstance(value, str) and "\0" not in value for value in values):
            self.fail(key, "expected a list of strings")
        return tuple(values)

    def name(self, key: str) -> str:
        value = self.value(key, str)
        if not NAME.match(value):
            self.fail(key, f"{value!r} is not a host name")
        return value

    def address(self, key: str) -> str:
        """A host name, an IP address or an ssh_config alias: it reaches ssh_config's
        ``Match exec`` and ``ProxyCommand`` as ``%h``, so nothing a shell reads as more."""
        value = self.text(key)
        if not (ADDRESS_PATTERN.match(value) and valid_hostname(value)):
            self.fail(key, f"{value!r} is not a host name or an address")
        return value

    def user(self, key: str) -> str | None:
        """As OpenSSH's ``valid_ruser``: the user reaches the same shell lines as ``%r``."""
        value = self.optional_text(key)
        if value is not None and not valid_ruser(value):
            self.fail(key, f"{value!r} is not a user name")
        return value

    def run_id(self, key: str) -> str:
        value = self.value(key, str)
        if not is_run_id(value):
            self.fail(key, f"{value!r} is not a run id")
        return value

    def integer(self, key: str, low: int = 1, high: int = 1 << 62) -> int:
        value = self.value(key, int)
        if not low <= value <= high:
            self.fail(key, f"{value} is out of range")
        return value

    def optional_integer(self, key: str, low: int = 1, high: int = 1 << 62) -> int | None:
        return None if self.data.get(key) is None else self.integer(key, low, high)

    def number(self, key: str, default: float | None = None, positive: bool = False) -> float:
        if default is not None and self.data.get(key) is None:
            return default
        value = self.data.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
                value <= 0 if positive else value < 0):
            self.fail(key, f"expected a number{' above 0' if positive else ''}, got {value!r}")
        return float(value)
