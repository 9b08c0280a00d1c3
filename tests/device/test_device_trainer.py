"""The device trainer: tensor exchange checks, head persistence, anchors, batching, training and evaluation."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from device_runtime.artifact_contract import MANIFEST_NAME, ArtifactError, verify_artifacts
from device_runtime.batching import epoch_batches
from device_runtime.frobenius import factor_pairs, frobenius_decay_step
from device_runtime.tensor_check import TensorMismatchError
from device_runtime.trainer import DeviceTrainer, class_means, cross_entropy_sum
from export.artifacts import build_artifacts
from fedcore.lowrank import RankPlan, factorize_model, resolve_plan
from fedcore.models import build_model
from server.torch_trainer import TorchTrainer

SHAPE, CLASSES, FEATURES = (1, 28, 28), 10, 512
TRAIN = dict(anchors=None, mask=None, lam=0.0, mu=1e-3, lr=0.05, epochs=1, batch_size=4)


@pytest.fixture(scope="module")
def model_and_ranks():
    model = build_model("fedavgcnn", SHAPE, CLASSES, seed=0)
    return model, resolve_plan(model, RankPlan(0.5)).ranks


@pytest.fixture(scope="module")
def artifact_dir(shared_artifact_cache, model_and_ranks) -> Path:
    model, ranks = model_and_ranks
    return build_artifacts(model, ranks, SHAPE, CLASSES, shared_artifact_cache).directory


@pytest.fixture
def trainer(artifact_dir) -> DeviceTrainer:
    return DeviceTrainer(artifact_dir)


def _data(n: int, labels: list[int] | None = None, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = np.array(labels if labels is not None else rng.integers(0, CLASSES, n), dtype=np.int64)
    return rng.standard_normal((len(y), *SHAPE)).astype(np.float32), y


# batching

def test_epoch_batches_cover_a_permutation_and_keep_the_last_partial_batch():
    batches = epoch_batches(10, 4, np.random.default_rng(0))
    assert [len(b) for b in batches] == [4, 4, 2]
    assert sorted(np.concatenate(batches).tolist()) == list(range(10))


def test_epoch_batches_follow_the_generator():
    first = epoch_batches(10, 4, np.random.default_rng(5))
    again = epoch_batches(10, 4, np.random.default_rng(5))
    assert all(np.array_equal(a, b) for a, b in zip(first, again))


def test_batch_size_must_be_positive():
    with pytest.raises(ValueError, match="batch_size"):
        epoch_batches(10, 0, np.random.default_rng(0))


# tensor exchange

def test_set_fe_then_get_fe_round_trips_any_memory_layout(trainer):
    rng = np.random.default_rng(1)
    new = {k: np.asfortranarray(rng.standard_normal(v.shape).astype(np.float32)) for k, v in trainer.get_fe().items()}
    trainer.set_fe(new)
    got = trainer.get_fe()
    assert all(np.array_equal(got[k], new[k]) for k in new)


def test_get_fe_returns_copies(trainer):
    fe = trainer.get_fe()
    name = trainer.fe_names[0]
    fe[name][...] = 123.0
    assert not np.any(trainer.get_fe()[name] == 123.0)


def test_set_fe_rejects_a_missing_tensor(trainer):
    fe = trainer.get_fe()
    del fe["fe.fc1.u"]
    with pytest.raises(TensorMismatchError, match=r"missing \['fe.fc1.u'\]"):
        trainer.set_fe(fe)


def test_set_fe_rejects_an_unknown_tensor(trainer):
    fe = trainer.get_fe()
    fe["fe.fc1.weight"] = np.zeros((512, 1024), np.float32)
    with pytest.raises(TensorMismatchError, match=r"unknown \['fe.fc1.weight'\]"):
        trainer.set_fe(fe)


def test_set_fe_rejects_a_wrong_shape_naming_the_tensor(trainer):
    fe = trainer.get_fe()
    fe["fe.fc1.v"] = fe["fe.fc1.v"][:, :-1].copy()
    with pytest.raises(TensorMismatchError, match=r"fe.fc1.v: shape \(1024, 255\), expected \(1024, 256\)"):
        trainer.set_fe(fe)


def test_set_fe_rejects_a_wrong_dtype_naming_the_tensor(trainer):
    fe = trainer.get_fe()
    fe["fe.conv1.bias"] = fe["fe.conv1.bias"].astype(np.float64)
    with pytest.raises(TensorMismatchError, match="fe.conv1.bias: dtype float64"):
        trainer.set_fe(fe)


def test_set_fe_leaves_the_head_alone(trainer):
    head = trainer.get_head()
    trainer.set_fe({k: np.zeros_like(v) for k, v in trainer.get_fe().items()})
    assert all(np.array_equal(trainer.get_head()[k], head[k]) for k in head)


# head persistence

def test_saved_head_is_restored_by_a_new_trainer(trainer, artifact_dir, tmp_path):
    head = {k: np.full_like(v, 0.25) for k, v in trainer.get_head().items()}
    trainer.set_head(head)
    trainer.save_head(tmp_path / "head.npz")
    restarted = DeviceTrainer(artifact_dir)
    restarted.load_head(tmp_path / "head.npz")
    assert all(np.array_equal(restarted.get_head()[k], head[k]) for k in head)
    assert not (tmp_path / "head.npz.tmp").exists()


def test_load_head_rejects_a_head_of_another_shape(trainer, tmp_path):
    np.savez(tmp_path / "head.npz", **{"head.weight": np.zeros((3, FEATURES), np.float32),
                                       "head.bias": np.zeros(3, np.float32)})
    with pytest.raises(TensorMismatchError, match="head.weight: shape"):
        trainer.load_head(tmp_path / "head.npz")


# anchors

def test_class_means_divide_sums_by_counts_and_zero_absent_classes():
    anchors, mask = class_means(np.array([[2.0, 4.0], [0.0, 0.0], [3.0, 3.0]]), np.array([2, 0, 1]))
    np.testing.assert_array_equal(anchors, [[1, 2], [0, 0], [3, 3]])
    np.testing.assert_array_equal(mask, [1, 0, 1])
    assert anchors.dtype == mask.dtype == np.float32


def test_anchors_mask_classes_without_local_samples(trainer):
    x, y = _data(0, labels=[0, 2, 2, 5, 5, 5])
    anchors, mask = trainer.compute_anchors(x, y, batch_size=4)
    np.testing.assert_array_equal(mask, [1, 0, 1, 0, 0, 1, 0, 0, 0, 0])
    assert anchors.shape == (CLASSES, FEATURES)
    assert not anchors[mask == 0].any() and anchors[mask == 1].any()


def test_anchors_do_not_depend_on_the_batch_size(trainer):
    x, y = _data(9)
    a1, _ = trainer.compute_anchors(x, y, batch_size=2)
    a9, _ = trainer.compute_anchors(x, y, batch_size=9)
    np.testing.assert_allclose(a1, a9, atol=1e-6)


# training and evaluation

def test_training_takes_one_step_per_batch_including_the_last_partial_one(trainer):
    x, y = _data(10)
    before = trainer.get_fe()
    result = trainer.train(x, y, rng=np.random.default_rng(0), **{**TRAIN, "epochs": 2})
    assert (result.num_samples, result.steps) == (10, 6)
    assert np.isfinite(result.loss) and 0.0 <= result.accuracy <= 1.0
    after = trainer.get_fe()
    assert all(not np.array_equal(before[k], after[k]) for k in before)


def test_training_updates_the_head_too(trainer):
    x, y = _data(8)
    before = trainer.get_head()
    trainer.train(x, y, rng=np.random.default_rng(0), **TRAIN)
    assert not np.array_equal(before["head.weight"], trainer.get_head()["head.weight"])


def test_train_rejects_labels_outside_the_classes(trainer):
    x, y = _data(4)
    y[0] = CLASSES
    with pytest.raises(ValueError, match="labels must lie in"):
        trainer.train(x, y, rng=np.random.default_rng(0), **TRAIN)


def test_train_rejects_anchors_of_the_wrong_shape(trainer):
    x, y = _data(4)
    settings = {**TRAIN, "anchors": np.zeros((CLASSES, 3), np.float32), "mask": np.ones(CLASSES, np.float32)}
    with pytest.raises(TensorMismatchError, match="anchors: shape"):
        trainer.train(x, y, rng=np.random.default_rng(0), **settings)


def test_train_rejects_images_of_another_shape(trainer):
    x, y = _data(4)
    with pytest.raises(ValueError, match="x must be float32"):
        trainer.train(x[:, :, :27], y, rng=np.random.default_rng(0), **TRAIN)


def test_evaluate_counts_correct_predictions_and_mean_cross_entropy(trainer):
    x, y = _data(0, labels=[3, 3, 1, 7, 3])
    bias = np.zeros(CLASSES, np.float32)
    bias[3] = 2.0
    trainer.set_head({"head.weight": np.zeros((CLASSES, FEATURES), np.float32), "head.bias": bias})
    result = trainer.evaluate(x, y, batch_size=2)
    logits = np.tile(bias, (len(y), 1))
    assert (result.correct, result.total) == (3, 5)
    assert result.loss == pytest.approx(cross_entropy_sum(logits, y) / len(y))
    assert result.accuracy == pytest.approx(0.6)


def test_cross_entropy_sum_is_stable_for_large_logits():
    assert cross_entropy_sum(np.array([[1000.0, 0.0]]), np.array([0])) == pytest.approx(0.0)
    assert cross_entropy_sum(np.array([[1000.0, 0.0]]), np.array([1])) == pytest.approx(1000.0)


def test_a_directory_without_manifest_is_not_an_artifact_set(tmp_path):
    with pytest.raises(ArtifactError, match="manifest.json is missing"):
        verify_artifacts(tmp_path, "0" * 64)
    with pytest.raises(ArtifactError, match="not an artifact directory"):
        DeviceTrainer(tmp_path)


def test_anchors_and_mask_go_together(trainer):
    x, y = _data(4)
    with pytest.raises(ValueError, match="both or neither"):
        trainer.train(x, y, rng=np.random.default_rng(0), **{**TRAIN, "anchors": np.zeros((CLASSES, FEATURES), np.float32)})


def test_a_manifest_of_another_format_version_is_refused(artifact_dir, tmp_path):
    manifest = json.loads((artifact_dir / MANIFEST_NAME).read_text())
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({**manifest, "format_version": 1}))
    with pytest.raises(ArtifactError, match="format version 1"):
        DeviceTrainer(tmp_path)


# Frobenius decay

def test_decay_step_shrinks_the_norm_and_leaves_its_inputs_alone():
    rng = np.random.default_rng(1)
    u, v = rng.standard_normal((30, 4)).astype(np.float32), rng.standard_normal((20, 4)).astype(np.float32)
    u0, v0 = u.copy(), v.copy()
    new_u, new_v = frobenius_decay_step(u, v, 1e-3, 0.5)
    assert np.linalg.norm(new_u @ new_v.T) < np.linalg.norm(u @ v.T)
    assert np.array_equal(u, u0) and np.array_equal(v, v0)
    assert new_u.dtype == new_v.dtype == np.float32


def test_decay_step_with_a_zero_step_is_the_identity():
    rng = np.random.default_rng(2)
    u, v = rng.standard_normal((6, 2)), rng.standard_normal((5, 2))
    new_u, new_v = frobenius_decay_step(u, v, 1e-3, 0.0)
    assert np.array_equal(new_u, u) and np.array_equal(new_v, v)


@pytest.mark.parametrize("mu,step,message", [(-1e-3, 0.1, "mu must be >= 0"), (1e-3, -0.1, "step must be >= 0")])
def test_decay_step_rejects_negative_settings(mu, step, message):
    with pytest.raises(ValueError, match=message):
        frobenius_decay_step(np.ones((3, 2)), np.ones((4, 2)), mu, step)


def test_decay_step_rejects_factors_of_different_ranks():
    with pytest.raises(ValueError, match=r"U\(3, 2\) and V\(4, 3\)"):
        frobenius_decay_step(np.ones((3, 2)), np.ones((4, 3)), 1e-3, 0.1)


def test_factor_pairs_pair_each_layers_u_with_its_v():
    names = ["fe.conv1.weight", "fe.conv2.u", "fe.conv2.v", "fe.conv2.bias", "fe.fc1.u", "fe.fc1.v", "fe.fc2.u"]
    assert factor_pairs(names) == [("fe.conv2.u", "fe.conv2.v"), ("fe.fc1.u", "fe.fc1.v")]


def test_decay_factors_steps_every_factor_pair_and_nothing_else(trainer):
    fe, head = trainer.get_fe(), trainer.get_head()
    trainer.decay_factors(1e-3, 0.2)
    after = trainer.get_fe()
    for u_name, v_name in factor_pairs(fe):
        u, v = frobenius_decay_step(fe[u_name], fe[v_name], 1e-3, 0.2)
        np.testing.assert_array_equal(after[u_name], u)
        np.testing.assert_array_equal(after[v_name], v)
    decayed = {name for pair in factor_pairs(fe) for name in pair}
    assert decayed == {"fe.conv2.u", "fe.conv2.v", "fe.fc1.u", "fe.fc1.v"}
    assert all(np.array_equal(after[k], fe[k]) for k in fe if k not in decayed)
    assert all(np.array_equal(trainer.get_head()[k], head[k]) for k in head)


def test_an_epoch_ends_with_one_decay_step_of_lr_times_its_step_count(artifact_dir):
    x, y = _data(10)  # batch 4: 3 steps
    with_decay, without = DeviceTrainer(artifact_dir), DeviceTrainer(artifact_dir)
    result = with_decay.train(x, y, rng=np.random.default_rng(0), **{**TRAIN, "mu": 0.5})
    without.train(x, y, rng=np.random.default_rng(0), **{**TRAIN, "mu": 0.0})
    without.decay_factors(0.5, TRAIN["lr"] * result.steps)
    assert result.steps == 3
    for name, value in with_decay.get_fe().items():
        np.testing.assert_array_equal(value, without.get_fe()[name])


def test_train_rejects_a_negative_mu(trainer):
    x, y = _data(4)
    with pytest.raises(ValueError, match="mu must be >= 0"):
        trainer.train(x, y, rng=np.random.default_rng(0), **{**TRAIN, "mu": -1.0})


# parameter groups (FedRep trains its head, then its FE)

def _perturbed(trainer: DeviceTrainer, seed: int = 4) -> None:
    """Weights unlike the artifact's initial ones, so a group left alone by mistake cannot pass by chance."""
    rng = np.random.default_rng(seed)
    trainer.set_fe({k: v + 0.01 * rng.standard_normal(v.shape).astype(np.float32) for k, v in trainer.get_fe().items()})
    trainer.set_head({k: v + 0.01 * rng.standard_normal(v.shape).astype(np.float32)
                      for k, v in trainer.get_head().items()})


