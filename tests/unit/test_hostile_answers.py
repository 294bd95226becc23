"""What a node, the job or SLURM answers is validated for type and range before it is
used: a bad answer is that node's failed check (or a figure left out), never an internal
error that ends ``check``, or a recovering run. Pure: the parsers and analyses are given
the answers a hostile or broken node could send."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

import pytest

from torchherd.checks import bandwidth as measure
from torchherd.checks.analysis.frontends import _covers_port
from torchherd.checks.analysis.iptables import _port_matches
from torchherd.checks.analysis.slurm import gres_gpus, parse_sinfo
from torchherd.checks.analysis.smoke import SmokeContext, SmokeRun, parse_marks, smoke_verdicts
from torchherd.engine.slurm.commands import parse_exit_file
from torchherd.inventory import parse
from torchherd.runlog import NodeOutcome, OutputLine, RunSummary

LINK = ("node0", "node1")
GOOD = {"id": 1, "bytes": 1_000_000, "seconds": 0.3, "sender": {"cpu": 0.1, "wait": 0.0},
        "receiver": {"cpu": 0.2, "wait": 0.1}}


@pytest.mark.parametrize("damage", [
    pytest.param({"bytes": 10 ** 400}, id="huge-byte-count"),
    pytest.param({"bytes": -5}, id="negative-byte-count"),
    pytest.param({"bytes": True}, id="byte-count-bool"),
    pytest.param({"seconds": float("nan")}, id="seconds-nan"),
    pytest.param({"seconds": float("inf")}, id="seconds-inf"),
    pytest.param({"seconds": 1e-320}, id="seconds-denormal"),
    pytest.param({"sender": [1, 2]}, id="sender-a-list"),
    pytest.param({"receiver": {"cpu": "lots"}}, id="share-a-string"),
    pytest.param({"receiver": {"cpu": float("nan")}}, id="share-nan"),
])
def test_a_transfer_answer_of_the_wrong_type_or_range_fails_that_link(damage: dict[str, Any]) -> None:
    answer = json.loads(json.dumps({**GOOD, **damage}))  # as it arrives: through JSON (NaN included)
    transfer = measure._transfer(LINK, answer, alone=False)
    assert transfer.bits_per_second is None
    assert "malformed" in transfer.error


def test_a_good_transfer_answer_is_measured() -> None:
    transfer = measure._transfer(LINK, GOOD, alone=False)
    assert transfer.bits_per_second == pytest.approx(1_000_000 * 8 / 0.3)
    assert transfer.cpu == {"sender_cpu": 0.1, "sender_wait": 0.0, "receiver_cpu": 0.2, "receiver_wait": 0.1}


NAMES = ("node0", "node1")
INVENTORY = parse({"cluster": {"port": 29500}, "hosts": [{"name": name} for name in NAMES]}, Path("hosts.toml"))
CONTEXT = SmokeContext(INVENTORY, {name: name for name in NAMES}, ("gloo",), 60.0, 8.0)


def test_the_smoke_jobs_figures_out_of_range_are_left_out() -> None:
    """The smoke job's output names node pairs by index: one past the nodes, or a figure
    that is not a number, is left out, not an IndexError."""
    crcs = ",".join(str(zlib.crc32(name.encode())) for name in NAMES)
    lines = {name: [OutputLine(name, index, "out", f"torchherd-smoke {text}")
                    for text in (f"start {index} {name}", f"joined {index}", f"gathered {index} {crcs}", f"ok {index}")]
             for index, name in enumerate(NAMES)}
    lines["node1"] += [OutputLine("node1", 1, "out", "torchherd-smoke pair 1 0 9 1.5"),
                       OutputLine("node1", 1, "out", "torchherd-smoke pair 1 0 1 nan"),
                       OutputLine("node1", 1, "out", "torchherd-smoke pair 1 0 1 2.5"),
                       OutputLine("node1", 1, "out", "torchherd-smoke gathered 1 \u00b2,1")]
    outcomes = tuple(NodeOutcome(name, index, "ok", 0, 5.0, None, None, ()) for index, name in enumerate(NAMES))
    results = smoke_verdicts(CONTEXT, SmokeRun(RunSummary("smoke", 0, "", outcomes, ""),
                                               {name: tuple(found) for name, found in lines.items()}, False))
    cluster = [result for result in results if result.node == "cluster"]
    assert len(cluster) == 1 and "slowest node pair node0 -> node1 2.5 Gbit/s (of 1," in cluster[0].summary
    assert parse_marks(lines["node1"][-1:]).gathered == [1]


def test_sinfo_with_a_digit_int_cannot_read_is_no_number() -> None:
    """``'²'.isdigit()`` is True and ``int('²')`` raises: in a recovering SLURM run's
    triage that ended the whole run."""
    rows = parse_sinfo("n1|gpu*|up|idle|\u00b2|gpu:\u00b2|none\nn2|gpu|up|idle|8|gpu:4|none\n")
    assert [(row.node, row.cpus, row.gpus) for row in rows] == [("n1", None, 0), ("n2", 8, 4)]
    assert gres_gpus("gpu:a100:\u0663") == 0


def test_other_numbers_from_a_node_are_ascii_digits_only() -> None:
    assert parse_exit_file("n1", "job \u00b2 1700000000.5") is None
    assert not _port_matches("\u00b2:80", 29500) and not _port_matches("1:\u00b2", 29500)
    assert not _covers_port("\u00b2", 29500) and not _covers_port("29000:\u00b2", 29500)


@pytest.mark.parametrize("check,damage", [
    pytest.param("clock", {"time": [1]}, id="clock-time-a-list"),
    pytest.param("clock", {"time": 10 ** 400}, id="clock-time-huge"),
    pytest.param("hostname", {"resolve": ["node0"]}, id="hostname-resolve-a-list"),
    pytest.param("firewall", {"port_range": "\u00b2\t60999\n"}, id="firewall-port-range"),
])
def test_a_facts_document_of_the_wrong_shape_is_that_nodes_failed_check(check: str, damage: dict[str, Any]) -> None:
    """One node's facts with a list where an object is expected (or a number no float
    holds): that node's check fails, naming what it sent; the other node is judged as ever."""
    from support.analysis import facts, observed
    from torchherd.checks.analysis.registry import ANALYSES

    results = {result.node: result for result in ANALYSES[check](observed(node1=facts("node1", **damage)))
               if result.node in ("node0", "node1")}
    assert results["node1"].status == "fail" and "malformed" in results["node1"].summary, results["node1"]
    assert results["node0"].status in ("pass", "warn", "skip"), results["node0"]


