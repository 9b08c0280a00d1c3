"""Versioned MQTT wire protocol shared by the server and the devices (numpy + stdlib only).

Envelope (one logical message), version 2:

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
copies that own their memory, and blobs as ``bytes``.

Frame (one MQTT publish), for brokers with a message-size limit:

    b"FACK" | version u8 | msg_id length u8 | msg_id (64 B, zero padded) | index u32 |
    count u32 | total length u64 | SHA-256 of the whole payload (32 B) | chunk bytes

Every payload travels as frames, even one that fits in a single frame, so the receiver has
one path. ``Reassembler`` joins frames back into payloads.
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

from device_runtime.auth import TAG_BYTES, Direction, compute_tag, is_counter

PROTOCOL_VERSION = 2

MAGIC = b"FAR2"
V1_MAGIC = b"FARA"
FRAME_MAGIC = b"FACK"

MAX_HEADER_BYTES = 256 * 1024
"""Largest JSON header accepted; headers describe tensors and carry small metadata only."""

DEFAULT_MAX_FRAME_BYTES = 256 * 1024
"""Frame size for chunking, well below the 1 MB limit common brokers ship with."""

MAX_ID_LEN = 64
MAX_NAME_LEN = 128
MAX_TENSOR_RANK = 8
MAX_TENSOR_BYTES = 2**31 - 1
"""Bound on prod(max(dim, 1)) * itemsize, so that every accepted shape is allocatable
(also by 32-bit numpy) even when a zero dimension makes the tensor empty."""
MAX_META_DEPTH = 8
MAX_ROUND = 2**31 - 1
MAX_JSON_INT = 2**63 - 1
COMPLETED_IDS_REMEMBERED = 4096
"""How many delivered msg_ids a Reassembler remembers (over all its streams) to drop re-delivered
duplicates."""

DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<")
    for name in ("float32", "float64", "int64", "int32", "uint8")
}
"""Allowed tensor dtypes by wire name, as their little-endian wire dtype."""

_ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,%d}" % (MAX_ID_LEN - 1))
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,%d}" % (MAX_NAME_LEN - 1))
_SHA256_HEX_RE = re.compile(r"[0-9a-f]{64}")

_PREFIX = struct.Struct("<4sI%ds" % TAG_BYTES)
_FRAME_HEADER = struct.Struct("<4sBB%dsIIQ32s" % MAX_ID_LEN)
FRAME_HEADER_BYTES = _FRAME_HEADER.size
"""Fixed size of a frame header; a frame is this header plus at least one payload byte."""

_HEADER_KEYS = frozenset(
    ("type", "version", "run_id", "round", "device_id", "msg_id", "direction", "counter", "meta",
     "tensors", "blobs", "body_sha256")
)
_TENSOR_KEYS = frozenset(("name", "dtype", "shape", "offset", "nbytes"))
_BLOB_KEYS = frozenset(("name", "offset", "nbytes"))


class Reason(str, Enum):
    """Machine-readable cause of a ProtocolError."""

    BAD_INPUT = "bad_input"
    TRUNCATED = "truncated"
    BAD_MAGIC = "bad_magic"
    OVERSIZE = "oversize"
    BAD_HEADER = "bad_header"
    BAD_VERSION = "bad_version"
    BAD_TYPE = "bad_type"
    BAD_ID = "bad_id"
    BAD_META = "bad_meta"
    BAD_TENSOR = "bad_tensor"
    BAD_BLOB = "bad_blob"
    DUPLICATE_NAME = "duplicate_name"
    BAD_LAYOUT = "bad_layout"
    BAD_HASH = "bad_hash"
    NONFINITE = "nonfinite"
    BAD_TOPIC = "bad_topic"
    BAD_FRAME = "bad_frame"
    BAD_INDEX = "bad_index"
    INCONSISTENT_CHUNK = "inconsistent_chunk"
    REPEAT = "repeat"


class ProtocolError(ValueError):
    """A message, frame or topic that breaks the protocol; ``reason`` says which rule."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(reason, message)
        self.reason = reason
        self.message = message

    def __str__(self) -> str:
        return f"{self.message} [{self.reason.value}]"


class RepeatedFrame(ProtocolError):
    """A frame of a message delivered moments ago: an MQTT QoS 1 re-delivery, or a replay by anyone on the broker.
    The two look alike, so the frame is dropped and the caller says so without alarm."""

    def __init__(self, msg_id: str) -> None:
        super().__init__(Reason.REPEAT, f"message {msg_id!r} was delivered moments ago (a re-delivery or a replay)")


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


