"""A plan's payload: the round's shared tensors at one rank plan, published once for every device of that plan
(numpy + stdlib only).

Devices of one plan get the same tensors in a round, so the server publishes them once per plan, content-addressed,
and each device's sealed TASK names the payload by its SHA-256 and size (``PayloadRef``) instead of carrying the
tensors. The device fetches the payload from the broker (``topics.payload_filter``: one retained frame per topic
level, so a device that subscribes late still gets it) and believes it only if its SHA-256 is the one its
authenticated TASK names: a payload anyone else published, or one of another round, is refused by its hash.

Payload layout:

    b"FARP" | uint32 LE header length | UTF-8 JSON header {"tensors": [{name, dtype, shape, offset, nbytes}]} | body

The body is every tensor's little-endian, C-order bytes in header order, contiguous, nothing after. Nothing is
unpickled or evaluated: decoding parses JSON and copies bytes, and happens only after the hash matched.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from device_runtime.envelope import (_TENSOR_KEYS, DTYPES, MAX_HEADER_BYTES, _check_finite, _check_name, _check_shape,
                                     _entries, _finite_float, _reject_constant, _unique_object)
from device_runtime.protocol import ProtocolError, Reason

PAYLOAD_MAGIC = b"FARP"
_PREFIX = struct.Struct("<4sI")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class PayloadMismatch(ProtocolError):
    """A payload whose size or SHA-256 is not the one the TASK names (junk, a replay, another round's)."""

    def __init__(self, message: str) -> None:
        super().__init__(Reason.BAD_HASH, message)


@dataclass(frozen=True)
class PayloadRef:
    """What a sealed TASK says of the payload it needs: its SHA-256 (hex) and its size in bytes."""

    sha256: str
    nbytes: int

    def to_meta(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "bytes": self.nbytes}

    @classmethod
    def from_meta(cls, value: object) -> PayloadRef:
        """The reference of a TASK's ``payload`` field; raises ValueError naming what is wrong."""
        if not isinstance(value, dict) or set(value) != {"sha256", "bytes"}:
            raise ValueError(f"task payload must be an object with keys sha256 and bytes, got {value!r:.80}")
        sha, nbytes = value["sha256"], value["bytes"]
        if not isinstance(sha, str) or _SHA256_HEX.fullmatch(sha) is None:
            raise ValueError(f"task payload sha256 must be 64 lowercase hex digits, got {sha!r:.80}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 < nbytes < 2**40:
            raise ValueError(f"task payload bytes must be a positive int, got {nbytes!r:.40}")
        return cls(sha, nbytes)


def encode_payload(tensors: dict[str, np.ndarray]) -> bytes:
    """The payload of ``tensors`` (float32 and the envelope's other dtypes), in the order given."""
    entries, parts, offset = [], [], 0
    for name, array in tensors.items():
        _check_name(name, Reason.BAD_TENSOR)
        wire = DTYPES[array.dtype.name]
        raw = np.ascontiguousarray(array, dtype=wire).tobytes()
        entries.append({"name": name, "dtype": array.dtype.name, "shape": list(array.shape), "offset": offset,
                        "nbytes": len(raw)})
        parts.append(raw)
        offset += len(raw)
    header = json.dumps({"tensors": entries}, separators=(",", ":")).encode("utf-8")
    return _PREFIX.pack(PAYLOAD_MAGIC, len(header)) + header + b"".join(parts)


def payload_ref(data: bytes) -> PayloadRef:
    """The reference a TASK carries for the payload ``data``."""
    return PayloadRef(hashlib.sha256(data).hexdigest(), len(data))


def check_payload(data: bytes, ref: PayloadRef) -> None:
    """Raise PayloadMismatch unless ``data`` is the payload ``ref`` names (size, then SHA-256)."""
    if len(data) != ref.nbytes:
        raise PayloadMismatch(f"payload of {len(data)} bytes, the task names {ref.nbytes} bytes "
                              f"(sha256 {ref.sha256[:12]})")
    digest = hashlib.sha256(data).hexdigest()
    if digest != ref.sha256:
        raise PayloadMismatch(f"payload sha256 {digest[:12]}, the task names {ref.sha256[:12]}")


def decode_payload(data: bytes, ref: PayloadRef) -> dict[str, np.ndarray]:
    """The tensors of ``data`` once it is the payload ``ref`` names (checked first: PayloadMismatch), as writable
    native-order copies, finite; raises ProtocolError where the layout is broken."""
    check_payload(data, ref)
    view = memoryview(data)
    if len(view) < _PREFIX.size:
        raise ProtocolError(Reason.TRUNCATED, "payload shorter than its prefix")
    magic, header_len = _PREFIX.unpack_from(view)
    if magic != PAYLOAD_MAGIC:
        raise ProtocolError(Reason.BAD_MAGIC, f"payload magic {magic!r}, expected {PAYLOAD_MAGIC!r}")
    if header_len > MAX_HEADER_BYTES or _PREFIX.size + header_len > len(view):
        raise ProtocolError(Reason.BAD_HEADER, f"payload header length {header_len} does not fit")
    try:
        header = json.loads(bytes(view[_PREFIX.size:_PREFIX.size + header_len]).decode("utf-8"),
                            object_pairs_hook=_unique_object, parse_constant=_reject_constant,
                            parse_float=_finite_float)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(Reason.BAD_HEADER, f"payload header is not valid JSON: {exc}") from None
    if not isinstance(header, dict) or set(header) != {"tensors"}:
        raise ProtocolError(Reason.BAD_HEADER, "payload header must be an object with the key tensors only")
    body = view[_PREFIX.size + header_len:]
    tensors: dict[str, np.ndarray] = {}
    expected = 0
    for e in _entries(header, "tensors", _TENSOR_KEYS, Reason.BAD_TENSOR):
        name = e["name"]
        if e["dtype"] not in DTYPES:
            raise ProtocolError(Reason.BAD_TENSOR, f"payload tensor {name!r}: dtype {e['dtype']!r:.30}")
        dtype = DTYPES[e["dtype"]]
        shape = _check_shape(e["shape"], dtype, name)
        if e["offset"] != expected or e["nbytes"] != math.prod(shape) * dtype.itemsize:
            raise ProtocolError(Reason.BAD_LAYOUT, f"payload tensor {name!r}: offset or size out of place")
        expected += e["nbytes"]
        if expected > len(body):
            raise ProtocolError(Reason.BAD_LAYOUT, f"payload tensor {name!r} runs past the body")
        array = np.frombuffer(body[e["offset"]:expected], dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))
        _check_finite(name, array)
        tensors[name] = array
    if expected != len(body):
        raise ProtocolError(Reason.BAD_LAYOUT, f"payload entries cover {expected} body bytes, body has {len(body)}")
    return tensors
