"""Run outputs: metrics.jsonl lines, the accuracy summary, report.md and its PNG plots."""
from __future__ import annotations

import csv

import pytest

from server.engine.coordinator import Evaluation
from server.engine.evaluation import evaluation_summary
from matplotlib.colors import to_hex

from server.outputs.report import (ACCURACY_PLOT, budget_stop, BYTES_PLOT, DEVICE_PLOT, EVALUATION_NOTE, METRICS_CSV, accuracy_figure,
                           bytes_figure, device_accuracies, device_accuracy_figure, read_metrics, tier_accuracy,
                           tiers_of, training_mb_by_tier, write_metrics, write_metrics_csv, write_report)
from server.outputs.tier_colors import tier_colors

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def record(round_index: int, accuracy: float | None = 0.5, **changes) -> dict:
    return {"round": round_index, "accuracy": accuracy, "accuracy_std": 0.1, "train_loss": 1.0, "participants": 2,
            "selected": 2, "dropped": {}, "bytes_down": 1_000_000, "bytes_up": 500_000, "bytes_artifacts": 0,
            "bytes_by_tier": {"1": {"down": 600_000, "up": 300_000, "artifacts": 0},
                              "0.25": {"down": 400_000, "up": 200_000, "artifacts": 0}},
            "seconds": 2.0, **changes}


def test_metrics_file_holds_one_line_per_round(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_metrics(path, [record(1), record(2)])
    assert path.read_text().count("\n") == 2
    assert read_metrics(path) == [record(1), record(2)]


def test_rewriting_metrics_replaces_the_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_metrics(path, [record(1), record(2)])
    write_metrics(path, [record(1)])
    assert read_metrics(path) == [record(1)]


def test_accuracy_is_weighted_by_test_samples():
    summary = evaluation_summary([Evaluation(9, 10, 0.2), Evaluation(10, 30, 1.0)])
    assert summary["accuracy"] == pytest.approx(19 / 40)
    assert summary["eval_loss"] == pytest.approx((0.2 * 10 + 1.0 * 30) / 40)
    assert summary["evaluated"] == 2


def test_no_evaluation_means_no_accuracy():
    assert evaluation_summary([]) == {"accuracy": None, "accuracy_std": None, "eval_loss": None, "evaluated": 0}


def test_tiers_are_listed_largest_first():
    assert tiers_of([record(1), record(2, bytes_by_tier={"0.5": {}})]) == ["1", "0.5", "0.25"]


def test_report_has_settings_rounds_evaluation_note_and_plots(tmp_path):
    records = [record(1, 0.4), record(2, 0.6, dropped={"dev_003": "no answer by the deadline"}), record(3, None)]
    path = write_report(tmp_path, records, {"dataset": "digits", "rounds": 3})
    text = path.read_text()
    assert "| dataset | digits |" in text and "final accuracy: 0.6000 (round 2, " in text
    assert "round 2, dev_003: no answer by the deadline" in text
    assert EVALUATION_NOTE in text
    for plot in (ACCURACY_PLOT, BYTES_PLOT):
        assert f"]({plot})" in text
        assert (tmp_path / plot).read_bytes().startswith(PNG_MAGIC)


def test_report_of_a_run_without_evaluations_says_so(tmp_path):
    assert "no round was evaluated" in write_report(tmp_path, [record(1, None)], {}).read_text()


def test_the_bytes_plot_counts_training_traffic_as_the_table_does_without_evaluation_downloads():
    last = record(3, bytes_down_eval=700_000,
                  bytes_by_tier={"1": {"down": 600_000, "up": 300_000, "artifacts": 0, "eval": 400_000},
                                 "0.25": {"down": 400_000, "up": 200_000, "artifacts": 0, "eval": 300_000}})
    heights = training_mb_by_tier([record(1), last])
    assert heights == {"1": [0.9, 0.9], "0.25": [0.6, 0.6]}
    assert sum(h[1] for h in heights.values()) == pytest.approx((last["bytes_down"] + last["bytes_up"]) / 1e6)


def test_the_report_names_evaluation_only_downloads_apart(tmp_path):
    text = write_report(tmp_path, [record(1), record(2, bytes_down_eval=700_000)], {}).read_text()
    assert "3.00 MB, and 0.70 MB of evaluation-only downloads" in text
    assert "| 1.00 | 0.50 | 0.00 | 0.70 | 2.0 |" in text


def test_an_async_reports_best_accuracy_is_over_the_versions_evaluated_by_the_most_devices(tmp_path):
    records = [record(1, 0.5, evaluated=4), record(2, 1.0, evaluated=1), record(3, 0.7, evaluated=4)]
    text = write_report(tmp_path, records, {"rounds": 3, "async": {"buffer_size": 2}}).read_text()
    assert "- best accuracy: 0.7000 (version 3), over the 2 version(s) of 3 evaluated by 4 devices" in text
    assert "| version | accuracy | ± std | evaluated by |" in text and "| 2 | 1.0000 | 0.1000 | 1 |" in text


def test_the_accuracy_plot_says_over_which_devices_each_point_was_measured():
    same = accuracy_figure([record(1, 0.4, evaluated=3), record(2, 0.6, evaluated=3)]).axes[0].get_title()
    mixed = accuracy_figure([record(1, 0.4, evaluated=3), record(2, 0.6, evaluated=1)], "version").axes[0]
    assert same == "Personalized accuracy after each round (3 devices each)"
    assert mixed.get_title() == ("Personalized accuracy after each version (the devices that evaluated each; see the "
                                 "report)") and mixed.get_xlabel() == "version"


def test_the_accuracy_plot_has_a_title_and_a_legend_that_explains_the_band():
    ax = accuracy_figure([record(1, 0.4), record(2, 0.6)]).axes[0]
    assert ax.get_title()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "accuracy: Σ correct / Σ test samples", "± 1 std of the devices' accuracies"]


