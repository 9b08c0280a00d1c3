"""The integers a device masks: its real vector x scaled by γ, stochastically rounded (unbiased), in Z_{2^b}, and
the sum's way back to reals. b and γ are chosen from the round before anyone quantizes, so that the sum of every
participant's integers (and, under distributed DP, their noise) cannot wrap around the modulus.

Without DP a device sends p_i·clip_∞(Δ_i, R) (p_i its sample share of the round, Σ p_i = 1), so every coordinate
of the sum lies in [−R, R] and the integers in [−(γR + n), γR + n]: γ = (2^(b−1) − 1 − n)/R, the largest that fits.
The aggregate's error per coordinate is below n_survivors/γ (each rounding moves a value by less than one unit):
``Quantizer.sum_error``. Under DP a device sends clip_2(Δ_i, C) plus its noise; γ puts C at ``DP_UNITS`` units
(at least 100·√d, so that rounding, which can lengthen a vector by up to √d units, adds at most 1 % to its
sensitivity), and the plan checks n·(γC + 1) plus the noise's tail (``noise_margin``) against 2^(b−1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

BITS = 32
"""The modulus 2^32 (Flower's SecAgg+ takes the same): a coordinate travels as 4 bytes, a float32's size."""
DP_UNITS = 2 ** 16
"""Units of the clip C under DP, at least (KLS21 quantize to 16-20 bits a coordinate)."""
TAIL_FAILURE = 2.0 ** -40
"""The chance, over a whole vector, that the noise alone passes the margin kept for it."""


class QuantizeError(ValueError):
    """No scale lets the round's sum fit the modulus (too many devices or too much noise for b bits)."""


@dataclass(frozen=True)
class Quantizer:
    """Z_{2^bits}, a real unit being ``scale`` integers."""

    bits: int
    scale: float

    @property
    def modulus(self) -> int:
        return 1 << self.bits

    def encode(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """round_stochastic(γ·x) mod 2^b as uint64: ⌊γx⌋ + 1 with probability frac(γx), so E = γx."""
        scaled = np.asarray(x, dtype=np.float64) * self.scale
        low = np.floor(scaled)
        integers = (low + (rng.random(scaled.shape) < scaled - low)).astype(np.int64)
        return self.wrap(integers)

    def wrap(self, integers: np.ndarray) -> np.ndarray:
        """Signed integers into Z_{2^b} (uint64)."""
        return integers.astype(np.int64).view(np.uint64) & np.uint64(self.modulus - 1)

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return (a + b) & np.uint64(self.modulus - 1)

    def subtract(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return (a - b) & np.uint64(self.modulus - 1)

    def lift(self, total: np.ndarray) -> np.ndarray:
        """The signed integers in [−2^(b−1), 2^(b−1)) that ``total`` holds mod 2^b."""
        values = np.asarray(total, dtype=np.uint64).astype(np.int64)
        return np.where(values >= self.modulus // 2, values - self.modulus, values)

    def decode(self, total: np.ndarray) -> np.ndarray:
        """The real sum a sum of encodings stands for (float64)."""
        return self.lift(total).astype(np.float64) / self.scale

    def sum_error(self, devices: int) -> float:
        """The most the decoded sum of ``devices`` encodings differs from the reals' sum, per coordinate."""
        return devices / self.scale


def plain_quantizer(coordinate_range: float, devices: int, bits: int = BITS) -> Quantizer:
    """Without DP: each device's x within p_i·[−R, R], Σ p_i = 1, so |Σ γx| < γR + n; the largest γ that fits."""
    room = (1 << (bits - 1)) - 1 - devices
    if room <= 0 or not coordinate_range > 0:
        raise QuantizeError(f"{devices} devices do not fit {bits}-bit integers at range {coordinate_range:g}")
    return Quantizer(bits, room / coordinate_range)


def noise_margin(mu_total: float, dimension: int, failure: float = TAIL_FAILURE) -> float:
    """A bound the sum of Skellam noise of total parameter ``mu_total`` (variance 2μ) passes in some coordinate
    with probability at most ``failure``: Bernstein's inequality, P(|X| ≥ a) ≤ 2 exp(−a²/(2(2μ + a/3))), over
    ``dimension`` coordinates."""
    log_term = math.log(2 * dimension / failure)
    return log_term / 3 + math.sqrt(log_term ** 2 / 9 + 4 * mu_total * log_term)


def dp_quantizer(clip: float, dimension: int, devices: int, noise_per_unit: float, bits: int = BITS) -> Quantizer:
    """Under DP: γ with γC = max(DP_UNITS, 100·√d); ``noise_per_unit(γ)``: the total Skellam parameter the round's
    devices add at that γ. QuantizeError when the sum and its noise's margin pass 2^(b−1)."""
    scale = max(DP_UNITS, 100 * math.sqrt(dimension)) / clip
    need = devices * (scale * clip + 1) + noise_margin(noise_per_unit(scale), dimension)
    if need >= 1 << (bits - 1):
        raise QuantizeError(f"{devices} devices' clipped updates and their noise need {math.log2(need) + 1:.1f} "
                            f"bits, more than {bits}")
    return Quantizer(bits, scale)
