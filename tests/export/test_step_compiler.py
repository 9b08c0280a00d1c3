"""The portable step graph: plain default-domain ONNX, one step equal to PyTorch's for every model, gated on
parity before it is published, cached by a hash that covers the compiler, and equal to the training API's
trajectory over many steps."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from device_runtime.artifact_contract import ARTIFACT_FILES_BY_KIND, PORTABLE_KIND, TRAINING_KIND
from device_runtime.portable_trainer import PortableTrainer
from device_runtime.trainer import DeviceTrainer
from export import step_compiler
from export.artifacts import artifact_config, build_artifacts_of_kind, config_hash, inference_session
from fedcore.lowrank import RankPlan, factorize_model, fe_state, resolve_plan
from fedcore.models import ARCHITECTURES, build_model
from server.training import train_local
from tests.support.step_edits import scaled_gradient

SHAPE, CLASSES = (1, 28, 28), 10
STEP_ATOL = 1e-5
LONG_STEPS = 50


@pytest.fixture(scope="module")
def cache(shared_artifact_cache):
    return shared_artifact_cache


@pytest.fixture(scope="module")
def fedavgcnn():
    return build_model("fedavgcnn", SHAPE, CLASSES, seed=0)


def _batch(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    return rng.standard_normal((n, *SHAPE)).astype(np.float32), rng.integers(0, CLASSES, n).astype(np.int64)


def _weights(reference) -> tuple[dict, dict]:
    fe = {k: v.numpy().copy() for k, v in fe_state(reference).items()}
    head = {k: v.detach().numpy().copy() for k, v in reference.head.state_dict(prefix="head.").items()}
    return fe, head


@pytest.mark.slow
@pytest.mark.parametrize("ratio", [1.0, 0.5])
@pytest.mark.parametrize("name", tuple(ARCHITECTURES))
def test_one_portable_step_equals_pytorch_for_every_model(name, ratio, cache):
    model = build_model(name, SHAPE, CLASSES, seed=0)
    ranks = resolve_plan(model, RankPlan(ratio)).ranks
    reference = factorize_model(model, ranks)
    trainer = PortableTrainer(build_artifacts_of_kind(PORTABLE_KIND, model, ranks, SHAPE, CLASSES, cache).directory)
    fe, head = _weights(reference)
    trainer.set_fe(fe)
    trainer.set_head(head)
    x, y = _batch(np.random.default_rng(4), 12)
    anchors, mask = trainer.compute_anchors(x, y)
    settings = dict(anchors=anchors, mask=mask, lam=2.0, mu=0.0, lr=0.05, epochs=1, batch_size=12)
    train_local(reference, x, y, rng=np.random.default_rng(0), **settings)
    trainer.train(x, y, rng=np.random.default_rng(0), **settings)
    expected = reference.state_dict()
    got = {**trainer.get_fe(), **trainer.get_head()}
    assert max(float(np.abs(expected[k].numpy() - v).max()) for k, v in got.items()) <= STEP_ATOL


def test_the_step_graph_holds_only_default_domain_ops_at_opset_18_ir_10(fedavgcnn, cache):
    built = build_artifacts_of_kind(PORTABLE_KIND, fedavgcnn, {}, SHAPE, CLASSES, cache)
    step = onnx.load(built.files["step_model"])
    assert {n.domain for n in step.graph.node} <= {""}
    assert [(o.domain, o.version) for o in step.opset_import] == [("", 18)]
    assert step.ir_version <= 10  # onnxruntime 1.17+ loads it
    assert step.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"


def test_the_manifest_names_its_kind_and_files(fedavgcnn, cache):
    built = build_artifacts_of_kind(PORTABLE_KIND, fedavgcnn, {}, SHAPE, CLASSES, cache)
    assert built.kind == PORTABLE_KIND
    assert set(built.files) == set(ARTIFACT_FILES_BY_KIND[PORTABLE_KIND])


@pytest.mark.slow
def test_the_parity_gate_refuses_a_step_whose_gradient_is_doubled(fedavgcnn):
    step, evaluate = step_compiler.compile_step(fedavgcnn, SHAPE, CLASSES, fedavgcnn.feature_dim)
    session = inference_session
    step_compiler.check_parity(fedavgcnn, step, evaluate, SHAPE, CLASSES, fedavgcnn.feature_dim, session)
    with pytest.raises(step_compiler.ParityError, match="head.weight.next"):
        step_compiler.check_parity(fedavgcnn, scaled_gradient(step, "head.weight", 2.0), evaluate, SHAPE, CLASSES,
                                   fedavgcnn.feature_dim, session)


@pytest.mark.slow
def test_a_set_that_fails_its_parity_gate_is_not_published(fedavgcnn, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise step_compiler.ParityError("differs")

    monkeypatch.setattr(step_compiler, "check_parity", refuse)
    with pytest.raises(step_compiler.ParityError):
        build_artifacts_of_kind(PORTABLE_KIND, fedavgcnn, {}, SHAPE, CLASSES, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_cached_set_is_reused_without_compiling(fedavgcnn, cache, monkeypatch):
    first = build_artifacts_of_kind(PORTABLE_KIND, fedavgcnn, {}, SHAPE, CLASSES, cache)
    monkeypatch.setattr(step_compiler, "compile_step", lambda *a, **k: pytest.fail("recompiled a cached set"))
    assert build_artifacts_of_kind(PORTABLE_KIND, fedavgcnn, {}, SHAPE, CLASSES, cache).hash == first.hash


@pytest.mark.parametrize("key, value", [("COMPILER_VERSION", 999), ("OPSET", 19)])
def test_the_hash_covers_the_compiler(fedavgcnn, monkeypatch, key, value):
    before = config_hash(artifact_config(fedavgcnn, {}, SHAPE, CLASSES, PORTABLE_KIND))
    monkeypatch.setattr(step_compiler, key, value)
    assert config_hash(artifact_config(fedavgcnn, {}, SHAPE, CLASSES, PORTABLE_KIND)) != before


def test_the_hash_covers_the_exporter_versions(fedavgcnn):
    versions = artifact_config(fedavgcnn, {}, SHAPE, CLASSES, PORTABLE_KIND)["versions"]
    assert {"torch", "onnx", "onnxscript", "compiler"} <= set(versions)


def test_the_two_kinds_have_different_hashes(fedavgcnn):
    assert (config_hash(artifact_config(fedavgcnn, {}, SHAPE, CLASSES, PORTABLE_KIND))
            != config_hash(artifact_config(fedavgcnn, {}, SHAPE, CLASSES, TRAINING_KIND)))


def test_portable_and_training_runtimes_stay_together_over_many_steps(fedavgcnn, cache):
    ranks = resolve_plan(fedavgcnn, RankPlan(0.5)).ranks
    portable = PortableTrainer(build_artifacts_of_kind(PORTABLE_KIND, fedavgcnn, ranks, SHAPE, CLASSES,
                                                       cache).directory)
    training = DeviceTrainer(build_artifacts_of_kind(TRAINING_KIND, fedavgcnn, ranks, SHAPE, CLASSES,
                                                     cache).directory)
    training.set_fe(portable.get_fe())
    training.set_head(portable.get_head())
    x, y = _batch(np.random.default_rng(7), 40)
    anchors, mask = portable.compute_anchors(x, y)
    settings = dict(anchors=anchors, mask=mask, lam=2.0, mu=1e-3, lr=0.05, epochs=LONG_STEPS // 5, batch_size=8)
    results = [t.train(x, y, rng=np.random.default_rng(1), **settings) for t in (portable, training)]
    assert results[0].steps == results[1].steps >= LONG_STEPS
    a, b = ({**t.get_fe(), **t.get_head()} for t in (portable, training))
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) <= STEP_ATOL


@pytest.mark.parametrize("shape", [(2, 3, 8, 8), (1, 2, 6, 4)])
def test_the_pool_backward_without_indices_routes_ties_to_the_first_maximum_as_pytorch_does(shape):
    """Values from {0, 1, 2} tie in most 2×2 windows; the gradient must reach the first maximum (row-major) only."""
    import torch
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 3, shape, generator=g).float()
    grad = torch.randn(shape[0], shape[1], shape[2] // 2, shape[3] // 2, generator=g)
    _, indices = torch.ops.aten.max_pool2d_with_indices(x, [2, 2], [2, 2])
    expected = torch.ops.aten.max_pool2d_with_indices_backward(grad, x, [2, 2], [2, 2], [0, 0], [1, 1], False,
                                                                indices)
    got = step_compiler._max_pool2d_backward(grad, x, [2, 2], [2, 2], [0, 0], [1, 1], False, indices)
    assert torch.equal(got, expected)
    every_tie = (x == torch.nn.functional.interpolate(torch.max_pool2d(x, 2), scale_factor=2)).float()
    assert not torch.equal(every_tie * torch.nn.functional.interpolate(grad, scale_factor=2), expected)


@pytest.mark.slow
def test_the_parity_gate_refuses_a_pool_backward_that_feeds_every_tied_maximum(fedavgcnn, monkeypatch):
    """The gate's batch is blank in its upper half: equal maxima in pooling windows, which such a graph gets wrong."""
    def every_maximum(x, kernel):
        return x == step_compiler._upsample(step_compiler._max_pool(x, kernel), kernel)

    monkeypatch.setattr(step_compiler, "_first_maxima", every_maximum)
    step, evaluate = step_compiler.compile_step(fedavgcnn, SHAPE, CLASSES, fedavgcnn.feature_dim)
    with pytest.raises(step_compiler.ParityError):
        step_compiler.check_parity(fedavgcnn, step, evaluate, SHAPE, CLASSES, fedavgcnn.feature_dim,
                                   inference_session)


