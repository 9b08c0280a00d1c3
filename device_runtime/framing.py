"""Framing: an envelope as MQTT publishes of bounded size, and those frames joined back (stdlib only).

Frame (one MQTT publish), for brokers with a message-size limit:

    b"FACK" | version u8 | msg_id length u8 | msg_id (64 B, zero padded) | index u32 |
    count u32 | total length u64 | SHA-256 of the whole payload (32 B) | chunk bytes

Every payload travels as frames, even one that fits in a single frame, so the receiver has
one path. ``Reassembler`` joins frames back into payloads, admitting each frame for a sender first (``Admit``):
on an open broker anyone publishes on any topic, so what one sender may hold half-received is bounded per sender.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Protocol

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


class NotAdmitted(ProtocolError):
    """A frame its receiver takes from no sender (a topic of a device not enrolled, a payload not awaited, one of
    another size or hash than the awaited one): dropped at the frame, before anything of it is buffered."""

    def __init__(self, stream: str) -> None:
        super().__init__(Reason.NOT_ADMITTED, f"a frame on {stream!r:.200} from no sender this receiver takes")


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
class Frame:
    """One parsed frame: what its header says and its chunk."""

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


def _parse_frame(frame: object) -> Frame:
    """Parse one frame and check what it can say about itself alone (no copy: a 50 MB junk frame costs no second
    50 MB here)."""
    if not isinstance(frame, (bytes, bytearray)):
        raise ProtocolError(Reason.BAD_INPUT, f"expected bytes, got {type(frame).__name__}")
    raw = frame
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
    return Frame(msg_id, index, count, total, digest, step, data)


Admit = Callable[[str], "Hashable | None"]
"""stream -> the sender its frames count for, or None: dropped at the frame (``NotAdmitted``) before the frame is even
parsed, never buffered. A server admits the streams of enrolled devices (each its own sender), a device its down topic
and the topic of the one payload it waits for."""
Check = Callable[[Hashable, "Frame"], bool]
"""(sender, frame) -> whether what the frame's header claims is what the receiver takes from that sender (a device: the
awaited payload's size and hash); False drops it at the frame like an unadmitted one."""
Vouch = Callable[[Hashable, memoryview], "int | None"]
"""(sender, chunk 0 of a message) -> the sender's counter when the chunk opens a message the sender authenticated
(its envelope's tag verifies under the sender's key), else None."""


class Spill(Protocol):
    """Where a reassembler keeps the chunks of incomplete messages past its memory budget (``spill.FileSpill``)."""

    def write(self, key: tuple[str, str], offset: int, data: memoryview | bytes) -> None: ...

    def take(self, key: tuple[str, str], size: int) -> bytearray: ...

    def drop(self, key: tuple[str, str]) -> None: ...


@dataclass
class _Pending:
    first_seen: float
    count: int
    total: int
    digest: bytes
    step: int
    sender: Hashable
    seq: int  # order of admission
    rank: int | None = None  # the sender's counter once chunk 0 vouched for the message (Vouch), else None
    pieces: dict[int, memoryview | None] = field(default_factory=dict)  # None: the chunk is in the spill
    held: int = 0  # bytes of its chunks received (in memory, or in the spill once ``spilled``)
    spilled: bool = False  # its chunks are in the spill, not in memory

    def keeps_over(self, other: _Pending) -> bool:
        """Whether, of two incomplete messages of one sender, this one stays when one must go: a vouched one over an
        unvouched one, then the higher counter (the sender's newest message: a replay has an older one), then the
        newer admission."""
        return (self.rank is not None, self.rank or 0, self.seq) > (other.rank is not None, other.rank or 0, other.seq)


@dataclass
class _Sender:
    keys: dict[tuple[str, str], None] = field(default_factory=dict)  # its incomplete messages, in admission order
    held: int = 0



