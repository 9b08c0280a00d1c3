"""Step time of the compiler's edge-model forms (issue 42) against PyTorch eager, both at 1 thread.

    .venv/bin/python scripts/bench_edge_forms.py [--out FILE.json] [--batch 16] [--runs 30]
    .venv/bin/python scripts/bench_edge_forms.py --batch-norm-forms [--out FILE.json] [--batch 16]
    .venv/bin/python scripts/bench_edge_forms.py --conv-forms [--out FILE.json] [--batch 16]

Models (tests/support/edge_models.py, at edge sizes): a DS-CNN with BatchNorm over 1×49×10 (keyword-spotting
MFCCs), the same DS-CNN without BatchNorm (BatchNorm's decomposed form is the known risk: the pair isolates its
cost), a ResNet-8 with BatchNorm over 3×32×32, a Transformer encoder layer over 32×16 sequences and a Conv1d net
over 3×128 windows. Each is compiled (export.step_compiler, parity-checked) and one SGD step of CE + λ·L_FAC timed
in onnxruntime (the installed build, an InferenceSession as the device runs it) and in PyTorch eager (forward,
backward, parameter update), medians of ``--runs`` after one warm-up, interleaved. Prints a table, writes JSON.

``--batch-norm-forms``: training-mode BatchNorm's two forms, the step compiler's statistics form
(``_BatchNormStatistics``: mean and E[(x − μ)²] in two reductions, x − μ kept for the backward) against torch's
decomposition (what the compiler emitted before: the mean computed twice, x − μ three times), in isolation (a
BatchNorm2d(64) + ReLU over 64×14×14, the DS-CNN example's layer size) and in the whole step of examples/dscnn.py
and examples/resnet8.py (1×28×28): each graph compiled both ways, parity-checked, and the two step graphs timed at
1 thread in interleaved blocks (thread-CPU and wall p50, ``BN_REPEATS`` rounds). Before them, the alternatives for
its channel reductions at that layer size as single ONNX graphs (:func:`_reduction_forms`: the variance, one channel
sum, the backward's two sums Σg and Σg·(x − μ), and the forward's output y against onnxruntime's own
BatchNormalization in training mode, which gives y and the running statistics but not the batch's), each checked
against its group's first form, timed likewise.

``--conv-forms``: the convolutions of examples/dscnn.py and examples/resnet8.py (1×28×28) one layer at a time, the
forms the step compiler emits and the alternatives tried, each a single ONNX graph, beside PyTorch eager's own op for
the same work (aten.convolution / convolution_backward), all timed at 1 thread in interleaved blocks (thread-CPU and
wall p50, µs): the depthwise 3×3 over 64×14×14 (forward, also as block-diagonal groups of 2 and 4 channels; input
gradient; weight gradient by taps, by taps over contiguous rows, by a grouped Conv over the batch), the weight
gradient of a 3×3 16→16 over 28×28 (the GEMM of grad_out and the patches, both ways round, per sample), and the
input gradient of the same-padded convolutions
(MatMul + Col2Im, Conv by the flipped kernel, ConvTranspose). Each form checked against its group's first.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np
import onnxruntime
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from device_runtime.artifact_contract import ANCHOR_MASK, ANCHORS, INPUT, LABELS, LAM, LR  # noqa: E402
from export import step_compiler  # noqa: E402
from export.artifacts import inference_session  # noqa: E402
from fedcore.models import SplitModel, build_model  # noqa: E402
from fedcore.objective import local_loss  # noqa: E402
from fedcore.tensors import carried_tensors  # noqa: E402
from tests.support.edge_models import conv1d_net, ds_cnn, resnet8, tiny_transformer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_thread_options import interleaved_p50  # noqa: E402
from profile_step import synthetic_feeds  # noqa: E402


def _no_batchnorm(model: nn.Module) -> nn.Module:
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, nn.Identity())
    return model


MODELS = {
    "ds_cnn_bn": (lambda: ds_cnn((1, 49, 10), 12, width=32), (1, 49, 10)),
    "ds_cnn_no_bn": (lambda: _no_batchnorm(ds_cnn((1, 49, 10), 12, width=32)), (1, 49, 10)),
    "resnet8_bn": (lambda: resnet8((3, 32, 32), 10, width=16), (3, 32, 32)),
    "transformer": (lambda: tiny_transformer((32, 16), 10, model_dim=32, heads=2), (32, 16)),
    "conv1d_bn": (lambda: conv1d_net((3, 128), 6, width=16), (3, 128)),
}


def _batch_norm_layer() -> SplitModel:
    torch.manual_seed(0)
    fe = nn.Sequential(nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    return SplitModel("batch_norm_layer", fe, 64, 10)


BN_MODELS = {
    "BatchNorm2d(64) + ReLU, 64x14x14": (_batch_norm_layer, (64, 14, 14)),
    "examples/dscnn.py:build, 1x28x28": (lambda: build_model("examples/dscnn.py:build", (1, 28, 28), 10, seed=0),
                                         (1, 28, 28)),
    "examples/resnet8.py:build, 1x28x28": (lambda: build_model("examples/resnet8.py:build", (1, 28, 28), 10, seed=0),
                                           (1, 28, 28)),
}
BN_FORMS = ("torch decomposition (before)", "statistics form (shipped)")
BN_REPEATS, BN_BLOCKS, BN_PER_BLOCK = 2, 8, 8
CONV_BLOCKS, CONV_PER_BLOCK = 6, 6


def _reduction_forms(batch: int) -> dict[str, tuple[str, list]]:
    """label -> (group, nodes) over inputs g and x of (batch, 64, 14, 14); output "o" (and "o2" for two sums)."""
    from onnx import helper as h
    ax, ax0 = "axes_023", "axes_0"

    def dot(g, x, out):
        return [h.make_node("Mul", [g, x], [out + "_p"]), h.make_node("ReduceSum", [out + "_p", ax], [out])]

    def by_ones(t, out):
        return [h.make_node("Reshape", [t, "rows"], [out + "_r"]), h.make_node("MatMul", [out + "_r", "ones"],
                                                                              [out + "_m"]),
                h.make_node("ReduceSum", [out + "_m", ax0], [out])]

    return {
        "variance: Mul + ReduceMean (shipped)": ("variance", [h.make_node("Mul", ["x", "x"], ["p"]),
                                                              h.make_node("ReduceMean", ["p", ax], ["o"])]),
        "variance: ReduceSumSquare · 1/n": ("variance", [h.make_node("ReduceSumSquare", ["x", ax], ["s"]),
                                                         h.make_node("Mul", ["s", "inv_n"], ["o"])]),
        "channel sum: ReduceSum axes 0,2,3 (shipped)": ("sum", [h.make_node("ReduceSum", ["g", ax], ["o"])]),
        "channel sum: MatMul by ones, ReduceSum axis 0": ("sum", by_ones("g", "o")),
        "two sums: two ReduceSum (shipped)": ("two", [h.make_node("ReduceSum", ["g", ax], ["o"]), *dot("g", "x", "o2")]),
        "two sums: MatMul by ones": ("two", [*by_ones("g", "o"), h.make_node("Mul", ["g", "x"], ["p"]),
                                             *by_ones("p", "o2")]),
        "two sums: Concat, one ReduceSum": ("two", [
            h.make_node("Mul", ["g", "x"], ["p"]), h.make_node("Concat", ["g", "p"], ["c"], axis=1),
            h.make_node("Reshape", ["c", "pairs"], ["r"]), h.make_node("ReduceSum", ["r", "axes_03"], ["s"]),
            h.make_node("Split", ["s"], ["o", "o2"], axis=1, num_outputs=2)]),
        "two sums: ReduceSum and Einsum": ("two", [h.make_node("ReduceSum", ["g", ax], ["o"]),
                                                   h.make_node("Einsum", ["g", "x"], ["o2"], equation="nchw,nchw->c")]),
        "forward y: the statistics form's 6 ops (shipped)": ("forward", [
            h.make_node("ReduceMean", ["x", ax], ["mu"]), h.make_node("Sub", ["x", "mu"], ["xc"]),
            h.make_node("Mul", ["xc", "xc"], ["sq"]), h.make_node("ReduceMean", ["sq", ax], ["var"]),
            h.make_node("Add", ["var", "eps"], ["ve"]), h.make_node("Sqrt", ["ve"], ["sd"]),
            h.make_node("Div", ["scale", "sd"], ["sc"]), h.make_node("Mul", ["xc", "sc"], ["t"]),
            h.make_node("Add", ["t", "shift"], ["o"])]),
        "forward y: BatchNormalization training_mode=1": ("forward", [
            h.make_node("BatchNormalization", ["x", "weight", "bias", "mean0", "var0"], ["o", "rm", "rv"],
                        training_mode=1, epsilon=1e-5, momentum=0.9)]),
    }


def bench_reduction_forms(batch: int) -> list[dict]:
    """Each of :func:`_reduction_forms` at (batch, 64, 14, 14): thread-CPU and wall p50, max |Δ| to its group's first."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    c, hw = 64, 14 * 14
    constants = dict(axes_023=np.array([0, 2, 3]), axes_0=np.array([0]), axes_03=np.array([0, 3]),
                     rows=np.array([batch, c, hw]), pairs=np.array([batch, 2, c, hw]),
                     ones=np.ones((hw, 1), np.float32), inv_n=np.array(1 / (batch * hw), np.float32),
                     eps=np.array(1e-5, np.float32), scale=np.full((1, c, 1, 1), 1.5, np.float32),
                     shift=np.full((1, c, 1, 1), 0.25, np.float32), weight=np.full(c, 1.5, np.float32),
                     bias=np.full(c, 0.25, np.float32), mean0=np.zeros(c, np.float32), var0=np.ones(c, np.float32))
    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal((batch, c, 14, 14)).astype(np.float32) for name in ("g", "x")}
    sessions, groups = {}, {}
    for label, (group, nodes) in _reduction_forms(batch).items():
        used = {i for node in nodes for i in node.input}
        outputs = [o for o in ("o", "o2") if any(o in node.output for node in nodes)]
        graph = helper.make_graph(
            nodes, "form", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [batch, c, 14, 14]) for n in ("g", "x")],
            [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
            [numpy_helper.from_array(v if v.dtype == np.float32 else v.astype(np.int64), k)
             for k, v in constants.items() if k in used])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        sessions[label] = _session(model.SerializeToString())
        groups[label] = group
    rows, first = [], {}
    for label, session in sessions.items():
        out = np.concatenate([o.ravel() for o in session.run(None, feeds)])
        reference = first.setdefault(groups[label], out)
        rows.append(dict(form=label, max_abs_diff=float(np.abs(out - reference).max()),
                         reference_max=float(np.abs(reference).max())))
    timed = interleaved_p50(sessions, feeds, BN_BLOCKS, BN_PER_BLOCK, time.thread_time)
    for row in rows:
        row |= {k: 1e3 * v for k, v in timed[row["form"]].items()}  # µs
    return rows


