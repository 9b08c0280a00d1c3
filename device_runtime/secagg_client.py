"""A device's side of SecAgg+ (Bell, Bonawitz, Gascón, Lepoint, Raykova, CCS 2020; semi-honest setting) for one
round, as a state machine without I/O: four exchanges through a server that relays what it cannot read.

1. ``advertise``: two fresh X25519 public keys, c (to encrypt shares) and s (to agree pairwise masks).
2. ``share_keys``: given its neighbours' keys, Shamir shares (threshold t) of its mask key s_sk and of a fresh
   self-mask seed b, one per neighbour, each sealed with AES-GCM under the key agreed with that neighbour's c key,
   and one it keeps (the sharer holds a share of its own secrets, as in classic SecAgg: a survivor's seed is
   rebuilt from itself and t − 1 surviving neighbours).
3. ``masked_input``: given the sealed shares addressed to it (their senders are its neighbours that shared), its
   integers x plus PRG(b) plus ±PRG(agree(s_sk, s_pk_v)) for each such neighbour v (+ when its id sorts first),
   all in Z_{2^b}: the server sees a uniformly random vector.
4. ``unmask``: given the survivors (those whose masked input arrived), for each neighbour that shared and for
   itself: the share of its self-mask seed if it survived, of its mask key if it dropped, never both for one
   device; only once,
   and only when at least ``min_survivors`` survive (what the DP noise of the sum is sized for).

A step out of order, a neighbourhood below the threshold, a share sealed for another device or another round is
refused with ``SecAggRefusal`` and reveals nothing.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from device_runtime.dense_delta import dimension, reconstruct
from device_runtime.secagg_crypto import (CryptoError, KeyPair, MaskStream, agree, mask, open_sealed, random_seed,
                                          seal)
from device_runtime.secagg_graph import neighbours
from device_runtime.secagg_noise import skellam
from device_runtime.secagg_quantize import Quantizer
from device_runtime.secagg_shamir import ShamirError, share_from_bytes, share_to_bytes, split
from device_runtime.task import Task, Update

MASK_KEY, SELF_SEED = "mask_key", "self_seed"
"""What an unmasking share opens: a dropped device's mask key, or a survivor's self-mask seed."""


class SecAggRefusal(ValueError):
    """A step this device will not take (the reason says why); nothing of its secrets leaves it."""


@dataclass(frozen=True)
class SecureSpec:
    """What a secure round tells each participant: who takes part, the graph and threshold, the integers' modulus
    and scale, the clip, the DP noise (μ per device; 0 without DP), the shared model's dense shapes and this
    device's weight (its sample share p_i; 1 under DP, where the server divides by the expected count)."""

    context: bytes
    participants: tuple[str, ...]
    neighbors: int
    threshold: int
    min_survivors: int
    graph_seed: bytes
    quantizer: Quantizer
    clip: float
    l2: bool
    noise_mu: float
    dense_shapes: dict[str, tuple[int, ...]]
    weight: float = 1.0

    def for_device(self, weight: float) -> SecureSpec:
        return replace(self, weight=weight)

    def graph(self) -> dict[str, tuple[str, ...]]:
        return neighbours(self.participants, self.neighbors, self.graph_seed)

    def holder(self, device_id: str) -> int:
        """A device's Shamir x-coordinate: its place among the participants, from 1."""
        return self.participants.index(device_id) + 1


@dataclass(frozen=True)
class AdvertisedKeys:
    encryption: bytes
    masking: bytes


def mask_sign(device_id: str, peer: str) -> int:
    """+1 when ``device_id`` sorts before ``peer``: the pair's masks cancel in the sum."""
    return 1 if device_id < peer else -1


def pairwise_mask(private: bytes, peer_public: bytes, spec: SecureSpec, size: int) -> np.ndarray:
    """The mask two devices agree (its sign: ``mask_sign``); the server rebuilds it for a dropped device."""
    return mask(agree(private, peer_public, "mask", spec.context), size, spec.quantizer.bits)


def share_context(spec: SecureSpec, sender: str, recipient: str) -> bytes:
    """What a sealed share is bound to: the round, its sender and its recipient (AES-GCM's associated data)."""
    return spec.context + b"|" + sender.encode() + b">" + recipient.encode()


CHUNK = 1 << 16
"""Values handled at once where a whole vector's temporaries would raise the device's peak memory."""
CHUNK_TEMPORARIES = 8
"""Arrays of CHUNK 8-byte values alive at once in a chunk's step (rounding: scaled, floor, uniform draws, the
comparison, the sum, the integers; noise: two Poisson draws; masking: the piece, the mask, the sum)."""


