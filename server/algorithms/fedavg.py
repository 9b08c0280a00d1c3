"""FedAvg: every client trains the whole dense model (FE and head) and the server averages all of it."""
from __future__ import annotations

import torch

from device_runtime.task import Phase
from server.algorithms.base import Algorithm, Fit, Shapes


class FedAvg(Algorithm):
    name = "fedavg"

    def global_tensors(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole model, head included (less the FE's personal tensors and BatchNorm counters)."""
        return {k: v.detach().clone() for k, v in state.items() if self.is_shared(k)}

    def update_shapes(self, fe_shapes: Shapes, personal_shapes: Shapes) -> Shapes:
        """The FE and the head (less the FE's personal tensors)."""
        return {k: v for k, v in {**fe_shapes, **personal_shapes}.items() if self.is_shared(k)}

    def configure_fit(self, round_index: int, factorized: bool) -> Fit:
        return Fit((Phase("all", self.local_epochs),), 0.0, 0.0, "all")
