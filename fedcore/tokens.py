"""Integer-token inputs: a model whose FE holds an ``nn.Embedding`` reads its samples as token ids.

Samples travel as float32 everywhere (shards, the wire, the step graph's input), and token ids are exact in
float32 below 2**24 (``server.data.datasets.MAX_TOKEN`` checks a file's ids): an FE that embeds them casts first
(``self.embed(x.long())``; the step graph holds a Cast, a Gather forward and a scatter-add backward). What draws
inputs for a model without data (the probe, the step compiler's trace and parity batches) draws ids below the
smallest vocabulary of the FE's Embedding layers for such a model, since normal samples would be negative ids, and
normal samples otherwise.
"""
from __future__ import annotations

import torch
from torch import nn


def token_vocabulary(model: nn.Module) -> int | None:
    """The smallest ``num_embeddings`` of the model's ``nn.Embedding`` layers, or None when it has none."""
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    return min(sizes) if sizes else None


def random_samples(input_shape: tuple[int, ...], batch: int, generator: torch.Generator,
                   vocabulary: int | None) -> torch.Tensor:
    """``batch`` float32 samples of ``input_shape``: standard normals, or token ids below ``vocabulary``."""
    if vocabulary is None:
        return torch.randn(batch, *input_shape, generator=generator)
    return torch.randint(0, vocabulary, (batch, *input_shape), generator=generator).float()
