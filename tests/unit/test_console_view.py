"""The terminal's view of a run: collapsed duplicates, the rank filter, torchrun's banner
once, the live panel; rendered to recording consoles and compared as exact text."""

from __future__ import annotations

from io import StringIO

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from torchherd.console import make_console
from torchherd.console.collapse import Collapser, RankFilter, parse_ranks
from torchherd.console.observer import ConsoleObserver
from torchherd.console.panel import PanelModel, render_panel
from torchherd.console.run import LiveRenderer
from torchherd.console.view import TerminalView, ViewOptions
from torchherd.engine.events import NodeExited, NodeStarted, NodeStatus, Output, RanksRunning, RunStarted
from torchherd.errors import UsageError
from torchherd.inventory.nodeset import expand, fold_names, fold_numbers
from torchherd.remote import wire
from torchherd.runlog import GpuUsage, OutputLine, OutputParser, RankLines, Status, gpu_usage, parse_status, progress_of

BANNER = ["*****************************************",
          "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system "
          "being overloaded, please further tune the variable for optimal performance in your application as needed. ",
          "*****************************************"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def chunk(node: str, *lines: tuple[int, str]) -> RankLines:
    """A chunk of rank lines as the engine hands it over (the bytes path)."""
    (block,) = OutputParser(node).feed(b"".join(b"O[torchherd-rank %d] %s\n" % (rank, text.encode())
                                                for rank, text in lines))
    assert isinstance(block, RankLines)
    return block


def collapser(nodes: list[str], world: int | None, clock: Clock) -> tuple[Collapser, StringIO]:
    out = StringIO()
    return Collapser(LiveRenderer(make_console(out, terminal=True), nodes, (world or 4) - 1), nodes, world, clock=clock), out


@pytest.mark.parametrize("names,folded", [
    # as ClusterShell's `nodeset -f` writes them (its tests/NodeSetTest.py: padding kept per range)
    (["node0", "node1"], "node[0-1]"),
    (["gpu01", "gpu02", "gpu03", "gpu07", "cpu1"], "gpu[01-03,07],cpu1"),
    (["n8", "n9", "n10"], "n[8-10]"),
    (["n08", "n09", "n10"], "n[08-10]"),
    (["login", "n1", "login"], "n1,login"),
    (["rack1-n3", "rack1-n4"], "rack1-n[3-4]"),
    (["n1", "n01"], "n1,n01"),
])
def test_fold_names_writes_the_nodeset_of_names(names: list[str], folded: str) -> None:
    assert fold_names(names) == folded


@given(st.lists(st.tuples(st.sampled_from(["gpu", "n", "rack1-n", "login"]), st.integers(0, 120),
                          st.sampled_from([0, 2, 3])), max_size=40))
def test_fold_names_expands_back_to_the_same_names(parts: list[tuple[str, int, int]]) -> None:
    names = [prefix if prefix == "login" else f"{prefix}{str(number).zfill(width)}" for prefix, number, width in parts]
    assert sorted(expand(fold_names(names))) == sorted(set(names)) if names else fold_names(names) == ""


def test_nodesets_and_rank_lists_fold() -> None:
    assert fold_names(["node0", "node1", "node2", "node3"]) == "node[0-3]"
    assert fold_names(["node0", "node2", "node3", "login"]) == "node[0,2-3],login"
    assert fold_names(["gpu01", "gpu02", "gpu10"]) == "gpu[01-02,10]"
    assert fold_names(["a1b", "a2b", "node5"]) == "a[1-2]b,node5"
    assert fold_numbers([8, 0, 1, 2, 3, 9, 12]) == "0-3,8-9,12"
    assert parse_ranks("0,8-11") == frozenset({0, 8, 9, 10, 11})
    for bad in ("", "x", "3-1", "1,,2", "-2"):
        with pytest.raises(UsageError):
            parse_ranks(bad)


def test_the_same_line_from_every_rank_is_shown_once_with_who_said_it() -> None:
    clock = Clock()
    view, out = collapser(["node0", "node1"], 4, clock)
    view.add([chunk("node0", (0, "warning: x is deprecated"), (1, "warning: x is deprecated"), (0, "loss 0.5"))])
    view.add([chunk("node1", (2, "warning: x is deprecated"), (3, "warning: x is deprecated"), (2, "loss 0.7"))])
    # every rank said it: shown at once, without waiting for the window
    assert view.take() == "node[0-1]:* │ warning: x is deprecated (x4)\n"
    clock.now = 0.6
    assert view.take() == "node0:0 │ loss 0.5\nnode1:2 │ loss 0.7\n"
    assert out.getvalue() == ""  # the collapser gives text; the caller writes it


def test_piped_collapsed_lines_keep_the_colon_form() -> None:
    """``run --collapse | grep``: the nodeset and the ranks, then ``: `` as every piped line."""
    clock = Clock()
    out = StringIO()
    view = Collapser(LiveRenderer(make_console(out), ["node0", "node1"], 3), ["node0", "node1"], 4, clock=clock)
    view.add([chunk("node0", (0, "warning: x"), (1, "warning: x"), (0, "loss 0.5"))])
    view.add([chunk("node1", (2, "warning: x"), (3, "warning: x"))])
    clock.now = 0.6
    view.note("torchherd: node1: finished (exit 0)\n")
    assert view.take() == ("node[0-1]:*: warning: x (x4)\n"
                           "node0:0: loss 0.5\n"
                           "torchherd: node1: finished (exit 0)\n")


def test_a_line_that_differs_on_one_node_stays_visible() -> None:
    clock = Clock()
    view, _ = collapser(["node0", "node1", "node2"], 3, clock)
    view.add([OutputLine("node0", 0, "out", "cuda: ok"), OutputLine("node1", 1, "out", "cuda: ok"),
              OutputLine("node2", 2, "err", "cuda: driver too old")])
    clock.now = 0.5
    assert view.take() == "node[0-1]:[0-1] │ cuda: ok (x2)\nnode2:2 │ cuda: driver too old\n"
    view.add([OutputLine(f"node{index}", index, "out", "ready") for index in range(3)])
    assert view.take() == "node[0-2]:* │ ready (x3)\n"


def test_each_rank_keeps_its_order() -> None:
    """Rank 1 said B before A: its A cannot join rank 0's earlier A group."""
    clock = Clock()
    view, _ = collapser(["node0"], 8, clock)
    view.add([OutputLine("node0", 0, "out", "A"), OutputLine("node0", 0, "out", "B"),
              OutputLine("node0", 1, "out", "B"), OutputLine("node0", 1, "out", "A")])
    clock.now = 1.0
    assert view.take() == "node0:0 │ A\nnode0:[0-1] │ B (x2)\nnode0:1 │ A\n"


def test_a_rank_repeating_itself_is_not_collapsed_and_the_window_ends_a_group() -> None:
    clock = Clock()
    view, _ = collapser(["node0"], 2, clock)
    view.add([OutputLine("node0", 0, "out", ""), OutputLine("node0", 0, "out", "")])
    clock.now = 0.6
    view.add([OutputLine("node0", 1, "out", "")])
    assert view.take() == "node0:0 │ \nnode0:0 │ \n"
    clock.now = 1.2
    assert view.take() == "node0:1 │ \n"


def test_a_held_chunk_is_taken_apart_when_another_node_repeats_one_of_its_lines() -> None:
    clock = Clock()
    view, _ = collapser(["node0", "node1"], 4, clock)
    view.add([chunk("node0", (0, "step 1"), (1, "epoch 1 done"), (0, "step 2"))])
    clock.now = 0.2
    view.add([chunk("node1", (2, "epoch 1 done"), (3, "step 9"))])
    clock.now = 0.5
    assert view.take() == "node0:0 │ step 1\nnode[0-1]:[1-2] │ epoch 1 done (x2)\nnode0:0 │ step 2\n"
    clock.now = 0.8
    assert view.take() == "node1:3 │ step 9\n"


def test_torchruns_banner_is_shown_once_and_notes_keep_their_place() -> None:
    clock = Clock()
    view, _ = collapser(["node0", "node1"], 4, clock)
    for node in ("node0", "node1"):
        view.add([OutputLine(node, None, "err", text) for text in BANNER])
    view.add([OutputLine("node1", 3, "err", "RuntimeError: boom")])
    view.note("torchherd │ node1: exited with code 1\n")
    assert view.take() == ""
    clock.now = 0.5
    assert view.take() == "".join(f"node0   │ {text}\n" for text in BANNER) + (
        "node1:3 │ RuntimeError: boom\ntorchherd │ node1: exited with code 1\n")


def test_torchs_timestamped_warnings_collapse_and_torchruns_blank_line_goes_with_its_banner() -> None:
    clock = Clock()
    view, _ = collapser(["node0", "node1"], 4, clock)
    warning = "socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved. err=-3"
    view.add([OutputLine("node0", None, "err", ""), OutputLine("node1", None, "err", ""),
              chunk("node0", (0, f"[W1123 12:18:13.870269108 {warning}"), (1, f"[W1123 12:18:13.961 {warning}")),
              chunk("node1", (2, f"[W1123 12:18:14.0001 {warning}"), (3, f"[W1123 12:18:15.1 {warning}"))])
    clock.now = 0.5
    assert view.take() == f"node0   │ \nnode[0-1]:* │ [W1123 12:18:13.870269108 {warning} (x4)\n"


def test_a_line_that_quotes_a_rank_prefix_is_only_text() -> None:
    clock = Clock()
    view, _ = collapser(["node0"], 2, clock)
    view.add([chunk("node0", (0, "[torchherd-rank 7] quoted"), (1, "plain"))])
    clock.now = 0.5
    assert view.take() == "node0:0 │ [torchherd-rank 7] quoted\nnode0:1 │ plain\n"


def test_torchruns_own_lines_collapse_across_nodes() -> None:
    clock = Clock()
    view, _ = collapser(["node0", "node1", "node2"], 6, clock)
    view.add([OutputLine(f"node{index}", None, "err", "W rendezvous slow") for index in range(3)])
    assert view.take() == "node[0-2] │ W rendezvous slow (x3)\n"


def test_the_rank_filter_keeps_the_named_ranks_and_torchruns_lines() -> None:
    keep = RankFilter(parse_ranks("0,2"))
    lines = keep([chunk("node0", (0, "a"), (1, "b"), (2, "c")), chunk("node1", (3, "d")),
                  OutputLine("node1", None, "err", "torchrun says"), OutputLine("node1", 3, "out", "e")])
    assert [(line.node, [(each.rank, each.text) for each in line.lines()]) if isinstance(line, RankLines)
            else line for line in lines] == [("node0", [(0, "a"), (2, "c")]),
                                             OutputLine("node1", None, "err", "torchrun says")]


def test_status_records_for_the_view_keep_a_chunk_on_the_bytes_path() -> None:
    parser = OutputParser("node0")
    data = (b"O[torchherd-rank 0] a\n" + wire.progress_record(0, " 10%|#") + b"O[torchherd-rank 1] b\n"
            + wire.gpu_record([(0, 50.0, 100.0, 200.0)]))
    block, bar, gpu = parser.feed(data)
    assert isinstance(block, RankLines) and [line.text for line in block.lines()] == ["a", "b"]
    assert isinstance(bar, Status) and progress_of(bar) == (0, " 10%|#")
    assert isinstance(gpu, Status) and gpu_usage(gpu) == (GpuUsage(0, 50.0, 100.0, 200.0),)
    assert gpu_usage(parse_status("n", b'{"event":"gpu","gpus":[["x"]]}')) == ()
    assert progress_of(gpu) is None


def panel_model() -> PanelModel:
    model = PanelModel(["node0", "node1", "node2"])
    model.state("node0", "running")
    model.state("node1", "running")
    model.lines([chunk("node0", (0, "step 1"), (1, "step 1"))], 1.0)
    model.lines([OutputLine("node1", 2, "out", "step 1 loss 0.5")], 1.0)
    model.bar("node1", 3, " 45%|####5     | 45/100 [00:04<00:05,  9.80it/s]", 2.0)
    model.lines([chunk("node0", *[(0, "step 2")] * 10)], 3.0)
    model.gpus("node0", (GpuUsage(0, 87, 12000, 81920), GpuUsage(1, 91, 13000, 81920)))
    model.state("node2", "exited", 1)
    return model


def test_the_panel_shows_every_node() -> None:
    out = StringIO()
    make_console(out, width=100).print(render_panel(panel_model(), 4.0))
    assert out.getvalue() == (
        "node    state      ranks   lines/s   quiet   gpu             last line                              \n"
        "────────────────────────────────────────────────────────────────────────────────────────────────────\n"
        "node0   running        2         4      1s   89% 24.4/160G   step 2                                 \n"
        "node1   running        1       0.3      2s                   [3]  45%|####5     | 45/100 [00:04<00:…\n"
        "node2   exited 1       0         0       -                                                          \n")


def test_a_bar_gives_way_once_its_rank_ends_its_line() -> None:
    model = panel_model()
    (block,) = OutputParser("node1").feed(b"E[torchherd-rank 3]  100%|##########| 100/100\n")
    model.lines([block], 4.0)
    assert model.nodes["node1"].shown_line(4.0) == " 100%|##########| 100/100"
    model.bar("node1", 3, " 10%|#", 5.0)
    model.lines([OutputLine("node1", 2, "err", "a warning of another rank")], 5.0)
    assert model.nodes["node1"].shown_line(5.0) == "[3]  10%|#"


def test_nodes_that_do_not_fit_are_grouped_by_state_and_a_quiet_node_stands_out() -> None:
    model = PanelModel([f"node{index}" for index in range(6)])
    for index in range(6):
        model.state(f"node{index}", "running")
        model.lines([OutputLine(f"node{index}", index, "out", "tick")], 0.0)
    for index in (0, 1, 2, 4, 5):
        model.lines([OutputLine(f"node{index}", index, "out", "tock")], 40.0)
    out = StringIO()
    make_console(out, width=80).print(render_panel(model, 41.0, limit=3))
    assert out.getvalue() == (
        "node                state     ranks   lines/s   quiet   last line\n"
        "─────────────────────────────────────────────────────────────────\n"
        "node[0-2,4-5] (5)   running       5         2      1s   tock     \n"
        "node3               quiet         1         0     41s   tick     \n")


def terminal(width: int = 80) -> tuple[Console, StringIO]:
    out = StringIO()
    return Console(file=out, width=width, height=40, force_terminal=True, color_system="standard",
                   highlight=False, soft_wrap=False), out


def test_on_a_terminal_lines_scroll_above_the_panel_in_one_write_each() -> None:
    console, out = terminal()
    clock = Clock()
    view = TerminalView(console, ["node0", "node1"], 3, ViewOptions(panel=True), clock=clock)
    view.render([OutputLine("node0", 0, "out", "hello")])
    first = out.getvalue()
    assert "hello" in first and "node0" in first and "\x1b[2K" not in first  # no panel yet to clear
    clock.now = 0.1
    out.truncate(0)
    out.seek(0)
    view.render([OutputLine("node1", 2, "out", "world")])
    again = out.getvalue()
    # back over the 4 lines of the panel, the new line, the panel as drawn before
    assert again.startswith("\r\x1b[2K" + "\x1b[1A\x1b[2K" * 3) and "world" in again
    assert again.endswith(first[first.index("\x1b[1m"):]) or again.count("node") >= 3
    view.close()
    assert out.getvalue().endswith("\x1b[?25h")


def test_no_color_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    console, out = terminal()
    view = TerminalView(console, ["node0"], 1, ViewOptions(panel=True))
    view.render([OutputLine("node0", 0, "err", "RuntimeError: boom")])
    view.close()
    assert "RuntimeError: boom" in out.getvalue()
    assert "\x1b[3" not in out.getvalue()  # no foreground colour; cursor and bold codes remain


def test_a_run_shows_bars_and_gpus_in_the_panel_and_only_lines_scroll() -> None:
    console, out = terminal(width=100)
    clock = Clock()
    view = TerminalView(console, ["node0", "node1"], 3, ViewOptions(panel=True, collapse=True), clock=clock)
    view.start()
    for event in (NodeStarted("node0", 42), RanksRunning("node0"),
                  NodeStatus(Status("node0", "progress", {"event": "progress", "rank": 0, "text": " 50%|#####"})),
                  NodeStatus(Status("node0", "gpu", {"event": "gpu", "gpus": [[0, 75, 2048, 8192]]}))):
        view.observe(event)
    view.render([OutputLine("node0", 0, "out", "done")])
    clock.now = 1.0
    view.observe(NodeExited("node0", 0))
    view.note("node0: finished (exit 0)", "green")
    view.close()
    text = out.getvalue()
    assert "[0]  50%|#####" in text and "75% 2.0/8G" in text and "finished" in text
    assert text.count("node0:0") == 1 and "torchherd │ node0: finished (exit 0)" in text
    assert text.endswith("\x1b[?25h")


def test_the_observer_builds_the_view_and_closes_it_before_the_summary() -> None:
    console, out = terminal(width=100)
    observer = ConsoleObserver(console, view=ViewOptions(panel=True, collapse=True))
    observer(RunStarted("r1", ("node0", "node1"), "node0", "10.0.0.1", 29500, "logs", 3))
    assert isinstance(observer.renderer, TerminalView)
    observer(Output([OutputLine("node0", 0, "out", "done")]))
    observer.close()
    assert observer.renderer.closed and "done" in out.getvalue()


def test_plain_output_stays_every_line() -> None:
    console = make_console(StringIO())
    assert ViewOptions.choose(console).plain
    assert ViewOptions.choose(console, collapse=True) == ViewOptions(panel=False, collapse=True)
    observer = ConsoleObserver(console, view=ViewOptions.choose(console))
    observer(RunStarted("r1", ("node0",), "node0", "10.0.0.1", 29500, "logs", 1))
    assert type(observer.renderer) is LiveRenderer
