"""SecAgg+'s exchanges as protocol messages (protocol 5): what a secure round's devices and server say to each other
over the transport, inside the sealed, session-bound envelopes every message travels in (numpy and stdlib only).

One message type, SECAGG, either way; its ``phase`` says which exchange (``device_runtime.secagg_client`` has the
protocol):

- ``keys`` up: the device's two X25519 public keys (blobs ``c``, ``s``); down: its neighbours' that advertised
  (blobs ``<id>.c``, ``<id>.s``).
- ``shares`` up: one AES-GCM-sealed share pair per neighbour (blob ``<recipient id>``); down: the sealed pairs
  addressed to the device (blob ``<sender id>``). The server relays what it cannot open.
- ``unmask`` down: the survivors (``meta.survivors``); up: one Shamir share per neighbour that shared (blob
  ``<neighbour id>``), what it opens in ``meta.kinds`` (``self_seed`` for a survivor, ``mask_key`` for a dropped one).

The masked input travels in the device's UPDATE (blob ``masked``: d integers, little-endian, 4 bytes each for
b = 32), so the round's answer is one message as before. Every parser checks sizes against what the round's
parameters allow before anything is kept: a key is 32 bytes, a sealed pair SEALED_SHARE_BYTES, a share
SHARE_BYTES, a masked input d·4 bytes, at most one entry per neighbour.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from device_runtime.envelope import Message, MessageType
from device_runtime.messages import MessageError, new_msg_id
from device_runtime.protocol import is_id
from device_runtime.secagg_client import MASK_KEY, SELF_SEED, AdvertisedKeys
from device_runtime.secagg_crypto import KEY_BYTES, NONCE_BYTES
from device_runtime.secagg_shamir import SHARE_BYTES, share_to_bytes

KEYS, SHARES, UNMASK = "keys", "shares", "unmask"
PHASES = (KEYS, SHARES, UNMASK)
MASKED_BLOB = "masked"
GCM_TAG_BYTES = 16
SEALED_SHARE_BYTES = NONCE_BYTES + 2 * SHARE_BYTES + GCM_TAG_BYTES
"""A sealed share pair: nonce, the mask key's and the seed's shares, AES-GCM's tag."""
_KEY_NAMES = ("c", "s")


def phase_of(msg: Message) -> str:
    """The exchange a SECAGG message belongs to; MessageError if it is none."""
    if msg.type != MessageType.SECAGG:
        raise MessageError(f"expected a secagg message, got {MessageType(msg.type).value}")
    phase = msg.meta.get("phase")
    if phase not in PHASES:
        raise MessageError(f"secagg phase must be one of {list(PHASES)}, got {phase!r:.40}")
    return phase


def _message(phase: str, device_id: str, run_id: str, round_index: int, blobs: dict[str, bytes],
             **meta: object) -> Message:
    return Message(MessageType.SECAGG, run_id, round_index, device_id, new_msg_id(MessageType.SECAGG),
                   {"phase": phase, **meta}, blobs=blobs)


def _ids(names: Iterable[str], allowed: Iterable[str], what: str) -> None:
    strangers = sorted(set(names) - set(allowed))
    if strangers:
        raise MessageError(f"{what} for {strangers[:3]}, not this round's neighbours")


def _sized(blobs: Mapping[str, bytes], size: int, what: str) -> None:
    wrong = sorted(name for name, data in blobs.items() if len(data) != size)
    if wrong:
        raise MessageError(f"{what} {wrong[:3]}: not {size} bytes")


# -- keys ---------------------------------------------------------------------------------------


def keys_message(keys: AdvertisedKeys, *, device_id: str, run_id: str, round_index: int) -> Message:
    """A device advertises its two public keys."""
    return _message(KEYS, device_id, run_id, round_index, {"c": keys.encryption, "s": keys.masking})


def parse_keys(msg: Message) -> AdvertisedKeys:
    if phase_of(msg) != KEYS or set(msg.blobs) != set(_KEY_NAMES):
        raise MessageError("advertised keys must be exactly blobs 'c' and 's'")
    _sized(msg.blobs, KEY_BYTES, "key")
    return AdvertisedKeys(msg.blobs["c"], msg.blobs["s"])


def neighbour_keys_message(keys: Mapping[str, AdvertisedKeys], *, device_id: str, run_id: str,
                           round_index: int) -> Message:
    """The server relays a device's neighbours' advertised keys."""
    blobs = {}
    for v, k in sorted(keys.items()):
        blobs[f"{v}.c"], blobs[f"{v}.s"] = k.encryption, k.masking
    return _message(KEYS, device_id, run_id, round_index, blobs)


