"""The envelope: one logical protocol message as bytes, tagged under the sender's key (numpy + stdlib only).

Envelope (the layout of protocol versions 2 and 3):

    b"FAR2" | uint32 LE header length | tag (32 B) | UTF-8 JSON header | body

The header is a JSON object with exactly the keys ``type, version, run_id, round, device_id,
msg_id, direction, counter, meta, tensors, blobs, body_sha256``. The tag is HMAC-SHA256 under the
device's key of the SHA-256 of the header bytes (device_runtime.auth): it covers every header field,
and through ``body_sha256`` the body. ``decode`` checks the structure only and returns the tag and
the header digest with the message; ``auth.Verifier.check`` decides whether to believe it. Version 1
envelopes (magic b"FARA", no tag) and frames are refused as BAD_VERSION. The body is the raw little-endian, C-order bytes
of every tensor in header order, then every blob in header order, with no gaps and no trailing
bytes; ``body_sha256`` is the hex SHA-256 of the whole body. Nothing is unpickled or evaluated:
decoding parses JSON and copies bytes. ``decode`` returns tensors as writable, native-byte-order
copies that own their memory, and blobs as ``bytes``. An envelope travels as frames (device_runtime.framing).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import numpy as np

from device_runtime.auth import TAG_BYTES, Direction, compute_tag, is_counter, tag_matches
from device_runtime.protocol import PROTOCOL_VERSION, ProtocolError, Reason, check_device_id, check_id, is_int

MAGIC = b"FAR2"
V1_MAGIC = b"FARA"

MAX_HEADER_BYTES = 256 * 1024
"""Largest JSON header accepted; headers describe tensors and carry small metadata only."""

MAX_NAME_LEN = 128
MAX_TENSOR_RANK = 8
MAX_TENSOR_BYTES = 2**31 - 1
"""Bound on prod(max(dim, 1)) * itemsize, so that every accepted shape is allocatable
(also by 32-bit numpy) even when a zero dimension makes the tensor empty."""
MAX_META_DEPTH = 8
MAX_ROUND = 2**31 - 1
MAX_JSON_INT = 2**63 - 1


DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<")
    for name in ("float32", "float64", "int64", "int32", "uint8")
}

_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,%d}" % (MAX_NAME_LEN - 1))
_SHA256_HEX_RE = re.compile(r"[0-9a-f]{64}")

_PREFIX = struct.Struct("<4sI%ds" % TAG_BYTES)

_HEADER_KEYS = frozenset(
    ("type", "version", "run_id", "round", "device_id", "msg_id", "direction", "counter", "meta",
     "tensors", "blobs", "body_sha256")
)
_TENSOR_KEYS = frozenset(("name", "dtype", "shape", "offset", "nbytes"))
_BLOB_KEYS = frozenset(("name", "offset", "nbytes"))


class MessageType(str, Enum):
    """What a message is for; the direction is fixed per type."""

    JOIN = "join"  # device -> server: resource profile
    PLAN = "plan"  # server -> device: rank plan + artifact hash, may carry artifact files
    TASK = "task"  # server -> device: round, FE weights, lam, lr, epochs, batch size, deadline
    UPDATE = "update"  # device -> server: updated FE tensors, sample count, metrics
    STATUS = "status"  # device online/offline (also its last will)
    ERROR = "error"
    ACK = "ack"
    AGGREGATION = "aggregation"  # between the round engine and its aggregator processes (server side only)
    SECAGG = "secagg"  # either way: one of SecAgg+'s exchanges inside a secure round (device_runtime/secagg_wire.py)


_MESSAGE_TYPES = tuple(t.value for t in MessageType)


@dataclass(eq=False)
class Message:
    """One logical protocol message (compare fields, not messages: tensors are arrays).

    ``direction`` and ``counter`` are set by the sender's ``seal``; ``tag`` and ``signed_digest``
    are filled by ``decode`` for the Verifier and ignored by ``encode``."""

    type: MessageType
    run_id: str
    round: int
    device_id: str
    msg_id: str
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    blobs: dict[str, bytes] = field(default_factory=dict)
    direction: Direction = Direction.UP
    counter: int = 0
    tag: bytes = b""
    signed_digest: bytes = b""


def _message_type(value: object) -> MessageType:
    if isinstance(value, str) and value in _MESSAGE_TYPES:
        return MessageType(value)
    raise ProtocolError(
        Reason.BAD_TYPE, f"unknown message type {value!r:.50}, expected one of {_MESSAGE_TYPES}"
    )


def _check_json_value(value: object, path: str, depth: int) -> None:
    """Raise unless ``value`` is plain, finite JSON of bounded depth that round-trips exactly."""
    if value is None or isinstance(value, (bool, str)):
        return
    if is_int(value):
        if abs(value) > MAX_JSON_INT:
            raise ProtocolError(Reason.BAD_META, f"{path}: integer outside signed 64-bit range")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ProtocolError(Reason.BAD_META, f"{path}: non-finite number {value}")
        return
    if depth >= MAX_META_DEPTH:
        raise ProtocolError(Reason.BAD_META, f"{path}: nested deeper than {MAX_META_DEPTH}")
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_json_value(item, f"{path}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ProtocolError(Reason.BAD_META, f"{path}: key {key!r:.50} is not a string")
            _check_json_value(item, f"{path}[{key!r:.50}]", depth + 1)
        return
    raise ProtocolError(
        Reason.BAD_META,
        f"{path}: unsupported type {type(value).__name__} (use None, bool, int, float, str, "
        "list or dict with str keys)",
    )


def _check_meta(meta: object) -> dict[str, Any]:
    if not isinstance(meta, dict):
        raise ProtocolError(
            Reason.BAD_META, f"meta must be a JSON object, got {type(meta).__name__}"
        )
    _check_json_value(meta, "meta", 0)
    return meta


def _check_name(name: object, reason: Reason) -> str:
    if not isinstance(name, str) or _NAME_RE.fullmatch(name) is None:
        raise ProtocolError(
            reason,
            f"name must be 1..{MAX_NAME_LEN} chars of [A-Za-z0-9_.-] not starting with '.' or "
            f"'-', got {name!r:.100}",
        )
    return name


def _check_round(value: object) -> int:
    if not is_int(value) or not 0 <= value <= MAX_ROUND:
        raise ProtocolError(
            Reason.BAD_HEADER, f"round must be an int in 0..{MAX_ROUND}, got {value!r:.50}"
        )
    return value


def _check_shape(shape: object, dtype: np.dtype, name: str) -> tuple[int, ...]:
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) > MAX_TENSOR_RANK
        or not all(is_int(d) and d >= 0 for d in shape)
    ):
        raise ProtocolError(
            Reason.BAD_TENSOR,
            f"tensor {name!r}: shape must be a list of at most {MAX_TENSOR_RANK} non-negative "
            f"ints, got {shape!r:.100}",
        )
    if math.prod(max(d, 1) for d in shape) * dtype.itemsize > MAX_TENSOR_BYTES:
        raise ProtocolError(
            Reason.BAD_TENSOR,
            f"tensor {name!r}: shape {list(shape)} spans over {MAX_TENSOR_BYTES} bytes",
        )
    return tuple(shape)


def _check_finite(name: str, array: np.ndarray) -> None:
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise ProtocolError(Reason.NONFINITE, f"tensor {name!r} holds NaN or infinity")


def _check_direction(value: object) -> Direction:
    if isinstance(value, str) and value in {d.value for d in Direction}:
        return Direction(value)
    raise ProtocolError(
        Reason.BAD_HEADER,
        f"direction must be one of {[d.value for d in Direction]}, got {value!r:.30}",
    )


def _check_counter(value: object) -> int:
    if not is_counter(value):
        raise ProtocolError(Reason.BAD_HEADER, f"counter must be a positive int below 2**63, got {value!r:.30}")
    return value  # type: ignore[return-value]


def seal(msg: Message, key: bytes, direction: Direction, counter: int) -> bytes:
    """``msg`` as an envelope sent in ``direction`` with ``counter``, tagged under ``key``."""
    return encode(replace(msg, direction=direction, counter=counter), key=key)


def encode(msg: Message, *, key: bytes) -> bytes:
    """Serialize ``msg`` into one envelope tagged under ``key``, with its ``direction`` and
    ``counter``; raises ProtocolError where ``msg`` breaks the schema (a counter of 0 included).

    Non-finite float tensors are encoded (the receiver decides whether to accept them)."""
    mtype = _message_type(msg.type)
    direction = _check_direction(msg.direction)
    counter = _check_counter(msg.counter)
    check_id(msg.run_id, "run_id")
    check_device_id(msg.device_id)
    check_id(msg.msg_id, "msg_id")
    _check_round(msg.round)
    _check_meta(msg.meta)
    if not isinstance(msg.tensors, dict) or not isinstance(msg.blobs, dict):
        raise ProtocolError(Reason.BAD_INPUT, "tensors and blobs must be dicts keyed by name")
    parts: list[bytes] = []
    tensor_entries: list[dict[str, Any]] = []
    offset = 0
    for name, array in msg.tensors.items():
        _check_name(name, Reason.BAD_TENSOR)
        if not isinstance(array, np.ndarray) or array.dtype.name not in DTYPES:
            raise ProtocolError(
                Reason.BAD_TENSOR,
                f"tensor {name!r}: must be a numpy array of dtype {sorted(DTYPES)}, got "
                f"{getattr(array, 'dtype', type(array).__name__)}",
            )
        wire_dtype = DTYPES[array.dtype.name]
        shape = _check_shape(array.shape, wire_dtype, name)
        raw = array.astype(wire_dtype, copy=False).tobytes(order="C")
        tensor_entries.append(
            {"name": name, "dtype": array.dtype.name, "shape": list(shape), "offset": offset,
             "nbytes": len(raw)}
        )
        parts.append(raw)
        offset += len(raw)
    blob_entries: list[dict[str, Any]] = []
    for name, blob in msg.blobs.items():
        _check_name(name, Reason.BAD_BLOB)
        if not isinstance(blob, (bytes, bytearray)):
            raise ProtocolError(
                Reason.BAD_BLOB, f"blob {name!r}: must be bytes, got {type(blob).__name__}"
            )
        blob_entries.append({"name": name, "offset": offset, "nbytes": len(blob)})
        parts.append(bytes(blob))
        offset += len(blob)
    body = b"".join(parts)
    header = {
        "type": mtype.value, "version": PROTOCOL_VERSION, "run_id": msg.run_id,
        "round": msg.round, "device_id": msg.device_id, "msg_id": msg.msg_id,
        "direction": direction.value, "counter": counter, "meta": msg.meta,
        "tensors": tensor_entries, "blobs": blob_entries,
        "body_sha256": hashlib.sha256(body).hexdigest(),
    }
    header_bytes = json.dumps(header, separators=(",", ":"), allow_nan=False).encode("utf-8")
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise ProtocolError(
            Reason.OVERSIZE, f"header is {len(header_bytes)} bytes, over {MAX_HEADER_BYTES}"
        )
    tag = compute_tag(key, hashlib.sha256(header_bytes).digest())
    return _PREFIX.pack(MAGIC, len(header_bytes), tag) + header_bytes + body


def _reject_constant(token: str) -> None:
    raise ValueError(f"non-finite number {token}")


def _finite_float(token: str) -> float:
    value = float(token)
    if not math.isfinite(value):
        raise ValueError(f"non-finite number {token}")
    return value


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("duplicate key in JSON object")
    return obj


def _parse_header(raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(
            raw.decode("utf-8"),
            object_pairs_hook=_unique_object,
            parse_constant=_reject_constant,
            parse_float=_finite_float,
        )
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(Reason.BAD_HEADER, f"header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(Reason.BAD_HEADER, "header must be a JSON object")
    version = header.get("version")
    if not is_int(version) or version != PROTOCOL_VERSION:
        raise ProtocolError(
            Reason.BAD_VERSION,
            f"protocol version {version!r:.20}, this side speaks {PROTOCOL_VERSION}",
        )
    if header.keys() != _HEADER_KEYS:
        raise ProtocolError(
            Reason.BAD_HEADER,
            f"header keys differ from the schema: missing "
            f"{sorted(_HEADER_KEYS - header.keys())}, unknown "
            f"{[k[:30] for k in sorted(header.keys() - _HEADER_KEYS)[:5]]}",
        )
    return header


def _entries(
    header: dict[str, Any], key: str, keys: frozenset[str], reason: Reason
) -> list[dict[str, Any]]:
    """The header's tensor or blob entries, checked for their keys, names and int fields."""
    entries = header[key]
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and e.keys() == keys for e in entries
    ):
        raise ProtocolError(reason, f"{key} must be a list of objects with keys {sorted(keys)}")
    names = [_check_name(e["name"], reason) for e in entries]
    if len(set(names)) != len(names):
        raise ProtocolError(Reason.DUPLICATE_NAME, f"{key} repeat a name")
    for e in entries:
        if not (is_int(e["offset"]) and is_int(e["nbytes"])):
            raise ProtocolError(
                reason, f"{key} entry {e['name']!r}: offset and nbytes must be ints"
            )
    return entries


