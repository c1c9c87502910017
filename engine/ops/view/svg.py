"""The viewer's plots, drawn server-side as inline SVG: the rollout timeline, the pool's
occupancy and histograms. Every label is escaped; a span carries its sample id in
``data-s`` (the page's script links it), so a 20,000-sample timeline stays one small element
per span."""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape

from engine.events.ids import id_ms
from engine.ops.view.data import Band, RolloutData

__all__ = ["Span", "histogram", "spans", "step_chart", "timeline"]

WIDTH = 1200
GUTTER = 140  # the lane labels' column


@dataclass(frozen=True, slots=True)
class Span:
    """One attempt of a sample on the timeline: ``kind`` is ``ok``, ``ab`` (aborted),
    ``retry`` (an attempt a later one replaced) or ``run`` (still running)."""

    sample_id: str
    attempt: int
    lane: str
    start_ms: int
    end_ms: int
    kind: str


def spans(data: RolloutData, *, lanes: str = "node") -> list[Span]:
    """Every attempt of every sample, by lane (``node`` or ``worker``); a sample that ended
    without a start (aborted before it ran) is a mark at its end in lane ``(not started)``."""
    out: list[Span] = []
    now = data.last_ms or 0
    for sid, r in data.state.samples.items():
        starts = data.starts.get(sid, [])
        end = id_ms(r.terminal_at) if r.terminal_at is not None else None
        if not starts:
            if end is not None:
                out.append(Span(sid, r.attempt, "(not started)", end, end, "ab"))
            continue
        for i, a in enumerate(starts):
            last = i == len(starts) - 1
            if not last:
                stop, kind = starts[i + 1].start_ms, "retry"
            elif end is None:
                stop, kind = now, "run"
            else:
                stop, kind = end, "ab" if r.aborted else "ok"
            lane = (a.node if lanes == "node" else a.worker) or "(none)"
            out.append(Span(sid, a.attempt, lane, a.start_ms, max(stop, a.start_ms), kind))
    return out


def _rows(items: Sequence[Span]) -> list[int]:
    """A row per span such that spans of one row do not overlap (fewest rows, greedily)."""
    order = sorted(range(len(items)), key=lambda i: items[i].start_ms)
    free: list[tuple[int, int]] = []  # (end_ms, row)
    rows = [0] * len(items)
    n_rows = 0
    for i in order:
        s = items[i]
        if free and free[0][0] <= s.start_ms:
            _, row = heapq.heappop(free)
        else:
            row, n_rows = n_rows, n_rows + 1
        rows[i] = row
        heapq.heappush(free, (s.end_ms, row))
    return rows


