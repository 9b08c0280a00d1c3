"""What a broker-loop run leaves in its output folder: metrics.jsonl, report.md and two PNG plots.

metrics.jsonl holds one JSON object per round with the simulator's keys (round, accuracy, accuracy_std,
train_loss, bytes_down, bytes_up, seconds, participants) and the federation's own: who was dropped and
why, and the bytes per rank tier. Plots are drawn with matplotlib's Agg canvas (no display, no pyplot state).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from device_runtime.atomic_file import write_atomic
from server.coordinator import Evaluation
from server.strategy import weighted_accuracy

METRICS_FILE = "metrics.jsonl"
REPORT_FILE = "report.md"
ACCURACY_PLOT = "accuracy.png"
BYTES_PLOT = "bytes_by_tier.png"
TIER_DIRECTIONS = ("down", "up", "artifacts")
PLOT_SIZE_IN = (6.0, 3.6)
PLOT_DPI = 110
MB = 1e6

EVALUATION_NOTE = (
    "Accuracy at round t is Σ correct / Σ test samples over the devices' local test splits, each device "
    "evaluating its personalized model after round t's aggregation: the global FE factorized at its plan, "
    "with its own head. The evaluation is piggy-backed: every task of round t+1 first makes the device "
    "evaluate the FE it received (round t's model) before training, and after the last round the server "
    "sends an evaluation-only task. Round t's line is therefore written once round t+1's answers are in "
    "(or its deadline passed); devices that did not answer are missing from that round's accuracy.")


def evaluation_summary(evaluations: Iterable[Evaluation]) -> dict[str, Any]:
    """accuracy (Σ correct / Σ total), accuracy_std over devices, mean eval loss, and how many devices."""
    evaluations = list(evaluations)
    total = sum(e.total for e in evaluations)
    if total == 0:
        return {"accuracy": None, "accuracy_std": None, "eval_loss": None, "evaluated": len(evaluations)}
    accuracy, std = weighted_accuracy([e.correct for e in evaluations], [e.total for e in evaluations])
    loss = sum(e.loss * e.total for e in evaluations) / total
    return {"accuracy": accuracy, "accuracy_std": std, "eval_loss": loss, "evaluated": len(evaluations)}


def write_metrics(path: str | os.PathLike, records: Sequence[Mapping[str, Any]]) -> None:
    """Write every round's record as one JSON line, atomically (a resumed run rewrites the file)."""
    write_atomic(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in records).encode())


SCALARS_FILE = "metrics.csv"


def write_scalars_csv(out_dir: str | os.PathLike, records: Sequence[Mapping[str, Any]]) -> Path:
    """metrics.csv: one row per round with every scalar of its record (for spreadsheets and other tools)."""
    path = Path(out_dir) / SCALARS_FILE
    keys = sorted({k for r in records for k, v in r.items() if v is None or isinstance(v, (int, float, str))})
    lines = [",".join(keys)]
    for record in records:
        lines.append(",".join("" if record.get(k) is None else str(record[k]) for k in keys))
    write_atomic(path, ("\n".join(lines) + "\n").encode())
    return path


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _save(figure: Figure, path: Path) -> None:
    FigureCanvasAgg(figure)
    for ax in figure.axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.tight_layout()
    figure.savefig(path, dpi=PLOT_DPI)


