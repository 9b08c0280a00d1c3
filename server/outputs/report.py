"""What a broker-loop run leaves in its output folder: metrics.jsonl, metrics.csv, report.md and PNG plots.

metrics.jsonl holds one JSON object per round with the simulator's keys (round, accuracy, accuracy_std,
train_loss, bytes_down, bytes_up, seconds, participants) and the federation's own: who was dropped and
why, the bytes per rank tier and, where the run recorded it, each device's accuracy and tier (``per_device``).
metrics.csv holds the scalar fields of the same records, one row per round, for spreadsheets and plotting
tools. Plots are drawn with matplotlib's Agg canvas (no display, no pyplot state).
"""
from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from device_runtime.atomic_file import write_atomic
from device_runtime.baseline import one_class
from server.engine.evaluation import TIER_DIRECTIONS
from server.outputs.tier_colors import tier_colors, tier_order

METRICS_FILE = "metrics.jsonl"
METRICS_CSV = "metrics.csv"
REPORT_FILE = "report.md"
ACCURACY_PLOT = "accuracy.png"
BYTES_PLOT = "bytes_by_tier.png"
DEVICE_PLOT = "accuracy_by_device.png"
PRIVACY_PLOT = "accuracy_by_epsilon.png"
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


def write_metrics(path: str | os.PathLike, records: Sequence[Mapping[str, Any]]) -> None:
    """Write every round's record as one JSON line, atomically (a resumed run rewrites the file)."""
    write_atomic(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in records).encode())


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _csv_cell(value: Any) -> str | int | float:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value


def write_metrics_csv(path: str | os.PathLike, records: Sequence[Mapping[str, Any]]) -> None:
    """Write the records' scalar fields as CSV, one row per round, atomically: ``round`` first, then every
    scalar key any record has, sorted; an empty cell where a record lacks it or holds None."""
    keys = sorted({k for r in records for k, v in r.items() if k != "round" and _is_scalar(v)})
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(["round", *keys])
    for r in records:
        writer.writerow([r["round"], *(_csv_cell(r.get(k)) if _is_scalar(r.get(k)) else "" for k in keys)])
    write_atomic(path, text.getvalue().encode())


def _save(figure: Figure, path: Path) -> None:
    FigureCanvasAgg(figure)
    for ax in figure.axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.tight_layout()
    figure.savefig(path, dpi=PLOT_DPI)


def _accuracy_axes(title: str, xlabel: str) -> tuple[Figure, Any]:
    """A figure whose one axes plot accuracy (0 to 1) against ``xlabel``."""
    figure = Figure(figsize=PLOT_SIZE_IN)
    ax = figure.add_subplot()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("accuracy")
    ax.set_ylim(0.0, 1.0)
    ax.grid(alpha=0.3)
    return figure, ax


def accuracy_figure(records: Sequence[Mapping[str, Any]], unit: str = "round") -> Figure:
    """Accuracy against the round (version), with its std over devices as a band; both named in the legend. The
    title says over which devices: all of them where every point had the same count, else those that evaluated
    each point (the report's "evaluated by" column)."""
    points = [(r["round"], r["accuracy"], r["accuracy_std"] or 0.0) for r in records if r.get("accuracy") is not None]
    counts = {r.get("evaluated") for r in records if r.get("accuracy") is not None}
    over = f"{counts.pop()} devices each" if len(counts) == 1 else "the devices that evaluated each; see the report"
    figure, ax = _accuracy_axes(f"Personalized accuracy after each {unit} ({over})", unit)
    if points:
        rounds, acc, std = zip(*points)
        ax.plot(rounds, acc, marker="o", label="accuracy: Σ correct / Σ test samples")
        ax.fill_between(rounds, [a - s for a, s in zip(acc, std)], [a + s for a, s in zip(acc, std)], alpha=0.2,
                        label="± 1 std of the devices' accuracies")
        ax.legend(loc="lower right")
    return figure


