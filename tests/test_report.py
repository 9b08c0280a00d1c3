"""Run outputs: metrics.jsonl lines, the accuracy summary, report.md and its PNG plots."""
from __future__ import annotations

import pytest

from server.coordinator import Evaluation
from server.report import (ACCURACY_PLOT, BYTES_PLOT, EVALUATION_NOTE, evaluation_summary, read_metrics, tiers_of,
                           write_metrics, write_report)

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
    assert "| dataset | digits |" in text and "final accuracy: 0.6000 (round 2)" in text
    assert "round 2, dev_003: no answer by the deadline" in text
    assert EVALUATION_NOTE in text
    for plot in (ACCURACY_PLOT, BYTES_PLOT):
        assert f"]({plot})" in text
        assert (tmp_path / plot).read_bytes().startswith(PNG_MAGIC)


def test_report_of_a_run_without_evaluations_says_so(tmp_path):
    assert "no round was evaluated" in write_report(tmp_path, [record(1, None)], {}).read_text()


def test_scalars_csv_has_one_row_per_round_with_every_scalar(tmp_path):
    from server.report import write_scalars_csv
    path = write_scalars_csv(tmp_path, [record(1, 0.4), record(2, None)])
    header, first, second = path.read_text().splitlines()
    keys = header.split(",")
    assert "accuracy" in keys and "bytes_up" in keys and "bytes_by_tier" not in keys and "dropped" not in keys
    assert dict(zip(keys, first.split(",")))["accuracy"] == "0.4"
    assert dict(zip(keys, second.split(",")))["accuracy"] == ""
