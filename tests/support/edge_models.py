"""Tiny edge models of the kinds users bring (issue 42), as SplitModels: a DS-CNN with BatchNorm over 1×H×W, a
ResNet-8-style net with BatchNorm and residual adds, a Transformer over T×D sequences and a Conv1d net over C×T.
Kept tiny: every compile in the tests traces, exports and runs them."""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from fedcore.models import SplitModel


def _split(name: str, fe: nn.Module, feature_dim: int, num_classes: int, seed: int) -> SplitModel:
    torch.manual_seed(seed)
    model = SplitModel(name, fe, feature_dim, num_classes)
    for module in model.modules():  # running statistics away from (0, 1), so a wrong update shows
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    return model


def ds_cnn(input_shape=(1, 12, 10), num_classes: int = 4, width: int = 8, act=nn.ReLU, seed: int = 0,
           dw_stride: int = 1) -> SplitModel:
    """Conv-BN-act, one depthwise-separable block (depthwise 3×3 of ``dw_stride`` + BN + act, pointwise 1×1 + BN +
    act), global average pool."""
    torch.manual_seed(seed)
    fe = nn.Sequential(OrderedDict([
        ("conv1", nn.Conv2d(input_shape[0], width, 3, stride=2, padding=1)), ("bn1", nn.BatchNorm2d(width)),
        ("act1", act()),
        ("dw", nn.Conv2d(width, width, 3, stride=dw_stride, padding=1, groups=width)), ("bn2", nn.BatchNorm2d(width)),
        ("act2", act()),
        ("pw", nn.Conv2d(width, 2 * width, 1)), ("bn3", nn.BatchNorm2d(2 * width)), ("act3", act()),
        ("pool", nn.AdaptiveAvgPool2d(1)), ("flatten", nn.Flatten())]))
    return _split("ds_cnn", fe, 2 * width, num_classes, seed)


class _Block(nn.Module):
    """A basic residual block: conv-BN-ReLU-conv-BN plus the input (a 1×1 conv-BN where the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = (nn.Sequential() if stride == 1 and c_in == c_out else
                         nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def resnet8(input_shape=(1, 8, 8), num_classes: int = 4, width: int = 8, seed: int = 0) -> SplitModel:
    """Stem conv-BN-ReLU, three residual blocks (widths w, 2w, 2w), global average pool."""
    torch.manual_seed(seed)
    fe = nn.Sequential(OrderedDict([
        ("stem", nn.Conv2d(input_shape[0], width, 3, padding=1, bias=False)), ("bn", nn.BatchNorm2d(width)),
        ("relu", nn.ReLU()), ("block1", _Block(width, width, 1)), ("block2", _Block(width, 2 * width, 2)),
        ("block3", _Block(2 * width, 2 * width, 1)), ("pool", nn.AdaptiveAvgPool2d(1)), ("flatten", nn.Flatten())]))
    return _split("resnet8", fe, 2 * width, num_classes, seed)


class _Encoder(nn.Module):
    """T×D sequences: a Linear embedding, one TransformerEncoderLayer (math attention, no dropout), LayerNorm,
    mean over time."""

    def __init__(self, dim: int, model_dim: int, heads: int, activation: str):
        super().__init__()
        self.embed = nn.Linear(dim, model_dim)
        self.encoder = nn.TransformerEncoderLayer(model_dim, heads, dim_feedforward=2 * model_dim, dropout=0.0,
                                                  activation=activation, batch_first=True)
        self.norm = nn.LayerNorm(model_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.encoder(self.embed(x))).mean(dim=1)


def tiny_transformer(input_shape=(6, 5), num_classes: int = 4, model_dim: int = 12, heads: int = 2,
                     activation: str = "gelu", seed: int = 0) -> SplitModel:
    torch.manual_seed(seed)
    return _split("tiny_transformer", _Encoder(input_shape[1], model_dim, heads, activation), model_dim, num_classes,
                  seed)


def conv1d_net(input_shape=(3, 16), num_classes: int = 4, width: int = 8, seed: int = 0) -> SplitModel:
    """C×T windows: Conv1d-BN-ReLU6, Conv1d (≥ 8 input channels: the GEMM form)-BN-Hardswish, SiLU after a depthwise
    Conv1d, global average pool over time."""
    torch.manual_seed(seed)
    fe = nn.Sequential(OrderedDict([
        ("conv1", nn.Conv1d(input_shape[0], width, 5, padding=2)), ("bn1", nn.BatchNorm1d(width)), ("act1", nn.ReLU6()),
        ("conv2", nn.Conv1d(width, 2 * width, 3, stride=2)), ("bn2", nn.BatchNorm1d(2 * width)),
        ("act2", nn.Hardswish()),
        ("dw", nn.Conv1d(2 * width, 2 * width, 3, padding=1, groups=2 * width)), ("act3", nn.SiLU()),
        ("pool", nn.AdaptiveAvgPool1d(1)), ("flatten", nn.Flatten())]))
    return _split("conv1d_net", fe, 2 * width, num_classes, seed)
