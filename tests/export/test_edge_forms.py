"""The step compiler covers real edge models (issue 42): each form passes the parity gate at two batch sizes with
a batch axis left free, BatchNorm's running statistics are step state that follows PyTorch's over many steps, and
what it cannot take (random ops, BatchNorm with momentum=None, ConvTranspose) is refused in one line naming the
layer. Compiles take seconds to a minute each: slow-marked, cached by the shared artifact cache."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from device_runtime.artifact_contract import BATCH_DIM, PORTABLE_KIND, TRAINING_KIND, next_name
from device_runtime.portable_trainer import PortableTrainer
from export import step_compiler
from export.artifacts import artifact_config, build_artifacts_of_kind, config_hash
from fedcore.lowrank import factorize_model
from fedcore.models import SplitModel, build_model
from fedcore.tensors import UnsupportedModel, carried_tensors, state_names
from server.training import train_local
from tests.support.edge_models import conv1d_net, ds_cnn, resnet8, tiny_transformer

FORMS = {
    # name: (model factory, per-sample shape, ranks of the client)
    "ds_cnn_bn_depthwise_global_pool": (ds_cnn, (1, 12, 10), {}),
    "depthwise_stride_2": (lambda input_shape: ds_cnn(input_shape, dw_stride=2), (1, 12, 10), {}),
    "resnet8_bn_residual": (resnet8, (1, 8, 8), {}),
    "transformer_attention_layernorm_gelu": (tiny_transformer, (6, 5), {}),
    "conv1d_bn1d_relu6_hardswish_silu": (conv1d_net, (3, 16), {}),
    # rank 2 < GEMM_CONV_MIN_CHANNELS behind an input of 8 channels: the non-GEMM weight gradient whose int() of
    # the batch fixed it to the trace's (the zoo at --rank-ratio 0.04)
    "factorized_conv2d_rank_below_8": (resnet8, (1, 8, 8), {"fe.block2.conv2": 2}),
    "factorized_conv1d": (conv1d_net, (3, 16), {"fe.conv2": 3}),
    # a 0-d parameter: stays 0-d in the initial weights, the graphs and the device's store
    "scalar_parameter": (lambda input_shape: _scaled(input_shape), (6,), {}),
    # an adaptive average pool to 2×2 (not global) after a convolution by patches: AveragePool, Resize backward
    "adaptive_avg_pool_2x2": (lambda input_shape: _pooled(input_shape), (8, 6, 4), {}),
    # token ids (float32) through nn.Embedding: Cast and Gather forward, a scatter-add backward (repeated ids)
    "embedding_of_token_ids": (lambda input_shape: _tokens(input_shape), (9,), {}),
    # BatchNorm1d over (batch, features): the statistics form reduces over the batch axis alone
    "batchnorm1d_on_features": (lambda input_shape: _normed_features(input_shape), (6,), {}),
    # a BatchNorm without affine parameters: torch's decomposition, not the statistics form
    "batchnorm2d_without_affine": (lambda input_shape: _plain_normed(input_shape), (2, 6, 6), {}),
    # same-padded convolutions (input gradient by the flipped kernel): 5×5 behind 4 channels (not the GEMM form),
    # a rectangular 3×5 and a 1×1 (the GEMM form), on an odd-sized input
    "same_padded_convs": (lambda input_shape: _same_padded(input_shape), (2, 7, 6), {}),
    "same_padded_convs_factorized": (lambda input_shape: _same_padded(input_shape), (2, 7, 6), {"fe.4": 3}),
}
STATS_STEPS = 6
STATS_ATOL = 1e-5


class _Scaled(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, 8)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return torch.tanh(self.fc(x)) * self.scale


def _scaled(input_shape) -> SplitModel:
    torch.manual_seed(0)
    return SplitModel("scaled", _Scaled(input_shape[0]), 8, 4)


def _pooled(input_shape) -> SplitModel:
    torch.manual_seed(0)
    fe = nn.Sequential(nn.Conv2d(input_shape[0], 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten())
    return SplitModel("pooled", fe, 32, 3)


def _normed_features(input_shape) -> SplitModel:
    torch.manual_seed(0)
    fe = nn.Sequential(nn.Linear(input_shape[0], 8), nn.BatchNorm1d(8), nn.ReLU())
    return SplitModel("normed_features", fe, 8, 3)


def _plain_normed(input_shape) -> SplitModel:
    torch.manual_seed(0)
    fe = nn.Sequential(nn.Conv2d(input_shape[0], 8, 3), nn.BatchNorm2d(8, affine=False), nn.ReLU(),
                       nn.AdaptiveAvgPool2d(1), nn.Flatten())
    return SplitModel("plain_normed", fe, 8, 3)


def _same_padded(input_shape) -> SplitModel:
    torch.manual_seed(0)
    fe = nn.Sequential(nn.Conv2d(input_shape[0], 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 8, 5, padding=2),
                       nn.ReLU(), nn.Conv2d(8, 8, (3, 5), padding=(1, 2)), nn.ReLU(), nn.Conv2d(8, 8, 1), nn.ReLU(),
                       nn.AdaptiveAvgPool2d(1), nn.Flatten())
    return SplitModel("same_padded", fe, 8, 3)


def _tokens(input_shape) -> SplitModel:
    return build_model("examples/token_classifier.py:build", input_shape, 3, seed=0)


@pytest.fixture(scope="module")
def cache(shared_artifact_cache):
    return shared_artifact_cache


def _built(form: str, cache):
    factory, shape, ranks = FORMS[form]
    model = factory(input_shape=shape)
    built = build_artifacts_of_kind(PORTABLE_KIND, model, ranks, shape, model.num_classes, cache)
    return model, factorize_model(model, ranks), shape, built


@pytest.mark.slow
@pytest.mark.parametrize("form", tuple(FORMS))
def test_each_form_passes_parity_at_two_batch_sizes_with_a_free_batch_axis(form, cache):
    model, client, shape, built = _built(form, cache)  # published only after its parity check
    assert len(set(step_compiler.parity_batches(client, shape, model.num_classes))) == 2
    for key in ("step_model", "eval_model"):
        graph = onnx.load(built.files[key])
        assert graph.graph.input[0].type.tensor_type.shape.dim[0].dim_param == BATCH_DIM
        assert graph.graph.output[1].type.tensor_type.shape.dim[0].dim_param == BATCH_DIM
    # a third batch size, neither of the gate's: the step runs and keeps the tensors' shapes
    trainer = PortableTrainer(built.directory)
    x = np.random.default_rng(0).standard_normal((3, *shape)).astype(np.float32)
    y = np.array([0, 1, 2], np.int64)
    result = trainer.train(x, y, anchors=None, mask=None, lam=0.0, mu=0.0, lr=0.05, epochs=1, batch_size=3,
                           rng=np.random.default_rng(0))
    assert result.steps == 1 and np.isfinite(result.loss)
    assert {k: v.shape for k, v in trainer.get_fe().items()} == built.fe_shapes  # 0-d ones too


def test_the_dynamic_batch_check_refuses_a_graph_whose_batch_is_fixed():
    model = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["input"], ["logits"])], "g",
        [onnx.helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, [5, 3])],
        [onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [5, 3])]))
    with pytest.raises(step_compiler.ParityError, match="fixed batch axis"):
        step_compiler.check_dynamic_batch(model)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["ds_cnn_bn_depthwise_global_pool", "conv1d_bn1d_relu6_hardswish_silu"])
def test_batchnorm_running_statistics_after_k_steps_equal_pytorchs(form, cache):
    model, client, shape, built = _built(form, cache)
    trainer = PortableTrainer(built.directory)
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((STATS_STEPS * 4, *shape)) * 2 + 0.5).astype(np.float32)
    y = rng.integers(0, model.num_classes, len(x)).astype(np.int64)
    settings = dict(anchors=None, mask=None, lam=0.0, mu=0.0, lr=0.05, epochs=1, batch_size=4)
    reference = factorize_model(model, {})
    train_local(reference, x, y, rng=np.random.default_rng(2), **settings)
    trainer.train(x, y, rng=np.random.default_rng(2), **settings)
    state = state_names(reference)
    assert state and all(".running_" in name for name in state)
    expected = carried_tensors(reference)
    got = trainer.get_fe()
    moved = max(float((expected[n] - carried_tensors(model)[n]).abs().max()) for n in state)
    assert moved > 0.1  # the statistics did move, so equality below says something
    assert max(float(np.abs(expected[n].numpy() - got[n]).max()) for n in state) <= STATS_ATOL
    assert max(float(np.abs(expected[n].numpy() - got[n]).max()) for n in got) <= STATS_ATOL


@pytest.mark.slow
def test_batchnorm_statistics_follow_the_step_while_only_the_head_trains(cache):
    model, client, shape, built = _built("ds_cnn_bn_depthwise_global_pool", cache)
    trainer = PortableTrainer(built.directory)
    x = np.random.default_rng(3).standard_normal((8, *shape)).astype(np.float32) + 1.0
    y = np.arange(8, dtype=np.int64) % model.num_classes
    settings = dict(anchors=None, mask=None, lam=0.0, mu=0.0, lr=0.05, epochs=1, batch_size=4)
    reference = factorize_model(model, {})
    train_local(reference, x, y, rng=np.random.default_rng(0), params=list(reference.head.parameters()), **settings)
    trainer.train(x, y, rng=np.random.default_rng(0), params="head", **settings)
    got = trainer.get_fe()
    for name, value in carried_tensors(reference).items():
        if name in got:
            assert np.abs(value.numpy() - got[name]).max() <= STATS_ATOL, name


def test_the_step_graph_takes_running_statistics_as_inputs_and_gives_them_back():
    model = ds_cnn()
    names = set(carried_tensors(model))
    assert "fe.bn1.running_mean" in names and "fe.bn1.num_batches_tracked" not in names
    assert set(state_names(model)) == {f"fe.bn{i}.running_{s}" for i in (1, 2, 3) for s in ("mean", "var")}
    assert next_name("fe.bn1.running_mean") == "fe.bn1.running_mean.next"


class _Dropping(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(torch.relu(self.fc(x.flatten(1))))


def test_dropout_is_refused_in_one_line_naming_the_layer():
    model = SplitModel("dropping", _Dropping(), 6, 3)
    with pytest.raises(UnsupportedModel) as refused:
        step_compiler.compile_step(model, (2, 3), 3, 6)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("fe.drop: ") and "Dropout(p=0)" in message


def test_batchnorm_with_momentum_none_is_refused_in_one_line():
    model = ds_cnn()
    model.fe.bn2.momentum = None
    with pytest.raises(UnsupportedModel, match=r"^fe\.bn2: BatchNorm2d with momentum=None .* momentum=0\.1$"):
        step_compiler.compile_step(model, (1, 12, 10), 4, 16)


def test_a_transposed_convolution_is_refused_in_one_line():
    fe = nn.Sequential(nn.ConvTranspose2d(1, 2, 2), nn.Flatten())
    with pytest.raises(UnsupportedModel, match="ConvTranspose"):
        step_compiler.compile_step(SplitModel("up", fe, 2 * 5 * 5, 3), (1, 4, 4), 3, 50)


def test_the_training_kind_refuses_a_model_with_step_state(tmp_path):
    model = ds_cnn()
    with pytest.raises(UnsupportedModel, match="onnxruntime kind"):
        build_artifacts_of_kind(TRAINING_KIND, model, {}, (1, 12, 10), 4, tmp_path)


def test_two_models_differing_only_in_an_activation_get_different_artifact_hashes():
    hashes = {config_hash(artifact_config(ds_cnn(act=act), {}, (1, 12, 10), 4, PORTABLE_KIND))
              for act in (nn.ReLU, nn.GELU)}
    assert len(hashes) == 2


def test_a_new_batchnorm_form_changes_the_hash_of_models_with_batchnorm_only(monkeypatch):
    models = {"bn": (ds_cnn(), (1, 12, 10)), "transformer": (tiny_transformer((6, 5)), (6, 5)),
              "zoo": (build_model("cnn1", (1, 28, 28), 10, seed=0), (1, 28, 28))}

    def hashes():
        return {k: config_hash(artifact_config(m, {}, shape, m.num_classes, PORTABLE_KIND))
                for k, (m, shape) in models.items()}

    before = hashes()
    monkeypatch.setattr(step_compiler, "BATCH_NORM_FORM_VERSION", step_compiler.BATCH_NORM_FORM_VERSION + 1)
    after = hashes()
    assert after["bn"] != before["bn"]
    assert after["transformer"] == before["transformer"] and after["zoo"] == before["zoo"]


def test_a_new_same_padded_form_changes_the_hash_of_models_with_same_padded_convolutions_only(monkeypatch):
    torch.manual_seed(0)
    unpadded_conv1d = SplitModel("unpadded_conv1d", nn.Sequential(  # factorized: a 1-wide half, same-padded
        nn.Conv1d(3, 8, 3), nn.ReLU(), nn.Conv1d(8, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten()), 8, 3)
    models = {"resnet8": (resnet8((1, 8, 8)), (1, 8, 8)), "conv1d": (unpadded_conv1d, (3, 16)),
              "transformer": (tiny_transformer((6, 5)), (6, 5)),
              **{name: (build_model(name, (1, 28, 28), 10, seed=0), (1, 28, 28)) for name in ("fedavgcnn", "cnn1")}}

    def hashes():
        return {k: config_hash(artifact_config(m, {}, shape, m.num_classes, PORTABLE_KIND))
                for k, (m, shape) in models.items()}

    before = hashes()
    monkeypatch.setattr(step_compiler, "SAME_PADDED_FORM_VERSION", step_compiler.SAME_PADDED_FORM_VERSION + 1)
    after = hashes()
    assert after["resnet8"] != before["resnet8"] and after["conv1d"] != before["conv1d"]
    assert all(after[k] == before[k] for k in ("transformer", "fedavgcnn", "cnn1"))


@pytest.mark.slow
def test_a_same_padded_convolutions_input_gradient_is_a_conv_not_col2im(cache):
    _, _, _, built = _built("same_padded_convs", cache)
    ops = [node.op_type for node in onnx.load(built.files["step_model"]).graph.node]
    assert "Col2Im" not in ops and "ConvTranspose" not in ops  # before: the 3×5's and 1×1's, and the 5×5's


def test_retrained_weights_keep_the_artifact_hash():
    hashes = {config_hash(artifact_config(ds_cnn(seed=seed), {}, (1, 12, 10), 4, PORTABLE_KIND))
              for seed in (0, 1)}
    assert len(hashes) == 1


class _Bessel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        return torch.special.i0(self.fc(x.flatten(1)))


def test_an_op_without_onnx_translation_is_refused_in_one_line_naming_op_and_layer():
    fe = nn.Sequential()
    fe.add_module("odd", _Bessel())
    with pytest.raises(UnsupportedModel) as refused:
        step_compiler.compile_step(SplitModel("odd", fe, 6, 3), (2, 3), 3, 6)
    assert str(refused.value).startswith("fe.odd: the op prims.bessel_i0 has no ONNX translation")
    assert "\n" not in str(refused.value)


@pytest.mark.slow
def test_the_zoo_at_rank_ratio_0_04_keeps_a_free_batch_axis(cache):
    from fedcore.lowrank import RankPlan, resolve_plan
    from fedcore.models import build_model

    model = build_model("fedavgcnn", (1, 28, 28), 10, seed=0)
    ranks = resolve_plan(model, RankPlan(0.04)).ranks
    assert min(ranks.values()) < step_compiler.GEMM_CONV_MIN_CHANNELS
    built = build_artifacts_of_kind(PORTABLE_KIND, model, ranks, (1, 28, 28), 10, cache)  # parity at 2 batches
    step = onnx.load(built.files["step_model"])
    assert step.graph.input[0].type.tensor_type.shape.dim[0].dim_param == BATCH_DIM