def test_gpu_facts_of_the_wrong_shape_are_read_as_absent_never_a_traceback() -> None:
    """The gpu check reads every field of a node's GPU facts as it comes (tests/unit/
    test_gpu_fuzz.py): a list where torch's answer should be is no answer from torch."""
    from support.analysis import facts, observed
    from torchherd.checks.analysis.registry import ANALYSES

    results = {result.node: result for result in ANALYSES["gpu"](observed(node1=facts("node1", torch=[1])))
               if result.node in ("node0", "node1")}
    assert (results["node1"].status, results["node1"].summary) == (
        "skip", "neither torch nor nvidia-smi could count GPUs here"), results["node1"]
    assert results["node0"].status in ("pass", "warn", "skip"), results["node0"]


def test_a_facts_answer_that_is_not_an_object_is_that_nodes_failure(tmp_path: Path) -> None:
    """The facts script (here a stand-in on a real local session) answers ``[1]``: the
    node fails to report, as when it answers nothing, not an AttributeError later."""
    from torchherd.checks.gather import finish_facts, start_facts
    from torchherd.errors import TransportError
    from torchherd.inventory import Host
    from torchherd.transport.local import LocalSession

    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho '[1]'\nexec cat >/dev/null\n")
    python.chmod(0o755)
    host = Host(name="node1", address="node1", user=None, ssh_port=None, identity_file=None, python=str(python),
                workdir="~", env={}, setup="", local_addr=None)
    session = LocalSession("node1")
    try:
        started = start_facts(session, {"listen": None}, 10.0, str(python))
        with pytest.raises(TransportError, match="not a JSON object"):
            finish_facts(started, host)
    finally:
        session.close()


FLOOD = "import sys, time\nsys.stdout.write('x' * (20 << 20)); sys.stdout.flush(); time.sleep(30)\n"


