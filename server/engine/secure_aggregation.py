"""The server's side of SecAgg+ (``device_runtime.secagg_client`` is the device's) for one round, as a state
machine without I/O: it relays what it cannot read, learns who survived, and from the survivors' unmasking shares
removes the masks, obtaining the sum of the survivors' integers and nothing else.

Phases, each closed by the driver (every device answered, or its deadline): ``keys`` (U1: who advertised),
``shares`` (U2: who sent shares; each device gets the sealed shares addressed to it), ``masked`` (U3: whose masked
input arrived: the survivors), ``unmask`` (each survivor's shares: a survivor's self-mask seed, a dropped device's
mask key), then ``done`` or ``failed``. A device holds one share of its own secrets besides its neighbours' (k + 1
holders). Before it asks anyone to unmask, the server checks that every secret it will need can be rebuilt (each
device of U2 has at least t of its holders in U3) and that at least ``min_survivors`` survive;
otherwise the round fails there and no share is revealed (the sum is not aggregated: said in one line). A message for
a phase that has closed, from a device outside the phase's set, or a second one, is refused with its reason and
changes nothing: in particular a masked input that arrives after the unmasking began (its mask key may have been
revealed) never counts.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from device_runtime.secagg_client import (MASK_KEY, SELF_SEED, AdvertisedKeys, SecureSpec, mask_sign,
                                          pairwise_mask)
from device_runtime.secagg_crypto import KEY_BYTES, CryptoError, KeyPair, mask
from device_runtime.secagg_shamir import SHARE_BYTES, ShamirError, recover

PHASES = ("keys", "shares", "masked", "unmask")


@dataclass
class PhaseCost:
    """Bytes the server took in and sent out in a phase, and its wall time."""

    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0


@dataclass
class SecAggServer:
    """One secure round's relay and unmasking (see the module docstring)."""

    spec: SecureSpec
    dimension: int
    phase: str = "keys"
    failure: str | None = None
    keys: dict[str, AdvertisedKeys] = field(default_factory=dict)
    sealed: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sender -> recipient -> sealed share
    masked: dict[str, np.ndarray] = field(default_factory=dict)
    revealed: dict[str, dict[str, tuple[str, int]]] = field(default_factory=dict)  # holder -> about -> share
    costs: dict[str, PhaseCost] = field(default_factory=lambda: {p: PhaseCost() for p in PHASES})
    recovered: tuple[str, ...] = ()
    _opened_at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.graph = self.spec.graph()

    @property
    def masked_bytes(self) -> int:
        """A masked input's size: d integers of b bits."""
        return self.dimension * self.spec.quantizer.bits // 8

    # -- what came in ---------------------------------------------------------------------------

    def _refuse(self, phase: str, device_id: str, members: Any, seen: Mapping[str, Any]) -> str | None:
        if self.phase != phase:
            return f"{phase} from {device_id}: that phase is {'not open yet' if PHASES.index(phase) > PHASES.index(self.phase) else 'closed'} (the round is at {self.phase})"
        if device_id not in members:
            return f"{phase} from {device_id}, who is not in this phase of the secure round"
        if device_id in seen:
            return f"a second {phase} from {device_id}"
        return None

    def receive_keys(self, device_id: str, keys: AdvertisedKeys) -> str | None:
        """A device's advertised keys; returns why they do not count, or None."""
        problem = self._refuse("keys", device_id, self.spec.participants, self.keys)
        if problem is None and not (len(keys.encryption) == len(keys.masking) == KEY_BYTES):
            problem = f"keys from {device_id} are not two {KEY_BYTES}-byte X25519 public keys"
        if problem is None:
            self.keys[device_id] = keys
            self.costs["keys"].bytes_in += 2 * KEY_BYTES
        return problem

    def close_keys(self, now: float) -> dict[str, dict[str, AdvertisedKeys]]:
        """U1 is who advertised: each of them gets its neighbours' keys (those that advertised)."""
        self._close("keys", now)
        out = {u: {v: self.keys[v] for v in self.graph[u] if v in self.keys} for u in self.keys}
        self.costs["keys"].bytes_out += sum(2 * KEY_BYTES * len(k) for k in out.values())
        return out

    def receive_shares(self, device_id: str, shares: Mapping[str, bytes]) -> str | None:
        """A device's sealed shares, one per neighbour that advertised; returns why they do not count, or None."""
        problem = self._refuse("shares", device_id, self.keys, self.sealed)
        expected = {v for v in self.graph.get(device_id, ()) if v in self.keys}
        if problem is None and set(shares) != expected:
            problem = (f"shares from {device_id} for {sorted(shares)[:4]}, not its neighbours that advertised "
                       f"({sorted(expected)[:4]})")
        if problem is None:
            self.sealed[device_id] = dict(shares)
            self.costs["shares"].bytes_in += sum(len(s) for s in shares.values())
        return problem

    def close_shares(self, now: float) -> dict[str, dict[str, bytes]]:
        """U2 is who shared: each of them gets the sealed shares addressed to it (sender -> bytes)."""
        self._close("shares", now)
        out = {u: {v: self.sealed[v][u] for v in self.sealed if u in self.sealed[v]} for u in self.sealed}
        self.costs["shares"].bytes_out += sum(len(s) for m in out.values() for s in m.values())
        return out

    def receive_masked(self, device_id: str, y: np.ndarray) -> str | None:
        """A device's masked input; returns why it does not count, or None."""
        problem = self._refuse("masked", device_id, self.sealed, self.masked)
        if problem is None and (not isinstance(y, np.ndarray) or y.dtype != np.uint64 or y.shape != (self.dimension,)
                                or bool((y >= np.uint64(self.spec.quantizer.modulus)).any())):
            problem = f"the masked input of {device_id} is not {self.dimension} integers below 2^{self.spec.quantizer.bits}"
        if problem is None:
            self.masked[device_id] = y
            self.costs["masked"].bytes_in += self.masked_bytes
        return problem

    def close_masked(self, now: float) -> tuple[str, ...]:
        """U3 is whose masked input arrived: the survivors every survivor is asked to unmask for; () when the round
        cannot be unmasked (``failure`` says why, and nobody is asked for a share)."""
        self._close("masked", now)
        survivors = tuple(sorted(self.masked))
        t = self.spec.threshold
        short = [v for v in sorted(self.sealed) if sum(u in self.masked for u in self.holders(v)) < t]
        if len(survivors) < self.spec.min_survivors:
            self.failure = (f"{len(survivors)} of {len(self.spec.participants)} devices survived, below the "
                            f"{self.spec.min_survivors} the round needs")
        elif short:
            self.failure = (f"{len(short)} device(s) ({', '.join(short[:3])}) have fewer than t = {t} surviving "
                            "holders (neighbours and itself): their secrets cannot be rebuilt")
        if self.failure is not None:
            self.phase = "failed"
            return ()
        self.costs["unmask"].bytes_out += len(survivors) * sum(len(d) + 1 for d in survivors)
        return survivors

    def receive_unmasking(self, device_id: str, reveals: Mapping[str, tuple[str, int]]) -> str | None:
        """A survivor's shares: for each neighbour that shared and itself, a seed's share (survivor) or mask key's
        (dropped)."""
        problem = self._refuse("unmask", device_id, self.masked, self.revealed)
        if problem is None:
            expected = {v for v in self.holders(device_id) if v in self.sealed}
            if set(reveals) != expected:
                problem = f"unmasking shares from {device_id} about {sorted(reveals)[:4]}, not {sorted(expected)[:4]}"
            elif any(kind != (SELF_SEED if v in self.masked else MASK_KEY) for v, (kind, _) in reveals.items()):
                problem = f"unmasking shares from {device_id} of the wrong kind (a seed for a dropped device or a key for a survivor)"
        if problem is None:
            self.revealed[device_id] = dict(reveals)
            self.costs["unmask"].bytes_in += len(reveals) * SHARE_BYTES
        return problem

    # -- the sum --------------------------------------------------------------------------------

    def finish(self, now: float) -> np.ndarray | None:
        """The sum of the survivors' integers mod 2^b, or None (``failure`` says why)."""
        if self.phase == "failed":
            return None
        self._close("unmask", now)
        q, d, t = self.spec.quantizer, self.dimension, self.spec.threshold
        try:
            seeds = {u: recover(self._shares_about(u, SELF_SEED), t) for u in self.masked}
            keys = {v: KeyPair.of_private(recover(self._shares_about(v, MASK_KEY), t))
                    for v in self.sealed if v not in self.masked}
        except (ShamirError, CryptoError) as exc:
            self.phase, self.failure = "failed", f"unmasking failed: {exc}"
            return None
        total = np.zeros(d, dtype=np.uint64)
        for u in sorted(self.masked):
            total = q.subtract(q.add(total, self.masked[u]), mask(seeds[u], d, q.bits))
        for v, pair in sorted(keys.items()):  # a dropped device's masks left in its surviving neighbours' inputs
            for u in self.graph[v]:
                if u in self.masked:
                    m = pairwise_mask(pair.private, self.keys[u].masking, self.spec, d)
                    total = q.subtract(total, m) if mask_sign(u, v) > 0 else q.add(total, m)
        self.recovered = tuple(sorted(keys))
        self.phase = "done"
        return total

    def holders(self, device_id: str) -> tuple[str, ...]:
        """Who holds shares of a device's secrets: its neighbours and itself (the graph is symmetric, so these are
        also the devices whose shares it holds)."""
        return (*self.graph[device_id], device_id)

    def _shares_about(self, device_id: str, kind: str) -> dict[int, int]:
        return {self.spec.holder(holder): share for holder, about in self.revealed.items()
                for v, (k, share) in about.items() if v == device_id and k == kind}

    def _close(self, phase: str, now: float) -> None:
        if self.phase != phase:
            raise ValueError(f"cannot close {phase}: the secure round is at {self.phase}")
        self.costs[phase].seconds = max(0.0, now - self._opened_at)
        self._opened_at = now
        self.phase = PHASES[PHASES.index(phase) + 1] if phase != "unmask" else "done"

    def summary(self) -> dict[str, Any]:
        """The metrics row's ``secagg`` object."""
        return {"participants": len(self.spec.participants), "dimension": self.dimension, "survivors": len(self.masked),
                "dropped": len(set(self.sealed) - set(self.masked)), "recovered": len(self.recovered),
                "threshold": self.spec.threshold, "neighbors": self.spec.neighbors,
                "aggregated": self.phase == "done", "failure": self.failure, "bits": self.spec.quantizer.bits,
                "phases": {p: {"bytes_in": c.bytes_in, "bytes_out": c.bytes_out, "seconds": round(c.seconds, 6)}
                           for p, c in self.costs.items()}}
