"""The contract a model must keep to be federated, checked once, before anything compiles: a forward in train
and in eval mode on a small batch of the data's shape. A misfit raises ``ModelMisfit`` (a ValueError: the drivers
answer it in one line, exit 2) naming the layer or tensor and the fix.

Checked: the FE maps ``(batch, *input_shape)`` to ``(batch, D)`` in both modes and the head is ``nn.Linear(D,
num_classes)``; every parameter is float32 (what the device trains); every BatchNorm has a momentum (``None``, a
cumulative average over all batches ever seen, has no per-round meaning in a federation); the forward takes the
data's per-sample shape; no custom ``torch.autograd.Function`` (its backward is Python the exporter cannot see);
``factorize`` and ``personal`` name layers and tensors of the FE. The rules on BatchNorm and on what the runtime
carries are ``fedcore.tensors.check_tensors``'s, asked here.
"""
from __future__ import annotations

import torch
from torch import nn

from fedcore.models import SplitModel
from fedcore.tensors import UnsupportedModel, check_tensors
from fedcore.tokens import random_samples, token_vocabulary

PROBE_BATCH = 3
"""Samples in the probing batch: neither 1 (BatchNorm refuses a single sample in train mode) nor the trace's 2."""


class ModelMisfit(ValueError):
    """The model breaks the contract; the message names what and how to fix it."""


def probe_model(model: SplitModel, input_shape: tuple[int, ...], num_classes: int) -> int:
    """Check ``model`` against the contract for samples of ``input_shape``; return D, the FE's output width.
    The model's weights and BatchNorm statistics are left as they were."""
    name = model.name
    for pname, param in model.named_parameters():
        if param.dtype != torch.float32:
            raise ModelMisfit(f"--model {name}: parameter {pname} is {str(param.dtype).removeprefix('torch.')}; the "
                              "device trains float32 (build the layer without dtype=, or call .float())")
    try:
        check_tensors(model)  # the runtime's own rule for what it carries (BatchNorm momentum, floating point)
    except UnsupportedModel as exc:
        raise ModelMisfit(f"--model {name}: {exc}") from None
    _check_names(model)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    was_training = model.training
    try:
        generator = torch.Generator().manual_seed(0)
        x = random_samples(input_shape, PROBE_BATCH, generator, token_vocabulary(model))
        dims = {}
        for mode in ("train", "eval"):
            model.train(mode == "train")
            with torch.enable_grad():
                features = _forward(model.fe, x, name, input_shape, mode)
            if features.dim() != 2 or features.shape[0] != PROBE_BATCH:
                raise ModelMisfit(f"--model {name}: in {mode} mode the FE maps a batch of {PROBE_BATCH} to "
                                  f"{tuple(features.shape)}, not (batch, D); end it with nn.Flatten() or a pooling "
                                  "that leaves (batch, D)")
            if not features.is_floating_point():
                raise ModelMisfit(f"--model {name}: the FE's output is {features.dtype}, not float32")
            width = dims[mode] = features.shape[1]
            if model.head.in_features != width or model.head.out_features != num_classes:
                raise ModelMisfit(f"--model {name}: the head is Linear({model.head.in_features}, "
                                  f"{model.head.out_features}) but the FE gives {width} features and the data has "
                                  f"{num_classes} classes: make it nn.Linear({width}, {num_classes})")
            if mode == "train":
                _check_autograd(model.head(features), name)
        return width
    finally:
        model.load_state_dict(saved)
        model.train(was_training)


def _forward(fe: nn.Module, x: torch.Tensor, name: str, input_shape: tuple[int, ...], mode: str) -> torch.Tensor:
    try:
        return fe(x)
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelMisfit(f"--model {name}: the FE fails on samples of the data's shape {tuple(input_shape)} "
                          f"({mode} mode): {first}") from None


def _check_autograd(output: torch.Tensor, name: str) -> None:
    """Refuse a custom autograd Function anywhere in the graph that produced ``output``."""
    seen, stack = set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            function = type(node).__name__.removesuffix("Backward")
            raise ModelMisfit(f"--model {name}: the forward calls the custom autograd Function {function}, whose "
                              "backward is Python the ONNX exporter cannot see; write it with torch operations")
        stack.extend(next_node for next_node, _ in node.next_functions)


def _check_names(model: SplitModel) -> None:
    """``factorize`` names FE layers and ``personal`` prefixes of FE tensors."""
    layers = dict(model.fe.named_modules())
    for layer in model.factorize or ():
        if layer not in layers or not isinstance(layers[layer], (nn.Linear, nn.Conv1d, nn.Conv2d)):
            raise ModelMisfit(f"--model {model.name}: factorize names {layer!r}, which is not a Linear or Conv layer "
                              f"of the FE")
    keys = list(model.fe.state_dict())
    for prefix in model.personal:
        if not any(k == prefix or k.startswith(prefix + ".") for k in keys):
            raise ModelMisfit(f"--model {model.name}: personal names {prefix!r}, which is no tensor or layer of the FE")
