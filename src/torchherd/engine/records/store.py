"""The records on this machine: written atomically, read back by id (a unique part is
enough), listed, and the history of attached runs kept bounded."""

from __future__ import annotations

from pathlib import Path

from torchherd.engine.records.attached import KEPT_RUNS
from torchherd.engine.records.fields import DAMAGED, RecordError
from torchherd.engine.records.locks import controller_lock, holds_lock
from torchherd.engine.records.model import RunRecord, attached_of
from torchherd.engine.records.paths import runs_dir
from torchherd.errors import UsageError
from torchherd.remote.wire import is_run_id, write_text_atomic

MAX_RECORD_BYTES = 16 << 20


def save(record: RunRecord, directory: Path | None = None) -> Path:
    """Writes the record atomically (a concurrent ``status`` never reads half of it)."""
    directory = directory or runs_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)  # how to reach the nodes: the user's only, however it was made
    path = directory / f"{record.run_id}.json"
    write_text_atomic(str(path), record.to_json())
    return path


AMBIGUOUS_SHOWN = 10
"""The runs an ambiguous run id lists."""


def load(run_id: str, directory: Path | None = None) -> RunRecord:
    """The record of ``run_id``; a unique prefix (or the last characters) is enough, never
    a part in the middle (``stop 1200`` would stop whichever run started at 12:00)."""
    if not is_run_id(run_id):  # never a path: "../../x" must not name a file
        raise UsageError(f"run id {run_id!r}: not a run id (letters, digits and '-')",
                         "torchherd status lists the known runs")
    directory = directory or runs_dir()
    exact = directory / f"{run_id}.json"
    if exact.is_file():
        return read_record(exact)
    matches = [path for path in _record_files(directory) if path.stem.startswith(run_id) or path.stem.endswith(run_id)]
    if len(matches) == 1:
        return read_record(matches[0])
    if matches:  # one line still, however many runs the state directory holds
        shown = ", ".join(path.stem for path in matches[:AMBIGUOUS_SHOWN])
        more = f", ... ({len(matches)} in all)" if len(matches) > AMBIGUOUS_SHOWN else ""
        raise UsageError(f"run id {run_id!r} is ambiguous: {shown}{more}", "give more of the run id")
    raise UsageError(f"no run {run_id!r} in {directory}", "torchherd status lists the known runs")


def read_record(path: Path) -> RunRecord:
    """The record in ``path``; RecordError (exit 2) names the file and what is wrong."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_RECORD_BYTES + 1)
    except OSError as error:
        raise RecordError(f"{path}: cannot read the run record: {error.strerror}") from None
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError(f"{path}: larger than {MAX_RECORD_BYTES >> 20} MiB: not a run record", DAMAGED)
    return RunRecord.from_json(data.decode("utf-8", "replace"), str(path))


def load_all(directory: Path | None = None) -> list[RunRecord]:
    """Every readable record, oldest first."""
    return scan(directory)[0]


def scan(directory: Path | None = None) -> tuple[list[RunRecord], list[RecordError]]:
    """Every readable record, oldest first, and what is wrong with each damaged one (its
    error names the file): ``status`` lists those too, never hides a run."""
    records, damaged = [], []
    for path in _record_files(directory or runs_dir()):
        try:
            records.append(read_record(path))
        except RecordError as error:
            damaged.append(error)
    return sorted(records, key=lambda record: record.created), damaged


def prune(directory: Path | None = None, keep: int = KEPT_RUNS) -> list[str]:
    """Keeps the history bounded: removes the records (and controller locks) of the oldest
    attached runs beyond ``keep``, never one whose controller still runs; returns their ids.
    Detached runs are not touched, nor damaged records (``status`` shows those)."""
    directory = directory or runs_dir()
    attached = []
    for record in scan(directory)[0]:
        found = attached_of(record)
        if found is not None:
            attached.append((record, found))
    removed = []
    for record, found in attached[:max(0, len(attached) - keep)]:
        if found.ending == "running" and holds_lock(record.run_id, found.pid, found.start, directory):
            continue
        for path in (directory / f"{record.run_id}.json", controller_lock(record.run_id, directory)):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        removed.append(record.run_id)
    return removed


def _record_files(directory: Path) -> list[Path]:
    try:
        return sorted(path for path in directory.iterdir() if path.suffix == ".json")
    except OSError:
        return []
