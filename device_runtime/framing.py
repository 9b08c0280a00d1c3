"""Framing: an envelope as MQTT publishes of bounded size, and those frames joined back (stdlib only).

Frame (one MQTT publish), for brokers with a message-size limit:

    b"FACK" | version u8 | msg_id length u8 | msg_id (64 B, zero padded) | index u32 |
    count u32 | total length u64 | SHA-256 of the whole payload (32 B) | chunk bytes

Every payload travels as frames, even one that fits in a single frame, so the receiver has
one path. ``Reassembler`` joins frames back into payloads.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

from device_runtime.protocol import MAX_ID_LEN, PROTOCOL_VERSION, ProtocolError, Reason, check_id, is_int

FRAME_MAGIC = b"FACK"

DEFAULT_MAX_FRAME_BYTES = 256 * 1024
"""Frame size for chunking, well below the 1 MB limit common brokers ship with."""

COMPLETED_IDS_REMEMBERED = 4096
"""How many delivered msg_ids a Reassembler remembers (over all its streams) to drop re-delivered
duplicates."""

_FRAME_HEADER = struct.Struct("<4sBB%dsIIQ32s" % MAX_ID_LEN)
FRAME_HEADER_BYTES = _FRAME_HEADER.size
"""Fixed size of a frame header; a frame is this header plus at least one payload byte."""


class RepeatedFrame(ProtocolError):
    """A frame of a message delivered moments ago: an MQTT QoS 1 re-delivery, or a replay by anyone on the broker.
    The two look alike, so the frame is dropped and the caller says so without alarm."""

    def __init__(self, msg_id: str) -> None:
        super().__init__(Reason.REPEAT, f"message {msg_id!r} was delivered moments ago (a re-delivery or a replay)")


def chunk(payload: bytes, max_frame_bytes: int, msg_id: str) -> list[bytes]:
    """Split ``payload`` into frames of at most ``max_frame_bytes`` bytes each (header included).

    A payload that fits still becomes one frame; an empty payload becomes one empty-chunk frame."""
    if not is_int(max_frame_bytes) or max_frame_bytes <= FRAME_HEADER_BYTES:
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
    data: memoryview  # the chunk, a view into the frame: no copy until the payload is joined


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
    data = memoryview(raw)[FRAME_HEADER_BYTES:]
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
    pieces: dict[int, memoryview] = field(default_factory=dict)
    held: int = 0  # bytes in pieces



class Reassembler:
    """Joins frames back into payloads, per stream (an MQTT topic), tolerating reordering and
    duplicates.

    Memory is bounded in total, over all streams: at most ``max_pending`` incomplete messages
    holding at most ``max_pending_bytes`` of chunks. A new message beyond ``max_pending``, or a
    chunk beyond ``max_pending_bytes``, evicts the oldest incomplete messages (of any stream) first.
    A frame flood on many topics thus costs a bounded amount of memory; it can still push out a
    genuine message in flight, which is then lost like any message on a lossy link; the frames of a
    pushed-out message that still come are dropped (it cannot complete), so they push out nothing more; that
    msg_id stays refused for ``timeout_s`` even if re-delivered whole (a QoS 1 re-delivery, a retained copy fetched
    again): every re-send of this protocol (a saved answer resealed, a payload published again) has a new
    msg_id. A frame that contradicts earlier frames of its msg_id (its count, total, chunk length or payload hash)
    is rejected and ignored. A frame of a recently delivered msg_id (an MQTT QoS 1 re-delivery, or an
    exact replay) raises RepeatedFrame: nothing is delivered twice, and the caller can say why.

    The payload hash the frames carry names the message; it is not computed again over the joined bytes: anyone
    on an open broker can write frames whose hash matches bytes of their choosing, so it proves nothing, and what
    this project reassembles is checked where it is read: an envelope by the body digest its authenticated header
    binds (``envelope.decode``, then ``auth``), a plan payload by the hash its sealed TASK names
    (``payload.check_payload``). A second SHA-256 pass over every byte here cost the server's read path ~0.16 CPU s per
    221 MB and bought nothing."""

    def __init__(self, max_message_bytes: int, timeout_s: float, max_pending: int,
                 max_pending_bytes: int | None = None) -> None:
        if not is_int(max_message_bytes) or max_message_bytes < 0:
            raise ValueError(
                f"max_message_bytes must be a non-negative int, got {max_message_bytes!r}"
            )
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        if not is_int(max_pending) or max_pending < 1:
            raise ValueError(f"max_pending must be a positive int, got {max_pending!r}")
        budget = max_message_bytes if max_pending_bytes is None else max_pending_bytes
        if not is_int(budget) or budget < max_message_bytes:
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
        self._pushed_out: dict[tuple[str, str], float] = {}  # (stream, msg_id) evicted for room -> when
        self._held = 0
        self.evicted: list[tuple[str, str]] = []  # (stream, msg_id) of incomplete messages pushed out for room, until
        # the caller takes them

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
        if not is_int(max_message_bytes) or not 0 <= max_message_bytes <= self.max_pending_bytes:
            raise ValueError(
                f"max_message_bytes must be an int in 0..{self.max_pending_bytes}, got "
                f"{max_message_bytes!r}"
            )
        self.max_message_bytes = max_message_bytes

    def feed(self, frame: bytes, now: float, stream: str = "") -> bytearray | None:
        """Take one frame of ``stream`` received at time ``now``; return the payload once it is
        complete: a new bytearray the caller owns (``envelope.decode`` reads tensors in place from it)."""
        f = _parse_frame(frame)
        if f.total > self.max_message_bytes:
            raise ProtocolError(
                Reason.OVERSIZE,
                f"message {f.msg_id!r} is {f.total} bytes, over {self.max_message_bytes}",
            )
        key = (stream, f.msg_id)
        if key in self._delivered:
            raise RepeatedFrame(f.msg_id)
        if key in self._pushed_out:
            return None  # the rest of a message pushed out for room: it cannot complete any more, so it takes none
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
        self._make_room(len(f.data), keep=key, now=now)
        pending.pieces[f.index] = f.data
        pending.held += len(f.data)
        self._held += len(f.data)
        if len(pending.pieces) < pending.count:
            return None
        self._drop(key)
        payload = bytearray().join(pending.pieces[i] for i in range(pending.count))
        self._remember_delivered(key, now)
        return payload

    def _admit(self, key: tuple[str, str], f: _Frame, now: float) -> _Pending:
        while len(self._pending) >= self.max_pending:
            self._evict(next(iter(self._pending)), now)
        pending = _Pending(now, f.count, f.total, f.digest, f.step)
        self._pending[key] = pending
        return pending

    def _make_room(self, size: int, keep: tuple[str, str], now: float) -> None:
        """Evict the oldest incomplete messages but ``keep`` until ``size`` more bytes fit."""
        while self._held + size > self.max_pending_bytes:
            oldest = next(k for k in self._pending if k != keep)
            self._evict(oldest, now)

    def _evict(self, key: tuple[str, str], now: float) -> None:
        """Push out an incomplete message; its frames still to come are dropped (remembered like delivered ids),
        so they hold no room that complete-able messages need (under a burst of interleaved messages they did, and
        pushed out more)."""
        self.evicted.append(key)
        self._drop(key)
        self._pushed_out[key] = now
        while len(self._pushed_out) > COMPLETED_IDS_REMEMBERED:
            del self._pushed_out[next(iter(self._pushed_out))]

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
        self._pushed_out = {k: t for k, t in self._pushed_out.items() if now - t <= self.timeout_s}
        return [msg_id for _, msg_id in expired]