def bench_batch_norm_forms(name: str, batch: int) -> dict:
    """Both BatchNorm forms of one model: nodes, parity, thread-CPU and wall p50 per repeat of interleaved blocks."""
    factory, shape = BN_MODELS[name]
    model = factory()
    sessions, row = {}, dict(model=name, batch=batch, forms={})
    for form in BN_FORMS:
        with mock.patch.object(step_compiler, "_batch_norms_by_statistics",
                               step_compiler._batch_norms_by_statistics if form == BN_FORMS[1] else lambda m: m):
            step, evaluate = step_compiler.compile_step(model, shape, model.num_classes, model.feature_dim)
        parity = step_compiler.check_parity(model, step, evaluate, shape, model.num_classes, model.feature_dim,
                                            inference_session)
        sessions[form] = _session(step.SerializeToString())
        row["forms"][form] = dict(nodes=len(step.graph.node), parity=parity, cpu_ms=[], wall_ms=[])
    feeds = synthetic_feeds(sessions[BN_FORMS[0]], batch)
    for _ in range(BN_REPEATS):
        for form, t in interleaved_p50(sessions, feeds, BN_BLOCKS, BN_PER_BLOCK, time.thread_time).items():
            row["forms"][form]["cpu_ms"].append(t["cpu_ms"])
            row["forms"][form]["wall_ms"].append(t["wall_ms"])
    return row


