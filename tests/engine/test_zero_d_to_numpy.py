"""The server's torch → numpy conversion keeps a 0-d tensor 0-d (np.ascontiguousarray made it (1,)) and copies."""
from __future__ import annotations

import torch

from server.engine.sampling import to_numpy


def test_to_numpy_keeps_a_0d_tensor_0d():
    assert to_numpy({"fe.scale": torch.tensor(2.0)})["fe.scale"].shape == ()


def test_to_numpy_returns_a_copy_not_a_view_of_the_tensor():
    value = torch.zeros(3)
    out = to_numpy({"w": value})["w"]
    value += 1.0
    assert out.tolist() == [0.0, 0.0, 0.0]
