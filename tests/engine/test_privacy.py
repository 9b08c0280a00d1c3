"""DP-FedAvg's mechanism (server/engine/privacy.py): every contribution clipped, a fixed denominator, noise of the
stated scale from a generator --seed does not fix, Poisson sampling, the adaptive clip, the settings' checks."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from server.engine.privacy import ClippedSum, Privacy, l2_norm, noise_cause, noise_generator, poisson_sample
from server.engine.run_config import DpSettings

SHAPES = {"fe.a.weight": (8, 4), "fe.a.bias": (8,)}


def settings(**kw) -> DpSettings:
    return DpSettings(**{"noise_multiplier": 1.0, "join_ratio": 0.1, "population": 100, "clip": 0.5,
                         "test_seed": 7, **kw})


def update(scale: float, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g, dtype=torch.float64) * scale for k, s in SHAPES.items()}


def release(privacy: Privacy, updates: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    total = privacy.open_round()
    for u in updates:
        total.add(u)
    return privacy.release(total).delta


def test_an_update_far_too_large_moves_the_aggregate_by_at_most_clip_over_expected():
    s = settings()
    honest = [update(0.01, seed) for seed in range(5)]
    raw = update(1.0, 99)
    attacker = {k: v * 1000 * s.clip / l2_norm(raw) for k, v in raw.items()}  # 1000x the clip
    assert l2_norm(attacker) == pytest.approx(1000 * s.clip)
    without = release(Privacy.of(s, SHAPES), honest)  # the same test seed: the same noise
    with_it = release(Privacy.of(s, SHAPES), honest + [attacker])
    moved = l2_norm({k: with_it[k] - without[k] for k in SHAPES})
    assert moved == pytest.approx(s.clip / s.expected, rel=1e-9)


def test_the_mean_divides_by_the_expected_participants_not_by_those_who_came():
    s = settings(noise_multiplier=1e-12)
    u = update(0.01)
    out = release(Privacy.of(s, SHAPES), [u, u])
    assert torch.allclose(out["fe.a.weight"], 2 * u["fe.a.weight"] / s.expected, atol=1e-12)


def test_noise_std_is_z_clip_over_expected_within_its_sampling_error():
    s = settings(noise_multiplier=1.3, clip=0.7)
    shapes = {"fe.big.weight": (400, 500)}
    out = Privacy.of(s, shapes).release(ClippedSum.zeros(s.clip, shapes)).delta["fe.big.weight"].numpy().ravel()
    expected_std = s.noise_multiplier * s.clip / s.expected
    # the sample std of n normal draws has relative standard error 1/sqrt(2n): allow 5 of them
    assert abs(out.std() / expected_std - 1) < 5 / math.sqrt(2 * out.size)
    assert abs(out.mean()) < 5 * expected_std / math.sqrt(out.size)


def test_the_noise_is_not_fixed_by_anything_but_the_test_seed():
    assert noise_generator().random() != noise_generator().random()
    assert noise_generator(3).random() == noise_generator(3).random()


def test_poisson_sampling_draws_each_device_with_the_join_ratio():
    rng = noise_generator(1)
    ids = [f"d{i:03d}" for i in range(1000)]
    counts = [len(poisson_sample(ids, 0.1, rng)) for _ in range(200)]
    # binomial(1000, 0.1): mean 100, sd 9.5; the mean of 200 draws has sd 0.67
    assert abs(np.mean(counts) - 100) < 5 * 0.67
    assert np.std(counts) > 5  # not a fixed-size sample


def test_adaptive_clip_follows_the_median_norm():
    s = settings(clip=0.1, clip_quantile=0.5, population=400)  # E = 40
    privacy = Privacy.of(s, SHAPES)
    rng = np.random.default_rng(0)
    for _ in range(80):
        total = privacy.open_round()
        for norm in rng.uniform(0.0, 2.0, 40):  # median norm 1
            u = update(1.0, int(rng.integers(1 << 30)))
            total.add({k: v * norm / l2_norm(u) for k, v in u.items()})
        privacy.release(total)
    assert 0.8 < privacy.clip < 1.25


def test_adaptive_clip_spends_part_of_the_budget_on_its_count():
    s = settings(clip_quantile=0.5, population=400, noise_multiplier=1.0)  # sigma_b = 2: multiplier 4 for the count
    assert s.update_noise_multiplier == pytest.approx((1 - 1 / 16) ** -0.5)
    assert settings().update_noise_multiplier == 1.0


def test_adaptive_clip_refuses_a_multiplier_its_count_alone_exceeds():
    with pytest.raises(ValueError, match="--dp-noise-multiplier 5 with --dp-clip-quantile"):
        settings(clip_quantile=0.5, noise_multiplier=5.0)  # E = 10: sigma_b = 0.5, count multiplier 1


def test_default_delta_is_below_one_over_the_population():
    assert settings(population=500).run_delta == pytest.approx(500 ** -1.1)


@pytest.mark.parametrize("field, value, flag", [("noise_multiplier", 0.0, "--dp-noise-multiplier"),
                                                ("clip", -1.0, "--dp-clip"), ("clip_quantile", 1.0, "--dp-clip-quantile"),
                                                ("delta", 1.5, "--dp-delta"), ("accountant", "moments", "--dp-accountant")])
def test_bad_settings_name_their_flag(field, value, flag):
    with pytest.raises(ValueError, match=flag):
        settings(**{field: value})


def test_resume_keeps_the_adaptive_clip():
    s = settings(clip_quantile=0.5, population=400)
    first = Privacy.of(s, SHAPES)
    first.release(first.open_round())  # nobody within... nobody at all: the clip moves
    second = Privacy.of(s, SHAPES)
    second.restore(first.to_state())
    assert second.clip == first.clip != s.clip


def test_a_target_no_round_fits_is_refused_naming_what_one_round_spends():
    with pytest.raises(ValueError, match=r"--dp-target-epsilon 0.001 fits no round: one round already spends ε = "):
        settings(target_epsilon=0.001).check_budget_fits()
    settings(target_epsilon=100.0).check_budget_fits()


def test_the_noise_cause_names_its_std_per_coordinate_against_the_clip():
    cause = noise_cause(DpSettings(1.0, 1.0, 3, clip=1.0), 1.0)
    assert "std z·C/E = 1·1/3 = 0.333 per coordinate, against updates clipped to norm C = 1" in cause
    assert "--dp-noise-multiplier" in cause