_MESSAGE_TYPES = tuple(t.value for t in MessageType)


class TopicKind(str, Enum):
    """Last level of a device topic."""

    DOWN = "down"  # server -> device
    UP = "up"  # device -> server
    STATUS = "status"  # device online/offline, carries its last will
    UPDATE = "update"  # device -> server: its UPDATEs only (one level below: to an aggregator, server/aggregator.py)


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


# ---------------------------------------------------------------------------------------------
# Identifiers and topics


def check_id(value: object, what: str) -> str:
    """Return ``value`` if it is a safe identifier ([A-Za-z0-9_.-], 1..64 chars, not led by
    '.' or '-'): usable as an MQTT topic level and as a file name, never a wildcard or path."""
    if not isinstance(value, str) or _ID_RE.fullmatch(value) is None:
        raise ProtocolError(
            Reason.BAD_ID,
            f"{what} must be 1..{MAX_ID_LEN} chars of [A-Za-z0-9_.-] not starting with '.' or "
            f"'-', got {value!r:.100}",
        )
    return value


def check_device_id(device_id: object) -> str:
    """Return ``device_id`` if it is a safe identifier (see check_id)."""
    return check_id(device_id, "device_id")


def check_topic_prefix(prefix: object) -> str:
    """Return ``prefix`` if it is a usable topic prefix: non-empty '/'-separated levels of
    safe identifiers (no wildcards, no empty levels, no leading '$')."""
    if not isinstance(prefix, str) or not all(_ID_RE.fullmatch(lv) for lv in prefix.split("/")):
        raise ProtocolError(
            Reason.BAD_TOPIC,
            f"topic prefix must be '/'-separated levels of [A-Za-z0-9_.-], got {prefix!r:.100}",
        )
    return prefix


@dataclass(frozen=True)
class Topics:
    """The four MQTT topics of one device under ``prefix``."""

    prefix: str
    device_id: str

    def __post_init__(self) -> None:
        check_topic_prefix(self.prefix)
        check_device_id(self.device_id)

    def _topic(self, kind: TopicKind) -> str:
        return f"{self.prefix}/dev/{self.device_id}/{kind.value}"

    @property
    def down(self) -> str:
        """Server -> device."""
        return self._topic(TopicKind.DOWN)

    @property
    def up(self) -> str:
        """Device -> server."""
        return self._topic(TopicKind.UP)

    @property
    def status(self) -> str:
        """Device online/offline; the device's last will is published here."""
        return self._topic(TopicKind.STATUS)

    @property
    def update(self) -> str:
        """Device -> server, UPDATEs only (read by the server when it folds the updates itself)."""
        return self._topic(TopicKind.UPDATE)

    def update_via(self, aggregator: str | None) -> str:
        """Where this device's UPDATE goes: the update topic, or below it the level of the aggregator process its
        task names (each aggregator subscribes only to its own level: see server/aggregator.py)."""
        if aggregator is None:
            return self.update
        return f"{self.update}/{check_id(aggregator, 'aggregator name')}"


def update_filter(prefix: str) -> str:
    """The topic filter of every device's update topic."""
    check_topic_prefix(prefix)
    return f"{prefix}/dev/+/{TopicKind.UPDATE.value}"


def server_subscriptions(prefix: str) -> list[str]:
    """Topic filters the server subscribes to: every device's up, status and update topics (with aggregators, an
    update routed to one goes a level below, out of this filter)."""
    check_topic_prefix(prefix)
    return [f"{prefix}/dev/+/{TopicKind.UP.value}", f"{prefix}/dev/+/{TopicKind.STATUS.value}", update_filter(prefix)]


def device_id_from_topic(prefix: str, topic: str) -> tuple[str, TopicKind]:
    """Split a device topic under ``prefix`` into (device_id, kind)."""
    check_topic_prefix(prefix)
    head = f"{prefix}/dev/"
    if not isinstance(topic, str) or not topic.startswith(head):
        raise ProtocolError(Reason.BAD_TOPIC, f"topic {topic!r:.200} is not under {head!r}")
    levels = topic[len(head):].split("/")
    kinds = {k.value: k for k in TopicKind}
    if len(levels) != 2 or levels[1] not in kinds:
        raise ProtocolError(
            Reason.BAD_TOPIC,
            f"topic {topic!r:.200} is not {head}<device_id>/{{{','.join(kinds)}}}",
        )
    return check_device_id(levels[0]), kinds[levels[1]]