def plot_accuracy(records: Sequence[Mapping[str, Any]], path: str | os.PathLike, unit: str = "round") -> None:
    """Save ``accuracy_figure`` as a PNG."""
    _save(accuracy_figure(records, unit), Path(path))


def private(records: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the run was differentially private (its rows carry the ε spent)."""
    return any(r.get("epsilon") is not None for r in records)


def privacy_figure(records: Sequence[Mapping[str, Any]]) -> Figure:
    """Accuracy against the ε spent up to each round: what each unit of privacy bought."""
    points = [(r["epsilon"], r["accuracy"]) for r in records
              if r.get("epsilon") is not None and r.get("accuracy") is not None]
    figure, ax = _accuracy_axes("Accuracy against the privacy spent (user-level ε, upper bound)", "ε spent so far")
    if points:
        ax.plot(*zip(*points), marker="o")
    return figure


def tiers_of(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every tier that moved bytes in some round, largest ratio first."""
    return sorted({t for r in records for t in r.get("bytes_by_tier", {})}, key=tier_order)


def training_mb_by_tier(records: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Per tier (largest ratio first), the MB of training traffic (TIER_DIRECTIONS) in each record."""
    return {tier: [sum(r.get("bytes_by_tier", {}).get(tier, {}).get(k, 0) for k in TIER_DIRECTIONS) / MB
                   for r in records] for tier in tiers_of(records)}


def plot_bytes_by_tier(records: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> None:
    """Save ``bytes_figure`` as a PNG."""
    _save(bytes_figure(records), Path(path))


def bytes_figure(records: Sequence[Mapping[str, Any]]) -> Figure:
    """Stacked bars: MB of training traffic per round (down + up + artifacts, as in the table) by rank tier, in the
    tiers' colours; evaluation-only downloads are left out, as the table's and summary's totals leave them out."""
    figure = Figure(figsize=PLOT_SIZE_IN)
    ax = figure.add_subplot()
    rounds = [r["round"] for r in records]
    bottom = [0.0] * len(records)
    colours = tier_colors(tiers_of(records))
    for tier, heights in training_mb_by_tier(records).items():
        ax.bar(rounds, heights, bottom=bottom, label=f"ratio {tier}", color=colours[tier])
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_title("Training traffic per round by rank tier (evaluation-only downloads not shown)", fontsize=9)
    ax.set_xlabel("round")
    ax.set_ylabel("MB (down + up + artifacts)")
    if records:
        ax.set_ylim(0.0, max(max(bottom) * 1.3, 1e-3))  # room for the legend above the bars
        ax.legend(loc="upper center", ncol=max(1, len(tiers_of(records))), fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return figure


def device_accuracies(records: Sequence[Mapping[str, Any]]) -> dict[str, tuple[str, list[tuple[int, float]]]]:
    """Each device's tier (its latest) and (round, accuracy) points, from the records that carry ``per_device``."""
    devices: dict[str, tuple[str, list[tuple[int, float]]]] = {}
    for r in records:
        for device_id, entry in (r.get("per_device") or {}).items():
            if entry.get("accuracy") is None:
                continue
            _, points = devices.get(device_id, ("", []))
            devices[device_id] = (str(entry["tier"]), [*points, (r["round"], entry["accuracy"])])
    return dict(sorted(devices.items()))


def tier_accuracy(records: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Per tier, (round, the tier's accuracy that round) from the records' ``per_tier``, largest ratio first.

    One definition everywhere (the engine's, printed on the console and kept in metrics.jsonl): a tier's accuracy
    pools its devices' test samples, Σ correct / Σ test samples, as the run's accuracy does."""
    points: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        for tier, entry in (r.get("per_tier") or {}).items():
            if entry.get("accuracy") is not None:
                points.setdefault(str(tier), []).append((r["round"], entry["accuracy"]))
    return {tier: points[tier] for tier in sorted(points, key=tier_order)}


def plot_device_accuracy(records: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> None:
    """Save ``device_accuracy_figure`` as a PNG."""
    _save(device_accuracy_figure(records), Path(path))


def device_accuracy_figure(records: Sequence[Mapping[str, Any]]) -> Figure:
    """One thin line per device and one thick line per tier (its devices' test samples pooled), in the tiers'
    colours (server.outputs.tier_colors: the status page's too)."""
    figure = Figure(figsize=PLOT_SIZE_IN)
    ax = figure.add_subplot()
    devices = device_accuracies(records)
    colours = tier_colors(tier_accuracy(records))
    for tier, points in tier_accuracy(records).items():
        count = sum(1 for t, _ in devices.values() if t == tier)
        rounds, acc = zip(*points)
        ax.plot(rounds, acc, color=colours[tier], linewidth=2.5, marker="o",
                label=f"ratio {tier}: {count} device{'s' if count != 1 else ''} pooled")
    for tier, points in devices.values():
        rounds, acc = zip(*points)
        ax.plot(rounds, acc, color=colours[tier], linewidth=0.8, alpha=0.45)
    ax.set_title("Accuracy per device (thin lines) and per rank tier (thick)", fontsize=10)
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy on the device's test split")
    ax.set_ylim(0.0, 1.0)
    ax.grid(alpha=0.3)
    if devices:
        ax.legend(loc="lower right", fontsize=8)
    return figure


def _fmt(value: Any, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def last_entries(records: Sequence[Mapping[str, Any]], key: str) -> dict[str, Mapping[str, Any]]:
    """Each device's (``key="per_device"``) or tier's (``"per_tier"``) entry of the last record that evaluated it."""
    last: dict[str, Mapping[str, Any]] = {}
    for r in records:
        last.update({str(k): v for k, v in (r.get(key) or {}).items() if v.get("accuracy") is not None})
    return last


def one_class_note(entry: Mapping[str, Any]) -> str:
    """The device table's flag for a model that answered one class for every test sample."""
    return "ONE CLASS: a trivial model" if one_class(entry.get("classes"), entry.get("samples") or 0) else ""


def device_section(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """report.md lines: each tier's and each device's accuracy at its last evaluated round beside its
    majority-class baseline, a model that answers one class flagged; [] without data."""
    devices = device_accuracies(records)
    if not devices:
        return []
    tiers, entries = last_entries(records, "per_tier"), last_entries(records, "per_device")
    lines = ["## Accuracy per rank tier and device", "",
             "At the last evaluated round; a tier's accuracy pools its devices' test samples (Σ correct / Σ test "
             "samples, as the console and metrics.jsonl report it); min and max are over its devices. The "
             "majority-class baseline is what answering each device's most common test label for everything "
             "would score: an accuracy near it says little, and a model that answers one class is flagged.", "",
             "| tier | devices | accuracy | majority-class baseline | min | max |",
             "| --- | --- | --- | --- | --- | --- |"]
    for tier, points in tier_accuracy(records).items():
        final = [p[-1][1] for t, p in devices.values() if t == tier]
        low, high = (_fmt(min(final), ".4f"), _fmt(max(final), ".4f")) if final else ("–", "–")
        baseline = _fmt(tiers.get(tier, {}).get("majority"), ".4f")
        lines.append(f"| {tier} | {len(final)} | {points[-1][1]:.4f} | {baseline} | {low} | {high} |")
    lines += ["", "| device | tier | accuracy | majority-class baseline | round | |",
              "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {device_id} | {tier} | {points[-1][1]:.4f} | {_fmt(entries[device_id].get('majority'), '.4f')} | "
              f"{points[-1][0]} | {one_class_note(entries[device_id])} |"
              for device_id, (tier, points) in devices.items()]
    return [*lines, "", f"![accuracy per device and tier]({DEVICE_PLOT})", ""]


def unit_of(settings: Mapping[str, Any]) -> str:
    """What a run's rows count: versions in --mode async, else rounds."""
    return "version" if settings.get("async") else "round"


def fully_evaluated(evaluated: Sequence[Mapping[str, Any]]) -> tuple[int, list[Mapping[str, Any]]]:
    """(n, the evaluated rows measured on n devices), n the most devices any row was evaluated by: the rows whose
    accuracy compares (an async version evaluated by one idle device can read 1.0)."""
    full = max(r.get("evaluated", 0) for r in evaluated)
    return full, [r for r in evaluated if r.get("evaluated", 0) == full]


def budget_stop(records: Sequence[Mapping[str, Any]], settings: Mapping[str, Any]) -> str | None:
    """"stopped by the privacy budget at ε …" where --dp-target-epsilon ended the run before its --rounds (the
    only way a finished private run has fewer rows than rounds), else None."""
    target, rounds = settings.get("dp_target_epsilon"), settings.get("rounds")
    if target is None or rounds is None or not records or records[-1]["round"] >= rounds:
        return None
    last, unit = records[-1], unit_of(settings)
    return (f"stopped by the privacy budget at ε = {last['epsilon']:.4g} after {unit} {last['round']} of {rounds}: "
            f"the next would have spent more than --dp-target-epsilon {target:g}")


SECAGG_PHASES = ("keys", "shares", "masked", "unmask")


def secure_section(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """The secure-aggregation table (rows that carry ``secagg``): survivors, drops recovered, threshold, whether the
    round was aggregated (or why not), and the bytes into the server and seconds of each SecAgg+ phase."""
    rows = [r for r in records if r.get("secagg")]
    if not rows:
        return []
    lines = ["", "## Secure aggregation (SecAgg+, docs/privacy.md)", "",
             "The server saw only masked vectors and their sum. Per phase: MB into the server / seconds (the masked "
             "phase's seconds include local training).", "",
             "| round | survivors | dropped | recovered | threshold | aggregated | "
             + " | ".join(SECAGG_PHASES) + " |", "| --- " * (6 + len(SECAGG_PHASES)) + "|"]
    for r in rows:
        s = r["secagg"]
        phases = s.get("phases", {})
        cells = [f"{phases[p]['bytes_in'] / MB:.3f} / {phases[p]['seconds']:.2f}" if p in phases else "-"
                 for p in SECAGG_PHASES]
        done = "yes" if s.get("aggregated") else f"no: {s.get('failure')}"
        lines.append(f"| {r['round']} | {s.get('survivors')} | {s.get('dropped')} | {s.get('recovered')} | "
                     f"{s.get('threshold')} | {done} | " + " | ".join(cells) + " |")
    return lines


def report_markdown(records: Sequence[Mapping[str, Any]], settings: Mapping[str, Any]) -> str:
    """report.md's text: settings, summary, per-round table, per-tier and per-device accuracy, the
    evaluation note, the plots."""
    evaluated = [r for r in records if r.get("accuracy") is not None]
    unit = unit_of(settings)
    lines = ["# FedARA federation report", "", "## Settings", "", "| setting | value |", "| --- | --- |"]
    lines += [f"| {key} | {value} |" for key, value in settings.items()]
    lines += ["", "## Summary", ""]
    if evaluated:
        full, among = fully_evaluated(evaluated)
        best = max(among, key=lambda r: r["accuracy"])
        lines += [f"- final accuracy: {evaluated[-1]['accuracy']:.4f} ({unit} {evaluated[-1]['round']}, evaluated by "
                  f"{evaluated[-1].get('evaluated', '–')} devices)",
                  f"- best accuracy: {best['accuracy']:.4f} ({unit} {best['round']}), over the {len(among)} "
                  f"{unit}(s) of {len(evaluated)} evaluated by {full} devices, the most any was: an accuracy "
                  "measured on fewer devices is not comparable"]
    else:
        lines.append(f"- no {unit} was evaluated")
    total = sum(r.get("bytes_down", 0) + r.get("bytes_up", 0) + r.get("bytes_artifacts", 0) for r in records)
    eval_total = sum(r.get("bytes_down_eval", 0) for r in records)
    lines += [f"- rounds: {len(records)}; bytes moved (FE down + up + artifacts): {total / MB:.2f} MB, "
              f"and {eval_total / MB:.2f} MB of evaluation-only downloads",
              f"- updates dropped: {sum(len(r.get('dropped', {})) for r in records)}"]
    dp = private(records)
    if dp:
        lines += [f"- privacy: user-level ε = {records[-1]['epsilon']:.4g} spent after round {records[-1]['round']} at "
                  f"δ = {settings.get('dp_delta') or 'the default 1/N^1.1'} (an upper bound: docs/privacy.md); the "
                  "devices' personal heads and the reported accuracies are outside the guarantee"]
        stop = budget_stop(records, settings)
        if stop:
            lines.append(f"- {stop}")
    lines += ["",
              f"## {unit.capitalize()}s", "",
              f"| {unit} | accuracy | ± std | evaluated by | train loss | participants | dropped | down MB | up MB "
              f"| artifacts MB | eval-only down MB | s |{' ε |' if dp else ''}",
              f"| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |{' --- |' if dp else ''}"]
    for r in records:
        lines.append(
            f"| {r['round']} | {_fmt(r.get('accuracy'), '.4f')} | {_fmt(r.get('accuracy_std'), '.4f')} | "
            f"{r.get('evaluated', '–')} | "
            f"{_fmt(r.get('train_loss'), '.4f')} | {r.get('participants', 0)}/{r.get('selected', 0)} | "
            f"{len(r.get('dropped', {}))} | {r.get('bytes_down', 0) / MB:.2f} | {r.get('bytes_up', 0) / MB:.2f} | "
            f"{r.get('bytes_artifacts', 0) / MB:.2f} | {r.get('bytes_down_eval', 0) / MB:.2f} | "
            f"{r.get('seconds', 0.0):.1f} |" + (f" {_fmt(r.get('epsilon'), '.4g')} |" if dp else ""))
    lines += ["", f"down MB: what the server sent for training, {settings.get('down_mb', 'with every device task')}; "
                  "up MB: what the devices sent back."]
    dropped = [(r["round"], d, why) for r in records for d, why in sorted(r.get("dropped", {}).items())]
    if dropped:
        lines += ["", "Dropped answers:", ""] + [f"- round {t}, {d}: {why}" for t, d, why in dropped]
    lines += secure_section(records)
    lines += ["", *device_section(records)]
    lines += ["## How accuracy is measured", "", EVALUATION_NOTE, "",
              "## Plots", "", f"![accuracy per {unit}]({ACCURACY_PLOT})", "",
              f"![training traffic per round by tier]({BYTES_PLOT})", ""]
    if dp:
        lines += [f"![accuracy against the privacy spent]({PRIVACY_PLOT})", ""]
    return "\n".join(lines)


def write_report(out_dir: str | os.PathLike, records: Sequence[Mapping[str, Any]],
                 settings: Mapping[str, Any]) -> Path:
    """Write report.md and its plots into ``out_dir`` (the per-device plot only when records carry
    ``per_device``); returns report.md's path."""
    out_dir = Path(out_dir)
    plot_accuracy(records, out_dir / ACCURACY_PLOT, unit_of(settings))
    plot_bytes_by_tier(records, out_dir / BYTES_PLOT)
    if device_accuracies(records):
        plot_device_accuracy(records, out_dir / DEVICE_PLOT)
    if private(records):
        _save(privacy_figure(records), out_dir / PRIVACY_PLOT)
    path = out_dir / REPORT_FILE
    path.write_text(report_markdown(records, settings))
    return path
