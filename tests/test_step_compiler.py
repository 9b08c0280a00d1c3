"""The portable step graph: plain default-domain ONNX, one step equal to PyTorch's for every model, gated on
parity before it is published, cached by a hash that covers the compiler, and equal to the training API's
trajectory over many steps."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from device_runtime.artifact_contract import ARTIFACT_FILES_BY_KIND, PORTABLE_KIND, TRAINING_KIND, next_name
from device_runtime.portable_trainer import PortableTrainer
from device_runtime.trainer import DeviceTrainer
from export import step_compiler
from export.artifacts import artifact_config, build_artifacts_of_kind, config_hash, inference_session
from fedcore.lowrank import RankPlan, factorize_model, fe_state, resolve_plan
from fedcore.models import ARCHITECTURES, build_model
from server.training import train_local

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


def _scaled_gradient(step: onnx.ModelProto, parameter: str, factor: float) -> onnx.ModelProto:
    """The step graph with ``parameter``'s update p − lr·g rewritten to p − factor·lr·g."""
    wrong = onnx.ModelProto()
    wrong.CopyFrom(step)
    out = next_name(parameter)
    producer = next(n for n in wrong.graph.node if out in n.output)
    producer.output[list(producer.output).index(out)] = "correct_update"
    wrong.graph.initializer.append(numpy_helper.from_array(np.array(factor, np.float32), "factor"))
    wrong.graph.initializer.append(numpy_helper.from_array(np.array(1.0 - factor, np.float32), "keep"))
    wrong.graph.node.extend([  # factor·(p − lr·g) + (1 − factor)·p = p − factor·lr·g
        helper.make_node("Mul", ["correct_update", "factor"], ["scaled_update"]),
        helper.make_node("Mul", [parameter, "keep"], ["kept_part"]),
        helper.make_node("Add", ["scaled_update", "kept_part"], [out]),
    ])
    return wrong


def test_the_parity_gate_refuses_a_step_whose_gradient_is_doubled(fedavgcnn):
    step, evaluate = step_compiler.compile_step(fedavgcnn, SHAPE, CLASSES, fedavgcnn.feature_dim)
    session = inference_session
    assert step_compiler.check_parity(fedavgcnn, step, evaluate, SHAPE, CLASSES, fedavgcnn.feature_dim,
                                      session) <= step_compiler.PARITY_ATOL
    with pytest.raises(step_compiler.ParityError, match="head.weight.next"):
        step_compiler.check_parity(fedavgcnn, _scaled_gradient(step, "head.weight", 2.0), evaluate, SHAPE, CLASSES,
                                   fedavgcnn.feature_dim, session)


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


def test_the_parity_gate_refuses_a_pool_backward_that_feeds_every_tied_maximum(fedavgcnn, monkeypatch):
    """The gate's batch is blank in its upper half: equal maxima in pooling windows, which such a graph gets wrong."""
    def every_maximum(x, kernel):
        return x == step_compiler._upsample(step_compiler._max_pool(x, kernel), kernel)

    monkeypatch.setattr(step_compiler, "_first_maxima", every_maximum)
    step, evaluate = step_compiler.compile_step(fedavgcnn, SHAPE, CLASSES, fedavgcnn.feature_dim)
    with pytest.raises(step_compiler.ParityError):
        step_compiler.check_parity(fedavgcnn, step, evaluate, SHAPE, CLASSES, fedavgcnn.feature_dim,
                                   inference_session)
