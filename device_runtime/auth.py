"""Message authentication: per-device keys, fresh counters, and the Verifier that refuses replays and forgeries.

The broker is assumed open (see DESIGN.md, "Security model"): anyone may publish byte-exact copies of earlier
messages on any topic. Every envelope therefore carries its run id, its direction and a counter, and an
HMAC-SHA256 tag under the device's key over the SHA-256 of its whole header (which holds all of these fields
and the body's SHA-256, so the tag also covers the body). A receiver believes a message only when

- the device is enrolled (its key is known) and the tag verifies under that key (``BAD_TAG`` otherwise; a
  tag of the wrong length is ``BAD_TAG`` too, compared in constant time);
- the direction is one this receiver takes (a server never takes ``down``: a reflected server message is
  refused even though its tag is genuine);
- the run id is one the receiver expects for this message (``runs``), where it expects one;
- the counter is above the last counter accepted for (device, direction). Counters are per sender and
  increase across runs, so per-(device, run, direction) freshness follows, and so does freshness across runs:
  an old run's PLAN or JOIN has a lower counter than anything the sender said since.

Status frames (``Direction.STATUS``) follow their own rule: an ``online`` frame must be fresh and makes its
per-connection nonce current; an ``offline`` frame is believed only when it names the current nonce, and closes
that connection. The MQTT last will is minted at CONNECT, before the ``online`` that follows it, so its counter is
older; the nonce, not the counter, ties it to its connection, and a will or ``offline`` captured from an earlier
connection is refused as ``STALE_CONNECTION``. The broker retains the last ``online`` and hands it to every new
subscriber (a restarted server): the very frame last accepted is taken again while its connection is open, and
changes nothing; once that connection's ``offline`` arrived, it is a replay.

Sessions bind what a receiver accepts to its current state. A device mints a fresh random session nonce at every
process start (its state starts there: a re-flashed board or a new workdir holds no counters) and names it in the
meta of everything it sends (``SESSION_KEY``, under the tag), its JOIN and status frames included. The server
learns each device's session from that device's freshest message (the highest counter accepted) and names it in
everything it sends that device. A Verifier built with its own ``session`` (a device's) refuses, as
``STALE_SESSION``, a message that does not name it: nothing sealed before the device started, such as a `refused`,
PLAN or TASK of an earlier run left retained or queued in its persistent session, can move it, even when its
counter is above everything this fresh device has seen.

Counters are ``epoch << SEQ_BITS | seq``. The epoch is fixed at process start as
``max(last persisted epoch + 1, unix time in seconds)`` and persisted before the first message goes out; seq
counts messages from 1 within the start. The persisted epoch alone makes counters increase across restarts
even with a wrong clock; the clock alone keeps them increasing when the state file is lost (a re-flashed
device); only one disk write per start, none per message. 32 epoch bits last until 2106; 31 seq bits allow
2**31 - 1 messages per start, after which ``CounterSource.next`` raises rather than wrap. The sum stays within
JSON's signed 64-bit range.

The Verifier is a pure state machine (no clock, no I/O): ``check`` returns a Verdict and advances its state
only when it accepts. Its state is plain JSON, so a server can persist it and still refuse a JOIN captured
before a restart.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import threading
import time
from collections.abc import Container, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Protocol

from device_runtime.atomic_file import fsync_directory, write_atomic

KEY_BYTES = 32
TAG_BYTES = 32
NONCE_BYTES = 16
SEQ_BITS = 31
EPOCH_BITS = 32
MAX_SEQ = (1 << SEQ_BITS) - 1
MAX_EPOCH = (1 << EPOCH_BITS) - 1
MAX_COUNTER = (MAX_EPOCH << SEQ_BITS) | MAX_SEQ
"""Largest counter: below 2**63, so it travels as a JSON integer every parser reads exactly."""
TAG_CONTEXT = b"fedara-envelope-v2\x00"
"""Prefix of every tagged string, so a tag made for this protocol means nothing elsewhere."""
STATUS_ONLINE = "online"
STATUS_OFFLINE = "offline"
SESSION_KEY = "session"
"""Meta key of the session nonce a message is bound to (see the module docstring)."""


class Direction(str, Enum):
    """Who sends a message: it is inside the tag, so a message cannot be reflected the other way."""

    UP = "up"  # device -> server
    DOWN = "down"  # server -> device
    STATUS = "status"  # device -> server on its status topic (online, offline, last will)


class Refusal(str, Enum):
    """Why the Verifier refused a message."""

    UNKNOWN_DEVICE = "unknown_device"  # no key for this device id: not enrolled
    BAD_TAG = "bad_tag"  # the tag does not verify under the device's key
    WRONG_DIRECTION = "wrong_direction"  # e.g. a server message replayed on a device's up topic
    WRONG_RUN = "wrong_run"  # the message belongs to another run
    REPLAY = "replay"  # counter not above the last one accepted: a replay or a reordering
    BAD_COUNTER = "bad_counter"  # not an int in 1..MAX_COUNTER
    STALE_CONNECTION = "stale_connection"  # an offline/will frame of a connection that is not current
    STALE_SESSION = "stale_session"  # not bound to the receiver's current session: sealed before it started


@dataclass(frozen=True)
class Verdict:
    """The Verifier's answer: accepted, or refused with a reason and a line for the log."""

    accepted: bool
    reason: Refusal | None = None
    detail: str = ""