def secure_step_bytes(dense_shapes: dict[str, tuple[int, ...]]) -> int:
    """An upper bound on what a device's secure step (``secure_input``, then ``masked_input``) allocates beyond
    what it held, d the shared model's size and L its largest tensor, 8-byte values: while a tensor is rebuilt, the
    float64 Δ (d) with that tensor's two reconstructions and their difference (3L); while rounding, Δ and the
    integers (2d); while masking, the integers and their masked copy (2d); each with one chunk's temporaries.
    The rank assignment adds it to a tier's need under --secure-aggregation (``server.run_setup.predictor_for``)."""
    d = dimension(dense_shapes)
    largest = max(math.prod(shape) for shape in dense_shapes.values())
    return 8 * (max(d + 3 * largest, 2 * d) + CHUNK_TEMPORARIES * CHUNK)


def secure_input(returned: dict[str, np.ndarray], sent: dict[str, np.ndarray], spec: SecureSpec,
                 rng: np.random.Generator) -> np.ndarray:
    """The integers a device masks: Δ at full rank (``dense_delta``; one tensor at a time), clipped (L2 to C under
    DP, else each coordinate to ±R), times its weight, stochastically rounded into Z_{2^b}, plus its share of the
    Skellam noise (under DP). Memory: the float64 Δ and the result, each d values, beyond one tensor's."""
    keys = sorted(spec.dense_shapes)
    delta = np.empty(dimension(spec.dense_shapes), dtype=np.float64)
    at, used = 0, set()
    for key in keys:  # the same layout as dense_delta.change, without both models whole at once
        only = {key: spec.dense_shapes[key]}
        used |= set(_tensors_of(returned, key))
        after = reconstruct(_tensors_of(returned, key), only)[key]
        before = reconstruct(_tensors_of(sent, key), only)[key]
        delta[at:at + after.size] = (after - before).ravel()
        at += after.size
    if set(returned) - used:
        raise ValueError(f"the update has tensors the shared model does not: {sorted(set(returned) - used)[:5]}")
    if spec.l2:
        norm = float(np.linalg.norm(delta))
        delta *= spec.weight * (1.0 if norm <= spec.clip else spec.clip / norm)
    else:
        np.clip(delta, -spec.clip, spec.clip, out=delta)
        delta *= spec.weight
    q, x = spec.quantizer, np.empty(delta.size, dtype=np.uint64)
    for start in range(0, delta.size, CHUNK):
        part = delta[start:start + CHUNK]
        x[start:start + CHUNK] = q.add(q.encode(part, rng), q.wrap(skellam(spec.noise_mu, part.size, rng)))
    return x


def _tensors_of(tensors: dict[str, np.ndarray], key: str) -> dict[str, np.ndarray]:
    """The tensors that make shared tensor ``key``: itself, or its layer's two factors."""
    if key in tensors:
        return {key: tensors[key]}
    layer = key.rsplit(".", 1)[0]
    return {name: tensors[name] for name in (layer + ".u", layer + ".v") if name in tensors}