def _read_line(script: str, seconds: float, sync: bool = False) -> tuple[float, bytes | None, int]:
    """A line read from a real local process that never ends one: how long it took, what it
    gave, and how much the reader held after. The process is killed after 8 s whatever
    happens (so a reader that never gives up still ends, and the test fails, not hangs)."""
    import shlex
    import sys
    import threading
    import time

    from torchherd.checks.gather import LineReader
    from torchherd.engine.prepare.sync import Lines
    from torchherd.transport.local import LocalSession

    session = LocalSession("node1")
    process = session.start(f"exec {shlex.quote(sys.executable)} -u -c {shlex.quote(script)}")
    reader = Lines(process) if sync else LineReader(process)
    found: list[bytes | None] = []
    started = time.monotonic()

    def read() -> None:  # the sync's reader takes a timeout, the checks' a deadline
        found.append(reader.line(seconds) if isinstance(reader, Lines) else reader.line(time.monotonic() + seconds))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(8.0)
    took = time.monotonic() - started
    process.close()
    session.close()
    thread.join(10.0)
    return took, found[0] if found else b"never returned", len(reader.lines.data)


class _Trickle:
    """A node's stdout that always has a little more, never a newline (as a hostile node
    over SSH: every read gets bytes, so a reader that looks at its deadline only when
    nothing arrives never does). Ends (EOF) once ``ended`` is set."""

    def __init__(self) -> None:
        import threading

        self.ended = threading.Event()

    def read(self, timeout: float) -> bytes:
        if self.ended.wait(min(timeout, 0.005)):
            return b""
        return b"x" * 512


def test_a_node_that_never_ends_a_line_is_given_up_at_the_deadline() -> None:
    import threading
    import time
    from typing import cast

    from torchherd.checks.gather import LineReader
    from torchherd.transport import Process

    trickle = _Trickle()
    reader = LineReader(cast(Process, trickle))
    found: list[bytes | None] = []
    started = time.monotonic()
    thread = threading.Thread(target=lambda: found.append(reader.line(time.monotonic() + 1.0)), daemon=True)
    thread.start()
    thread.join(4.0)
    took = time.monotonic() - started
    trickle.ended.set()
    thread.join(10.0)
    assert found == [None] and took < 3.0, (took, found[:1] and (found[0] or b"")[:10])


def test_a_line_without_end_is_cut_off_at_the_readers_cap() -> None:
    from torchherd.checks.gather import MAX_LINE

    took, line, held = _read_line(FLOOD, 6.0)
    assert line is None and took < 5.0 and held <= MAX_LINE, (took, line, held)


def test_the_syncs_reader_gives_up_a_line_without_end_at_the_same_cap() -> None:
    """A sync receiver (or a relay) that never ends its answer: given up once it passes the
    checks' cap, not held in memory until the read's timeout (600 s for a pull)."""
    from torchherd.checks.gather import MAX_LINE

    took, line, held = _read_line(FLOOD, 60.0, sync=True)
    assert line is None and took < 5.0 and held <= MAX_LINE, (took, line, held)


def test_the_shared_line_buffer_keeps_what_follows_a_line() -> None:
    from torchherd.checks.gather import LineBuffer

    lines = LineBuffer(cap=16)
    for chunk in (b"ab", b"c\nde", b"f\n", b"g"):
        lines.add(chunk)
    assert (lines.take(), lines.take(), lines.take()) == (b"abc", b"def", None)
    lines.add(b"h" * 16)
    assert lines.take() is None and lines.broken and lines.data == bytearray()
    lines.add(b"\n")
    assert lines.take() is None  # broken: nothing more is held


# --uv-offline: a node's platform answer names the wheelhouse's directory here ----------------

class _Answers:
    """A node whose venv builder answers ``answer`` (one JSON line) to every command."""

    def __init__(self, answer: dict[str, Any]) -> None:
        self.answer = answer
        self.commands: list[str] = []

    def run(self, command: str, stdin: bytes | None = None, timeout: float | None = None) -> Any:
        from torchherd.transport.base import CommandResult

        self.commands.append(command)
        return CommandResult(0, (json.dumps(self.answer) + "\n").encode(), b"", 0.1)


def _venv_node(tmp_path: Path) -> Any:
    from torchherd.plan import RunOptions, SyncOptions, UvOptions, build_plan

    inventory = parse({"cluster": {"nproc_per_node": 1},
                       "defaults": {"python": "/usr/bin/python3", "workdir": str(tmp_path),
                                    "venv_dir": str(tmp_path / "v")},
                       "hosts": [{"name": "n0"}]}, Path("h.toml"))
    plan = build_plan(inventory, RunOptions(script="train.py", run_id="r1", sync=SyncOptions(str(tmp_path)),
                                            uv=UvOptions("ab" * 32, offline=True)))
    return plan.nodes[0]


