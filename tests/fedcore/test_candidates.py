"""Factorization says what it can do: the candidates are exactly the factorizable FE layers, every other FE
Linear/Conv is listed with its reason, a plan naming one is refused in one line, Conv1d factorizes exactly at full
rank, and "skip the input layer" is a rule on the full rank that a plan can override."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fedcore.lowrank import (DEFAULT_MIN_FULL_RANK, FactorizedConv1d, RankPlan, check_ranks, decompose,
                             default_layers, factorization_candidates, factorize_model, full_rank, reconstruct,
                             resolve_plan)
from fedcore.models import ARCHITECTURES, build_model
from fedcore.tensors import UnsupportedModel
from tests.support.edge_models import conv1d_net, ds_cnn, tiny_transformer


@pytest.mark.parametrize("stride, padding", [(1, 0), (2, 1)])
def test_a_full_rank_factorized_conv1d_equals_the_dense_one(stride, padding):
    torch.manual_seed(0)
    dense = nn.Conv1d(4, 6, 3, stride=stride, padding=padding)
    u, v = decompose(dense.weight, full_rank(tuple(dense.weight.shape)))
    exact = FactorizedConv1d(u, v, dense.bias, tuple(dense.weight.shape), dense.stride, dense.padding)
    x = torch.randn(2, 4, 11)
    assert torch.allclose(exact(x), dense(x), atol=1e-5)


def test_reconstruct_inverts_decompose_for_a_conv1d_weight():
    weight = torch.randn(6, 4, 3)
    u, v = decompose(weight, full_rank(tuple(weight.shape)))
    assert u.shape == (6, 6) and v.shape == (12, 6)
    assert torch.allclose(reconstruct(u, v, tuple(weight.shape)), weight, atol=1e-5)


def test_depthwise_convolutions_are_excluded_with_their_reason():
    candidates = factorization_candidates(ds_cnn())
    assert list(candidates.layers) == ["fe.conv1", "fe.pw"]
    assert candidates.excluded == {"fe.dw": "depthwise Conv2d (groups=8) cannot be factorized"}


def test_a_grouped_not_depthwise_convolution_is_named_grouped():
    model = ds_cnn()
    model.fe.dw = nn.Conv2d(8, 8, 3, padding=1, groups=2)
    assert factorization_candidates(model).excluded["fe.dw"] == "grouped Conv2d (groups=2) cannot be factorized"


def test_a_depthwise_conv1d_is_excluded_and_the_other_conv1ds_are_candidates():
    candidates = factorization_candidates(conv1d_net())
    assert list(candidates.layers) == ["fe.conv1", "fe.conv2"]
    assert list(candidates.excluded) == ["fe.dw"]


def test_layers_whose_parent_reads_their_weight_are_excluded():
    candidates = factorization_candidates(tiny_transformer())
    assert "MultiheadAttention" in candidates.excluded["fe.encoder.self_attn.out_proj"]
    assert list(candidates.layers) == ["fe.embed"]


def test_a_linear_called_by_its_parent_is_a_candidate():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(x) + x

    model = build_model("fedavgcnn", (1, 28, 28), 10)
    model.fe.add_module("block", Block())
    assert "fe.block.proj" in factorization_candidates(model).layers


def test_a_plan_naming_an_excluded_layer_is_refused_in_one_line():
    with pytest.raises(UnsupportedModel) as refused:
        resolve_plan(ds_cnn(width=16), RankPlan(0.5, ("dw",)))
    assert str(refused.value) == "fe.dw: depthwise Conv2d (groups=16) cannot be factorized"


def test_ranks_for_an_excluded_layer_are_refused_in_one_line():
    with pytest.raises(UnsupportedModel, match=r"^fe\.dw: depthwise Conv2d \(groups=8\) cannot be factorized$"):
        check_ranks(ds_cnn(), {"fe.dw": 1})


@pytest.mark.parametrize("name", tuple(ARCHITECTURES))
def test_the_default_size_rule_skips_exactly_the_zoo_input_layer(name):
    for shape in ((1, 28, 28), (3, 32, 32)):
        model = build_model(name, shape, 10)
        assert default_layers(model) == tuple(factorization_candidates(model).layers)[1:]


def test_a_plan_can_lower_the_size_rule_to_factorize_the_input_layer():
    model = build_model("fedavgcnn", (1, 28, 28), 10)
    assert "fe.conv1" not in resolve_plan(model, RankPlan(0.2)).ranks
    assert resolve_plan(model, RankPlan(0.2, min_full_rank=1)).ranks["fe.conv1"] == 1


def test_the_size_rule_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="min_full_rank"):
        RankPlan(0.5, min_full_rank=0)
    assert DEFAULT_MIN_FULL_RANK == 16


def test_a_factorized_conv1d_net_keeps_its_batchnorm_and_depthwise_layers():
    model = conv1d_net()
    client = factorize_model(model, {"fe.conv2": 4})
    x = torch.randn(3, 3, 16)
    assert isinstance(client.fe.conv2, FactorizedConv1d)
    assert client.fe.dw is not model.fe.dw and client(x).shape == (3, 4)

