"""Sample-weighted aggregation of client FEs, streaming: memory stays one model whatever the client count."""
from __future__ import annotations

import torch

from server.lowrank import reconstruct_state


class StreamingAverage:
    """Running Σ n_k·W_k and Σ n_k in float64; add one client at a time, read the weighted mean."""

    def __init__(self, dense_shapes: dict[str, tuple[int, ...]]):
        self.dense_shapes = dict(dense_shapes)
        self._sums = {k: torch.zeros(shape, dtype=torch.float64) for k, shape in self.dense_shapes.items()}
        self.total_weight = 0.0
        self.count = 0

    def add(self, client_fe: dict[str, torch.Tensor], num_samples: int) -> None:
        """Reconstruct a client's FE (factors → full rank; dense layers as they are) and accumulate it."""
        if num_samples <= 0:
            raise ValueError(f"a client update needs a positive sample count, got {num_samples}")
        dense = reconstruct_state(client_fe, self.dense_shapes)
        for key, value in dense.items():
            self._sums[key].add_(value.double(), alpha=float(num_samples))
        self.total_weight += float(num_samples)
        self.count += 1

    def result(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        if self.count == 0:
            raise ValueError("no client update to aggregate")
        return {k: (s / self.total_weight).to(dtype) for k, s in self._sums.items()}

