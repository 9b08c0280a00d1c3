"""Both ONNX device runtimes equal the PyTorch reference: same weights and batches in, same weights out.

Inputs are fixed (seeded): an argmax flip at a max-pool near-tie, which a 1e-7 rounding difference can cause,
moves a weight by ~lr·|grad|, so a parity failure after a dependency upgrade may be such a flip, not a bug.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from device_runtime.artifact_contract import KINDS
from device_runtime.runtimes import open_trainer
from device_runtime.trainer import LocalTrainer
from export.artifacts import build_artifacts_of_kind
from fedcore.lowrank import factorize_model, fe_state
from fedcore.models import build_model
from fedcore.objective import compute_anchors
from server.training import evaluate, train_local
from tests.support.parity import CLASSES, PARAM_ATOL, SHAPE

FACTORIZED = {"fe.conv2": 80, "fe.fc1": 256}
SETTINGS = dict(mu=1e-3, lr=0.05, epochs=1, batch_size=8)  # 20 samples: batches of 8, 8 and a partial 4
SEED = 3
STRONG_DECAY = dict(mu=0.05, epochs=2)  # large enough that the per-epoch decay step shows in the weights


@pytest.fixture(scope="module")
def model():
    return build_model("fedavgcnn", SHAPE, CLASSES, seed=0)


@pytest.fixture(scope="module")
def cache(shared_artifact_cache):
    return shared_artifact_cache


@pytest.fixture(scope="module", params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    y = rng.integers(0, CLASSES - 2, 20).astype(np.int64)  # the last two classes have no sample
    return rng.standard_normal((20, *SHAPE)).astype(np.float32), y


def _pair(model, ranks, cache, kind) -> tuple[torch.nn.Module, LocalTrainer]:
    """The reference client model and a device trainer of the ``kind`` runtime holding exactly its weights."""
    reference = factorize_model(model, ranks)
    trainer = open_trainer(build_artifacts_of_kind(kind, model, ranks, SHAPE, CLASSES, cache).directory)
    trainer.set_fe({k: v.numpy() for k, v in fe_state(reference).items()})
    trainer.set_head({k: v.detach().numpy().copy() for k, v in reference.head.state_dict(prefix="head.").items()})
    return reference, trainer


def _max_param_diff(reference: torch.nn.Module, trainer: LocalTrainer) -> float:
    device = {**trainer.get_fe(), **trainer.get_head()}
    reference_state = reference.state_dict()
    assert set(device) == set(reference_state)
    return max(float(np.abs(reference_state[k].numpy() - device[k]).max()) for k in device)


def _train_both(reference, trainer, data, *, lam: float, anchors=None, mask=None, **overrides):
    x, y = data
    common = dict(anchors=anchors, mask=mask, lam=lam, **{**SETTINGS, **overrides})
    stats = train_local(reference, x, y, rng=np.random.default_rng(SEED), **common)
    result = trainer.train(x, y, rng=np.random.default_rng(SEED), **common)
    return stats, result


def test_dense_epoch_matches_torch(model, cache, data, kind):
    reference, trainer = _pair(model, {}, cache, kind)
    _train_both(reference, trainer, data, lam=0.0)
    assert _max_param_diff(reference, trainer) < PARAM_ATOL


def test_factorized_epoch_matches_torch(model, cache, data, kind):
    reference, trainer = _pair(model, FACTORIZED, cache, kind)
    _train_both(reference, trainer, data, lam=0.0)
    assert _max_param_diff(reference, trainer) < PARAM_ATOL


def test_anchor_term_epoch_matches_torch(model, cache, data, kind):
    reference, trainer = _pair(model, FACTORIZED, cache, kind)
    anchors, mask = compute_anchors(reference.fe, *data, CLASSES)
    _train_both(reference, trainer, data, lam=2.0, anchors=anchors, mask=mask)
    assert _max_param_diff(reference, trainer) < PARAM_ATOL


def test_two_epochs_with_a_strong_decay_match_torch(model, cache, data, kind):
    reference, trainer = _pair(model, FACTORIZED, cache, kind)
    _train_both(reference, trainer, data, lam=0.0, **STRONG_DECAY)
    assert _max_param_diff(reference, trainer) < PARAM_ATOL


def test_the_strong_decay_moves_the_factors_beyond_the_parity_tolerance(model, cache, data, kind):
    (_, decaying), (_, plain) = _pair(model, FACTORIZED, cache, kind), _pair(model, FACTORIZED, cache, kind)
    for trainer, mu in ((decaying, STRONG_DECAY["mu"]), (plain, 0.0)):
        trainer.train(*data, anchors=None, mask=None, lam=0.0, rng=np.random.default_rng(SEED),
                      **{**SETTINGS, **STRONG_DECAY, "mu": mu})
    decayed, undecayed = decaying.get_fe(), plain.get_fe()
    assert max(float(np.abs(decayed[k] - undecayed[k]).max()) for k in decayed) > 100 * PARAM_ATOL


def test_a_head_only_phase_decays_no_fe_factor(model, data):
    reference = factorize_model(model, FACTORIZED)
    before = fe_state(reference)
    train_local(reference, *data, anchors=None, mask=None, lam=0.0, rng=np.random.default_rng(SEED),
                params=list(reference.head.parameters()), **{**SETTINGS, **STRONG_DECAY})
    assert all(torch.equal(before[k], v) for k, v in fe_state(reference).items())


def test_the_updates_are_large_enough_for_parity_to_mean_something(model, cache, data, kind):
    reference, trainer = _pair(model, FACTORIZED, cache, kind)
    start = trainer.get_fe()
    _train_both(reference, trainer, data, lam=0.0)
    assert max(float(np.abs(trainer.get_fe()[k] - start[k]).max()) for k in start) > 100 * PARAM_ATOL


def test_anchors_match_the_reference(model, cache, data, kind):
    reference, trainer = _pair(model, FACTORIZED, cache, kind)
    expected_anchors, expected_mask = compute_anchors(reference.fe, *data, CLASSES, batch_size=8)
    anchors, mask = trainer.compute_anchors(*data, batch_size=8)
    np.testing.assert_array_equal(mask, expected_mask)
    np.testing.assert_allclose(anchors, expected_anchors, atol=1e-5)


def test_reported_loss_accuracy_and_steps_match_the_reference(model, cache, data, kind):
    reference, trainer = _pair(model, FACTORIZED, cache, kind)
    anchors, mask = compute_anchors(reference.fe, *data, CLASSES)
    stats, result = _train_both(reference, trainer, data, lam=2.0, anchors=anchors, mask=mask)
    assert (result.num_samples, result.steps, result.accuracy) == (stats.num_samples, stats.steps, stats.accuracy)
    assert result.loss == pytest.approx(stats.loss, rel=1e-5)


def test_evaluation_matches_the_reference(model, cache, data, kind):
    reference, trainer = _pair(model, FACTORIZED, cache, kind)
    stats = evaluate(reference, *data, batch_size=8)
    result = trainer.evaluate(*data, batch_size=8)
    assert (result.correct, result.total) == (stats.correct, stats.total)
    assert result.loss == pytest.approx(stats.loss, rel=1e-5)


@pytest.mark.parametrize("group", ["head", "fe"])
def test_a_one_group_phase_matches_torch_training_only_that_group(model, cache, data, kind, group):
    reference, trainer = _pair(model, FACTORIZED, cache, kind)
    x, y = data
    module = reference.head if group == "head" else reference.fe
    common = dict(anchors=None, mask=None, lam=0.0, **{**SETTINGS, **STRONG_DECAY})
    train_local(reference, x, y, rng=np.random.default_rng(SEED), params=list(module.parameters()), **common)
    trainer.train(x, y, rng=np.random.default_rng(SEED), params=group, **common)
    assert _max_param_diff(reference, trainer) < PARAM_ATOL


@pytest.mark.parametrize("group, frozen", [("head", "fe"), ("fe", "head")])
def test_a_one_group_phase_leaves_the_other_group_bit_identical(model, cache, data, kind, group, frozen):
    _, trainer = _pair(model, FACTORIZED, cache, kind)
    read = trainer.get_fe if frozen == "fe" else trainer.get_head
    changed = trainer.get_head if frozen == "fe" else trainer.get_fe
    before, before_changed = read(), changed()
    trainer.train(*data, anchors=None, mask=None, lam=0.0, rng=np.random.default_rng(SEED), params=group,
                  **{**SETTINGS, **STRONG_DECAY})
    assert all(np.array_equal(before[k], v) for k, v in read().items())
    assert any(not np.array_equal(before_changed[k], v) for k, v in changed().items())


def test_an_unknown_parameter_group_is_refused(model, cache, data, kind):
    _, trainer = _pair(model, {}, cache, kind)
    with pytest.raises(ValueError, match="params must be one of all, fe, head"):
        trainer.train(*data, anchors=None, mask=None, lam=0.0, rng=np.random.default_rng(SEED), params="factors",
                      **SETTINGS)
