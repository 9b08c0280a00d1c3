"""FedARA (CVPR 2026): resource-adaptive low-rank FE with anchor-driven representation alignment.

Each client trains the global FE factorized at its rank tier (spectral init from one SVD per layer) and its
personal head together, under CE + λ·L_FAC with λ ramped over the first rounds, plus the Frobenius decay
μ·Σ‖U Vᵀ‖² applied once per local epoch; it sends back only its factors, which the server reconstructs and
averages by sample count. The math lives in fedcore.lowrank (factorize, reconstruct) and fedcore.objective
(anchors, L_FAC, λ schedule); this file says how a round uses it.
"""
from __future__ import annotations

from device_runtime.task import Phase
from server.algorithms.base import Algorithm
from fedcore.objective import lam_at_round


class FedAra(Algorithm):
    name = "fedara"
    factorizes = True
    returns = "fe"

    def phases(self, local_epochs: int) -> tuple[Phase, ...]:
        return (Phase("all", local_epochs),)

    def lam(self, round_index: int, lam: float, warmup: int) -> float:
        return lam_at_round(round_index, lam, warmup)
