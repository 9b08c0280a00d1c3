"""A token classifier (bag of embeddings + MLP, fastText-style) for integer token sequences: the FE starts with an
``nn.Embedding`` whose backward the step compiler compiles as a scatter-add (fedcore/tokens.py).

    python -m server.simulate --model examples/token_classifier.py:build --dataset npz:TOKENS.npz --backend portable

The data's samples are T token ids (an npz with ``vocabulary`` V: ids 0..V-1, docs/your_model.md); they arrive as
float32 holding exact integers, so the FE casts them with ``.long()``. ``build(input_shape, num_classes)`` returns a
module with ``.fe`` and ``.head``.
"""
from __future__ import annotations

import torch
from torch import nn

VOCABULARY = 64
EMBEDDING = 16
HIDDEN = 32


class BagOfEmbeddings(nn.Module):
    """Each token's embedding, averaged over the sequence, then a hidden layer with ReLU."""

    def __init__(self, vocabulary: int, embedding: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocabulary, embedding)
        self.fc = nn.Linear(embedding, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(self.embed(x.long()).mean(dim=1)))


class TokenClassifier(nn.Module):
    def __init__(self, input_shape: tuple[int, ...], num_classes: int, vocabulary: int = VOCABULARY):
        super().__init__()
        if len(input_shape) != 1:
            raise ValueError(f"the token classifier takes sequences of T token ids, got samples {tuple(input_shape)}")
        self.fe = BagOfEmbeddings(vocabulary, EMBEDDING, HIDDEN)
        self.head = nn.Linear(HIDDEN, num_classes)

    def forward(self, x):
        return self.head(self.fe(x))


def build(input_shape: tuple[int, ...], num_classes: int) -> TokenClassifier:
    return TokenClassifier(input_shape, num_classes)
