"""The parity gate's tolerance is a float32 error bound (export.step_compiler.parity_tolerance): it grows with the
step's accumulated reduction length and the output's magnitude, passes a deep BatchNorm model whose two runtimes
differ only by rounding and kink flips, and still refuses real mistranslations (a gradient of the wrong sign, a
BatchNorm compiled in inference mode)."""
from __future__ import annotations

import contextlib

import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from device_runtime.artifact_contract import PORTABLE_KIND
from export import step_compiler
from export.artifacts import build_artifacts_of_kind, inference_session
from fedcore.lowrank import factorize_model, resolve_plan
from fedcore.models import SplitModel, build_model, rank_plan
from tests.support.step_edits import scaled_gradient

RESNET8 = "examples/resnet8.py:build"
SHAPE, CLASSES, RATIO = (1, 28, 28), 10, 0.5
SEEDS = range(6)  # seeds 1, 3 and 5 flip a ReLU near its kink: 1.1e-5 to 6.4e-5, beyond the old fixed 1e-5


def _client(seed: int) -> SplitModel:
    model = build_model(RESNET8, SHAPE, CLASSES, seed=seed)
    return factorize_model(model, resolve_plan(model, rank_plan(model, RATIO)).ranks)


@pytest.fixture(scope="module")
def resnet8_graphs(shared_artifact_cache):
    """ResNet-8's step and eval graphs at rank ratio 0.5 (weights are inputs: one graph serves every seed)."""
    model = build_model(RESNET8, SHAPE, CLASSES, seed=0)
    built = build_artifacts_of_kind(PORTABLE_KIND, model, resolve_plan(model, rank_plan(model, RATIO)).ranks, SHAPE,
                                    CLASSES, shared_artifact_cache)
    return onnx.load(built.files["step_model"]), onnx.load(built.files["eval_model"])


def _check(client: SplitModel, step: onnx.ModelProto, evaluate: onnx.ModelProto) -> float:
    return step_compiler.check_parity(client, step, evaluate, SHAPE, CLASSES, client.feature_dim, inference_session)


def test_gamma_is_highams_n_u_over_one_minus_n_u_and_refuses_lengths_float32_cannot_bound():
    assert step_compiler.gamma(1000) == pytest.approx(1000 * 2.0 ** -24 / (1 - 1000 * 2.0 ** -24))
    with pytest.raises(ValueError, match="beyond float32"):
        step_compiler.gamma(2 ** 24)


def test_the_tolerance_grows_with_reduction_length_and_magnitude():
    base = step_compiler.parity_tolerance(1000, 1.0)
    assert step_compiler.parity_tolerance(4000, 1.0) > base < step_compiler.parity_tolerance(1000, 3.0)
    assert step_compiler.parity_tolerance(1000, 0.0) == step_compiler.PARITY_ATOL


def test_the_reduction_length_of_a_linear_model_is_its_inner_sizes():
    torch.manual_seed(0)
    model = SplitModel("mlp", nn.Sequential(nn.Linear(7, 5), nn.ReLU()), 5, 3)
    data = step_compiler.example_inputs((7,), 3, 5, 4, 0)
    forward, step = step_compiler.reduction_lengths(model, data)
    assert forward == 7 + 5  # the two layers' inner sizes
    assert step > 2 * forward  # the backward adds the weight gradients' batch sums and the loss's reductions


@pytest.mark.slow
def test_resnet8_at_rank_ratio_half_passes_for_several_seeds(resnet8_graphs):
    for seed in SEEDS:
        assert _check(_client(seed), *resnet8_graphs) < 1e-3


@pytest.mark.slow
def test_a_bias_update_of_the_wrong_sign_in_a_deep_layer_is_refused(resnet8_graphs):
    step, evaluate = resnet8_graphs
    with pytest.raises(step_compiler.ParityError, match="fe.5.bn1.bias.next"):
        _check(_client(0), scaled_gradient(step, "fe.5.bn1.bias", -1.0), evaluate)


@contextlib.contextmanager
def _batchnorm_in_inference_mode():
    """Every BatchNorm forward normalizes by its running statistics, as an inference-mode export would (the step
    compiler's own training form, ``_batch_norms_by_statistics``, left out so the traced module is that one)."""
    original, by_statistics = nn.modules.batchnorm._BatchNorm.forward, step_compiler._batch_norms_by_statistics

    def inference(self, x):
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)

    nn.modules.batchnorm._BatchNorm.forward = inference
    step_compiler._batch_norms_by_statistics = lambda model: model
    try:
        yield
    finally:
        nn.modules.batchnorm._BatchNorm.forward = original
        step_compiler._batch_norms_by_statistics = by_statistics


@pytest.mark.slow
def test_a_training_step_compiled_with_inference_mode_batchnorm_is_refused():
    torch.manual_seed(0)
    model = SplitModel("bn", nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                           nn.Flatten()), 4, 3)
    step, evaluate = step_compiler.compile_step(model, (1, 6, 6), 3, 4)
    step_compiler.check_parity(model, step, evaluate, (1, 6, 6), 3, 4, inference_session)  # the right one passes
    with _batchnorm_in_inference_mode():
        step, evaluate = step_compiler.compile_step(model, (1, 6, 6), 3, 4)
    with pytest.raises(step_compiler.ParityError, match="float32 bound"):
        step_compiler.check_parity(model, step, evaluate, (1, 6, 6), 3, 4, inference_session)
