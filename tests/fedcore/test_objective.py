import gc
import weakref

import numpy as np
import pytest
import torch
from torch import nn

from fedcore.lowrank import decompose
from fedcore.objective import compute_anchors, fac_loss, lam_at_round
from server.engine.aggregate import DEFAULT_DENSE_FOLD_CLIENTS, StreamingAverage


def test_lam_is_zero_in_the_first_round():
    assert lam_at_round(1, 10.0, 10) == 0.0


def test_lam_ramps_linearly_then_stays():
    assert lam_at_round(6, 10.0, 10) == pytest.approx(5.0)
    assert lam_at_round(11, 10.0, 10) == pytest.approx(10.0)
    assert lam_at_round(50, 10.0, 10) == pytest.approx(10.0)


def test_lam_without_warmup_jumps_after_round_one():
    assert lam_at_round(1, 2.0, 0) == 0.0 and lam_at_round(2, 2.0, 0) == 2.0


def test_lam_rejects_round_zero():
    with pytest.raises(ValueError):
        lam_at_round(0, 1.0, 10)


def test_anchors_are_per_class_mean_features():
    fe = nn.Flatten()
    x = np.arange(12, dtype=np.float32).reshape(4, 1, 1, 3)
    y = np.array([0, 0, 2, 2])
    anchors, mask = compute_anchors(fe, x, y, num_classes=3, batch_size=3)
    np.testing.assert_allclose(anchors[0], x[:2].reshape(2, 3).mean(0))
    np.testing.assert_allclose(anchors[2], x[2:].reshape(2, 3).mean(0))


def test_absent_class_has_no_anchor():
    anchors, mask = compute_anchors(nn.Flatten(), np.ones((2, 1, 1, 2), np.float32), np.array([1, 1]), 3)
    assert mask.tolist() == [0.0, 1.0, 0.0] and not anchors[0].any()


def test_fac_loss_is_mean_squared_distance_to_own_anchor():
    features = torch.tensor([[1.0, 2.0], [3.0, 5.0]])
    labels = torch.tensor([0, 1])
    anchors = torch.tensor([[0.0, 0.0], [3.0, 3.0]])
    expected = ((1 + 4) / 2 + (0 + 4) / 2) / 2
    assert fac_loss(features, labels, anchors, torch.ones(2)).item() == pytest.approx(expected)


def test_fac_loss_skips_samples_without_anchor():
    features = torch.tensor([[1.0], [100.0]])
    loss = fac_loss(features, torch.tensor([0, 1]), torch.zeros(2, 1), torch.tensor([1.0, 0.0]))
    assert loss.item() == pytest.approx(1.0)


def average_of(updates, shapes):
    average = StreamingAverage(shapes)
    for client_fe, num_samples in updates:
        average.add(client_fe, num_samples)
    return average.result()


def test_aggregation_weights_by_sample_count():
    shapes = {"fe.b": (2,)}
    result = average_of([({"fe.b": torch.tensor([1.0, 1.0])}, 1), ({"fe.b": torch.tensor([4.0, 0.0])}, 3)], shapes)
    assert torch.allclose(result["fe.b"], torch.tensor([13 / 4, 1 / 4]))


def test_aggregation_reconstructs_factors_to_full_rank():
    weight = torch.randn(6, 4, dtype=torch.float64)
    u, v = decompose(weight, 4)
    shapes = {"fe.fc.weight": (6, 4)}
    result = average_of([({"fe.fc.u": u, "fe.fc.v": v}, 2), ({"fe.fc.weight": weight}, 2)], shapes)
    assert torch.allclose(result["fe.fc.weight"].double(), weight, atol=1e-5)


def test_aggregation_of_many_small_updates_keeps_float64_precision():
    average = StreamingAverage({"fe.w": (1,)})
    for _ in range(10_000):
        average.add({"fe.w": torch.tensor([1e-4 + 1.0])}, 1)
    assert average.result(torch.float64)["fe.w"].item() == pytest.approx(float(np.float32(1e-4 + 1.0)), abs=1e-12)


def held_tensors(obj: object) -> list[torch.Tensor]:
    """Every tensor reachable from ``obj``'s attributes (through dicts, lists and tuples)."""
    found, stack = [], list(vars(obj).values())
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return found


def test_streaming_average_holds_one_model_whatever_the_client_count():
    average = StreamingAverage({"fe.w": (3,)})
    added = []
    for k in range(50):
        client = {"fe.w": torch.full((3,), float(k))}
        added.append(weakref.ref(client["fe.w"]))
        average.add(client, 1)
        del client
    gc.collect()
    # Only the clients waiting for the next batched fold are held, never the round's: memory is flat in K.
    assert sum(ref() is not None for ref in added) <= DEFAULT_DENSE_FOLD_CLIENTS
    assert sum(t.numel() for t in held_tensors(average)) <= 3 * (DEFAULT_DENSE_FOLD_CLIENTS + 1)
    assert average.count == 50
    assert torch.allclose(average.result()["fe.w"], torch.full((3,), 24.5))


def test_aggregation_rejects_non_positive_sample_count():
    with pytest.raises(ValueError, match="sample count"):
        StreamingAverage({"fe.w": (1,)}).add({"fe.w": torch.zeros(1)}, 0)