@dataclass
class SecAggClient:
    """One device's state in one secure round (see the module docstring)."""

    device_id: str
    spec: SecureSpec
    step: str = "advertise"
    _c: KeyPair = field(default_factory=KeyPair.generate)
    _s: KeyPair = field(default_factory=KeyPair.generate)
    _b: bytes = field(default_factory=random_seed)
    _neighbour_keys: dict[str, AdvertisedKeys] = field(default_factory=dict)
    _held: dict[str, tuple[int, int]] = field(default_factory=dict)  # sender -> (its mask key's, its seed's share)
    _own: tuple[int, int] = (0, 0)  # this device's shares of its own two secrets

    def __post_init__(self) -> None:
        if self.device_id not in self.spec.participants:
            raise SecAggRefusal(f"{self.device_id} is not a participant of this secure round")
        self.mine = self.spec.graph()[self.device_id]

    def _expect(self, step: str) -> None:
        if self.step != step:
            raise SecAggRefusal(f"{step}: out of order, this device is at {self.step}")

    def advertise(self) -> AdvertisedKeys:
        self._expect("advertise")
        self.step = "share_keys"
        return AdvertisedKeys(self._c.public, self._s.public)

    def share_keys(self, keys: Mapping[str, AdvertisedKeys]) -> dict[str, bytes]:
        """Sealed shares for the neighbours that advertised keys (their keys as the server relayed them)."""
        self._expect("share_keys")
        strangers = sorted(set(keys) - set(self.mine))
        if strangers:
            raise SecAggRefusal(f"keys of {strangers[:3]}, who are not this device's neighbours")
        if len(keys) + 1 < self.spec.threshold:
            raise SecAggRefusal(f"{len(keys)} neighbour(s) advertised keys: with this device, below the threshold "
                                f"{self.spec.threshold}")
        self._neighbour_keys = dict(keys)
        holders = {self.spec.holder(v): v for v in [*keys, self.device_id]}
        mask_shares = split(self._s.private, holders, self.spec.threshold)
        seed_shares = split(self._b, holders, self.spec.threshold)
        mine = self.spec.holder(self.device_id)
        self._own = (mask_shares[mine], seed_shares[mine])
        self.step = "masked_input"
        return {v: seal(agree(self._c.private, keys[v].encryption, "share", self.spec.context),
                        share_to_bytes(mask_shares[x]) + share_to_bytes(seed_shares[x]),
                        share_context(self.spec, self.device_id, v))
                for x, v in holders.items() if v != self.device_id}

    def masked_input(self, x: np.ndarray, shares: Mapping[str, bytes]) -> np.ndarray:
        """x masked, given the sealed shares addressed to this device (their senders: the neighbours it masks with)."""
        self._expect("masked_input")
        unknown = sorted(set(shares) - set(self._neighbour_keys))
        if unknown:
            raise SecAggRefusal(f"shares from {unknown[:3]}, who did not advertise keys to this device")
        if len(shares) + 1 < self.spec.threshold:
            raise SecAggRefusal(f"{len(shares)} neighbour(s) shared: with this device, below the threshold "
                                f"{self.spec.threshold}")
        held = {}
        for sender, sealed in shares.items():
            key = agree(self._c.private, self._neighbour_keys[sender].encryption, "share", self.spec.context)
            try:
                plain = open_sealed(key, sealed, share_context(self.spec, sender, self.device_id))
                held[sender] = (share_from_bytes(plain[:len(plain) // 2]), share_from_bytes(plain[len(plain) // 2:]))
            except (CryptoError, ShamirError) as exc:
                raise SecAggRefusal(f"the share from {sender} does not open: {exc}") from None
        q = self.spec.quantizer
        streams = [(1, MaskStream(self._b, q.bits))] + [
            (mask_sign(self.device_id, v), MaskStream(agree(self._s.private, self._neighbour_keys[v].masking, "mask",
                                                            self.spec.context), q.bits)) for v in sorted(held)]
        self._held = dict(held, **{self.device_id: self._own})
        y = np.array(x, dtype=np.uint64)
        for start in range(0, y.size, CHUNK):  # every mask in pieces: no whole mask is ever held
            part = y[start:start + CHUNK]
            for sign, stream in streams:
                m = stream.take(part.size)
                part = q.add(part, m) if sign > 0 else q.subtract(part, m)
            y[start:start + CHUNK] = part
        self.step = "unmask"
        return y

    def unmask(self, survivors: Iterable[str]) -> dict[str, tuple[str, int]]:
        """For each neighbour that shared, and for itself: (what the share opens, the share)."""
        self._expect("unmask")
        alive = set(survivors)
        if self.device_id not in alive:
            raise SecAggRefusal("this device is not among the survivors named: its masked input counts for nothing")
        if not alive <= set(self.spec.participants):
            raise SecAggRefusal(f"survivors {sorted(alive - set(self.spec.participants))[:3]} are not participants")
        if len(alive) < self.spec.min_survivors:
            raise SecAggRefusal(f"{len(alive)} survivor(s), below the {self.spec.min_survivors} the round needs")
        self.step = "done"  # once: a second list of survivors could ask for both shares of one neighbour
        return {v: (SELF_SEED, seed) if v in alive else (MASK_KEY, key) for v, (key, seed) in self._held.items()}


def secure_answer(update: Update, task: Task, rng: np.random.Generator) -> tuple[Update, np.ndarray]:
    """A trained update split for a secure round: the update without its tensors (what the server may read: sample
    count, loss, metrics) and the integers to mask (``secure_input`` of what it returned against what it was sent)."""
    x = secure_input(update.weights, task.weights, task.secure, rng)
    return replace(update, weights={}), x