PLATFORM = {"system": "Linux", "machine": "x86_64", "libc": "glibc", "libc_version": "2.35", "python": "3.11.4"}


@pytest.mark.parametrize("damage, field", [
    pytest.param({"machine": "x86_64-3.11/../../../../my", "python": "thesis"}, "machine", id="machine-a-path"),
    pytest.param({"python": "thesis"}, "python", id="python-not-a-version"),
    pytest.param({"python": "3.11.4/../x"}, "python", id="python-a-path"),
    pytest.param({"libc_version": "2.35/.."}, "libc_version", id="libc-version-a-path"),
    pytest.param({"libc": "glibc/../x"}, "libc", id="libc-other"),
    pytest.param({"system": "Linux/.."}, "system", id="system-not-linux"),
    pytest.param({"machine": ["x86_64"]}, "machine", id="machine-a-list"),
    pytest.param({"machine": "x" * 33}, "machine", id="machine-too-long"),
    pytest.param({"machine": "x86_64\n"}, "machine", id="machine-with-a-newline"),
])
def test_a_hostile_platform_answer_fails_that_node_as_malformed(tmp_path: Path, damage: dict[str, Any],
                                                                  field: str) -> None:
    from torchherd.engine.events import VenvFailed
    from torchherd.engine.prepare import venvs
    from torchherd.engine.prepare.uvwheels import REPORTED

    answer = {"error": "the lock's wheels are not in x", "wheelhouse_missing": True, **PLATFORM, **damage}
    result = venvs._build(_venv_node(tmp_path), _Answers(answer), None, offline=True)  # type: ignore[arg-type]
    assert isinstance(result, VenvFailed), result
    assert result.message == f"the venv builder's answer is malformed: its {field} is not {REPORTED[field]}"
    # the uv-missing answer is read as strictly (it picks the uv wheel sent to the node)
    answer = {"error": "uv not found", "uv_missing": True, **PLATFORM, **damage}
    if field != "python":
        result = venvs._build(_venv_node(tmp_path), _Answers(answer), None)  # type: ignore[arg-type]
        assert isinstance(result, VenvFailed) and result.message.startswith("the venv builder's answer is malformed")


def test_a_good_platform_answer_asks_for_wheels(tmp_path: Path) -> None:
    from torchherd.engine.prepare import venvs
    from torchherd.engine.prepare.uvwheels import NodePlatform

    answer = {"error": "the lock's wheels are not in x", "wheelhouse_missing": True, **PLATFORM}
    needs = venvs._build(_venv_node(tmp_path), _Answers(answer), None, offline=True)  # type: ignore[arg-type]
    assert isinstance(needs, venvs.NeedsWheels)
    assert (needs.platform, needs.python) == (NodePlatform("Linux", "x86_64", "glibc", "2.35"), "3.11.4")
    musl = {**answer, "libc": "musl", "libc_version": ""}
    needs = venvs._build(_venv_node(tmp_path), _Answers(musl), None, offline=True)  # type: ignore[arg-type]
    assert isinstance(needs, venvs.NeedsWheels) and needs.platform.libc == "musl"


def test_the_wheelhouse_is_never_made_outside_its_cache(tmp_path: Path) -> None:
    """Past the parser (a NodePlatform made by hand): the name a path, the wheelhouse the
    reviewer's ``~/my-thesis``. Nothing there is renamed aside or removed."""
    from torchherd.engine.prepare.offline import WheelhouseError, cache_name, make_wheelhouse
    from torchherd.engine.prepare.uvwheels import NodePlatform

    root = tmp_path / "c" / "t" / "houses"
    hostile = NodePlatform("Linux", "x86_64-3.11/../../../../my", "glibc", "2.35")
    name = cache_name("ab" * 32, hostile, "thesis")
    (root / name.split("/")[0]).mkdir(parents=True)  # the first part: a wheelhouse made earlier
    thesis = Path(os.path.normpath(root / name))
    assert thesis == tmp_path / "my-thesis"
    thesis.mkdir()
    (thesis / "chapter1.tex").write_text("years of work")
    with pytest.raises(WheelhouseError) as raised:
        make_wheelhouse("", "ab" * 32, hostile, "thesis", None, root=root)
    assert str(raised.value) == f"the wheelhouse name {name!r} is not one directory in {root}"
    assert (thesis / "chapter1.tex").read_text() == "years of work"
    assert sorted(path.name for path in thesis.iterdir()) == ["chapter1.tex"]


