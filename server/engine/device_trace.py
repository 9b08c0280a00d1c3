"""A seeded model of a fleet's speeds and availability on a virtual clock: which devices are online when, and when a
device that starts some work finishes it. Pure: every answer is a function of the seed, the device id and the
virtual time asked about, never of the order the questions come in (each device draws from its own generator).

- Speed (``--device-speed lognormal:SIGMA``): a device's step takes the cost model's step time for its rank tier
  times its own factor exp(σ·z), z ~ N(0, 1) drawn once per device (median factor 1; σ = 1: the slowest of 50
  devices is ~10× the median, the fastest ~1/10).
- Availability (``--availability P,MEAN_S``): each device alternates online and away periods, exponentially
  distributed, online periods of mean MEAN_S and away periods of mean MEAN_S·(1 − P)/P, so it is online a
  fraction P of the time; it starts online with probability P (the stationary state; memoryless periods make the
  first one the same law). A device trains only while online: work paused by an away period resumes on return.
"""
from __future__ import annotations

import bisect
import hashlib
import math
from dataclasses import dataclass

import numpy as np

SPEED_KIND = "lognormal"


@dataclass(frozen=True)
class SpeedModel:
    """Per-device step-time factors exp(σ·z)."""

    sigma: float

    @classmethod
    def parse(cls, text: str) -> SpeedModel:
        """``lognormal:SIGMA`` (ValueError naming the flag otherwise)."""
        kind, _, value = text.partition(":")
        try:
            sigma = float(value)
        except ValueError:
            sigma = math.nan
        if kind != SPEED_KIND or not (math.isfinite(sigma) and sigma >= 0):
            raise ValueError(f"--device-speed wants {SPEED_KIND}:SIGMA with SIGMA >= 0 (e.g. lognormal:1), got {text!r}")
        return cls(sigma)


@dataclass(frozen=True)
class Availability:
    """Online a fraction ``fraction`` of the time, in online periods of mean ``mean_s`` virtual seconds."""

    fraction: float
    mean_s: float

    @classmethod
    def parse(cls, text: str) -> Availability:
        """``P,MEAN_S`` with 0 < P <= 1 and MEAN_S > 0 (ValueError naming the flag otherwise)."""
        parts = text.split(",")
        try:
            fraction, mean_s = (float(p) for p in parts)
        except ValueError:
            fraction = mean_s = math.nan
        if not (0 < fraction <= 1 and math.isfinite(mean_s) and mean_s > 0):
            raise ValueError(f"--availability wants P,MEAN_S with 0 < P <= 1 and MEAN_S > 0 seconds (e.g. 0.7,60), "
                             f"got {text!r}")
        return cls(fraction, mean_s)


def _device_key(device_id: str) -> int:
    return int.from_bytes(hashlib.sha256(device_id.encode()).digest()[:8], "big")


class _Periods:
    """One device's alternating online/away switch times, drawn lazily from its own generator."""

    def __init__(self, rng: np.random.Generator, availability: Availability):
        self.rng, self.availability = rng, availability
        self.starts_online = bool(rng.random() < availability.fraction)
        self.switches: list[float] = []  # times at which the state flips, increasing

    def _extend(self, until: float) -> None:
        a = self.availability
        away_mean = a.mean_s * (1 - a.fraction) / a.fraction
        while not self.switches or self.switches[-1] <= until:
            last = self.switches[-1] if self.switches else 0.0
            online_now = self.starts_online == (len(self.switches) % 2 == 0)
            self.switches.append(last + float(self.rng.exponential(a.mean_s if online_now else away_mean)))

    def online(self, t: float) -> bool:
        self._extend(t)
        flips = bisect.bisect_right(self.switches, t)
        return self.starts_online == (flips % 2 == 0)

    def next_switch(self, t: float) -> float:
        """The first switch time after ``t``."""
        self._extend(t)
        return self.switches[bisect.bisect_right(self.switches, t)]


class DeviceTrace:
    """Speeds and availability of a fleet for one seed (see the module docstring). No speed model: every factor
    is 1; no availability: every device is always online."""

    def __init__(self, seed: int, speed: SpeedModel | None = None, availability: Availability | None = None):
        self.seed, self.speed, self.availability = seed, speed, availability
        self._factors: dict[str, float] = {}
        self._periods: dict[str, _Periods] = {}

    def factor(self, device_id: str) -> float:
        """The device's step-time factor (1: as fast as the cost model's reference device)."""
        if self.speed is None:
            return 1.0
        if device_id not in self._factors:
            z = np.random.default_rng([self.seed, 1, _device_key(device_id)]).standard_normal()
            self._factors[device_id] = float(math.exp(self.speed.sigma * z))
        return self._factors[device_id]

    def _of(self, device_id: str) -> _Periods | None:
        if self.availability is None or self.availability.fraction >= 1:
            return None
        if device_id not in self._periods:
            rng = np.random.default_rng([self.seed, 2, _device_key(device_id)])
            self._periods[device_id] = _Periods(rng, self.availability)
        return self._periods[device_id]

    def online(self, device_id: str, t: float) -> bool:
        """Whether the device is online at virtual time ``t``."""
        periods = self._of(device_id)
        return True if periods is None else periods.online(t)

    def next_online(self, device_id: str, t: float) -> float:
        """The first time at or after ``t`` the device is online."""
        periods = self._of(device_id)
        if periods is None or periods.online(t):
            return t
        return periods.next_switch(t)

    def finish(self, device_id: str, start: float, work_s: float) -> float:
        """When ``work_s`` seconds of the device's online time, started at ``start``, are done (work pauses while
        it is away)."""
        if work_s < 0:
            raise ValueError(f"work must be >= 0 seconds, got {work_s}")
        periods = self._of(device_id)
        if periods is None:
            return start + work_s
        t, left = self.next_online(device_id, start), work_s
        while True:
            end = periods.next_switch(t)  # the end of this online period
            if t + left <= end:
                return t + left
            left -= end - t
            t = periods.next_switch(end)  # back online