# ---------------------------------------------------------------------------------------------
# Envelope


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    if _is_int(value):
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
    if not _is_int(value) or not 0 <= value <= MAX_ROUND:
        raise ProtocolError(
            Reason.BAD_HEADER, f"round must be an int in 0..{MAX_ROUND}, got {value!r:.50}"
        )
    return value


def _check_shape(shape: object, dtype: np.dtype, name: str) -> tuple[int, ...]:
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) > MAX_TENSOR_RANK
        or not all(_is_int(d) and d >= 0 for d in shape)
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
    if not _is_int(version) or version != PROTOCOL_VERSION:
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
        if not (_is_int(e["offset"]) and _is_int(e["nbytes"])):
            raise ProtocolError(
                reason, f"{key} entry {e['name']!r}: offset and nbytes must be ints"
            )
    return entries


def decode(data: bytes, *, max_bytes: int, allow_nonfinite: bool = False) -> Message:
    """Parse and fully validate one envelope of at most ``max_bytes`` bytes.

    Any violation raises ProtocolError and nothing else. Tensors come back as writable
    native-byte-order copies; float tensors must be finite unless ``allow_nonfinite``.
    This authenticates nothing: act on the message only after ``auth.Verifier.check`` accepts it."""
    if not _is_int(max_bytes) or max_bytes <= 0:
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
    for (name, dtype, shape), e in zip(layouts, tensor_entries):
        raw = body[e["offset"]:e["offset"] + e["nbytes"]]
        array = np.frombuffer(raw, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))
        if not allow_nonfinite:
            _check_finite(name, array)
        tensors[name] = array
    blobs = {e["name"]: bytes(body[e["offset"]:e["offset"] + e["nbytes"]]) for e in blob_entries}
    return Message(mtype, run_id, round_, device_id, msg_id, meta, tensors, blobs, direction, counter,
                   tag, hashlib.sha256(raw_header).digest())


# ---------------------------------------------------------------------------------------------
# Chunking