def _device_and_reference(artifact_dir, model_and_ranks) -> tuple[DeviceTrainer, TorchTrainer]:
    """A perturbed device trainer and the PyTorch reference holding the same tensors."""
    model, ranks = model_and_ranks
    device = DeviceTrainer(artifact_dir)
    _perturbed(device)
    reference = TorchTrainer(factorize_model(model, ranks))
    reference.set_fe(device.get_fe())
    reference.set_head(device.get_head())
    return device, reference


def test_a_head_only_step_leaves_the_fe_bit_identical_and_matches_pytorch(artifact_dir, model_and_ranks):
    device, reference = _device_and_reference(artifact_dir, model_and_ranks)
    fe, head = device.get_fe(), device.get_head()
    x, y = _data(10)
    settings = {**TRAIN, "mu": 0.5, "epochs": 2}  # a decay step on the factors would show: the head phase has none
    result = device.train(x, y, rng=np.random.default_rng(0), params="head", **settings)
    expected = reference.train(x, y, rng=np.random.default_rng(0), params="head", **settings)
    assert result.steps == expected.steps == 6
    for name, value in device.get_fe().items():
        np.testing.assert_array_equal(value, fe[name], err_msg=name)
    trained = device.get_head()
    assert not np.array_equal(trained["head.weight"], head["head.weight"])
    for name, value in reference.get_head().items():
        np.testing.assert_allclose(trained[name], value, atol=1e-6, err_msg=name)
    assert result.loss == pytest.approx(expected.loss, abs=1e-5)


def test_an_fe_only_step_leaves_the_head_bit_identical_and_matches_pytorch(artifact_dir, model_and_ranks):
    device, reference = _device_and_reference(artifact_dir, model_and_ranks)
    fe, head = device.get_fe(), device.get_head()
    x, y = _data(10)
    device.train(x, y, rng=np.random.default_rng(0), params="fe", **{**TRAIN, "mu": 0.5})
    reference.train(x, y, rng=np.random.default_rng(0), params="fe", **{**TRAIN, "mu": 0.5})
    for name, value in device.get_head().items():
        np.testing.assert_array_equal(value, head[name], err_msg=name)
    trained, expected = device.get_fe(), reference.get_fe()
    assert all(not np.array_equal(trained[k], fe[k]) for k in fe)
    for name, value in expected.items():
        np.testing.assert_allclose(trained[name], value, atol=1e-5, err_msg=name)


def test_train_rejects_an_unknown_parameter_group(trainer):
    x, y = _data(4)
    with pytest.raises(ValueError, match="params must be one of"):
        trainer.train(x, y, rng=np.random.default_rng(0), params="bias", **TRAIN)
