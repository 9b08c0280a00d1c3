"""The round engine's asynchronous mode (``--mode async``): buffered aggregation (``server.engine.fedbuff``) behind
the same door as the sync rounds, for every algorithm.

It is the round engine (admission, plans, presence, records, checkpoints are the sync engine's own) with tasks
given out one device at a time instead of rounds: at most ``--concurrency`` devices train at once, each on the
version that is current when it starts (a seeded choice among the free devices, so a run is reproducible). Each
task and its update carry a task number (the ``round`` field; numbers only grow, so a device and the engine take
an earlier one as a replay). An update is judged like a sync round's (its device's topic, this run, its plan, its
tensors and declared samples, its evaluation's fit) plus fedbuff's rules (the device's task in flight, staleness).
Every ``--buffer-size`` accepted updates make a new version; a version's metrics row is written when the next one
is made (or at the end), with the evaluations of that version that came in: the evaluation that leads every task
(the model received) and evaluation-only tasks a driver asks for. A row still awaiting those (asked, or leading a
task in flight) waits until the version after next. ``--task-timeout`` ends tasks not answered in time (``expire``,
from the ``now`` a driver passes).
"""
from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

import numpy as np

from device_runtime.envelope import Message
from device_runtime.messages import MessageError
from device_runtime.payload import PayloadRef
from device_runtime.task import Task, Update, tensor_bytes
from device_runtime.topics import check_topic_device
from device_runtime.protocol import ProtocolError
from server.engine.coordinator import Evaluation, Verdict, evaluation_of
from server.engine.privacy import BufferDp, finite
from server.engine.fedbuff import TOO_STALE, FedBuff, InFlight, Judged, update_delta
from server.engine.run_config import BufferRule, RunError
from server.engine.round_engine import RoundEngine
from server.engine.round_record import RoundBook, TrainingRecord, tier_label
from server.engine.sampling import batch_seed, factorize_per_plan, plan_key, to_torch
from server.engine.update_rule import Answer, Asked, body_problem

LOG = logging.getLogger("fedara.async")
BUFFER_FULL = "buffer full"
TIMED_OUT = "[timed_out]"
DP_BUFFER_PREFIX = "dp_buffer/"