@pytest.mark.parametrize("kernel, stride, padding", [((5, 5), (1, 1), (0, 0)), ((3, 2), (2, 1), (1, 0)),
                                                     ((1, 5), (1, 2), (0, 2))])
def test_the_patches_are_the_unfolded_image_with_rows_n_y_x_and_columns_ky_kx_c(kernel, stride, padding):
    import torch
    x = torch.randn(3, 8, 9, 10, generator=torch.Generator().manual_seed(0))
    got, (oh, ow) = step_compiler._patches(x, kernel, stride, padding)
    unfolded = torch.nn.functional.unfold(x, kernel, padding=padding, stride=stride)  # (n, c·kh·kw, oh·ow)
    expected = (unfolded.reshape(3, 8, kernel[0] * kernel[1], oh * ow).permute(0, 3, 2, 1)
                .reshape(3 * oh * ow, kernel[0] * kernel[1] * 8))
    assert torch.equal(got, expected)


@pytest.mark.parametrize("stride, padding", [((1, 1), (0, 0)), ((2, 1), (1, 2))])
def test_a_convolution_by_patches_and_its_backward_agree_with_torch(stride, padding):
    """The GEMM forms of forward, dX, dW and db against aten's own convolution, within float32 rounding of
    sums of 8·3·3 = 72 products (|x|, |w| ~ 1: a relative 1e-5 is far above that bound)."""
    import torch
    aten = torch.ops.aten
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(2, 8, 11, 9, generator=g), torch.randn(6, 8, 3, 3, generator=g), torch.randn(6, generator=g)
    args = (list(stride), list(padding), [1, 1], False, [0, 0], 1)
    patches = step_compiler._Patches()
    y = step_compiler._convolution(x, w, b, *args, patches=patches)
    expected_y = aten.convolution(x, w, b, *args)
    grad = torch.randn(expected_y.shape, generator=g)
    got = step_compiler._convolution_backward(grad, x, w, [6], *args, [True, True, True], patches=patches)
    expected = aten.convolution_backward(grad, x, w, [6], *args, [True, True, True])
    for a, e in zip((y, *got), (expected_y, *expected)):
        assert a.shape == e.shape
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_a_convolution_of_few_input_channels_stays_a_conv():
    import torch
    few = step_compiler.GEMM_CONV_MIN_CHANNELS - 1
    x, w = torch.randn(2, few, 6, 6), torch.randn(4, few, 3, 3)
    assert step_compiler._convolution(x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                                      patches=step_compiler._Patches()) is NotImplemented