ACCEPTED = Verdict(True)


class Sealed(Protocol):
    """What the Verifier reads of a decoded envelope (envelope.Message has these fields)."""

    device_id: str
    run_id: str
    direction: Direction
    counter: int
    tag: bytes
    signed_digest: bytes


def new_key() -> bytes:
    """A fresh device key (32 random bytes from the OS's CSPRNG)."""
    return secrets.token_bytes(KEY_BYTES)


def new_nonce() -> str:
    """A fresh per-connection nonce, as 32 hex digits."""
    return secrets.token_hex(NONCE_BYTES)


def compute_tag(key: bytes, signed_digest: bytes) -> bytes:
    """HMAC-SHA256 under ``key`` of the SHA-256 of an envelope header."""
    return hmac.new(key, TAG_CONTEXT + signed_digest, hashlib.sha256).digest()


def tag_matches(key: bytes, signed_digest: bytes, tag: bytes) -> bool:
    """Whether ``tag`` is the tag of ``signed_digest`` under ``key`` (constant time)."""
    return hmac.compare_digest(compute_tag(key, signed_digest), tag)


def is_counter(value: object) -> bool:
    """Whether ``value`` is a valid counter: an int in 1..MAX_COUNTER (bools are not)."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_COUNTER


def counter_epoch(counter: int) -> int:
    """The epoch of ``counter``: which process start of its sender sealed it (see the module docstring)."""
    return counter >> SEQ_BITS


class CounterExhausted(RuntimeError):
    """2**31 - 1 messages were sent in one process start; restart for a new epoch rather than wrap."""


class CounterSource:
    """Outbound counters of one sender for one process start: ``epoch << SEQ_BITS | seq``, seq from 1.

    One source serves all of a sender's directions and threads (the MQTT network thread mints status
    frames): every counter it hands out is larger than the one before."""

    def __init__(self, epoch: int, seq: int = 0) -> None:
        if not 1 <= epoch <= MAX_EPOCH:
            raise ValueError(f"epoch must be in 1..{MAX_EPOCH}, got {epoch}")
        if not 0 <= seq <= MAX_SEQ:
            raise ValueError(f"seq must be in 0..{MAX_SEQ}, got {seq}")
        self.epoch = epoch
        self._seq = seq
        self._lock = threading.Lock()

    def next(self) -> int:
        """The next counter; raises CounterExhausted instead of wrapping to a value already used."""
        with self._lock:
            if self._seq >= MAX_SEQ:
                raise CounterExhausted(f"epoch {self.epoch} used all {MAX_SEQ} counters: restart the process")
            self._seq += 1
            return (self.epoch << SEQ_BITS) | self._seq


def next_epoch(last_epoch: int | None, now_unix: float) -> int:
    """Epoch of a new process start: above the last persisted one, and at least the clock's seconds."""
    epoch = max((last_epoch or 0) + 1, int(now_unix))
    if epoch > MAX_EPOCH:
        raise ValueError(f"epoch {epoch} exceeds {MAX_EPOCH}: the persisted epoch or the clock is corrupt")
    return epoch


def parse_key(text: object, where: str) -> bytes:
    """The key written as ``text`` (64 hex digits); raises ValueError saying ``where`` it was read."""
    try:
        key = bytes.fromhex(text) if isinstance(text, str) else b""
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise ValueError(f"{where}: a key is {2 * KEY_BYTES} hex digits ({KEY_BYTES} bytes)")
    return key


def read_key_file(path: str | os.PathLike[str], flag: str = "--key-file") -> bytes:
    """The key in a key file (64 hex digits); raises ValueError naming ``flag`` and the file."""
    try:
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror})") from None
    return parse_key(text, f"{flag} {path}")


