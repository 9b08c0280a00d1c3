"""Batched aggregation (server.engine.aggregate): factor products folded in chunks equal the per-client reconstruction,
the conv layout survives the fold, partial sums of several aggregators merge, memory stays within the fold."""
from __future__ import annotations

import pytest
import torch

from fedcore.lowrank import decompose, full_rank, matrix_shape, reconstruct_state
from server.engine.aggregate import StreamingAverage

SHAPES = {"fe.conv2.weight": (16, 8, 5, 5), "fe.conv2.bias": (16,), "fe.fc1.weight": (64, 200), "fe.fc1.bias": (64,)}
CONV_RANKS = (None, 20, 10, 5)  # None: the layer arrives dense
FC_RANKS = (None, 48, 32, 8)
FOLD_COLUMNS = 64  # a few clients per fold, so the test crosses many fold boundaries
CLIENTS = 30


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def layer_update(key: str, rank: int | None) -> dict[str, torch.Tensor]:
    """One layer's tensors of a client update: dense at rank None, else random U, V of that rank."""
    shape = SHAPES[key]
    layer = key.rsplit(".", 1)[0]
    if rank is None:
        return {key: torch.randn(shape)}
    rows, cols = matrix_shape(shape)
    return {layer + ".u": torch.randn(rows, rank), layer + ".v": torch.randn(cols, rank)}


def client_update(k: int) -> tuple[dict[str, torch.Tensor], int]:
    """Client k's float32 FE at mixed ranks per layer, and its sample count."""
    fe = {**layer_update("fe.conv2.weight", CONV_RANKS[k % 4]), **layer_update("fe.fc1.weight", FC_RANKS[(k // 2) % 4]),
          "fe.conv2.bias": torch.randn(16), "fe.fc1.bias": torch.randn(64)}
    return fe, 40 + 13 * k


def per_client_mean(updates: list[tuple[dict[str, torch.Tensor], int]]) -> dict[str, torch.Tensor]:
    """The reference: each update reconstructed on its own and added in float64."""
    sums = {k: torch.zeros(s, dtype=torch.float64) for k, s in SHAPES.items()}
    for fe, n in updates:
        for key, value in reconstruct_state(fe, SHAPES).items():
            sums[key] += n * value.double()
    total = sum(n for _, n in updates)
    return {k: s / total for k, s in sums.items()}


def max_relative_error(result: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    return max(float((result[k].double() - reference[k]).abs().max() / reference[k].abs().max()) for k in reference)


def test_batched_folds_equal_the_per_client_reconstruction():
    updates = [client_update(k) for k in range(CLIENTS)]
    average = StreamingAverage(SHAPES, fold_columns=FOLD_COLUMNS)
    for fe, n in updates:
        average.add(fe, n)
    assert max_relative_error(average.result(torch.float64), per_client_mean(updates)) < 1e-6


def test_float64_folds_equal_the_per_client_reconstruction_to_rounding():
    updates = [({k: v.double() for k, v in fe.items()}, n) for fe, n in (client_update(k) for k in range(CLIENTS))]
    average = StreamingAverage(SHAPES, fold_columns=FOLD_COLUMNS, product_dtype=torch.float64)
    for fe, n in updates:
        average.add(fe, n)
    assert max_relative_error(average.result(torch.float64), per_client_mean(updates)) < 1e-12


def test_full_rank_conv_factors_fold_back_to_the_conv_weight():
    """Fails if the fold's matrix is reshaped to the conv layout without the (c_out, kh, c_in, kw) permute."""
    weight = torch.randn(SHAPES["fe.conv2.weight"], dtype=torch.float64)
    u, v = decompose(weight, full_rank(tuple(weight.shape)))
    average = StreamingAverage(SHAPES, product_dtype=torch.float64)
    average.add({"fe.conv2.u": u, "fe.conv2.v": v, "fe.conv2.bias": torch.zeros(16),
                 "fe.fc1.weight": torch.zeros(64, 200), "fe.fc1.bias": torch.zeros(64)}, 5)
    assert torch.allclose(average.result(torch.float64)["fe.conv2.weight"], weight, atol=1e-10)


def test_three_merged_partials_equal_one_aggregator_over_all_updates():
    updates = [client_update(k) for k in range(CLIENTS)]
    single = StreamingAverage(SHAPES, fold_columns=FOLD_COLUMNS)
    shares = [StreamingAverage(SHAPES, fold_columns=FOLD_COLUMNS) for _ in range(3)]
    for k, (fe, n) in enumerate(updates):
        single.add(fe, n)
        shares[k % 3].add(fe, n)
    engine = StreamingAverage(SHAPES)
    for share in shares:
        engine.merge(share.partial())
    assert (engine.count, engine.total_weight) == (single.count, single.total_weight)
    assert max_relative_error(engine.result(torch.float64), single.result(torch.float64)) < 1e-6


def test_merge_rejects_partial_sums_over_other_tensors():
    other = StreamingAverage({"fe.fc9.bias": (3,)})
    other.add({"fe.fc9.bias": torch.ones(3)}, 1)
    with pytest.raises(ValueError, match="fe.fc9.bias"):
        StreamingAverage(SHAPES).merge(other.partial())


def test_result_mid_round_then_more_updates_still_averages_all():
    updates = [client_update(k) for k in range(5)]
    average = StreamingAverage(SHAPES, fold_columns=FOLD_COLUMNS)
    for fe, n in updates[:3]:
        average.add(fe, n)
    average.result()
    for fe, n in updates[3:]:
        average.add(fe, n)
    assert max_relative_error(average.result(torch.float64), per_client_mean(updates)) < 1e-6


def test_pending_factor_columns_never_exceed_the_fold_width():
    average = StreamingAverage(SHAPES, fold_columns=FOLD_COLUMNS)
    widest = 0
    for k in range(4 * CLIENTS):
        average.add(*client_update(k))
        widest = max([widest, *(fold.used for fold in average._folds.values())])
    assert 0 < widest <= FOLD_COLUMNS


def test_malformed_update_counts_for_nothing():
    good, n = client_update(1)
    average = StreamingAverage(SHAPES)
    average.add(good, n)
    bad = {**client_update(2)[0], "fe.fc1.u": torch.randn(64, 8), "fe.fc1.v": torch.randn(199, 8)}
    bad.pop("fe.fc1.weight", None)
    with pytest.raises(ValueError, match="do not fit fe.fc1.weight"):
        average.add(bad, 10)
    assert average.count == 1
    assert max_relative_error(average.result(torch.float64), per_client_mean([(good, n)])) < 1e-6