def timeline(
    data: RolloutData,
    bands: Sequence[Band],
    *,
    lanes: str = "node",
    servers: Mapping[str, Sequence[tuple[int, str, str]]] | None = None,
) -> str:
    """The rollout's timeline: a lane per node (or worker), each sample's attempts as spans
    from start to end; a lane per model server, its state (up / down / stale) from each
    report to the next; quiesces as bands and version activations as lines."""
    items = spans(data, lanes=lanes)
    t0 = data.first_ms or 0
    t1 = max([data.last_ms or t0, *(s.end_ms for s in items)]) or t0
    scale = (WIDTH - GUTTER - 10) / max(1, t1 - t0)
    by_lane: dict[str, list[Span]] = {}
    for s in items:
        by_lane.setdefault(s.lane, []).append(s)
    packed = {lane: _rows(group) for lane, group in by_lane.items()}
    n_rows = sum(max(r, default=0) + 1 for r in packed.values()) or 1
    row_h = max(2, min(14, 640 // n_rows))
    servers = servers or {}
    height = n_rows * row_h + 20 * len(by_lane) + 20 * len(servers) + 40
    parts = [
        f'<svg class="timeline" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" data-t0="{t0}" data-scale="{scale:.6g}">'
    ]
    y = 30
    for lane in sorted(by_lane):
        group, rows = by_lane[lane], packed[lane]
        lane_rows = max(rows) + 1
        parts.append(
            f'<text class="lane" x="4" y="{y + 12}">{escape(lane)} ({len(group)})</text>'
            f'<line class="lane-rule" x1="0" x2="{WIDTH}" y1="{y}" y2="{y}"/>'
        )
        y += 16
        for s, row in zip(group, rows, strict=True):
            x = GUTTER + (s.start_ms - t0) * scale
            w = max(1.0, (s.end_ms - s.start_ms) * scale)
            parts.append(
                f'<rect class="{s.kind}" x="{x:.1f}" y="{y + row * row_h}" width="{w:.1f}" '
                f'height="{max(1, row_h - 1)}" data-s="{escape(s.sample_id)}" '
                f'data-a="{s.attempt}"/>'
            )
        y += lane_rows * row_h + 4
    for url in sorted(servers):
        parts.append(f'<text class="lane" x="4" y="{y + 12}">{escape(url)}</text>')
        reports = servers[url]
        for i, (ms, state, why) in enumerate(reports):
            stop = reports[i + 1][0] if i + 1 < len(reports) else t1
            if stop < t0 or ms > t1:
                continue
            x = GUTTER + (max(ms, t0) - t0) * scale
            w = max(1.0, (min(stop, t1) - max(ms, t0)) * scale)
            parts.append(f'<rect class="server-{state}" x="{x:.1f}" y="{y + 2}" '
                         f'width="{w:.1f}" height="12"><title>{escape(f"{state} {why}")}'
                         "</title></rect>")
        y += 20
    for b in bands:
        end = t1 if b.end_ms is None else b.end_ms
        if end < t0 or b.start_ms > t1:
            continue
        x = GUTTER + (max(b.start_ms, t0) - t0) * scale
        w = max(1.0, (min(end, t1) - max(b.start_ms, t0)) * scale)
        parts.append(
            f'<rect class="band-{b.kind}" x="{x:.1f}" y="0" width="{w:.1f}" height="{height}">'
            f"<title>{escape(b.label)}</title></rect>"
            f'<text class="band-label" x="{x + 2:.1f}" y="{12 if b.kind == "quiesce" else 24}">'
            f"{escape(b.label)}</text>"
        )
    parts.append(
        f'<text class="axis" x="{GUTTER}" y="{height - 4}">0 s</text>'
        f'<text class="axis" x="{WIDTH - 80}" y="{height - 4}">{(t1 - t0) / 1000:.1f} s</text>'
        "</svg>"
    )
    return "".join(parts)


def step_chart(series: Sequence[tuple[int, int]], t0: int, t1: int, *, height: int = 80) -> str:
    """A step line of ``(ms, value)`` over ``[t0, t1]`` (the pool's tokens held)."""
    if not series:
        return '<p class="none">no pool events for this rollout</p>'
    top = max(v for _, v in series) or 1
    scale = (WIDTH - GUTTER - 10) / max(1, t1 - t0)
    points = []
    last = 0
    for ms, value in series:
        x = GUTTER + (ms - t0) * scale
        points.append(f"{x:.1f},{height - 10 - (height - 20) * last / top:.1f}")
        points.append(f"{x:.1f},{height - 10 - (height - 20) * value / top:.1f}")
        last = value
    return (
        f'<svg class="pool" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}">'
        f'<text class="lane" x="4" y="{height // 2}">tokens held (max {top})</text>'
        f'<polyline class="pool-line" points="{" ".join(points)}"/></svg>'
    )


def histogram(values: Sequence[float], *, bins: int = 20, label: str = "") -> str:
    """Bars of ``values`` in ``bins`` equal bins between their min and max."""
    if not values:
        return '<p class="none">no values</p>'
    lo, hi = min(values), max(values)
    width, height = 320, 90
    counts = [0] * bins
    span = (hi - lo) or 1.0
    for v in values:
        counts[min(bins - 1, int((v - lo) / span * bins))] += 1
    top = max(counts)
    bar = (width - 20) / bins
    parts = [f'<svg class="hist" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}"><title>{escape(label)}</title>']
    for i, c in enumerate(counts):
        h = (height - 30) * c / top
        parts.append(
            f'<rect x="{10 + i * bar:.1f}" y="{height - 20 - h:.1f}" width="{bar - 1:.1f}" '
            f'height="{h:.1f}"><title>{c}</title></rect>'
        )
    parts.append(
        f'<text class="axis" x="10" y="{height - 6}">{lo:g}</text>'
        f'<text class="axis" x="{width - 60}" y="{height - 6}">{hi:g}</text>'
        f'<text class="axis" x="10" y="10">{escape(label)} (n={len(values)})</text></svg>'
    )
    return "".join(parts)
