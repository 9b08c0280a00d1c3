"""Secure aggregation's building blocks on the device (numpy and ``cryptography``, no torch): Shamir sharing,
masks, sealed shares, the neighbour graph, quantization and the Skellam noise."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest

from device_runtime.secagg_crypto import CryptoError, KeyPair, agree, mask, open_sealed, seal
from device_runtime.secagg_graph import check_graph, neighbours
from device_runtime.secagg_noise import skellam
from device_runtime.secagg_quantize import (QuantizeError, Quantizer, dp_quantizer, noise_margin,
                                            plain_quantizer)
from device_runtime.secagg_shamir import ShamirError, recover, split


def test_shamir_rebuilds_the_secret_from_any_threshold_shares():
    secret = os.urandom(32)
    shares = split(secret, range(1, 8), 4)
    assert recover({x: shares[x] for x in (2, 3, 5, 7)}, 4) == secret
    assert recover({x: shares[x] for x in (1, 4, 6, 7)}, 4) == secret


def test_shamir_refuses_one_share_below_the_threshold():
    shares = split(os.urandom(32), range(1, 8), 4)
    with pytest.raises(ShamirError, match="3 share"):
        recover({x: shares[x] for x in (1, 2, 3)}, 4)


def test_masks_from_both_ends_of_an_agreement_cancel_exactly():
    a, b = KeyPair.generate(), KeyPair.generate()
    bits = 32
    m_ab = mask(agree(a.private, b.public, "mask", b"run|1"), 1000, bits)
    m_ba = mask(agree(b.private, a.public, "mask", b"run|1"), 1000, bits)
    x = np.arange(1000, dtype=np.uint64)
    q = Quantizer(bits, 1.0)
    assert np.array_equal(q.subtract(q.add(x, m_ab), m_ba), x)
    assert (m_ab < 2 ** bits).all() and len(np.unique(m_ab)) > 990


def test_a_mask_is_bound_to_its_round():
    a, b = KeyPair.generate(), KeyPair.generate()
    one = mask(agree(a.private, b.public, "mask", b"run|1"), 16, 32)
    two = mask(agree(a.private, b.public, "mask", b"run|2"), 16, 32)
    assert not np.array_equal(one, two)


def test_a_sealed_share_opens_only_for_its_recipient_and_context():
    a, b, c = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    sealed = seal(agree(a.private, b.public, "share", b"r1"), b"share", b"r1|a>b")
    assert open_sealed(agree(b.private, a.public, "share", b"r1"), sealed, b"r1|a>b") == b"share"
    with pytest.raises(CryptoError):
        open_sealed(agree(c.private, a.public, "share", b"r1"), sealed, b"r1|a>b")
    with pytest.raises(CryptoError):
        open_sealed(agree(b.private, a.public, "share", b"r1"), sealed, b"r1|a>c")


def test_the_graph_is_k_regular_symmetric_and_the_same_for_everyone():
    ids = [f"d{i:03d}" for i in range(50)]
    k = 12
    graph = neighbours(ids, k, b"round seed")
    assert all(len(v) == k and d not in v for d, v in graph.items())
    assert all(d in graph[v] for d, vs in graph.items() for v in vs)
    assert graph == neighbours(list(reversed(ids)), k, b"round seed")
    assert graph != neighbours(ids, k, b"another seed")


@pytest.mark.parametrize("n,k,t,problem", [(10, 8, 5, None), (10, 8, 4, "above (k + 1)/2"), (10, 8, 9, "at most k"),
                                           (10, 5, 3, "even"), (10, 10, 6, "between 2"), (2, 1, 1, "at least 3"),
                                           (10, 9, 6, None), (10, 9, 5, "above (k + 1)/2")])
def test_graph_settings_are_structurally_valid(n, k, t, problem):
    """A device and its k neighbours hold its shares: t is a majority of those k + 1 and at most k."""
    found = check_graph(n, k, t)
    assert (found is None) if problem is None else (problem in found)


@pytest.mark.parametrize("devices", [1, 10, 1000])
def test_plain_quantization_cannot_overflow_at_the_extremes(devices):
    """n devices at ±R with weights 1/n sum to ±R: inside the modulus, and decoded within n/γ."""
    q = plain_quantizer(8.0, devices)
    rng = np.random.default_rng(1)
    for value in (8.0, -8.0, 0.0):
        x = np.full(4, value / devices)
        total = np.zeros(4, dtype=np.uint64)
        for _ in range(devices):
            total = q.add(total, q.encode(x, rng))
        assert np.all(np.abs(q.decode(total) - value) <= q.sum_error(devices))
    assert q.lift(q.wrap(np.array([(1 << 31) - 1]))) == (1 << 31) - 1


def test_stochastic_rounding_is_unbiased():
    q = Quantizer(32, 1.0)
    rng = np.random.default_rng(2)
    draws = q.decode(q.encode(np.full(200_000, 0.25), rng))
    assert set(np.unique(draws)) == {0.0, 1.0}
    assert abs(draws.mean() - 0.25) < 5 * math.sqrt(0.25 * 0.75 / 200_000)


def test_dp_quantization_leaves_room_for_the_noise_tail_and_refuses_when_it_cannot():
    q = dp_quantizer(1.0, 10_000, 100, lambda scale: (1.0 * scale) ** 2 / 2)
    assert 100 * (q.scale + 1) + noise_margin((q.scale ** 2) / 2, 10_000) < 2 ** 31
    with pytest.raises(QuantizeError, match="bits"):
        dp_quantizer(1.0, 10_000, 100_000, lambda scale: (10 * scale) ** 2 / 2, bits=24)


def test_skellam_noise_has_variance_two_mu_and_integer_values():
    rng = np.random.default_rng(3)
    draws = skellam(50.0, 200_000, rng)
    assert draws.dtype == np.int64
    assert abs(draws.var() - 100.0) < 2.0 and abs(draws.mean()) < 0.1
    assert not skellam(0.0, 5, rng).any()


def test_noise_margin_holds_the_sum_of_noise():
    rng = np.random.default_rng(4)
    draws = skellam(1e4, 100_000, rng)
    assert np.abs(draws).max() < noise_margin(1e4, 100_000)


def test_dp_quantization_holds_n_devices_at_the_clip_with_their_noise():
    """n devices at +C (and at −C) with their Skellam shares: the decoded sum is nC within the noise's margin,
    never wrapped around."""
    from device_runtime.secagg_noise import total_mu
    clip, d, n, s, z = 0.5, 1000, 50, 26, 1.0
    q = dp_quantizer(clip, d, n, lambda g: n / s * total_mu(z, g, clip, d))
    mu = total_mu(z, q.scale, clip, d) / s
    rng = np.random.default_rng(7)
    for sign in (1.0, -1.0):
        x = np.zeros(d)
        x[0] = sign * clip
        total = np.zeros(d, dtype=np.uint64)
        for _ in range(n):
            total = q.add(total, q.add(q.encode(x, rng), q.wrap(skellam(mu, d, rng))))
        margin = noise_margin(n * mu, d) / q.scale + q.sum_error(n)
        assert abs(q.decode(total)[0] - sign * n * clip) < margin
        assert np.all(np.abs(q.decode(total)[1:]) < margin)