def chunk(payload: bytes, max_frame_bytes: int, msg_id: str) -> list[bytes]:
    """Split ``payload`` into frames of at most ``max_frame_bytes`` bytes each (header included).

    A payload that fits still becomes one frame; an empty payload becomes one empty-chunk frame."""
    if not _is_int(max_frame_bytes) or max_frame_bytes <= FRAME_HEADER_BYTES:
        raise ValueError(
            f"max_frame_bytes must exceed the {FRAME_HEADER_BYTES}-byte frame header, "
            f"got {max_frame_bytes!r}"
        )
    check_id(msg_id, "msg_id")
    if not isinstance(payload, (bytes, bytearray)):
        raise ProtocolError(
            Reason.BAD_INPUT, f"payload must be bytes, got {type(payload).__name__}"
        )
    view = memoryview(payload)
    step = max_frame_bytes - FRAME_HEADER_BYTES
    count = max(1, -(-len(view) // step))
    if count > 0xFFFFFFFF:
        raise ProtocolError(Reason.OVERSIZE, f"payload needs {count} frames, over 2**32 - 1")
    digest = hashlib.sha256(view).digest()
    ident = msg_id.encode("ascii")
    return [
        _FRAME_HEADER.pack(
            FRAME_MAGIC, PROTOCOL_VERSION, len(ident), ident, i, count, len(view), digest
        )
        + bytes(view[i * step:(i + 1) * step])
        for i in range(count)
    ]


@dataclass(frozen=True)
class _Frame:
    msg_id: str
    index: int
    count: int
    total: int
    digest: bytes
    step: int  # length of every chunk but the last, implied by this frame alone
    data: bytes


def _implied_step(index: int, count: int, total: int, size: int) -> int | None:
    """The chunk length a chunk of ``size`` bytes at ``index`` implies, or None if it cannot
    be one: chunks but the last share one length, the last holds the rest (1..that length)."""
    if count == 1:
        return size if size == total else None
    if index < count - 1:
        return size if 1 <= total - (count - 1) * size <= size else None
    step, rest = divmod(total - size, count - 1)
    return step if rest == 0 and 1 <= size <= step else None


def frame_msg_id(frame: bytes) -> str:
    """The msg_id a frame's header names, read as the reassembler reads it; raises ProtocolError."""
    return _parse_frame(frame).msg_id


def _parse_frame(frame: object) -> _Frame:
    """Parse one frame and check what it can say about itself alone."""
    if not isinstance(frame, (bytes, bytearray)):
        raise ProtocolError(Reason.BAD_INPUT, f"expected bytes, got {type(frame).__name__}")
    raw = bytes(frame)
    if len(raw) < FRAME_HEADER_BYTES:
        raise ProtocolError(
            Reason.TRUNCATED,
            f"frame is {len(raw)} bytes, shorter than its {FRAME_HEADER_BYTES}-byte header",
        )
    magic, version, id_len, id_field, index, count, total, digest = _FRAME_HEADER.unpack_from(raw)
    if magic != FRAME_MAGIC:
        raise ProtocolError(Reason.BAD_MAGIC, f"frame magic {magic!r}, expected {FRAME_MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            Reason.BAD_VERSION, f"frame version {version}, this side speaks {PROTOCOL_VERSION}"
        )
    if not 1 <= id_len <= MAX_ID_LEN or any(id_field[id_len:]):
        raise ProtocolError(
            Reason.BAD_FRAME, f"frame msg_id length {id_len} or its zero padding is invalid"
        )
    try:
        msg_id = check_id(id_field[:id_len].decode("ascii"), "msg_id")
    except UnicodeDecodeError:
        raise ProtocolError(Reason.BAD_ID, "frame msg_id is not ASCII") from None
    data = raw[FRAME_HEADER_BYTES:]
    if count == 0 or index >= count:
        raise ProtocolError(Reason.BAD_INDEX, f"frame index {index} outside count {count}")
    step = _implied_step(index, count, total, len(data))
    if step is None:
        raise ProtocolError(
            Reason.BAD_FRAME,
            f"chunk {index} of {len(data)} bytes cannot be part of {count} chunks totalling "
            f"{total} bytes (equal chunks, the last one shorter or equal, none empty)",
        )
    return _Frame(msg_id, index, count, total, digest, step, data)


@dataclass
class _Pending:
    first_seen: float
    count: int
    total: int
    digest: bytes
    step: int
    pieces: dict[int, bytes] = field(default_factory=dict)
    held: int = 0  # bytes in pieces


def envelope_limit(payload_bytes: int) -> int:
    """Largest envelope to accept for a message whose tensors and blobs hold ``payload_bytes``:
    the payload plus the largest header this protocol allows."""
    return _PREFIX.size + MAX_HEADER_BYTES + payload_bytes


class Reassembler:
    """Joins frames back into payloads, per stream (an MQTT topic), tolerating reordering and
    duplicates.

    Memory is bounded in total, over all streams: at most ``max_pending`` incomplete messages
    holding at most ``max_pending_bytes`` of chunks. A new message beyond ``max_pending``, or a
    chunk beyond ``max_pending_bytes``, evicts the oldest incomplete messages (of any stream) first.
    A frame flood on many topics thus costs a bounded amount of memory; it can still push out a
    genuine message in flight, which is then lost like any message on a lossy link. A frame that
    contradicts earlier frames of its msg_id is rejected and ignored; a completed payload whose
    hash fails is dropped. A frame of a recently delivered msg_id (an MQTT QoS 1 re-delivery, or an
    exact replay) raises RepeatedFrame: nothing is delivered twice, and the caller can say why."""

    def __init__(self, max_message_bytes: int, timeout_s: float, max_pending: int,
                 max_pending_bytes: int | None = None) -> None:
        if not _is_int(max_message_bytes) or max_message_bytes < 0:
            raise ValueError(
                f"max_message_bytes must be a non-negative int, got {max_message_bytes!r}"
            )
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        if not _is_int(max_pending) or max_pending < 1:
            raise ValueError(f"max_pending must be a positive int, got {max_pending!r}")
        budget = max_message_bytes if max_pending_bytes is None else max_pending_bytes
        if not _is_int(budget) or budget < max_message_bytes:
            raise ValueError(
                f"max_pending_bytes must be an int >= max_message_bytes ({max_message_bytes}), "
                f"got {budget!r}: a message of the largest size must be able to complete"
            )
        self.max_message_bytes = max_message_bytes
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self.max_pending_bytes = budget
        self._pending: dict[tuple[str, str], _Pending] = {}
        self._delivered: dict[tuple[str, str], float] = {}
        self._held = 0

    @property
    def pending_ids(self) -> tuple[str, ...]:
        """Msg_ids of incomplete messages, oldest first."""
        return tuple(msg_id for _, msg_id in self._pending)

    @property
    def pending_bytes(self) -> int:
        """Bytes of chunks held for incomplete messages, over all streams."""
        return self._held

    def set_max_message_bytes(self, max_message_bytes: int) -> None:
        """Change the largest message accepted from now on (up to ``max_pending_bytes``); a
        device lowers it to its model's size once it knows its plan."""
        if not _is_int(max_message_bytes) or not 0 <= max_message_bytes <= self.max_pending_bytes:
            raise ValueError(
                f"max_message_bytes must be an int in 0..{self.max_pending_bytes}, got "
                f"{max_message_bytes!r}"
            )
        self.max_message_bytes = max_message_bytes

    def feed(self, frame: bytes, now: float, stream: str = "") -> bytes | None:
        """Take one frame of ``stream`` received at time ``now``; return the payload once it is
        complete."""
        f = _parse_frame(frame)
        if f.total > self.max_message_bytes:
            raise ProtocolError(
                Reason.OVERSIZE,
                f"message {f.msg_id!r} is {f.total} bytes, over {self.max_message_bytes}",
            )
        key = (stream, f.msg_id)
        if key in self._delivered:
            raise RepeatedFrame(f.msg_id)
        pending = self._pending.get(key)
        if pending is None:
            pending = self._admit(key, f, now)
        elif (f.count, f.total, f.step, f.digest) != (
            pending.count, pending.total, pending.step, pending.digest
        ):
            raise ProtocolError(
                Reason.INCONSISTENT_CHUNK,
                f"message {f.msg_id!r}: frame says count {f.count}, total {f.total}, chunk "
                f"length {f.step}; earlier frames said {pending.count}, {pending.total}, "
                f"{pending.step} (or another hash)",
            )
        known = pending.pieces.get(f.index)
        if known is not None:
            if known != f.data:
                raise ProtocolError(
                    Reason.INCONSISTENT_CHUNK,
                    f"message {f.msg_id!r}: chunk {f.index} re-sent with other bytes",
                )
            return None
        self._make_room(len(f.data), keep=key)
        pending.pieces[f.index] = f.data
        pending.held += len(f.data)
        self._held += len(f.data)
        if len(pending.pieces) < pending.count:
            return None
        self._drop(key)
        payload = b"".join(pending.pieces[i] for i in range(pending.count))
        if hashlib.sha256(payload).digest() != pending.digest:
            raise ProtocolError(Reason.BAD_HASH, f"message {f.msg_id!r}: payload hash mismatch")
        self._remember_delivered(key, now)
        return payload

    def _admit(self, key: tuple[str, str], f: _Frame, now: float) -> _Pending:
        while len(self._pending) >= self.max_pending:
            self._drop(next(iter(self._pending)))
        pending = _Pending(now, f.count, f.total, f.digest, f.step)
        self._pending[key] = pending
        return pending

    def _make_room(self, size: int, keep: tuple[str, str]) -> None:
        """Evict the oldest incomplete messages but ``keep`` until ``size`` more bytes fit."""
        while self._held + size > self.max_pending_bytes:
            oldest = next(k for k in self._pending if k != keep)
            self._drop(oldest)

    def _drop(self, key: tuple[str, str]) -> None:
        self._held -= self._pending.pop(key).held

    def _remember_delivered(self, key: tuple[str, str], now: float) -> None:
        self._delivered[key] = now
        while len(self._delivered) > COMPLETED_IDS_REMEMBERED:
            del self._delivered[next(iter(self._delivered))]

    def expire(self, now: float) -> list[str]:
        """Drop incomplete messages first seen more than ``timeout_s`` before ``now`` (and
        forget delivered ids as old); return the dropped messages' ids."""
        expired = [k for k, p in self._pending.items() if now - p.first_seen > self.timeout_s]
        for key in expired:
            self._drop(key)
        self._delivered = {k: t for k, t in self._delivered.items() if now - t <= self.timeout_s}
        return [msg_id for _, msg_id in expired]
