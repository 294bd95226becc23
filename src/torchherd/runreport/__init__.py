"""What happened to a run, from its history (``events.jsonl``): ``report RUN`` (one HTML
file, ``html``), ``report RUN --text`` (``text``), ``torchherd.report`` and
``torchherd.events_of``. ``story`` reads the history into plain data both draw from."""

from __future__ import annotations

from pathlib import Path

from torchherd.engine.eventlog import HISTORY_FILE, Recorded, history_file, read_history
from torchherd.engine.records import load
from torchherd.errors import UsageError
from torchherd.remote.wire import write_text_atomic
from torchherd.runreport.story import Story, story_of

NO_HISTORY_HINT = ("a run keeps its history from this version on, attached or detached with retries; "
                   "a plain detached run has no controller left to receive its events")


def history_path(run_id: str) -> Path:
    """The run's history file; UsageError for a run unknown or without one."""
    record = load(run_id)
    path = history_file(record)
    if path is None:
        raise UsageError(f"run {run_id} keeps no history ({HISTORY_FILE})", NO_HISTORY_HINT)
    return path


def history_of(run_id: str) -> list[Recorded]:
    """Every record of the run's history, in time order."""
    path = history_path(run_id)
    try:
        records = read_history(path)
    except FileNotFoundError:
        raise UsageError(f"run {run_id}: {path} is not there", NO_HISTORY_HINT) from None
    except OSError as error:
        raise UsageError(f"run {run_id}: cannot read {path}: {error.strerror}",
                         "it is written private to the user who ran the run") from None
    return sorted(records, key=lambda record: record.at)


def story(run_id: str) -> Story:
    return story_of(run_id, history_of(run_id))


def write_html(found: Story, path: Path) -> Path:
    """The report written to ``path`` (private: 0600, replaced atomically); its path."""
    from torchherd.runreport.html import page

    write_text_atomic(str(path), page(found))
    return path


REPORT_FILE = "report.html"


def default_path(run_id: str) -> Path:
    """Beside the history, in the run's log directory."""
    return history_path(run_id).parent / REPORT_FILE
