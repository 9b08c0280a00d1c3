"""--bn-stats: BatchNorm running statistics personal to each device (FedBN) or shared and averaged with the FE
(FedAvg-BN); the batch counter is never federated."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn

from device_runtime.local_round import load_weights, returned_weights
from fedcore.models import SplitModel
from server.algorithms import REGISTRY
from server.algorithms.base import Settings
from server.run_setup import personal_names
from server.torch_trainer import TorchTrainer

STATS = {"fe.bn.running_mean", "fe.bn.running_var"}


def bn_model() -> SplitModel:
    torch.manual_seed(0)
    fe = nn.Sequential(OrderedDict([("fc", nn.Linear(5, 4)), ("bn", nn.BatchNorm1d(4)), ("relu", nn.ReLU())]))
    return SplitModel("bn", fe, 4, 3)


def algorithm(name: str, bn_stats: str, model: SplitModel):
    built = REGISTRY[name].from_settings(Settings(1, 0.0, 0, 0.0))
    built.keep_personal(personal_names(model, bn_stats))
    return built


@pytest.mark.parametrize("name", ["fedara", "fedrep", "fedavg"])
def test_personal_statistics_stay_out_of_the_global_model_and_the_updates(name):
    model = bn_model()
    chosen = algorithm(name, "personal", model)
    state = model.state_dict()
    shapes = {k: tuple(v.shape) for k, v in state.items() if k.startswith("fe.") and "num_batches" not in k}
    shared = chosen.global_tensors(state)
    assert not STATS & set(shared) and "fe.bn.num_batches_tracked" not in shared
    assert STATS <= set(chosen.personal_tensors(state))
    assert not STATS & set(chosen.update_shapes(shapes, {}))
    assert {"fe.bn.weight", "fe.bn.bias"} <= set(chosen.global_tensors(state))


def test_shared_statistics_are_global_and_the_counter_is_nowhere():
    model = bn_model()
    chosen = algorithm("fedara", "shared", model)
    state = model.state_dict()
    assert STATS <= set(chosen.global_tensors(state))
    assert not any("num_batches" in k for k in {**chosen.global_tensors(state), **chosen.personal_tensors(state)})


def trained_trainer() -> TorchTrainer:
    trainer = TorchTrainer(bn_model())
    x = np.random.default_rng(0).normal(2.0, 1.0, (32, 5)).astype(np.float32)
    trainer.train(x, np.arange(32) % 3, anchors=None, mask=None, lam=0.0, mu=0.0, lr=0.1, epochs=1, batch_size=8,
                  rng=np.random.default_rng(0))
    return trainer


def test_a_task_without_statistics_leaves_the_devices_own_and_gets_none_back():
    trainer = trained_trainer()
    own = {k: v for k, v in trainer.get_fe().items() if k in STATS}
    received = {k: np.zeros_like(v) for k, v in trainer.get_fe().items() if k not in STATS}
    load_weights(trainer, received)
    held = trainer.get_fe()
    assert all(np.array_equal(held[k], own[k]) for k in STATS) and not held["fe.fc.weight"].any()
    assert set(returned_weights(trainer, "fe", received)) == set(received)


def test_a_task_with_statistics_overwrites_them_and_gets_them_back():
    trainer = trained_trainer()
    received = {k: np.full_like(v, 0.5) for k, v in trainer.get_fe().items()}
    load_weights(trainer, received)
    assert np.array_equal(trainer.get_fe()["fe.bn.running_var"], received["fe.bn.running_var"])
    assert STATS <= set(returned_weights(trainer, "fe", received))


def test_the_batch_counter_is_no_trainer_tensor():
    assert not any("num_batches" in k for k in TorchTrainer(bn_model()).fe_names)


@pytest.fixture(scope="module")
def compiled_ds_cnn(tmp_path_factory):
    """A tiny DS-CNN with BatchNorm and its portable step graph, compiled once for the tests below."""
    from device_runtime.artifact_contract import PORTABLE_KIND
    from export.artifacts import build_artifacts_of_kind
    from tests.support.edge_models import ds_cnn

    model = ds_cnn()
    return model, build_artifacts_of_kind(PORTABLE_KIND, model, {}, (1, 12, 10), 4, tmp_path_factory.mktemp("art"))


@pytest.mark.slow
@pytest.mark.parametrize("params", ["head", "fe", "all"])
def test_the_portable_device_and_pytorch_agree_on_batchnorm_statistics_in_every_phase(compiled_ds_cnn, params):
    from copy import deepcopy

    from device_runtime.runtimes import open_trainer

    model, built = compiled_ds_cnn
    device, reference = open_trainer(built.directory, threads=1), TorchTrainer(deepcopy(model))
    x = np.random.default_rng(1).normal(size=(24, 1, 12, 10)).astype(np.float32)
    y = np.arange(24) % 4
    for trainer in (device, reference):
        trainer.train(x, y, anchors=None, mask=None, lam=0.0, mu=0.0, lr=0.05, epochs=1, batch_size=8,
                      rng=np.random.default_rng(0), params=params)
    held, expected = device.get_fe(), reference.get_fe()
    statistics = [k for k in expected if k.endswith(("running_mean", "running_var"))]
    assert statistics and all(np.allclose(held[k], expected[k], atol=1e-5) for k in statistics)
