"""Models: every model is a feature extractor (FE, shared) followed by a classifier head (personal).

The zoo's shapes follow PFLlib / pFedES: FedAvgCNN for 1×28×28 and 3×32×32 inputs, and the heterogeneous
CNN1..CNN5 family. Layers carry names (``conv1``, ``fc1`` ...) so that rank plans, ONNX parameter
names and wire tensors all refer to the same thing: ``fe.conv1.weight``.

A user's model is named by ``MODULE:FUNCTION`` or ``PATH.py:FUNCTION`` (``fedcore.model_spec``):
``FUNCTION(input_shape, num_classes)`` returns a module with ``.fe`` (a batch to ``(batch, D)``) and ``.head``
(``nn.Linear(D, num_classes)``), or the pair ``(fe, head)``; :func:`split_sequential` cuts an ``nn.Sequential``
before its last Linear. Optional attributes of the returned module: ``factorize`` (the FE layers the rank plans
factorize, names relative to the FE) and ``personal`` (state_dict prefixes, relative to the FE, that stay on the
device like the head). ``fedcore.model_probe`` checks the contract before anything compiles.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn

from fedcore.lowrank import FE_PREFIX, RankPlan, default_layers
from fedcore.model_spec import FILE_KIND, ModelSpec, parse_model_spec

KERNEL = 5
POOL = 2


class SplitModel(nn.Module):
    """A feature extractor ``fe`` (shared) and a linear head ``head`` (personal)."""

    def __init__(self, name: str, fe: nn.Module, feature_dim: int, num_classes: int, head: nn.Linear | None = None,
                 *, factorize: tuple[str, ...] | None = None, personal: tuple[str, ...] = ()):
        super().__init__()
        self.name = name
        self.fe = fe
        self.head = nn.Linear(feature_dim, num_classes) if head is None else head
        self.feature_dim = feature_dim
        self.num_classes = num_classes
        self.factorize = factorize  # FE layers a rank plan factorizes (None: the default rule)
        self.personal = personal  # FE state_dict prefixes that stay on the device, as the head does

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fe(x))


def _conv_stack(in_shape: tuple[int, int, int], channels: tuple[int, int]) -> tuple[list, int]:
    """Two k5 convs each followed by ReLU and 2×2 max-pool; returns the layers and the flat size."""
    c, h, w = in_shape
    layers: list[tuple[str, nn.Module]] = []
    for i, out_c in enumerate(channels, start=1):
        layers += [(f"conv{i}", nn.Conv2d(c, out_c, KERNEL)), (f"relu{i}", nn.ReLU()),
                   (f"pool{i}", nn.MaxPool2d(POOL))]
        c, h, w = out_c, (h - KERNEL + 1) // POOL, (w - KERNEL + 1) // POOL
    if h <= 0 or w <= 0:
        raise ValueError(f"input {in_shape} is too small for two k{KERNEL} conv + pool stages")
    return layers, c * h * w


def _fe(in_shape: tuple[int, int, int], channels: tuple[int, int], fc: tuple[int, ...]) -> tuple[nn.Sequential, int]:
    layers, dim = _conv_stack(in_shape, channels)
    layers.append(("flatten", nn.Flatten()))
    relu_index = len(channels) + 1
    for i, width in enumerate(fc, start=1):
        layers += [(f"fc{i}", nn.Linear(dim, width)), (f"relu{relu_index}", nn.ReLU())]
        dim, relu_index = width, relu_index + 1
    return nn.Sequential(OrderedDict(layers)), dim


# name -> (conv channels, fc widths of the FE); the head maps the last width to the classes.
ARCHITECTURES: dict[str, tuple[tuple[int, int], tuple[int, ...]]] = {
    "fedavgcnn": ((32, 64), (512,)),
    "cnn1": ((16, 32), (2000, 500)),
    "cnn2": ((16, 16), (2000, 500)),
    "cnn3": ((16, 32), (1000, 500)),
    "cnn4": ((16, 32), (800, 500)),
    "cnn5": ((16, 32), (500, 500)),
}


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, seed: int | None = None) -> SplitModel:
    """Build the model ``name`` names (a zoo name, ``MODULE:FUNCTION`` or ``PATH.py:FUNCTION``) for
    ``input_shape`` (per sample) and ``num_classes``; ``seed`` makes the initial weights reproducible."""
    spec = parse_model_spec(name, tuple(ARCHITECTURES))
    if seed is not None:
        torch.manual_seed(seed)
    if spec.is_zoo:
        if len(input_shape) != 3:
            raise ValueError(f"--model {name} is a CNN for (C, H, W) images; the data's samples are "
                             f"{tuple(input_shape)}: bring a model for them (MODULE:FUNCTION or PATH.py:FUNCTION)")
        channels, fc = ARCHITECTURES[name]
        fe, dim = _fe(tuple(input_shape), channels, fc)
        return SplitModel(name, fe, dim, num_classes)
    return _user_model(spec, model_function(spec)(tuple(int(d) for d in input_shape), num_classes), num_classes)


def import_model_code(spec: ModelSpec):
    """The module holding a user's model, imported once per process under ``spec.module_name`` (a file too:
    the name is the same in every process, so its classes pickle)."""
    if spec.module_name in sys.modules:
        return sys.modules[spec.module_name]
    if spec.kind != FILE_KIND:
        return importlib.import_module(spec.source)
    loader_spec = importlib.util.spec_from_file_location(spec.module_name, spec.source)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[spec.module_name] = module
    try:
        loader_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.module_name]
        raise
    return module


def model_function(spec: ModelSpec) -> Callable[[tuple[int, ...], int], object]:
    """The FUNCTION a ``MODULE:FUNCTION`` / ``PATH.py:FUNCTION`` spec names; ValueError where there is none."""
    module = import_model_code(spec)
    function = getattr(module, spec.function, None)
    if not callable(function):
        raise ValueError(f"--model {spec.text!r}: {spec.source} defines no function {spec.function!r}")
    return function


def split_sequential(layers: nn.Sequential) -> tuple[nn.Sequential, nn.Linear]:
    """``(fe, head)`` from an ``nn.Sequential`` whose last layer is the ``nn.Linear`` classifier (the layer names
    are kept, so ``fe.3.weight`` is the Sequential's ``3.weight``)."""
    names = list(layers._modules)
    if not names or not isinstance(layers[-1], nn.Linear):
        raise ValueError("split_sequential: the Sequential's last layer must be the nn.Linear head")
    return nn.Sequential(OrderedDict((n, layers._modules[n]) for n in names[:-1])), layers[-1]


def _user_model(spec: ModelSpec, built: object, num_classes: int) -> SplitModel:
    """The SplitModel of what a user's FUNCTION returned (a module with ``.fe`` and ``.head``, or the pair)."""
    if isinstance(built, tuple) and len(built) == 2:
        fe, head = built
        options = None
    else:
        fe, head, options = getattr(built, "fe", None), getattr(built, "head", None), built
    if not isinstance(fe, nn.Module) or not isinstance(head, nn.Linear):
        raise ValueError(f"--model {spec.text!r}: {spec.function}(input_shape, num_classes) must return a module "
                         "with .fe (an nn.Module) and .head (an nn.Linear), or the pair (fe, head); got "
                         f"{type(built).__name__}")
    if head.out_features != num_classes:
        raise ValueError(f"--model {spec.text!r}: the head has {head.out_features} outputs but the data has "
                         f"{num_classes} classes")
    factorize = getattr(options, "factorize", None)
    personal = getattr(options, "personal", ())
    return SplitModel(spec.text, fe, head.in_features, num_classes, head,
                      factorize=None if factorize is None else tuple(factorize), personal=tuple(personal))


def rank_plan(model: nn.Module, ratio: float) -> RankPlan:
    """A tier's plan for ``model``: its ``factorize`` layers where it names them; else the default layers
    (``fedcore.lowrank.default_layers``), less its ``personal`` layers (a device keeps those dense, as they are)."""
    factorize, personal = getattr(model, "factorize", None), getattr(model, "personal", ())
    if factorize is not None:
        return RankPlan(ratio, tuple(factorize))
    if not personal:
        return RankPlan(ratio)
    personal = tuple(FE_PREFIX + p for p in personal)
    default = default_layers(model)
    return RankPlan(ratio, tuple(n for n in default if not any(n == p or n.startswith(p + ".") for p in personal)))
