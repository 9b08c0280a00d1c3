"""Rank tiers from resource profiles: the largest tier predicted to fit a device's budget, overrides first."""
from __future__ import annotations

import json

import pytest

from fedcore.lowrank import RankPlan, resolve_plan
from fedcore.models import build_model
from tests.support.edge_models import conv1d_net
from server.engine.rank_assignment import (RUNTIME_BASE_MB, Footprint, OverrideError, assign_tier, check_tiers, choose_ratio,
                                    load_overrides, plan_footprint, predict_peak_mb, tier_predictor, unchosen_tiers)

TIERS = (1.0, 0.5, 0.25)
MB_PER_TIER = {1.0: 100.0, 0.5: 80.0, 0.25: 60.0}.__getitem__
INPUT = (1, 28, 28)


@pytest.fixture(scope="module")
def model():
    return build_model("fedavgcnn", INPUT, 10, seed=0)


def test_largest_tier_that_fits_the_budget_is_chosen():
    assert assign_tier(85.0, TIERS, MB_PER_TIER) == 0.5


def test_budget_exactly_at_a_prediction_fits():
    assert assign_tier(100.0, TIERS, MB_PER_TIER) == 1.0


def test_device_without_a_budget_gets_the_largest_tier():
    assert assign_tier(None, (0.25, 1.0, 0.5), MB_PER_TIER) == 1.0


def test_device_that_fits_no_tier_gets_the_smallest():
    assert assign_tier(10.0, TIERS, MB_PER_TIER) == 0.25


FACTORS_COST_MORE = {1.0: 74.0, 0.5: 74.0, 0.25: 82.0}.__getitem__
"""A depthwise-separable model's tiers, as measured: ratio 0.5 is its dense plan, its factors at 0.25 hold more."""


def test_device_that_fits_no_tier_gets_the_leanest_even_where_that_is_dense():
    assert assign_tier(70.0, TIERS, FACTORS_COST_MORE) == 1.0


def test_a_tier_needing_no_less_than_a_larger_one_is_never_chosen_by_memory_and_named():
    assert unchosen_tiers(TIERS, FACTORS_COST_MORE) == [(0.5, 1.0), (0.25, 1.0)]
    assert all(assign_tier(budget, TIERS, FACTORS_COST_MORE) == 1.0 for budget in (74.0, 80.0, 82.0, 90.0))


def test_tiers_that_each_save_memory_are_all_chosen_by_some_budget():
    assert unchosen_tiers(TIERS, MB_PER_TIER) == []


def test_override_takes_precedence_over_the_budget():
    assert choose_ratio("dev_001", None, TIERS, MB_PER_TIER, {"dev_001": 0.125}) == 0.125
    assert choose_ratio("dev_002", 85.0, TIERS, MB_PER_TIER, {"dev_001": 0.125}) == 0.5


@pytest.mark.parametrize("tiers, match", [((), "at least one"), ((1.0, 1.5), r"\(0, 1\]"), ((0.5, 0.5), "repeat")])
def test_bad_tiers_are_refused(tiers, match):
    with pytest.raises(ValueError, match=match):
        check_tiers(tiers)


def test_prediction_is_the_runtime_base_plus_parameters_and_activations():
    footprint = Footprint(parameters=1024 * 1024, activations_per_sample=1024 * 1024)
    assert predict_peak_mb(footprint, batch_size=1) == RUNTIME_BASE_MB + 16.0
    assert predict_peak_mb(footprint, batch_size=3) == RUNTIME_BASE_MB + 32.0


def test_lower_ratio_plan_holds_fewer_parameters(model):
    dense = plan_footprint(model, {}, INPUT)
    low = plan_footprint(model, resolve_plan(model, RankPlan(0.125)).ranks, INPUT)
    assert low.parameters < dense.parameters / 4
    assert dense.parameters == sum(p.numel() for p in model.parameters())


def test_factorized_conv_counts_its_intermediate_activation(model):
    """A conv split in two keeps an extra r-channel map for the backward pass: at ratio 0.5 that outweighs
    the savings, and the prediction must show it."""
    dense = plan_footprint(model, {}, INPUT)
    half = plan_footprint(model, resolve_plan(model, RankPlan(0.5)).ranks, INPUT)
    assert half.activations_per_sample > dense.activations_per_sample


def test_factorized_conv1d_counts_its_rank_channels_over_the_output_time_steps():
    """conv2 (8 -> 16 channels, k 3, stride 2 over 16 steps: 7 out) at rank 2 keeps 2 x 7 floats between its halves."""
    net = conv1d_net((3, 16), 4)
    factorized = plan_footprint(net, {"fe.conv2": 2}, (3, 16)).activations_per_sample
    dense = plan_footprint(net, {}, (3, 16)).activations_per_sample
    assert factorized - dense == 2 * 7


def test_predictor_grows_with_the_batch(model):
    assert tier_predictor(model, INPUT, 64)(1.0) > tier_predictor(model, INPUT, 16)(1.0)


def test_override_file_is_read(tmp_path):
    path = tmp_path / "overrides.json"
    path.write_text(json.dumps({"dev_000": 0.25, "dev_001": 1}))
    assert load_overrides(path) == {"dev_000": 0.25, "dev_001": 1.0}


@pytest.mark.parametrize("text, match", [('{"dev_000": 2.0}', "dev_000"), ('[0.5]', "JSON object"),
                                         ("{not json", "cannot read")])
def test_bad_override_file_is_refused(tmp_path, text, match):
    path = tmp_path / "overrides.json"
    path.write_text(text)
    with pytest.raises(OverrideError, match=match):
        load_overrides(path)
