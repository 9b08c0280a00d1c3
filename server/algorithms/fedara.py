"""FedARA (CVPR 2026): resource-adaptive low-rank FE with anchor-driven representation alignment.

Each client trains the global FE factorized at its rank tier (spectral init from one SVD per layer) and its
personal head together, under CE + λ·L_FAC with λ ramped over the first rounds, plus the Frobenius decay
μ·Σ‖U Vᵀ‖² applied once per local epoch; it sends back only its factors, which the server reconstructs and
averages by sample count. The math lives in fedcore.lowrank (factorize, reconstruct) and fedcore.objective
(anchors, L_FAC, λ schedule); this file says how a round uses it.
"""
from __future__ import annotations

from device_runtime.task import Phase
from fedcore.objective import lam_at_round
from server.algorithms.base import Algorithm, Fit


class FedAra(Algorithm):
    name = "fedara"

    def offered_tiers(self, tiers: tuple[float, ...], overrides: dict[str, float]
                      ) -> tuple[tuple[float, ...], dict[str, float]]:
        """Every tier: each device trains the FE at the rank its memory affords."""
        return tiers, dict(overrides)

    def configure_fit(self, round_index: int, local_epochs: int, lam: float, warmup: int, mu: float,
                      factorized: bool) -> Fit:
        """FE and head together, λ on its warm-up ramp, μ on the factors; the FE (factors) goes back."""
        return Fit((Phase("all", local_epochs),), lam_at_round(round_index, lam, warmup), mu if factorized else 0.0,
                   "fe")
