"""One plain-SGD step of CE + λ·L_FAC compiled into a default-domain ONNX graph: stock onnxruntime trains with it.

The step (forward, backward and the SGD update p ← p − lr·∂L/∂p of every parameter) is traced from
``fedcore.objective.local_loss`` by ``make_fx`` with a symbolic batch and exported by ``torch.onnx.export(...,
dynamo=True)`` at opset 18; the eval graph (logits and features) likewise. Three backward ops need help:
- ``aten.convolution_backward`` has no ONNX translation: decomposed here (:func:`_convolution_backward`);
- ``aten.max_pool2d_with_indices_backward`` neither: for windows that tile the input it routes the gradient by a mask
  of each window's first maximum (:func:`_max_pool2d_backward`), so the forward MaxPool needs no Indices output;
  ReLU's backward is a multiply by a mask (onnxruntime's Where is slow);
- ``aten.nll_loss_forward`` translates to NegativeLogLikelihoodLoss with its ``total_weight`` output filled with
  1 (torch 2.13), which silently multiplies every gradient by the batch size: torch's decomposition is used.
The rest is speed, each form measured against the one it replaced (docs/benchmarks.md): a convolution of
≥ GEMM_CONV_MIN_CHANNELS input channels runs in the step as one gather of patches shared by two GEMMs (forward and
weight gradient) and a GEMM + Col2Im (input gradient); a Linear layer as (W·xᵀ)ᵀ and a product a·Bᵀ with B wider
than a is tall as (B·aᵀ)ᵀ (:func:`_mm`), the parameters traced as contiguous tensors, as ONNX holds them (an SVD
factor is column-major in torch, which had hidden U's Linear from that form); ReLU → MaxPool as MaxPool → ReLU
(:func:`_pool_before_relu`); backpropagation starts from −lr so each gradient is the update; a matrix Expanded
over the batch into a MatMul is broadcast instead, and dead nodes are dropped.
Silent errors of any kind are why every compiled set passes :func:`check_parity` (one step in onnxruntime
against PyTorch eager on a random batch, each output within :func:`parity_tolerance`, a float32 error bound that
grows with the step's accumulated reduction length and the output's magnitude) before it is published.
Real edge models (issue 42), each form parity-checked at two batch sizes with the batch axis checked free:
- BatchNorm 1-D/2-D trains with its running statistics as step STATE: graph inputs named by their state_dict key
  (``fe.bn1.running_mean``), ``.next`` outputs that the training-mode forward updates, never differentiated
  (``fedcore.tensors``: the ``num_batches_tracked`` counter is dropped, ``momentum=None`` refused); an affine one
  by :class:`_BatchNormStatistics` (two reductions forward, x − μ kept for the backward: 17 % less time than
  torch's decomposition for a BatchNorm2d(64) + ReLU at 64×14×14, docs/your_model.md), others through torch's own
  decompositions (the exporter would emit an inference-mode BatchNormalization); the eval graph is traced in eval
  mode, on the running statistics;
- grouped and depthwise convolutions (forward: Conv; backward: :func:`_convolution_backward`), 1-D convolutions
  (as 2-D ones with a unit height axis), global average pools after any convolution form (:class:`_GlobalAvgPool`),
  ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` by the math attention path (:func:`_math_attention`),
  ReLU6/Hardswish/GELU/SiLU, LayerNorm, residual adds; ``nn.Embedding`` on token ids carried as float32
  (``fedcore.tokens``: a Cast and a Gather forward, a scatter-add backward; the trace and parity batches draw ids);
- Dropout with p > 0 is REFUSED (:func:`_check_modules`), not fed masks the device draws: masks shaped by every
  layer and by the batch would widen the graph contract, and no parity check could compare a step whose
  randomness is the device's with PyTorch's; Dropout(p=0) compiles. A model the compiler cannot take raises
  ``fedcore.tensors.UnsupportedModel``, one line naming the layer and the op (an op with no ONNX translation is
  traced back to its layer by an eager forward, :func:`_layer_using`), never a traceback.
The Frobenius term is not in the step: the device applies it once per epoch (``device_runtime.frobenius``).
Devices need onnxruntime ≥ 1.17 (opset 18; down-conversion to 17 fails on ReduceMean with input axes).
"""
from __future__ import annotations

import copy
import functools
import importlib.metadata
import logging
import re
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from torch import nn
from torch._decomp import get_decompositions
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import optimization_hint, statically_known_true
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from device_runtime.artifact_contract import (ANCHOR_MASK, ANCHORS, BATCH_DIM, EVAL_OUTPUTS, FEATURES, INPUT, LABELS,
                                              LAM, LOGITS, LOSS, LR, STEP_DATA_INPUTS, STEP_OUTPUTS, next_name)
from fedcore.lowrank import FE_PREFIX, FactorizedConv1d, FactorizedConv2d
from fedcore.objective import fac_loss, local_loss
from fedcore.tensors import UnsupportedModel, carried_tensors, check_tensors, state_names, without_counters
from fedcore.tokens import random_samples, token_vocabulary

HEAD_PREFIX = "head."

COMPILER_VERSION = 8  # bump whenever the emitted graphs change for the same inputs
BATCH_NORM_FORM_VERSION = 1  # bump when training-mode BatchNorm changes form (compiler_versions)
DEPTHWISE_FORM_VERSION = 2  # bump when a depthwise convolution's backward changes form (compiler_versions)
SAME_PADDED_FORM_VERSION = 1  # bump when a same-padded convolution's input gradient changes form (compiler_versions)
OPSET = 18
UNIT_ROUNDOFF = 2.0 ** -24
"""float32's unit roundoff u: a rounded operation's relative error is at most u."""
PARITY_ATOL = 1e-6
"""The parity bound's absolute floor, for outputs whose magnitude is near zero (a few ulps of the loss)."""
GEMM_CONV_MIN_CHANNELS = 8
PARITY_SEED = 0
_LOW_TRACE_BATCH = 5
aten = torch.ops.aten


class ParityError(RuntimeError):
    """A compiled graph whose step in onnxruntime differs from PyTorch's beyond :func:`parity_tolerance`: it is
    not published."""


class ExporterUnavailable(RuntimeError):
    """torch.onnx's dynamo exporter lacks onnxscript here: the portable artifact kind cannot be built."""


def compiler_versions(model: nn.Module | None = None) -> dict:
    """What the step graphs depend on beyond the model: goes into the artifact hash. A form only some models use
    has its own version, in the hash only of ``model``s that use it (so the zoo's hashes stay as they were):
    ``depthwise_backward`` where a Conv is depthwise (:func:`_convolution_backward`), ``batch_norm`` where a
    BatchNorm1d/2d is (:class:`_BatchNormStatistics`)."""
    try:
        onnxscript = importlib.metadata.version("onnxscript")
    except importlib.metadata.PackageNotFoundError:
        raise ExporterUnavailable("the onnxruntime artifact kind needs onnxscript: pip install 'onnx==1.17.0' "
                                  "'onnxscript==0.7.2' 'onnx-ir==0.2.1' (pyproject.toml's server extra)") from None
    versions = {"compiler": COMPILER_VERSION, "opset": OPSET, "torch": torch.__version__, "onnx": onnx.__version__,
                "onnxscript": onnxscript}
    if model is not None and any(isinstance(m, nn.Conv2d | nn.Conv1d) and 1 < m.groups == m.in_channels ==
                                 m.out_channels for m in model.modules()):
        versions["depthwise_backward"] = DEPTHWISE_FORM_VERSION
    if model is not None and any(isinstance(m, nn.BatchNorm1d | nn.BatchNorm2d) for m in model.modules()):
        versions["batch_norm"] = BATCH_NORM_FORM_VERSION
    if model is not None and any(_same_padded_layer(m) for m in model.modules()):
        versions["same_padded_input_grad"] = SAME_PADDED_FORM_VERSION
    return versions


