"""The federation's state machine, transport-free: which devices are in, which round is open, which updates count.

Every method takes the time ``now`` (monotonic seconds) explicitly and does no I/O: the broker loop feeds
it what arrives and acts on what it returns. An update is accepted only when it answers the open round's
task for that device under the one rule of ``server.engine.update_rule``, for this run, before the deadline, with an
evaluation that fits the test samples the device declared; otherwise the Verdict says why not. A caller may add a last screen of well-formed training updates (the
robust-aggregation rule), which can refuse an update or change what is aggregated. A round closes when every
device asked has answered (accepted or rejected) or at its deadline; it counts when at least
``min_completion`` of its training devices delivered.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from device_runtime.messages import Join, MessageError
from device_runtime.task import Update
from server.engine.sampling import sample_clients
from server.engine.update_rule import Answer, Asked, body_problem, header_problem

ALL_ANSWERED = "all answered"
DEADLINE = "deadline"
NO_ANSWER = "no answer by the deadline"
NON_FINITE = "non-finite"
"""The reason's prefix of a device that declined its round: its loss or update was NaN or inf."""
EVAL_KEYS = ("eval_correct", "eval_total", "eval_loss")
BASELINE_KEYS = ("eval_majority", "eval_classes")
"""What an evaluation is read beside (device_runtime.baseline): the test split's majority-class count and how many
classes the model answered; optional (a device that does not send them shows no baseline)."""

Screen = Callable[[str, Update], "Update | str"]
"""A last check of a well-formed training update, (device id, update) -> the update to aggregate, or why it
does not count."""


@dataclass(frozen=True)
class CoordinatorConfig:
    """What the coordinator decides with: the model's input, how many devices a round needs, and its timing (the
    join ratio and min completion come from a checked ``FederationConfig``)."""

    input_shape: tuple[int, ...]
    num_classes: int
    min_devices: int = 1
    join_ratio: float = 1.0
    seed: int = 0
    round_deadline_s: float = 300.0
    min_completion: float = 0.5

    def __post_init__(self) -> None:
        if self.min_devices < 1:
            raise ValueError(f"min_devices must be >= 1, got {self.min_devices}")
        if not self.round_deadline_s > 0:
            raise ValueError(f"round deadline must be positive, got {self.round_deadline_s}")


@dataclass
class DeviceRecord:
    """One device as the server knows it."""

    device_id: str
    online: bool = False
    num_train: int = 0
    num_test: int = 0
    budget_mb: float | None = None
    ratio: float | None = None
    plan_hash: str | None = None
    ready: bool = False  # it acknowledged its plan: its artifacts are installed
    artifacts: set[str] = field(default_factory=set)  # artifact hashes it holds

    def to_state(self) -> dict[str, Any]:
        return dict(asdict(self), artifacts=sorted(self.artifacts))

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> DeviceRecord:
        """A record restored from a checkpoint: offline until its status says otherwise."""
        known = {k: v for k, v in state.items() if k in cls.__dataclass_fields__}
        return cls(**dict(known, online=False, artifacts=set(state["artifacts"])))


@dataclass(frozen=True)
class RoundOpen:
    """Who is asked what in a round: ``train`` devices train, ``evaluate`` devices only evaluate."""

    round: int
    train: tuple[str, ...]
    evaluate: tuple[str, ...]
    deadline: float


@dataclass(frozen=True)
class Evaluation:
    correct: int
    total: int
    loss: float
    majority: int | None = None  # the test split's most common label's count
    classes: int | None = None  # distinct classes the model answered


@dataclass(frozen=True)
class Verdict:
    """Whether an update counts; ``reason`` says why not. ``update`` is set when accepted."""

    accepted: bool
    reason: str = ""
    update: Update | None = None


