"""A tiny Transformer encoder over sequences: samples of T×D (T steps of D features: sensor windows, frames), or
1×T×D (an image's rows as steps, e.g. Fashion-MNIST's 1×28×28). Pre-norm blocks of softmax self-attention
written with Linear + matmul (so its projections can be factorized) and a GELU MLP; the mean over the steps is
the FE's output.

    python -m server.simulate --model examples/tiny_transformer.py:build --dataset fmnist --max-samples 2000 --rounds 2

``build(input_shape, num_classes)`` returns a module with ``.fe`` and ``.head`` (docs/your_model.md).
"""
from __future__ import annotations

import math

import torch
from torch import nn

WIDTH = 32
HEADS = 2
BLOCKS = 2
MLP_RATIO = 2


class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.reshape(b, t, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(self.head_dim), dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(width), SelfAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, MLP_RATIO * width), nn.GELU(), nn.Linear(MLP_RATIO * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Encoder(nn.Module):
    """(batch, T, D) or (batch, 1, T, D) -> (batch, WIDTH): embed, add positions, BLOCKS blocks, mean over T."""

    def __init__(self, steps: int, features: int, width: int, heads: int, blocks: int):
        super().__init__()
        self.steps, self.features = steps, features
        self.embed = nn.Linear(features, width)
        self.position = nn.Parameter(torch.zeros(steps, width))
        nn.init.normal_(self.position, std=0.02)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(blocks)))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x.reshape(x.shape[0], self.steps, self.features)) + self.position
        return self.norm(self.blocks(x)).mean(dim=1)


def build(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    shape = tuple(input_shape)
    if len(shape) == 3 and shape[0] == 1:
        shape = shape[1:]
    if len(shape) != 2:
        raise ValueError(f"the tiny Transformer takes T×D (or 1×T×D) samples, got {tuple(input_shape)}")
    model = nn.Module()
    model.fe = Encoder(*shape, WIDTH, HEADS, BLOCKS)
    model.head = nn.Linear(WIDTH, num_classes)
    return model
