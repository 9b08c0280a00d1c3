import numpy as np
import pytest
import torch
from torch import nn

from device_runtime import frobenius
from fedcore.lowrank import (FactorizedConv2d, RankPlan, decay_factors, decompose, factorize_layer, factorize_model,
                            factorize_state, fe_state, frobenius_decay_step, full_rank,
                            matrix_shape, reconstruct, reconstruct_state, resolve_plan)
from fedcore.models import build_model


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def test_full_rank_factorized_linear_equals_dense():
    dense = nn.Linear(12, 7)
    x = torch.randn(5, 12)
    factorized = factorize_layer(dense, full_rank(tuple(dense.weight.shape)))
    assert torch.allclose(factorized(x), dense(x), atol=1e-5)


@pytest.mark.parametrize("stride,padding", [(1, 0), (2, 1), ((2, 1), (1, 2))])
def test_full_rank_factorized_conv_equals_dense(stride, padding):
    dense = nn.Conv2d(3, 6, 5, stride=stride, padding=padding)
    x = torch.randn(2, 3, 15, 13)
    factorized = factorize_layer(dense, full_rank(tuple(dense.weight.shape)))
    assert factorized(x).shape == dense(x).shape
    assert torch.allclose(factorized(x), dense(x), atol=1e-5)


def test_non_square_kernel_conv_factorizes_exactly():
    dense = nn.Conv2d(2, 4, (3, 5), padding=(1, 2))
    x = torch.randn(1, 2, 9, 9)
    factorized = factorize_layer(dense, full_rank(tuple(dense.weight.shape)))
    assert torch.allclose(factorized(x), dense(x), atol=1e-5)


@pytest.mark.parametrize("shape", [(7, 12), (12, 7), (8, 3, 5, 5), (4, 6, 3, 3)])
def test_reconstruct_inverts_decompose_at_full_rank(shape):
    weight = torch.randn(shape)
    u, v = decompose(weight, full_rank(shape))
    assert torch.allclose(reconstruct(u, v, shape), weight, atol=1e-5)


def test_factor_shapes_follow_the_permuted_conv_layout():
    u, v = decompose(torch.randn(8, 3, 5, 5), 4)
    assert u.shape == (8 * 5, 4) and v.shape == (3 * 5, 4)
    assert matrix_shape((8, 3, 5, 5)) == (40, 15)


def test_truncated_error_is_the_eckart_young_optimum():
    weight = torch.randn(20, 4, 3, 3, dtype=torch.float64)
    rank = 5
    u, v = decompose(weight, rank)
    error = torch.linalg.norm(reconstruct(u, v, weight.shape) - weight)
    matrix = weight.permute(0, 2, 1, 3).reshape(60, 12)
    tail = torch.linalg.svdvals(matrix)[rank:]
    assert torch.isclose(error, tail.square().sum().sqrt(), rtol=1e-9)


def test_factors_are_balanced_spectral_init():
    weight = torch.randn(10, 6, dtype=torch.float64)
    u, v = decompose(weight, 3)
    assert torch.allclose(u.T @ u, v.T @ v, atol=1e-10)


def test_conv_layout_without_permute_is_not_separable():
    """The popular reshape-without-permute layout cannot run as a 1×k then k×1 conv pair."""
    weight = torch.randn(6, 3, 5, 5)
    x = torch.randn(1, 3, 11, 11)
    dense = nn.Conv2d(3, 6, 5, bias=False)
    dense.weight.data = weight
    naive_matrix = weight.reshape(6 * 5, 3 * 5)
    u, s, vh = torch.linalg.svd(naive_matrix, full_matrices=False)
    naive = FactorizedConv2d(u * s.sqrt(), vh.T * s.sqrt(), None, weight.shape, (1, 1), (0, 0))
    assert not torch.allclose(naive(x), dense(x), atol=1e-3)
    u, v = decompose(weight, full_rank(weight.shape))
    exact = FactorizedConv2d(u, v, None, weight.shape, (1, 1), (0, 0))
    assert torch.allclose(exact(x), dense(x), atol=1e-4)