def _same_padded(kernel, stride, padding, dilation) -> bool:
    """Stride 1, undilated, padding (k − 1)/2 on every axis: the output has the input's size, and the input
    gradient is itself such a convolution (of grad_out by the flipped, transposed kernel)."""
    return all(int(s) == 1 and int(d) == 1 and 2 * int(p) == int(k) - 1
               for k, s, p, d in zip(kernel, stride, padding, dilation, strict=True))


def _same_padded_layer(module: nn.Module) -> bool:
    """Whether an ungrouped Conv1d/Conv2d, dense or factorized, may put a same-padded convolution into the step
    graph: itself (:func:`_same_padded`) or a half that factorization makes of it — a Conv2d's 1×kw and kh×1
    halves are same-padded where their axis is, a Conv1d's 1-wide half always is. A superset (a version in the
    hash of a model whose graph it leaves as it was costs a compile), never a subset."""
    if isinstance(module, nn.Conv1d | FactorizedConv1d):
        return getattr(module, "groups", 1) == 1
    if not isinstance(module, nn.Conv2d | FactorizedConv2d) or getattr(module, "groups", 1) != 1:
        return False
    kernel = module.kernel_size if isinstance(module, nn.Conv2d) else module.weight_shape[2:]
    padding = {"same": tuple((k - 1) // 2 if k % 2 else -1 for k in kernel),
               "valid": (0,) * len(kernel)}.get(module.padding, module.padding)  # type: ignore[arg-type]
    dilation = getattr(module, "dilation", (1,) * len(kernel))
    return any(_same_padded((k,), (st,), (p,), (d,)) for k, st, p, d in zip(kernel, module.stride, padding, dilation))


def _gemm_conv(x: torch.Tensor, weight: torch.Tensor, dilation, transposed: bool, groups: int) -> bool:
    """Whether a convolution runs as patches × matrix (:func:`_patches`): ungrouped, undilated, with at least
    GEMM_CONV_MIN_CHANNELS input channels, so that every gathered block is a contiguous run of channels.
    Measured (stock onnxruntime 1.32, 1 thread, batch 16): FedAvgCNN's conv2 (32→64, 5×5 on 12×12) forward plus
    weight gradient 5.4 ms as Conv and swapped Conv in the step, against ~3 ms as one gather and two GEMMs;
    its conv1 (one input channel) 0.28 ms as Conv against 2.2 ms, as single floats are gathered one by one."""
    return (not transposed and groups == 1 and all(d == 1 for d in dilation)
            and int(x.shape[1]) >= GEMM_CONV_MIN_CHANNELS)


def _patches(x: torch.Tensor, kernel: tuple[int, int], stride, padding) -> tuple[torch.Tensor, tuple[int, int]]:
    """im2col of (N, C, H, W) as one gather: (N·oh·ow, kh·kw·C) with rows in (n, y, x) and columns in
    (ky, kx, c) order, and (oh, ow). The image goes channels-last, so each gathered block is C contiguous floats."""
    if any(padding):
        x = F.pad(x, (padding[1], padding[1], padding[0], padding[0]))
    c, h, w = (int(d) for d in x.shape[1:])  # the batch stays symbolic
    oh, ow = (h - kernel[0]) // stride[0] + 1, (w - kernel[1]) // stride[1] + 1
    rows = (torch.arange(oh) * stride[0]).reshape(oh, 1, 1, 1) + torch.arange(kernel[0]).reshape(1, 1, -1, 1)
    cols = (torch.arange(ow) * stride[1]).reshape(1, ow, 1, 1) + torch.arange(kernel[1]).reshape(1, 1, 1, -1)
    flat = x.permute(0, 2, 3, 1).reshape(-1, h * w, c)
    taken = torch.index_select(flat, 1, (rows * w + cols).reshape(-1))
    return taken.reshape(-1, kernel[0] * kernel[1] * c), (oh, ow)


class _Patches:
    """The patches of each convolution input, made once per trace: the backward's weight gradient multiplies the
    forward's own patches (one gather in the graph, not two). A 1-D convolution's input gets one unit height axis,
    also once, so its forward and backward share the patches too. While :meth:`over_batch` is open, convolutions
    stay Conv ops: the non-GEMM weight gradient convolves over the batch axis (the batch is its channel count),
    and the GEMM test's ``int()`` of that axis would fix the batch size into the graph."""

    def __init__(self) -> None:
        self._made: dict[tuple, tuple[torch.Tensor, tuple[int, int]]] = {}
        self._raised: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.batch_channels = False

    def __call__(self, x: torch.Tensor, kernel: tuple[int, int], stride, padding):
        key = (id(x), kernel, tuple(stride), tuple(padding))
        if key not in self._made:
            self._made[key] = (x, _patches(x, kernel, stride, padding))  # x held: its id stays its own
        return self._made[key][1]

    def two_d(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C, T) as (N, C, 1, T), the same tensor for the same ``x``."""
        if id(x) not in self._raised:
            self._raised[id(x)] = (x, x.unsqueeze(2))
        return self._raised[id(x)][1]

    @contextmanager
    def over_batch(self) -> Iterator[None]:
        self.batch_channels = True
        try:
            yield
        finally:
            self.batch_channels = False


def _as_2d(weight: torch.Tensor, stride, padding, dilation):
    """A 1-D convolution's weight and settings as those of the 2-D convolution with a unit height axis."""
    return weight.unsqueeze(2), [1, *stride], [0, *padding], [1, *dilation]


def _convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups, *, patches):
    """A convolution as patches × weight matrix (+ bias) where :func:`_gemm_conv` says so (1-D ones with a unit
    height axis); else the Conv op. The weight matrix is (C_out, kh·kw·C): a move of the channel axis, which
    onnxruntime transposes quickly."""
    if patches.batch_channels or not _gemm_conv(x, weight, dilation, transposed, groups):
        return NotImplemented
    if weight.dim() == 3:
        weight2, stride2, padding2, dilation2 = _as_2d(weight, stride, padding, dilation)
        return _convolution(patches.two_d(x), weight2, bias, stride2, padding2, dilation2, transposed,
                            output_padding, groups, patches=patches).squeeze(2)
    c_out = int(weight.shape[0])
    rows, (oh, ow) = patches(x, tuple(int(k) for k in weight.shape[2:]), stride, padding)
    y = rows @ weight.permute(0, 2, 3, 1).reshape(c_out, -1).transpose(0, 1)
    if bias is not None:
        y = y + bias
    return y.reshape(-1, oh, ow, c_out).permute(0, 3, 1, 2)


