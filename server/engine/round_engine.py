"""The round engine: every decision of a federation, for any algorithm, with no I/O, behind the one door the
drivers use.

It owns the device registry and round state machine (``server.engine.coordinator``), the devices' presence
(``server.engine.presence``), the rank tier of each device, the plans it is sent (artifact files only when it lacks
them, at most ``MAX_PLAN_RESENDS`` times after it says it lost them), the tasks of a round, which updates count
(``server.engine.update_rule``), the aggregation (the algorithm's ``aggregate_fit``), remote folding by aggregator
processes (``server.engine.remote_folding``) and each round's record (``server.engine.round_record``). Every method takes the
time ``now`` where time matters and returns what to send; the two drivers, in-process devices
(``server.simulate``) and MQTT devices (``server.broker_loop``), deliver it and touch nothing behind it. So a rule
is found once, here, and both drivers run the same federation. The algorithm (``server.algorithms``) says what is
shared, trained and returned; the engine branches on none of its properties.

Evaluation is piggy-backed: every task of round t+1 first makes a device evaluate the weights it received
(round t's model with its own head), so round t's record is completed when round t+1 closes; after the last
round an evaluate-only round completes it.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from device_runtime.artifact_contract import PORTABLE_KIND
from device_runtime.messages import Join, Plan
from device_runtime.profile import ResourceProfile
from device_runtime.envelope import Message
from device_runtime.payload import PayloadRef
from device_runtime.task import Task, Update, tensor_bytes
from server.engine.aggregate import StreamingAverage
from server.engine.fold_order import FoldOrder
from server.engine.folding_records import Brief, Partial, Receipt
from server.algorithms import get_algorithm
from server.algorithms.base import Algorithm, Settings
from fedcore.lowrank import ResolvedPlan
from server.engine.coordinator import NO_ANSWER, NON_FINITE, Coordinator, DeviceRecord, RoundOpen, RoundResult, Verdict
from server.engine.plan_payloads import PlanPayloads
from server.engine.presence import Presence
from server.engine.privacy import DpFedAvg, finite, noise_cause
from server.engine.rank_assignment import choose_ratio, unchosen_tiers
from server.engine.remote_folding import RemoteFolding
from server.engine.evaluation import EVAL_DIRECTION
from server.engine.robust import bound_update, rejection_reason
from server.engine.round_record import RoundBook, TrainingRecord, tier_label
from server.engine.run_config import DpSettings, FederationConfig, NormBound, RunError, SecureSettings
from server.engine.secure_aggregation import SecAggServer
from server.engine.secure_rounds import SecureRounds
from server.engine.sampling import as_torch, batch_seed, factorize_per_plan, plan_key, to_numpy, to_torch
from server.engine.update_rule import Answer, Asked

LOG = logging.getLogger("fedara.engine")
MAX_PLAN_RESENDS = 3


def algorithm_for(config: FederationConfig) -> Algorithm:
    """The run's algorithm (``--algo``), built with the run's settings: the engine and its algorithm read one config."""
    return get_algorithm(config.algo, Settings(config.local_epochs, config.lam, config.lam_warmup, config.mu))


class PlanInfo(Protocol):
    """A rank tier resolved on the model, with what identifies and carries it to a device."""

    ratio: float
    resolved: ResolvedPlan
    hash: str
    fe_shapes: dict[str, tuple[int, ...]]
    files: dict[str, bytes]
    description: str


class PlanSource(Protocol):
    def get(self, ratio: float, kind: str = PORTABLE_KIND, model: str | None = None) -> PlanInfo: ...


Predictor = Callable[[ResourceProfile, int], Callable[[float], float]]
"""(profile, shard samples) -> (ratio -> the MiB that device needs at that tier)."""


@dataclass(frozen=True)
class Admission:
    """What a JOIN gets: a refusal, or the plan to send (with files or without)."""

    refusal: str | None = None
    plan: Plan | None = None


@dataclass(frozen=True)
class StatusChange:
    """What a device's status frame changed: nothing (an online of the connection already known), whether the
    device is known to the run, and whether the open round awaits it (send its task again: it may have missed
    it while away)."""

    ignored: bool
    known: bool = False
    resend_task: bool = False


class RoundEngine:
    """One run's federation state and rules (see the module docstring)."""

    def __init__(self, algorithm: Algorithm, config: FederationConfig, coordinator: Coordinator, plans: PlanSource,
                 global_state: dict[str, torch.Tensor], initial_personal: dict[str, dict[str, np.ndarray]], *,
                 tiers: tuple[float, ...], overrides: dict[str, float] | None = None,
                 device_models: dict[str, str] | None = None,
                 predictor: Predictor | None = None, norm_bound: NormBound | None = None, remote: bool = False,
                 shared_payloads: bool = False, privacy: DpSettings | None = None,
                 secure: SecureSettings | None = None):
        self.algorithm, self.config, self.coordinator, self.plans = algorithm, config, coordinator, plans
        self.global_state = global_state  # what the algorithm shares and aggregates (empty: no global model)
        self.initial_personal = initial_personal  # model name -> what a device of that model starts from
        self.device_models = dict(device_models or {})  # device -> its model, where devices differ (local only)
        if len(set(self.device_models.values())) > 1 and global_state:
            raise ValueError(f"--model with several models ({', '.join(sorted(set(self.device_models.values())))}) "
                             f"needs an algorithm without a global model: {algorithm.name} shares one")
        self.tiers, self.overrides = algorithm.offered_tiers(tuple(tiers), dict(overrides or {}))
        self.predictor = predictor
        self.norm_bound = norm_bound
        if remote and (norm_bound is not None or not global_state):
            raise ValueError("--aggregators: aggregator processes fold the updates of an algorithm with a global model "
                             f"({algorithm.name} {'has none' if not global_state else 'has one'}), without "
                             "--update-norm-bound (the engine never sees their tensors)")
        if privacy is not None and not global_state:
            raise ValueError("--dp-noise-multiplier clips each update's change to the shared model: it needs an "
                             "algorithm with a global model")
        self.dense_shapes = {k: tuple(v.shape) for k, v in global_state.items()}
        if secure is not None and (remote or norm_bound is not None or not global_state):
            raise ValueError("--secure-aggregation sums the changes of an algorithm with a global model, without "
                             "--aggregators or --update-norm-bound (the server never sees one update)")
        # DP-FedAvg and its budget; under secure aggregation the devices add the noise (distributed DP)
        self.dp = DpFedAvg(privacy, self.dense_shapes, distributed=secure is not None) if privacy is not None else None
        self.secure = SecureRounds(secure, self.dense_shapes, coordinator.run_id, privacy) if secure else None
        self._secure_round = False  # the open round is aggregated securely
        self._private_round = False  # the open round is a DP training round
        self.remote = RemoteFolding(self.dense_shapes) if remote else None  # aggregator processes hold the updates
        self.payloads = PlanPayloads() if shared_payloads and global_state else None  # tasks name their payload
        self.presence = Presence()
        self.records: list[dict[str, Any]] = []
        self._pending: TrainingRecord | None = None  # round t's record, awaiting round t+1's evaluations
        self.kinds: dict[str, str] = {}  # device -> the artifact kind its runtime runs
        self.profiles: dict[str, ResourceProfile] = {}  # device -> the resources its last JOIN reported
        self.demoted: dict[str, float] = {}  # device -> the tier it is held below after it died in a round
        self._unchosen_said: set[float] = set()  # tiers the log said no memory budget selects
        self._lost: dict[str, float] = {}  # device -> its tier when it went offline during the open round
        self._resends: dict[str, int] = {}
        self._files_sent: dict[str, str] = {}  # device -> plan hash whose files it was last sent
        self._round_weights: dict[tuple, dict[str, np.ndarray]] = {}
        self._average: StreamingAverage | None = None
        self._sent_weight: dict[tuple, float] = {}  # plan -> Σ samples of its accepted updates (the updates rule)
        self._folds: FoldOrder[tuple[Update, int]] = FoldOrder()  # accepted updates, folded in device-id order
        self._book = RoundBook(0.0)

    # -- what the drivers read ------------------------------------------------------------------

    @property
    def run_id(self) -> str:
        return self.coordinator.run_id

    @property
    def opened(self) -> RoundOpen | None:
        """The open round (who is asked what, its deadline), or None."""
        return self.coordinator.open

    @property
    def pending(self) -> dict[str, Any] | None:
        """The last training round's record (with each device's tier), awaiting the evaluations of its model (None:
        none): a copy, to read."""
        return None if self._pending is None else self._pending.to_state()

    @property
    def min_devices(self) -> int:
        return self.coordinator.config.min_devices

    def registry(self) -> dict[str, DeviceRecord]:
        """Every device the run knows, by id (to read: the engine changes them)."""
        return self.coordinator.devices

    def awaits(self, device_id: str) -> bool:
        """Whether the open round still waits for this device's answer."""
        return self.coordinator.awaits(device_id)

    def awaited(self) -> list[str]:
        """The devices the open round still waits for, by id."""
        return [d for d in sorted(self.coordinator.devices) if self.coordinator.awaits(d)]

    def ready_devices(self) -> list[str]:
        return self.coordinator.ready_devices()

    def can_start(self) -> bool:
        """Whether --min-devices devices are ready for a round."""
        return self.coordinator.can_start()

    def closing(self, now: float) -> str | None:
        """Why the open round may close now (all answered, or its deadline), or None."""
        return self.coordinator.closing(now)

    # -- devices --------------------------------------------------------------------------------

    def register(self, device_id: str) -> None:
        """A device the run expects (a local device process), known before it says anything."""
        self.coordinator.register(device_id)

    def plan_info(self, device_id: str) -> PlanInfo:
        record = self.coordinator.devices[device_id]
        return self.plans.get(record.ratio, self.kinds.get(device_id, PORTABLE_KIND), self.device_models.get(device_id))

    def status(self, device_id: str, online: bool, nonce: str, now: float) -> StatusChange:
        """A device's connection opened (``online``, its ``nonce``) or closed (its last will). An online of the
        connection already known changes nothing: a task is re-sent at most once per connection the device really
        opened. Going offline while a round awaits its training is noted (see :meth:`lost_in_round`)."""
        if online and self.presence.known_connection(device_id, nonce):
            return StatusChange(ignored=True)
        record = self.coordinator.devices.get(device_id)
        if online:
            self.presence.online(device_id, nonce, now, has_plan=record is not None and record.plan_hash is not None)
        else:
            self.presence.offline(device_id)
            self.lost_in_round(device_id)
        known = self.coordinator.set_online(device_id, online)
        return StatusChange(ignored=False, known=known, resend_task=online and self.coordinator.awaits(device_id))

    def to_ask_to_join(self, now: float) -> list[str]:
        """Online devices that have not joined for a while (they joined before the server listened): ask them."""
        return self.presence.to_ask_to_join(now)

    def _choose_ratio(self, device_id: str, profile: ResourceProfile, budget_mb: float | None,
                      shard_samples: int) -> float:
        tiers, overrides = self.tiers, self.overrides
        if device_id in self.demoted:  # it died at its tier: below it, whatever an override said
            tiers = tuple(t for t in tiers if t < self.demoted[device_id]) or (min(tiers),)
            overrides = {}
        if self.predictor is None or len(tiers) == 1:
            return overrides.get(device_id, tiers[0])
        predict = functools.cache(self.predictor(profile, shard_samples))  # each tier's need computed once a join
        for tier, larger in unchosen_tiers(tiers, predict):
            if tier not in self._unchosen_said:
                self._unchosen_said.add(tier)
                LOG.warning("rank tier %g is predicted to need %.1f MiB, no less than tier %g's %.1f: no device is "
                            "sent there by its memory (this model's factors save none at that ratio), only by "
                            "--rank-overrides", tier, predict(tier), larger, predict(larger))
        ratio = choose_ratio(device_id, budget_mb, tiers, predict, overrides)
        if budget_mb is not None and predict(ratio) > budget_mb and device_id not in overrides:
            LOG.warning("%s: no tier fits its %.0f MiB budget; the leanest, tier %g (predicted %.1f MiB)",
                        device_id, budget_mb, ratio, predict(ratio))
        else:
            LOG.info("%s: tier %g, predicted to need %.1f MiB", device_id, ratio, predict(ratio))
        return ratio

    def join(self, device_id: str, join: Join) -> Admission:
        """Admit a device (or say why not) and give it its plan, as artifacts of the kind its runtime runs: its
        tier is chosen once per run, from its memory budget and the cost model, unless an override names it or
        it was demoted."""
        self.presence.joined(device_id)
        refusal = self.coordinator.join(device_id, join)
        if refusal is not None:
            return Admission(refusal=refusal)
        record = self.coordinator.devices[device_id]
        kind = self.kinds[device_id] = join.profile.runtime
        self.profiles[device_id] = join.profile
        if record.ratio is None or (device_id in self.demoted and record.ratio >= self.demoted[device_id]):
            ratio = self._choose_ratio(device_id, join.profile, record.budget_mb, record.num_train + record.num_test)
            plan = self.plans.get(ratio, kind, self.device_models.get(device_id))
            self.coordinator.assign_plan(device_id, ratio, plan.hash, plan.fe_shapes)
        plan = self.plan_info(device_id)
        # Files already on their way are not sent twice for a repeated JOIN; a device that lost them says so.
        send_files = plan.hash not in record.artifacts and self._files_sent.get(device_id) != plan.hash
        LOG.info("%s joined: budget %s MiB, ratio %g, %d train / %d test samples, artifacts %s", device_id,
                 record.budget_mb, record.ratio, record.num_train, record.num_test,
                 "sent" if send_files else "not sent (held or on their way)")
        return Admission(plan=self._plan(device_id, plan, send_files))

    def _plan(self, device_id: str, plan: PlanInfo, send_files: bool) -> Plan:
        files = plan.files if send_files else {}
        if send_files:
            self._files_sent[device_id] = plan.hash
            nbytes = sum(len(f) for f in files.values())
            self._book.bytes_artifacts += nbytes
            self._book.count(tier_label(plan.ratio), "artifacts", nbytes)
        return Plan(plan.hash, plan.ratio, plan.description, files, self._initial(device_id))

    def _initial(self, device_id: str) -> dict[str, np.ndarray]:
        model = self.device_models.get(device_id)
        return self.initial_personal[model] if model else next(iter(self.initial_personal.values()))

    def acknowledge(self, device_id: str, plan_hash: str) -> str | None:
        """A device installed its plan; returns why the ACK does not count, or None."""
        problem = self.coordinator.acknowledge(device_id, plan_hash)
        if problem is None:
            self._resends.pop(device_id, None)
        return problem

    def artifacts_lost(self, device_id: str) -> Plan | None:
        """The plan with its files again for a device that lost or could not verify them (a bounded number of
        times per device), or None."""
        record = self.coordinator.devices.get(device_id)
        if record is None or record.plan_hash is None:
            return None
        record.artifacts.discard(record.plan_hash)
        sent = self._resends.get(device_id, 0)
        if sent >= MAX_PLAN_RESENDS:
            return None
        self._resends[device_id] = sent + 1
        return self._plan(device_id, self.plan_info(device_id), send_files=True)

    def lost_in_round(self, device_id: str) -> None:
        """A device went offline while a round awaited its training answer. That alone is no evidence that its
        tier does not fit (a brief disconnect, or anyone on the broker taking its client id over, looks the same):
        it is demoted only if it misses the round (see close_round) or ``demote`` is told it was killed for
        memory."""
        record = self.coordinator.devices.get(device_id)
        opened = self.coordinator.open
        if record is None or record.ratio is None or opened is None or device_id not in opened.train:
            return
        if self.coordinator.awaits(device_id) and min(self.tiers) < record.ratio:
            self._lost.setdefault(device_id, record.ratio)
            LOG.info("%s went offline during round %d at tier %g: a lower tier if it misses the round",
                     device_id, opened.round, record.ratio)

    def demote(self, device_id: str, evidence: str) -> bool:
        """Evidence that the device's tier does not fit it (``evidence`` says which): when it joins again it gets
        a lower tier than the one it had. False where there is none lower (or it had no tier yet: it died before
        it joined), so trying again would change nothing."""
        record = self.coordinator.devices.get(device_id)
        if record is None or record.ratio is None or min(self.tiers) >= record.ratio:
            return False
        self.demoted[device_id] = min(record.ratio, self.demoted.get(device_id, record.ratio))
        LOG.warning("%s %s at tier %g: it gets a lower tier when it rejoins", device_id, evidence, record.ratio)
        return True

    # -- rounds ---------------------------------------------------------------------------------

    def budget_refusal(self) -> str | None:
        """Why no further training round may open (the privacy budget would be overspent), or None: the drivers
        stop the run cleanly when it says so."""
        return None if self.dp is None else self.dp.refusal()

    @property
    def secure_round(self) -> SecAggServer | None:
        """The open round's SecAgg+ exchanges (the drivers relay them; ``server.engine.secure_aggregation``), or
        None: the round is not aggregated securely (not asked for, or it cannot be: the record says why)."""
        return self.secure.server if self._secure_round else None

    def open_round(self, round_index: int, now: float, *, train: bool = True,
                   wall: float | None = None, away: frozenset[str] = frozenset()) -> dict[str, Task]:
        """Open a round; returns each asked device's task (trainers train, the others only evaluate), with the
        round's deadline on the wall clock when ``wall`` (the wall time of ``now``) is given. Devices ``away``
        (the simulator's trace) only evaluate."""
        private = self.dp is not None and train
        opened = self.coordinator.open_round(round_index, now, train=train, away=away,
                                             sample=self.dp.sample if private else None)
        self._book.opened_at = now  # artifacts sent since the last round closed count in this one
        plans = [self.plan_info(d).resolved for d in opened.train + opened.evaluate]
        self._round_weights = factorize_per_plan(self.global_state, plans) if self.global_state else {}
        self._secure_round = self.secure is not None and train
        plain = self.global_state and self.dp is None and not self._secure_round
        self._average = StreamingAverage(self.dense_shapes) if plain else None
        self._private_round = private
        if self._secure_round:
            self.secure.open(round_index, opened.train,
                             {d: self.coordinator.devices[d].num_train for d in opened.train})
        if private:
            self.dp.open_round()
        self._sent_weight = {}
        self._folds = FoldOrder(opened.train)
        if self.remote is not None:
            self.remote.open_round()
        if self.payloads is not None:
            self.payloads.open_round()
        return {d: self.task(d, now=now, wall=wall) for d in opened.train + opened.evaluate}

    def _weights(self, device_id: str) -> dict[str, np.ndarray]:
        """The global model at the device's plan (factorized once per plan and round; a device that got a new
        plan mid-round, e.g. rejoining at a lower tier, adds its plan)."""
        if not self.global_state:
            return {}
        resolved = self.plan_info(device_id).resolved
        if plan_key(resolved) not in self._round_weights:
            self._round_weights.update(factorize_per_plan(self.global_state, [resolved]))
        return self._round_weights[plan_key(resolved)]

    def task(self, device_id: str, *, now: float | None = None, wall: float | None = None) -> Task:
        """The open round's task for a device it asked (again, after a reconnect: counted each time sent). With
        ``wall`` (the wall time of ``now``) it carries the round's deadline on the wall clock; it names the
        aggregator its answer goes to, where aggregator processes fold."""
        opened = self.coordinator.open
        if opened is None or device_id not in opened.train + opened.evaluate:
            raise ValueError(f"round {'none' if opened is None else opened.round} does not ask {device_id}")
        plan = self.plan_info(device_id)
        weights = self._weights(device_id)
        training = device_id in opened.train
        config = self.config
        fit = self.algorithm.configure_fit(opened.round, bool(plan.resolved.ranks)) if training else None
        deadline = None if wall is None else wall + max(0.0, opened.deadline - now)
        secure = self.secure.spec_for(device_id) if self._secure_round and training else None
        # a secure round that could not be set up (too few participants) asks for nothing back: never in the clear
        returns = "none" if fit is None or (self._secure_round and secure is None) else fit.returns
        task = Task(round=opened.round, weights=weights, lam=fit.lam if fit else 0.0, mu=fit.mu if fit else 0.0,
                    lr=config.lr, phases=fit.phases if fit else (), batch_size=config.batch_size,
                    seed=batch_seed(config.seed, opened.round, device_id) if training else 0,
                    returns=returns, deadline=deadline, aggregator=self.route(device_id), secure=secure)
        if self.payloads is None:  # the tensors go with each task; else once per plan (see payload)
            self._book_down(plan, training, tensor_bytes(weights))
        return task

    def _book_down(self, plan: PlanInfo, training: bool, nbytes: int) -> None:
        if training:
            self._book.bytes_down += nbytes
        else:
            self._book.bytes_down_eval += nbytes
        self._book.count(tier_label(plan.ratio), "down" if training else EVAL_DIRECTION, nbytes)

    @property
    def shares_payloads(self) -> bool:
        """Whether a task names its plan's payload (published once per plan) instead of carrying the tensors."""
        return self.payloads is not None

    def payload(self, device_id: str, task: Task, now: float) -> tuple[PayloadRef, bytes | None]:
        """The open round's payload of the device's plan (``task``'s weights, plan_payloads.py): the reference
        its TASK carries, and the bytes to publish when they are not yet published this round (booked as sent down,
        once per plan)."""
        plan = self.plan_info(device_id)
        ref, data = self.payloads.get(plan_key(plan.resolved), task.weights, now)
        if data is not None:
            self._book_down(plan, device_id in self.coordinator.open.train, len(data))
        return ref, data

    def payload_wanted(self, device_id: str, ref: PayloadRef, now: float) -> bytes | None:
        """A device asks for payload ``ref`` again (it did not come whole, or one that did not match came): the bytes
        to publish again (booked), or None: not its plan's payload of the open round, or published moments ago."""
        opened = self.coordinator.open
        if self.payloads is None or opened is None or device_id not in opened.train + opened.evaluate:
            return None
        plan = self.plan_info(device_id)
        if self.payloads.ref_of(plan_key(plan.resolved)) != ref:
            return None
        data = self.payloads.requested(ref, now)
        if data is not None:
            self._book_down(plan, device_id in opened.train, len(data))
        return data

    def _expected_shapes(self, device_id: str) -> dict[str, tuple[int, ...]] | None:
        """The tensors a training update must carry (the algorithm's ``update_shapes`` of the device's plan).
        None for a device without a plan (unknown, or joined without one): the coordinator refuses its update."""
        record = self.coordinator.devices.get(device_id)
        if record is None or record.plan_hash is None:
            return None
        if self._secure_round:  # its change travels masked (secure_round), the update carries no tensor
            return {}
        personal = {k: tuple(v.shape) for k, v in self._initial(device_id).items()}
        return self.algorithm.update_shapes(self.plan_info(device_id).fe_shapes, personal)

    def receive(self, device_id: str, msg: Message, now: float) -> Verdict:
        """Judge an UPDATE that arrived on ``device_id``'s topic; an accepted training update is folded into
        the round's average in device-id order (see :meth:`_fold_ready`)."""
        verdict = self.coordinator.judge(device_id, Answer.of_message(msg), now,
                                         expected=self._expected_shapes(device_id),
                                         screen=self._screen if self.norm_bound else None)
        if not verdict.accepted or device_id not in self.coordinator.open.train:
            return verdict
        nbytes = tensor_bytes(msg.tensors)  # as sent: a clipped update is aggregated dense
        self._folds.hold(device_id, (verdict.update, nbytes), tensor_bytes(verdict.update.weights))
        self._fold_ready()
        return verdict

    def decline(self, device_id: str, round_index: int, problem: str) -> Verdict:
        """The device has no answer for ``round_index``: its round gave a non-finite loss or update
        (``device_runtime.task.non_finite``). Its answer counts as refused for that reason and nothing of it is
        aggregated; the updates waiting for its turn are folded."""
        verdict = self.coordinator.decline(device_id, round_index, f"{NON_FINITE}: {problem}")
        self._fold_ready()
        return verdict

    def _fold_ready(self, *, closing: bool = False) -> None:
        """Fold the held updates whose turn has come (``FoldOrder``: device-id order, never arrival order)."""
        for device_id, (update, nbytes) in self._folds.ready(self.coordinator.awaits, closing=closing):
            self._fold(device_id, update, nbytes)
        if self._folds.overflowing:
            LOG.warning("%d updates wait for a slower device: folded now, in id order among themselves",
                        len(self._folds.held))

    def _fold(self, device_id: str, update: Update, nbytes: int) -> None:
        if self._secure_round:  # its change is in the masked sum
            pass
        elif self._average is not None:
            self._average.add(as_torch(update.weights), update.num_samples)
        elif self.dp is not None:
            norm = self.dp.add(to_torch(update.weights), to_torch(self._weights(device_id)),
                               plan_key(self.plan_info(device_id).resolved))
            LOG.info("%s: update norm %.6g (DP clip %g)", device_id, norm, self.dp.mechanism.clip)
        self._count(device_id, update, nbytes)

    def _count(self, device_id: str, update: Update, nbytes: int) -> None:
        """Book an aggregated update: its plan's share of the round's weight, its bytes and training metrics."""
        book = self._book
        if self._average is not None:
            key = plan_key(self.plan_info(device_id).resolved)
            self._sent_weight[key] = self._sent_weight.get(key, 0.0) + update.num_samples
        book.bytes_up += nbytes
        book.count(tier_label(self.coordinator.devices[device_id].ratio), "up", nbytes)
        book.samples += update.num_samples
        book.loss_sum += update.train_loss * update.num_samples
        book.accuracy_sum += update.train_accuracy * update.num_samples

    def _screen(self, device_id: str, update: Update) -> Update | str:
        """--update-norm-bound: the update to aggregate (clipped where it clips), or why it does not count."""
        bounded, distance = bound_update(update, self.global_state, self.norm_bound)
        LOG.info("%s: update %.6g from the global FE (bound %g, %s)", device_id, distance, self.norm_bound.bound,
                 self.norm_bound.action.value)
        return rejection_reason(distance, self.norm_bound) if bounded is None else bounded

    # -- remote aggregation: aggregator processes hold the updates (server/aggregator.py) ----------------------

    @property
    def members(self) -> tuple[str, ...]:
        """The aggregators alive this round: each takes its devices' updates."""
        return self.remote.members if self.remote is not None else ()

    def set_members(self, members: list[str] | tuple[str, ...] | set[str]) -> None:
        """The aggregators that hold the open round's brief: the devices are routed over them."""
        self.remote.set_members(members)

    def route(self, device_id: str) -> str | None:
        """The aggregator whose topic takes ``device_id``'s update (``folding_records.route``), None when the
        engine reads the updates itself."""
        return self.remote.route(device_id) if self.remote is not None else None

    def routed_to(self, aggregator: str) -> list[str]:
        """The devices the open round still awaits whose updates go to ``aggregator``: what it may have missed
        while it was away from the broker, to ask again."""
        return [d for d in self.awaited() if self.route(d) == aggregator]

    def member_lost(self, aggregator: str) -> list[str]:
        """``aggregator`` stopped answering: for the rest of the round its receipts count for nothing, the updates it
        was told to fold are awaited again, and its devices go to the other members. Returns the devices to send
        their task again (naming their new member)."""
        moved = self.routed_to(aggregator)
        told = self.remote.member_lost(aggregator)
        if told is None:
            return []
        for device_id in told:
            self.coordinator.reopen(device_id)
        LOG.warning("aggregator %s stopped answering: %d device(s) go to %s%s", aggregator, len(moved) + len(told),
                    ", ".join(self.members) or "no member (none left)",
                    f"; its updates from {', '.join(told)} are asked for again" if told else "")
        return sorted(set(moved) | set(told))

    def brief(self, max_inbound: int) -> Brief:
        """What the aggregators need to check and fold the open round's updates."""
        opened = self.coordinator.open
        devices: dict[str, Asked] = {}
        plans: dict[str, dict[str, tuple[int, ...]]] = {}
        for device_id in opened.train + opened.evaluate:
            record = self.coordinator.devices[device_id]
            trains = device_id in opened.train
            devices[device_id] = Asked(record.plan_hash, record.num_train if trains else 0, trains)
            if trains:
                plans[record.plan_hash] = self._expected_shapes(device_id)
        if not self._private_round:
            return Brief(self.coordinator.run_id, opened.round, self.dense_shapes, plans, devices, max_inbound)
        # DP: the members apply the engine's own per-device rule (privacy.RoundChanges) at the round's clip, each Δ
        # against the weights its device was sent; the engine adds the noise once, over the merged sum
        sent = {devices[d].plan_hash: self._weights(d) for d in opened.train}
        return Brief(self.coordinator.run_id, opened.round, self.dense_shapes, plans, devices, max_inbound,
                     dp_clip=self.dp.round_clip, sent=sent)

    def receive_receipt(self, aggregator: str, receipt: Receipt, now: float) -> Verdict:
        """Judge an update ``aggregator`` verified and holds, from its receipt: every rule of :meth:`receive` but
        the tensors' (the aggregator checked them against the brief), plus the device's counter above the last one
        accepted. An accepted training update is one that aggregator is told to fold, and must show in its partial."""
        opened = self.coordinator.open
        return self.remote.receive_receipt(
            aggregator, receipt, lambda: self.coordinator.judge(receipt.device_id, receipt.answer(), now),
            trains=opened is not None and receipt.device_id in opened.train)

    def partials_missing(self) -> list[str]:
        """Aggregators told to fold updates this round whose partial sums have not come."""
        return self.remote.partials_missing() if self.remote is not None else []

    def fold_list(self, aggregator: str) -> list[str]:
        """The devices whose updates ``aggregator`` was told to fold this round, as its CLOSE names them."""
        return self.remote.fold_list(aggregator)

    def told_to_fold(self) -> dict[str, int]:
        """Aggregator -> how many of the open round's updates it was told to fold."""
        return self.remote.told_to_fold() if self.remote is not None else {}

    def receive_partial(self, aggregator: str, partial: Partial) -> str | None:
        """Take ``aggregator``'s partial sums of the open round; returns why they do not count, or None."""
        opened = self.coordinator.open
        return self.remote.receive_partial(aggregator, partial, None if opened is None else opened.round,
                                           dp_clip=self.dp.round_clip if self._private_round else None)

    def _merge_partials(self, round_index: int) -> None:
        """Merge the partials that came and book their updates (in device-id order); an aggregator's updates
        without its partial count as not delivered."""
        merged, lost = self.remote.merge(round_index, lambda partial: (
            self.dp if self._private_round else self._average).merge(partial))  # DP: into the round's clipped sum
        for device_id, reason in lost.items():
            self.coordinator.withdraw(device_id, reason)
        for device_id in sorted(merged):
            self._count(device_id, *merged[device_id])

    def close_round(self, now: float, *, wire: tuple[int, int] | None = None,
                    sim_time: float | None = None) -> tuple[RoundResult, dict[str, Any] | None]:
        """Close the open round: aggregate when enough delivered (else keep the model), record it (``wire``: the
        bytes the transport sent and took during the round, where it counts them; ``sim_time``: the simulator's
        virtual clock at the close), and complete the previous
        round's record with the evaluations that came in. Returns the result and the record completed now (None
        for the first round)."""
        self._fold_ready(closing=True)
        if self.remote is not None and self.coordinator.open is not None:
            self._merge_partials(self.coordinator.open.round)
        result = self.coordinator.close_round(now)
        for device_id, reason in result.dropped.items():
            if reason == NO_ANSWER:
                LOG.warning("round %d closed at its deadline without %s's answer", result.round, device_id)
                if device_id in self._lost:
                    self.demote(device_id, f"went offline during round {result.round} and missed it")
        self._lost = {}
        self._stop_if_diverged(result)
        training = bool(result.train) or self._private_round  # a Poisson sample may be empty: DP still releases
        if not training and self._pending is not None:  # the evaluation after the last round: its downloads
            self._pending.add_evaluation_bytes(self._book)  # belong to the last round's record
        completed = self._complete_previous(result)
        if training:
            self._pending = self._training_record(result, now, wire, sim_time)
        self._book = RoundBook(now)
        return result, completed

    def divergence_cause(self) -> str:
        """Why devices' training may diverge on this run's model: the DP noise where there is some, else the step."""
        if self.dp is not None:
            return noise_cause(self.dp.settings, self.dp.mechanism.clip)
        return f"lower --lr (now {self.config.lr:g})"

    def _stop_if_diverged(self, result: RoundResult) -> None:
        """Every training device of the round went non-finite on the model it was sent: that model trains nothing,
        so the run stops, naming why, instead of releasing round after round of it (the checkpoint keeps the rounds
        before)."""
        trained = [result.dropped.get(d, "") for d in result.train]
        if trained and not result.accepted and all(why.startswith(NON_FINITE) for why in trained):
            raise RunError(f"round {result.round}: every training device's round went non-finite on the model of "
                           f"round {result.round - 1} ({trained[0]}); {self.divergence_cause()}")

    def _aggregate(self) -> dict[str, torch.Tensor]:
        """The new global model from the round's accepted updates: the algorithm's aggregate_fit over their
        float64 sample-weighted mean (each client's tensors reconstructed to full rank), under --aggregate; with
        DP, the global model plus the round's noised mean of clipped updates (``server.engine.privacy``)."""
        if self.dp is not None and not self._secure_round:
            return self.dp.aggregate(self.global_state)
        def sent_mean() -> dict[str, torch.Tensor]:
            sent = StreamingAverage(self.dense_shapes)  # Σ p_k S_k, one factor set per plan
            for key, weight in self._sent_weight.items():
                sent.add(to_torch(self._round_weights[key]), weight)
            return sent.result(torch.float64)
        return self.algorithm.aggregate_fit(self.global_state, self._average.result(torch.float64), sent_mean,
                                            self.config.aggregate)

    def _training_record(self, result: RoundResult, now: float, wire: tuple[int, int] | None,
                         sim_time: float | None = None) -> TrainingRecord:
        folding = self._average is not None or self.dp is not None or self._secure_round
        secagg = self._secure_step(result, now) if self._secure_round else None
        aggregated = result.enough and folding if secagg is None else secagg["aggregated"]
        if aggregated and secagg is None:
            self._release(result.round, self._aggregate())
        elif folding and not result.enough:
            LOG.warning("round %d: %d of %d updates, below --min-completion %g: the global model is kept",
                        result.round, len(result.accepted), len(result.train), self.coordinator.config.min_completion)
        tiers = {d: tier_label(self.coordinator.devices[d].ratio) for d in result.train + result.evaluate}
        return TrainingRecord.of(result, self._book, aggregated=aggregated,
                                 algorithm=self.algorithm.name, aggregate=self.config.aggregate, tiers=tiers,
                                 now=now, wire=wire, sim_time=sim_time,
                                 epsilon=None if self.dp is None else self.dp.epsilon, secagg=secagg)

    def _release(self, round_: int, model: dict[str, torch.Tensor]) -> None:
        """``model`` becomes the global model; a non-finite one is never published, evaluated or checkpointed."""
        if not finite(model):
            raise RunError(f"round {round_}: the new global model is not finite, so it is not released; "
                           f"{self.divergence_cause()}")
        self.global_state = model

    def _secure_step(self, result: RoundResult, now: float) -> dict[str, Any]:
        """Unmask the round's sum and take its step (when enough devices answered); the record's ``secagg``. What
        the exchanges moved counts as the round's bytes up (into the server) and down (out of it)."""
        step = self.secure.step(now, self.dp.expected if self.dp is not None else None) if result.enough else None
        if step is not None:
            self._release(result.round, {k: (v.double() + torch.from_numpy(step[k])).to(v.dtype)
                                         for k, v in self.global_state.items()})
        summary = dict(self.secure.summary(), aggregated=step is not None)
        if not result.enough and not summary.get("failure"):
            summary["failure"] = (f"{len(result.accepted)} of {len(result.train)} updates, below --min-completion "
                                  f"{self.coordinator.config.min_completion:g}")
        for phase in summary.get("phases", {}).values():
            self._book.bytes_up += phase["bytes_in"]
            self._book.bytes_down += phase["bytes_out"]
        server = self.secure.server
        for device_id in server.masked if server is not None else ():  # each survivor's masked vector, by tier
            self._book.count(tier_label(self.coordinator.devices[device_id].ratio), "up", server.masked_bytes)
        return summary

    def _complete_previous(self, result: RoundResult) -> dict[str, Any] | None:
        """The evaluations that came with this round measure the previous round's model: finish its record."""
        if self._pending is None:
            return None
        record = self._pending.completed(result.evaluations)
        self.records.append(record)
        self._pending = None
        return record

    # -- checkpoints ----------------------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """JSON-able state (the global model is saved beside it as tensors; an open round is not kept)."""
        return {"registry": self.coordinator.to_state(), "records": self.records,
                "pending": None if self._pending is None else self._pending.to_state(), "demoted": self.demoted,
                "privacy": None if self.dp is None else self.dp.to_state(), "kinds": self.kinds}

    def state_tensors(self) -> dict[str, np.ndarray]:
        """Tensors of the engine's state saved beside the global model (none in sync mode: an open round is not
        kept)."""
        return {}

    def restore(self, state: dict[str, Any], global_state: dict[str, np.ndarray]) -> None:
        """Continue from ``to_state``; ``global_state``: the checkpoint's tensors (the global model's are taken)."""
        self.coordinator.restore(state["registry"])
        self.records = state["records"]
        self._pending = None if state["pending"] is None else TrainingRecord.from_state(state["pending"])
        self.demoted = dict(state.get("demoted", {}))
        self.kinds = dict(state.get("kinds", {}))  # a checkpoint of an earlier version: every device portable
        if self.dp is not None and state.get("privacy") is not None:  # the budget spent goes on being spent
            self.dp.restore(state["privacy"])
        if self.dense_shapes:
            self.global_state = to_torch({k: global_state[k] for k in self.dense_shapes})

    def global_arrays(self) -> dict[str, np.ndarray]:
        return to_numpy(self.global_state)
