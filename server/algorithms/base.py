"""What an algorithm tells the round engine, in the manner of Flower's Strategy: which tensors are shared and
which stay personal, what a client trains and returns in a round (``configure_fit``), what a training update
carries, the rank tiers it may be offered, and how the accepted updates become the next global model
(``aggregate_fit``). The engine asks; it branches on no property of the algorithm."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from device_runtime.batchnorm import is_counter
from device_runtime.task import Phase
from fedcore.lowrank import FE_PREFIX

DENSE = 1.0
Shapes = dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class Settings:
    """The run's settings an algorithm is built with (each algorithm keeps those it uses): passes over a client's
    data per round, FedARA's anchor weight λ and its warm-up in rounds, and the Frobenius decay μ."""

    local_epochs: int
    lam: float
    lam_warmup: int
    mu: float


@dataclass(frozen=True)
class Fit:
    """A training client's instructions for a round: what it trains, in order, the anchor weight λ, the
    Frobenius decay μ, and what it sends back ("fe", "all" or "none")."""

    phases: tuple[Phase, ...]
    lam: float
    mu: float
    returns: str


class Algorithm(ABC):
    """One federated algorithm's decisions (defaults: the FE is shared and averaged, the head is personal)."""

    name: str
    personal_names: frozenset[str] = frozenset()
    """FE tensors that stay on the devices as the head does (BatchNorm statistics under --bn-stats personal, the
    model's own ``personal`` layers); set by ``keep_personal``."""

    def __init__(self, local_epochs: int) -> None:
        self.local_epochs = local_epochs

    def keep_personal(self, names: frozenset[str]) -> None:
        """Keep these FE tensors (full state_dict names) on the devices: never global, never in an update."""
        self.personal_names = frozenset(names)

    def is_shared(self, name: str) -> bool:
        """Whether the FE tensor ``name`` (or, factorized, its factors ``name``.u/.v) is shared."""
        stem = name.rsplit(".", 1)[0]
        return name not in self.personal_names and f"{stem}.weight" not in self.personal_names \
            and not is_counter(name)

    @classmethod
    def from_settings(cls, settings: Settings) -> Algorithm:
        """The algorithm with the run's settings (by default it uses only the local epochs)."""
        return cls(settings.local_epochs)

    def offered_tiers(self, tiers: tuple[float, ...], overrides: dict[str, float]
                      ) -> tuple[tuple[float, ...], dict[str, float]]:
        """The rank tiers (and per-device overrides) a device may get: dense only, unless the algorithm
        factorizes."""
        return (DENSE,), {}

    def global_tensors(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the server keeps and aggregates, from the initial model's state: the feature extractor (less its
        personal tensors and BatchNorm counters)."""
        return {k: v.detach().clone() for k, v in state.items() if k.startswith(FE_PREFIX) and self.is_shared(k)}

    def personal_tensors(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What every device starts from and keeps to itself (sent in its PLAN): the head and the FE's personal
        tensors."""
        return {k: v for k, v in state.items()
                if (not k.startswith(FE_PREFIX) or k in self.personal_names) and not is_counter(k)}

    def update_shapes(self, fe_shapes: Shapes, personal_shapes: Shapes) -> Shapes:
        """The tensors a training update carries, from the device's plan (its FE) and its personal tensors."""
        return {k: v for k, v in fe_shapes.items() if self.is_shared(k)}

    @abstractmethod
    def configure_fit(self, round_index: int, factorized: bool) -> Fit:
        """What a training client does in round ``round_index`` (``factorized``: its plan has factors)."""

    def aggregate_fit(self, global_state: dict[str, torch.Tensor], mean: dict[str, torch.Tensor],
                      sent_mean: Callable[[], dict[str, torch.Tensor]], rule: str) -> dict[str, torch.Tensor]:
        """The next global model from the round's float64 sample-weighted mean of the clients' (reconstructed)
        tensors, under --aggregate. weights: Σ p_k W_k; updates: ω + Σ p_k (W_k − S_k), ``sent_mean()`` being
        Σ p_k S_k, what each client was sent (its plan's factorization of ω; a dense client's S_k is ω itself,
        so dense layers and dense clients aggregate the same under both rules)."""
        if rule == "weights":
            return {k: v.float() for k, v in mean.items()}
        sent = sent_mean()
        return {k: (global_state[k].double() + mean[k] - sent[k]).float() for k in mean}