def _convolution_backward(grad_out, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding,
                          groups, output_mask, *, patches):
    """(dX, dW, db) of a 1-D or 2-D convolution, grouped or not, from GEMMs and ops ONNX has (1-D: as 2-D with a
    unit height axis).

    dX: for an ungrouped same-padded convolution (:func:`_same_padded`), the Conv of grad_out by the flipped,
    transposed kernel, same-padded (stock onnxruntime, 1 thread, batch 16, against MatMul + Col2Im: 1.02–1.08
    against 1.34–1.43 ms at 16 channels on 28×28, 3×3; 0.94–0.95 against 0.97–0.99 at 32 on 14×14; 0.30 against
    0.34 for a 1×1 of 64 channels on 14×14; 1.08 against 0.99 at 64 on 7×7; ResNet-8's step 0.6–4.8 % faster);
    elsewhere where :func:`_gemm_conv` holds, Col2Im (``F.fold``) of Wᵀ × grad_out; elsewhere the transposed
    convolution of grad_out (same groups; its output_padding taken from the input's size; a depthwise convolution
    of stride 1: the convolution of grad_out by the flipped kernel, 0.65 against 1.0 ms for ConvTranspose at
    DS-CNN's 64×14×14, batch 16, 1 thread).
    dW: where :func:`_gemm_conv` holds, grad_outᵀ × the forward's patches; for a depthwise convolution, its taps
    (:func:`_depthwise_weight_grad`); else a convolution over the batch: x as (C_in/G, G·N, H, W) by grad_out as
    (C_out, N, oh, ow) in G groups, the forward stride acting as dilation, cropped to the kernel (ungrouped: x with
    its batch and channel axes swapped). db: grad_out summed over batch and space.
    """
    if transposed:
        raise UnsupportedModel("a transposed convolution (ConvTranspose) is refused by the step compiler")
    if weight.dim() == 3:
        weight2, stride2, padding2, dilation2 = _as_2d(weight, stride, padding, dilation)
        grads = _convolution_backward(grad_out.unsqueeze(2), patches.two_d(x), weight2, bias_sizes, stride2,
                                      padding2, dilation2, transposed, output_padding, groups, output_mask,
                                      patches=patches)
        return (*(None if g is None else g.squeeze(2) for g in grads[:2]), grads[2])
    kernel = tuple(int(k) for k in weight.shape[2:])
    c_out, c_in = int(weight.shape[0]), int(weight.shape[1])
    gemm = _gemm_conv(x, weight, dilation, transposed, groups)
    grad_x = grad_w = grad_b = None
    if output_mask[0] and groups == 1 and _same_padded(kernel, stride, padding, dilation):
        with patches.over_batch():  # a Conv op, not patches of grad_out
            grad_x = F.conv2d(grad_out, weight.transpose(0, 1).flip((2, 3)), padding=padding)
    elif output_mask[0] and gemm:
        columns = weight.reshape(c_out, -1).transpose(0, 1) @ grad_out.reshape(grad_out.shape[0], c_out, -1)
        grad_x = F.fold(columns, tuple(int(d) for d in x.shape[2:]), kernel, stride=stride, padding=padding)
    elif output_mask[0] and _depthwise(x, weight, dilation, groups) and all(
            st == 1 and p <= k - 1 for st, p, k in zip(stride, padding, kernel)):
        grad_x = F.conv2d(grad_out, weight.flip((2, 3)), padding=[k - 1 - p for p, k in zip(padding, kernel)],
                          groups=groups)
    elif output_mask[0]:
        extra = [int(x.shape[2 + i]) - ((int(grad_out.shape[2 + i]) - 1) * stride[i] - 2 * padding[i]
                                        + dilation[i] * (kernel[i] - 1) + 1) for i in range(2)]
        grad_x = F.conv_transpose2d(grad_out, weight, stride=stride, padding=padding, output_padding=extra,
                                    groups=groups, dilation=dilation)
    if output_mask[1] and gemm:
        rows, _ = patches(x, kernel, stride, padding)
        matrix = grad_out.permute(0, 2, 3, 1).reshape(-1, c_out).transpose(0, 1) @ rows
        grad_w = matrix.reshape(c_out, kernel[0], kernel[1], c_in).permute(0, 3, 1, 2)
    elif output_mask[1] and _depthwise(x, weight, dilation, groups):
        grad_w = _depthwise_weight_grad(x, grad_out, kernel, stride, padding)
    elif output_mask[1]:
        h, w = (int(d) for d in x.shape[2:])
        by_group = (x.transpose(0, 1) if groups == 1 else
                    x.reshape(-1, groups, c_in, h, w).permute(2, 1, 0, 3, 4).reshape(c_in, -1, h, w))
        with patches.over_batch():
            swapped = F.conv2d(by_group, grad_out.transpose(0, 1), stride=dilation, padding=padding,
                               dilation=stride, groups=groups)
        grad_w = swapped[:, :, :kernel[0], :kernel[1]].transpose(0, 1)
    if output_mask[2]:
        grad_b = grad_out.sum(dim=(0, 2, 3))
    return grad_x, grad_w, grad_b


def _depthwise(x: torch.Tensor, weight: torch.Tensor, dilation, groups: int) -> bool:
    """A depthwise convolution: one input and one output channel per group, undilated."""
    return (groups > 1 and int(weight.shape[1]) == 1 and int(weight.shape[0]) == groups == int(x.shape[1])
            and all(d == 1 for d in dilation))


def _depthwise_weight_grad(x: torch.Tensor, grad_out: torch.Tensor, kernel: tuple[int, int], stride,
                           padding) -> torch.Tensor:
    """dW (C, 1, kh, kw) of a depthwise convolution from its kh·kw taps: per kernel offset, the strided window of
    the padded input times grad_out, summed over batch and space (Slice, Mul, ReduceSum). Measured (stock
    onnxruntime, 1 thread, DS-CNN's 64 channels on 14×14, batch 16, 3×3): 1.3 ms against 2.4 ms for the grouped
    Conv over the batch axis this replaces (the batch as channels, a 14×14 kernel per group)."""
    if any(padding):
        x = F.pad(x, (padding[1], padding[1], padding[0], padding[0]))
    oh, ow = (int(d) for d in grad_out.shape[2:])
    taps = [(x[:, :, ky:ky + (oh - 1) * stride[0] + 1:stride[0], kx:kx + (ow - 1) * stride[1] + 1:stride[1]]
             * grad_out).sum(dim=(0, 2, 3)) for ky in range(kernel[0]) for kx in range(kernel[1])]
    return torch.stack(taps, dim=1).reshape(-1, 1, kernel[0], kernel[1])