def _batch_norm_main(args) -> int:
    reductions = bench_reduction_forms(args.batch)
    print(f"| channel reductions at {args.batch}x64x14x14 | thread-CPU p50 µs | wall p50 µs | max abs diff |")
    print("|---|---:|---:|---:|")
    for r in reductions:
        print(f"| {r['form']} | {r['cpu_ms']:.0f} | {r['wall_ms']:.0f} | {r['max_abs_diff']:.1e} |", flush=True)
    print()
    rows = []
    print("| model | form | nodes | parity | thread-CPU p50 ms (per repeat) | wall p50 ms | load |")
    print("|---|---|---:|---:|---|---|---:|")
    for name in BN_MODELS:
        row = bench_batch_norm_forms(name, args.batch)
        rows.append(row)
        for form, r in row["forms"].items():
            print(f"| {name} | {form} | {r['nodes']} | {r['parity']:.1e} | "
                  f"{', '.join(f'{v:.3f}' for v in r['cpu_ms'])} | {', '.join(f'{v:.2f}' for v in r['wall_ms'])} | "
                  f"{os.getloadavg()[0]:.1f} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"batch": args.batch, "threads": 1, "onnxruntime": onnxruntime.__version__,
                                              "torch": torch.__version__, "reductions_us": reductions, "rows": rows},
                                             indent=1))
    return 0


