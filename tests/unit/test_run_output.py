"""The run's output path without sockets: records -> lines -> log text and terminal text,
the summary, and the remote command run through a local shell and the real supervisor."""

from __future__ import annotations

import json
import subprocess
import sys
from io import StringIO
from pathlib import Path

from support.processes import plant
from torchherd.console import make_console
from torchherd.console.detach import status_note
from torchherd.console.run import LiveRenderer, render_summary
from torchherd.engine.outcome import OutputTrack, first_cause
from torchherd.engine.ssh.job import records_to_events, remote_command, supervisor_config, supervisor_source
from torchherd.inventory import parse
from torchherd.plan import RunOptions, build_plan
from torchherd.runlog import (
    AttemptRecord,
    NodeOutcome,
    OutputLine,
    OutputParser,
    RankLines,
    RecordSplitter,
    RunSummary,
    Slowest,
    Status,
    is_error_line,
    is_peer_error,
    parse_output,
    root_cause_rank,
    visible_text,
)


def test_splitter_joins_records_across_chunks() -> None:
    splitter = RecordSplitter()
    assert splitter.feed(b"Ohel") == []
    assert splitter.feed(b"lo\nH\nEba") == [b"Ohello", b"H"]
    assert splitter.feed(b"d\n") == [b"Ebad"]
    assert splitter.feed(b"Otail") == []
    assert splitter.finish() == [b"Otail"]


def test_records_become_lines_and_events() -> None:
    events = records_to_events("n1", [b"O[torchherd-rank 3] step 1", b"H", b"E[torchherd-rank 12] oops",
                                      b"Oplain", b'S{"event":"exit","code":2}', b"Xodd"])
    assert events == [OutputLine("n1", 3, "out", "step 1"), OutputLine("n1", 12, "err", "oops"),
                      OutputLine("n1", None, "out", "plain"), Status("n1", "exit", {"event": "exit", "code": 2}),
                      OutputLine("n1", None, "out", "Xodd")]


def test_only_a_real_prefix_is_a_rank() -> None:
    assert parse_output("n", "out", b"[torchherd-rank x] a").rank is None
    assert parse_output("n", "out", b"text [torchherd-rank 1] a").rank is None


def test_carriage_return_keeps_what_a_terminal_shows() -> None:
    assert visible_text(b"10%\r50%\r100%") == "100%"
    assert visible_text(b"done\r") == "done"
    assert visible_text(b"\xff bad utf8") == "\ufffd bad utf8"


def test_log_text_keeps_rank_and_stream() -> None:
    assert OutputLine("n", 3, "out", "x").log_text() == "[rank 3] x"
    assert OutputLine("n", 3, "err", "x").log_text() == "[rank 3 stderr] x"
    assert OutputLine("n", None, "out", "x").log_text() == "x"
    assert OutputLine("n", None, "err", "x").log_text() == "[stderr] x"


def test_error_lines_and_root_cause() -> None:
    assert is_error_line(OutputLine("n", 1, "err", "[rank1]: RuntimeError: boom"))
    assert is_error_line(OutputLine("n", None, "err", "ValueError: bad"))
    assert not is_error_line(OutputLine("n", 1, "out", "ValueError: printed on stdout"))
    assert not is_error_line(OutputLine("n", 1, "err", "[rank1]:     raise RuntimeError('x')"))
    missing = "/usr/bin/python3: can't open file '/w/train.py': [Errno 2] No such file or directory"
    assert is_error_line(OutputLine("n", 2, "err", missing))
    assert not is_error_line(OutputLine("n", 2, "out", missing))
    assert OutputLine("n", 1, "err", "[rank1]: RuntimeError: boom").described() == "rank 1: RuntimeError: boom"
    assert root_cause_rank(OutputLine("n", None, "err", "  rank      : 5 (local_rank: 1)")) == 5


def test_renderer_prints_a_batch_with_aligned_prefixes_on_a_terminal() -> None:
    out = StringIO()
    renderer = LiveRenderer(make_console(out, terminal=True), ["node0", "node1"], max_rank=11)
    renderer.render([OutputLine("node0", 0, "out", "hello"), OutputLine("node1", 11, "err", "[x] not markup"),
                     OutputLine("node1", None, "err", "torchrun says")])
    renderer.note("node1: exited with code 1")
    assert out.getvalue() == ("node0:0  │ hello\n"
                              "node1:11 │ [x] not markup\n"
                              "node1    │ torchrun says\n"
                              "torchherd │ node1: exited with code 1\n")


