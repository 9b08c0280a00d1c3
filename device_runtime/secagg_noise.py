"""Distributed DP's noise: the Skellam mechanism (Agarwal, Kairouz, Liu, NeurIPS 2021, "The Skellam Mechanism for
Differentially Private Federated Learning"). Each device adds Sk(μ/s) = Poisson(μ/s) − Poisson(μ/s) to every
integer it masks; Skellam variables add up (Sk(a) + Sk(b) = Sk(a + b)), so the sum of at least s survivors carries
Sk(μ') with μ' >= μ, the noise the accountant charges (``server.engine.accountant.skellam_epsilon``). The server
only ever sees the masked vectors and the noised sum.

The integers are drawn by numpy's PCG64 seeded with 256 bits from ``secrets`` (the OS's generator), as the central
mechanism's noise is (``server.engine.privacy``); Poisson sampling is integer-valued, so none of the floating-point
side channels of a continuous Gaussian arise in the noise itself.
"""
from __future__ import annotations

import math
import secrets

import numpy as np


def secure_generator() -> np.random.Generator:
    """A generator seeded from the OS's secure source (a device's rounding and noise)."""
    return np.random.default_rng(secrets.randbits(256))


def skellam(mu: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` draws of Sk(μ) (int64; variance 2μ); zeros for μ = 0."""
    if mu == 0:
        return np.zeros(size, dtype=np.int64)
    return rng.poisson(mu, size).astype(np.int64) - rng.poisson(mu, size).astype(np.int64)


def sensitivity(scale: float, clip: float, dimension: int) -> float:
    """The L2 sensitivity of one device's integers: γC, plus at most √d from stochastic rounding (each coordinate
    moves by less than one unit)."""
    return scale * clip + math.sqrt(dimension)


def total_mu(noise_multiplier: float, scale: float, clip: float, dimension: int) -> float:
    """The total Skellam parameter μ of the sum whose Gaussian part has multiplier z on the rounded sensitivity:
    2μ = (z·Δ₂)²."""
    return (noise_multiplier * sensitivity(scale, clip, dimension)) ** 2 / 2