class AsyncEngine(RoundEngine):
    """The round engine, asynchronous (see the module docstring). ``rule``: C, K, S, a, η_g."""

    def __init__(self, *args: Any, rule: BufferRule, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self.remote is not None:
            raise ValueError("--mode async does not run with --aggregators (aggregator processes fold sync rounds)")
        if self.norm_bound is not None:
            raise ValueError("--mode async does not take --update-norm-bound (it bounds a sync round's updates)")
        self.rule = rule
        self.buff = FedBuff(rule, self.global_state)
        if self.dp is not None:  # each flush a Gaussian mechanism on ≤ K clipped changes (privacy.BufferDp)
            self.dp = BufferDp(self.dp.settings, self.dense_shapes)
        self._sent: dict[tuple[int, tuple], dict[str, np.ndarray]] = {}  # (version, plan) -> the weights sent
        self._evaluating: dict[str, tuple[int, int]] = {}  # device -> (task number, version) of its evaluation
        self._evaluations: dict[int, dict[str, Evaluation]] = {}  # version -> device -> its evaluation
        self._refused: dict[str, str] = {}  # device -> why its update did not count, since the last version
        self._version_record: TrainingRecord | None = None  # the last version's record, awaiting its evaluations
        self._version_extra: dict[str, Any] = {}
        self._held: list[tuple[TrainingRecord, dict[str, Any]]] = []  # older versions' rows awaiting evaluations asked
        self._too_stale_at_last = 0
        self._last_version_at: float | None = None
        self._started: dict[str, float] = {}  # device -> when its task in flight began (--task-timeout counts from it)
        self._timed_out: dict[str, int] = {}  # device -> its task number that --task-timeout ended
        self._timeouts = 0  # tasks --task-timeout ended, in the run
        self._timeouts_at_last = 0

    # -- what the drivers read ------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The current model version (``--rounds`` counts versions in this mode)."""
        return self.buff.version

    def training(self) -> list[str]:
        """The devices with a task in flight, by id."""
        return sorted(self.buff.in_flight)

    def free_slots(self) -> int:
        return max(0, self.rule.concurrency - self.buff.busy())

    def makes_no_more(self) -> bool:
        """Whether no further version will be made: --rounds versions exist, or (DP) the next one would overspend
        the budget (``budget_refusal``). Then no task is given out and no training update is taken: what is
        buffered is never released."""
        return self.version >= self.config.rounds or self.budget_refusal() is not None

    # -- tasks ----------------------------------------------------------------------------------

    def dispatch(self, candidates: list[str], now: float | None = None) -> dict[str, Task]:
        """Tasks at the current version for up to the free slots of ``candidates`` (online devices, as the driver
        knows them) that are ready and not training: a seeded choice, by id, never by the order they came in.
        ``now``: when they start (what --task-timeout counts from; None: from the next ``expire``). None once the
        run makes no more versions (``makes_no_more``)."""
        if self.makes_no_more():
            return {}
        ready = set(self.ready_devices())
        free = sorted(d for d in set(candidates) if d in ready and d not in self.buff.in_flight
                      and not (self.dp is not None and self.dp.holds(d)))  # with DP: once per buffer
        slots = self.free_slots()
        if not free or not slots:
            return {}
        if len(free) > slots:
            rng = np.random.default_rng([self.config.seed, 3, self.buff.next_task])
            free = sorted(free[i] for i in rng.choice(len(free), size=slots, replace=False))
        for device_id in free:  # a start from an earlier task never counts for this one
            self._started.pop(device_id, None)
            if now is not None:
                self._started[device_id] = now
        return {d: self._training_task(d, self.buff.dispatch(d)) for d in free}

    def expire(self, now: float) -> list[str]:
        """End the tasks in flight for --task-timeout seconds or more at ``now`` (their devices never answered): each
        slot is free again, the device's late update will be refused (``[timed_out]``) and the version's row counts
        it. Returns those devices, by id. A task whose start is unknown (restored, or dispatched without ``now``)
        counts from this call."""
        timeout = self.rule.task_timeout
        if timeout is None:
            return []
        in_flight = self.buff.in_flight
        self._started = {d: self._started.get(d, now) for d in in_flight}
        expired = sorted(d for d, started in self._started.items() if now - started >= timeout)
        for device_id in expired:
            number = in_flight[device_id].task
            self._timed_out[device_id] = number
            self._refused[device_id] = f"{TIMED_OUT} task {number} not answered in --task-timeout {timeout:g} s"
            del self._started[device_id]
            self.buff.finish(device_id)
            self._timeouts += 1
            LOG.warning("%s: %s", device_id, self._refused[device_id])
        self._complete_held()
        return expired

    def abandon(self) -> list[str]:
        """End every task in flight without its update (a driver's run is over: what the devices still train is not
        awaited, and a resumed run gives them fresh tasks); returns their devices, by id."""
        devices = self.training()
        for device_id in devices:
            self.buff.finish(device_id)
        self._started = {}
        return devices

    def next_expiry(self) -> float | None:
        """When the first task in flight reaches --task-timeout (None: no timeout, or no task with a known start)."""
        timeout = self.rule.task_timeout
        starts = [self._started[d] for d in self.buff.in_flight if d in self._started]
        return None if timeout is None or not starts else min(starts) + timeout

    def _sent_weights(self, device_id: str, version: int) -> dict[str, np.ndarray]:
        """The model of ``version`` at the device's plan (factorized once per version and plan)."""
        if not self.global_state:
            return {}
        resolved = self.plan_info(device_id).resolved
        key = (version, plan_key(resolved))
        if key not in self._sent:
            self._sent[key] = factorize_per_plan(self.buff.base_model(version), [resolved])[plan_key(resolved)]
        return self._sent[key]

    def resend(self, device_id: str) -> Task:
        """The task the device has in flight, again (the same number, version and weights: a device that missed
        it, or a resumed simulation)."""
        return self._training_task(device_id, self.buff.in_flight[device_id], count=False)

    def _training_task(self, device_id: str, flight: InFlight, count: bool = True) -> Task:
        plan = self.plan_info(device_id)
        weights = self._sent_weights(device_id, flight.base)
        config = self.config
        fit = self.algorithm.configure_fit(flight.base + 1, bool(plan.resolved.ranks))
        if count and self.payloads is None:  # else booked once per publish of its payload (``payload``)
            self._book_down(plan, True, tensor_bytes(weights))
        return Task(round=flight.task, weights=weights, lam=fit.lam, mu=fit.mu, lr=config.lr, phases=fit.phases,
                    batch_size=config.batch_size, seed=batch_seed(config.seed, flight.task, device_id),
                    returns=fit.returns, version=flight.base)

    def evaluation_tasks(self, device_ids: list[str]) -> dict[str, Task]:
        """Evaluation-only tasks of the current version for ``device_ids`` (ready ones, by id): what completes the
        version's metrics row where tasks alone would evaluate it on few devices."""
        ready = set(self.ready_devices())
        tasks = {}
        for device_id in sorted(d for d in set(device_ids) if d in ready):
            number = self.buff.next_number()
            self._evaluating[device_id] = (number, self.version)
            weights = self._sent_weights(device_id, self.version)
            if self.payloads is None:  # else booked once per publish of its payload (``payload``)
                self._book_down(self.plan_info(device_id), False, tensor_bytes(weights))
            tasks[device_id] = Task(round=number, weights=weights, lam=0.0, mu=0.0, lr=self.config.lr, phases=(),
                                    batch_size=self.config.batch_size, seed=0, returns="none", version=self.version)
        return tasks

    # -- payloads (shared_payloads: a task names its version's payload, published once per version and plan) --------

    def payload(self, device_id: str, task: Task, now: float) -> tuple[PayloadRef, bytes | None]:
        """The payload of ``task`` (its version's model at the device's plan): the reference its TASK carries, and
        the bytes to publish when they are not yet published (booked as sent down, once per version and plan, then
        once per publish again). A task sent again names the same payload: it costs a TASK, not the model."""
        ref, data = self.payloads.get(self._payload_key(device_id, task.version), task.weights, now)
        if data is not None:
            self._book_down(self.plan_info(device_id), not task.evaluate_only, len(data))
        return ref, data

    def payload_wanted(self, device_id: str, ref: PayloadRef, now: float) -> bytes | None:
        """A device asks for payload ``ref`` again: the bytes to publish again (booked), or None: not the payload of
        its task in flight or its evaluation asked, or published moments ago."""
        if self.payloads is None:
            return None
        for version, training in self._versions_used(device_id):
            if self.payloads.ref_of(self._payload_key(device_id, version)) == ref:
                data = self.payloads.requested(ref, now)
                if data is not None:
                    self._book_down(self.plan_info(device_id), training, len(data))
                return data
        return None

    def unused_payloads(self) -> list[PayloadRef]:
        """Forget the payloads no task in flight or evaluation asked uses any more: returns those published, whose
        retained copies the driver deletes."""
        if self.payloads is None:
            return []
        devices = set(self.buff.in_flight) | set(self._evaluating)
        return self.payloads.keep_only({self._payload_key(d, version) for d in devices
                                        for version, _ in self._versions_used(d)})

    def _versions_used(self, device_id: str) -> list[tuple[int, bool]]:
        """(version, training) of the device's task in flight and of its evaluation asked, where it has them."""
        uses = []
        flight = self.buff.in_flight.get(device_id)
        if flight is not None:
            uses.append((flight.base, True))
        if device_id in self._evaluating:
            uses.append((self._evaluating[device_id][1], False))
        return uses

    def _payload_key(self, device_id: str, version: int | None) -> tuple[int | None, tuple]:
        return version, plan_key(self.plan_info(device_id).resolved)

    # -- updates --------------------------------------------------------------------------------

    def receive(self, device_id: str, msg: Message, now: float) -> Verdict:
        """Judge an UPDATE that arrived on ``device_id``'s topic: an evaluation it was asked for, or the update of
        its task in flight; an accepted training update goes into the buffer, and a full buffer makes a version."""
        verdict = self._receive(device_id, msg, now)
        self._complete_held()  # a row may wait for nothing else now
        return verdict

    def _receive(self, device_id: str, msg: Message, now: float) -> Verdict:
        answer = Answer.of_message(msg)
        record = self.coordinator.devices.get(device_id)
        if record is None:
            return self._refuse(device_id, "unknown device", None)
        try:
            check_topic_device(device_id, answer.device_id)
        except ProtocolError as exc:
            return Verdict(False, str(exc))
        if answer.run_id != self.run_id:
            return Verdict(False, f"update of run {answer.run_id}, this run is {self.run_id}")
        evaluating = self._evaluating.get(device_id)
        if evaluating is not None and evaluating[0] == answer.round:
            del self._evaluating[device_id]
            return self._evaluation(record, answer, evaluating[1])
        if self.makes_no_more():  # a flush past --rounds or past the privacy budget is never made
            return Verdict(False, f"no further version after version {self.version}: "
                                  + (self.budget_refusal() or f"--rounds {self.config.rounds} reached"))
        judged = self.buff.judge(device_id, answer.round)
        if isinstance(judged, str) and self._timed_out.get(device_id) == answer.round:
            return Verdict(False, f"{TIMED_OUT} update for task {answer.round} came after --task-timeout "
                                  f"{self.rule.task_timeout:g} s ended it")
        if isinstance(judged, str):
            if judged.startswith(TOO_STALE):
                self._refused[device_id] = judged
                LOG.warning("%s: %s", device_id, judged)
            return Verdict(False, judged)
        problem, update, evaluation = self._body(record, answer, trains=True)
        if problem is not None:
            self.buff.finish(device_id)
            return self._refuse(device_id, problem, record)
        self._evaluations.setdefault(judged.task.base, {}).setdefault(device_id, evaluation)
        self._book_update(device_id, update, tensor_bytes(msg.tensors))
        full = self._accept(device_id, judged, update)
        if full:
            self._new_version(now)
        return Verdict(True, update=update)

    def _refuse(self, device_id: str, reason: str, record: Any) -> Verdict:
        if record is not None:
            self._refused[device_id] = reason
        return Verdict(False, reason)

    def _body(self, record: Any, answer: Answer, trains: bool) -> tuple[str | None, Update | None, Evaluation | None]:
        """(why not, None, None) or (None, the update, its evaluation), under the one update rule."""
        try:
            plan_hash, update = answer.parse()
        except MessageError as exc:
            return f"malformed update: {exc}", None, None
        asked = Asked(record.plan_hash, record.num_train if trains else 0, trains)
        problem = body_problem(plan_hash, update, asked, self._expected_shapes(record.device_id) if trains else {},
                               tensors_checked=False)
        if problem is not None:
            return problem, None, None
        evaluation = evaluation_of(update.metrics, record.num_test)
        if isinstance(evaluation, str):
            return evaluation, None, None
        return None, update, evaluation

    def _evaluation(self, record: Any, answer: Answer, version: int) -> Verdict:
        problem, update, evaluation = self._body(record, answer, trains=False)
        if problem is not None:
            return Verdict(False, problem)
        self._evaluations.setdefault(version, {}).setdefault(record.device_id, evaluation)
        return Verdict(True, update=update)

    def _accept(self, device_id: str, judged: Judged, update: Update) -> bool:
        if not self.global_state:
            return self.buff.count_only(device_id, judged)
        sent = self._sent_weights(device_id, judged.task.base)
        if self.config.aggregate == "weights":  # the change from the base model itself (truncation included)
            sent = {k: v for k, v in self.buff.base_model(judged.task.base).items()}
        else:
            sent = to_torch(sent)
        returned = to_torch(update.weights)
        delta = update_delta(returned, sent, self.dense_shapes)
        if self.dp is not None:  # clipped into DP's own sum; fedbuff only counts it toward K
            norm = self.dp.add(device_id, delta)
            LOG.info("%s: update norm %.6g (DP clip %g)", device_id, norm, self.dp.mechanism.clip)
            return self.buff.count_only(device_id, judged)
        return self.buff.accept(device_id, judged, delta, update.num_samples)

    def _book_update(self, device_id: str, update: Update, nbytes: int) -> None:
        book = self._book
        book.bytes_up += nbytes
        book.count(tier_label(self.coordinator.devices[device_id].ratio), "up", nbytes)
        book.samples += update.num_samples
        book.loss_sum += update.train_loss * update.num_samples
        book.accuracy_sum += update.train_accuracy * update.num_samples

    def _new_version(self, now: float) -> None:
        """Apply the full buffer; the previous version's record is completed, this one's waits for its evaluations."""
        members = self.buff.flush(None if self.dp is None else self.dp.release())
        if not finite(self.buff.current):  # never sent, evaluated or checkpointed
            raise RunError(f"version {self.version}: the new model is not finite, so it is not released; "
                           f"{self.divergence_cause()}")
        self.global_state = self.buff.current
        self._sent = {k: v for k, v in self._sent.items() if k[0] in self.buff.versions}
        if self._version_record is not None:
            self._held.append((self._version_record, self._version_extra))
            self._version_record = None
        self._complete_held()
        book = self._book
        opened = book.opened_at if self._last_version_at is None else self._last_version_at
        tiers = {d: tier_label(r.ratio) for d, r in self.coordinator.devices.items()}
        stale = [tau for _, tau in members]
        self._version_record = TrainingRecord(
            self.version, len(members), len(members), dict(self._refused), bool(self.global_state),
            self.algorithm.name, self.config.aggregate, BUFFER_FULL,
            book.loss_sum / book.samples if book.samples else None,
            book.accuracy_sum / book.samples if book.samples else None,
            book.bytes_down, book.bytes_up, book.bytes_artifacts, book.bytes_down_eval, book.by_tier, now - opened,
            tiers, epsilon=None if self.dp is None else self.dp.epsilon, sim_time=now)
        self._version_extra = {"mode": "async", "staleness_mean": sum(stale) / len(stale), "staleness_max": max(stale),
                               "too_stale": self.buff.too_stale - self._too_stale_at_last}
        if self.rule.task_timeout is not None:
            self._version_extra["timed_out"] = self._timeouts - self._timeouts_at_last
        self._too_stale_at_last, self._timeouts_at_last = self.buff.too_stale, self._timeouts
        self._refused = {}
        self._last_version_at = now
        self._book = RoundBook(now)
        LOG.info("version %d from %d updates (staleness mean %.2f, max %d)", self.version, len(members),
                 self._version_extra["staleness_mean"], self._version_extra["staleness_max"])

    def _complete_held(self, final: bool = False) -> None:
        """Write the rows of older versions, in order: a version's row waits for the evaluations asked of it
        (``evaluation_tasks``) and those that lead the tasks in flight based on it, until the version after the next
        is made (a device that never answers holds no row longer); with ``final``, every row is written."""
        while self._held:
            record, extra = self._held[0]
            awaited = any(version == record.round for _, version in self._evaluating.values()) or \
                any(flight.base == record.round for flight in self.buff.in_flight.values())
            if awaited and not final and record.round >= self.version - 1:
                return
            self._held.pop(0)
            self._complete_version(record, extra)

    def _complete_version(self, record: TrainingRecord, extra: dict[str, Any]) -> dict[str, Any]:
        evaluations = self._evaluations.pop(record.round, {})
        for version in [v for v in self._evaluations if v < record.round]:
            del self._evaluations[version]  # evaluations of older versions that came too late for their row
        row = dict(record.completed(evaluations), **extra)
        self.records.append(row)
        return row

    def finish(self) -> dict[str, Any] | None:
        """The run ends: the versions' records are completed with the evaluations that came; returns the last."""
        self._complete_held(final=True)
        record, self._version_record = self._version_record, None
        if record is None:
            return None
        record.add_evaluation_bytes(self._book)
        return self._complete_version(record, self._version_extra)

    @property
    def pending(self) -> dict[str, Any] | None:
        return None if self._version_record is None else self._version_record.to_state()

    # -- checkpoints ----------------------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """The sync engine's state, plus fedbuff's (its tensors: ``state_tensors``) and the open version's."""
        buff_state, _ = self.buff.to_state()
        state = super().to_state()
        state["pending"] = None
        state["async"] = {
            "fedbuff": buff_state, "record": self.pending, "extra": self._version_extra,
            "held": [[r.to_state(), extra] for r, extra in self._held],
            "evaluating": {d: list(v) for d, v in self._evaluating.items()},
            "evaluations": {str(v): {d: [e.correct, e.total, e.loss] for d, e in sorted(evals.items())}
                            for v, evals in self._evaluations.items()},
            "refused": self._refused, "too_stale_at_last": self._too_stale_at_last,
            "last_version_at": self._last_version_at, "book": asdict(self._book),
            "timeouts": {"timed_out": self._timed_out, "count": self._timeouts, "at_last": self._timeouts_at_last}}
        return state

    def state_tensors(self) -> dict[str, np.ndarray]:
        """The stored versions and the buffer's float64 sums (saved beside the global model), DP's too."""
        tensors = self.buff.to_state()[1]
        if self.dp is not None:
            tensors.update({f"{DP_BUFFER_PREFIX}{k}": v for k, v in self.dp.sum_tensors().items()})
        return tensors

    def restore(self, state: dict[str, Any], global_state: dict[str, np.ndarray]) -> None:
        """``global_state``: the checkpoint's tensors (the global model and ``state_tensors``)."""
        super().restore(state, global_state)
        saved = state["async"]
        self.buff.restore(saved["fedbuff"], global_state)
        if self.dp is not None:
            self.dp.restore(state["privacy"], {k: global_state[f"{DP_BUFFER_PREFIX}{k}"] for k in self.dense_shapes})
        self.global_state = self.buff.current
        self._version_record = None if saved["record"] is None else TrainingRecord.from_state(saved["record"])
        self._version_extra = saved["extra"]
        self._held = [(TrainingRecord.from_state(r), extra) for r, extra in saved.get("held", [])]
        self._evaluating = {d: (t, v) for d, (t, v) in saved["evaluating"].items()}
        self._evaluations = {int(v): {d: Evaluation(*e) for d, e in evals.items()}
                             for v, evals in saved["evaluations"].items()}
        self._refused = dict(saved["refused"])
        self._too_stale_at_last = saved["too_stale_at_last"]
        self._last_version_at = saved["last_version_at"]
        self._book = RoundBook(**saved["book"])
        timeouts = saved.get("timeouts", {"timed_out": {}, "count": 0, "at_last": 0})  # none before --task-timeout
        self._timed_out, self._timeouts = dict(timeouts["timed_out"]), timeouts["count"]
        self._timeouts_at_last = timeouts["at_last"]
        self._started = {}  # a clock of the run before: the tasks in flight count from the next expire