def test_piped_lines_are_node_rank_colon_text_in_ascii() -> None:
    """pdsh's form where stdout is not a terminal: ``grep '^node1:'`` and ``cut -d:`` work;
    the job's escape sequences are still shown, never acted on."""
    out = StringIO()
    renderer = LiveRenderer(make_console(out), ["node0", "node1"], max_rank=11)
    renderer.render([OutputLine("node0", 0, "out", "hello"), OutputLine("node1", 11, "err", "[x] not markup"),
                     OutputLine("node1", None, "err", "torchrun says"),
                     RankLines("node1", b"\nO[torchherd-rank 10] a: b\nE[torchherd-rank 11] \x1b[2Jboom\n"
                                        b"O[torchherd-rank 10] \n")])
    renderer.note("node1: exited with code 1")
    text = out.getvalue()
    assert text == ("node0:0: hello\n"
                    "node1:11: [x] not markup\n"
                    "node1: torchrun says\n"
                    "node1:10: a: b\n"
                    "node1:11: \\x1b[2Jboom\n"
                    "node1:10: \n"
                    "torchherd: node1: exited with code 1\n")
    assert text.isascii()
    assert [line.split(":", 2)[:2] for line in text.splitlines() if line.startswith("node1:1")] == [
        ["node1", "11"], ["node1", "10"], ["node1", "11"], ["node1", "10"]]


def test_a_long_piped_line_comes_through_whole() -> None:
    line = "x" * 150
    out = StringIO()
    LiveRenderer(make_console(out, width=80), ["node0"], max_rank=0).render([OutputLine("node0", 0, "out", line)])
    assert out.getvalue() == f"node0:0: {line}\n"


def test_renderer_colours_on_a_terminal() -> None:
    from rich.console import Console

    out = StringIO()
    renderer = LiveRenderer(Console(file=out, force_terminal=True, color_system="standard"), ["a"], 1)
    renderer.render([OutputLine("a", 1, "err", "bad")])
    text = out.getvalue()
    assert "\x1b[" in text and text.endswith("bad\x1b[0m\n") and "a:1" in text


def test_summary_names_the_failed_node_and_shows_its_last_lines() -> None:
    summary = RunSummary("r1", 1, "node1 rank 3 failed first with exit code 1: rank 3: RuntimeError: boom", (
        NodeOutcome("node0", 0, "torn down", 143, 3.25, None, None, ()),
        NodeOutcome("node1", 1, "failed", 1, 2.0, "rank 3: RuntimeError: boom", 3, ("[rank 3] last words",)),
    ), "logs/r1")
    out = StringIO()
    render_summary(make_console(out, width=100, terminal=True), summary)
    text = out.getvalue()
    assert "│ node0 │ torn down       │ 143  │ 3.2s │" in text
    assert "│ node1 │ failed (rank 3) │ 1    │ 2.0s │ rank 3: RuntimeError: boom" in text
    assert "last lines of node1:\n  [rank 3] last words\n" in text
    assert text.endswith("node1 rank 3 failed first with exit code 1: rank 3: RuntimeError: boom\nlogs: logs/r1\n")
    piped = StringIO()
    render_summary(make_console(piped, width=100), summary)
    assert piped.getvalue() == ("run r1\n"
                                "node   state            exit  time  first error\n"
                                "node0  torn down        143   3.2s\n"
                                "node1  failed (rank 3)  1     2.0s  rank 3: RuntimeError: boom\n"
                                "last lines of node1:\n"
                                "  [rank 3] last words\n"
                                "node1 rank 3 failed first with exit code 1: rank 3: RuntimeError: boom\n"
                                "logs: logs/r1\n")


NASTY = "a b'c\"$(touch /tmp/pwned-unit) `id` ; \\ $HOME *"


