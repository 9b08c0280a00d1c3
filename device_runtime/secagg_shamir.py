"""Shamir secret sharing (Shamir, CACM 1979) over the prime field GF(2^521 − 1): what SecAgg+ gives each device's
neighbours of its mask key and self-mask seed, so that any ``threshold`` of them rebuild a secret and fewer learn
nothing about it (every value of the secret is equally likely given threshold − 1 shares).

A secret is a byte string of at most 64 bytes (a 32-byte X25519 private key or seed); the polynomial's random
coefficients come from ``secrets`` (the OS's generator). Holders are numbered 1..n (the x-coordinates; 0 would be
the secret itself).
"""
from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping

PRIME = 2 ** 521 - 1
"""A Mersenne prime above every 64-byte secret."""
SECRET_BYTES_MAX = 64


class ShamirError(ValueError):
    """Shares that cannot rebuild a secret: fewer than the threshold, holder 0, or repeated holders."""


def split(secret: bytes, holders: Iterable[int], threshold: int) -> dict[int, int]:
    """One share per holder (x-coordinate >= 1): the points of a random polynomial of degree threshold − 1 whose
    value at 0 is the secret (its length is kept in the top byte)."""
    xs = sorted(set(holders))
    if len(secret) > SECRET_BYTES_MAX:
        raise ShamirError(f"a secret holds at most {SECRET_BYTES_MAX} bytes, got {len(secret)}")
    if not xs or xs[0] < 1:
        raise ShamirError(f"holders are numbered from 1, got {xs[:3]}")
    if not 1 <= threshold <= len(xs):
        raise ShamirError(f"threshold {threshold} must be between 1 and the {len(xs)} holders")
    value = int.from_bytes(bytes([len(secret)]) + secret, "big")
    coefficients = [value] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    return {x: _evaluate(coefficients, x) for x in xs}


def recover(shares: Mapping[int, int], threshold: int) -> bytes:
    """The secret from at least ``threshold`` shares (x -> y); ShamirError with fewer (they determine nothing)."""
    points = [(x, y) for x, y in sorted(shares.items())]
    if len(points) < threshold:
        raise ShamirError(f"{len(points)} share(s) cannot rebuild a secret shared at threshold {threshold}")
    if any(x < 1 for x, _ in points):
        raise ShamirError("a share at x = 0 is the secret itself, never a share")
    points = points[:threshold]
    value = 0
    for i, (xi, yi) in enumerate(points):
        numerator, denominator = 1, 1
        for j, (xj, _) in enumerate(points):
            if i != j:
                numerator = numerator * -xj % PRIME
                denominator = denominator * (xi - xj) % PRIME
        value = (value + yi * numerator * pow(denominator, -1, PRIME)) % PRIME
    raw = value.to_bytes((value.bit_length() + 7) // 8 or 1, "big")
    if len(raw) != raw[0] + 1:  # the length byte leads: random (wrong, forged) shares rarely rebuild one that fits
        raise ShamirError("the shares do not rebuild a secret of this sharing (wrong or forged shares)")
    return raw[1:]


def _evaluate(coefficients: list[int], x: int) -> int:
    result = 0
    for c in reversed(coefficients):
        result = (result * x + c) % PRIME
    return result


SHARE_BYTES = 66
"""A share's y-coordinate as bytes (big-endian; 521 bits)."""


def share_to_bytes(y: int) -> bytes:
    return y.to_bytes(SHARE_BYTES, "big")


def share_from_bytes(data: bytes) -> int:
    if len(data) != SHARE_BYTES:
        raise ShamirError(f"a share is {SHARE_BYTES} bytes, got {len(data)}")
    y = int.from_bytes(data, "big")
    if y >= PRIME:
        raise ShamirError("a share outside the field")
    return y
