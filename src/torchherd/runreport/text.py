"""A run's story in a few lines (``report RUN --text``): the attempts, the recoveries and
how long each took, the straggler, the hang, each node's GPU use as a sparkline. Times
are UTC, as the history holds them."""

from __future__ import annotations

import time

from torchherd.engine.watch.hang import described
from torchherd.engine.watch.straggler import GPU_BUSY
from torchherd.runlog import THROTTLE_REASONS
from torchherd.runreport.story import GpuPoint, Story
from torchherd.words import count

SPARK = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 40
"""Characters of a sparkline at most: the run's span cut into as many equal stretches."""


def clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(at))


def duration(seconds: float) -> str:
    """``42 s``, ``4 min 5 s``, ``2 h 3 min``."""
    whole = round(seconds)
    if whole < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60} s"
    return f"{whole // 3600} h {whole % 3600 // 60} min"


def story_lines(story: Story) -> list[str]:
    lines = [_headline(story)]
    for index, attempt in enumerate(story.attempts):
        if len(story.attempts) > 1:  # one attempt: the headline says how it ended
            lines.append(f"attempt {attempt.number} on {', '.join(attempt.nodes)}: {clock(attempt.start)}, "
                         f"{duration(attempt.end - attempt.start)}, {attempt.outcome}")
        if index < len(story.recoveries):
            recovery = story.recoveries[index]
            steps = f" ({'; '.join(recovery.steps)})" if recovery.steps else ""
            lines.append(f"recovery after attempt {recovery.after}: {duration(recovery.end - recovery.start)}"
                         f" to ranks running again{steps}")
    straggler = next((mark for mark in story.marks if mark.kind == "straggler"), None)
    if straggler is not None:
        lines.append(f"straggler: {straggler.text}, marked at {clock(straggler.at)}")
    elif story.summary is not None and story.summary.straggler:
        lines.append(f"straggler: {story.summary.straggler}")
    hang = next((mark for mark in story.marks if mark.kind == "hang"), None)
    if hang is not None:
        lines.append(f"hang: found at {clock(hang.at)}; {described(story.stacks)}")
    lines += gpu_lines(story)
    if story.summary is not None and story.summary.checkpoint:
        lines.append(f"checkpoint: {story.summary.checkpoint}")
    return lines


def _headline(story: Story) -> str:
    span = f"{clock(story.start)} to {clock(story.end)} UTC ({duration(story.end - story.start)})"
    if story.summary is None:
        return f"run {story.run_id}: no end recorded; {span}"
    return f"run {story.run_id}, exit {story.summary.exit_code}: {story.summary.headline}; {span}"


def gpu_lines(story: Story) -> list[str]:
    """Each node's mean GPU utilisation over the run, one character per stretch."""
    if not story.gpus:
        return []
    times = {point.at for points in story.gpus.values() for point in points}
    first, last = min(times), max(times)
    width = max(1, min(SPARK_WIDTH, len(times)))
    step = (last - first) / width if last > first else 1.0
    by_node: dict[str, list[tuple[int, list[GpuPoint]]]] = {}
    for (node, gpu), points in story.gpus.items():
        by_node.setdefault(node, []).append((gpu, points))
    nodes = [node for node in story.nodes if node in by_node] + sorted(set(by_node) - set(story.nodes))
    lines = [f"GPU use (mean utilisation; {clock(first)} to {clock(last)} UTC, "
             f"1 character = {duration(step)}):"]
    pad = max(len(node) for node in nodes)
    for node in nodes:
        sums, counts = [0.0] * width, [0] * width
        for _gpu, points in by_node[node]:
            for point in points:
                stretch = min(width - 1, int((point.at - first) / step))
                sums[stretch] += point.usage.utilisation
                counts[stretch] += 1
        spark = "".join(" " if not found else SPARK[min(7, int(total / found / 100 * 8))]
                        for total, found in zip(sums, counts))
        mean = sum(sums) / sum(counts)
        slowed = _slowed(by_node[node])
        lines.append(f"  {node.ljust(pad)}  {spark}  {mean:3.0f} % ({count(len(by_node[node]), 'GPU')}"
                     f"{'; ' + slowed if slowed else ''})")
    return lines


def _slowed(gpus: list[tuple[int, list[GpuPoint]]]) -> str:
    """The clock throttle reasons present in at least half of a node's busy GPU samples."""
    reasons = [point.usage.reasons for _gpu, points in gpus for point in points if point.usage.utilisation >= GPU_BUSY]
    return ", ".join(words for bit, words in THROTTLE_REASONS.items()
                     if reasons and 2 * sum(1 for value in reasons if value & bit) >= len(reasons))


def story_text(story: Story) -> str:
    return "\n".join(story_lines(story)) + "\n"
