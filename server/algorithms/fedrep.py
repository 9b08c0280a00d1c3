"""FedRep: a client first fits its personal head on the received (frozen) FE, then trains the FE with its
head frozen; only the dense FE is averaged (the base class's shared FE, personal head)."""
from __future__ import annotations

from device_runtime.task import Phase
from server.algorithms.base import Algorithm, Fit

HEAD_EPOCHS = 1
"""Head-only epochs before the FE epochs (PFLlib's FedRep default plocal_epochs = 1)."""


class FedRep(Algorithm):
    name = "fedrep"

    def configure_fit(self, round_index: int, factorized: bool) -> Fit:
        return Fit((Phase("head", HEAD_EPOCHS), Phase("fe", self.local_epochs)), 0.0, 0.0, "fe")
