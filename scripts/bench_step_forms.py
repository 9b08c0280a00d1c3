"""Questions about the step graph's form, answered by measurement on this CPU (stock onnxruntime's kernels).

    .venv/bin/python scripts/bench_step_forms.py --python STOCK_PYTHON --out-dir DIR [--arm64]

1. The few-channel first convolution (FedAvgCNN's conv1: 3 or 1 input channels, 5×5, 32 outputs): its forward and
   weight gradient as the step compiler emits them (a Conv, and a Conv of the batch/channel-swapped input by the
   swapped output gradient) against forms that share one patch matrix between the two products: kh·kw strided
   slices stacked (planar patches), or a Conv with a one-hot weight (MLAS does the im2col), each with a batched
   MatMul for the forward and for the weight gradient (or one GEMM over transposed copies), and the mixed forms
   (Conv forward, patch-matrix weight gradient). Every form's outputs are checked against the first's.
2. Reduced precision: each op kind of a compiled step graph at its step shapes in float16 against float32 (what
   stock onnxruntime's CPU provider runs: where it has no float16 kernel it inserts casts), and the share of one
   SGD step's parameter updates (lr 5e-3, CE + λ·L_FAC at λ 10, batch 16) that float16 or int8 weights cannot hold
   (p + Δ rounds back to p), for FedAvgCNN 3×32×32 and CNN1 1×28×28 at their seed-0 weights.
3. The whole step with float16 weights: the shipped FedAvgCNN 3×32×32 dense step graph with its parameter inputs
   and updated-parameter outputs in float16 (a Cast to float32 after each input, one to float16 before each output:
   the weights stored and sent in half the bytes, the arithmetic unchanged), against the graph as shipped: step
   time, the peak RSS (VmHWM) of a fresh process that runs STEP_RUNS steps, each feeding its outputs back, and the
   share of the first step's nonzero float32 updates that the float16 outputs lose (p.next == p), both graphs
   started from the seed-0 weights rounded to float16 (so their arithmetic is the same until the last Cast).
4. The max-pool backward (2×2 windows that tile the input, the gradient to each window's first maximum in row-major
   order, as PyTorch routes it): the step compiler's first-maximum mask (Equal with the upsampled maximum, Cast,
   weights 4, 3, 2, 1, a second MaxPool, Equal, Cast, Mul with the upsampled gradient) against the same masks in
   float arithmetic (Sign of the difference to the window's maximum: no bool tensors, no Cast) and against
   MaxPool's Indices output with a ScatterElements of the gradient into zeros, at the pools' step shapes, on inputs
   with tied windows. Every form's outputs are checked against the first's.
5. With ``--arm64``: questions 2 and 3 (not the convolution or pooling forms) on the emulated arm64 Debian of
   scripts/arm64_emulation.sh, in the stock onnxruntime of the device bundle installed there (ARM64_PYTHON), beside
   the same measures in ``--python`` here: whether each float16 op has a kernel there (the profile names the ops
   that ran: a Cast around it means onnxruntime inserted casts to float32), whether the float16-weights step loads
   and runs, the share of its updates lost, its outputs against this machine's, and VmHWM (under qemu-user: the
   emulator process's peak, i.e. the guest's memory plus the translator's; compare the two graphs, not the figure
   with a board). Emulated times say nothing about a board's speed (fewer repeats there). Writes
   bench_step_forms_arm64.{json,md}.
The parent builds the graphs (onnx) and the update shares (torch); a worker in ``--python`` (an environment with
stock onnxruntime and numpy, e.g. a venv of the device bundle's requirements-device.txt) times them at 1 thread,
forms in interleaved blocks, in thread-CPU time (the calling thread's CPU: onnxruntime runs a 1-thread session on
it) and wall time. Writes bench_step_forms.json and bench_step_forms.md into ``--out-dir``; prints the tables.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

C_OUT, KERNEL = 32, 5
CONV_CONFIGS = ((16, 3, 32), (16, 1, 28), (64, 3, 32))  # (batch, input channels, image side)
POOL_CONFIGS = ((16, 32, 28, 28), (16, 16, 24, 24), (16, 64, 10, 10))  # the pools of FedAvgCNN 3x32x32, CNN1 1x28x28
POOL_FORMS = ("first-maximum mask (shipped)", "float masks by Sign", "MaxPool indices + ScatterElements")
FORMS = ("conv + swapped conv (shipped)", "planar slices, shared", "one-hot conv, shared", "conv + planar slices dW",
         "conv + one-hot conv dW", "one-hot conv, shared, one GEMM dW")
PRECISION_CASES = (("MatMul", [[1600, 64], [64, 800]], {}), ("MatMul", [[16, 1600], [1600, 512]], {}),
                   ("Gemm", [[16, 1600], [512, 1600], [512]], dict(transB=1)),
                   ("Conv", [[16, 32, 14, 14], [64, 32, 5, 5], [64]], {}),
                   ("Conv", [[16, 3, 32, 32], [32, 3, 5, 5], [32]], {}),
                   ("MaxPool", [[16, 32, 28, 28]], dict(kernel_shape=[2, 2], strides=[2, 2])),
                   ("Relu", [[16, 32, 28, 28]], {}), ("Mul", [[16, 32, 28, 28], [16, 32, 28, 28]], {}),
                   ("Add", [[512, 1600], [512, 1600]], {}), ("ReduceSum", [[16, 64, 10, 10]], dict(keepdims=0)),
                   ("Transpose", [[16, 64, 10, 10]], dict(perm=[0, 2, 3, 1])), ("Resize", [[16, 32, 14, 14]], {}))
STEP_MODEL, STEP_SHAPE, STEP_RUNS = "fedavgcnn", (3, 32, 32), 60
BLOCKS, PER_BLOCK = 12, 5
FORM_TOLERANCE = 1e-5  # max |Δ| / max |reference| of a form's outputs: float32 sums in another order (~1e-7 seen)
LR, LAM = 5e-3, 10.0
ARM64_PYTHON = "/opt/fedara-device/venv/bin/python"  # inside the emulated root: the device bundle's install.sh puts it
ARM64_ROOT = Path(os.environ.get("FEDARA_ARM64_ROOT", ROOT / ".arm64" / "rootfs"))  # scripts/arm64_emulation.sh's
EMULATION = ROOT / "scripts" / "arm64_emulation.sh"
ARM64_OP_RUNS, ARM64_STEP_RUNS, ARM64_STEP_REPEATS = 3, 4, 3  # emulated float work is ~100x slower
AT_HWCAP, HWCAP_FPHP, HWCAP_ASIMDHP = 16, 1 << 9, 1 << 10  # aarch64 auxv: float16 scalar and vector arithmetic


# ---------------------------------------------------------------------------------------------------------------
# Graphs (parent: onnx)

def _conv_graph(form: str, batch: int, channels: int, side: int) -> bytes:
    """Inputs X (N, C, H, W), W, B, G (the output gradient); outputs Y (the forward) and dW, in ``form``."""
    from onnx import TensorProto, helper, numpy_helper
    out = side - KERNEL + 1
    area, depth = out * out, channels * KERNEL * KERNEL
    nodes, inits = [], []

    def ints(name: str, values) -> str:
        inits.append(numpy_helper.from_array(np.array(values, np.int64), name))
        return name

    def node(op: str, inputs: list[str], output: str, **attrs) -> str:
        nodes.append(helper.make_node(op, inputs, [output], **attrs))
        return output

    def planar() -> str:
        taps = []
        for ky in range(KERNEL):
            for kx in range(KERNEL):
                tap = node("Slice", ["X", ints(f"s{ky}{kx}", [ky, kx]), ints(f"e{ky}{kx}", [ky + out, kx + out]),
                                     ints("axes", [2, 3])], f"t{ky}{kx}")
                taps.append(node("Unsqueeze", [tap, ints("two", [2])], f"u{ky}{kx}"))
        return node("Reshape", [node("Concat", taps, "P5", axis=2), ints("pshape", [batch, depth, area])], "P")

    def one_hot() -> str:
        eye = np.zeros((depth, channels, KERNEL, KERNEL), np.float32)
        for c in range(channels):
            for ky in range(KERNEL):
                for kx in range(KERNEL):
                    eye[c * KERNEL * KERNEL + ky * KERNEL + kx, c, ky, kx] = 1.0
        inits.append(numpy_helper.from_array(eye, "E"))
        return node("Reshape", [node("Conv", ["X", "E"], "P4"), ints("pshape", [batch, depth, area])], "P")

    def gemm_forward(patches: str) -> None:
        product = node("MatMul", [node("Reshape", ["W", ints("wshape", [C_OUT, depth])], "Wr"), patches], "Y0")
        biased = node("Add", [product, node("Reshape", ["B", ints("bshape", [C_OUT, 1])], "Br")], "Y1")
        node("Reshape", [biased, ints("yshape", [batch, C_OUT, out, out])], "Y")

    def gemm_weight_gradient(patches: str, one_gemm: bool = False) -> None:
        grads = node("Reshape", ["G", ints("gshape", [batch, C_OUT, area])], "Gr")
        if one_gemm:
            rows = node("Reshape", [node("Transpose", [grads], "Gt", perm=[1, 0, 2]),
                                    ints("g2", [C_OUT, batch * area])], "G2")
            cols = node("Reshape", [node("Transpose", [patches], "Pt", perm=[0, 2, 1]),
                                    ints("p2", [batch * area, depth])], "P2")
            summed = node("MatMul", [rows, cols], "D2")
        else:
            products = node("MatMul", [grads, node("Transpose", [patches], "Pt", perm=[0, 2, 1])], "D3")
            summed = node("ReduceSum", [products, ints("zero", [0])], "D2", keepdims=0)
        node("Reshape", [summed, ints("dwshape", [C_OUT, channels, KERNEL, KERNEL])], "dW")

    def conv_forward() -> None:
        node("Conv", ["X", "W", "B"], "Y")

    if form == FORMS[0]:
        conv_forward()
        swapped = node("Conv", [node("Transpose", ["X"], "Xs", perm=[1, 0, 2, 3]),
                                node("Transpose", ["G"], "Gs", perm=[1, 0, 2, 3])], "D")
        node("Transpose", [swapped], "dW", perm=[1, 0, 2, 3])
    elif form in (FORMS[1], FORMS[2], FORMS[5]):
        patches = planar() if form == FORMS[1] else one_hot()
        gemm_forward(patches)
        gemm_weight_gradient(patches, one_gemm=form == FORMS[5])
    else:
        conv_forward()
        gemm_weight_gradient(planar() if form == FORMS[3] else one_hot())
    value = helper.make_tensor_value_info
    inputs = [value("X", TensorProto.FLOAT, [batch, channels, side, side]),
              value("W", TensorProto.FLOAT, [C_OUT, channels, KERNEL, KERNEL]), value("B", TensorProto.FLOAT, [C_OUT]),
              value("G", TensorProto.FLOAT, [batch, C_OUT, out, out])]
    outputs = [value("Y", TensorProto.FLOAT, None), value("dW", TensorProto.FLOAT, None)]
    return _model(helper.make_graph(nodes, form, inputs, outputs, inits))


def _pool_graph(form: str, batch: int, channels: int, height: int, width: int) -> bytes:
    """Inputs X (N, C, H, W) and G (the pooled output's gradient); outputs Y (2×2 max-pool) and dX, in ``form``."""
    from onnx import TensorProto, helper, numpy_helper
    nodes = []
    inits = [numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
             numpy_helper.from_array(np.tile(np.array([[4, 3], [2, 1]], np.float32), (height // 2, width // 2)),
                                     "rank")]

    def node(op: str, inputs: list[str], output: str | list[str], **attrs) -> str:
        nodes.append(helper.make_node(op, inputs, [output] if isinstance(output, str) else output, **attrs))
        return output if isinstance(output, str) else output[0]

    def up(x: str) -> str:
        return node("Resize", [x, "", "scales"], f"{x}.up", mode="nearest")

    def pool(x: str, output: str | list[str]) -> str:
        return node("MaxPool", [x], output, kernel_shape=[2, 2], strides=[2, 2])

    if form == POOL_FORMS[0]:
        equal = node("Cast", [node("Equal", ["X", up(pool("X", "Y"))], "eq")], "eqf", to=TensorProto.FLOAT)
        key = node("Mul", [equal, "rank"], "key")
        first = node("Cast", [node("Equal", [key, up(pool(key, "kmax"))], "first")], "firstf", to=TensorProto.FLOAT)
        node("Mul", [up("G"), first], "dX")
    elif form == POOL_FORMS[1]:  # Sign(max - x) is 0 exactly where x is its window's maximum, else 1
        below = node("Sign", [node("Sub", [up(pool("X", "Y")), "X"], "gap")], "below")
        key = node("Sub", ["rank", node("Mul", [below, "rank"], "rank_below")], "key")
        later = node("Sign", [node("Sub", [up(pool(key, "kmax")), key], "kgap")], "later")
        grad = up("G")
        node("Sub", [grad, node("Mul", [grad, later], "dropped")], "dX")
    else:  # onnxruntime's generic MaxPool kernel (the Indices output), the gradient scattered by those indices
        inits += [numpy_helper.from_array(np.array([batch * channels * height * width], np.int64), "size"),
                  numpy_helper.from_array(np.array([-1], np.int64), "flat"),
                  numpy_helper.from_array(np.array([batch, channels, height, width], np.int64), "xshape")]
        pool("X", ["Y", "I"])
        indices = node("Reshape", ["I", "flat"], "If")
        zeros = node("ConstantOfShape", ["size"], "zeros", value=numpy_helper.from_array(np.zeros(1, np.float32)))
        scattered = node("ScatterElements", [zeros, indices, node("Reshape", ["G", "flat"], "Gf")], "dXf", axis=0)
        node("Reshape", [scattered, "xshape"], "dX")
    value = helper.make_tensor_value_info
    inputs = [value("X", TensorProto.FLOAT, [batch, channels, height, width]),
              value("G", TensorProto.FLOAT, [batch, channels, height // 2, width // 2])]
    outputs = [value("Y", TensorProto.FLOAT, None), value("dX", TensorProto.FLOAT, None)]
    return _model(helper.make_graph(nodes, form, inputs, outputs, inits))


def _op_graph(op: str, shapes: list[list[int]], attrs: dict, half: bool) -> bytes:
    from onnx import TensorProto, helper, numpy_helper
    dtype = TensorProto.FLOAT16 if half else TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info(f"x{i}", dtype, shape) for i, shape in enumerate(shapes)]
    names, inits = [f"x{i}" for i in range(len(shapes))], []
    if op == "Resize":  # nearest ×2, as the pool backward upsamples
        inits.append(numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"))
        names += ["", "scales"]
    graph = helper.make_graph([helper.make_node(op, names, ["y"], **attrs)], op, inputs,
                              [helper.make_tensor_value_info("y", dtype, None)], inits)
    return _model(graph)


def _model(graph) -> bytes:
    from onnx import helper
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9  # onnxruntime >= 1.15 loads it
    return model.SerializeToString()


def half_weight_step(step_path: str) -> bytes:
    """The step graph at ``step_path`` with every parameter input and every ``<param>.next`` output in float16 and a
    Cast at each (the float32 graph in between unchanged)."""
    import onnx
    from onnx import TensorProto, helper
    from device_runtime.artifact_contract import STEP_DATA_INPUTS, next_name
    model = onnx.load(step_path)
    graph = model.graph
    params = [v.name for v in graph.input if v.name not in STEP_DATA_INPUTS]
    outputs = {next_name(p) for p in params}
    for node in graph.node:
        node.input[:] = [f"{name}.f32" if name in params else name for name in node.input]
        node.output[:] = [f"{name}.f32" if name in outputs else name for name in node.output]
    casts_in = [helper.make_node("Cast", [p], [f"{p}.f32"], to=TensorProto.FLOAT) for p in params]
    casts_out = [helper.make_node("Cast", [f"{o}.f32"], [o], to=TensorProto.FLOAT16) for o in sorted(outputs)]
    nodes = [*casts_in, *graph.node, *casts_out]
    del graph.node[:]
    graph.node.extend(nodes)
    for value in [*graph.input, *graph.output]:
        if value.name in params or value.name in outputs:
            value.type.tensor_type.elem_type = TensorProto.FLOAT16
    onnx.checker.check_model(model)
    return model.SerializeToString()


def update_losses() -> dict:
    """Per model: the share of one SGD step's updates that float16 weights, and int8 weights (per-tensor symmetric,
    scale max|w|/127), cannot hold: of every parameter (a zero update counts as lost) and of the nonzero updates."""
    import torch
    from fedcore.models import build_model
    from fedcore.objective import local_loss
    torch.manual_seed(0)
    shares = {}
    for name, shape in (("fedavgcnn", (3, 32, 32)), ("cnn1", (1, 28, 28))):
        model = build_model(name, shape, 10, seed=0)
        anchors = torch.randn(10, model.feature_dim) * 0.1
        loss, _ = local_loss(model, torch.randn(16, *shape), torch.randint(0, 10, (16,)), anchors, torch.ones(10), LAM)
        loss.backward()
        total = updated = lost16 = lost8 = updated_lost16 = updated_lost8 = 0
        for p in model.parameters():
            w, delta = p.detach().numpy(), -LR * p.grad.numpy()
            w16 = w.astype(np.float16)
            scale = float(np.abs(w).max()) / 127
            held16 = (w16 + delta.astype(np.float16)).astype(np.float16) == w16
            held8 = np.round((w + delta) / scale) == np.round(w / scale)
            nonzero = delta != 0
            total, updated = total + w.size, updated + int(nonzero.sum())
            lost16, lost8 = lost16 + int(held16.sum()), lost8 + int(held8.sum())
            updated_lost16 += int((held16 & nonzero).sum())
            updated_lost8 += int((held8 & nonzero).sum())
        shares[name] = dict(params=total, fp16_lost=lost16 / total, int8_lost=lost8 / total, updated=updated / total,
                            fp16_lost_of_updated=updated_lost16 / updated, int8_lost_of_updated=updated_lost8 / updated)
    return shares


# ---------------------------------------------------------------------------------------------------------------
# Worker (numpy and onnxruntime only)

def _session(ort, path: str):
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def _ops_run(ort, path: str, feeds: dict, profile_dir: str) -> list[str]:
    """The op types a 1-thread session of the graph at ``path`` ran for ``feeds``, from onnxruntime's profile: a
    Cast beside a float16 op is one onnxruntime inserted because its CPU provider has no float16 kernel for it."""
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
    options.enable_profiling, options.profile_file_prefix = True, str(Path(profile_dir) / "profile")
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    session.run(None, feeds)
    events = json.loads(Path(session.end_profiling()).read_text())
    return sorted({e["args"]["op_name"] for e in events if e.get("cat") == "Node" and "op_name" in e.get("args", {})})


def float16_hwcaps() -> dict | None:
    """On aarch64, whether the (possibly emulated) CPU advertises float16 scalar (fphp) and vector (asimdhp)
    arithmetic in its auxiliary vector (what onnxruntime's MLAS checks before its float16 kernels); None elsewhere."""
    if platform.machine() != "aarch64":
        return None
    words = np.frombuffer(Path("/proc/self/auxv").read_bytes(), np.uint64).reshape(-1, 2)
    hwcap = int(next(value for key, value in words if key == AT_HWCAP))
    return dict(fphp=bool(hwcap & HWCAP_FPHP), asimdhp=bool(hwcap & HWCAP_ASIMDHP))


def _timed(session, feeds: dict) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    session.run(None, feeds)
    return time.perf_counter() - wall, time.thread_time() - cpu


def step_worker(spec: dict) -> dict:
    """``spec["runs"]`` steps of the step graph at ``spec["path"]`` from the weights in ``spec["weights"]`` (.npz,
    cast to the graph's parameter dtype) on a synthetic batch (input N(0, 1), anchors 0.1·N(0, 1)), each step's
    updated parameters fed to the next: thread-CPU and wall p50 of the steps after the first, and the process's peak
    RSS; the first step's updated parameters go to ``spec["first_step"]`` (.npz)."""
    import onnxruntime as ort
    from device_runtime.artifact_contract import ANCHOR_MASK, ANCHORS, INPUT, LABELS, LAM as LAM_INPUT, LR as LR_INPUT
    rng = np.random.default_rng(0)
    session = _session(ort, spec["path"])
    weights = np.load(spec["weights"])
    dtypes = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
    feeds = {value.name: weights[value.name].astype(dtypes[value.type]) for value in session.get_inputs()
             if value.name in weights.files}
    feeds.update({INPUT: rng.standard_normal((spec["batch"], *STEP_SHAPE)).astype(np.float32),
                  LABELS: rng.integers(0, 10, spec["batch"]).astype(np.int64),
                  ANCHORS: (0.1 * rng.standard_normal(weights["anchors"].shape)).astype(np.float32),
                  ANCHOR_MASK: np.ones(len(weights["anchors"]), np.float32),
                  LR_INPUT: np.asarray(LR, np.float32), LAM_INPUT: np.asarray(LAM, np.float32)})
    names = [o.name for o in session.get_outputs()]
    walls, cpus = [], []
    for _ in range(spec["runs"]):
        wall, cpu = time.perf_counter(), time.thread_time()
        out = dict(zip(names, session.run(None, feeds)))
        walls.append(time.perf_counter() - wall)
        cpus.append(time.thread_time() - cpu)
        nexts = {name[:-len(".next")]: value for name, value in out.items() if name.endswith(".next")}
        if len(walls) == 1:
            np.savez(spec["first_step"], **nexts)
        feeds.update(nexts)
    with open("/proc/self/status") as status:
        peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    return dict(wall_ms=1e3 * float(np.median(walls[1:])), cpu_ms=1e3 * float(np.median(cpus[1:])),
                peak_rss_mb=peak / 2**20, machine=platform.machine(), onnxruntime=ort.__version__,
                weight_bytes=int(sum(feeds[v.name].nbytes for v in session.get_inputs()
                                     if v.name.startswith(("fe.", "head.")))))


def pool_feeds(rng, batch: int, channels: int, height: int, width: int) -> dict[str, np.ndarray]:
    """X standard normal but for its upper half, one value per channel (a blank image region through a conv: every
    window there is a tie), and G standard normal."""
    x = rng.standard_normal((batch, channels, height, width), np.float32)
    x[:, :, :height // 2] = rng.standard_normal((1, channels, 1, 1), np.float32)
    return dict(X=x, G=rng.standard_normal((batch, channels, height // 2, width // 2), np.float32))


def _time_forms(ort, config: str, paths: dict[str, str], feeds: dict) -> dict:
    """Each form's p50 thread-CPU and wall ms over interleaved blocks, and the relative error of its outputs against
    the first form's; RuntimeError where a form differs beyond FORM_TOLERANCE."""
    sessions = {form: _session(ort, path) for form, path in paths.items()}
    reference = next(iter(sessions.values())).run(None, feeds)
    error = {form: max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(s.run(None, feeds), reference))
             for form, s in sessions.items()}
    wrong = {form: e for form, e in error.items() if not e <= FORM_TOLERANCE}
    if wrong:
        raise RuntimeError(f"{config}: forms differ from the shipped one beyond {FORM_TOLERANCE:g}: {wrong}")
    times = {form: ([], []) for form in sessions}
    for _ in range(BLOCKS):
        for form, s in sessions.items():
            s.run(None, feeds)  # untimed
            for _ in range(PER_BLOCK):
                wall, cpu = _timed(s, feeds)
                times[form][0].append(wall)
                times[form][1].append(cpu)
    return {form: dict(wall_ms=1e3 * float(np.median(w)), cpu_ms=1e3 * float(np.median(c)), relative_error=error[form])
            for form, (w, c) in times.items()}


def time_graphs(spec: dict) -> dict:
    """Times of every graph in ``spec``: conv and pool forms per config (interleaved blocks, outputs checked against
    the first form), and each precision case in float32 and float16 (or why float16 does not load; ``spec["op_runs"]``
    timed runs each) with the ops the float16 graph ran."""
    import onnxruntime as ort
    rng = np.random.default_rng(0)
    result = dict(onnxruntime=ort.__version__, machine=platform.machine(), float16_hwcaps=float16_hwcaps(), conv={},
                  pool={}, precision=[])
    for config, paths in spec["conv"].items():
        batch, channels, side = (int(v) for v in config.split("x"))
        out = side - KERNEL + 1
        feeds = dict(X=rng.standard_normal((batch, channels, side, side), np.float32),
                     W=rng.standard_normal((C_OUT, channels, KERNEL, KERNEL), np.float32),
                     B=rng.standard_normal(C_OUT).astype(np.float32),
                     G=rng.standard_normal((batch, C_OUT, out, out), np.float32))
        result["conv"][config] = _time_forms(ort, config, paths, feeds)
    for config, paths in spec["pool"].items():
        batch, channels, height, width = (int(v) for v in config.split("x"))
        result["pool"][config] = _time_forms(ort, config, paths, pool_feeds(rng, batch, channels, height, width))
    for case in spec["precision"]:
        row = dict(op=case["op"], shapes=case["shapes"])
        for tag, dtype in (("f32", np.float32), ("f16", np.float16)):
            try:
                s = _session(ort, case[tag])
            except Exception as exc:  # a missing kernel: the answer, not a failure
                row[tag] = str(exc).splitlines()[0][:120]
                continue
            feeds = {f"x{i}": (rng.standard_normal(shape) * 0.1).astype(dtype) for i, shape in enumerate(case["shapes"])}
            s.run(None, feeds)
            row[tag] = 1e3 * float(np.median([_timed(s, feeds)[1] for _ in range(spec["op_runs"])]))
            if tag == "f16":
                with tempfile.TemporaryDirectory() as profile_dir:
                    row["f16_ops"] = _ops_run(ort, case[tag], feeds, profile_dir)
        result["precision"].append(row)
    return result


# ---------------------------------------------------------------------------------------------------------------
# Parent

def _precision_rows(timings: dict) -> list[str]:
    rows = []
    for row in timings["precision"]:
        half = row["f16"]
        cells = ([f"{half:.3f}", f"{half / row['f32']:.2f}", ", ".join(row["f16_ops"])] if isinstance(half, float)
                 else [f"not run: {half}", "", ""])
        rows.append(f"| {row['op']} | {row['shapes']} | {row['f32']:.3f} | " + " | ".join(cells) + " |")
    return rows


PRECISION_HEADER = ["| op | input shapes | float32 | float16 | float16/float32 | ops the float16 graph ran |",
                    "|---|---|---:|---:|---:|---|"]


def _step_rows(label: str, steps: dict, lost: dict) -> list[str]:
    changes = [f"changes {100 * lost['changed']:.1f} % of the parameters",
               f"loses {100 * lost['float16_lost_of_changed']:.1f} % of those changes"]
    return [f"| {label} | {graph} | {row['cpu_ms']:.2f} / {row['wall_ms']:.2f} | {row['peak_rss_mb']:.1f} | "
            f"{row['weight_bytes'] / 1024:.0f} | {change} |" for (graph, row), change in zip(steps.items(), changes)]


STEP_HEADER = ["| where | graph | step thread-CPU / wall ms | peak RSS (VmHWM) MiB | weights KiB | first step |",
               "|---|---|---:|---:|---:|---|"]


def tables(report: dict) -> str:
    version = report["timings"]["onnxruntime"]
    lines = _forms_table(f"First convolution, forward + weight gradient, 1 thread, onnxruntime {version}",
                         report["timings"]["conv"], FORMS, "N×C×H")
    lines += ["", *_forms_table(f"Max-pool 2×2 forward + backward to the first maximum, 1 thread, onnxruntime "
                                f"{version}", report["timings"]["pool"], POOL_FORMS, "N×C×H×W")]
    lines += ["", "One op at its step shape in float16 against float32, thread-CPU p50 ms, 1 thread", "",
              *PRECISION_HEADER, *_precision_rows(report["timings"])]
    lines += _loss_table(report)
    lines += ["", f"The {STEP_MODEL} {'x'.join(map(str, STEP_SHAPE))} dense step with float16 weights, batch 16, 1 thread "
              f"(medians of {STEP_REPEATS} fresh processes of {STEP_RUNS} steps)", "", *STEP_HEADER,
              *_step_rows(platform.machine(), report["half_weights"], report["lost_updates"])]
    return "\n".join(lines) + "\n"


def _forms_table(title: str, timings: dict, forms: tuple[str, ...], dims: str) -> list[str]:
    """Forms (rows) by config (columns): thread-CPU / wall p50 ms and the thread-CPU ratio to the first form."""
    lines = [f"{title} (p50 ms; ratio to the shipped form in thread-CPU time)", "",
             "| form | " + " | ".join(f"{dims} {c}: thread-CPU / wall ms (ratio)" for c in timings) + " |",
             "|---|" + "---:|" * len(timings)]
    for form in forms:
        cells = [f"{row[form]['cpu_ms']:.2f} / {row[form]['wall_ms']:.2f} "
                 f"({row[form]['cpu_ms'] / row[forms[0]]['cpu_ms']:.2f})" for row in timings.values()]
        lines.append(f"| {form} | " + " | ".join(cells) + " |")
    return lines


def _loss_table(report: dict) -> list[str]:
    lines = ["", "Share of one SGD step's updates (lr 5e-3, batch 16) lost to the weights' precision (PyTorch): of "
             "every parameter (a zero update counts as lost) / of the nonzero updates", "",
             "| model | parameters | nonzero updates | float16 weights | int8 weights |", "|---|---:|---:|---:|---:|"]
    for name, share in report["update_losses"].items():
        lines.append(f"| {name} | {share['params']} | {100 * share['updated']:.1f} % | "
                     f"{100 * share['fp16_lost']:.1f} % / {100 * share['fp16_lost_of_updated']:.1f} % | "
                     f"{100 * share['int8_lost']:.1f} % / {100 * share['int8_lost_of_updated']:.1f} % |")
    return lines


def arm64_tables(report: dict) -> str:
    """--arm64: the float16 ops and the float16-weights step here and in the emulated arm64 Debian."""
    lines = []
    for label, where in report["platforms"].items():
        t = where["timings"]
        caps = t["float16_hwcaps"]
        lines += [f"{label}: onnxruntime {t['onnxruntime']} on {t['machine']}"
                  + (f", CPU float16 features (auxv): fphp {caps['fphp']}, asimdhp {caps['asimdhp']}" if caps else "")
                  + f"; one op at its step shape, thread-CPU p50 ms of {where['op_runs']} runs", "",
                  *PRECISION_HEADER, *_precision_rows(t), ""]
    lines += [f"The {STEP_MODEL} {'x'.join(map(str, STEP_SHAPE))} dense step with float16 weights, batch 16, 1 thread, "
              "from the seed-0 weights (medians over fresh processes; emulated times and peaks are qemu-user's, not "
              "a board's)", "", *STEP_HEADER]
    for label, where in report["platforms"].items():
        lines += _step_rows(label, where["half_weights"], where["lost_updates"])
    lines += ["", "First step's updated parameters, aarch64 against x86_64 (max |Δ| / max |x86_64|): "
              + ", ".join(f"{graph} {d:.1e}" for graph, d in report["first_step_difference_across_platforms"].items())]
    lines += _loss_table(report)
    return "\n".join(lines) + "\n"


STEP_REPEATS = 3


def host_launcher(python: str) -> Callable[[list[str]], list[str]]:
    """A worker's command line in ``python`` here."""
    return lambda args: [python, *args]


def emulated_launcher(args: list[str]) -> list[str]:
    """A worker's command line in ARM64_PYTHON inside the emulated arm64 Debian, the repository bound at its path."""
    return [str(EMULATION), "run", "--bind", str(ROOT), shlex.join([ARM64_PYTHON, *args])]


def _run(launcher: Callable[[list[str]], list[str]], flag: str, spec: dict, spec_path: Path) -> dict:
    """A worker (``flag``) started by ``launcher`` on ``spec``; its JSON answer."""
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    done = subprocess.run(launcher([str(Path(__file__).resolve()), flag, str(spec_path)]), capture_output=True,
                          text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"the worker {flag} ({launcher([])}) failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def shipped_step(cache_dir: Path) -> Path:
    """The step graph of STEP_MODEL on STEP_SHAPE, dense, as the step compiler builds it (cached in ``cache_dir``)."""
    from device_runtime.artifact_contract import PORTABLE_KIND
    from export.artifacts import build_artifacts_of_kind
    from fedcore.models import build_model
    model = build_model(STEP_MODEL, STEP_SHAPE, 10, seed=0)
    artifacts = build_artifacts_of_kind(PORTABLE_KIND, model, {}, STEP_SHAPE, 10, cache_dir)
    return Path(artifacts.directory) / "step_model.onnx"


def seed_weights(path: Path) -> str:
    """STEP_MODEL's seed-0 parameters rounded to float16 (the shipped step's inputs by name, float32) and an
    ``anchors`` array of its shape, as .npz at ``path``: both step graphs then start from the same values."""
    from fedcore.models import build_model
    model = build_model(STEP_MODEL, STEP_SHAPE, 10, seed=0)
    np.savez(path, anchors=np.zeros((10, model.feature_dim), np.float32),
             **{name: value.detach().numpy().astype(np.float16).astype(np.float32)
                for name, value in model.state_dict().items()})
    return str(path)


def lost_updates(weights: str, float32_step: str, float16_step: str) -> dict:
    """From the first step of both graphs on the same (float16-representable) weights: the share of parameters the
    float32 step changes, and the share of those changes the float16 outputs lose (p.next == p)."""
    start, wide, half = np.load(weights), np.load(float32_step), np.load(float16_step)
    changed = lost = total = 0
    for name in wide.files:
        moved = wide[name] != start[name]
        changed, total = changed + int(moved.sum()), total + moved.size
        lost += int((moved & (half[name].astype(np.float32) == start[name])).sum())
    return dict(changed=changed / total, float16_lost_of_changed=lost / changed)


def max_relative_difference(first: str, second: str) -> float:
    """max |a - b| / max |b| over the parameters of two first-step outputs (.npz)."""
    a, b = np.load(first), np.load(second)
    return max(float(np.abs(a[k] - b[k]).max() / np.abs(b[k]).max()) for k in b.files)


def arm64_missing(cache_dir: Path) -> str | None:
    """Why --arm64 cannot run here, in one line a user can act on; None: it can."""
    if os.geteuid() != 0:
        return "the emulation needs root (chroot, mounts): run as root"
    if not (ARM64_ROOT / ".fedara-ready").exists():
        return (f"no emulated arm64 root at {ARM64_ROOT}: run scripts/arm64_emulation.sh setup (FEDARA_ARM64_ROOT "
                "picks another)")
    if not (ARM64_ROOT / ARM64_PYTHON.lstrip("/")).exists():
        return (f"no device bundle at {ARM64_PYTHON} in {ARM64_ROOT}: install it there with .venv/bin/python -m "
                "pytest -m arm64 tests/device/test_arm64.py")
    if not cache_dir.resolve().is_relative_to(ROOT):
        return f"--cache-dir {cache_dir} is outside {ROOT}, the folder bound into the emulation: pick one inside"
    return None


def measure_precision(launcher: Callable[[list[str]], list[str]], work: Path, tag: str, spec: dict,
                      graphs: dict[str, str], weights: str, runs: int, repeats: int) -> tuple[dict, dict, dict]:
    """The op timings of ``spec`` and the step graphs (``graphs``: label -> path, the float32 one first, ``repeats``
    fresh processes of ``runs`` steps each, in turn) in workers started by ``launcher``; the lost updates; the
    first-step outputs' paths (``work``/``tag``-…)."""
    timings = _run(launcher, "--worker", spec, work / "spec.json")
    steps = {label: [] for label in graphs}
    first = {label: str(work / f"{tag}-{i}.npz") for i, label in enumerate(graphs)}
    for _ in range(repeats):  # fresh processes in turn: each one's peak is its own
        for label, path in graphs.items():
            steps[label].append(_run(launcher, "--step-worker", dict(path=path, batch=16, weights=weights, runs=runs,
                                                                    first_step=first[label]), work / "step.json"))
    summary = {label: dict(cpu_ms=float(np.median([r["cpu_ms"] for r in rows])),
                           wall_ms=float(np.median([r["wall_ms"] for r in rows])),
                           peak_rss_mb=float(np.median([r["peak_rss_mb"] for r in rows])),
                           weight_bytes=rows[0]["weight_bytes"], runs=rows)
               for label, rows in steps.items()}
    return timings, summary, dict(lost_updates(weights, *first.values()), first_step=first)


def main(argv: list[str] | None = None) -> int:
    from device_runtime.help_format import CommandParser
    parser = CommandParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path)
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter with stock onnxruntime and numpy that times the graphs (default: this one)")
    parser.add_argument("--cache-dir", type=Path, default=ROOT / "artifacts_cache" / "bench_step_forms",
                        help="artifact cache for the compiled step graph (built once)")
    parser.add_argument("--arm64", action="store_true",
                        help="reduced precision only (not the convolution forms), here in --python and in the emulated "
                             "arm64 Debian of scripts/arm64_emulation.sh: bench_step_forms_arm64.{json,md}")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--step-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(time_graphs(json.loads(args.worker.read_text()))))
        return 0
    if args.step_worker:
        print(json.dumps(step_worker(json.loads(args.step_worker.read_text()))))
        return 0
    if args.out_dir is None:
        parser.error("--out-dir is required")
    why_not = arm64_missing(args.cache_dir) if args.arm64 else None
    if why_not:
        print(f"error: --arm64: {why_not}", file=sys.stderr)
        return 2
    command = " ".join([".venv/bin/python", "scripts/bench_step_forms.py", *(argv if argv is not None else sys.argv[1:])])
    load = os.getloadavg()
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.cache_dir if args.arm64 else None) as work_dir:
        work = Path(work_dir)

        def write(name: str, data: bytes) -> str:
            (work / name).write_bytes(data)
            return str(work / name)
        precision = [dict(op=op, shapes=shapes, f32=write(f"op{i}_f32.onnx", _op_graph(op, shapes, attrs, False)),
                          f16=write(f"op{i}_f16.onnx", _op_graph(op, shapes, attrs, True)))
                     for i, (op, shapes, attrs) in enumerate(PRECISION_CASES)]
        conv = {} if args.arm64 else {
            f"{b}x{c}x{s}": {form: write(f"conv{i}_{b}_{c}_{s}.onnx", _conv_graph(form, b, c, s))
                             for i, form in enumerate(FORMS)} for b, c, s in CONV_CONFIGS}
        shipped = shipped_step(args.cache_dir)
        graphs = {"float32 (shipped)": str(shipped), "float16 weights": write("half.onnx", half_weight_step(str(shipped)))}
        weights = seed_weights(work / "weights.npz")
        pool = {} if args.arm64 else {
            "x".join(map(str, config)): {form: write(f"pool{i}_{'_'.join(map(str, config))}.onnx",
                                                     _pool_graph(form, *config))
                                         for i, form in enumerate(POOL_FORMS)} for config in POOL_CONFIGS}
        host = dict(spec=dict(conv=conv, pool=pool, precision=precision, op_runs=BLOCKS * PER_BLOCK), runs=STEP_RUNS,
                    repeats=STEP_REPEATS)
        places = {f"{platform.machine()} (here)": (host_launcher(args.python), host)}
        if args.arm64:
            places["aarch64 (qemu-user)"] = (emulated_launcher, dict(spec=dict(conv={}, pool={}, precision=precision,
                                                                               op_runs=ARM64_OP_RUNS),
                                                                     runs=ARM64_STEP_RUNS, repeats=ARM64_STEP_REPEATS))
        measured = {label: measure_precision(launcher, work, f"place{i}", how["spec"], graphs, weights, how["runs"],
                                             how["repeats"])
                    for i, (label, (launcher, how)) in enumerate(places.items())}
        outputs = [lost.pop("first_step") for _, _, lost in measured.values()]
        across = {graph: max_relative_difference(outputs[-1][graph], outputs[0][graph]) for graph in graphs}
    from server.outputs.machine import cpu_name
    machine = dict(platform=platform.platform(), cpu=cpu_name(), cpus=os.cpu_count(), loadavg_at_start=list(load),
                   loadavg_at_end=list(os.getloadavg()))
    if args.arm64:
        name = "bench_step_forms_arm64"
        report = dict(command=command, machine=machine, update_losses=update_losses(),
                      first_step_difference_across_platforms=across,
                      platforms={label: dict(timings=timings, half_weights=steps, lost_updates=lost,
                                             op_runs=places[label][1]["spec"]["op_runs"],
                                             step_runs=places[label][1]["runs"], repeats=places[label][1]["repeats"])
                                 for label, (timings, steps, lost) in measured.items()})
        text = arm64_tables(report)
    else:
        name = "bench_step_forms"
        timings, steps, lost = next(iter(measured.values()))
        report = dict(command=command, machine=machine, timings=timings, update_losses=update_losses(),
                      half_weights=steps, lost_updates=lost)
        text = tables(report)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out_dir / f"{name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
