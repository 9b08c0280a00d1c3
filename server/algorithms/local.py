"""Local training: every client trains its own dense model on its own data; nothing is sent or averaged."""
from __future__ import annotations

import torch

from device_runtime.batchnorm import is_counter
from device_runtime.task import Phase
from server.algorithms.base import Algorithm, Fit, Shapes


class Local(Algorithm):
    name = "local"

    def global_tensors(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """None: the server keeps no model."""
        return {}

    def personal_tensors(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole model: the server sends it in the PLAN, so no device depends on its artifact cache's."""
        return {k: v for k, v in state.items() if not is_counter(k)}

    def update_shapes(self, fe_shapes: Shapes, personal_shapes: Shapes) -> Shapes:
        """None: an answer carries only the evaluation."""
        return {}

    def configure_fit(self, round_index: int, factorized: bool) -> Fit:
        return Fit((Phase("all", self.local_epochs),), 0.0, 0.0, "none")
