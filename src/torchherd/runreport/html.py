"""A run's story as one self-contained HTML file (``report RUN``): three interactive
figures (plotly: zoom, hover for the exact values) and the tables, opened offline in any
browser. plotly is an optional extra (``pip install torchherd[report]``), imported here
only, when a report is written: never by ``run``.

The figures' JSON is in the page as written (``<script type="application/json"
data-figure=...>``); plotly.js (4.8 MB) is in it gzipped and base64-encoded (1.9 MB),
unpacked by the browser's own ``DecompressionStream``. Each series is cut into at most
``MAX_BINS`` stretches of the run, each heatmap into ``MAX_COLUMNS``, so a report of 64
nodes of 8 GPUs over 2 hours stays a few MB.
"""

from __future__ import annotations

import base64
import functools
import gzip
import html
import json
import math
import statistics
from datetime import datetime, timezone
from typing import Any, Callable, Sequence

from torchherd.checks.results import CLUSTER
from torchherd.errors import UsageError
from torchherd.runlog import THROTTLE_REASONS
from torchherd.runreport.story import Point, Story
from torchherd.runreport.text import clock, duration, story_lines

MAX_BINS = 300
"""Stretches a node's progress and busy share are averaged over, at most."""
MAX_COLUMNS = 200
"""Columns of a GPU heatmap, at most."""
MIN_BIN = 2.0
"""Seconds: no stretch is shorter (the samples' own spacing)."""
STATES = ("starting", "running", "silent", "lost", "failed", "torn down", "finished", "not started")
STATE_COLOURS = {"starting": "#9ecae1", "running": "#31a354", "silent": "#fdae6b", "lost": "#e6550d",
                 "failed": "#de2d26", "torn down": "#969696", "finished": "#74c476", "not started": "#bdbdbd"}
MARKS = {"triage": ("diamond", "#756bb1"), "excluded": ("x", "#de2d26"), "spare": ("star", "#3182bd"),
         "checkpoint": ("square", "#636363"), "staged": ("triangle-up", "#636363"),
         "replica": ("circle-open", "#636363"), "hang": ("hourglass", "#e6550d"),
         "straggler": ("triangle-down", "#d62728")}  # STRAGGLER
STRAGGLER = "#d62728"
NODE_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
"""A node's colour in both of its rows (plotly's own, less the straggler's red)."""
THROTTLE_ORDER = (0x4, 0x8, 0x20, 0x40, 0x80)
"""The slowing reasons, mildest first: a heatmap cell shows the worst present."""
NO_PLOTLY = "report: the HTML report needs plotly, not installed here: pip install 'torchherd[report]'"
NO_PLOTLY_HINT = "report RUN --text tells the same story in a few lines without it"


def plotly_modules() -> tuple[Any, Any]:
    """plotly's graph objects and subplots; UsageError naming the extra where it is missing."""
    try:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots
    except ImportError:
        raise UsageError(NO_PLOTLY, NO_PLOTLY_HINT) from None
    return go, make_subplots


def iso(at: float) -> str:
    return datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


# the figures -----------------------------------------------------------------------------