def test_decompose_rejects_rank_above_full():
    with pytest.raises(ValueError, match="outside"):
        decompose(torch.randn(4, 3), 4)


def test_decompose_rejects_non_matrix_weights():
    with pytest.raises(ValueError, match="2-D"):
        decompose(torch.randn(3, 3, 3, 3, 3), 1)


@pytest.mark.parametrize("ratio", [0.0, -0.5, 1.5])
def test_plan_rejects_ratio_outside_unit_interval(ratio):
    with pytest.raises(ValueError, match="rank ratio"):
        RankPlan(ratio)


def test_plan_rejects_unknown_layer():
    model = build_model("fedavgcnn", (1, 28, 28), 10)
    with pytest.raises(ValueError, match="unknown FE layer"):
        resolve_plan(model, RankPlan(0.5, ("fc9",)))


def test_default_plan_factorizes_all_but_the_input_layer():
    model = build_model("fedavgcnn", (1, 28, 28), 10)
    plan = resolve_plan(model, RankPlan(0.25))
    assert plan.ranks == {"fe.conv2": 40, "fe.fc1": 128}


def test_plan_keeps_dense_where_factors_would_be_larger():
    model = build_model("fedavgcnn", (1, 28, 28), 10)
    plan = resolve_plan(model, RankPlan(0.75))
    assert plan.ranks == {} and plan.kept_dense == ("fe.conv2", "fe.fc1")


def test_tiers_shrink_parameters_monotonically():
    model = build_model("cnn1", (3, 32, 32), 10)
    counts = []
    for ratio in (1.0, 0.75, 0.5, 0.25, 0.125):
        client = factorize_model(model, resolve_plan(model, RankPlan(ratio)).ranks)
        counts.append(sum(p.numel() for p in client.fe.parameters()))
    assert counts == sorted(counts, reverse=True) and counts[-1] < counts[0]


def test_decay_step_is_the_step_size_times_the_autograd_gradient_of_the_penalty():
    u, v = torch.randn(30, 4, requires_grad=True), torch.randn(20, 4, requires_grad=True)
    mu, step = 1e-3, 0.1
    (mu * torch.linalg.norm(u @ v.T).square()).backward()
    new_u, new_v = frobenius_decay_step(u.detach(), v.detach(), mu, step)
    assert torch.allclose(new_u, u.detach() - step * u.grad, atol=1e-6)
    assert torch.allclose(new_v, v.detach() - step * v.grad, atol=1e-6)


def test_numpy_decay_step_equals_the_torch_twin():
    u, v = torch.randn(40, 8), torch.randn(25, 8)
    expected = frobenius_decay_step(u, v, 1e-3, 0.5)
    got = frobenius.frobenius_decay_step(u.numpy(), v.numpy(), 1e-3, 0.5)
    for want, have in zip(expected, got):
        np.testing.assert_allclose(have, want.numpy(), atol=1e-6)


def test_decay_step_rejects_factors_of_different_ranks():
    with pytest.raises(ValueError, match="one rank r"):
        frobenius_decay_step(torch.randn(5, 3), torch.randn(4, 2), 1e-3, 0.1)


