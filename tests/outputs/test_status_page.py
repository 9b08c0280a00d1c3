"""The status page (server.outputs.status_page), rendered on the server: it says what the console says, in HTML
that needs no script to show the run (curl, a screenshot without a time budget, a browser with scripts off)."""
from __future__ import annotations

import copy
import re

from server.outputs.status_page import render_page
from server.outputs.status_snapshot import fleet_snapshot
from server.outputs.tier_colors import ALL_DEVICES, tier_colors
from tests.support.engine import two_rounds_engine


def snapshot_after_round_1(**changes) -> dict:
    """Round 1 trained (the console printed "round 1/3 ..."), its accuracy not in yet, round 2 waiting for dev_001."""
    return fleet_snapshot(two_rounds_engine(), now=5.0, wall=1000.0, rounds=3, **changes)


def test_the_page_shows_in_html_what_the_console_printed_before_any_accuracy():
    page = render_page(snapshot_after_round_1(), now_unix=1000.0)
    assert "round 1/3 trained" in page and "accuracy: none evaluated yet" in page
    assert re.findall(r'<tr data-device="([^"]+)"', page) == ["dev_000", "dev_001"]
    assert "round 2: 2 train, 0 evaluate: 1 of 2 answered, deadline in 8 s" in page
    assert '<div class="late">waiting for: dev_001</div>' in page


def test_the_page_names_the_accuracy_by_the_round_whose_model_it_measured_and_says_when_the_run_ended():
    engine = two_rounds_engine()
    engine.close_round(20.0)  # round 2 closes: round 1's record completes with its evaluations
    last = fleet_snapshot(engine, now=21.0, wall=1016.0, rounds=2, finished=True)
    page = render_page(last, now_unix=1016.0)
    assert "round 2/2 trained" in page and "accuracy after round 1: 0.5000" in page and "run finished" in page
    assert "none: the run has finished" in page


def test_the_final_evaluation_is_named_for_the_model_it_evaluates():
    snapshot = snapshot_after_round_1()
    snapshot["open_round"] = dict(snapshot["open_round"], round=4, train=0, evaluate=2)
    assert "evaluation of round 3&#x27;s model: 1 of 2 answered" in render_page(snapshot, now_unix=1000.0)


def test_a_device_shows_its_majority_class_baseline_and_a_one_class_model_is_flagged():
    snapshot = copy.deepcopy(snapshot_after_round_1())
    snapshot["devices"][0] |= {"last_accuracy": 129 / 149, "last_majority": 129 / 149, "last_classes": 1,
                               "last_samples": 149}
    snapshot["devices"][1] |= {"last_accuracy": 0.8, "last_majority": 0.4, "last_classes": 5, "last_samples": 150}
    page = render_page(snapshot, now_unix=1000.0)
    row_0, row_1 = re.findall(r'<tr data-device="[^"]+".*?</tr>', page)
    assert '<td class="num">0.8658</td><td class="num">0.8658</td><td class="flag">ONE CLASS' in row_0
    assert '<td class="num">0.8000</td><td class="num">0.4000</td><td class="flag"></td>' in row_1


def test_the_plot_draws_each_tier_in_its_report_colour():
    snapshot = snapshot_after_round_1()
    snapshot["history"] = [{"round": 1, "accuracy": 0.5, "per_tier": {"1": 0.6, "0.25": 0.4}},
                           {"round": 2, "accuracy": 0.6, "per_tier": {"1": 0.7, "0.25": 0.5}}]
    page = render_page(snapshot, now_unix=1000.0)
    colours = tier_colors(["1", "0.25"])
    strokes = re.findall(r'<polyline [^>]*stroke="([^"]+)"', page)
    assert strokes == [ALL_DEVICES, colours["1"], colours["0.25"]]
    assert f'fill="{colours["0.25"]}">tier 0.25</text>' in page


def test_a_page_before_the_first_snapshot_says_it_is_starting():
    assert "FedARA run: starting" in render_page(None, now_unix=0.0)


def test_no_device_shows_a_round_beyond_the_last_the_evaluation_after_it_counts_as_the_last_rounds():
    """In a 1-round run, round 2's task is the final evaluation (of round 1's model): dev_000 answered round 1."""
    snapshot = fleet_snapshot(two_rounds_engine(), now=5.0, wall=1000.0, rounds=1)
    assert {d["id"]: d["last_answered_round"] for d in snapshot["devices"]} == {"dev_000": 1, "dev_001": 1}
