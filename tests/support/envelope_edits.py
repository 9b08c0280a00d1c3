"""Byte-level mutations of wire envelopes, shared by the protocol fuzz tests and the server-path fuzz tests."""
from __future__ import annotations

import hashlib
import json
import struct

from hypothesis import strategies as st

from device_runtime.auth import compute_tag
from tests.support.sealing import KEY

EDIT_OPS = ("flip", "delete", "insert", "truncate")
NEAR_START_BYTES = 1024


def byte_edits(max_position: int) -> st.SearchStrategy[list[tuple[str, int, int]]]:
    """1–4 (op, position, value) edits; positions wrap around whatever they are applied to."""
    return st.lists(st.tuples(st.sampled_from(list(EDIT_OPS)), st.integers(0, max_position), st.integers(1, 255)),
                    min_size=1, max_size=4)


def apply_edits(data: bytes, edits: list[tuple[str, int, int]], near_start: bool = False) -> bytes:
    """Byte edits; positions wrap around the data, or only its first 1 KiB with ``near_start``."""
    out = bytearray(data)
    for op, position, value in edits:
        i = position % (min(len(out), NEAR_START_BYTES) + 1 if near_start else len(out) + 1)
        if op == "flip" and i < len(out):
            out[i] ^= value
        elif op == "delete":
            del out[i:i + value % 8 + 1]
        elif op == "insert":
            out[i:i] = bytes([value]) * (value % 8 + 1)
        elif op == "truncate":
            del out[i:]
    return bytes(out)


PREFIX_BYTES = 8 + 32
"""Magic, header length, tag."""


def split(data: bytes) -> tuple[bytes, bytes]:
    """(JSON header bytes, body) of an envelope."""
    (header_len,) = struct.unpack_from("<I", data, 4)
    return data[PREFIX_BYTES:PREFIX_BYTES + header_len], data[PREFIX_BYTES + header_len:]


def envelope(header: bytes, body: bytes, key: bytes = KEY) -> bytes:
    """An envelope of ``header`` and ``body``, tagged under ``key``: what a holder of the device's key could send,
    so the edits reach the checks behind the tag."""
    tag = compute_tag(key, hashlib.sha256(header).digest())
    return b"FAR2" + struct.pack("<I", len(header)) + tag + header + body


def rehashed(header: bytes, body: bytes) -> bytes:
    """The header with ``body_sha256`` fixed up for ``body``, so a body edit reaches the checks behind the hash."""
    fields = json.loads(header)
    fields["body_sha256"] = hashlib.sha256(body).hexdigest()
    return json.dumps(fields).encode()