class KeyRing:
    """Device keys by id: enrolled ids with their own keys, or (open mode) one shared key for any id."""

    def __init__(self, keys: Mapping[str, bytes], shared_key: bytes | None = None) -> None:
        for device_id, key in keys.items():
            _check_key(key, f"key of {device_id!r}")
        if shared_key is not None:
            _check_key(shared_key, "shared run key")
        self._keys = dict(keys)
        self.shared_key = shared_key

    def key_for(self, device_id: str) -> bytes | None:
        """The key of ``device_id``, or None when it is not enrolled (and the ring is not open)."""
        return self._keys.get(device_id, self.shared_key)

    def enrolled(self, device_id: str) -> bool:
        return self.key_for(device_id) is not None

    @property
    def device_ids(self) -> tuple[str, ...]:
        """Ids enrolled with their own key (open mode admits others besides)."""
        return tuple(self._keys)


def _check_key(key: object, what: str) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"{what} must be {KEY_BYTES} bytes")


class Verifier:
    """Accepts or refuses sealed messages; state: last counter per (device, direction), current nonces, and each
    sender's session as learnt from its freshest message.

    ``accepts`` names the directions this receiver takes: ``{UP, STATUS}`` on a server, ``{DOWN}`` on a
    device. ``state`` round-trips through JSON (see ``to_state``) so a restarted receiver keeps refusing.
    ``session``: this receiver's own session nonce (a device's, fresh per process start), which every message
    must name; None on a receiver that learns its senders' sessions instead (a server)."""

    def __init__(self, keys: KeyRing, accepts: Container[Direction], state: Mapping[str, object] | None = None, *,
                 session: str | None = None) -> None:
        self.keys = keys
        self.accepts = accepts
        self.session = session
        state = state or {}
        counters = state.get("counters", {})
        nonces = state.get("nonces", {})
        if not isinstance(counters, dict) or not isinstance(nonces, dict):
            raise ValueError("verifier state must hold 'counters' and 'nonces' objects")
        self._last: dict[str, int] = {k: v for k, v in counters.items() if is_counter(v)}
        self._nonce: dict[str, str] = {k: v for k, v in nonces.items() if isinstance(v, str)}
        self._closed: set[str] = {d for d in state.get("closed", []) if isinstance(d, str)}  # current connection ended
        sessions = state.get("sessions", {})
        self._sessions: dict[str, tuple[int, str]] = {  # sender -> (counter, session) of its freshest message
            d: (v[0], v[1]) for d, v in (sessions.items() if isinstance(sessions, dict) else ())
            if isinstance(v, list) and len(v) == 2 and is_counter(v[0]) and isinstance(v[1], str)}

    def last_counter(self, device_id: str, direction: Direction) -> int:
        """The last counter accepted from (device, direction); 0 when none was."""
        return self._last.get(_slot(device_id, direction), 0)

    def current_nonce(self, device_id: str) -> str | None:
        """The nonce of the device's current connection (its last accepted ``online``)."""
        return self._nonce.get(device_id)

    def session_of(self, device_id: str) -> str | None:
        """The session ``device_id`` named in its freshest accepted message (None before any)."""
        learnt = self._sessions.get(device_id)
        return None if learnt is None else learnt[1]

    def check(self, msg: Sealed, runs: Container[str] | None = None, *, status: str | None = None,
              nonce: str | None = None, session: str | None = None, commit: bool = True) -> Verdict:
        """Accept ``msg`` (and advance the state) or refuse it with a reason; nothing changes on refusal.

        ``runs``: the run ids acceptable for this message, None for any (a JOIN or a PLAN). Status frames
        pass their ``status`` (online/offline) and ``nonce``; every message passes the ``session`` its meta
        names (the caller reads these from the meta, which the tag covers). ``commit=False`` only says whether
        the message would be accepted now (a screen before it queues) and changes nothing."""
        key = self.keys.key_for(msg.device_id)
        if key is None:
            return Verdict(False, Refusal.UNKNOWN_DEVICE, f"device {msg.device_id!r} is not enrolled")
        if not tag_matches(key, msg.signed_digest, msg.tag):
            return Verdict(False, Refusal.BAD_TAG, f"tag does not verify under the key of {msg.device_id!r}")
        if msg.direction not in self.accepts:
            return Verdict(False, Refusal.WRONG_DIRECTION, f"direction {msg.direction.value!r} is not taken here")
        if runs is not None and msg.run_id not in runs:
            return Verdict(False, Refusal.WRONG_RUN, f"run {msg.run_id!r} is not this run")
        if not is_counter(msg.counter):
            return Verdict(False, Refusal.BAD_COUNTER, f"counter {msg.counter!r:.30} is not in 1..{MAX_COUNTER}")
        if msg.direction == Direction.STATUS and status == STATUS_OFFLINE:
            current = self._nonce.get(msg.device_id)
            if nonce is None or nonce != current:
                return Verdict(False, Refusal.STALE_CONNECTION,
                               f"offline of connection {str(nonce)[:8]}, current is {str(current)[:8]}")
            unbound = self._unbound(session)
            if unbound is not None or not commit:
                return unbound or ACCEPTED
            self._closed.add(msg.device_id)
            return ACCEPTED
        slot = _slot(msg.device_id, msg.direction)
        last = self._last.get(slot, 0)
        # the retained online of the open connection, handed to a new subscriber again: changes nothing
        repeat = (msg.direction == Direction.STATUS and msg.counter == last and nonce == self._nonce.get(msg.device_id)
                  and msg.device_id not in self._closed)
        if msg.counter <= last and not repeat:
            return Verdict(False, Refusal.REPLAY, f"counter {msg.counter} is not above the last accepted {last}")
        unbound = self._unbound(session)
        if unbound is not None or repeat or not commit:
            return unbound or ACCEPTED
        self._last[slot] = msg.counter
        if msg.direction == Direction.STATUS and nonce is not None:
            self._nonce[msg.device_id] = nonce
            self._closed.discard(msg.device_id)
        if self.session is None and session is not None and msg.counter > self._sessions.get(msg.device_id, (0,))[0]:
            self._sessions[msg.device_id] = (msg.counter, session)
        return ACCEPTED

    def _unbound(self, session: str | None) -> Verdict | None:
        """The refusal of a message that does not name this receiver's own session, or None."""
        if self.session is None or session == self.session:
            return None
        return Verdict(False, Refusal.STALE_SESSION, f"bound to session {str(session)[:8]}, this receiver's is "
                       f"{self.session[:8]} (sealed before it started)")

    def to_state(self) -> dict[str, object]:
        """The state as JSON-ready data, for ``Verifier(keys, accepts, state)``."""
        return {"counters": dict(self._last), "nonces": dict(self._nonce), "closed": sorted(self._closed),
                "sessions": {d: list(v) for d, v in self._sessions.items()}}

    def entry(self, device_id: str) -> dict[str, object]:
        """All the state holds of ``device_id``, as JSON-ready data: a journal line, which ``apply_entry`` puts in
        place of that device's part of a saved state."""
        counters = {d.value: self._last[_slot(device_id, d)] for d in Direction if _slot(device_id, d) in self._last}
        session = self._sessions.get(device_id)
        return {"device": device_id, "counters": counters, "nonce": self._nonce.get(device_id),
                "closed": device_id in self._closed, "session": None if session is None else list(session)}

    def senders(self) -> int:
        """How many senders the state holds anything of."""
        return len({slot.rsplit("/", 1)[0] for slot in self._last} | set(self._nonce) | set(self._sessions))


