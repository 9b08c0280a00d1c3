"""Buffered asynchronous aggregation (FedBuff, Nguyen et al., AISTATS 2022) for devices of any rank: the server's
model versions, the tasks in flight, the buffer of accepted updates and the rule that turns a full buffer into the
next version. Pure: no I/O, no clock (nothing here depends on when things happen, only on their order).

A device that is given a task trains on the current version v (its base). Its update is its change against what it
was sent, Δ = reconstruct(returned) − reconstruct(sent at its base, at its own rank) (``--aggregate updates``; under
``weights`` the base version itself is subtracted, so the truncation to its rank is part of the change, as in the
sync rule). Its staleness is τ = v − base when it arrives; an update staler than ``max_staleness`` is refused
(``[too_stale]``) and counted. Every ``buffer_size`` accepted updates one step is applied:

    v+1 = v + η_g · Σ s(τ_i)·n_i·Δ_i / D,   s(τ) = (1 + τ)^−a,

with D = Σ n_i (FedBuff's rule with sample weights, ``normalize="samples"``) or D = Σ s(τ_i)·n_i (a weighted
mean, ``normalize="staleness"``, the default: it measured better, docs/async.md). The buffer's sums are float64 and saved whole, so a run resumed mid-buffer
continues exactly. Versions are kept only while a task in flight (not yet too stale) was based on them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedcore.lowrank import reconstruct_state
from server.engine.run_config import BufferRule

TOO_STALE = "[too_stale]"
VERSION_PREFIX = "version/"
BUFFER_PREFIX = "buffer/"


def staleness_weight(tau: int, exponent: float) -> float:
    """s(τ) = (1 + τ)^−a: FedBuff's polynomial staleness weight (a = 0.5 is its default; a = 0: no discount)."""
    if tau < 0:
        raise ValueError(f"staleness must be >= 0, got {tau}")
    return float((1.0 + tau) ** -exponent)


@dataclass(frozen=True)
class InFlight:
    """A task given out: its number (the ``round`` field of the task and of its update) and the version it carries."""

    task: int
    base: int


@dataclass(frozen=True)
class Judged:
    """An update that may count: its task and its staleness at arrival."""

    task: InFlight
    staleness: int


