"""The status page (``/``), rendered on the server from a snapshot: what it shows is in the HTML the server sends
(a headless screenshot, ``curl`` or a browser without scripts sees the run), and the page's one small script only
fetches the page again every 2 s and swaps the live part in. One renderer, in Python, no second copy in JavaScript.

The page shows what the console shows: the rounds trained ("round 3/5" on the console), the accuracy after the
last evaluated round ("accuracy after round 2"), the final evaluation as the evaluation of the last round's model,
each device's accuracy beside its majority-class baseline (a model that answers one class is flagged), accuracy
per tier over rounds in the tiers' colours (report.md's plots use the same, server.outputs.tier_colors), and
whether the run has finished.
"""
from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

from device_runtime.baseline import one_class
from server.outputs.status_snapshot import Snapshot
from server.outputs.tier_colors import ALL_DEVICES, tier_colors, tier_order

TEMPLATE = Path(__file__).with_name("status_page.html").read_text(encoding="utf-8")
"""The page around its live part (style, links, the refresh script): a package data file."""
LIVE_MARK = "<!--LIVE-->"
PLOT_W, PLOT_H, LEFT, RIGHT, TOP, BOTTOM = 640, 260, 44, 110, 10, 30
LATE_S = 10.0
"""A round whose deadline is this close shows whom it waits for in red."""


