"""The round's average folded on a worker thread (server.engine.background_average): the in-line fold's bits, checks
at once, a failure in the worker raised to the caller (never a hang), and a bounded queue."""
from __future__ import annotations

import threading

import pytest
import torch

from fedcore.lowrank import matrix_shape
from server.engine.aggregate import CheckedUpdate, StreamingAverage
from server.engine.background_average import BackgroundAverage, FoldFailed

SHAPES = {"fe.conv2.weight": (16, 8, 5, 5), "fe.conv2.bias": (16,), "fe.fc1.weight": (64, 200), "fe.fc1.bias": (64,)}
RANKS = (None, 48, 20, 8)  # None: fc1 arrives dense
FOLD_COLUMNS = 64  # a few clients per fold: the test crosses many fold boundaries
CLIENTS = 40


def client_update(k: int, generator: torch.Generator) -> tuple[dict[str, torch.Tensor], int]:
    """Client k's float32 FE, fc1 at a rank that cycles through RANKS, and its sample count."""
    fe = {"fe.conv2.weight": torch.randn(SHAPES["fe.conv2.weight"], generator=generator),
          "fe.conv2.bias": torch.randn(16, generator=generator), "fe.fc1.bias": torch.randn(64, generator=generator)}
    rank = RANKS[k % len(RANKS)]
    if rank is None:
        fe["fe.fc1.weight"] = torch.randn(SHAPES["fe.fc1.weight"], generator=generator)
    else:
        rows, cols = matrix_shape(SHAPES["fe.fc1.weight"])
        fe["fe.fc1.u"] = torch.randn(rows, rank, generator=generator)
        fe["fe.fc1.v"] = torch.randn(cols, rank, generator=generator)
    return fe, 40 + 13 * k


def updates() -> list[tuple[dict[str, torch.Tensor], int]]:
    generator = torch.Generator().manual_seed(0)
    return [client_update(k, generator) for k in range(CLIENTS)]


class FailingAverage(StreamingAverage):
    """Fails in the arithmetic of its ``fail_at``-th update (as a bug or a failed allocation would)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__(SHAPES, fold_columns=FOLD_COLUMNS)
        self.fail_at, self.added = fail_at, 0

    def accumulate(self, update: CheckedUpdate) -> None:
        self.added += 1
        if self.added == self.fail_at:
            raise MemoryError("no room for the fold buffer")
        super().accumulate(update)


class GatedAverage(StreamingAverage):
    """Its arithmetic waits until ``gate`` is set: the worker is busy for as long as the test says."""

    def __init__(self) -> None:
        super().__init__(SHAPES, fold_columns=FOLD_COLUMNS)
        self.gate, self.started = threading.Event(), threading.Event()

    def accumulate(self, update: CheckedUpdate) -> None:
        self.started.set()
        assert self.gate.wait(30)
        super().accumulate(update)


def test_the_worker_fold_gives_the_in_line_folds_bits():
    inline = StreamingAverage(SHAPES, fold_columns=FOLD_COLUMNS)
    background = BackgroundAverage(StreamingAverage(SHAPES, fold_columns=FOLD_COLUMNS))
    for fe, n in updates():
        inline.add(fe, n)
        background.add(fe, n)
    expected, got = inline.partial(), background.partial()
    assert (got.total_weight, got.count) == (expected.total_weight, expected.count)
    for key, value in expected.sums.items():
        assert torch.equal(got.sums[key], value), key


def test_a_malformed_update_is_refused_at_add_and_nothing_of_it_counts():
    background = BackgroundAverage(StreamingAverage(SHAPES, fold_columns=FOLD_COLUMNS))
    fe, n = updates()[0]
    background.add(fe, n)
    with pytest.raises(ValueError, match="fe.conv2.bias"):
        background.add({**fe, "fe.conv2.bias": torch.zeros(17)}, n)
    assert background.partial().count == 1


def test_an_error_in_the_worker_is_raised_to_the_caller_not_a_hang():
    background = BackgroundAverage(FailingAverage(fail_at=3))
    with pytest.raises(FoldFailed) as raised:
        for fe, n in updates()[:10]:  # the failure shows at the first add after it, or at the read
            background.add(fe, n)
        background.result()
    assert isinstance(raised.value.__cause__, MemoryError)
    assert "no room for the fold buffer" in str(raised.value)
    with pytest.raises(FoldFailed):  # and stays: the sums are incomplete
        background.partial()


def test_add_waits_while_the_queue_holds_its_bound():
    gated = GatedAverage()
    first, second = updates()[:2]
    background = BackgroundAverage(gated, max_queued_bytes=1)  # one update at a time
    background.add(*first)
    assert gated.started.wait(30)
    queued = threading.Event()
    adder = threading.Thread(target=lambda: (background.add(*second), queued.set()))
    adder.start()
    assert not queued.wait(0.3)  # the worker still holds the first update: the second waits
    gated.gate.set()
    adder.join(30)
    assert queued.is_set() and background.partial().count == 2
