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
from server.algorithms.base import Algorithm, Fit, Settings


class FedAra(Algorithm):
    name = "fedara"

    def __init__(self, local_epochs: int, lam: float, lam_warmup: int, mu: float) -> None:
        super().__init__(local_epochs)
        self.lam, self.lam_warmup, self.mu = lam, lam_warmup, mu

    @classmethod
    def from_settings(cls, settings: Settings) -> FedAra:
        return cls(settings.local_epochs, settings.lam, settings.lam_warmup, settings.mu)

    def offered_tiers(self, tiers: tuple[float, ...], overrides: dict[str, float]
                      ) -> tuple[tuple[float, ...], dict[str, float]]:
        """Every tier: each device trains the FE at the rank its memory affords."""
        return tiers, dict(overrides)

    def configure_fit(self, round_index: int, factorized: bool) -> Fit:
        """FE and head together, λ on its warm-up ramp, μ on the factors; the FE (factors) goes back."""
        return Fit((Phase("all", self.local_epochs),), lam_at_round(round_index, self.lam, self.lam_warmup),
                   self.mu if factorized else 0.0, "fe")
