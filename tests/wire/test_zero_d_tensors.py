"""A 0-d tensor (a BatchNorm counter, a scalar parameter) stays 0-d on the wire: shape () out, shape () back."""
from __future__ import annotations

import numpy as np

from device_runtime.payload import decode_payload, encode_payload, payload_ref


def test_a_0d_tensor_keeps_its_shape_through_a_payload():
    tensors = {"fe.scale": np.array(1.5, np.float32), "fe.fc.weight": np.ones((2, 3), np.float32)}
    data = encode_payload(tensors)
    back = decode_payload(data, payload_ref(data))
    assert back["fe.scale"].shape == () and float(back["fe.scale"]) == 1.5
    assert back["fe.fc.weight"].shape == (2, 3)