@contextmanager
def _exporter_quiet() -> Iterator[None]:
    """Keep torch.onnx's registry chatter (e.g. "torchvision is not installed") off the console during an export."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _threshold_backward(grad_out, result, threshold):
    """ReLU's backward as grad·(result > threshold): onnxruntime's Where with a scalar branch is ~10× a Mul."""
    return grad_out * (result > threshold).to(grad_out.dtype)


def _pow(x, exponent):
    """x**1 and x**2 (an MSE and its backward) as a copy and a Mul: onnxruntime's Pow calls pow() per element.
    Other exponents: NotImplemented, which make_fx takes as "trace the op itself"."""
    if exponent == 1:
        return x * 1.0
    if exponent == 2:
        return x * x
    return NotImplemented


def _upsample(t: torch.Tensor, kernel: tuple[int, int]) -> torch.Tensor:
    """Nearest-neighbour upsampling of (N, C, h, w) by ``kernel``: each pooled value back over its window (one
    Resize: 0.21 ms for 16×32×12×12 where a repeat by MatMul and Expand took ~0.33 ms)."""
    size = [int(t.shape[2]) * kernel[0], int(t.shape[3]) * kernel[1]]
    return aten.upsample_nearest2d.default(t, size)


def _max_pool2d_backward(grad_out, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    """Max-pool backward without the indices, for non-overlapping windows that tile the input (other pools: torch's
    scatter-add decomposition). The gradient goes to the first maximum of each window in row-major order, as
    PyTorch routes it: ties are real (a ReLU over a blank image region gives equal positive values): positions equal
    to the window's maximum get decreasing weights in row-major order, and the heaviest one per window is kept.
    onnxruntime's MaxPool with an Indices output is its generic kernel (slow); without, MLAS's."""
    kernel = tuple(kernel_size) * (2 // len(kernel_size))
    strides = tuple(stride or kernel) * (2 // len(stride or kernel))
    tiled = (strides == kernel and not any(padding) and all(d == 1 for d in dilation) and not ceil_mode
             and all(int(x.shape[2 + i]) % kernel[i] == 0 for i in range(2)))
    if not tiled:
        return _TORCH_POOL_BACKWARD(grad_out, x, kernel_size, stride, padding, dilation, ceil_mode, indices)
    return _upsample(grad_out, kernel) * _first_maxima(x, kernel).to(x.dtype)


def _max_pool(x: torch.Tensor, kernel: tuple[int, int]) -> torch.Tensor:
    return aten.max_pool2d_with_indices.default(x, list(kernel), list(kernel))[0]


def _first_maxima(x: torch.Tensor, kernel: tuple[int, int]) -> torch.Tensor:
    """True at the first maximum (row-major) of each ``kernel`` window tiling ``x``, false elsewhere."""
    equal = (x == _upsample(_max_pool(x, kernel), kernel)).to(x.dtype)
    rank = torch.arange(kernel[0] * kernel[1], 0, -1, dtype=x.dtype).reshape(kernel)
    key = equal * rank.repeat(int(x.shape[2]) // kernel[0], int(x.shape[3]) // kernel[1])
    return key == _upsample(_max_pool(key, kernel), kernel)


def _pool_windows(x: torch.Tensor, output_size) -> tuple[int, int] | None:
    """The window of an adaptive average pool whose output size divides its input's, else None."""
    size = [int(d) for d in x.shape[2:]]
    if any(o < 1 or n % o for n, o in zip(size, output_size)):
        return None
    return size[0] // int(output_size[0]), size[1] // int(output_size[1])


def _adaptive_avg_pool2d(x, output_size):
    """An adaptive average pool whose windows tile the input as a plain one (AveragePool; global: a mean)."""
    window = _pool_windows(x, output_size)
    if window is None:
        return NotImplemented
    if tuple(int(o) for o in output_size) == (1, 1):
        return x.mean(dim=(2, 3), keepdim=True)
    return F.avg_pool2d(x, window, window)


def _adaptive_avg_pool2d_backward(grad_out, x):
    """Its backward: each window's gradient spread evenly over the window (a nearest upsampling and a scale)."""
    window = _pool_windows(x, grad_out.shape[2:])
    if window is None:
        return NotImplemented
    if tuple(int(d) for d in grad_out.shape[2:]) == (1, 1):
        return (grad_out / (window[0] * window[1])).expand(x.shape)
    return _upsample(grad_out, window) / (window[0] * window[1])


def _addmm(bias, x, weight_t, beta=1, alpha=1):
    """A Linear layer's x·Wᵀ + b as (W·xᵀ)ᵀ + b where Wᵀ is the transpose of a contiguous weight: onnxruntime's
    GEMM packs its right operand on every run, and this way that operand is xᵀ (16 columns at batch 16), not
    the weight (4 MB for CNN1's fc1 and fc2). Measured in the step (onnxruntime's profiler, CNN1 dense, batch 16,
    1 thread): the two forward GEMMs 1058 + 1014 µs as x·Wᵀ, 592 + 531 µs as (W·xᵀ)ᵀ. Other addmms: as traced."""
    if beta != 1 or alpha != 1 or weight_t.dim() != 2 or weight_t.stride() != (1, int(weight_t.shape[0])):
        return NotImplemented
    return (weight_t.t() @ x.t()).t() + bias


def _row_major(t: torch.Tensor) -> bool:
    """Whether ``t`` (2-D) is a contiguous matrix, provably for every batch size (no guard on the batch)."""
    return (t.dim() == 2 and statically_known_true(t.stride(1) == 1)
            and statically_known_true(t.stride(0) == t.shape[1]))


def _transposed_contiguous(t: torch.Tensor) -> bool:
    """Whether ``t`` (2-D) is the transpose of a contiguous matrix, provably for every batch size."""
    return t.dim() == 2 and _row_major(t.t())


def _mm(a: torch.Tensor, b: torch.Tensor):
    """a·b as (bᵀ·aᵀ)ᵀ where a is a contiguous matrix and b the transpose of one with more columns than a has
    rows (at the trace's sizes; the choice is speed only): onnxruntime's GEMM packs its right operand on every
    run, and this way that operand is aᵀ, e.g. a factorized Linear's input gradient dz·vᵀ becomes (v·dzᵀ)ᵀ and
    packs the 16-column dzᵀ, not v. Other products: as traced."""
    if (not (_row_major(a) and _transposed_contiguous(b))
            or optimization_hint(a.shape[0]) >= optimization_hint(b.shape[1])):
        return NotImplemented
    return (b.t() @ a.t()).t()


def _decompositions(convolution_by_patches: bool) -> dict:
    """The op table of a trace. The eval graph keeps its convolutions as Conv ops (``convolution_by_patches``
    false): it runs at the evaluation batch of 64, where FedAvgCNN's conv2 patches alone take 13 MB of a device's
    peak, and it has no weight gradient to share them with."""
    table = get_decompositions([aten.nll_loss_forward, aten.nll_loss_backward, *_BATCH_NORM_OPS, *_ACTIVATION_BACKWARDS])
    patches = _Patches()
    if convolution_by_patches:
        table[aten.convolution.default] = functools.partial(_convolution, patches=patches)
    table[aten.convolution_backward.default] = functools.partial(_convolution_backward, patches=patches)
    table[aten.max_pool2d_with_indices_backward.default] = _max_pool2d_backward
    table[aten.threshold_backward.default] = _threshold_backward
    table[aten.addmm.default] = _addmm
    table[aten._adaptive_avg_pool2d.default] = _adaptive_avg_pool2d
    table[aten._adaptive_avg_pool2d_backward.default] = _adaptive_avg_pool2d_backward
    table[aten.mm.default] = _mm
    table[aten.pow.Tensor_Scalar] = _pow
    return table


_BATCH_NORM_OPS = (aten.native_batch_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_functional,
                   aten.native_batch_norm_backward)
"""Training-mode BatchNorm that :func:`_batch_norms_by_statistics` leaves (no affine parameters or no running
statistics) by torch's own decompositions (mean, variance, the running statistics' update): left to the
exporter, it becomes an inference-mode BatchNormalization (parity: 0.29 off). The eval graph's
``_native_batch_norm_legit_no_training`` is left to it: that one is an inference BatchNormalization."""