def _fmt(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _text(value: Any) -> str:
    return escape("–" if value is None else str(value))


def meta_parts(snapshot: Snapshot) -> list[str]:
    """The run's headline figures, in the console's words."""
    completed, rounds = snapshot["completed"], snapshot["rounds"]
    trained = snapshot["last_trained_round"] or 0
    parts = [f"round {trained}/{rounds} trained" if rounds else f"round {trained} trained"]
    if completed:
        parts.append(f"accuracy after round {completed[-1]['round']}: {_fmt(completed[-1]['accuracy'], 4)}")
    else:
        parts.append("accuracy: none evaluated yet")
    down = sum(t.get("down", 0) + t.get("eval", 0) for c in completed for t in c["bytes_by_tier"].values())
    up = sum(t.get("up", 0) for c in completed for t in c["bytes_by_tier"].values())
    refused = sum(snapshot["refusals"].values()) + snapshot["transport"].get("frames_rejected", 0)
    aggregators = " ".join(f"{a['name']}@{_text(a['briefed_round'])}" for a in snapshot["aggregators"]) or "none"
    parts += [f"down {down / 1e6:.2f} MB", f"up {up / 1e6:.2f} MB", f"refused {refused}", f"aggregators {aggregators}"]
    privacy = snapshot.get("privacy")
    if privacy:
        target = "∞" if privacy["target_epsilon"] is None else f"{privacy['target_epsilon']:g}"
        parts.append(f"privacy ε {privacy['epsilon']:.3f} of {target} at δ {privacy['delta']:.2e}")
    secagg = next((c["secagg"] for c in reversed(completed) if c.get("secagg")), None)
    if secagg:
        done = "aggregated" if secagg["aggregated"] else f"not aggregated ({_text(secagg.get('failure'))})"
        parts.append(f"secure aggregation round {secagg['round']}: {secagg['survivors']} survivors, "
                     f"{secagg['dropped']} dropped, {secagg['recovered']} recovered, t {_text(secagg['threshold'])}, "
                     f"{done}")
    if snapshot.get("finished"):
        parts.append("run finished")
    return parts


def round_html(snapshot: Snapshot, now_unix: float) -> str:
    """The open round: who answered, whom it waits for, its deadline (an evaluation-only round is named for the
    model it evaluates: the one after the round before)."""
    r = snapshot["open_round"]
    if r is None:
        state = "none: the run has finished" if snapshot.get("finished") else "none"
        return f"{state} (last trained round: {_text(snapshot['last_trained_round'])})"
    left = max(0.0, r["deadline_unix"] - now_unix)
    name = (f"round {r['round']}: {r['train']} train, {r['evaluate']} evaluate" if r["train"]
            else f"evaluation of round {r['round'] - 1}'s model")
    html = f"{escape(name)}: {r['answered']} of {r['asked']} answered, deadline in {left:.0f} s"
    if r["waiting_for"]:
        late = ' class="late"' if left < LATE_S else ""
        html += f"<div{late}>waiting for: {escape(', '.join(r['waiting_for']))}</div>"
    return html


def _row(device: dict[str, Any]) -> str:
    flag = "ONE CLASS: a trivial model" if one_class(device["last_classes"], device["last_samples"] or 0) else ""
    cells = [("", device["id"]), ("", device["tier"]), ("num", _fmt(device["memory_limit_mb"], 0)),
             ("", device["memory_limit_source"]), ("num", _fmt(device["budget_mb"], 0)), ("", device["runtime"]),
             ("", "yes" if device["online"] else "no"), ("num", device["last_answered_round"]),
             ("num", _fmt(device["last_accuracy"], 4)), ("num", _fmt(device["last_majority"], 4)), ("flag", flag)]
    off = "" if device["online"] else ' class="off"'
    return (f'<tr data-device="{escape(device["id"])}"{off}>'
            + "".join(f'<td class="{cls}">{_text(v)}</td>' if cls else f"<td>{_text(v)}</td>" for cls, v in cells)
            + "</tr>")


def plot_svg(snapshot: Snapshot) -> str:
    """Accuracy over the evaluated rounds, of every device pooled and of each tier: an inline SVG."""
    history = snapshot["history"]
    max_round = max([1, snapshot["rounds"] or 0, *(h["round"] for h in history)])

    def x(r: float) -> float:
        return LEFT + (r - 1) / max(1, max_round - 1) * (PLOT_W - LEFT - RIGHT)

    def y(a: float) -> float:
        return TOP + (1 - a) * (PLOT_H - TOP - BOTTOM)
    parts = [f'<rect x="{LEFT}" y="{TOP}" width="{PLOT_W - LEFT - RIGHT}" height="{PLOT_H - TOP - BOTTOM}" '
             'fill="none" stroke="#999"/>']
    for a in (0, 0.25, 0.5, 0.75, 1):
        parts.append(f'<line x1="{LEFT}" x2="{PLOT_W - RIGHT}" y1="{y(a):.1f}" y2="{y(a):.1f}" stroke="#eee"/>'
                     f'<text x="{LEFT - 6}" y="{y(a) + 4:.1f}" text-anchor="end">{a:.2f}</text>')
    for r in range(1, max_round + 1, max(1, -(-max_round // 10))):
        parts.append(f'<text x="{x(r):.1f}" y="{PLOT_H - BOTTOM + 14}" text-anchor="middle">{r}</text>')
    parts.append(f'<text x="{PLOT_W - RIGHT}" y="{PLOT_H - 2}" text-anchor="end">round</text>')
    tiers = sorted({t for h in history for t in h["per_tier"]}, key=tier_order)
    colors = tier_colors(tiers)
    series = [("all", ALL_DEVICES, lambda h: h["accuracy"])]
    series += [(f"tier {t}", colors[t], lambda h, t=t: h["per_tier"].get(t)) for t in tiers]
    for i, (name, color, value) in enumerate(series):
        points = [(x(h["round"]), y(value(h))) for h in history if value(h) is not None]
        if points:
            parts.append(f'<polyline points="{" ".join(f"{px:.1f},{py:.1f}" for px, py in points)}" fill="none" '
                         f'stroke="{color}" stroke-width="{1.5 if i else 2.5}"/>')
        parts += [f'<circle cx="{px:.1f}" cy="{py:.1f}" r="2.5" fill="{color}"/>' for px, py in points]
        parts.append(f'<text x="{PLOT_W - RIGHT + 8}" y="{TOP + 14 + 16 * i}" fill="{color}">{escape(name)}</text>')
    return (f'<svg id="plot" width="{PLOT_W}" height="{PLOT_H}" role="img" aria-label="accuracy per tier">'
            + "".join(parts) + "</svg>")


def live_html(snapshot: Snapshot | None, now_unix: float) -> str:
    """The part of the page that changes: everything the snapshot says."""
    if snapshot is None:
        return '<div id="live"><h1>FedARA run: starting</h1><p>no snapshot yet</p></div>'
    meta = "".join(f"<span>{escape(part)}</span>" for part in meta_parts(snapshot))
    return (f'<div id="live"><h1>FedARA run {escape(snapshot["run_id"])} ({escape(snapshot["algorithm"])})</h1>'
            f'<div id="meta">{meta}</div>'
            f'<h2>Open round</h2><div id="round">{round_html(snapshot, now_unix)}</div>'
            f'<h2>Accuracy per tier</h2>{plot_svg(snapshot)}'
            '<h2>Devices</h2><table id="devices"><thead><tr><th>device</th><th>tier</th><th>memory limit (MiB)</th>'
            '<th>limit source</th><th>budget (MiB)</th><th>runtime</th><th>online</th><th>last answered round</th>'
            '<th>last accuracy</th><th>majority-class baseline</th><th></th></tr></thead>'
            f'<tbody>{"".join(_row(d) for d in snapshot["devices"])}</tbody></table></div>')


def render_page(snapshot: Snapshot | None, now_unix: float) -> str:
    """The whole page for ``snapshot`` at Unix time ``now_unix`` (the open round's deadline counts down from it)."""
    return TEMPLATE.replace(LIVE_MARK, live_html(snapshot, now_unix))