def test_relu_then_pool_is_compiled_as_pool_then_relu_in_a_copy(fedavgcnn):
    import torch
    traced = step_compiler._pool_before_relu(fedavgcnn)
    names = [n for n, _ in traced.fe.named_children()]
    assert names.index("pool1") < names.index("relu1") and names.index("pool2") < names.index("relu2")
    assert [n for n, _ in fedavgcnn.fe.named_children()][:3] == ["conv1", "relu1", "pool1"]  # model untouched
    x = torch.randn(4, *SHAPE)
    with torch.no_grad():
        assert torch.equal(traced(x), fedavgcnn(x))


@pytest.fixture(scope="module")
def compiled(fedavgcnn, cache):
    """The dense FedAvgCNN's step and eval graphs as the compiler published them (from the artifact cache)."""
    files = build_artifacts_of_kind(PORTABLE_KIND, fedavgcnn, {}, SHAPE, CLASSES, cache).files
    return onnx.load(str(files["step_model"])), onnx.load(str(files["eval_model"]))


def test_the_step_gathers_the_patches_of_each_gemm_convolution_once(compiled):
    """FedAvgCNN's conv2 (32 input channels) runs by patches; conv1 (one channel) stays a Conv. The weight
    gradient reuses the forward's patches: one Gather, not two. The eval graph (batch 64 on a device, no
    gradient to share patches with) keeps both Conv ops."""
    step, evaluate = compiled
    assert [n.op_type for n in step.graph.node].count("Gather") == 1
    assert [n.op_type for n in evaluate.graph.node].count("Gather") == 0
    assert [n.op_type for n in evaluate.graph.node].count("Conv") == 2


