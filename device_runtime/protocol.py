"""What every part of the wire protocol shares: its version, the errors it raises and its identifiers.

The protocol between the server and the devices (numpy + stdlib only) has three parts, one module each:
``device_runtime.topics`` (which MQTT topic carries what), ``device_runtime.envelope`` (one logical message, sealed,
as bytes) and ``device_runtime.framing`` (an envelope as MQTT publishes of bounded size, joined back together).
"""

from __future__ import annotations

import re
from enum import Enum

PROTOCOL_VERSION = 5
"""5: secure aggregation over MQTT: a TASK may carry the round's SecAgg+ parameters (``secure``), SECAGG messages
carry the exchanges (device_runtime/secagg_wire.py) and a secure round's UPDATE carries the masked input as a blob.
4: payload topics carry the run's id (``PREFIX/payload/RUN/SHA256``, device_runtime/topics.py), so a device of
protocol 3 could not fetch a payload; an async TASK names its model version. 3: a TASK may name its plan's payload
(device_runtime/payload.py) instead of carrying the tensors; 2 carried them always (same envelope and frame
layouts)."""

MAX_ID_LEN = 64

_ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,%d}" % (MAX_ID_LEN - 1))


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
    NOT_ADMITTED = "not_admitted"


class ProtocolError(ValueError):
    """A message, frame or topic that breaks the protocol; ``reason`` says which rule."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(reason, message)
        self.reason = reason
        self.message = message

    def __str__(self) -> str:
        return f"{self.message} [{self.reason.value}]"


def is_int(value: object) -> bool:
    """Whether ``value`` is an int and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_id(value: object) -> bool:
    """Whether ``value`` is a safe identifier (see check_id)."""
    return isinstance(value, str) and _ID_RE.fullmatch(value) is not None


def check_id(value: object, what: str) -> str:
    """Return ``value`` if it is a safe identifier ([A-Za-z0-9_.-], 1..64 chars, not led by
    '.' or '-'): usable as an MQTT topic level and as a file name, never a wildcard or path."""
    if not is_id(value):
        raise ProtocolError(
            Reason.BAD_ID,
            f"{what} must be 1..{MAX_ID_LEN} chars of [A-Za-z0-9_.-] not starting with '.' or "
            f"'-', got {value!r:.100}",
        )
    return value


def check_device_id(device_id: object) -> str:
    """Return ``device_id`` if it is a safe identifier (see check_id)."""
    return check_id(device_id, "device_id")