_ACTIVATION_BACKWARDS = (aten.silu_backward, aten.hardswish_backward, aten.hardsigmoid_backward,
                         aten.sigmoid_backward, aten.tanh_backward, aten.gelu_backward, aten.hardtanh_backward)
"""Activation backwards by torch's decompositions: the exporter has no translation for SiLU's and Hardswish's."""

_TORCH_POOL_BACKWARD = get_decompositions([aten.max_pool2d_with_indices_backward])[
    aten.max_pool2d_with_indices_backward.default]


def _drop_unused_pool_indices(model: onnx.ModelProto) -> None:
    """MaxPool nodes whose Indices output nothing reads lose it: onnxruntime then runs MLAS's pooling kernel (its
    value_info goes with :func:`_drop_dead_nodes`)."""
    read = {name for node in model.graph.node for name in node.input} | {o.name for o in model.graph.output}
    for node in model.graph.node:
        if node.op_type == "MaxPool" and len(node.output) == 2 and node.output[1] not in read:
            node.output.pop()


def _broadcast_matmul_operands(model: onnx.ModelProto) -> None:
    """A MatMul operand that is a matrix Expanded over the batch becomes the matrix itself: ONNX's MatMul
    broadcasts it (the same products), and onnxruntime then skips the copy (0.29 ms for FedAvgCNN's conv2 Wᵀ)."""
    producer = {out: node for node in model.graph.node for out in node.output}
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in
             [*model.graph.value_info, *model.graph.input, *model.graph.output] if v.type.tensor_type.HasField("shape")}
    ranks |= {t.name: len(t.dims) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "MatMul":
            continue
        for i, other in ((0, 1), (1, 0)):
            expand = producer.get(node.input[i])
            if (expand is not None and expand.op_type == "Expand" and ranks.get(expand.input[0]) == 2
                    and ranks.get(node.input[i]) == ranks.get(node.input[other]) == 3):
                node.input[i] = expand.input[0]


def _drop_dead_nodes(model: onnx.ModelProto) -> None:
    """Nodes and initializers that no graph output depends on are removed (what a rewrite above left unread)."""
    needed = {o.name for o in model.graph.output}
    kept = []
    for node in reversed(model.graph.node):
        if any(out in needed for out in node.output):
            kept.append(node)
            needed.update(node.input)
    del model.graph.node[:]
    model.graph.node.extend(reversed(kept))
    initializers = [t for t in model.graph.initializer if t.name in needed]
    del model.graph.initializer[:]
    model.graph.initializer.extend(initializers)
    values = [v for v in model.graph.value_info if v.name in needed]
    del model.graph.value_info[:]
    model.graph.value_info.extend(values)


def trace_batch_size(model: nn.Module, input_shape: tuple[int, ...], num_classes: int) -> int:
    """A batch size no tensor dimension has: a batch equal to one (16 = conv1's channels) would be specialised."""
    taken = {int(d) for p in model.state_dict().values() for d in p.shape} | set(input_shape) | {num_classes}
    return next(b for b in range(_LOW_TRACE_BATCH, 10_000) if b not in taken)


def _loss(model: nn.Module, state: dict[str, torch.Tensor], x, labels, anchors, mask, lam):
    """(CE + λ·L_FAC, logits) with the tensors given by name; λ is a tensor, so the term is always traced."""
    features = functional_call(model.fe, _strip(state, FE_PREFIX), (x,))
    logits = functional_call(model.head, _strip(state, HEAD_PREFIX), (features,))
    return F.cross_entropy(logits, labels) + lam * fac_loss(features, labels, anchors, mask), logits


def _strip(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def _step_function(model: nn.Module, names: tuple[str, ...], state: tuple[str, ...]) -> Callable:
    """f(input, labels, anchors, mask, λ, lr, *tensors) -> (loss, logits, *next tensors), ``model`` in training mode.

    A parameter's next value is p − lr·∂L/∂p. Backpropagation starts from −lr instead of 1, so each gradient
    arrives as the update itself and a parameter needs one Add (which onnxruntime folds into a weight gradient's
    GEMM) instead of a Mul and a Sub over it. A ``state`` tensor (BatchNorm's running statistics) goes in as a
    copy that the forward updates in place, and comes out as that copy: never differentiated."""

    def step(x, labels, anchors, mask, lam, lr, *tensors):
        given = dict(zip(names, tensors))
        buffers = {n: given[n].clone() for n in state}
        params = {n: v.detach().requires_grad_() for n, v in given.items() if n not in buffers}
        loss, logits = _loss(model, params | buffers, x, labels, anchors, mask, lam)
        steps = dict(zip(params, torch.autograd.grad(loss, tuple(params.values()), grad_outputs=-lr)))
        after = {n: buffers[n].detach() if n in buffers else params[n].detach() + steps[n] for n in names}
        return (loss.detach(), logits.detach(), *after.values())

    return step


def _eval_function(model: nn.Module, names: tuple[str, ...]) -> Callable:
    """f(input, *tensors) -> (logits, features), ``model`` in eval mode (BatchNorm by its running statistics)."""

    def forward(x, *tensors):
        features = functional_call(model.fe, _strip(dict(zip(names, tensors)), FE_PREFIX), (x,))
        return functional_call(model.head, _strip(dict(zip(names, tensors)), HEAD_PREFIX), (features,)), features

    return forward


def example_inputs(input_shape: tuple[int, ...], num_classes: int, feature_dim: int, batch: int,
                   seed: int, vocabulary: int | None = None) -> dict[str, torch.Tensor]:
    """A random batch with labels, anchors, a mask with one class absent, λ = 2 and lr = 0.05, by graph input name;
    token ids below ``vocabulary`` as samples where given (``fedcore.tokens``)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(num_classes)
    mask[-1] = 0.0
    return {INPUT: random_samples(input_shape, batch, g, vocabulary),
            LABELS: torch.randint(0, num_classes, (batch,), generator=g),
            ANCHORS: torch.randn(num_classes, feature_dim, generator=g) * 0.1,
            ANCHOR_MASK: mask, LAM: torch.tensor(2.0), LR: torch.tensor(0.05)}


@contextmanager
def _math_attention() -> Iterator[None]:
    """Attention as its math form while tracing: the CPU flash-attention kernel's backward has no ONNX
    translation, and the fused fast paths of nn.MultiheadAttention / nn.TransformerEncoderLayer (taken in eval
    mode) neither."""
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)


def _trace(function: Callable, args: tuple[torch.Tensor, ...], convolution_by_patches: bool) -> torch.fx.GraphModule:
    """make_fx with a symbolic batch, the decompositions above and math attention; random ops refused."""
    with _math_attention():
        traced = make_fx(function, decomposition_table=_decompositions(convolution_by_patches),
                         tracing_mode="symbolic")(*args)
    for node in traced.graph.nodes:
        if node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            raise UnsupportedModel(f"the model: the random op {node.target} is refused: {_RANDOM_REFUSED}")
    return traced


_RANDOM_REFUSED = ("a step graph's random draws are onnxruntime's, which no PyTorch reference (the parity gate) "
                   "can reproduce: use Dropout(p=0) or none")


def _check_modules(model: nn.Module) -> None:
    """UnsupportedModel for a layer the compiler refuses, named: Dropout with p > 0 (nn.Dropout*, the attention
    dropout of nn.MultiheadAttention) and transposed convolutions. Dropout is refused rather than fed masks the
    device draws: masks shaped by every layer and the batch would widen the graph contract, and no parity check
    could compare a step whose randomness is the device's with PyTorch's."""
    for name, module in model.named_modules():
        p = module.p if isinstance(module, nn.modules.dropout._DropoutNd) else (
            module.dropout if isinstance(module, nn.MultiheadAttention) else 0.0)
        if p > 0:
            raise UnsupportedModel(f"{name}: {type(module).__name__} with dropout p={p:g} is refused: "
                                   f"{_RANDOM_REFUSED}")
        if isinstance(module, nn.modules.conv._ConvTransposeNd):
            raise UnsupportedModel(f"{name}: {type(module).__name__} is refused by the step compiler (no "
                                   "transposed convolution backward): use an upsampling and a Conv")


class _OpSites(TorchDispatchMode):
    """The innermost module (by name) that first called each aten op in an eager forward."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.stack: list[str] = []
        self.sites: dict[str, str] = {}
        self._hooks = [h for name, m in model.named_modules() if name for h in (
            m.register_forward_pre_hook(functools.partial(self._enter, name)), m.register_forward_hook(self._leave))]

    def _enter(self, name: str, *_) -> None:
        self.stack.append(name)

    def _leave(self, *_) -> None:
        self.stack.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.sites.setdefault(func.overloadpacket.__name__, self.stack[-1] if self.stack else "the model")
        return func(*args, **(kwargs or {}))

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _layer_using(model: nn.Module, op: str, input_shape: tuple[int, ...]) -> str:
    """The layer whose forward calls aten ``op`` (or, for ``X_backward``, ``X``; else an op whose name contains
    or is contained in it, as ``prims.bessel_i0`` for ``aten.i0``), found by one eager forward."""
    traced = copy.deepcopy(model).train()
    sites = _OpSites(traced)
    try:
        with sites, torch.no_grad():
            traced(torch.randn(2, *input_shape))
    except Exception:  # noqa: BLE001 - naming the layer is best effort; the refusal stands without it
        return "the model"
    finally:
        sites.close()
    base = op.split(".")[1] if "." in op else op
    exact = [n for n in (base, base.removesuffix("_backward")) if n in sites.sites]
    related = sorted((n for n in sites.sites if len(n) > 1 and (n in base or base in n)), key=len, reverse=True)
    return sites.sites[(exact or related)[0]] if exact or related else "the model"


_NO_TRANSLATION = re.compile(r"No ONNX function found for <OpOverload\(op='([\w.]+)'")


def _export(function: Callable, args: tuple[torch.Tensor, ...], input_names: list[str],
            output_names: list[str], convolution_by_patches: bool) -> onnx.ModelProto:
    """make_fx (symbolic shapes, the decompositions above) then the dynamo exporter; the batch dim is named and
    checked dynamic (a batch fixed to the trace's would pass a parity check run at that batch)."""
    traced = _trace(function, args, convolution_by_patches)
    batch = torch.export.Dim(BATCH_DIM)
    dynamic = tuple({0: batch} if name in (INPUT, LABELS) else None for name in input_names)
    with warnings.catch_warnings(), _exporter_quiet():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(traced, args, dynamo=True, opset_version=OPSET, input_names=input_names,
                                    output_names=output_names, dynamic_shapes=dynamic, optimize=True,
                                    verbose=False, report=False)
    model = program.model_proto
    _drop_unused_pool_indices(model)
    _broadcast_matmul_operands(model)
    _drop_dead_nodes(model)
    for value in [*model.graph.input, *model.graph.output]:
        if value.type.tensor_type.shape.dim and value.type.tensor_type.shape.dim[0].dim_param:
            value.type.tensor_type.shape.dim[0].dim_param = BATCH_DIM
    check_dynamic_batch(model)
    onnx.checker.check_model(model, full_check=True)
    return model


def check_dynamic_batch(model: onnx.ModelProto) -> None:
    """ParityError unless the batch axis of the graph's input (and labels, logits, features) is the named
    dimension BATCH_DIM: a graph traced with the batch fixed runs at that batch only."""
    batched = (INPUT, LABELS, LOGITS, FEATURES)
    fixed = [v.name for v in [*model.graph.input, *model.graph.output] if v.name in batched
             and v.type.tensor_type.shape.dim[0].dim_param != BATCH_DIM]
    if fixed:
        raise ParityError(f"compiled graph has a fixed batch axis at {fixed}: a trace fixed the batch size "
                          "(an int() of a symbolic axis in export/step_compiler.py)")


def _pool_before_relu(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose feature extractor runs each ReLU → MaxPool2d pair as MaxPool2d → ReLU: the same
    values and the same gradients (max commutes with the monotone ReLU; a window whose maximum is ≤ 0 passes no
    gradient either way, and one whose maximum is > 0 has the same first maximum), with the ReLU and its backward
    on a quarter of the elements. Parameter names are unchanged; the parity check compares with ``model`` itself."""
    if not isinstance(model.fe, nn.Sequential):
        return model
    traced = copy.deepcopy(model)
    layers = list(traced.fe.named_children())
    for i in range(len(layers) - 1):
        if isinstance(layers[i][1], nn.ReLU) and isinstance(layers[i + 1][1], nn.MaxPool2d):
            layers[i], layers[i + 1] = layers[i + 1], layers[i]
    traced.fe = nn.Sequential(OrderedDict(layers))
    return traced


class _GlobalAvgPool(nn.Module):
    """``nn.AdaptiveAvgPool1d/2d`` to output size 1 as a mean over the spatial axes. ATen's own global pool
    restrides its result like its input, which after a convolution by patches is a channels-last view; a Flatten
    of that is exported as as_strided_scatter, which ONNX lacks."""

    def __init__(self, axes: tuple[int, ...]):
        super().__init__()
        self.axes = axes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=self.axes, keepdim=True)


def _global_pools_as_means(model: nn.Module) -> nn.Module:
    """``model`` with each adaptive average pool to size 1 replaced by :class:`_GlobalAvgPool`."""
    for name, module in list(model.named_modules()):
        if not isinstance(module, (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d)):
            continue
        size = module.output_size
        if all(d == 1 for d in ((size,) if isinstance(size, int) else size)):
            parent, _, child = name.rpartition(".")
            axes = (-1,) if isinstance(module, nn.AdaptiveAvgPool1d) else (-2, -1)
            setattr(model.get_submodule(parent), child, _GlobalAvgPool(axes))
    return model


class _BatchNormStatistics(torch.autograd.Function):
    """Training-mode batch normalization with its statistics in the fewest passes over the activations, and a
    backward that reuses the centred input x − μ the forward computed (torch's decomposition computes the mean twice,
    once for var_mean and once more as sum/n, and recomputes x − μ twice, in the forward and the backward).
    forward(x, weight, bias) -> (y, μ, σ²): μ = mean(x), σ² = mean((x − μ)²) over every axis but the channels,
    y = (x − μ)·(w·rstd) + b with rstd = 1/√(σ² + ε). The backward is native_batch_norm_backward's formula in
    training mode: ∂x = (g − (x − μ)·Σ(g·(x − μ))·rstd²/n − Σg/n)·w·rstd, ∂w = Σ(g·(x − μ))·rstd, ∂b = Σg."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        dims = (0, *range(2, x.dim()))
        shape = (1, -1, *(1,) * (x.dim() - 2))
        mean = x.mean(dims, keepdim=True)
        centred = x - mean
        var = (centred * centred).mean(dims, keepdim=True)
        rstd = torch.rsqrt(var + eps)
        scale = weight.reshape(shape) * rstd
        ctx.save_for_backward(centred, rstd, scale)
        ctx.dims = dims
        ctx.mark_non_differentiable(mean, var)
        return centred * scale + bias.reshape(shape), mean, var

    @staticmethod
    def backward(ctx, grad, _mean, _var):
        centred, rstd, scale = ctx.saved_tensors
        n = centred.numel() // centred.shape[1]
        grad_sum = grad.sum(ctx.dims, keepdim=True)
        dot = (grad * centred).sum(ctx.dims, keepdim=True)
        projection = centred * (dot * (rstd * rstd) / n)
        grad_x = (grad - projection - grad_sum / n) * scale
        return grad_x, (dot * rstd).flatten(), grad_sum.flatten(), None


class _TrainingBatchNorm(nn.Module):
    """A training-mode ``nn.BatchNorm1d/2d`` (affine, running statistics, a momentum) by
    :class:`_BatchNormStatistics`, its parameters and running statistics under the same names; the running
    statistics updated in place as torch does (momentum·batch + (1 − momentum)·running, the variance unbiased)."""

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm):
        super().__init__()
        self.weight, self.bias = bn.weight, bn.bias
        self.register_buffer("running_mean", bn.running_mean)
        self.register_buffer("running_var", bn.running_var)
        self.eps, self.momentum = bn.eps, bn.momentum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, mean, var = _BatchNormStatistics.apply(x, self.weight, self.bias, self.eps)
        n = x.numel() // x.shape[1]
        with torch.no_grad():
            self.running_mean.copy_(self.momentum * mean.flatten() + (1 - self.momentum) * self.running_mean)
            self.running_var.copy_(self.momentum * (var.flatten() * (n / (n - 1)))
                                   + (1 - self.momentum) * self.running_var)
        return y


def _batch_norms_by_statistics(model: nn.Module) -> nn.Module:
    """``model`` (in training mode) with each affine BatchNorm that tracks running statistics replaced by
    :class:`_TrainingBatchNorm`; others keep torch's decomposition."""
    for name, module in list(model.named_modules()):
        if (isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d)) and module.training and module.affine
                and module.track_running_stats and module.momentum is not None):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, _TrainingBatchNorm(module))
    return model