def decode(data: bytes, *, max_bytes: int, allow_nonfinite: bool = False) -> Message:
    """Parse and fully validate one envelope of at most ``max_bytes`` bytes.

    Any violation raises ProtocolError and nothing else. Tensors come back writable, in native byte order:
    from a ``bytearray`` (what ``framing.Reassembler`` hands over, which the caller then owns) of a message with no
    blobs they are views into it where the order already is native (no copy of every update byte on the server's
    read path; writing a tensor writes ``data``); otherwise copies (a view keeps the whole buffer alive, and a
    blob's bytes, copied out, must not be held twice on a device). Float tensors must be finite unless
    ``allow_nonfinite``.
    This authenticates nothing: act on the message only after ``auth.Verifier.check`` accepts it."""
    if not is_int(max_bytes) or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
    if not isinstance(data, (bytes, bytearray)):
        raise ProtocolError(Reason.BAD_INPUT, f"expected bytes, got {type(data).__name__}")
    view = memoryview(data)
    if len(view) > max_bytes:
        raise ProtocolError(
            Reason.OVERSIZE, f"message is {len(view)} bytes, over max_bytes={max_bytes}"
        )
    if len(view) < _PREFIX.size:
        raise ProtocolError(
            Reason.TRUNCATED, f"message is {len(view)} bytes, shorter than its prefix"
        )
    if bytes(view[:len(V1_MAGIC)]) == V1_MAGIC:
        raise ProtocolError(
            Reason.BAD_VERSION,
            f"protocol version 1 envelope (no authentication tag), this side speaks {PROTOCOL_VERSION}: "
            "update the sender",
        )
    magic, header_len, tag = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise ProtocolError(Reason.BAD_MAGIC, f"magic {magic!r}, expected {MAGIC!r}")
    if header_len > MAX_HEADER_BYTES:
        raise ProtocolError(Reason.OVERSIZE, f"header length {header_len} over {MAX_HEADER_BYTES}")
    body_start = _PREFIX.size + header_len
    if body_start > len(view):
        raise ProtocolError(
            Reason.TRUNCATED, f"header length {header_len} runs past the message end"
        )
    raw_header = bytes(view[_PREFIX.size:body_start])
    header = _parse_header(raw_header)
    body = view[body_start:]

    mtype = _message_type(header["type"])
    run_id = check_id(header["run_id"], "run_id")
    device_id = check_device_id(header["device_id"])
    msg_id = check_id(header["msg_id"], "msg_id")
    direction = _check_direction(header["direction"])
    counter = _check_counter(header["counter"])
    round_ = _check_round(header["round"])
    meta = _check_meta(header["meta"])
    digest = header["body_sha256"]
    if not isinstance(digest, str) or _SHA256_HEX_RE.fullmatch(digest) is None:
        raise ProtocolError(Reason.BAD_HEADER, "body_sha256 must be 64 lowercase hex digits")
    tensor_entries = _entries(header, "tensors", _TENSOR_KEYS, Reason.BAD_TENSOR)
    blob_entries = _entries(header, "blobs", _BLOB_KEYS, Reason.BAD_BLOB)

    layouts: list[tuple[str, np.dtype, tuple[int, ...]]] = []
    for e in tensor_entries:
        name = e["name"]
        if not isinstance(e["dtype"], str) or e["dtype"] not in DTYPES:
            raise ProtocolError(
                Reason.BAD_TENSOR,
                f"tensor {name!r}: dtype {e['dtype']!r:.30} not in {sorted(DTYPES)}",
            )
        dtype = DTYPES[e["dtype"]]
        shape = _check_shape(e["shape"], dtype, name)
        if e["nbytes"] != math.prod(shape) * dtype.itemsize:
            raise ProtocolError(
                Reason.BAD_TENSOR,
                f"tensor {name!r}: nbytes {e['nbytes']} != prod({list(shape)}) * "
                f"{dtype.itemsize}",
            )
        layouts.append((name, dtype, shape))
    expected = 0
    for e in tensor_entries + blob_entries:
        if e["offset"] != expected:
            raise ProtocolError(
                Reason.BAD_LAYOUT,
                f"{e['name']!r}: offset {e['offset']}, expected {expected} (entries are "
                "contiguous: tensors, then blobs, in header order)",
            )
        if e["nbytes"] < 0:
            raise ProtocolError(Reason.BAD_LAYOUT, f"{e['name']!r}: negative nbytes")
        expected += e["nbytes"]
    if expected != len(body):
        raise ProtocolError(
            Reason.BAD_LAYOUT, f"entries cover {expected} body bytes, body has {len(body)}"
        )
    if hashlib.sha256(body).hexdigest() != digest:
        raise ProtocolError(Reason.BAD_HASH, "body_sha256 does not match the body")

    tensors: dict[str, np.ndarray] = {}
    in_place = isinstance(data, bytearray) and not blob_entries
    for (name, dtype, shape), e in zip(layouts, tensor_entries):
        raw = body[e["offset"]:e["offset"] + e["nbytes"]]
        array = np.frombuffer(raw, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="), copy=not in_place)
        if not allow_nonfinite:
            _check_finite(name, array)
        tensors[name] = array
    blobs = {e["name"]: bytes(body[e["offset"]:e["offset"] + e["nbytes"]]) for e in blob_entries}
    return Message(mtype, run_id, round_, device_id, msg_id, meta, tensors, blobs, direction, counter,
                   tag, hashlib.sha256(raw_header).digest())


def tagged_counter(chunk: bytes | memoryview, key: bytes) -> int | None:
    """The counter of the envelope ``chunk`` begins with (chunk 0 of its frames), when its header is whole in the chunk
    and its tag verifies under ``key``; else None. A receiver ranks the incomplete messages of a sender with it
    (``framing.Vouch``): junk under an enrolled device's id has no valid tag, and a replay of its earlier messages an
    older counter. It authenticates the header only: the whole message is checked again once complete."""
    if len(chunk) < _PREFIX.size:
        return None
    magic, header_len, tag = _PREFIX.unpack_from(chunk)
    end = _PREFIX.size + header_len
    if magic != MAGIC or header_len > MAX_HEADER_BYTES or end > len(chunk):
        return None
    raw = bytes(chunk[_PREFIX.size:end])
    if not tag_matches(key, hashlib.sha256(raw).digest(), tag):
        return None
    try:
        counter = json.loads(raw).get("counter")
    except (ValueError, AttributeError, RecursionError):
        return None
    return counter if is_counter(counter) else None


def envelope_limit(payload_bytes: int) -> int:
    """Largest envelope to accept for a message whose tensors and blobs hold ``payload_bytes``:
    the payload plus the largest header this protocol allows."""
    return _PREFIX.size + MAX_HEADER_BYTES + payload_bytes
