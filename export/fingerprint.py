"""A model's fingerprint: the sha256 of its traced forward graphs, so of its code, not of its name.

Two models that share a name and every tensor shape but differ in one activation (GELU vs ReLU), a constant or the
order of two layers get different fingerprints; retraining (other weight values) keeps it. The graphs are the
aten-level forward in training mode and in eval mode (BatchNorm by batch and by running statistics), traced by
``make_fx`` on fake tensors at a fixed batch with the carried tensors (``fedcore.tensors``) as inputs, so weights
never enter it but every constant the code creates does (its bytes included). It keys the artifact cache
(``export.artifacts.artifact_config``) and the measured tiers of a model nobody measured.
"""
from __future__ import annotations

import copy
import hashlib

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

from fedcore.tensors import carried_tensors, without_counters

FINGERPRINT_VERSION = 1  # bump when what is hashed changes
_BATCH = 2


def _forward_graph(model: nn.Module, input_shape: tuple[int, ...], training: bool) -> torch.fx.GraphModule:
    traced = without_counters(copy.deepcopy(model).train(training))
    names = tuple(carried_tensors(traced))

    def forward(x, *tensors):
        return functional_call(traced, dict(zip(names, tensors)), (x,))

    tensors = tuple(t.detach() for t in carried_tensors(traced).values())
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            return make_fx(forward, tracing_mode="fake")(torch.zeros(_BATCH, *input_shape), *tensors)
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)


def fingerprint(model: nn.Module, input_shape: tuple[int, ...]) -> str:
    """Hex sha256 of ``model``'s training- and eval-mode forward graphs at per-sample ``input_shape``, its carried
    tensors' names, shapes and dtypes, and the bytes of every constant tensor its code makes."""
    digest = hashlib.sha256(f"fingerprint {FINGERPRINT_VERSION} {tuple(int(d) for d in input_shape)}\n".encode())
    for name, value in carried_tensors(model).items():
        digest.update(f"{name} {tuple(value.shape)} {value.dtype}\n".encode())
    for training in (True, False):
        graph = _forward_graph(model, input_shape, training)
        digest.update(graph.code.encode())
        for name, constant in sorted(graph.named_buffers()) + sorted(
                (k, v) for k, v in vars(graph).items() if isinstance(v, torch.Tensor)):
            digest.update(name.encode() + constant.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()