def _traced_copy(model: nn.Module, training: bool) -> nn.Module:
    """A copy of ``model`` to trace: in training or eval mode, without BatchNorm counters, ReLU → MaxPool2d
    swapped (:func:`_pool_before_relu`), global average pools as means (:class:`_GlobalAvgPool`), in training
    mode BatchNorm by its statistics (:func:`_batch_norms_by_statistics`)."""
    traced = _global_pools_as_means(_pool_before_relu(without_counters(copy.deepcopy(model).train(training))))
    return _batch_norms_by_statistics(traced) if training else traced


def compile_step(model: nn.Module, input_shape: tuple[int, ...], num_classes: int,
                 feature_dim: int) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(step graph, eval graph) of ``model`` (a client model: dense or factorized) with the contract's I/O names:
    its carried tensors (``fedcore.tensors``) by state_dict name, BatchNorm's running statistics as step state.
    UnsupportedModel (one line, the layer named) for a model the compiler cannot take."""
    check_tensors(model)
    _check_modules(model)
    try:
        return _compile(model, input_shape, num_classes, feature_dim)
    except torch.onnx.errors.OnnxExporterError as e:
        missing = _NO_TRANSLATION.search(str(e))
        if missing is None:
            raise
        op = missing.group(1)
        raise UnsupportedModel(f"{_layer_using(model, op, input_shape)}: the op {op} has no ONNX translation "
                               "(stock onnxruntime cannot run it): replace that layer") from None


def _compile(model: nn.Module, input_shape: tuple[int, ...], num_classes: int,
             feature_dim: int) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    names = tuple(carried_tensors(model))
    state = state_names(model)
    # contiguous, as the graph's inputs are: the stride-keyed forms (_addmm, _mm) must see the layout ONNX has
    tensors = tuple(t.detach().clone(memory_format=torch.contiguous_format) for t in carried_tensors(model).values())
    data = example_inputs(input_shape, num_classes, feature_dim, trace_batch_size(model, input_shape, num_classes),
                          PARITY_SEED, token_vocabulary(model))
    step = _export(_step_function(_traced_copy(model, True), names, state), (*data.values(), *tensors),
                   [*STEP_DATA_INPUTS, *names], [*STEP_OUTPUTS, *(next_name(n) for n in names)],
                   convolution_by_patches=True)
    evaluate = _export(_eval_function(_traced_copy(model, False), names), (data[INPUT], *tensors), [INPUT, *names],
                       list(EVAL_OUTPUTS), convolution_by_patches=False)
    return step, evaluate


def _reference_step(model: nn.Module, data: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """One SGD step of ``fedcore.objective.local_loss`` in PyTorch eager (training mode): loss, logits, the new
    parameters and the running statistics the forward updated."""
    client = copy.deepcopy(model).train()
    loss, logits = local_loss(client, data[INPUT], data[LABELS], data[ANCHORS], data[ANCHOR_MASK], float(data[LAM]))
    client.zero_grad()
    loss.backward()
    out = {LOSS: loss.detach().numpy(), LOGITS: logits.detach().numpy()}
    with torch.no_grad():
        for name, p in client.named_parameters():
            out[next_name(name)] = (p - data[LR] * p.grad).numpy()
        for name in state_names(client):
            out[next_name(name)] = carried_tensors(client)[name].numpy()
    return out


def parity_batches(model: nn.Module, input_shape: tuple[int, ...], num_classes: int) -> tuple[int, int]:
    """The two batch sizes the parity gate runs: the trace's, and one more than it (the batch axis must be free)."""
    traced = trace_batch_size(model, input_shape, num_classes)
    return traced, traced + 1


