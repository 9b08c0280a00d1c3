"""FedRep: a client first fits its personal head on the received (frozen) FE, then trains the FE with its
head frozen; only the dense FE is averaged."""
from __future__ import annotations

from device_runtime.task import Phase
from server.algorithms.base import Algorithm

HEAD_EPOCHS = 1
"""Head-only epochs before the FE epochs (PFLlib's FedRep default plocal_epochs = 1)."""


class FedRep(Algorithm):
    name = "fedrep"
    returns = "fe"

    def phases(self, local_epochs: int) -> tuple[Phase, ...]:
        return (Phase("head", HEAD_EPOCHS), Phase("fe", local_epochs))