def per_device(**results: tuple[int, int, str]) -> dict:
    """A record's per_device and per_tier (as the engine writes them) from each device's (correct, total, tier)."""
    tiers: dict[str, list[int]] = {}
    for correct, total, tier in results.values():
        tiers.setdefault(tier, [0, 0])
        tiers[tier][0] += correct
        tiers[tier][1] += total
    return {"per_device": {d: {"accuracy": c / n, "tier": t} for d, (c, n, t) in results.items()},
            "per_tier": {t: {"accuracy": c / n, "devices": sum(1 for *_, u in results.values() if u == t)}
                         for t, (c, n) in tiers.items()}}


DEVICE_RECORDS = [record(1, 0.5, **per_device(dev_000=(4, 10, "1"), dev_001=(6, 10, "0.25"), dev_002=(15, 30, "0.25"))),
                  record(2, 0.7, **per_device(dev_000=(8, 10, "1"), dev_001=(7, 10, "0.25"))),
                  record(3, None)]


def test_device_accuracies_follow_each_device_over_the_rounds_it_was_evaluated():
    assert device_accuracies(DEVICE_RECORDS) == {"dev_000": ("1", [(1, 0.4), (2, 0.8)]),
                                                 "dev_001": ("0.25", [(1, 0.6), (2, 0.7)]),
                                                 "dev_002": ("0.25", [(1, 0.5)])}


def test_tier_accuracy_pools_the_tiers_test_samples_each_round_largest_ratio_first():
    """Σ correct / Σ test samples over the tier's devices, the console's and metrics.jsonl's definition: 21 of 40
    (0.525), not the mean of the devices' 0.6 and 0.5."""
    tiers = tier_accuracy(DEVICE_RECORDS)
    assert list(tiers) == ["1", "0.25"]
    assert tiers["0.25"] == [(1, pytest.approx(0.525)), (2, pytest.approx(0.7))]


