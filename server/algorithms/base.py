"""What an algorithm tells the round engine (Flower's Strategy, reduced to what FedARA and its baselines need)."""
from __future__ import annotations

from abc import ABC, abstractmethod

from device_runtime.task import Phase


class Algorithm(ABC):
    """One federated algorithm's decisions; the engine asks, the devices carry them out."""

    name: str
    factorizes: bool = False
    """Each client trains the global FE factorized at its rank tier (else every client is dense)."""
    returns: str = "fe"
    """What a client sends back: "fe", "all" (FE and head) or "none" (nothing: local training)."""

    @property
    def aggregates(self) -> bool:
        """Whether the server keeps a global model (local training has none)."""
        return self.returns != "none"

    @property
    def shares_head(self) -> bool:
        return self.returns == "all"

    @abstractmethod
    def phases(self, local_epochs: int) -> tuple[Phase, ...]:
        """What a client trains in a round, in order."""

    def lam(self, round_index: int, lam: float, warmup: int) -> float:
        """The anchor-loss weight λ of a round; the baselines have no anchor term."""
        return 0.0

    def mu(self, mu: float, factorized: bool) -> float:
        """The Frobenius decay μ: it acts on factors only."""
        return mu if factorized else 0.0