def timeline_figure(story: Story) -> dict[str, Any]:
    """One row per node: its states as bars, the marks as symbols, the attempts and the
    recoveries as bands behind them."""
    go, _ = plotly_modules()
    figure = go.Figure()
    for state in STATES:
        segments = [segment for segment in story.segments if segment.state == state]
        if not segments:
            continue
        figure.add_trace(go.Bar(
            name=state, orientation="h", y=[segment.node for segment in segments],
            base=[iso(segment.start) for segment in segments],
            x=[round((segment.end - segment.start) * 1000) for segment in segments],
            marker_color=STATE_COLOURS[state], legendgroup="states",
            hovertext=[f"{segment.node}: {state} {clock(segment.start)} to {clock(segment.end)} UTC "
                       f"({duration(segment.end - segment.start)})" for segment in segments],
            hoverinfo="text"))
    for kind, (symbol, colour) in MARKS.items():
        marks = [mark for mark in story.marks if mark.kind == kind]
        if not marks:
            continue
        figure.add_trace(go.Scatter(
            name=kind, mode="markers", x=[iso(mark.at) for mark in marks], y=[mark.node for mark in marks],
            marker={"symbol": symbol, "size": 12, "color": colour, "line": {"width": 1, "color": "#000"}},
            hovertext=[f"{mark.node} {clock(mark.at)} UTC: {mark.text}" for mark in marks], hoverinfo="text"))
    shapes, notes = [], []
    for attempt in story.attempts:
        shapes.append({"type": "rect", "xref": "x", "yref": "paper", "x0": iso(attempt.start), "x1": iso(attempt.end),
                       "y0": 0, "y1": 1, "layer": "below", "line": {"width": 0},
                       "fillcolor": "rgba(49,130,189,0.08)" if attempt.number % 2 else "rgba(49,163,84,0.08)",
                       "name": f"attempt {attempt.number}"})
        notes.append({"xref": "x", "yref": "paper", "x": iso(attempt.start), "y": 1.0, "xanchor": "left",
                      "yanchor": "bottom", "showarrow": False, "text": f"attempt {attempt.number}"})
    for recovery in story.recoveries:
        shapes.append({"type": "rect", "xref": "x", "yref": "paper", "x0": iso(recovery.start),
                       "x1": iso(recovery.end), "y0": 0, "y1": 1, "layer": "below", "line": {"width": 0},
                       "fillcolor": "rgba(222,45,38,0.10)", "name": f"recovery after attempt {recovery.after}"})
    figure.update_layout(
        barmode="overlay", shapes=shapes, annotations=notes, height=max(260, 60 + 28 * len(story.nodes)),
        margin={"l": 10, "r": 10, "t": 40, "b": 40}, legend={"orientation": "h", "y": -0.15},
        xaxis={"type": "date", "title": _day(story), "tickformat": "%H:%M:%S"},
        yaxis={"categoryorder": "array", "categoryarray": story.nodes, "autorange": "reversed"})
    return _plain(figure)


def progress_figure(story: Story) -> dict[str, Any] | None:
    """Each node's progress rate and CPU busy share over the run; the straggler stands out."""
    if not story.progress and not story.busy:
        return None
    go, make_subplots = plotly_modules()
    label = {"tqdm rate": "progress (tqdm iterations/s)", "lines per second": "progress (lines/s)"}
    figure = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                           subplot_titles=(label.get(story.progress_signal, "progress"), "CPU busy share"))
    start, width, count = _bins(story, MAX_BINS, [[point.at for point in points]
                                                  for series in (story.progress, story.busy) for points in series.values()])
    for row, series, digits in ((1, story.progress, 3), (2, story.busy, 2)):
        for node in _ordered(story, series):
            slow = node == story.straggler
            values = _binned(series[node], start, width, count, statistics.fmean)
            figure.add_trace(go.Scatter(
                name=f"{node} (straggler)" if slow else node, legendgroup=node, showlegend=row == 1,
                x0=iso(start + width / 2), dx=width * 1000, y=[_rounded(value, digits) for value in values],
                mode="lines+markers", connectgaps=False, marker={"size": 3},  # a lone sample shows too
                line={"width": 3, "color": STRAGGLER} if slow else
                {"width": 1, "color": NODE_COLOURS[_rank(story, node) % len(NODE_COLOURS)]}), row=row, col=1)
    figure.update_xaxes(type="date", tickformat="%H:%M:%S")
    figure.update_xaxes(title=_day(story), row=2, col=1)
    figure.update_yaxes(rangemode="tozero")
    figure.update_yaxes(range=[0, 1.05], row=2, col=1)
    figure.update_layout(height=560, margin={"l": 10, "r": 10, "t": 40, "b": 40})
    return _plain(figure)