@dataclass(frozen=True)
class RoundResult:
    round: int
    train: tuple[str, ...]
    evaluate: tuple[str, ...]
    accepted: tuple[str, ...]  # training devices whose update was aggregated, in arrival order
    dropped: dict[str, str]  # device -> why its answer does not count (rejected, or none by the deadline)
    evaluations: dict[str, Evaluation]  # device -> its evaluation of the model it received
    closed_by: str  # ALL_ANSWERED or DEADLINE
    enough: bool  # at least min_completion of the training devices delivered: aggregate


@dataclass
class _OpenRound:
    plan: RoundOpen
    answered: dict[str, str] = field(default_factory=dict)  # device -> "" (accepted) or the rejection reason
    accepted: list[str] = field(default_factory=list)
    evaluations: dict[str, Evaluation] = field(default_factory=dict)

    @property
    def expected(self) -> set[str]:
        return set(self.plan.train) | set(self.plan.evaluate)


def _reject(reason: str) -> Verdict:
    return Verdict(False, reason)


def evaluation_of(metrics: dict[str, Any], num_test: int) -> Evaluation | str:
    """The evaluation in an update's metrics, or why it is not one."""
    missing = [k for k in EVAL_KEYS if k not in metrics]
    if missing:
        return f"metrics lack {missing}"
    correct, total, loss = (metrics[k] for k in EVAL_KEYS)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (correct, total)):
        return f"eval_correct and eval_total must be integers, got {correct!r:.20} and {total!r:.20}"
    if total != num_test or not 0 <= correct <= total:
        return f"evaluation {correct}/{total} does not fit the {num_test} test samples declared at join"
    if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss):
        return f"eval_loss must be a finite number, got {loss!r:.20}"
    majority, classes = (metrics.get(k) for k in BASELINE_KEYS)
    for key, value in zip(BASELINE_KEYS, (majority, classes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= total):
            return f"{key} must be an integer in 0..{total} (the test samples), got {value!r:.20}"
    return Evaluation(correct, total, float(loss), majority, classes)


class Coordinator:
    """Device registry and round state machine of one run."""

    def __init__(self, config: CoordinatorConfig, run_id: str):
        self.config = config
        self.run_id = run_id
        self.devices: dict[str, DeviceRecord] = {}
        self.plan_shapes: dict[str, dict[str, tuple[int, ...]]] = {}  # plan hash -> its FE tensors' shapes
        self._round: _OpenRound | None = None

    # -- registry -----------------------------------------------------------------------------

    def register(self, device_id: str) -> DeviceRecord:
        """The device's record, created when it is new."""
        if device_id not in self.devices:
            self.devices[device_id] = DeviceRecord(device_id)
        return self.devices[device_id]

    def join(self, device_id: str, join: Join) -> str | None:
        """Record a JOIN; returns why the device cannot take part (its shard does not fit the model), or None.

        A joining device is online and not ready until it acknowledges its plan again."""
        shard = join.shard
        if tuple(shard.input_shape) != tuple(self.config.input_shape) or shard.num_classes != self.config.num_classes:
            return (f"shard of {list(shard.input_shape)} inputs and {shard.num_classes} classes does not fit the "
                    f"model ({list(self.config.input_shape)}, {self.config.num_classes} classes)")
        record = self.register(device_id)
        record.online, record.ready = True, False
        record.num_train, record.num_test = shard.num_train, shard.num_test
        record.budget_mb = join.profile.memory_budget_mb
        record.artifacts = set(join.artifacts)
        return None

    def assign_plan(self, device_id: str, ratio: float, plan_hash: str, shapes: dict[str, tuple[int, ...]]) -> None:
        """Give a registered device its plan: its ratio, artifact hash and the FE tensors it trains."""
        record = self.devices[device_id]
        if record.plan_hash != plan_hash:
            record.ready = False
        record.ratio, record.plan_hash = ratio, plan_hash
        self.plan_shapes[plan_hash] = {name: tuple(shape) for name, shape in shapes.items()}

    def acknowledge(self, device_id: str, plan_hash: str) -> str | None:
        """A device installed its plan's artifacts; returns why the ACK does not count, or None."""
        record = self.devices.get(device_id)
        if record is None:
            return "unknown device"
        if plan_hash != record.plan_hash:
            return f"acknowledged plan {plan_hash[:12]}, its plan is {(record.plan_hash or 'none')[:12]}"
        record.ready = True
        record.artifacts.add(plan_hash)
        return None

    def set_online(self, device_id: str, online: bool) -> bool:
        """Track a device's status (its last will says offline); returns whether the device is known."""
        record = self.devices.get(device_id)
        if record is not None:
            record.online = online
        return record is not None

    def ready_devices(self) -> list[str]:
        """Online devices with an acknowledged plan, by device id (never by the order they joined in)."""
        return sorted(d.device_id for d in self.devices.values() if d.online and d.ready and d.plan_hash is not None)

    def can_start(self) -> bool:
        return len(self.ready_devices()) >= self.config.min_devices

    # -- rounds -------------------------------------------------------------------------------

    @property
    def open(self) -> RoundOpen | None:
        return None if self._round is None else self._round.plan

    def open_round(self, round_index: int, now: float, *, train: bool = True,
                   away: frozenset[str] = frozenset(),
                   sample: Callable[[list[str]], list[str]] | None = None) -> RoundOpen:
        """Ask the ready devices: a seeded sample of them trains (all with join ratio 1), the others evaluate;
        ``sample`` (ready devices -> those that train) replaces the seeded sample (DP's Poisson sampling).

        With ``train=False`` every ready device only evaluates (the evaluation after the last round). Devices
        ``away`` (the simulator's trace says so) only evaluate: a measurement that takes no virtual time."""
        if self._round is not None:
            raise RuntimeError(f"round {self._round.plan.round} is still open")
        ready = self.ready_devices()
        present = [d for d in ready if d not in away]
        if not (train and present):
            chosen = []
        elif sample is not None:
            chosen = sample(present)
        else:
            chosen = sample_clients(present, self.config.join_ratio, round_index, self.config.seed)
        plan = RoundOpen(round_index, tuple(chosen), tuple(d for d in ready if d not in chosen),
                         now + self.config.round_deadline_s)
        self._round = _OpenRound(plan)
        return plan

    def awaits(self, device_id: str) -> bool:
        """Whether the open round still waits for this device (a rejoining device is sent its task again)."""
        rnd = self._round
        return rnd is not None and device_id in rnd.expected and device_id not in rnd.answered

    def judge(self, topic_device: str, answer: Answer, now: float, screen: Screen | None = None, *,
              expected: dict[str, tuple[int, ...]] | None = None) -> Verdict:
        """Accept or reject an update that arrived on ``topic_device``'s up topic, under ``server.engine.update_rule``
        plus what only the server knows: the device, the run, the deadline, the evaluation's fit.

        A training update must carry exactly the tensors ``expected`` (default: its plan's FE tensors); an
        evaluation carries none. ``screen``, when given, sees a training update once every other check passed: it
        may refuse it or return the update to aggregate in its place."""
        record = self.devices.get(topic_device)
        if record is None:
            return _reject("unknown device")
        if answer.device_id == topic_device and answer.run_id != self.run_id:
            return _reject(f"update of run {answer.run_id}, this run is {self.run_id}")
        rnd = self._round
        problem = header_problem(topic_device, answer, None if rnd is None else rnd.plan.round,
                                 rnd is not None and topic_device in rnd.expected,
                                 rnd is not None and topic_device in rnd.answered)
        if problem is not None:
            return _reject(problem)
        verdict = self._judge_answer(record, answer, now, rnd, screen, expected)
        rnd.answered[topic_device] = verdict.reason
        return verdict

    def _judge_answer(self, record: DeviceRecord, answer: Answer, now: float, rnd: _OpenRound,
                      screen: Screen | None, expected: dict[str, tuple[int, ...]] | None) -> Verdict:
        """Checks of the one answer a device may give; a rejection here is its answer for the round."""
        if now > rnd.plan.deadline:
            return _reject(f"late: round {rnd.plan.round}'s deadline passed")
        try:
            plan_hash, update = answer.parse()
        except MessageError as exc:
            return _reject(f"malformed update: {exc}")
        training = record.device_id in rnd.plan.train
        asked = Asked(record.plan_hash, record.num_train if training else 0, training)
        shapes = expected if expected is not None else self.plan_shapes.get(plan_hash)
        problem = body_problem(plan_hash, update, asked, shapes, tensors_checked=answer.tensors is None)
        if problem is not None:
            return _reject(problem)
        evaluation = evaluation_of(update.metrics, record.num_test)
        if isinstance(evaluation, str):
            return _reject(evaluation)
        if training and screen is not None:
            screened = screen(record.device_id, update)
            if isinstance(screened, str):
                return _reject(screened)
            update = screened
        rnd.evaluations[record.device_id] = evaluation
        if training:
            rnd.accepted.append(record.device_id)
        return Verdict(True, update=update)

    def decline(self, device_id: str, round_index: int, reason: str) -> Verdict:
        """A device that the open round awaits says it has no answer for it (its model diverged to a non-finite
        loss or update): that is its answer, a rejection for ``reason``; nothing of it is aggregated. A device not
        awaited, or another round's, changes nothing."""
        rnd = self._round
        if rnd is None or rnd.plan.round != round_index or not self.awaits(device_id):
            return _reject(f"not asked: no open round {round_index} awaits {device_id}")
        rnd.answered[device_id] = reason
        return _reject(reason)

    def withdraw(self, device_id: str, reason: str) -> None:
        """An accepted training update was lost before it was aggregated (the aggregator holding it sent no partial
        sums): it counts as not delivered, for ``reason``."""
        rnd = self._round
        if rnd is not None and device_id in rnd.accepted:
            rnd.accepted.remove(device_id)
            rnd.answered[device_id] = reason

    def reopen(self, device_id: str) -> None:
        """An accepted training update was lost before it was aggregated while the round still runs (the aggregator
        holding it stopped answering): the round awaits the device's answer again (it re-sends it when asked)."""
        rnd = self._round
        if rnd is not None and device_id in rnd.accepted:
            rnd.accepted.remove(device_id)
            rnd.answered.pop(device_id, None)

    def closing(self, now: float) -> str | None:
        """ALL_ANSWERED or DEADLINE once the open round may close, else None."""
        rnd = self._round
        if rnd is None:
            return None
        if rnd.expected <= set(rnd.answered):
            return ALL_ANSWERED
        return DEADLINE if now >= rnd.plan.deadline else None

    def close_round(self, now: float) -> RoundResult:
        """Close the open round: who delivered, who was dropped and why, and whether it counts."""
        rnd = self._round
        if rnd is None:
            raise RuntimeError("no round is open")
        closed_by = self.closing(now) or DEADLINE
        dropped = {d: reason for d, reason in rnd.answered.items() if reason}
        dropped.update({d: NO_ANSWER for d in sorted(rnd.expected - set(rnd.answered))})
        needed = max(1, math.ceil(self.config.min_completion * len(rnd.plan.train))) if rnd.plan.train else 0
        self._round = None
        return RoundResult(rnd.plan.round, rnd.plan.train, rnd.plan.evaluate, tuple(rnd.accepted), dropped,
                           dict(rnd.evaluations), closed_by, len(rnd.accepted) >= needed)

    # -- checkpoints --------------------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """The registry as JSON-able data (the open round is not kept: a resumed run repeats it)."""
        return {"devices": [d.to_state() for d in self.devices.values()],
                "plan_shapes": {h: {n: list(s) for n, s in shapes.items()} for h, shapes in self.plan_shapes.items()}}

    def restore(self, state: dict[str, Any]) -> None:
        """Load a registry saved by to_state (every device offline until its status arrives)."""
        self.devices = {d["device_id"]: DeviceRecord.from_state(d) for d in state["devices"]}
        self.plan_shapes = {h: {n: tuple(s) for n, s in shapes.items()} for h, shapes in state["plan_shapes"].items()}