def _slot(device_id: str, direction: Direction) -> str:
    return f"{device_id}/{direction.value}"


# -- persistence (the thin shell: files under a state directory) ----------------------------------------------

EPOCH_FILE = "counter_epoch.json"
VERIFIER_FILE = "verifier_state.json"


def start_counters(state_dir: str | os.PathLike[str], now_unix: float | None = None) -> CounterSource:
    """The CounterSource of this process start; its epoch is on disk before this returns."""
    path = Path(state_dir) / EPOCH_FILE
    last = _read_json(path, {}).get("epoch")
    epoch = next_epoch(last if isinstance(last, int) else None, time.time() if now_unix is None else now_unix)
    write_json_atomic(path, {"epoch": epoch})
    return CounterSource(epoch)


JOURNAL_FILE = "verifier_state.journal"
COMPACT_MIN_LINES = 256
"""The journal is folded into a new snapshot once it holds more lines than this and than twice the senders."""


def apply_entry(state: dict[str, object], entry: object) -> None:
    """Put a journal line (``Verifier.entry``) in place of its device's part of ``state`` (``to_state``'s form)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("device"), str):
        raise ValueError("a journal line must be an object naming its 'device'")
    device_id = entry["device"]
    counters, nonces = state.setdefault("counters", {}), state.setdefault("nonces", {})
    closed, sessions = set(state.get("closed", [])), state.setdefault("sessions", {})
    assert isinstance(counters, dict) and isinstance(nonces, dict) and isinstance(sessions, dict)
    for direction, counter in dict(entry.get("counters") or {}).items():
        counters[f"{device_id}/{direction}"] = counter
    for table, value in ((nonces, entry.get("nonce")), (sessions, entry.get("session"))):
        if value is None:
            table.pop(device_id, None)
        else:
            table[device_id] = value
    (closed.add if entry.get("closed") else closed.discard)(device_id)
    state["closed"] = sorted(closed)


class VerifierStore:
    """A Verifier's state under ``state_dir``: a snapshot (``VERIFIER_FILE``, written atomically) and a journal of
    what changed since (``JOURNAL_FILE``: one line per accepted message, the sender's whole entry). An accept costs
    one short append, not a rewrite of every sender's counters (the server's largest cost at 100 devices); the
    journal is folded into the snapshot once it is longer than ``COMPACT_MIN_LINES`` and twice the senders (counted
    at the last load or fold, so an accept costs O(1)), so both stay bounded.

    Durability is group-committed: ``record`` appends, ``sync`` fsyncs what was appended since the last ``sync``.
    The owner calls ``sync`` before anything that depends on an accept leaves the process or lands on disk (Link
    does it before it seals a message; a server before it writes a checkpoint): an accept lost in a crash before
    that had no effect that survived the crash, so taking its message again after a restart is its first taking.
    A crash between the snapshot and the journal's truncation leaves entries the snapshot already holds: applying
    them again changes nothing. A torn last line (a crash mid-append) is ignored."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(state_dir)
        self._lines = 0
        self._limit = COMPACT_MIN_LINES  # lines before the next fold: set from the senders at each load and fold
        self._fd: int | None = None  # the journal, open for appends
        self._unsynced = False

    @property
    def journal(self) -> Path:
        return self.dir / JOURNAL_FILE

    def load(self) -> dict[str, object]:
        """The saved state (snapshot, then the journal's entries in order), or an empty one."""
        state = _read_json(self.dir / VERIFIER_FILE, {})
        try:
            lines = self.journal.read_bytes().split(b"\n")
        except FileNotFoundError:
            return state
        complete, torn = lines[:-1], lines[-1]  # a whole line ends with a newline; the rest was cut mid-append
        for number, line in enumerate(complete, 1):
            try:
                apply_entry(state, json.loads(line))
            except ValueError as exc:
                raise ValueError(f"{self.journal}: line {number} unreadable ({exc}); restore it from a backup or "
                                 "remove it and the snapshot beside it (counters then restart from the clock)") from None
        self._lines = len(complete) + bool(torn)
        self._limit = max(COMPACT_MIN_LINES, 2 * Verifier(KeyRing({}), (), state).senders())
        return state

    def record(self, verifier: Verifier, device_id: str) -> None:
        """Journal ``device_id``'s entry after an accept (durable at the next ``sync``); fold the journal into a
        snapshot when it is long."""
        if self._lines > self._limit:
            self.compact(verifier)
            return
        if self._fd is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            created = not self.journal.exists()
            self._fd = os.open(self.journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            if created:
                fsync_directory(self.dir)
        os.write(self._fd, json.dumps(verifier.entry(device_id), separators=(",", ":")).encode() + b"\n")
        self._unsynced = True
        self._lines += 1

    def sync(self) -> None:
        """Make every accept recorded so far durable (one fsync for all of them; nothing to do when none is new)."""
        if self._unsynced and self._fd is not None:
            os.fsync(self._fd)
        self._unsynced = False

    def compact(self, verifier: Verifier) -> None:
        """The whole state as the snapshot, then an empty journal (both durable)."""
        write_json_atomic(self.dir / VERIFIER_FILE, verifier.to_state())
        write_atomic(self.journal, b"", mode=0o600)
        self.close()
        self._lines = 0
        self._limit = max(COMPACT_MIN_LINES, 2 * verifier.senders())

    def close(self) -> None:
        """Sync and let go of the journal's file (the next ``record`` opens it again)."""
        self.sync()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def load_verifier_state(state_dir: str | os.PathLike[str]) -> dict[str, object]:
    """The Verifier state saved under ``state_dir``, or an empty one."""
    return VerifierStore(state_dir).load()


def save_verifier_state(state_dir: str | os.PathLike[str], verifier: Verifier) -> None:
    """The whole state as the snapshot under ``state_dir`` (and an empty journal)."""
    VerifierStore(state_dir).compact(verifier)


def _read_json(path: Path, default: dict[str, object]) -> dict[str, object]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return default
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable ({exc}); restore it from a backup or remove it (its counters then "
                         "restart from the clock)") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def write_json_atomic(path: Path, data: object) -> None:
    """Write ``data`` as JSON, atomically and readable by its owner only (keys and counters are secrets)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(data).encode(), mode=0o600)