def _checked_budgets(max_message_bytes: int, max_pending: int, max_pending_bytes: int | None,
                     max_pending_per_sender: int | None, max_pending_bytes_per_sender: int | None, spill: Spill | None,
                     max_spill_bytes: int) -> tuple[int, int, int, int, int, int]:
    """A reassembler's budgets, checked and with their defaults (``Reassembler``): (max_message_bytes, max_pending,
    max_pending_bytes, max_pending_per_sender, max_pending_bytes_per_sender, max_spill_bytes); raises ValueError."""
    if not is_int(max_message_bytes) or max_message_bytes < 0:
        raise ValueError(
            f"max_message_bytes must be a non-negative int, got {max_message_bytes!r}"
        )
    if not is_int(max_pending) or max_pending < 1:
        raise ValueError(f"max_pending must be a positive int, got {max_pending!r}")
    budget = max_message_bytes if max_pending_bytes is None else max_pending_bytes
    if not is_int(budget) or budget < max_message_bytes:
        raise ValueError(
            f"max_pending_bytes must be an int >= max_message_bytes ({max_message_bytes}), "
            f"got {budget!r}: a message of the largest size must be able to complete"
        )
    per_sender = max_pending if max_pending_per_sender is None else max_pending_per_sender
    if not is_int(per_sender) or not 1 <= per_sender <= max_pending:
        raise ValueError(f"max_pending_per_sender must be an int in 1..{max_pending}, got {per_sender!r}")
    sender_budget = budget if max_pending_bytes_per_sender is None else max_pending_bytes_per_sender
    if not is_int(sender_budget) or not max_message_bytes <= sender_budget <= budget:
        raise ValueError(f"max_pending_bytes_per_sender must be an int in {max_message_bytes}..{budget}, got "
                         f"{sender_budget!r}: a message of the largest size must be able to complete")
    if not is_int(max_spill_bytes) or max_spill_bytes < 0 or (max_spill_bytes and spill is None):
        raise ValueError(f"max_spill_bytes must be a non-negative int, and 0 without a spill, got "
                         f"{max_spill_bytes!r}")
    return max_message_bytes, max_pending, budget, per_sender, sender_budget, max_spill_bytes


