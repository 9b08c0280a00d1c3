"""``python -m server.simulate --mode async``: the in-process devices on the virtual clock, given tasks by the async
engine (``server.engine.async_engine``) as they come free and online, each update arriving when its device has
trained it (``server.virtual_clock``). After each new version the devices online then evaluate it (no virtual
time: a measurement), which completes the version's metrics row; a checkpoint follows, with the tasks in flight
and their ends, so ``--resume`` continues exactly."""
from __future__ import annotations

import heapq
import logging

from device_runtime.messages import update_message
from device_runtime.task import Task, Update
from server.engine.run_config import RunError
from server.outputs.progress import Progress, print_and_log
from server.simulation import Simulation

log = logging.getLogger("fedara.simulate")
REFUSALS_PER_DEVICE = 10
"""The run stops after this many refused updates in a row per device: none is accepted, so no version can come
(every device's training diverged, say), and without this it would hand out tasks forever."""


class AsyncSimulation(Simulation):
    """The simulation's devices under the async engine (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        self._ends: list[tuple[float, int, str]] = []  # (virtual end, task number, device) of the tasks in flight
        self._tasks: dict[str, Task] = {}
        self._started: dict[str, object] = {}  # --ray: the tasks in flight, training on the cluster meanwhile
        self._refused_in_a_row = 0
        super().__init__(*args, **kwargs)
        if kwargs.get("progress") is None:  # versions, timed on the wall clock, the virtual one beside it
            self.progress = Progress(self.config.rounds, unit="version", virtual=True)
        if self.fleet is None:
            raise RunError(f"--mode async needs the virtual clock: the cost model has no step time for "
                           f"{self.args.model}")

    def _restore(self) -> None:
        super()._restore()
        self._ends = [(end, number, device_id) for end, number, device_id in self.saved.state["clock"]["in_flight"]]
        heapq.heapify(self._ends)
        self._tasks = {d: self.engine.resend(d) for _, _, d in self._ends}

    def _online(self) -> list[str]:
        return [d for d in self.devices if self.fleet.online(d, self.clock)]

    def _dispatch(self) -> None:
        engine = self.engine
        for device_id, task in engine.dispatch(self._online()).items():
            record = engine.registry()[device_id]
            seconds = self.fleet.task_seconds(device_id, record.ratio, task, record.num_train)
            heapq.heappush(self._ends, (self.fleet.finish(device_id, self.clock, seconds), task.round, device_id))
            self._tasks[device_id] = task
            if self.args.ray is not None:  # trains now on the cluster; the clock still decides when it arrives
                self._started[device_id] = self._workers().submit(device_id, task)

    def _next_wake(self) -> float | None:
        """The first time an idle device away now comes online (it may take a free slot then), None: none."""
        if not self.engine.free_slots():
            return None
        idle = [d for d in self.devices if d not in self._tasks and not self.fleet.online(d, self.clock)]
        return min((self.fleet.next_online(d, self.clock) for d in idle), default=None)

    def _trained(self, device_id: str, task: Task) -> Update:
        """The device's answer to its task in flight: computed now (one process), or the --ray task's, started at
        dispatch (a task resumed from a checkpoint starts now) from the same personal tensors."""
        if self.args.ray is None:
            return self.devices[device_id].answer(task)
        pool = self._workers()
        handle = self._started.pop(device_id, None)
        if handle is None:
            handle = pool.submit(device_id, task)
        return pool.result(device_id, handle)

    def _deliver(self, device_id: str, task: Task, update: Update) -> None:
        msg = update_message(update, plan_hash=self.devices[device_id].plan_hash, device_id=device_id,
                             run_id=self.run_id)
        verdict = self.engine.receive(device_id, msg, self.clock)
        if verdict.accepted:
            self._refused_in_a_row = 0
            return
        log.warning("dropped %s's update (task %d): %s", device_id, task.round, verdict.reason)
        self._refused_in_a_row += 1
        if self._refused_in_a_row > REFUSALS_PER_DEVICE * len(self.devices):
            raise RunError(f"--mode async: {self._refused_in_a_row} updates in a row were refused, none accepted "
                           f"(the last: {verdict.reason}); no version can be made: lower --lr (or the DP noise)")

    def _evaluate_version(self) -> None:
        """Every device evaluates the new version (no virtual time: a measurement, as sync's away devices do)."""
        tasks = self.engine.evaluation_tasks(list(self.devices))
        for device_id, update in self._answers(tasks):
            self._deliver(device_id, tasks[device_id], update)

    def run(self) -> list[dict]:
        """Versions up to --rounds (fewer where the privacy budget ends the run first); a checkpoint after each."""
        engine = self.engine
        self.progress.begin(engine.version, engine.records)
        try:
            while engine.version < self.config.rounds:
                stop = engine.budget_refusal()  # DP: the next version would overspend; what is buffered stays unsent
                if stop is not None:
                    print_and_log(stop)
                    break
                self._dispatch()
                wake = self._next_wake()
                if not self._ends and wake is None:
                    raise RunError("--mode async: no device can train (none ready, or --concurrency slots all held)")
                if wake is not None and (not self._ends or wake < self._ends[0][0]):
                    self.clock = wake
                    continue
                end, _, device_id = heapq.heappop(self._ends)
                self.clock = end
                before = engine.version
                task = self._tasks.pop(device_id)
                self._deliver(device_id, task, self._trained(device_id, task))
                self._follow()
                if engine.version > before:
                    self._evaluate_version()
                    self._follow()
                    self._checkpoint(engine.version, finished=False)
            engine.finish()
            self._follow()
        finally:
            self.close()
        self._checkpoint(self.config.rounds, finished=True)
        return engine.records

    def _follow(self) -> None:
        """The progress lines of the versions made and the rows completed since the last call."""
        self.progress.follow(self.engine.version, self.engine.pending, self.engine.records)

    def _clock_state(self) -> dict:
        """The virtual clock and the ends of the tasks in flight, for --resume."""
        return {"now": self.clock, "in_flight": sorted(self._ends)}