def gamma(n: int) -> float:
    """Higham's γ_n = n·u / (1 − n·u): the relative error bound of a float32 sum or dot product of n terms, and
    of a chain of products whose reduction lengths add up to n (Accuracy and Stability of Numerical Algorithms,
    2nd ed., Lemma 3.1 and Theorem 3.7)."""
    nu = n * UNIT_ROUNDOFF
    if nu >= 1:
        raise ValueError(f"a reduction length of {n} is beyond float32's error bound (n·u ≥ 1)")
    return nu / (1 - nu)


def parity_tolerance(reduction_length: int, magnitude: float) -> float:
    """How far onnxruntime's value of one output may lie from PyTorch's: PARITY_ATOL + 2·γ_N·magnitude.

    Both runtimes compute the same function in float32 with reductions in different orders (GEMM blocking,
    patches against direct convolution, fused kernels), each within γ_N·M of the exact value by the bound of a
    chain of products, N the accumulated reduction length (:class:`_ReductionLengths`: the sum of every reduction
    the step runs, an upper bound on the lengths along any one path) and M the magnitude of what was summed, so
    their difference within twice that. M is norm-wise (max over a tensor, the ∞-norm), so an output whose
    elements cancel to near zero is not judged against its own tiny size: a forward output's or running
    statistic's own max |t|; a parameter's max |p| plus the step's largest update max over every parameter of
    |p − p'| (:func:`_parity_at`): a bias that starts at zero holds only its update, whose terms are as large as
    any gradient's. A ReLU or max-pool input that lands within rounding of its kink may take the other branch in
    one runtime, which is not a rounding error but changes one term of the sums behind it, propagated as a
    gradient is: the same bound covers it (measured: ResNet-8 at rank ratio 0.5, 1×28×28, up to 6.4e-5 where the
    bound is 1.1e-4 and more). Real mistranslations lie far outside it: a gradient of the wrong sign or scale
    moves an update by its own size, an inference-mode BatchNorm in a training step moves the logits by tenths."""
    return PARITY_ATOL + 2.0 * gamma(reduction_length) * magnitude