def test_no_matmul_of_the_step_reads_a_matrix_expanded_over_the_batch(compiled):
    step, _ = compiled
    producer = {out: n for n in step.graph.node for out in n.output}
    assert not [n.name for n in step.graph.node if n.op_type == "MatMul"
                and any(producer.get(i) is not None and producer[i].op_type == "Expand" for i in n.input)]


def test_every_node_of_the_compiled_graphs_feeds_an_output(compiled):
    for graph in (g.graph for g in compiled):
        read = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
        assert [n.name for n in graph.node if not any(o in read for o in n.output)] == []
        assert [t.name for t in graph.initializer if t.name not in read] == []


def test_a_linear_layer_is_computed_with_the_weight_on_the_left_and_the_same_values():
    import torch
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(16, 40, generator=g), torch.randn(30, 40, generator=g), torch.randn(30, generator=g)
    got = step_compiler._addmm(b, x, w.t())
    torch.testing.assert_close(got, torch.addmm(b, x, w.t()), rtol=1e-5, atol=1e-5)
    assert step_compiler._addmm(b, x, w.t().contiguous()) is NotImplemented  # not a transposed weight
    assert step_compiler._addmm(b, x, w.t(), beta=0.5) is NotImplemented


def test_a_product_with_a_wide_transposed_right_operand_is_computed_the_other_way_round():
    import torch
    g = torch.Generator().manual_seed(3)
    dz, v = torch.randn(16, 40, generator=g), torch.randn(800, 40, generator=g)
    got = step_compiler._mm(dz, v.t())  # a factorized Linear's input gradient dz·vᵀ
    torch.testing.assert_close(got, dz @ v.t(), rtol=1e-5, atol=1e-5)
    assert step_compiler._mm(dz, v.t().contiguous()) is NotImplemented  # not a transposed matrix
    assert step_compiler._mm(v, dz.t()) is NotImplemented  # 800 rows against 16 columns: packing dzᵀ is cheaper
    assert step_compiler._mm(dz.t().contiguous().t(), v.t()) is NotImplemented  # left operand not row-major


def test_no_factor_of_a_factorized_linear_layer_is_transposed_in_the_step(fedavgcnn, cache):
    """U feeds its GEMMs as it is ((U·zᵀ)ᵀ forward, dZ = dY·U, dU = dYᵀ·z + U), and V's input gradient is
    (V·dZᵀ)ᵀ: no Transpose copies a factor of FedAvgCNN's fc1 at ratio 0.5 (the SVD's column-major U, traced as
    it was, had two)."""
    ranks = resolve_plan(fedavgcnn, RankPlan(0.5)).ranks
    assert "fe.fc1" in ranks
    files = build_artifacts_of_kind(PORTABLE_KIND, fedavgcnn, ranks, SHAPE, CLASSES, cache).files
    step = onnx.load(str(files["step_model"]))
    readers = {}
    for node in step.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)

    def transposes_on_the_way(name: str, depth: int = 0) -> set[int]:
        """How many 2-D Transposes the value passes before each op that computes with it."""
        found = set()
        for node in readers.get(name, []):
            found |= transposes_on_the_way(node.output[0], depth + 1) if node.op_type == "Transpose" else {depth}
        return found

    for factor in ("fe.fc1.u", "fe.fc1.v"):  # a Transpose pair cancels (onnxruntime drops it); one alone copies
        parities = {d % 2 for d in transposes_on_the_way(factor)} if factor in readers else set()
        assert parities == {0}, f"{factor}: read through an odd number of Transposes (a copy per step)"
