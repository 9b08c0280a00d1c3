"""The rule that chooses a SecAgg+ round's neighbours k and threshold t (``server.engine.secagg_parameters``): the
complete graph for small rounds, O(log n)-sized subgraphs for large ones, every bound recomputed here independently
(scipy's distributions), and explicit values that miss a bound refused."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binom, hypergeom

from device_runtime.secagg_graph import neighbours
from server.engine.secagg_parameters import (CORRECTNESS_BITS, SECURITY_BITS, choose, dropout_bound, parameters,
                                             violation)


@pytest.mark.parametrize("n,dropout,k,t", [(3, 0.1, 2, 2), (4, 0.1, 3, 3), (10, 0.3, 9, 6), (10, 0.1, 9, 6)])
def test_small_rounds_get_the_complete_graph_and_a_majority_threshold(n, dropout, k, t):
    g = choose(n, dropout, 0.1)
    assert (g.neighbors, g.threshold, g.complete) == (k, t, True)
    assert g.min_survivors(n) == t  # complete: exactly the rounds with >= t survivors can be unmasked


def test_the_complete_graphs_threshold_exceeds_the_corrupt_devices():
    assert choose(10, 0.3, 0.4).threshold == 6 and choose(20, 0.3, 0.45).threshold == 11
    assert choose(20, 0.6, 0.45).complete


def test_the_dropout_bound_is_the_binomial_quantile_at_the_correctness_parameter():
    for n, rate in [(10, 0.3), (300, 0.1), (1000, 0.05), (50, 0.0)]:
        d = dropout_bound(n, rate)
        limit = 2.0 ** -(CORRECTNESS_BITS + 1)
        assert binom.sf(d, n, rate) <= limit * (1 + 1e-9)
        assert d == 0 or binom.sf(d - 1, n, rate) > limit


@pytest.mark.parametrize("n,dropout,corrupt", [(300, 0.1, 0.1), (1000, 0.05, 0.1), (3000, 0.1, 0.05), (300, 0.0, 0.1)])
def test_a_large_rounds_subgraph_meets_every_bound_recomputed_independently(n, dropout, corrupt):
    g = choose(n, dropout, corrupt)
    k, t, bad_corrupt = g.neighbors, g.threshold, math.floor(corrupt * n)
    assert not g.complete and k % 2 == 0 and k < n // 4
    bad = min(n, bad_corrupt + g.dropouts)
    disconnected = n * (n - k - 1) / 2 * hypergeom.pmf(k, n, bad, k)  # the k nodes of two gaps, all bad
    exposed = n * hypergeom.sf(t - 1, n - 1, bad_corrupt, k)  # some device with t corrupt neighbours
    unrecoverable = n * hypergeom.cdf(t - 1, n - 1, n - 1 - g.dropouts, k)  # fewer than t surviving neighbours
    assert disconnected <= 2.0 ** -(SECURITY_BITS + 1) * (1 + 1e-6)
    assert exposed <= 2.0 ** -(SECURITY_BITS + 1) * (1 + 1e-6)
    assert unrecoverable <= 2.0 ** -(CORRECTNESS_BITS + 1) * (1 + 1e-6)
    assert t > (k + 1) / 2


def test_the_chosen_k_is_the_smallest_that_meets_the_bounds():
    g = choose(300, 0.1, 0.1)
    assert violation(300, g.neighbors, g.threshold, 0.1, 0.1) is None
    smaller = g.neighbors - 2
    assert all(violation(300, smaller, t, 0.1, 0.1) is not None for t in range(smaller // 2 + 1, smaller + 1))
    assert violation(300, g.neighbors, g.threshold - 1, 0.1, 0.1) is not None  # and t the smallest at that k


def short_devices(n: int, k: int, t: int, rate: float, trials: int) -> int:
    """Over ``trials`` random graphs and independent drops at ``rate``: devices left with fewer than t surviving
    holders (their neighbours and themselves)."""
    ids = [f"d{i:03d}" for i in range(n)]
    rng = np.random.default_rng(0)
    found = 0
    for trial in range(trials):
        graph = neighbours(ids, k, trial.to_bytes(4, "big"))
        alive = {d for d in ids if rng.random() >= rate}
        found += sum(sum(u in alive for u in (*graph[d], d)) < t for d in ids)
    return found


@pytest.mark.parametrize("n,rate", [(300, 0.1), (30, 0.3)])
def test_with_the_rules_k_and_t_every_device_keeps_its_holders_when_devices_drop_at_the_stated_rate(n, rate):
    g = choose(n, rate, 0.1)
    assert short_devices(n, g.neighbors, g.threshold, rate, 40) == 0


def test_the_old_default_of_2_log2_n_neighbours_loses_devices_at_30_percent_dropout():
    assert short_devices(30, 10, 6, 0.3, 40) > 0


@pytest.mark.parametrize("k,t,says", [
    (4, 3, "--secagg-neighbors 4"),        # a small ring: its survivors' graph disconnects
    (60, 31, None),
    (60, 55, "--secagg-neighbors 60 --secagg-threshold 55"),  # too high: dropped devices cannot be rebuilt
])
def test_explicit_values_are_checked_against_the_bounds(k, t, says):
    found = violation(300, k, t, 0.1, 0.1)
    assert (found is None) if says is None else (says in found)


def test_a_complete_graph_threshold_at_or_below_the_corrupt_devices_is_refused():
    assert "corrupt devices" in violation(10, 9, 6, 0.1, 0.6)  # 6 corrupt of 10 would hold 6 shares


def test_one_explicit_flag_takes_the_rules_other_value_and_a_violation_names_the_fix():
    assert parameters(10, None, 7, 0.3, 0.1).neighbors == 9
    assert parameters(300, 60, None, 0.1, 0.1).threshold == choose(300, 0.1, 0.1).threshold
    with pytest.raises(ValueError, match=r"leave it out \(the rule gives k = 9, t = 6 for 10 devices\)"):
        parameters(10, 8, 5, 0.3, 0.1)
    with pytest.raises(ValueError, match="at least 3 participants"):
        parameters(2, None, None, 0.1, 0.1)
