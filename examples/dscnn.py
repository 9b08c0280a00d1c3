"""A depthwise-separable CNN (DS-CNN, Zhang et al. 2017, "Hello Edge" keyword spotting) with BatchNorm, for
1×H×W spectrogram-like input (MFCC frames × coefficients; Fashion-MNIST's 1×28×28 serves as a stand-in).

    python -m server.simulate --model examples/dscnn.py:build --dataset fmnist --max-samples 2000 --rounds 2

``build(input_shape, num_classes)`` returns a module with ``.fe`` (a batch to (batch, channels)) and ``.head``
(the classifier): the contract of docs/your_model.md. The depthwise convolutions cannot be factorized (a grouped
weight has no low-rank form worth having); ``factorize`` names the pointwise (1×1) convolutions, which hold most of
the weights.
"""
from __future__ import annotations

from collections import OrderedDict

from torch import nn

CHANNELS = 64
BLOCKS = 4


def _conv_bn(name: str, conv: nn.Conv2d) -> list[tuple[str, nn.Module]]:
    return [(name, conv), (f"{name}_bn", nn.BatchNorm2d(conv.out_channels)), (f"{name}_relu", nn.ReLU())]


class DsCnn(nn.Module):
    """Stem conv, BLOCKS depthwise-separable blocks (depthwise 3×3 + pointwise 1×1, each with BatchNorm and
    ReLU), global average pooling, a linear head."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, channels: int = CHANNELS,
                 blocks: int = BLOCKS):
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(f"DS-CNN takes C×H×W input, got {tuple(input_shape)}")
        layers = _conv_bn("stem", nn.Conv2d(input_shape[0], channels, 3, stride=2, padding=1, bias=False))
        for i in range(1, blocks + 1):
            layers += _conv_bn(f"dw{i}", nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=False))
            layers += _conv_bn(f"pw{i}", nn.Conv2d(channels, channels, 1, bias=False))
        layers += [("pool", nn.AdaptiveAvgPool2d(1)), ("flatten", nn.Flatten())]
        self.fe = nn.Sequential(OrderedDict(layers))
        self.head = nn.Linear(channels, num_classes)
        self.factorize = [f"pw{i}" for i in range(1, blocks + 1)]

    def forward(self, x):
        return self.head(self.fe(x))


def build(input_shape: tuple[int, ...], num_classes: int) -> DsCnn:
    return DsCnn(input_shape, num_classes)