class _Eager:
    """A PyTorch eager op behind the ``run(outputs, feeds)`` of a session, for :func:`interleaved_p50`."""

    def __init__(self, op):
        self.op = op

    def run(self, _outputs, _feeds):
        return [t.numpy() for t in (self.op(),) if t is not None]


class _Fed:
    """An onnxruntime session with its own inputs (the forms of one group take different ones)."""

    def __init__(self, session: onnxruntime.InferenceSession, feeds: dict[str, np.ndarray]):
        self.session, self.feeds = session, feeds

    def run(self, outputs, _feeds):
        return self.session.run(outputs, self.feeds)


def _graph(nodes, inputs: dict[str, np.ndarray], ints: dict[str, list[int]] | None = None) -> _Fed:
    """A session over ``nodes`` (output "y", named inputs fed as given, int64 constants) and its feeds."""
    from onnx import TensorProto, helper, numpy_helper
    graph = helper.make_graph(
        nodes, "form", [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(v.shape)) for n, v in inputs.items()],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in (ints or {}).items()])
    return _Fed(_session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()),
                inputs)


def _conv_forms(batch: int) -> dict[str, dict[str, object]]:
    """group -> label -> a session-like form; each group's first is the reference it is checked against."""
    from onnx import helper as h
    rng = np.random.default_rng(0)

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    def backward(g, x, w, padding, groups, mask):
        tg, tx, tw = (torch.from_numpy(a) for a in (g, x, w))
        return lambda: torch.ops.aten.convolution_backward(tg, tx, tw, None, [1, 1], padding, [1, 1], False, [0, 0],
                                                            groups, mask)[mask.index(True)]

    c, s = 64, 14
    x, g, w = normal(batch, c, s, s), normal(batch, c, s, s), normal(c, 1, 3, 3)
    taps_nodes, taps_ints, outs = [h.make_node("Pad", ["x", "pads"], ["xp"])], {"pads": [0, 0, 1, 1, 0, 0, 1, 1],
                                                                                "sp": [2, 3], "red": [0, 2, 3]}, []
    flat_nodes = [h.make_node("Pad", ["x", "pads"], ["xp"]), h.make_node("Reshape", ["xp", "rows"], ["xf"]),
                  h.make_node("Pad", ["xf", "tail"], ["xe"]), h.make_node("Pad", ["g", "gpads"], ["gp"]),
                  h.make_node("Reshape", ["gp", "rows"], ["gf"])]
    flat_ints = {"pads": [0, 0, 1, 1, 0, 0, 1, 1], "rows": [0, 0, -1], "tail": [0, 0, 0, 0, 0, 2 * (s + 2) + 2],
                 "gpads": [0, 0, 0, 0, 0, 0, 2, 2], "last": [2], "red": [0, 2]}
    for ky in range(3):
        for kx in range(3):
            k, offset = f"{ky}{kx}", ky * (s + 2) + kx
            taps_ints |= {"b" + k: [ky, kx], "e" + k: [ky + s, kx + s]}
            taps_nodes += [h.make_node("Slice", ["xp", "b" + k, "e" + k, "sp"], ["w" + k]),
                           h.make_node("Mul", ["w" + k, "g"], ["m" + k]),
                           h.make_node("ReduceSum", ["m" + k, "red"], ["t" + k])]
            flat_ints |= {"b" + k: [offset], "e" + k: [offset + (s + 2) ** 2]}
            flat_nodes += [h.make_node("Slice", ["xe", "b" + k, "e" + k, "last"], ["w" + k]),
                           h.make_node("Mul", ["w" + k, "gf"], ["m" + k]),
                           h.make_node("ReduceSum", ["m" + k, "red"], ["t" + k])]
            outs.append("t" + k)
    by_tap = [h.make_node("Concat", outs, ["taps"], axis=0), h.make_node("Reshape", ["taps", "nine"], ["t9"]),
              h.make_node("Transpose", ["t9"], ["y"], perm=[1, 0])]
    taps_ints["nine"] = flat_ints["nine"] = [9, -1]
    depthwise_dw = {
        "taps: Slice, Mul, ReduceSum per offset (shipped)": _graph(taps_nodes + by_tap, dict(x=x, g=g), taps_ints),
        "taps over contiguous rows (one Pad, last-axis Slices)": _graph(flat_nodes + by_tap, dict(x=x, g=g), flat_ints),
        "grouped Conv, channel-major: C groups of N channels, grad_out as kernel": _graph([
            h.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2, 3]), h.make_node("Reshape", ["xt", "one"], ["xr"]),
            h.make_node("Transpose", ["g"], ["gt"], perm=[1, 0, 2, 3]),
            h.make_node("Conv", ["xr", "gt"], ["o"], group=c, pads=[1, 1, 1, 1]),
            h.make_node("Reshape", ["o", "out"], ["y"])], dict(x=x, g=g), {"one": [1, -1, s, s], "out": [c, 9]}),
        "PyTorch eager: convolution_backward, weight": _Eager(backward(g, x, w, [1, 1], c, [False, True, False])),
    }
    tw, tx = torch.from_numpy(w), torch.from_numpy(x)

    def block_diagonal(b: int) -> _Fed:
        eye = np.eye(b, dtype=np.float32).reshape(1, b, b, 1)
        return _graph([h.make_node("Reshape", ["w", "blocks"], ["w1"]), h.make_node("Mul", ["w1", "eye"], ["w2"]),
                       h.make_node("Reshape", ["w2", "kernel"], ["w3"]),
                       h.make_node("Conv", ["x", "w3"], ["y"], group=c // b, pads=[1, 1, 1, 1])],
                      dict(x=x, w=w, eye=eye), {"blocks": [c // b, b, 1, 9], "kernel": [c, b, 3, 3]})

    depthwise = {
        "Conv, group=C (shipped)": _graph([h.make_node("Conv", ["x", "w"], ["y"], group=c, pads=[1, 1, 1, 1])],
                                          dict(x=x, w=w)),
        "Conv of block-diagonal 2-channel groups": block_diagonal(2),
        "Conv of block-diagonal 4-channel groups": block_diagonal(4),
        "PyTorch eager: convolution": _Eager(lambda tx=tx, tw=tw, c=c: torch.ops.aten.convolution(
            tx, tw, None, [1, 1], [1, 1], [1, 1], False, [0, 0], c)),
    }
    depthwise_dx = {
        "Conv of grad_out by the flipped kernel, group=C (shipped)": _graph(
            [h.make_node("Slice", ["w", "start", "end", "axes", "steps"], ["wf"]),
             h.make_node("Conv", ["g", "wf"], ["y"], group=c, pads=[1, 1, 1, 1])], dict(g=g, w=w),
            {"start": [-1, -1], "end": [-2 ** 62, -2 ** 62], "axes": [2, 3], "steps": [-1, -1]}),
        "PyTorch eager: convolution_backward, input": _Eager(backward(g, x, w, [1, 1], c, [True, False, False])),
    }
    c, s = 16, 28
    x, g, w = normal(batch, c, s, s), normal(batch, c, s, s), normal(c, c, 3, 3)
    # the patches as the compiler lays them out: rows (n, y, x), columns (ky, kx, c)
    rows = np.ascontiguousarray(torch.nn.functional.unfold(torch.from_numpy(x), 3, padding=1)
                                .reshape(batch, c, 9, -1).permute(0, 3, 2, 1).reshape(-1, 9 * c).numpy())
    flat_g = np.ascontiguousarray(g.transpose(0, 2, 3, 1).reshape(-1, c))
    operands = dict(g=flat_g, rows=rows)
    weight_gemm = {
        "grad_outᵀ × patches (shipped)": _graph([h.make_node("Transpose", ["g"], ["gt"], perm=[1, 0]),
                                                 h.make_node("MatMul", ["gt", "rows"], ["y"])], operands),
        "(patchesᵀ × grad_out)ᵀ": _graph([h.make_node("Transpose", ["rows"], ["rt"], perm=[1, 0]),
                                          h.make_node("MatMul", ["rt", "g"], ["yt"]),
                                          h.make_node("Transpose", ["yt"], ["y"], perm=[1, 0])], operands),
        "per sample, then ReduceSum over the batch": _graph([
            h.make_node("Reshape", ["g", "gs"], ["g3"]), h.make_node("Transpose", ["g3"], ["g3t"], perm=[0, 2, 1]),
            h.make_node("Reshape", ["rows", "rs"], ["r3"]), h.make_node("MatMul", ["g3t", "r3"], ["p"]),
            h.make_node("ReduceSum", ["p", "batch_axis"], ["y"], keepdims=0)], operands,
            {"gs": [batch, -1, c], "rs": [batch, -1, 9 * c], "batch_axis": [0]}),
        "PyTorch eager: convolution_backward, weight (direct)": _Eager(
            lambda dw=backward(g, x, w, [1, 1], 1, [False, True, False]), c=c: dw().permute(0, 2, 3, 1).reshape(c, -1)),
    }
    groups = {"depthwise 3x3, 64x14x14: forward": depthwise, "depthwise 3x3, 64x14x14: input gradient": depthwise_dx,
              "depthwise 3x3, 64x14x14: weight gradient": depthwise_dw,
              "3x3 16->16, 28x28: weight gradient GEMM (M=16, K=N·28·28, N=144)": weight_gemm}
    for c, s, k in ((16, 28, 3), (32, 14, 3), (64, 7, 3), (64, 14, 1)):
        g, w = normal(batch, c, s, s), normal(c, c, k, k)
        p = k // 2
        groups[f"same-padded {k}x{k} {c}->{c}, {s}x{s}: input gradient"] = {
            "MatMul + Col2Im (before)": _graph([
                h.make_node("Reshape", ["w", "matrix"], ["w2"]), h.make_node("Transpose", ["w2"], ["wt"], perm=[1, 0]),
                h.make_node("Reshape", ["g", "flat"], ["g3"]), h.make_node("MatMul", ["wt", "g3"], ["columns"]),
                h.make_node("Col2Im", ["columns", "image", "block"], ["y"], pads=[p] * 4)], dict(g=g, w=w),
                {"matrix": [c, -1], "flat": [0, c, -1], "image": [s, s], "block": [k, k]}),
            "Conv by the flipped, transposed kernel (shipped)": _graph([
                h.make_node("Transpose", ["w"], ["wt"], perm=[1, 0, 2, 3]),
                h.make_node("Slice", ["wt", "start", "end", "axes", "steps"], ["wf"]),
                h.make_node("Conv", ["g", "wf"], ["y"], pads=[p] * 4)], dict(g=g, w=w),
                {"start": [-1, -1], "end": [-2 ** 62, -2 ** 62], "axes": [2, 3], "steps": [-1, -1]}),
            "ConvTranspose": _graph([h.make_node("ConvTranspose", ["g", "w"], ["y"], pads=[p] * 4)], dict(g=g, w=w)),
            "PyTorch eager: convolution_backward, input": _Eager(
                backward(g, normal(batch, c, s, s), w, [p, p], 1, [True, False, False])),
        }
    return groups


def bench_conv_forms(batch: int) -> list[dict]:
    """Each of :func:`_conv_forms`: thread-CPU and wall p50 µs, max |Δ| to its group's first form."""
    rows = []
    for group, forms in _conv_forms(batch).items():
        outputs = {label: np.asarray(form.run(None, {})[0]) for label, form in forms.items()}
        reference = next(iter(outputs.values()))
        timed = interleaved_p50(forms, {}, CONV_BLOCKS, CONV_PER_BLOCK, time.thread_time)
        for label in forms:
            rows.append(dict(group=group, form=label, cpu_us=1e3 * timed[label]["cpu_ms"],
                             wall_us=1e3 * timed[label]["wall_ms"],
                             max_abs_diff=float(np.abs(outputs[label].reshape(reference.shape) - reference).max()),
                             reference_max=float(np.abs(reference).max())))
    return rows


def _conv_main(args) -> int:
    rows = bench_conv_forms(args.batch)
    print(f"| batch {args.batch}, 1 thread | form | thread-CPU p50 µs | wall p50 µs | max abs diff |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['group']} | {r['form']} | {r['cpu_us']:.0f} | {r['wall_us']:.0f} | {r['max_abs_diff']:.1e} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"batch": args.batch, "threads": 1, "onnxruntime": onnxruntime.__version__,
                                              "torch": torch.__version__, "loadavg": os.getloadavg(), "rows": rows},
                                             indent=1))
    return 0


def _session(model_bytes: bytes) -> onnxruntime.InferenceSession:
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    return onnxruntime.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


def _torch_step(model: nn.Module, data: dict) -> None:
    loss, _ = local_loss(model, data[INPUT], data[LABELS], data[ANCHORS], data[ANCHOR_MASK], float(data[LAM]))
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= data[LR] * p.grad


def bench(name: str, batch: int, runs: int) -> dict:
    factory, shape = MODELS[name]
    model = factory()
    t0 = time.perf_counter()
    step, evaluate = step_compiler.compile_step(model, shape, model.num_classes, model.feature_dim)
    compile_s = time.perf_counter() - t0
    worst = step_compiler.check_parity(model, step, evaluate, shape, model.num_classes, model.feature_dim,
                                       inference_session)
    data = step_compiler.example_inputs(shape, model.num_classes, model.feature_dim, batch, 7)
    feeds = {k: v.numpy() for k, v in data.items()} | {k: v.detach().numpy().copy()
                                                       for k, v in carried_tensors(model).items()}
    session = _session(step.SerializeToString())
    eager = copy.deepcopy(model).train()
    ort_ms, torch_ms = [], []
    for i in range(runs + 1):
        t = time.perf_counter()
        session.run(None, feeds)
        ort = time.perf_counter() - t
        t = time.perf_counter()
        _torch_step(eager, data)
        eager_s = time.perf_counter() - t
        if i:
            ort_ms.append(1e3 * ort)
            torch_ms.append(1e3 * eager_s)
    o, p = float(np.median(ort_ms)), float(np.median(torch_ms))
    return dict(model=name, batch=batch, onnxruntime_ms=o, pytorch_ms=p, ratio=o / p, parity=worst,
                compile_s=compile_s, nodes=len(step.graph.node))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSON file to write")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of: " + ", ".join(MODELS))
    p.add_argument("--batch-norm-forms", action="store_true",
                   help="instead: BatchNorm's statistics form against torch's decomposition, alone and in the step")
    p.add_argument("--conv-forms", action="store_true",
                   help="instead: the examples' convolutions one layer at a time, each form beside PyTorch's op")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.batch_norm_forms:
        return _batch_norm_main(args)
    if args.conv_forms:
        return _conv_main(args)
    rows = []
    print(f"| model | onnxruntime {onnxruntime.__version__} step ms | PyTorch {torch.__version__} eager ms | "
          "ratio | parity | compile s |")
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        row = bench(name, args.batch, args.runs)
        rows.append(row)
        print(f"| {name} | {row['onnxruntime_ms']:.2f} | {row['pytorch_ms']:.2f} | {row['ratio']:.2f} | "
              f"{row['parity']:.1e} | {row['compile_s']:.0f} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"batch": args.batch, "runs": args.runs, "threads": 1,
                                              "onnxruntime": onnxruntime.__version__, "torch": torch.__version__,
                                              "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