def test_decay_factors_leaves_a_dense_model_untouched():
    model = build_model("fedavgcnn", (1, 28, 28), 10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    decay_factors(model, 1e-3, 0.1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_decay_factors_steps_every_factorized_layer():
    client = factorize_model(build_model("fedavgcnn", (1, 28, 28), 10), {"fe.conv2": 8, "fe.fc1": 16})
    layers = [client.fe.conv2, client.fe.fc1]
    expected = [frobenius_decay_step(m.u.detach(), m.v.detach(), 1e-3, 0.1) for m in layers]
    decay_factors(client, 1e-3, 0.1)
    for layer, (u, v) in zip(layers, expected):
        assert torch.equal(layer.u, u) and torch.equal(layer.v, v)


def test_decay_factors_changes_only_the_trained_factors():
    client = factorize_model(build_model("fedavgcnn", (1, 28, 28), 10), {"fe.fc1": 16})
    before = {k: v.clone() for k, v in client.state_dict().items()}
    decay_factors(client, 1e-3, 0.1, params=list(client.head.parameters()))
    assert all(torch.equal(before[k], v) for k, v in client.state_dict().items())
    decay_factors(client, 1e-3, 0.1, params=[client.fe.fc1.u])
    assert not torch.equal(before["fe.fc1.u"], client.fe.fc1.u) and torch.equal(before["fe.fc1.v"], client.fe.fc1.v)


def test_factorize_then_reconstruct_state_roundtrips_at_full_rank():
    model = build_model("fedavgcnn", (1, 28, 28), 10)
    dense = fe_state(model)
    shapes = {k: tuple(v.shape) for k, v in dense.items()}
    ranks = {"fe.conv2": 160, "fe.fc1": 512}
    client = factorize_state(dense, ranks)
    assert "fe.fc1.u" in client and "fe.fc1.weight" not in client
    back = reconstruct_state(client, shapes)
    # The float64 SVD is exact to ~1e-16; rounding U and V to float32 and the float32 product of k = rank terms
    # err by at most (k + 2)·2⁻²⁴·(|U||V|ᵀ) per element, whatever the CPU's summation order. Measured: at most
    # 2.8e-7 of that scale (4.5e-8 absolute), 100x under the bound (3.1e-5 of it for fc1); dropping the smallest
    # singular direction moves an element by 3.2e-3 (fc1) and 4.9e-3 (conv2), ≥ 200x over it (≤ 8.8e-6 absolute).
    scale = reconstruct_state({k: v.abs() for k, v in client.items()}, shapes)
    unit = torch.finfo(torch.float32).eps / 2
    for key in dense:
        layer = key.rsplit(".", 1)[0]
        if layer in ranks and key.endswith(".weight"):
            bound = (ranks[layer] + 2) * unit * scale[key]
            assert bool(((back[key] - dense[key]).abs() <= bound).all()), key
        else:
            assert torch.equal(back[key], dense[key]), key


def test_factorized_model_state_matches_factorize_state():
    model = build_model("fedavgcnn", (1, 28, 28), 10)
    ranks = {"fe.fc1": 32}
    client = factorize_model(model, ranks)
    expected = factorize_state(fe_state(model), ranks)
    assert set(fe_state(client)) == set(expected)
    assert all(torch.equal(fe_state(client)[k], expected[k]) for k in expected)


def test_reconstruct_state_rejects_wrong_shape():
    shapes = {"fe.fc1.weight": (4, 6), "fe.fc1.bias": (4,)}
    with pytest.raises(ValueError, match="fe.fc1.bias"):
        reconstruct_state({"fe.fc1.weight": torch.zeros(4, 6), "fe.fc1.bias": torch.zeros(5)}, shapes)


def test_reconstruct_state_rejects_missing_and_unexpected_tensors():
    shapes = {"fe.fc1.weight": (4, 6)}
    with pytest.raises(ValueError, match="lacks"):
        reconstruct_state({}, shapes)
    with pytest.raises(ValueError, match="unexpected"):
        reconstruct_state({"fe.fc1.weight": torch.zeros(4, 6), "fe.other": torch.zeros(1)}, shapes)


def test_every_tier_truncates_one_svd_per_layer(monkeypatch):
    import fedcore.lowrank as lowrank
    from server.engine.sampling import factorize_per_plan, plan_key
    model = build_model("fedavgcnn", (1, 28, 28), 10)
    plans = [resolve_plan(model, RankPlan(ratio)) for ratio in (1.0, 0.75, 0.5, 0.25, 0.125)]
    svds = []
    real_spectrum = lowrank.spectrum
    monkeypatch.setattr(lowrank, "spectrum", lambda weight: svds.append(weight.shape) or real_spectrum(weight))
    per_plan = factorize_per_plan(fe_state(model), plans)
    assert len(svds) == len({layer for plan in plans for layer in plan.ranks}) == 2
    low = plans[-1]
    expected = factorize_state(fe_state(model), low.ranks)
    assert all(np.allclose(per_plan[plan_key(low)][k], expected[k].numpy()) for k in expected)