def gpu_figure(story: Story) -> dict[str, Any] | None:
    """Per GPU (node:index) over time: utilisation, SM clock as a share of its maximum,
    power, and the worst clock throttle reason, as heatmaps."""
    if not story.gpus:
        return None
    go, make_subplots = plotly_modules()
    keys = sorted(story.gpus, key=lambda key: (_rank(story, key[0]), key[1]))
    rows = [f"{node}:{gpu}" for node, gpu in keys]
    start, width, count = _bins(story, MAX_COLUMNS, [[point.at for point in points] for points in story.gpus.values()])
    panels: list[tuple[str, Callable[[Any], float | None], str, dict[str, Any]]] = [
        ("GPU utilisation (%)", lambda usage: usage.utilisation, "Viridis", {"zmin": 0, "zmax": 100}),
        ("SM clock (% of its maximum)",
         lambda usage: None if not usage.max_clock or usage.clock is None else 100 * usage.clock / usage.max_clock,
         "Cividis", {"zmin": 0, "zmax": 100}),
        ("power (W)", lambda usage: usage.power, "Inferno", {}),
        ("clock throttle reason (the worst)", _throttle, "Reds", {"zmin": 0, "zmax": len(THROTTLE_ORDER)}),
    ]
    figure = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.04,
                           subplot_titles=[title for title, _, _, _ in panels])
    matrices: list[list[list[float | int | None]]] = [[] for _ in panels]
    for key in keys:
        points = story.gpus[key]
        columns = [min(count - 1, max(0, int((point.at - start) / width))) for point in points]
        for matrix, (_title, value_of, _scale, _limits) in zip(matrices, panels):
            worst = value_of is _throttle  # a throttle reason holds its column: the worst, not the mean
            matrix.append(_columns(columns, [value_of(point.usage) for point in points], count, worst))
    for index, (title, value_of, scale, limits) in enumerate(panels, start=1):
        bar = {"len": 1 / len(panels) * 0.9, "y": 1 - (index - 0.5) / len(panels), "title": {"text": ""}}
        if value_of is _throttle:
            bar.update(tickvals=list(range(len(THROTTLE_ORDER) + 1)),
                       ticktext=["none"] + [THROTTLE_REASONS[bit] for bit in THROTTLE_ORDER])
        # z: a placeholder plotly checks; the matrix goes in as plain numbers below (checking
        # 100,000s of cells would cost the report most of its time)
        figure.add_trace(go.Heatmap(name=title, z=[[0]], y=rows, x0=iso(start + width / 2), dx=width * 1000,
                                    colorscale=scale, colorbar=bar, hoverongaps=False, **limits), row=index, col=1)
    figure.update_xaxes(type="date", tickformat="%H:%M:%S")
    figure.update_xaxes(title=_day(story), row=len(panels), col=1)
    figure.update_yaxes(autorange="reversed", type="category")
    height = max(140, min(900, 14 * len(rows)))
    figure.update_layout(height=len(panels) * height + 80, margin={"l": 10, "r": 10, "t": 40, "b": 40})
    found = _plain(figure)
    for trace, matrix in zip(found["data"], matrices):
        trace["z"] = matrix
    return found


def _columns(columns: Sequence[int], values: Sequence[float | None], count: int,
             worst: bool) -> list[float | int | None]:
    """Per column, the mean (or the largest) of the values that fall in it, rounded; None: none."""
    sums = [0.0] * count
    counts = [0] * count
    for column, value in zip(columns, values):
        if value is None:
            continue
        if worst:
            sums[column] = max(sums[column], value)
        else:
            sums[column] += value
        counts[column] += 1
    return [None if not found else round(total if worst else total / found) for total, found in zip(sums, counts)]