class Reassembler:
    """Joins frames back into payloads, per stream (an MQTT topic), tolerating reordering and
    duplicates.

    Every frame is first admitted for a sender by its stream (``admit``; without it the stream is the sender) and,
    once parsed, by what its header claims (``check``): a frame admitted for none is dropped at the frame
    (``NotAdmitted``), buffering nothing. Memory is bounded per sender and in total: one sender holds at most
    ``max_pending_per_sender`` incomplete messages of at most ``max_pending_bytes_per_sender``, and all together at
    most ``max_pending`` of ``max_pending_bytes``. A message beyond a sender's bound pushes out one of that sender's
    own messages, never another sender's: the unvouched first (oldest first), then the vouched one with the lowest
    counter (``vouch``: chunk 0 carries the envelope's tagged header, so a flood of junk under an enrolled id cannot
    push out that device's own update, nor can replays of its older messages); where the newcomer ranks lowest, the
    newcomer is the one dropped. The total bound is the last guard: beyond it the oldest unvouched messages of any
    sender go first, then the newest vouched (the least received: the others complete). With a ``spill``
    (``spill.FileSpill``) a vouched message that the total bound would push out goes to the spill instead while it has
    room (``max_spill_bytes``, reserved at each message's total): its chunks, those held and those still to come, are
    written there and read back whole once it completes, so a burst of many senders' interleaved messages costs disk
    and page cache, not memory, and loses nothing; an unvouched one (junk, or anything where nothing vouches) never
    goes there. Spilled messages count for their senders' bounds, not for the total's. A pushed-out message is lost
    like any message on a lossy link; its frames still to come are dropped (it cannot complete), so they push out
    nothing more; that msg_id stays refused for ``timeout_s`` even if re-delivered whole (a QoS 1 re-delivery, a
    retained copy fetched again): every re-send of this protocol (a saved answer resealed, a payload published again)
    has a new msg_id. Those of them the owner may want back (vouched ones, or any where nothing vouches) wait in
    ``evicted``. A frame that contradicts earlier frames of its msg_id (its count, total, chunk length or payload
    hash) is rejected and ignored. A frame of a recently delivered msg_id (an MQTT QoS 1 re-delivery, or an exact
    replay) raises RepeatedFrame: nothing is delivered twice, and the caller can say why.

    The payload hash the frames carry names the message; it is not computed again over the joined bytes: anyone
    on an open broker can write frames whose hash matches bytes of their choosing, so it proves nothing, and what
    this project reassembles is checked where it is read: an envelope by the body digest its authenticated header
    binds (``envelope.decode``, then ``auth``), a plan payload by the hash its sealed TASK names
    (``payload.check_payload``). A second SHA-256 pass over every byte here cost the server's read path ~0.16 CPU s per
    221 MB and bought nothing."""

    def __init__(self, max_message_bytes: int, timeout_s: float, max_pending: int,
                 max_pending_bytes: int | None = None, *, admit: Admit | None = None, check: Check | None = None,
                 vouch: Vouch | None = None,
                 max_pending_per_sender: int | None = None, max_pending_bytes_per_sender: int | None = None,
                 spill: Spill | None = None, max_spill_bytes: int = 0) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        (self.max_message_bytes, self.max_pending, self.max_pending_bytes, self.max_pending_per_sender,
         self.max_pending_bytes_per_sender, self.max_spill_bytes) = _checked_budgets(
            max_message_bytes, max_pending, max_pending_bytes, max_pending_per_sender, max_pending_bytes_per_sender,
            spill, max_spill_bytes)
        self.timeout_s = timeout_s
        self._spill = spill
        self._spilled = 0  # bytes reserved in the spill: the totals of the spilled messages
        self._spilled_count = 0  # incomplete messages in the spill
        self._admit_stream, self._check = admit, check
        self._vouch = vouch
        self._pending: dict[tuple[str, str], _Pending] = {}
        self._senders: dict[Hashable, _Sender] = {}
        # OrderedDicts: the oldest is forgotten first, in O(1) (a plain dict's first key, after many deletions at its
        # front, costs a scan of the deleted slots: 60 µs a frame under a junk flood)
        self._delivered: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._pushed_out: OrderedDict[tuple[str, str], float] = OrderedDict()  # (stream, msg_id) evicted -> when
        self._held = 0
        self._seq = 0
        self.evicted: list[tuple[str, str]] = []  # (stream, msg_id) of incomplete messages pushed out for room that
        # the owner may want back (see the class docstring), until the caller takes them
        self.expired_lost: list[tuple[str, str]] = []  # (stream, msg_id) of those expired that the owner may want back
        self.spills = 0  # messages moved to the spill since the caller last took the count

    @property
    def pending_ids(self) -> tuple[str, ...]:
        """Msg_ids of incomplete messages, oldest first."""
        return tuple(msg_id for _, msg_id in self._pending)

    @property
    def pending_bytes(self) -> int:
        """Bytes of chunks held in memory for incomplete messages, over all streams."""
        return self._held

    @property
    def spilled_bytes(self) -> int:
        """Bytes reserved in the spill for incomplete messages (their totals)."""
        return self._spilled

    def set_max_message_bytes(self, max_message_bytes: int) -> None:
        """Change the largest message accepted from now on (up to ``max_pending_bytes_per_sender``); a
        device lowers it to its model's size once it knows its plan."""
        if not is_int(max_message_bytes) or not 0 <= max_message_bytes <= self.max_pending_bytes_per_sender:
            raise ValueError(
                f"max_message_bytes must be an int in 0..{self.max_pending_bytes_per_sender}, got "
                f"{max_message_bytes!r}"
            )
        self.max_message_bytes = max_message_bytes

    def set_budgets(self, max_message_bytes: int, max_pending: int, max_pending_bytes: int | None = None, *,
                    max_pending_per_sender: int | None = None, max_pending_bytes_per_sender: int | None = None,
                    max_spill_bytes: int = 0) -> None:
        """New budgets from now on, checked and defaulted as the constructor's (an aggregator learns the largest
        update at its round's brief). What is held stays; a lower bound pushes out (or spills) at the next frames
        that need room. Safe between two frames of the network thread: the bounds move in an order that keeps
        max_message_bytes <= max_pending_bytes_per_sender <= max_pending_bytes at every step."""
        message, pending, budget, per_sender, sender_budget, spill_bytes = _checked_budgets(
            max_message_bytes, max_pending, max_pending_bytes, max_pending_per_sender, max_pending_bytes_per_sender,
            self._spill, max_spill_bytes)
        self.max_pending_bytes = max(self.max_pending_bytes, budget)
        self.max_pending_bytes_per_sender = max(self.max_pending_bytes_per_sender, sender_budget)
        self.max_message_bytes = message
        self.max_pending_bytes_per_sender = sender_budget
        self.max_pending_bytes = budget
        self.max_pending = max(self.max_pending, pending)  # and max_pending_per_sender <= max_pending likewise
        self.max_pending_per_sender = per_sender
        self.max_pending = pending
        self.max_spill_bytes = spill_bytes

    def feed(self, frame: bytes, now: float, stream: str = "") -> bytearray | None:
        """Take one frame of ``stream`` received at time ``now``; return the payload once it is
        complete: a new bytearray the caller owns (``envelope.decode`` reads tensors in place from it)."""
        sender = stream if self._admit_stream is None else self._admit_stream(stream)
        if sender is None:
            raise NotAdmitted(stream)
        f = _parse_frame(frame)
        if self._check is not None and not self._check(sender, f):
            raise NotAdmitted(stream)
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
            pending = self._admit(key, f, sender, now)
            if pending is None:
                return None  # the sender's lowest-ranked message: dropped, its place kept for what ranks higher
        elif (f.count, f.total, f.step, f.digest, sender) != (
            pending.count, pending.total, pending.step, pending.digest, pending.sender
        ):
            raise ProtocolError(
                Reason.INCONSISTENT_CHUNK,
                f"message {f.msg_id!r}: frame says count {f.count}, total {f.total}, chunk "
                f"length {f.step}; earlier frames said {pending.count}, {pending.total}, "
                f"{pending.step} (or another hash or sender)",
            )
        elif f.index == 0 and pending.rank is None and self._vouch is not None and 0 not in pending.pieces:
            pending.rank = self._vouch(sender, f.data)  # chunk 0 came after others: vouched from now on
        if f.index in pending.pieces:
            known = pending.pieces[f.index]
            if known is not None and known != f.data:  # a spilled chunk is not read back to compare: the body
                raise ProtocolError(  # digest the envelope's tagged header binds refuses a changed one
                    Reason.INCONSISTENT_CHUNK,
                    f"message {f.msg_id!r}: chunk {f.index} re-sent with other bytes",
                )
            return None
        if not self._make_room(len(f.data), key, now):
            return None
        if pending.spilled:
            try:
                self._spill.write(key, f.index * pending.step, f.data)
            except OSError:
                self._evict(key, now)
                return None
            pending.pieces[f.index] = None
        else:
            pending.pieces[f.index] = f.data
            self._held += len(f.data)
        pending.held += len(f.data)
        self._senders[sender].held += len(f.data)
        if len(pending.pieces) < pending.count:
            return None
        if pending.spilled:
            try:
                payload = self._spill.take(key, pending.total)
            except OSError:
                self._evict(key, now)
                return None
        else:
            payload = bytearray().join(pending.pieces[i] for i in range(pending.count))
        self._drop(key)
        self._remember_delivered(key, now)
        return payload

    def _admit(self, key: tuple[str, str], f: Frame, sender: Hashable, now: float) -> _Pending | None:
        """A new incomplete message of ``sender``, room made for it (its own messages first); None where it ranks
        lowest of the sender's (it is pushed out at once)."""
        self._seq += 1
        pending = _Pending(now, f.count, f.total, f.digest, f.step, sender, self._seq)
        if f.index == 0 and self._vouch is not None:
            pending.rank = self._vouch(sender, f.data)
        own = self._senders.get(sender)
        if own is not None and len(own.keys) >= self.max_pending_per_sender:
            victim = self._lowest(own.keys)
            if self._pending[victim].keeps_over(pending):
                self._note_evicted(key, pending)  # the newcomer ranks lowest: its frames still to come take nothing
                self._remember_pushed_out(key, now)
                return None
            self._evict(victim, now)
        while len(self._pending) - self._spilled_count >= self.max_pending:
            victim = self._total_victim(keep=None)
            if victim is None:  # every message in memory is vouched: the newcomer is the newest, the one to go
                if self._spill_room(pending):
                    break  # to the spill, once it is held
                self._note_evicted(key, pending)
                self._remember_pushed_out(key, now)
                return None
            self._evict(victim, now)
        self._pending[key] = pending
        self._senders.setdefault(sender, _Sender()).keys[key] = None
        if len(self._pending) - self._spilled_count > self.max_pending and not self._to_spill(key):
            self._evict(key, now)
            return None
        return pending

    def _lowest(self, keys: dict[tuple[str, str], None]) -> tuple[str, str]:
        """The key of the message that goes first of one sender's ``keys`` (``_Pending.keeps_over``)."""
        lowest = None
        for key in keys:
            if lowest is None or self._pending[lowest].keeps_over(self._pending[key]):
                lowest = key
        return lowest

    def _total_victim(self, keep: tuple[str, str] | None) -> tuple[str, str] | None:
        """The total bound's victim to make room for ``keep`` (None: a newcomer, not held yet, and newer than all): the
        oldest unvouched incomplete message but ``keep`` (junk, or what nothing vouches for), else the newest vouched
        one, ``keep`` included (it holds the least: under a burst of many senders' interleaved frames the older ones
        complete and the newest is asked again; pushing out the oldest, which holds the most, cascaded). None where
        ``keep`` is the one to go."""
        newest = None
        for key, pending in self._pending.items():
            if pending.spilled:
                continue  # it holds no memory
            if pending.rank is None:
                if key != keep:
                    return key
            else:
                newest = key
        if keep is None or self._pending[keep].rank is None or newest == keep:
            return None
        return newest

    def _make_room(self, size: int, keep: tuple[str, str], now: float) -> bool:
        """Make room for ``size`` more bytes of ``keep``: its sender's lower-ranked messages go first, then, for the
        total bound, ``_total_victim``'s; False where ``keep`` itself had to go."""
        pending = self._pending[keep]
        own = self._senders[pending.sender]
        while own.held + size > self.max_pending_bytes_per_sender:
            victim = self._lowest({k: None for k in own.keys if k != keep})
            if victim is None or self._pending[victim].keeps_over(pending):
                self._evict(keep, now)
                return False
            self._evict(victim, now)
        if pending.spilled:
            return True
        while self._held + size > self.max_pending_bytes:
            victim = self._total_victim(keep)
            target = keep if victim is None else victim
            if self._spill_room(self._pending[target]) and self._to_spill(target):
                if target == keep:
                    return True
                continue
            if victim is None:
                self._evict(keep, now)
                return False
            self._evict(victim, now)
        return True

    def _spill_room(self, pending: _Pending) -> bool:
        """Whether ``pending`` may go to the spill: a vouched message (authenticated by its sender: junk never goes)
        whose whole size fits in what the spill has left."""
        return self._spill is not None and pending.rank is not None and \
            self._spilled + pending.total <= self.max_spill_bytes

    def _to_spill(self, key: tuple[str, str]) -> bool:
        """Move incomplete message ``key`` to the spill (its chunks written, its memory freed); False where the spill
        refused a write (then nothing changed in memory, and what was written is dropped)."""
        pending = self._pending[key]
        try:
            for index, data in pending.pieces.items():
                self._spill.write(key, index * pending.step, data)
        except OSError:
            self._spill.drop(key)
            return False
        self._held -= pending.held
        pending.pieces = dict.fromkeys(pending.pieces)
        pending.spilled = True
        self._spilled += pending.total
        self._spilled_count += 1
        self.spills += 1
        return True

    def _evict(self, key: tuple[str, str], now: float) -> None:
        """Push out an incomplete message; its frames still to come are dropped (remembered like delivered ids),
        so they hold no room that complete-able messages need (under a burst of interleaved messages they did, and
        pushed out more)."""
        self._note_evicted(key, self._pending[key])
        self._drop(key)
        self._remember_pushed_out(key, now)

    def _remember_pushed_out(self, key: tuple[str, str], now: float) -> None:
        self._pushed_out[key] = now
        while len(self._pushed_out) > COMPLETED_IDS_REMEMBERED:
            self._pushed_out.popitem(last=False)

    def _note_evicted(self, key: tuple[str, str], pending: _Pending) -> None:
        if self._vouch is None or pending.rank is not None:  # an unvouched one, where chunk 0 vouches: likely junk
            self.evicted.append(key)

    def _drop(self, key: tuple[str, str]) -> None:
        pending = self._pending.pop(key)
        if pending.spilled:
            self._spill.drop(key)
            self._spilled -= pending.total
            self._spilled_count -= 1
        else:
            self._held -= pending.held
        own = self._senders[pending.sender]
        own.held -= pending.held
        del own.keys[key]
        if not own.keys:
            del self._senders[pending.sender]

    def _remember_delivered(self, key: tuple[str, str], now: float) -> None:
        self._delivered[key] = now
        while len(self._delivered) > COMPLETED_IDS_REMEMBERED:
            self._delivered.popitem(last=False)

    def expire(self, now: float) -> list[str]:
        """Drop incomplete messages first seen more than ``timeout_s`` before ``now`` (and
        forget delivered ids as old); return the dropped messages' ids. Those the owner may want back wait in
        ``expired_lost`` (a frame the broker dropped, its queue for this client full under a flood, leaves its message
        incomplete for good)."""
        expired = [k for k, p in self._pending.items() if now - p.first_seen > self.timeout_s]
        for key in expired:
            if self._vouch is None or self._pending[key].rank is not None:
                self.expired_lost.append(key)
            self._drop(key)
        self._delivered = OrderedDict((k, t) for k, t in self._delivered.items() if now - t <= self.timeout_s)
        self._pushed_out = OrderedDict((k, t) for k, t in self._pushed_out.items() if now - t <= self.timeout_s)
        return [msg_id for _, msg_id in expired]
