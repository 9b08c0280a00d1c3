"""The round engine: every decision of a federation, for any algorithm, with no I/O.

It owns the device registry and round state machine (``server.coordinator``), the rank tier of each device,
the plans it is sent (artifact files only when it lacks them, at most ``MAX_PLAN_RESENDS`` times after it
says it lost them), the tasks of a round, which updates count, the aggregation, the evaluation bookkeeping
and each round's record. Every method takes the time ``now`` where time matters and returns what to send;
the two drivers, in-process devices (``server.simulate``) and MQTT devices (``server.broker_loop``), deliver
it. So a rule is found once, here, and both drivers run the same federation.

Evaluation is piggy-backed: every task of round t+1 first makes a device evaluate the weights it received
(round t's model with its own head), so round t's record is completed when round t+1 closes; after the last
round an evaluate-only round completes it.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from device_runtime.artifact_contract import PORTABLE_KIND
from device_runtime.messages import Join, Plan
from device_runtime.profile import ResourceProfile
from device_runtime.envelope import Message
from device_runtime.task import Task, Update, tensor_bytes
from server.aggregate import StreamingAverage
from server.aggregation_wire import Asked, Brief, Partial, Receipt, route
from server.algorithms.base import Algorithm
from server.coordinator import NO_ANSWER, Coordinator, RoundResult, Verdict
from fedcore.lowrank import ResolvedPlan
from server.rank_assignment import choose_ratio
from server.report import EVAL_DIRECTION, TIER_DIRECTIONS, evaluation_summary
from server.robust import bound_update, rejection_reason
from server.run_config import FederationConfig, NormBound
from server.strategy import batch_seed, factorize_per_plan, plan_key, to_numpy, to_torch

LOG = logging.getLogger("fedara.engine")
MAX_PLAN_RESENDS = 3
MAX_HELD_BYTES = 256 << 20
"""Accepted updates that may wait for a slower, lower-id device before being folded (order-independence)."""
DENSE = 1.0


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


def tier_label(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:g}"


@dataclass
class _Book:
    """What a round moved and how its training went."""

    opened_at: float
    bytes_down: int = 0
    bytes_down_eval: int = 0
    bytes_up: int = 0
    bytes_artifacts: int = 0
    by_tier: dict[str, dict[str, int]] = field(default_factory=dict)
    samples: int = 0
    loss_sum: float = 0.0
    accuracy_sum: float = 0.0

    def count(self, tier: str, direction: str, nbytes: int) -> None:
        self.by_tier.setdefault(tier, dict.fromkeys((*TIER_DIRECTIONS, EVAL_DIRECTION), 0))[direction] += nbytes


class RoundEngine:
    """One run's federation state and rules (see the module docstring)."""

    def __init__(self, algorithm: Algorithm, config: FederationConfig, coordinator: Coordinator, plans: PlanSource,
                 global_state: dict[str, torch.Tensor], initial_personal: dict[str, dict[str, np.ndarray]], *,
                 tiers: tuple[float, ...], overrides: dict[str, float] | None = None,
                 device_models: dict[str, str] | None = None,
                 predictor: Predictor | None = None, norm_bound: NormBound | None = None, remote: bool = False):
        self.algorithm, self.config, self.coordinator, self.plans = algorithm, config, coordinator, plans
        self.global_state = global_state
        self.initial_personal = initial_personal  # model name -> what a device of that model starts from
        self.device_models = dict(device_models or {})  # device -> its model, where devices differ (local only)
        if len(set(self.device_models.values())) > 1 and algorithm.aggregates:
            raise ValueError(f"--model with several models ({', '.join(sorted(set(self.device_models.values())))}) "
                             f"needs --algo local: {algorithm.name} shares one model")
        self.tiers = tiers if algorithm.factorizes else (DENSE,)
        self.overrides = dict(overrides or {}) if algorithm.factorizes else {}
        self.predictor = predictor
        self.norm_bound = norm_bound
        if remote and (norm_bound is not None or not algorithm.aggregates):
            raise ValueError("--aggregators: aggregator processes fold the updates of an algorithm that aggregates "
                             f"({algorithm.name} {'does not' if not algorithm.aggregates else 'does'}), without "
                             "--update-norm-bound (the engine never sees their tensors)")
        self.remote = remote  # aggregator processes hold the updates (server/aggregator.py); the engine judges receipts
        self.dense_shapes = {k: tuple(v.shape) for k, v in global_state.items()}
        self.records: list[dict[str, Any]] = []
        self.pending: dict[str, Any] | None = None  # round t's record, awaiting round t+1's evaluations
        self.kinds: dict[str, str] = {}  # device -> the artifact kind its runtime runs
        self.profiles: dict[str, ResourceProfile] = {}  # device -> the resources its last JOIN reported
        self.demoted: dict[str, float] = {}  # device -> the tier it is held below after it died in a round
        self._lost: dict[str, float] = {}  # device -> its tier when it went offline during the open round
        self._resends: dict[str, int] = {}
        self._files_sent: dict[str, str] = {}  # device -> plan hash whose files it was last sent
        self._round_weights: dict[tuple, dict[str, np.ndarray]] = {}
        self._average: StreamingAverage | None = None
        self._fold_order: list[str] = []
        self._next = 0
        self._held: dict[str, tuple[Update, int]] = {}
        self._held_bytes = 0
        self._book = _Book(0.0)
        self._update_counters: dict[str, int] = {}  # device -> counter of its last update accepted from a receipt
        self._told: dict[str, dict[str, tuple[Update, int]]] = {}  # aggregator -> device -> (update, bytes) to fold
        self._partials: dict[str, Partial] = {}
        self.members: tuple[str, ...] = ()  # the aggregators alive this round: each takes its devices' updates

    # -- devices --------------------------------------------------------------------------------

    def plan_info(self, device_id: str) -> PlanInfo:
        record = self.coordinator.devices[device_id]
        return self.plans.get(record.ratio, self.kinds.get(device_id, PORTABLE_KIND), self.device_models.get(device_id))

    def _choose_ratio(self, device_id: str, profile: ResourceProfile, budget_mb: float | None,
                      shard_samples: int) -> float:
        tiers, overrides = self.tiers, self.overrides
        if device_id in self.demoted:  # it died at its tier: below it, whatever an override said
            tiers = tuple(t for t in tiers if t < self.demoted[device_id]) or (min(tiers),)
            overrides = {}
        if self.predictor is None or len(tiers) == 1:
            return overrides.get(device_id, tiers[0])
        predict = self.predictor(profile, shard_samples)
        ratio = choose_ratio(device_id, budget_mb, tiers, predict, overrides)
        if budget_mb is not None and predict(ratio) > budget_mb and device_id not in overrides:
            LOG.warning("%s: no tier fits its %.0f MiB budget; smallest tier %g (predicted %.1f MiB)",
                        device_id, budget_mb, ratio, predict(ratio))
        return ratio

    def join(self, device_id: str, join: Join) -> Admission:
        """Admit a device (or say why not) and give it its plan, as artifacts of the kind its runtime runs: its
        tier is chosen once per run, from its memory budget and the cost model, unless an override names it or
        it was demoted."""
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
        if self.algorithm.factorizes and self.coordinator.awaits(device_id) and min(self.tiers) < record.ratio:
            self._lost.setdefault(device_id, record.ratio)
            LOG.info("%s went offline during round %d at tier %g: a lower tier if it misses the round",
                     device_id, opened.round, record.ratio)

    def demote(self, device_id: str, evidence: str) -> None:
        """Evidence that the device's tier does not fit it (``evidence`` says which): when it joins again it gets
        a lower tier than the one it had."""
        record = self.coordinator.devices.get(device_id)
        if record is None or record.ratio is None or not self.algorithm.factorizes or min(self.tiers) >= record.ratio:
            return
        self.demoted[device_id] = min(record.ratio, self.demoted.get(device_id, record.ratio))
        LOG.warning("%s %s at tier %g: it gets a lower tier when it rejoins", device_id, evidence, record.ratio)

    # -- rounds ---------------------------------------------------------------------------------

    def open_round(self, round_index: int, now: float, *, train: bool = True) -> dict[str, Task]:
        """Open a round; returns each asked device's task (trainers train, the others only evaluate)."""
        opened = self.coordinator.open_round(round_index, now, train=train)
        self._book.opened_at = now  # artifacts sent since the last round closed count in this one
        plans = [self.plan_info(d).resolved for d in opened.train + opened.evaluate]
        self._round_weights = factorize_per_plan(self.global_state, plans) if self.algorithm.aggregates else {}
        self._average = StreamingAverage(self.dense_shapes) if self.algorithm.aggregates else None
        self._sent_weight: dict[tuple, float] = {}  # plan -> Σ samples of its accepted updates (the updates rule)
        self._fold_order, self._next = sorted(self.coordinator.open.train), 0
        self._held: dict[str, tuple[Update, int]] = {}  # accepted, waiting for a lower id to be folded first
        self._held_bytes = 0
        self._told, self._partials = {}, {}
        return {d: self.task(d) for d in opened.train + opened.evaluate}

    def _weights(self, device_id: str) -> dict[str, np.ndarray]:
        """The global model at the device's plan (factorized once per plan and round; a device that got a new
        plan mid-round, e.g. rejoining at a lower tier, adds its plan)."""
        if not self.algorithm.aggregates:
            return {}
        resolved = self.plan_info(device_id).resolved
        if plan_key(resolved) not in self._round_weights:
            self._round_weights.update(factorize_per_plan(self.global_state, [resolved]))
        return self._round_weights[plan_key(resolved)]

    def task(self, device_id: str, deadline: float | None = None) -> Task:
        """The open round's task for a device it asked (again, after a reconnect: counted each time sent)."""
        opened = self.coordinator.open
        if opened is None or device_id not in opened.train + opened.evaluate:
            raise ValueError(f"round {'none' if opened is None else opened.round} does not ask {device_id}")
        plan = self.plan_info(device_id)
        weights = self._weights(device_id)
        training = device_id in opened.train
        algo, config = self.algorithm, self.config
        task = Task(round=opened.round, weights=weights,
                    lam=algo.lam(opened.round, config.lam, config.lam_warmup) if training else 0.0,
                    mu=algo.mu(config.mu, bool(plan.resolved.ranks)) if training else 0.0, lr=config.lr,
                    phases=algo.phases(config.local_epochs) if training else (), batch_size=config.batch_size,
                    seed=batch_seed(config.seed, opened.round, device_id) if training else 0,
                    returns=algo.returns if training else "none", deadline=deadline, aggregator=self.route(device_id))
        nbytes = tensor_bytes(weights)
        if training:
            self._book.bytes_down += nbytes
        else:
            self._book.bytes_down_eval += nbytes
        self._book.count(tier_label(plan.ratio), "down" if training else EVAL_DIRECTION, nbytes)
        return task

    def _expected_shapes(self, device_id: str) -> dict[str, tuple[int, ...]] | None:
        """The tensors a training update must carry: the plan's FE, plus the head for FedAvg, none for local.
        None for a device without a plan (unknown, or joined without one): the coordinator refuses its update."""
        record = self.coordinator.devices.get(device_id)
        if record is None or record.plan_hash is None:
            return None
        if not self.algorithm.aggregates:
            return {}
        shapes = dict(self.plan_info(device_id).fe_shapes)
        if self.algorithm.shares_head:
            shapes.update({k: tuple(v.shape) for k, v in self._initial(device_id).items()})
        return shapes

    def receive(self, device_id: str, msg: Message, now: float) -> Verdict:
        """Judge an UPDATE that arrived on ``device_id``'s topic; an accepted training update is folded into
        the round's average in device-id order (see :meth:`_fold_ready`)."""
        verdict = self.coordinator.judge(device_id, msg, now, expected=self._expected_shapes(device_id),
                                         screen=self._screen if self.norm_bound else None)
        if not verdict.accepted or device_id not in self.coordinator.open.train:
            return verdict
        nbytes = tensor_bytes(msg.tensors)  # as sent: a clipped update is aggregated dense
        self._held[device_id] = (verdict.update, nbytes)
        self._held_bytes += tensor_bytes(verdict.update.weights)
        self._fold_ready()
        return verdict

    def _fold_ready(self, *, closing: bool = False) -> None:
        """Fold held updates into the average in device-id order, never in arrival order: float sums depend on
        their order, and a run must not depend on which device answered first. An update waits only for the
        training devices before it that may still answer; past ``MAX_HELD_BYTES`` of waiting updates they are
        folded at once (in id order among themselves) and the run says so."""
        order = self._fold_order
        while self._next < len(order):
            device_id = order[self._next]
            if device_id in self._held:
                self._fold(device_id)
            elif not (closing or self._held_bytes > MAX_HELD_BYTES) and self.coordinator.awaits(device_id):
                break
            self._next += 1
        if self._held_bytes > MAX_HELD_BYTES:
            LOG.warning("%d updates wait for a slower device: folded now, in id order among themselves",
                        len(self._held))

    def _fold(self, device_id: str) -> None:
        update, nbytes = self._held.pop(device_id)
        self._held_bytes -= tensor_bytes(update.weights)
        if self._average is not None:
            self._average.add(to_torch(update.weights), update.num_samples)
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

    def set_members(self, members: list[str] | tuple[str, ...] | set[str]) -> None:
        """The aggregators that hold the open round's brief: the devices are routed over them."""
        self.members = tuple(sorted(members))

    def route(self, device_id: str) -> str | None:
        """The aggregator whose topic takes ``device_id``'s update (``aggregation_wire.route``), None when the
        engine reads the updates itself."""
        return route(device_id, self.members) if self.remote else None

    def routed_to(self, aggregator: str) -> list[str]:
        """The devices the open round still awaits whose updates go to ``aggregator``: what it may have missed
        while it was away from the broker, to ask again."""
        return [d for d in sorted(self.coordinator.devices)
                if self.coordinator.awaits(d) and self.route(d) == aggregator]

    def member_lost(self, aggregator: str) -> list[str]:
        """``aggregator`` stopped answering: for the rest of the round its receipts count for nothing, the updates it
        was told to fold are awaited again, and its devices go to the other members. Returns the devices to send
        their task again (naming their new member)."""
        if aggregator not in self.members:
            return []
        moved = self.routed_to(aggregator)
        self.members = tuple(m for m in self.members if m != aggregator)
        told = sorted(self._told.pop(aggregator, {}))
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
        return Brief(self.coordinator.run_id, opened.round, self.dense_shapes, plans, devices, max_inbound)

    def receive_receipt(self, aggregator: str, receipt: Receipt, now: float) -> Verdict:
        """Judge an update ``aggregator`` verified and holds, from its receipt: every rule of :meth:`receive` but
        the tensors' (the aggregator checked them against the brief), plus the device's counter above the last one
        accepted. An accepted training update is one that aggregator is told to fold, and must show in its partial."""
        device_id = receipt.device_id
        if aggregator not in self.members:
            return Verdict(False, f"{aggregator} is not a member of round {receipt.round}'s aggregation")
        last = self._update_counters.get(device_id, 0)
        if receipt.counter <= last:
            return Verdict(False, f"replay: counter {receipt.counter} is not above the last accepted {last}")
        verdict = self.coordinator.judge(device_id, receipt.as_update(), now, expected={})
        if verdict.accepted:
            self._update_counters[device_id] = receipt.counter
            if device_id in self.coordinator.open.train:
                self._told.setdefault(aggregator, {})[device_id] = (verdict.update, receipt.nbytes)
        return verdict

    def partials_missing(self) -> list[str]:
        """Aggregators told to fold updates this round whose partial sums have not come."""
        return sorted(set(self._told) - set(self._partials))

    def fold_list(self, aggregator: str) -> list[str]:
        """The devices whose updates ``aggregator`` was told to fold this round, as its CLOSE names them."""
        return sorted(self._told.get(aggregator, {}))

    def told_to_fold(self) -> dict[str, int]:
        """Aggregator -> how many of the open round's updates it was told to fold."""
        return {aggregator: len(told) for aggregator, told in self._told.items()}

    def receive_partial(self, aggregator: str, partial: Partial) -> str | None:
        """Take ``aggregator``'s partial sums of the open round; returns why they do not count, or None. They count
        only over exactly the updates it was told to fold, with their sample counts and the model's tensors."""
        opened = self.coordinator.open
        if opened is None or partial.round != opened.round:
            open_now = "no round" if opened is None else f"round {opened.round}"
            return f"partial of round {partial.round}, {open_now} is open"
        if aggregator in self._partials:
            return "its partial for this round was already taken"
        told = self._told.get(aggregator, {})
        if sorted(partial.devices) != sorted(told):
            return f"it folded {sorted(partial.devices)}, it was told to fold {sorted(told)}"
        weight = sum(update.num_samples for update, _ in told.values())
        if partial.sum.count != len(told) or partial.sum.total_weight != weight:
            return (f"{partial.sum.count} updates of weight {partial.sum.total_weight:g}, expected {len(told)} of "
                    f"weight {weight:g}")
        shapes = {k: tuple(v.shape) for k, v in partial.sum.sums.items()}
        if shapes != self.dense_shapes or not all(bool(v.isfinite().all()) for v in partial.sum.sums.values()):
            return "its sums do not have the model's tensors, or hold NaN or infinity"
        self._partials[aggregator] = partial
        return None

    def _merge_partials(self, round_index: int) -> None:
        """Merge the partials that came (in aggregator order) and book their updates (in device-id order); an
        aggregator's updates without its partial count as not delivered."""
        merged: dict[str, tuple[Update, int]] = {}
        for aggregator in sorted(self._told):
            told = self._told[aggregator]
            partial = self._partials.get(aggregator)
            if partial is None:
                LOG.warning("round %d: no partial sums from aggregator %s: its %d update(s) from %s count as not "
                            "delivered", round_index, aggregator, len(told), ", ".join(sorted(told)))
                for device_id in sorted(told):
                    self.coordinator.withdraw(device_id, f"aggregator {aggregator} sent no partial sums")
                continue
            self._average.merge(partial.sum)
            merged.update(told)
        for device_id in sorted(merged):
            self._count(device_id, *merged[device_id])

    def close_round(self, now: float) -> tuple[RoundResult, dict[str, Any] | None]:
        """Close the open round: aggregate when enough delivered (else keep the model), record it, and
        complete the previous round's record with the evaluations that came in. Returns the result and the
        record completed now (None for the first round)."""
        self._fold_ready(closing=True)
        if self.remote and self.coordinator.open is not None:
            self._merge_partials(self.coordinator.open.round)
        result = self.coordinator.close_round(now)
        for device_id, reason in result.dropped.items():
            if reason == NO_ANSWER:
                LOG.warning("round %d closed at its deadline without %s's answer", result.round, device_id)
                if device_id in self._lost:
                    self.demote(device_id, f"went offline during round {result.round} and missed it")
        self._lost = {}
        completed = self._complete_previous(result)
        if result.train:
            self.pending = self._training_record(result, now)
        else:  # the evaluation after the last round: its downloads belong to the last round's record
            self._fold_eval_bytes(completed)
        self._book = _Book(now)
        return result, completed

    def _aggregate(self) -> dict[str, torch.Tensor]:
        """The new global model from the round's accepted updates, under --aggregate.

        weights: Σ p_k W_k, each client's tensors reconstructed to full rank. updates: ω + Σ p_k (W_k − S_k),
        S_k what client k was sent (its plan's factorization of ω); a dense client's S_k is ω itself, so dense
        layers and dense clients aggregate the same under both rules. Only one factor set per plan is kept."""
        mean = self._average.result(torch.float64)
        if self.config.aggregate == "weights":
            return {k: v.float() for k, v in mean.items()}
        sent = StreamingAverage(self.dense_shapes)
        for key, weight in self._sent_weight.items():
            sent.add(to_torch(self._round_weights[key]), weight)
        sent_mean = sent.result(torch.float64)
        return {k: (self.global_state[k].double() + mean[k] - sent_mean[k]).float() for k in mean}

    def _training_record(self, result: RoundResult, now: float) -> dict[str, Any]:
        if result.enough and self._average is not None:
            self.global_state = self._aggregate()
        elif self.algorithm.aggregates:
            LOG.warning("round %d: %d of %d updates, below --min-completion %g: the global model is kept",
                        result.round, len(result.accepted), len(result.train), self.coordinator.config.min_completion)
        book = self._book
        tiers = {d: tier_label(self.coordinator.devices[d].ratio) for d in result.train + result.evaluate}
        return {"round": result.round, "participants": len(result.accepted), "selected": len(result.train),
                "dropped": result.dropped, "aggregated": result.enough and self.algorithm.aggregates,
                "algorithm": self.algorithm.name, "aggregate": self.config.aggregate,
                "closed_by": result.closed_by,
                "train_loss": book.loss_sum / book.samples if book.samples else None,
                "train_accuracy": book.accuracy_sum / book.samples if book.samples else None,
                "bytes_down": book.bytes_down, "bytes_up": book.bytes_up, "bytes_artifacts": book.bytes_artifacts,
                "bytes_down_eval": book.bytes_down_eval, "bytes_by_tier": book.by_tier, "tiers": tiers,
                "seconds": now - book.opened_at}

    def _complete_previous(self, result: RoundResult) -> dict[str, Any] | None:
        """The evaluations that came with this round measure the previous round's model: finish its record."""
        if self.pending is None:
            return None
        tiers = self.pending.pop("tiers")
        per_device = {d: {"accuracy": e.correct / e.total if e.total else None, "tier": tiers.get(d, "-")}
                      for d, e in sorted(result.evaluations.items())}
        # In device-id order, not arrival order: the std and mean loss (float sums) must not depend on timing.
        ordered = [result.evaluations[d] for d in sorted(result.evaluations)]
        record = dict(self.pending, **evaluation_summary(ordered), per_device=per_device,
                      per_tier=_per_tier(result.evaluations, tiers))
        self.records.append(record)
        self.pending = None
        return record

    def _fold_eval_bytes(self, record: dict[str, Any] | None) -> None:
        if record is None:
            return
        record["bytes_down_eval"] += self._book.bytes_down_eval
        for tier, counts in self._book.by_tier.items():
            bucket = record["bytes_by_tier"].setdefault(tier, dict.fromkeys((*TIER_DIRECTIONS, EVAL_DIRECTION), 0))
            for direction, nbytes in counts.items():
                bucket[direction] += nbytes

    # -- checkpoints ----------------------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """JSON-able state (the global model is saved beside it as tensors; an open round is not kept)."""
        return {"registry": self.coordinator.to_state(), "records": self.records, "pending": self.pending,
                "demoted": self.demoted}

    def restore(self, state: dict[str, Any], global_state: dict[str, np.ndarray]) -> None:
        self.coordinator.restore(state["registry"])
        self.records, self.pending = state["records"], state["pending"]
        self.demoted = dict(state.get("demoted", {}))
        if global_state:
            self.global_state = to_torch(global_state)

    def global_arrays(self) -> dict[str, np.ndarray]:
        return to_numpy(self.global_state)


def _per_tier(evaluations: dict, tiers: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Accuracy (Σ correct / Σ total) and device count per rank tier."""
    out: dict[str, dict[str, Any]] = {}
    for device_id, e in evaluations.items():
        bucket = out.setdefault(tiers.get(device_id, "-"), {"correct": 0, "total": 0, "devices": 0})
        bucket["correct"] += e.correct
        bucket["total"] += e.total
        bucket["devices"] += 1
    return {t: {"accuracy": b["correct"] / b["total"] if b["total"] else None, "devices": b["devices"]}
            for t, b in sorted(out.items())}

