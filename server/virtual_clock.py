"""The simulator's virtual clock: how long a device's task takes (the cost model's step time at its tier, times
its speed factor from the device trace, times the task's steps), and when it ends given when the device is away.
Both modes of ``server.simulate`` run on it, on the same trace for the same flags and seed."""
from __future__ import annotations

import math
from dataclasses import dataclass

from device_runtime.task import Task
from server.engine.cost_model import CostModelError, predict
from server.engine.device_trace import Availability, DeviceTrace, SpeedModel

REFERENCE_PROBE_GFLOPS = 50.0
"""The reference device a trace's factor 1 stands for: 50 GFLOP/s on the probe (the cost model's benchmark machine
measured 40-73), one thread."""


@dataclass(frozen=True)
class _Reference:
    probe_gflops: float = REFERENCE_PROBE_GFLOPS
    threads: int = 1


class VirtualFleet:
    """Task durations and ends on the virtual clock for one run's devices."""

    def __init__(self, trace: DeviceTrace, model_name: str, input_shape: tuple[int, ...], batch_size: int):
        self.trace, self.model_name, self.input_shape, self.batch_size = trace, model_name, input_shape, batch_size
        self._step_s: dict[float, float] = {}

    @classmethod
    def from_flags(cls, seed: int, device_speed: str | None, availability: str | None, model_name: str,
                   input_shape: tuple[int, ...], batch_size: int) -> VirtualFleet:
        """The fleet the flags describe (ValueError naming the flag for a bad value or a model the cost model has
        not measured)."""
        trace = DeviceTrace(seed, SpeedModel.parse(device_speed) if device_speed else None,
                            Availability.parse(availability) if availability else None)
        fleet = cls(trace, model_name, input_shape, batch_size)
        try:
            fleet.step_seconds(1.0)
        except CostModelError as exc:
            raise ValueError(f"the virtual clock needs the cost model's step time: {exc}") from None
        return fleet

    def step_seconds(self, ratio: float) -> float:
        """One training step at rank ``ratio`` on the reference device, seconds."""
        if ratio not in self._step_s:
            prediction = predict(self.model_name, self.input_shape, ratio, self.batch_size, _Reference())
            self._step_s[ratio] = prediction.step_ms / 1000.0
        return self._step_s[ratio]

    def task_seconds(self, device_id: str, ratio: float, task: Task, num_train: int) -> float:
        """The device's online time to train ``task``: steps × its tier's step time × its speed factor."""
        steps = task.epochs * math.ceil(num_train / task.batch_size)
        return steps * self.step_seconds(ratio) * self.trace.factor(device_id)

    def finish(self, device_id: str, start: float, seconds: float) -> float:
        """When ``seconds`` of online work started at ``start`` end (paused while the device is away)."""
        return self.trace.finish(device_id, start, seconds)

    def online(self, device_id: str, t: float) -> bool:
        return self.trace.online(device_id, t)

    def next_online(self, device_id: str, t: float) -> float:
        return self.trace.next_online(device_id, t)