def parse_neighbour_keys(msg: Message, neighbours: Iterable[str]) -> dict[str, AdvertisedKeys]:
    """A device's neighbours' keys, only of ``neighbours`` (its own in the round's graph)."""
    if phase_of(msg) != KEYS:
        raise MessageError("expected neighbours' keys")
    _sized(msg.blobs, KEY_BYTES, "key")
    split = [name.rsplit(".", 1) for name in msg.blobs]
    if any(len(p) != 2 or p[1] not in _KEY_NAMES for p in split):
        raise MessageError("neighbours' keys must be blobs '<id>.c' and '<id>.s'")
    ids = {p[0] for p in split}
    _ids(ids, neighbours, "keys")
    if len(msg.blobs) != 2 * len(ids):
        raise MessageError("each neighbour's keys must be both 'c' and 's'")
    return {v: AdvertisedKeys(msg.blobs[f"{v}.c"], msg.blobs[f"{v}.s"]) for v in sorted(ids)}


# -- shares -------------------------------------------------------------------------------------


def shares_message(sealed: Mapping[str, bytes], *, device_id: str, run_id: str, round_index: int) -> Message:
    """Sealed share pairs, by recipient (up) or by sender (down: the server relays them)."""
    return _message(SHARES, device_id, run_id, round_index, dict(sorted(sealed.items())))


def parse_shares(msg: Message, neighbours: Iterable[str]) -> dict[str, bytes]:
    """Sealed share pairs of (up: to; down: from) ``neighbours`` only, each SEALED_SHARE_BYTES."""
    if phase_of(msg) != SHARES or not all(is_id(v) for v in msg.blobs):
        raise MessageError("shares must be blobs named by device ids")
    _ids(msg.blobs, neighbours, "shares")
    _sized(msg.blobs, SEALED_SHARE_BYTES, "sealed share")
    return dict(msg.blobs)


# -- unmasking ----------------------------------------------------------------------------------


def survivors_message(survivors: Iterable[str], *, device_id: str, run_id: str, round_index: int) -> Message:
    """The server names the survivors (whose masked input it took) and asks for the unmasking shares."""
    return _message(UNMASK, device_id, run_id, round_index, {}, survivors=sorted(survivors))


def parse_survivors(msg: Message, participants: Iterable[str]) -> tuple[str, ...]:
    survivors = msg.meta.get("survivors")
    allowed = set(participants)
    if (phase_of(msg) != UNMASK or not isinstance(survivors, list) or len(survivors) > len(allowed)
            or not all(isinstance(v, str) and v in allowed for v in survivors)):
        raise MessageError("survivors must be a list of this round's participants")
    return tuple(survivors)


def unmasking_message(reveals: Mapping[str, tuple[str, int]], *, device_id: str, run_id: str,
                      round_index: int) -> Message:
    """A survivor's unmasking shares: per neighbour that shared, (what it opens, the share)."""
    return _message(UNMASK, device_id, run_id, round_index,
                    {v: share_to_bytes(share) for v, (_, share) in sorted(reveals.items())},
                    kinds={v: kind for v, (kind, _) in sorted(reveals.items())})


def parse_unmasking(msg: Message, neighbours: Iterable[str]) -> dict[str, tuple[str, int]]:
    kinds = msg.meta.get("kinds")
    if phase_of(msg) != UNMASK or not isinstance(kinds, dict) or set(kinds) != set(msg.blobs):
        raise MessageError("unmasking shares must be blobs named by device ids, with their kinds")
    if any(k not in (MASK_KEY, SELF_SEED) for k in kinds.values()):
        raise MessageError(f"an unmasking share opens {MASK_KEY} or {SELF_SEED}")
    _ids(msg.blobs, neighbours, "unmasking shares")
    _sized(msg.blobs, SHARE_BYTES, "unmasking share")
    return {v: (kinds[v], int.from_bytes(data, "big")) for v, data in msg.blobs.items()}


# -- the masked input ---------------------------------------------------------------------------


def _dtype(bits: int) -> np.dtype:
    return np.dtype("<u4" if bits <= 32 else "<u8")


def masked_blob(y: np.ndarray, bits: int) -> bytes:
    """A masked input (integers below 2^bits) as the UPDATE's ``masked`` blob."""
    return np.asarray(y, dtype=np.uint64).astype(_dtype(bits)).tobytes()


def masked_of(msg: Message, dimension: int, bits: int) -> np.ndarray:
    """The masked input an UPDATE carries: exactly ``dimension`` integers of ``bits`` bits (uint64)."""
    data = msg.blobs.get(MASKED_BLOB)
    dtype = _dtype(bits)
    if data is None or set(msg.blobs) != {MASKED_BLOB} or msg.tensors:
        raise MessageError("a secure round's update carries its masked input (blob 'masked') and no tensor")
    if len(data) != dimension * dtype.itemsize:
        raise MessageError(f"masked input of {len(data)} bytes, not {dimension} integers of {dtype.itemsize} bytes")
    return np.frombuffer(data, dtype=dtype).astype(np.uint64)
