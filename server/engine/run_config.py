"""What a run is asked to do, checked, without torch: the names and defaults the command line offers and the
federation's settings with their checks.

The drivers parse and check their flags with this alone, so a mistake is reported (exit 2) before torch and the
data load. The algorithms take their names from here and the datasets' names live in ``server.data`` (torch-free, below the engine);
``fedcore.models`` sits below ``server`` and keeps its own registry. A test holds each registry to its names.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from enum import Enum

ALGORITHMS = ("fedara", "fedavg", "fedrep", "local")
"""The algorithms, one file each in server/algorithms/."""
MODELS = ("fedavgcnn", "cnn1", "cnn2", "cnn3", "cnn4", "cnn5")
"""The model zoo (fedcore/models.py)."""
DEFAULT_MU = 1e-3
"""The Frobenius decay μ on factorized layers (the paper's)."""
DEFAULT_LAM_WARMUP = 10
"""Rounds over which λ ramps from 0 to its target (the paper's)."""
DEFAULT_TIERS = (1.0, 0.75, 0.5, 0.25, 0.125)
"""The rank ratios a heterogeneous run offers by default."""

AGGREGATION_RULES = ("weights", "updates")
"""weights: ω ← Σ p_k U_k V_kᵀ (the paper's); updates: ω ← ω + Σ p_k (U_k V_kᵀ − U_k⁰ V_k⁰ᵀ), what was sent subtracted."""



class RunError(RuntimeError):
    """The run cannot go on: not enough devices, every local device died, a bad resume."""


@dataclass(frozen=True)
class FederationConfig:
    """Hyper-parameters of a run; defaults are the paper's (homogeneous λ = 10, lr 5e-3, batch 16, E = 5)."""

    algo: str = "fedara"
    rounds: int = 100
    lam: float = 10.0
    lam_warmup: int = DEFAULT_LAM_WARMUP
    mu: float = DEFAULT_MU
    lr: float = 5e-3
    local_epochs: int = 5
    batch_size: int = 16
    join_ratio: float = 1.0
    seed: int = 0
    aggregate: str = "weights"
    min_completion: float = 0.5

    def __post_init__(self) -> None:
        if self.algo not in ALGORITHMS:
            raise ValueError(f"--algo {self.algo!r} is unknown; choose one of {', '.join(ALGORITHMS)}")
        if self.aggregate not in AGGREGATION_RULES:
            raise ValueError(f"--aggregate {self.aggregate!r} is unknown; choose one of {', '.join(AGGREGATION_RULES)}")
        if not 0.0 < self.join_ratio <= 1.0:
            raise ValueError(f"--join-ratio must be in (0, 1], got {self.join_ratio}")
        if not 0.0 <= self.min_completion <= 1.0:
            raise ValueError(f"--min-completion must be in [0, 1], got {self.min_completion:g}")
        for name in ("rounds", "local_epochs", "batch_size", "lam_warmup"):
            if getattr(self, name) < (0 if name == "lam_warmup" else 1):
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be at least {0 if name == 'lam_warmup' else 1}, got {getattr(self, name)}")
        for flag, value, positive in (("--lr", self.lr, True), ("--lam", self.lam, False), ("--frob", self.mu, False)):
            if not math.isfinite(value) or value < 0 or (positive and value == 0):
                raise ValueError(f"{flag} must be {'positive' if positive else 'non-negative'}, got {value:g}")

    def to_dict(self) -> dict:
        return asdict(self)


class NormAction(str, Enum):
    """What happens to an update beyond the bound."""

    CLIP = "clip"
    REJECT = "reject"


@dataclass(frozen=True)
class NormBound:
    """At most ``bound`` (L2, over the whole FE) between a counted client FE and the global FE."""

    bound: float
    action: NormAction = NormAction.CLIP

    def __post_init__(self) -> None:
        if isinstance(self.bound, bool) or not isinstance(self.bound, (int, float)) or not math.isfinite(self.bound) \
                or self.bound <= 0:
            raise ValueError(f"update norm bound must be a positive finite number, got {self.bound!r}")
        if self.action not in {a.value for a in NormAction}:
            raise ValueError(f"update norm action must be one of {[a.value for a in NormAction]}, got {self.action!r}")
        object.__setattr__(self, "action", NormAction(self.action))


def add_norm_bound_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The --update-norm-bound / --update-norm-action flags shared by the simulator and the broker loop."""
    parser.add_argument("--update-norm-bound", type=float, default=None, metavar="FLOAT",
                        help="robust aggregation: the largest L2 distance a client FE may have from the global FE "
                             "(whole FE, reconstructed to full rank); default: no bound")
    parser.add_argument("--update-norm-action", choices=[a.value for a in NormAction], default=NormAction.CLIP.value,
                        help="beyond the bound: scale the update back onto it (clip) or leave it out (reject)")


def norm_bound_from_args(args: argparse.Namespace) -> NormBound | None:
    """The rule the flags ask for, or None (the default: every update counts as sent)."""
    if args.update_norm_bound is None:
        return None
    return NormBound(args.update_norm_bound, NormAction(args.update_norm_action))
