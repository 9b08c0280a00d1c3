"""Model zoo: every model is a feature extractor (FE, shared) followed by a classifier head (personal).

Shapes follow PFLlib / pFedES: FedAvgCNN for 1×28×28 and 3×32×32 inputs, and the heterogeneous
CNN1..CNN5 family. Layers carry names (``conv1``, ``fc1`` ...) so that rank plans, ONNX parameter
names and wire tensors all refer to the same thing: ``fe.conv1.weight``.
"""
from __future__ import annotations

from collections import OrderedDict
import torch
from torch import nn

KERNEL = 5
POOL = 2


class SplitModel(nn.Module):
    """A feature extractor ``fe`` (shared) and a linear head ``head`` (personal)."""

    def __init__(self, name: str, fe: nn.Sequential, feature_dim: int, num_classes: int):
        super().__init__()
        self.name = name
        self.fe = fe
        self.head = nn.Linear(feature_dim, num_classes)
        self.feature_dim = feature_dim
        self.num_classes = num_classes

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


def build_model(name: str, input_shape: tuple[int, int, int], num_classes: int, seed: int | None = None) -> SplitModel:
    """Build a model by name for a (C, H, W) input; ``seed`` makes the initial weights reproducible."""
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(ARCHITECTURES)}")
    channels, fc = ARCHITECTURES[name]
    if seed is not None:
        torch.manual_seed(seed)
    fe, dim = _fe(tuple(input_shape), channels, fc)
    return SplitModel(name, fe, dim, num_classes)