# checkpoint staging: a node's answer of the wrong type, a file name that is not UTF-8 -------------

CHECKPOINT = {"path": "ckpt/step-20.pt", "kind": "file", "size": 10, "mtime": 2000.0, "sha256": "ab" * 32, "files": 1}


@pytest.mark.parametrize("damage", [
    pytest.param({"size": "10"}, id="size-a-string"),
    pytest.param({"size": True}, id="size-a-bool"),
    pytest.param({"size": -1}, id="size-negative"),
    pytest.param({"mtime": "yesterday"}, id="mtime-a-string"),
    pytest.param({"mtime": None}, id="mtime-null"),
    pytest.param({"kind": "fifo"}, id="kind-other"),
    pytest.param({"path": ["a"]}, id="path-a-list"),
    pytest.param({"sha256": 7}, id="sha256-a-number"),
    pytest.param({"size": None, "kind": None, "mtime": None}, id="fields-missing"),
])
def test_a_checkpoint_answer_of_the_wrong_type_fails_that_node(tmp_path: Path, damage: dict[str, Any]) -> None:
    from torchherd.engine.prepare.staging import _find

    node = _venv_node(tmp_path)
    answer = _find(_Answers({**CHECKPOINT, **damage}), node, "ckpt/step-*.pt")  # type: ignore[arg-type]
    assert answer == "a malformed answer from checkpoint.py find"


def test_a_checkpoint_name_that_is_not_utf8_fails_that_node_in_one_line(tmp_path: Path) -> None:
    """The node's json.dumps writes an undecodable byte of a file name as a lone surrogate:
    put on the relay's command line, paramiko's UTF-8 would raise."""
    from torchherd.engine.prepare.staging import Copy, _find

    node = _venv_node(tmp_path)
    answer = _find(_Answers({**CHECKPOINT, "path": "ckpt/step-\udcff.pt"}), node, "ckpt/*")  # type: ignore[arg-type]
    assert answer == ("its newest checkpoint's name is not UTF-8 (ckpt/step-\\udcff.pt): rename it; torchherd "
                      "names files on command lines as UTF-8")
    good = _find(_Answers(CHECKPOINT), node, "ckpt/*")  # type: ignore[arg-type]
    assert good == Copy("n0", "ckpt/step-20.pt", "file", 10, 2000.0, "ab" * 32)


def test_a_command_that_is_not_utf8_is_a_transport_error_not_an_internal_one() -> None:
    from torchherd.errors import TransportError
    from torchherd.transport.sshfailures import as_transport_error

    with pytest.raises(TransportError) as raised:
        with as_transport_error("n0", "run"):
            "cat ckpt/\udcff.pt".encode("utf-8")
    assert str(raised.value) == "n0: cannot run: a command or path that is not UTF-8"


@pytest.mark.parametrize("progress, shown", [(1024, True), ("1024", False), (-1, False), (True, False), (1.5, False),
                                             (None, False)])
def test_a_relays_progress_of_the_wrong_type_is_passed_over(progress: Any, shown: bool) -> None:
    from torchherd.engine.prepare.relay import _well_formed

    assert _well_formed({"progress": progress}) is shown


def test_a_nodes_python_version_reaches_the_terminal_escaped() -> None:
    """``check --sync`` prints the wheels' notes: a python version a node made up (OSC 52,
    a clear screen) is shown escaped (the venv builder's answer is checked too: M1)."""
    from io import StringIO

    from torchherd.console import make_console
    from torchherd.console.sync import SyncPrinter
    from torchherd.engine.events import WheelsDownloading, WheelsRelayed, WheelsStarted

    hostile = "3.11\x1b]52;c;ZXZpbA==\x07\x1b[2J"
    out = StringIO()
    printer = SyncPrinter(make_console(out, width=400))
    printer(WheelsDownloading("manylinux_2_35_x86_64", hostile, ("a==1",), "/w"))
    printer(WheelsStarted("manylinux_2_35_x86_64", hostile, "/c/h", (("n0",),), 1, 10))
    printer(WheelsRelayed("manylinux_2_35_x86_64", hostile, "/c/h", (("n0",),), 1, 10, 10, (), 1.0, ()))
    text = out.getvalue()
    assert "\x1b" not in text and "\x07" not in text, repr(text)
    assert text.count("python 3.11\\x1b]52;c;ZXZpbA==\\x07\\x1b[2J") == 3, text