def _product(shape) -> int:
    return int(np.prod([int(d) for d in shape]))


class _ReductionLengths(TorchDispatchMode):
    """The accumulated reduction length of what runs under it: Σ over every aten op of the number of terms each of
    its outputs sums (a matrix product's inner size, a convolution's c_in/groups·k, its backward's c_out/groups·k
    and batch·positions, a mean or BatchNorm statistic's count, a softmax's row)."""

    _MATRIX = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear"}
    _ROW_OPS = {"_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data"}

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.total += self._length(func.overloadpacket.__name__, args, out)
        return out

    def _length(self, op: str, args, out) -> int:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not tensors:
            return 0
        first = tensors[0]
        if op in self._MATRIX:
            matrix = args[1] if op in ("addmm", "baddbmm", "addbmm") else args[0]
            return int(matrix.shape[-1])
        if op == "convolution":
            weight = args[1]
            return _product(weight.shape[1:])
        if op == "convolution_backward":
            grad_out, weight = args[0], args[2]
            groups = int(args[-2]) if isinstance(args[-2], int) else 1
            return int(weight.shape[0]) // max(groups, 1) * _product(weight.shape[2:]) + \
                int(grad_out.shape[0]) * _product(grad_out.shape[2:])
        if op == "embedding_dense_backward":  # a scatter-add: a row sums up to every token's gradient
            return int(args[1].numel())
        if op in self._ROW_OPS:
            dim = next((a for a in args[1:] if isinstance(a, int)), -1)
            return int(first.shape[dim])
        first_out = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(first_out, torch.Tensor) and first.numel() > first_out.numel() > 0 and (
                "sum" in op or "mean" in op or "var" in op or "std" in op or "norm" in op):
            return first.numel() // first_out.numel()
        if "batch_norm" in op or "layer_norm" in op:  # statistics (forward) and their backward: 2 sums each
            weight = next((a for a in args[1:] if isinstance(a, torch.Tensor) and a.dim() == 1), None)
            per = first.numel() // int(weight.numel()) if weight is not None and weight.numel() else first.numel()
            return 2 * per
        return 0


def reduction_lengths(model: nn.Module, data: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(forward, step): the accumulated reduction lengths of ``model``'s forward on ``data`` in eval mode and of
    one training step (forward, backward, update), counted on PyTorch eager (:class:`_ReductionLengths`)."""
    forward, step = _ReductionLengths(), _ReductionLengths()
    reference = copy.deepcopy(model).eval()
    with forward, torch.no_grad():
        reference.head(reference.fe(data[INPUT]))
    with step:
        _reference_step(model, data)
    return forward.total, step.total


def check_parity(model: nn.Module, step: onnx.ModelProto, evaluate: onnx.ModelProto, input_shape: tuple[int, ...],
                 num_classes: int, feature_dim: int, session: Callable[[bytes], object]) -> float:
    """Max |Δ| of one step and one forward in onnxruntime vs PyTorch eager on a random batch whose samples are
    blank in their first half (ties in max-pool windows), at both :func:`parity_batches`; ParityError where an
    output lies beyond its :func:`parity_tolerance` (the eval graph's outputs by the forward's reduction length,
    the step's by the step's). ``session(model_bytes)`` opens an onnxruntime InferenceSession (the caller's
    build)."""
    sessions = session(step.SerializeToString()), session(evaluate.SerializeToString())
    outputs = [o.name for o in step.graph.output], [o.name for o in evaluate.graph.output]
    worst = 0.0
    for i, batch in enumerate(parity_batches(model, input_shape, num_classes)):
        worst = max(worst, _parity_at(model, sessions, outputs, input_shape, num_classes, feature_dim, batch,
                                      PARITY_SEED + 1 + i))
    return worst


def _parity_at(model: nn.Module, sessions, outputs, input_shape: tuple[int, ...], num_classes: int,
               feature_dim: int, batch: int, seed: int) -> float:
    data = example_inputs(input_shape, num_classes, feature_dim, batch, seed, token_vocabulary(model))
    if len(input_shape) >= 2:
        data[INPUT][:, :, :input_shape[1] // 2] = 0.0  # a blank region: equal maxima in pooling windows (ties)
    tensors = {k: v.detach().numpy() for k, v in carried_tensors(model).items()}
    feeds = {k: v.numpy() for k, v in data.items()} | tensors
    expected = _reference_step(model, data)
    got = dict(zip(outputs[0], sessions[0].run(None, feeds)))
    reference = copy.deepcopy(model).eval()
    with torch.no_grad():
        features = reference.fe(data[INPUT])
        expected_eval = {LOGITS: reference.head(features).numpy(), FEATURES: features.numpy()}
    got_eval = dict(zip(outputs[1], sessions[1].run(None, {INPUT: feeds[INPUT]} | tensors)))
    forward_length, step_length = reduction_lengths(model, data)
    parameters = {next_name(n): n for n in tensors if n not in state_names(model)}
    largest_update = max((float(np.abs(tensors[p] - expected[k]).max()) for k, p in parameters.items()),
                         default=0.0)

    def magnitude(name: str, reference: np.ndarray) -> float:
        size = float(np.max(np.abs(reference), initial=0.0))
        return float(np.max(np.abs(tensors[parameters[name]]), initial=0.0)) + largest_update \
            if name in parameters else size

    pairs = [(k, v, got.get(k), step_length) for k, v in expected.items()]
    pairs += [(k, v, got_eval.get(k), forward_length) for k, v in expected_eval.items()]
    missing = [k for k, want, value, _ in pairs if value is None or value.shape != np.shape(want)]
    if missing:
        raise ParityError(f"compiled graphs lack or misshape outputs {missing} at batch {batch}")
    judged = [(float(np.abs(e - g).max()), parity_tolerance(n, magnitude(k, e)), k) for k, e, g, n in pairs]
    error, tolerance, name = max(judged, key=lambda j: j[0] / j[1])
    if not error <= tolerance:
        raise ParityError(f"compiled step differs from PyTorch by {error:.3g} (> its float32 bound {tolerance:.3g}) "
                          f"at {name}, batch {batch}: not published; an exporter upgrade may mistranslate an op "
                          "(see export/step_compiler.py)")
    return max(j[0] for j in judged)
