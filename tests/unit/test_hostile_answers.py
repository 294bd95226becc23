"""What a node, the job or SLURM answers is validated for type and range before it is
used: a bad answer is that node's failed check (or a figure left out), never an internal
error that ends ``check``, or a recovering run. Pure: the parsers and analyses are given
the answers a hostile or broken node could send."""

from __future__ import annotations

import json
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


def _read_line(script: str, seconds: float) -> tuple[float, bytes | None, int]:
    """A line read from a real local process that never ends one: how long it took, what it
    gave, and how much the reader held after. The process is killed after 8 s whatever
    happens (so a reader that never gives up still ends, and the test fails, not hangs)."""
    import shlex
    import sys
    import threading
    import time

    from torchherd.checks.gather import LineReader
    from torchherd.transport.local import LocalSession

    session = LocalSession("node1")
    process = session.start(f"exec {shlex.quote(sys.executable)} -u -c {shlex.quote(script)}")
    reader = LineReader(process)
    found: list[bytes | None] = []
    started = time.monotonic()
    thread = threading.Thread(target=lambda: found.append(reader.line(time.monotonic() + seconds)), daemon=True)
    thread.start()
    thread.join(8.0)
    took = time.monotonic() - started
    process.close()
    session.close()
    thread.join(10.0)
    return took, found[0] if found else b"never returned", len(reader.buffer)


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