def update_delta(returned: dict[str, torch.Tensor], sent: dict[str, torch.Tensor],
                 dense_shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Δ = reconstruct(returned) − reconstruct(sent) in float64, per dense tensor (factors multiplied back; a dense
    ``sent`` is taken as it is)."""
    after = reconstruct_state(returned, dense_shapes)
    before = reconstruct_state(sent, dense_shapes)
    return {k: after[k].double() - before[k].double() for k in dense_shapes}


@dataclass
class _Buffer:
    sums: dict[str, torch.Tensor]  # Σ s(τ_i)·n_i·Δ_i, float64
    samples: float = 0.0  # Σ n_i
    weighted: float = 0.0  # Σ s(τ_i)·n_i
    members: list[tuple[str, int]] = field(default_factory=list)  # (device, τ) in the order they were accepted


class FedBuff:
    """The version counter, the tasks in flight (one per device at most), the stored versions and the buffer."""

    def __init__(self, rule: BufferRule, global_state: dict[str, torch.Tensor]):
        self.rule = rule
        self.dense_shapes = {k: tuple(v.shape) for k, v in global_state.items()}
        self.version = 0
        self.next_task = 1
        self.in_flight: dict[str, InFlight] = {}
        self.too_stale = 0  # updates refused as staler than max_staleness
        self.versions: dict[int, dict[str, torch.Tensor]] = {0: dict(global_state)}
        self._buffer = self._empty()

    # -- what is read -------------------------------------------------------------------------

    @property
    def current(self) -> dict[str, torch.Tensor]:
        """The model at the current version."""
        return self.versions[self.version]

    @property
    def buffered(self) -> list[tuple[str, int]]:
        """(device, staleness) of the accepted updates waiting in the buffer, in the order accepted."""
        return list(self._buffer.members)

    def busy(self) -> int:
        """How many tasks are in flight (the concurrency they use)."""
        return len(self.in_flight)

    # -- tasks and updates --------------------------------------------------------------------

    def dispatch(self, device_id: str) -> InFlight:
        """Give ``device_id`` a task at the current version (a device has one task at a time)."""
        if device_id in self.in_flight:
            raise ValueError(f"{device_id} already trains task {self.in_flight[device_id].task}")
        task = InFlight(self.next_task, self.version)
        self.next_task += 1
        self.in_flight[device_id] = task
        return task

    def next_number(self) -> int:
        """A task number for a task that trains nothing (an evaluation): numbers only grow, so a device takes every
        later task as fresh and an earlier one as a replay."""
        number = self.next_task
        self.next_task += 1
        return number

    def judge(self, device_id: str, task_number: int) -> Judged | str:
        """Whether an update for task ``task_number`` from ``device_id`` may count (a ``Judged``), or why not: no
        task in flight for the device, another task (a replay, or a copy of an earlier answer), or staler than
        ``max_staleness`` (refused for good: the task is over, and counted)."""
        task = self.in_flight.get(device_id)
        if task is None:
            return f"stale: update for task {task_number}, {device_id} has no task in flight"
        if task.task != task_number:
            return f"stale: update for task {task_number}, {device_id}'s task is {task.task}"
        tau = self.version - task.base
        if tau > self.rule.max_staleness:
            self.finish(device_id)
            self.too_stale += 1
            return (f"{TOO_STALE} update of version {task.base} arrived at version {self.version}: staleness {tau} > "
                    f"--max-staleness {self.rule.max_staleness}")
        return Judged(task, tau)

    def finish(self, device_id: str) -> None:
        """The device's task is over without an update that counts (refused, or lost): its slot is free."""
        self.in_flight.pop(device_id, None)
        self._prune()

    def base_model(self, version: int) -> dict[str, torch.Tensor]:
        """The model at a version a task in flight is based on."""
        return self.versions[version]

    def accept(self, device_id: str, judged: Judged, delta: dict[str, torch.Tensor], num_samples: int) -> bool:
        """Add an accepted update's s(τ)·n·Δ to the buffer; returns whether the buffer is full (call ``flush``)."""
        if num_samples <= 0:
            raise ValueError(f"an update needs a positive sample count, got {num_samples}")
        if set(delta) != set(self.dense_shapes):
            raise ValueError(f"an update's change covers {sorted(delta)}, the model has {sorted(self.dense_shapes)}")
        weight = staleness_weight(judged.staleness, self.rule.staleness_exponent) * num_samples
        buffer = self._buffer
        for key, value in delta.items():
            buffer.sums[key].add_(value.double(), alpha=weight)
        buffer.samples += num_samples
        buffer.weighted += weight
        buffer.members.append((device_id, judged.staleness))
        self.in_flight.pop(device_id)
        return len(buffer.members) >= self.rule.buffer_size

    def count_only(self, device_id: str, judged: Judged) -> bool:
        """An accepted update with nothing to aggregate (an algorithm without a global model): it counts toward the
        buffer; returns whether the buffer is full."""
        self._buffer.members.append((device_id, judged.staleness))
        self.in_flight.pop(device_id)
        return len(self._buffer.members) >= self.rule.buffer_size

    def flush(self, step: dict[str, torch.Tensor] | None = None) -> list[tuple[str, int]]:
        """Apply the buffer as one step: version v+1 = v + η_g · Σ s(τ_i) n_i Δ_i / D, or v + η_g · ``step`` where
        the caller aggregated the buffer itself (DP's noised mean of clipped changes, ``privacy.BufferDp``).
        Returns the buffer's (device, staleness) members."""
        buffer = self._buffer
        if not buffer.members:
            raise ValueError("the buffer is empty: nothing to apply")
        old = self.current
        if step is not None:
            new = {k: (old[k].double() + self.rule.server_lr * step[k]).to(old[k].dtype) for k in old}
        elif self.dense_shapes and buffer.samples > 0:
            denominator = buffer.samples if self.rule.normalize == "samples" else buffer.weighted
            step = self.rule.server_lr / denominator
            new = {k: (old[k].double() + step * buffer.sums[k]).to(old[k].dtype) for k in old}
        else:
            new = old
        self.version += 1
        self.versions[self.version] = new
        self._buffer = self._empty()
        self._prune()
        return buffer.members

    # -- state --------------------------------------------------------------------------------

    def _empty(self) -> _Buffer:
        return _Buffer({k: torch.zeros(s, dtype=torch.float64) for k, s in self.dense_shapes.items()})

    def needed_versions(self) -> set[int]:
        """The current version and every base of a task in flight that may still count."""
        limit = self.version - self.rule.max_staleness
        return {self.version} | {t.base for t in self.in_flight.values() if t.base >= limit}

    def _prune(self) -> None:
        for version in set(self.versions) - self.needed_versions():
            del self.versions[version]

    def to_state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """(JSON-able state, tensors): the stored versions and the float64 buffer sums, to restore exactly."""
        buffer = self._buffer
        state = {"version": self.version, "next_task": self.next_task, "too_stale": self.too_stale,
                 "in_flight": {d: [t.task, t.base] for d, t in sorted(self.in_flight.items())},
                 "versions": sorted(self.versions), "buffer": {"samples": buffer.samples, "weighted": buffer.weighted,
                                                               "members": [list(m) for m in buffer.members]}}
        tensors = {f"{VERSION_PREFIX}{v}/{k}": t.detach().cpu().numpy() for v, model in self.versions.items()
                   for k, t in model.items()}
        tensors.update({f"{BUFFER_PREFIX}{k}": t.numpy() for k, t in buffer.sums.items()})
        return state, tensors

    def restore(self, state: dict[str, Any], tensors: dict[str, np.ndarray]) -> None:
        """Continue from ``to_state``'s output (bit-exact: float64 sums, the versions' own dtypes)."""
        self.version, self.next_task, self.too_stale = state["version"], state["next_task"], state["too_stale"]
        self.in_flight = {d: InFlight(t, b) for d, (t, b) in state["in_flight"].items()}
        self.versions = {v: {k: torch.from_numpy(np.array(tensors[f"{VERSION_PREFIX}{v}/{k}"]))
                             for k in self.dense_shapes} for v in state["versions"]}
        if not self.dense_shapes:
            self.versions = {v: {} for v in state["versions"]}
        saved = state["buffer"]
        self._buffer = _Buffer({k: torch.from_numpy(np.array(tensors[f"{BUFFER_PREFIX}{k}"], dtype=np.float64))
                                for k in self.dense_shapes}, saved["samples"], saved["weighted"],
                               [(d, tau) for d, tau in saved["members"]])