def test_the_report_tabulates_tiers_and_devices_and_plots_them(tmp_path):
    text = write_report(tmp_path, DEVICE_RECORDS, {}).read_text()
    assert "| 0.25 | 2 | 0.7000 | – | 0.5000 | 0.7000 |" in text  # round 2 pools dev_001 alone; no baseline sent
    assert "| dev_002 | 0.25 | 0.5000 | – | 1 |  |" in text
    assert f"]({DEVICE_PLOT})" in text
    assert (tmp_path / DEVICE_PLOT).read_bytes().startswith(PNG_MAGIC)


def test_each_accuracy_has_its_majority_class_baseline_beside_it_and_a_one_class_model_is_flagged(tmp_path):
    """dev_000 answers class 7 for all 149 of its test samples: its 0.8658 is its majority share (129/149)."""
    trivial = {"accuracy": 129 / 149, "tier": "1", "majority": 129 / 149, "classes": 1, "samples": 149}
    learned = {"accuracy": 0.8, "tier": "1", "majority": 0.4, "classes": 6, "samples": 150}
    text = write_report(tmp_path, [record(1, 0.83, per_device={"dev_000": trivial, "dev_001": learned},
                                          per_tier={"1": {"accuracy": 0.83, "devices": 2, "majority": 0.63}})],
                        {}).read_text()
    assert "| 1 | 2 | 0.8300 | 0.6300 | 0.8000 | 0.8658 |" in text
    assert "| dev_000 | 1 | 0.8658 | 0.8658 | 1 | ONE CLASS: a trivial model |" in text
    assert "| dev_001 | 1 | 0.8000 | 0.4000 | 1 |  |" in text


def test_a_tier_has_one_colour_in_every_plot_and_on_the_status_page():
    colours = tier_colors(["0.25", "1", "0.5"])
    assert colours == {"1": "#1f77b4", "0.5": "#ff7f0e", "0.25": "#2ca02c"}  # tab10 by ratio, largest first
    records = [record(1, 0.5, **per_device(dev_000=(4, 10, "1"), dev_001=(6, 10, "0.25")))]
    lines = {line.get_label().split(":")[0]: to_hex(line.get_color())
             for line in device_accuracy_figure(records).axes[0].get_lines() if line.get_label().startswith("ratio")}
    assert lines == {"ratio 1": colours["1"], "ratio 0.25": tier_colors(["1", "0.25"])["0.25"]}
    bars = {c.get_label(): to_hex(c.patches[0].get_facecolor()) for c in bytes_figure(records).axes[0].containers}
    assert bars == {"ratio 1": "#1f77b4", "ratio 0.25": "#ff7f0e"}


def test_a_run_without_per_device_records_has_no_device_section_or_plot(tmp_path):
    text = write_report(tmp_path, [record(1)], {}).read_text()
    assert DEVICE_PLOT not in text and not (tmp_path / DEVICE_PLOT).exists()


def test_metrics_csv_holds_one_row_per_round_of_the_scalar_fields(tmp_path):
    path = tmp_path / METRICS_CSV
    write_metrics_csv(path, [record(1, aggregated=True), record(2, None)])
    rows = list(csv.DictReader(path.open()))
    assert [r["round"] for r in rows] == ["1", "2"]
    assert rows[0]["accuracy"] == "0.5" and rows[1]["accuracy"] == "" and rows[0]["aggregated"] == "true"
    assert rows[1]["aggregated"] == "" and float(rows[0]["bytes_down"]) == 1_000_000
    assert "bytes_by_tier" not in rows[0] and "dropped" not in rows[0]
    assert next(iter(rows[0])) == "round"


def test_a_run_the_privacy_budget_ended_says_so_and_one_that_ran_its_rounds_does_not():
    records = [record(1, epsilon=2.5), record(2, epsilon=3.9)]
    stop = budget_stop(records, {"rounds": 10, "dp_target_epsilon": 4.0})
    assert stop == ("stopped by the privacy budget at ε = 3.9 after round 2 of 10: the next would have spent more "
                    "than --dp-target-epsilon 4")
    assert budget_stop(records, {"rounds": 2, "dp_target_epsilon": 4.0}) is None
    assert budget_stop(records, {"rounds": 10, "dp_target_epsilon": None}) is None