def test_remote_command_runs_the_supervisor_with_exact_env(tmp_path: Path) -> None:
    """The exact command sshd would run, through a local sh: quoting, ~, setup, supervisor,
    in a workdir whose own ``json.py``, ``base64.py``... the supervisor does not import."""
    plant(tmp_path)
    document = {"defaults": {"python": sys.executable, "workdir": str(tmp_path), "setup": "export FROM_SETUP=1"},
                "hosts": [{"name": "n0", "address": "127.0.0.1"}]}
    plan = build_plan(parse(document, Path("h.toml")), RunOptions(script="-c", run_id="unit-1",
                                                                 extra_env={"X": NASTY}))
    node = plan.nodes[0]
    argv = (sys.executable, "-c", "import os; print(repr(os.environ['X']), os.environ['FROM_SETUP'], os.getcwd())")
    node = type(node)(**{**node.__dict__, "argv": argv})
    command = remote_command(node, "unit-1", supervisor_source())
    assert NASTY not in command and "FROM_SETUP=1" in command  # the env travels on stdin, not in `ps`
    # stdin stays open while the job runs: its EOF would mean "the controller is gone".
    shell = subprocess.Popen(["sh", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert shell.stdout is not None and shell.stdin is not None
    shell.stdin.write(supervisor_config(node, "unit-1", 1.0).to_line())
    shell.stdin.flush()
    records = []
    for record in shell.stdout:
        records.append(record.rstrip(b"\n"))
        if record.startswith(b'S{"event":"done"'):
            break
    shell.stdin.close()
    assert shell.wait(timeout=30) == 0
    assert f"O{NASTY!r} 1 {tmp_path}".encode() in records, records
    assert json.loads(records[-1][1:]) == {"event": "done", "code": 0, "left": 0}
    assert not Path("/tmp/pwned-unit").exists()


CHUNK = (b"O[torchherd-rank 3] step 1\nH\nE[torchherd-rank 12] [rank12]: RuntimeError: boom\n"
         b"O[torchherd-rank 12] \xff bad utf8 \xe2\x82\nE[torchherd-rank 3] warn \xe2\x82\nO[torchherd-rank 0] \n")


def test_a_chunk_of_rank_lines_stays_one_block_with_the_same_lines() -> None:
    parser = OutputParser("n1")
    assert parser.feed(CHUNK[:20]) == []
    [block] = parser.feed(CHUNK[20:])
    assert isinstance(block, RankLines)
    slow = [event for event in records_to_events("n1", CHUNK.split(b"\n")[:-1]) if isinstance(event, OutputLine)]
    assert block.lines() == slow
    assert block.tail(2) == slow[-2:] and block.tail(8) == slow
    assert block.log_bytes() == "".join(line.log_text() + "\n" for line in slow).encode()
    assert [line for line in block.error_candidates() if is_error_line(line)] == [slow[1]]


def test_other_chunks_are_parsed_line_by_line() -> None:
    for odd in (b"Oplain\n", b"O[torchherd-rank 01] x\n", b"O[torchherd-rank 1]x\n", b"O[torchherd-rank 1] 10%\r50%\n",
                b'S{"event":"exit","code":2}\n', b"Xodd\n", b"H\nH\n"):
        events = OutputParser("n1").feed(b"O[torchherd-rank 1] a\n" + odd)
        assert events == records_to_events("n1", (b"O[torchherd-rank 1] a\n" + odd).split(b"\n")[:-1]), odd


def test_renderer_prints_a_block_as_it_prints_its_lines() -> None:
    from rich.console import Console

    [block] = OutputParser("node1").feed(CHUNK)
    assert isinstance(block, RankLines)
    for colour in (False, True):
        bulk, single = StringIO(), StringIO()
        for out, items in ((bulk, [block, block]), (single, block.lines() * 2)):
            console = Console(file=out, force_terminal=colour, color_system="standard" if colour else None)
            LiveRenderer(console, ["node0", "node1"], max_rank=12).render(items)
        assert bulk.getvalue() == single.getvalue(), colour


_TORCHRUN_REPORT = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=====================================================
/w/examples/ddp_demo.py FAILED
-----------------------------------------------------
Failures:
[1]:
  time      : 2026-11-25_18:42:14
  host      : node1
  rank      : 3 (local_rank: 1)
  exitcode  : -15 (pid: 650)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 650
-----------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-25_18:42:14
  host      : node1
  rank      : 2 (local_rank: 0)
  exitcode  : -6 (pid: 649)  (SIGABRT)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 649
====================================================="""


def _tracked(lines: list[OutputLine]) -> OutputTrack:
    track = OutputTrack("node1", 1, Path("node1.log"))
    for line in lines:
        track.take(line)
    return track


def test_the_failed_rank_is_torchruns_root_cause_not_the_peer_its_agent_terminated() -> None:
    """torchrun lists the rank it SIGTERMed (3) under "Failures" before the rank that
    aborted first (2) under "Root Cause": the summary names 2, with its own exit code."""
    report = [OutputLine("node1", None, "err", text) for text in _TORCHRUN_REPORT.splitlines()]
    track = _tracked(report)
    assert (track.failed_rank, track.rank_exit_code) == (2, -6)


def test_a_cxx_abort_on_a_ranks_stderr_is_its_first_error() -> None:
    """The line std::terminate prints before SIGABRT names the failure, not torchrun's
    ChildFailedError that follows it."""
    abort = OutputLine("node1", 2, "err", "terminate called without an active exception")
    report = [OutputLine("node1", None, "err", text) for text in _TORCHRUN_REPORT.splitlines()]
    track = _tracked([OutputLine("node1", 2, "out", "rank 2 done"), abort, *report])
    assert track.first_error() == "rank 2: terminate called without an active exception"
    assert (track.failed_rank, track.rank_exit_code) == (2, -6)
    assert is_error_line(OutputLine("n", 0, "err", "terminate called after throwing an instance of 'c10::Error'"))
    assert not is_error_line(OutputLine("n", 0, "err", "asked to terminate cleanly"))


def test_the_summary_as_json_has_every_node_attempt_and_the_slowest() -> None:
    node = NodeOutcome("node1", 1, "failed", 1, 12.34567, "rank 2: boom", 2, ("a", "b"), rank_exit_code=-6)
    attempt = AttemptRecord(1, ("node0", "node1"), "failed", "node1 rank 2 failed first", 12.5, ("node1: ping",),
                            "attempt 2 on node0, node2")
    summary = RunSummary("th-1", 1, "node1 rank 2 failed first", (node,), "logs/th-1", "node1", (attempt,),
                         Slowest("node1", 2.25, "busy share", "the others waited for it"), "slowest node: node1")
    assert json.loads(json.dumps(summary.as_json())) == {
        "run_id": "th-1", "exit_code": 1, "headline": "node1 rank 2 failed first", "culprit": "node1",
        "log_dir": "logs/th-1",
        "nodes": [{"node": "node1", "node_rank": 1, "state": "failed", "exit_code": 1, "seconds": 12.346,
                   "first_error": "rank 2: boom", "failed_rank": 2, "rank_exit_code": -6, "left": 0,
                   "last_lines": ["a", "b"]}],
        "attempts": [{"attempt": 1, "nodes": ["node0", "node1"], "ended": "failed",
                      "headline": "node1 rank 2 failed first", "seconds": 12.5, "triage": ["node1: ping"],
                      "next": "attempt 2 on node0, node2", "start": "cold", "warm": []}],
        "slowest": {"node": "node1", "ratio": 2.25, "signal": "busy share", "detail": "the others waited for it"},
        "straggler": "slowest node: node1", "checkpoint": None}


def test_a_node_the_supervisor_stopped_reads_stopped_whatever_code_the_job_chose() -> None:
    """torchrun turns SIGTERM into exit 1 in parts of its loop: the supervisor's exit record
    says it had signalled the job, and a follower says stopped, not a failure."""
    out = StringIO()
    renderer = LiveRenderer(make_console(out), ["node0", "node1"], max_rank=1)
    status_note(renderer, Status("node1", "exit", {"event": "exit", "code": 1, "stopped": "signal SIGTERM"}))
    status_note(renderer, Status("node0", "exit", {"event": "exit", "code": 0}))
    status_note(renderer, Status("node0", "exit", {"event": "exit", "code": 3}))
    status_note(renderer, Status("node1", "exit", {"event": "exit", "code": 143, "stopped": "x\x1b[2J"}))
    assert out.getvalue() == ("torchherd: node1: stopped (signal SIGTERM; exit code 1)\n"
                              "torchherd: node0: finished (exit 0)\n"
                              "torchherd: node0: exited with code 3\n"
                              "torchherd: node1: stopped (x\\x1b[2J; exit code 143)\n")


def test_c10ds_cannot_name_a_peer_warning_is_one_note_a_run_on_screen() -> None:
    """Once per peer and rank from torch; on screen one torchherd note saying what it means
    (the engine has written every line to the logs before the console sees it)."""
    from torchherd.console.observer import C10D_EXPLAINED, ConsoleObserver
    from torchherd.engine.events import Output

    warning = "[W1127 08:00:01.5 socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved. err=-3"
    out = StringIO()
    observer = ConsoleObserver(make_console(out, width=400))
    observer(Output([OutputLine("node0", None, "err", warning), OutputLine("node0", 0, "out", "step 1")]))
    chunk = RankLines("node1", b"\nE[torchherd-rank 2] " + warning.encode() + b"\nO[torchherd-rank 3] step 1\n")
    observer(Output([chunk, OutputLine("node1", None, "err", warning)]))
    observer(Output([RankLines("node1", b"\nO[torchherd-rank 2] step 2\n")]))
    assert out.getvalue() == (f"torchherd: {C10D_EXPLAINED}\n"
                              "node0:0: step 1\n"
                              "node1:3: step 1\n"
                              "node1:2: step 2\n")


GLOO_PEER_GONE = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
                  "closed by peer [10.131.51.3]:55692. This is typically caused by a remote worker crashing. Check "
                  "the logs of the remote worker before reporting an error. GLHF!")
"""What rank 2 raised on a local-cluster run (torch 2.13, gloo) when rank 1 on another node crashed."""
NCCL_PEER_GONE = ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3356, remote process "
                  "exited or there was a network error, NCCL version 2.21.5")


def _failed(name: str, rank: int, error: str) -> OutputTrack:
    track = OutputTrack(name, rank, Path(f"{name}.log"))
    track.take(OutputLine(name, rank, "err", "Traceback (most recent call last):"))
    track.take(OutputLine(name, rank, "err", error))
    return track


def test_a_peer_gone_error_names_no_cause_of_its_own() -> None:
    assert is_peer_error(OutputLine("n", 2, "err", GLOO_PEER_GONE))
    assert is_peer_error(OutputLine("n", 2, "err", NCCL_PEER_GONE))
    assert is_peer_error(OutputLine("n", 2, "err", "torch.distributed.DistNetworkError: Connection reset by peer"))
    assert not is_peer_error(OutputLine("n", 1, "err", "RuntimeError: resumable: failing on purpose at step 6"))
    assert not is_peer_error(OutputLine("n", 1, "err", "torch.OutOfMemoryError: CUDA out of memory."))


def test_the_node_whose_rank_crashed_is_blamed_not_the_peer_whose_torchrun_reported_first() -> None:
    """Rank 1 on node1 raised; rank 2 on node2 lost its gloo peer and node2's torchrun
    exited 1 ms sooner than node1's: node1 is the cause, whichever came first."""
    node0 = OutputTrack("node0", 0, Path("node0.log"))
    node1 = _failed("node1", 1, "RuntimeError: resumable: failing on purpose at step 6")
    node2 = _failed("node2", 2, GLOO_PEER_GONE)
    assert first_cause(node2, [node0, node1, node2]) is node1
    assert first_cause(node1, [node0, node1, node2]) is node1


def test_a_peer_gone_error_stays_the_cause_when_no_rank_raised_one_of_its_own() -> None:
    """A rank killed without a word (the OOM killer) leaves only its peers' errors: the
    first of them is still named; a lost node and a node without a rank error stay too."""
    node1, node2 = _failed("node1", 1, GLOO_PEER_GONE), _failed("node2", 2, NCCL_PEER_GONE)
    assert first_cause(node2, [node1, node2]) is node2
    silent = OutputTrack("node3", 3, Path("node3.log"))
    own = _failed("node4", 4, "ValueError: bad batch")
    assert first_cause(silent, [silent, own]) is silent
    lost = _failed("node5", 5, GLOO_PEER_GONE)
    lost.lost = "node5 vanished"
    assert first_cause(lost, [lost, own]) is lost
    assert first_cause(None, [own]) is None


def test_of_two_own_errors_the_one_read_first_is_the_cause() -> None:
    peer = _failed("node0", 0, GLOO_PEER_GONE)
    first = _failed("node1", 1, "ValueError: first")
    second = _failed("node2", 2, "ValueError: second")
    assert first.rank_error_at is not None and second.rank_error_at is not None
    first.rank_error_at, second.rank_error_at = 2.0, 1.0
    assert first_cause(peer, [peer, first, second]) is second