def _day(story: Story) -> str:
    """The x axis's title: the times are UTC, of this day (the ticks say only the time)."""
    first, last = (datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%d") for at in (story.start, story.end))
    return f"UTC, {first}" if first == last else f"UTC, {first} to {last}"


def _throttle(usage: Any) -> float:
    reasons = int(usage.reasons)
    worst = 0
    for level, bit in enumerate(THROTTLE_ORDER, start=1):
        if reasons & bit:
            worst = level
    return float(worst)


def _plain(figure: Any) -> dict[str, Any]:
    """The figure as the page holds it: plotly's JSON, without its default template (the
    page's 100 kB the same for every figure)."""
    figure.update_layout(template="none", font={"family": "sans-serif", "size": 12})
    figure.update_xaxes(automargin=True)
    figure.update_yaxes(automargin=True)  # the node names whole, however long
    found: dict[str, Any] = json.loads(figure.to_json())
    return found


def _rank(story: Story, node: str) -> int:
    return story.nodes.index(node) if node in story.nodes else len(story.nodes)


def _ordered(story: Story, series: dict[str, list[Point]]) -> list[str]:
    return sorted(series, key=lambda node: (_rank(story, node), node))


def _spacing(streams: Sequence[Sequence[float]]) -> float:
    """The samples' own spacing: the median time between two of one stream."""
    gaps = [later - earlier for times in streams for earlier, later in zip(times, times[1:]) if later > earlier]
    return statistics.median(gaps) if gaps else MIN_BIN


def _bins(story: Story, most: int, streams: Sequence[Sequence[float]]) -> tuple[float, float, int]:
    """(first bin's start, its width in seconds, how many) over the samples' span: no
    narrower than their spacing (no empty bins between two samples), at most ``most``."""
    times = [at for stream in streams for at in stream]
    start = min(times) if times else story.start
    end = max(times) if times else story.end
    span = max(end - start, MIN_BIN)
    width = max(MIN_BIN, _spacing(streams), span / most)
    return start, width, max(1, math.ceil(span / width + 1e-9) if end > start else 1)


def _binned(points: Sequence[Point], start: float, width: float, count: int,
            reduce: Callable[[Sequence[float]], float]) -> list[float | None]:
    bins: list[list[float]] = [[] for _ in range(count)]
    for point in points:
        bins[min(count - 1, max(0, int((point.at - start) / width)))].append(point.value)
    return [reduce(values) if values else None for values in bins]


def _rounded(value: float | None, digits: int) -> float | int | None:
    if value is None:
        return None
    if digits == 0:
        return round(value)
    if digits == 3:  # three significant digits: rates from 0.01 to 100,000
        return float(f"{value:.3g}")
    return round(value, digits)


# the page ----------------------------------------------------------------------------------

_STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
pre.story { background: #f6f6f6; padding: 0.8em; white-space: pre-wrap; }
table { border-collapse: collapse; font-size: 0.9em; }
td, th { border: 1px solid #ccc; padding: 0.2em 0.5em; text-align: left; vertical-align: top; }
td.pass { background: #e5f5e0; } td.warn { background: #fff3cd; } td.fail { background: #fdd0cf; }
td.skip { background: #eee; } .figure { width: 100%; } .note { color: #777; }
@media print { .figure { page-break-inside: avoid; } body { margin: 0; } }
"""

_LOADER = """
(async () => {
  const packed = document.getElementById('plotly-js');
  const figures = document.querySelectorAll('script[data-figure]');
  try {
    const bytes = Uint8Array.from(atob(packed.textContent), c => c.charCodeAt(0));
    const code = await new Response(new Blob([bytes]).stream().pipeThrough(new DecompressionStream('gzip'))).text();
    const tag = document.createElement('script');
    tag.textContent = code;
    document.head.appendChild(tag);
    for (const holder of figures) {
      const figure = JSON.parse(holder.textContent);
      await Plotly.newPlot(document.getElementById(holder.dataset.figure), figure.data, figure.layout,
                           {responsive: true, displaylogo: false});
    }
    document.body.dataset.plotted = String(figures.length);
    document.body.dataset.drawnMs = String(Math.round(performance.now()));  // from the page's start
  } catch (error) {
    for (const holder of figures) {
      document.getElementById(holder.dataset.figure).textContent =
        'this browser could not draw the figure (' + error + '); the tables below hold the figures';
    }
  }
})();
"""


@functools.cache
def packed_plotly() -> str:
    """plotly.js, gzipped and base64-encoded, as the page carries it (once a process)."""
    from plotly.offline import get_plotlyjs

    return base64.b64encode(gzip.compress(get_plotlyjs().encode("utf-8"), 6, mtime=0)).decode("ascii")


def page(story: Story) -> str:
    """The whole report as one HTML document."""
    figures = [("timeline", "Timeline: each node's states, the attempts, the marks", timeline_figure(story)),
               ("progress", "Progress and CPU busy share per node", progress_figure(story)),
               ("gpus", "GPUs: node:index over time", gpu_figure(story))]
    parts = [f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
             f"<title>torchherd report: {_e(story.run_id)}</title><style>{_STYLE}</style></head><body>",
             f"<h1>torchherd run {_e(story.run_id)}</h1>"]
    if story.summary is not None:
        parts.append(f"<p class=\"headline\"><b>{_e(story.summary.headline)}</b> (exit {story.summary.exit_code})</p>")
    parts.append(f"<pre class=\"story\">{_e(chr(10).join(story_lines(story)))}</pre>")
    for name, title, figure in figures:
        parts.append(f"<h2>{_e(title)}</h2>")
        if figure is None:
            parts.append("<p class=\"note\">no samples of this kind in the run's history</p>")
            continue
        data = json.dumps(figure, separators=(",", ":")).replace("</", "<\\/")
        parts.append(f"<div class=\"figure\" id=\"figure-{name}\"></div>"
                     f"<script type=\"application/json\" data-figure=\"figure-{name}\">{data}</script>")
    parts += _tables(story)
    parts.append(f"<script id=\"plotly-js\" type=\"application/octet-stream\">{packed_plotly()}</script>"
                 f"<script>{_LOADER}</script></body></html>\n")
    return "\n".join(parts)


def _tables(story: Story) -> list[str]:
    parts = []
    if story.attempts:
        parts.append("<h2>Attempts</h2>" + _table(
            ("attempt", "nodes", "started (UTC)", "lasted", "ended"),
            [(str(attempt.number), ", ".join(attempt.nodes), clock(attempt.start),
              duration(attempt.end - attempt.start), attempt.outcome) for attempt in story.attempts]))
    if story.summary is not None:
        parts.append("<h2>Summary</h2>" + _table(
            ("node", "rank", "state", "exit", "seconds", "first error"),
            [(node.node, str(node.node_rank), node.state, "" if node.exit_code is None else str(node.exit_code),
              "" if node.seconds is None else f"{node.seconds:.1f}", node.first_error or "")
             for node in story.summary.nodes]))
        if story.summary.checkpoint:
            parts.append(f"<h2>Checkpoint</h2><p>{_e(story.summary.checkpoint)}</p>")
    if story.preflight is not None:
        parts.append("<h2>Preflight</h2>" + _grid(story))
    if story.stacks:
        parts.append("<h2>The hang's stacks</h2>" + _table(
            ("node", "rank", "in", "at"),
            [(stack.node, str(stack.rank), stack.function, stack.where) for stack in story.stacks]))
    return parts


def _grid(story: Story) -> str:
    """Node x check, each cell its status (its summary on hover and in print below)."""
    assert story.preflight is not None
    results = story.preflight.results
    checks = list(dict.fromkeys(result.check for result in results))
    nodes = list(dict.fromkeys(result.node for result in results if result.node != CLUSTER))
    nodes += [CLUSTER] if any(result.node == CLUSTER for result in results) else []
    cells = {(result.node, result.check): result for result in results}
    rows = ["<table class=\"preflight\"><tr><th>node</th>" + "".join(f"<th>{_e(check)}</th>" for check in checks) + "</tr>"]
    for node in nodes:
        row = [f"<tr><th>{_e(node)}</th>"]
        for check in checks:
            found = cells.get((node, check))
            row.append("<td></td>" if found is None else
                       f"<td class=\"{found.status}\" title=\"{_e(found.summary)}\">{found.status}</td>")
        rows.append("".join(row) + "</tr>")
    failing = [result for result in results if result.status in ("fail", "warn")]
    notes = "".join(f"<li>{_e(result.node)} {_e(result.check)}: {result.status}, {_e(result.summary)}</li>"
                    for result in failing)
    return "".join(rows) + "</table>" + (f"<ul>{notes}</ul>" if notes else "")


def _table(heads: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{_e(text)}</th>" for text in heads)
    body = "".join("<tr>" + "".join(f"<td>{_e(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _e(text: str) -> str:
    return html.escape(text, quote=True)
