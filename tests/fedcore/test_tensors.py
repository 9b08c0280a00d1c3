"""Which tensors the runtime carries (parameters and BatchNorm running statistics, not the counter), which are step
state, and the one-line refusals of what it cannot carry."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fedcore.tensors import UnsupportedModel, carried_tensors, check_tensors, state_names, without_counters
from tests.support.edge_models import ds_cnn


def test_the_batchnorm_counter_is_not_carried_and_the_running_statistics_are_state():
    model = ds_cnn()
    assert not any(k.endswith("num_batches_tracked") for k in carried_tensors(model))
    assert state_names(model) == tuple(f"fe.bn{i}.running_{s}" for i in (1, 2, 3) for s in ("mean", "var"))


def test_without_counters_removes_the_counter_buffers_and_keeps_training_working():
    model = without_counters(ds_cnn())
    assert tuple(model.state_dict()) == tuple(carried_tensors(model))
    model.train()(torch.randn(2, 1, 12, 10))  # nothing to increment, no error


def test_momentum_none_is_refused_in_one_line_with_the_fix():
    model = ds_cnn()
    model.fe.bn1.momentum = None
    with pytest.raises(UnsupportedModel, match=r"^fe\.bn1: BatchNorm2d with momentum=None .*momentum=0\.1$"):
        check_tensors(model)


def test_batchnorm_without_running_statistics_is_refused():
    model = ds_cnn()
    model.fe.add_module("bn4", nn.BatchNorm1d(16, track_running_stats=False))
    with pytest.raises(UnsupportedModel, match=r"^fe\.bn4: BatchNorm1d with track_running_stats=False"):
        check_tensors(model)


def test_an_integer_buffer_is_refused_in_one_line_with_the_fix():
    model = ds_cnn()
    model.fe.register_buffer("positions", torch.arange(4))
    with pytest.raises(UnsupportedModel, match=r"^fe\.positions: a torch\.int64 tensor is refused: .*persistent=False"):
        check_tensors(model)
