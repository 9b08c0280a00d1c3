"""ResNet-8 (a stem and three residual stages of one basic block each, He et al. 2016; the MLPerf Tiny image
classification model's shape) with BatchNorm, for C×H×W images.

    python -m server.simulate --model examples/resnet8.py:build --dataset fmnist --max-samples 2000 --rounds 2

``build(input_shape, num_classes)`` returns a module with ``.fe`` and ``.head`` (docs/your_model.md).
"""
from __future__ import annotations

from torch import nn

WIDTHS = (16, 32, 64)


class BasicBlock(nn.Module):
    """Two 3×3 conv + BatchNorm, a residual add (a 1×1 conv + BatchNorm on the shortcut where the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU()
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet8(nn.Module):
    def __init__(self, input_shape: tuple[int, ...], num_classes: int, widths: tuple[int, ...] = WIDTHS):
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(f"ResNet-8 takes C×H×W input, got {tuple(input_shape)}")
        stages = [nn.Conv2d(input_shape[0], widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]),
                  nn.ReLU()]
        c = widths[0]
        for i, width in enumerate(widths):
            stages.append(BasicBlock(c, width, 1 if i == 0 else 2))
            c = width
        stages += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.fe = nn.Sequential(*stages)
        self.head = nn.Linear(c, num_classes)

    def forward(self, x):
        return self.head(self.fe(x))


def build(input_shape: tuple[int, ...], num_classes: int) -> ResNet8:
    return ResNet8(input_shape, num_classes)