def plot_accuracy(records: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> None:
    """Accuracy (with its std over devices as a band) against the round."""
    points = [(r["round"], r["accuracy"], r["accuracy_std"] or 0.0) for r in records if r.get("accuracy") is not None]
    figure = Figure(figsize=PLOT_SIZE_IN)
    ax = figure.add_subplot()
    if points:
        rounds, acc, std = zip(*points)
        ax.plot(rounds, acc, marker="o")
        ax.fill_between(rounds, [a - s for a, s in zip(acc, std)], [a + s for a, s in zip(acc, std)], alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy (personalized, all devices)")
    ax.set_ylim(0.0, 1.0)
    ax.grid(alpha=0.3)
    _save(figure, Path(path))


def tiers_of(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every tier that moved bytes in some round, largest ratio first."""
    return sorted({t for r in records for t in r.get("bytes_by_tier", {})}, key=float, reverse=True)


def plot_bytes_by_tier(records: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> None:
    """Stacked bars: MB moved per round (down + up + artifacts) by rank tier."""
    figure = Figure(figsize=PLOT_SIZE_IN)
    ax = figure.add_subplot()
    rounds = [r["round"] for r in records]
    bottom = [0.0] * len(records)
    for tier in tiers_of(records):
        heights = [sum(r.get("bytes_by_tier", {}).get(tier, {}).get(k, 0) for k in TIER_DIRECTIONS) / MB
                   for r in records]
        ax.bar(rounds, heights, bottom=bottom, label=f"ratio {tier}")
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xlabel("round")
    ax.set_ylabel("MB (down + up + artifacts)")
    if records:
        ax.legend()
    ax.grid(axis="y", alpha=0.3)
    _save(figure, Path(path))


def _fmt(value: Any, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def report_markdown(records: Sequence[Mapping[str, Any]], settings: Mapping[str, Any]) -> str:
    """report.md's text: settings, summary, per-round table, the evaluation note, the plots."""
    evaluated = [r for r in records if r.get("accuracy") is not None]
    lines = ["# FedARA federation report", "", "## Settings", "", "| setting | value |", "| --- | --- |"]
    lines += [f"| {key} | {value} |" for key, value in settings.items()]
    lines += ["", "## Summary", ""]
    if evaluated:
        best = max(evaluated, key=lambda r: r["accuracy"])
        lines += [f"- final accuracy: {evaluated[-1]['accuracy']:.4f} (round {evaluated[-1]['round']})",
                  f"- best accuracy: {best['accuracy']:.4f} (round {best['round']})"]
    else:
        lines.append("- no round was evaluated")
    total = sum(r.get("bytes_down", 0) + r.get("bytes_up", 0) + r.get("bytes_artifacts", 0) for r in records)
    lines += [f"- rounds: {len(records)}; bytes moved (FE down + up + artifacts): {total / MB:.2f} MB",
              f"- updates dropped: {sum(len(r.get('dropped', {})) for r in records)}", "",
              "## Rounds", "",
              "| round | accuracy | ± std | train loss | participants | dropped | down MB | up MB | artifacts MB | s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        lines.append(
            f"| {r['round']} | {_fmt(r.get('accuracy'), '.4f')} | {_fmt(r.get('accuracy_std'), '.4f')} | "
            f"{_fmt(r.get('train_loss'), '.4f')} | {r.get('participants', 0)}/{r.get('selected', 0)} | "
            f"{len(r.get('dropped', {}))} | {r.get('bytes_down', 0) / MB:.2f} | {r.get('bytes_up', 0) / MB:.2f} | "
            f"{r.get('bytes_artifacts', 0) / MB:.2f} | {r.get('seconds', 0.0):.1f} |")
    dropped = [(r["round"], d, why) for r in records for d, why in sorted(r.get("dropped", {}).items())]
    if dropped:
        lines += ["", "Dropped answers:", ""] + [f"- round {t}, {d}: {why}" for t, d, why in dropped]
    lines += ["", "## How accuracy is measured", "", EVALUATION_NOTE, "",
              "## Plots", "", f"![accuracy per round]({ACCURACY_PLOT})", "",
              f"![bytes per round by tier]({BYTES_PLOT})", ""]
    return "\n".join(lines)


def write_report(out_dir: str | os.PathLike, records: Sequence[Mapping[str, Any]],
                 settings: Mapping[str, Any]) -> Path:
    """Write report.md and its two plots into ``out_dir``; returns report.md's path."""
    out_dir = Path(out_dir)
    plot_accuracy(records, out_dir / ACCURACY_PLOT)
    plot_bytes_by_tier(records, out_dir / BYTES_PLOT)
    path = out_dir / REPORT_FILE
    path.write_text(report_markdown(records, settings))
    return path
