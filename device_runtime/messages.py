"""What the server and a device say to each other, as protocol Messages (numpy and the stdlib only).

- JOIN (device -> server): resource profile, what its shard holds, the artifact sets it has cached.
- PLAN (server -> device): the rank plan's artifact hash and ratio; carries the artifact files only when the
  device lacks that hash, and the run's initial personal tensors.
- ACK (device -> server): the plan's artifacts are installed and verified.
- TASK (server -> device): one round's Task; no phases asks for an evaluation only (no training). Its weights
  come inline or (protocol 3) from the plan's payload the TASK names by SHA-256 (device_runtime/payload.py); in a
  secure round (protocol 5) its ``secure`` field carries the round's SecAgg+ parameters (``secure_from_meta``), and
  the exchanges are SECAGG messages (device_runtime/secagg_wire.py).
- UPDATE (device -> server): the Update (the tensors its task asked back, none for an evaluation), with the evaluation of the
  received model in ``metrics`` (``eval_correct``, ``eval_total``, ``eval_loss``).
- ERROR (either way): a code from ErrorCode and a human-readable detail.

Builders take plain data and return a Message; parsers take a decoded Message and raise MessageError
naming the first field that is missing or out of range.
"""
from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from device_runtime.artifact_contract import ARTIFACT_FILES_BY_KIND, MANIFEST_NAME
from device_runtime.envelope import MAX_ROUND, Message, MessageType
from device_runtime.payload import PayloadRef
from device_runtime.profile import ProfileError, ResourceProfile
from device_runtime.protocol import ProtocolError, check_id, is_id
from device_runtime.secagg_client import SecureSpec
from device_runtime.secagg_quantize import BITS, Quantizer
from device_runtime.shard import Shard
from device_runtime.task import PARAM_GROUPS, RETURNS, Phase, Task, Update

DEFAULT_TOPIC_PREFIX = "fedara"
"""Topic prefix shared by the server and its devices unless both are told otherwise."""
NO_RUN = "none"
"""run_id of a device's messages before any PLAN assigned it to a run."""
MAX_PHASES = 4
"""The most phases a TASK may ask for (none: evaluate the received model and train nothing)."""
ARTIFACT_BLOBS_BY_KIND = {kind: frozenset((*files.values(), MANIFEST_NAME))
                          for kind, files in ARTIFACT_FILES_BY_KIND.items()}
"""The file sets a PLAN may carry: one artifact kind's files and its manifest."""
MAX_DETAIL_CHARS = 500
MAX_SEED = 2**63 - 1
MAX_ARTIFACTS_LISTED = 64
_HASH_RE = re.compile(r"[0-9a-f]{64}")


class MessageError(ValueError):
    """A decoded message whose fields do not make sense for its type."""


class ErrorCode(str, Enum):
    """Why an ERROR message was sent."""

    REJOIN = "rejoin"  # server: I do not know you (or your run): send JOIN again
    REFUSED = "refused"  # server: your shard or profile cannot take part in this run
    ARTIFACTS_MISSING = "artifacts_missing"  # device: PLAN named artifacts I do not hold
    ARTIFACTS_CORRUPT = "artifacts_corrupt"  # device: the artifact files failed verification
    UNKNOWN_PLAN = "unknown_plan"  # device: TASK for a plan or run I was not given
    BAD_TASK = "bad_task"  # device: TASK tensors do not fit my plan's artifacts
    PAYLOAD_WANTED = "payload_wanted"  # device: publish the payload my TASK names again (it did not come, or not whole)
    NON_FINITE = "non_finite"  # device: my round gave a NaN or inf (the model diverged): no update this round
    RECEIVED = "received"  # server: your answer to this round is counted: do not send it again (answer_receipt.py)


@dataclass(frozen=True)
class ShardInfo:
    """What a device's local data looks like: enough for the server to check it fits the model."""

    num_train: int
    num_test: int
    input_shape: tuple[int, ...]
    num_classes: int

    @classmethod
    def of(cls, shard: Shard) -> ShardInfo:
        return cls(len(shard.y_train), len(shard.y_test), tuple(shard.input_shape), shard.num_classes)


@dataclass(frozen=True)
class Join:
    profile: ResourceProfile
    shard: ShardInfo
    artifacts: tuple[str, ...]  # hashes of the verified artifact sets the device holds


@dataclass(frozen=True)
class Plan:
    plan_hash: str  # the artifact set's content hash
    ratio: float  # the rank tier r_k
    description: str  # which layers are factorized at which rank (ResolvedPlan.describe())
    files: dict[str, bytes]  # artifact files by name; empty when the device already holds plan_hash
    init: dict[str, np.ndarray] = field(default_factory=dict)
    """The run's initial personal tensors (the head; FE and head for local training): a device starts from
    them when it holds nothing of this run, whatever weights its cached artifacts carry."""


@dataclass(frozen=True)
class ErrorReport:
    code: ErrorCode
    detail: str


def new_msg_id(kind: MessageType) -> str:
    """A fresh message id, e.g. ``task-3f2a...``."""
    return f"{kind.value}-{uuid.uuid4().hex}"


# -- field checks -----------------------------------------------------------------------------


def _expect(msg: Message, kind: MessageType) -> dict[str, Any]:
    if msg.type != kind:
        raise MessageError(f"expected a {kind.value} message, got {MessageType(msg.type).value}")
    return msg.meta


def _field(meta: dict[str, Any], key: str, kind: MessageType) -> Any:
    if key not in meta:
        raise MessageError(f"{kind.value} message lacks meta field {key!r}")
    return meta[key]


def _int(value: Any, name: str, low: int, high: int = MAX_SEED) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise MessageError(f"{name} must be an integer in [{low}, {high}], got {value!r:.40}")
    return value


def _number(value: Any, name: str, low: float = -math.inf, *, positive: bool = False) -> float:
    """A finite number >= ``low`` (> 0 with ``positive``)."""
    finite = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not finite or value < low or (positive and value <= 0):
        bound = "> 0" if positive else f">= {low}"
        raise MessageError(f"{name} must be a finite number {bound}, got {value!r:.40}")
    return float(value)


def check_hash(value: Any, name: str = "plan_hash") -> str:
    """Return ``value`` if it is an artifact hash (64 lowercase hex digits)."""
    if not isinstance(value, str) or _HASH_RE.fullmatch(value) is None:
        raise MessageError(f"{name} must be 64 lowercase hex digits, got {value!r:.80}")
    return value


def _float32_tensors(tensors: dict[str, np.ndarray], kind: MessageType) -> dict[str, np.ndarray]:
    for name, value in tensors.items():
        if value.dtype != np.float32:
            raise MessageError(f"{kind.value} tensor {name!r} is {value.dtype}, expected float32")
    return tensors


# -- JOIN -------------------------------------------------------------------------------------


def join_message(join: Join, *, device_id: str, run_id: str = NO_RUN) -> Message:
    shard = join.shard
    meta = {"profile": join.profile.to_meta(), "artifacts": list(join.artifacts),
            "shard": {"num_train": shard.num_train, "num_test": shard.num_test,
                      "input_shape": list(shard.input_shape), "num_classes": shard.num_classes}}
    return Message(MessageType.JOIN, run_id, 0, device_id, new_msg_id(MessageType.JOIN), meta)


def parse_join(msg: Message) -> Join:
    kind = MessageType.JOIN
    meta = _expect(msg, kind)
    try:
        profile = ResourceProfile.from_meta(_field(meta, "profile", kind))
    except ProfileError as exc:
        raise MessageError(str(exc)) from None
    shard = _field(meta, "shard", kind)
    if not isinstance(shard, dict):
        raise MessageError("join field 'shard' must be an object")
    shape = _field(shard, "input_shape", kind)
    if not isinstance(shape, list) or not 1 <= len(shape) <= 4:
        raise MessageError(f"shard input_shape must be a list of 1..4 sizes, got {shape!r:.60}")
    info = ShardInfo(_int(_field(shard, "num_train", kind), "num_train", 1),
                     _int(_field(shard, "num_test", kind), "num_test", 0),
                     tuple(_int(d, "input_shape entry", 1, 1 << 16) for d in shape),
                     _int(_field(shard, "num_classes", kind), "num_classes", 1, 1 << 20))
    artifacts = _field(meta, "artifacts", kind)
    if not isinstance(artifacts, list) or len(artifacts) > MAX_ARTIFACTS_LISTED:
        raise MessageError(f"join field 'artifacts' must be a list of at most {MAX_ARTIFACTS_LISTED} hashes")
    return Join(profile, info, tuple(check_hash(h, "artifact hash") for h in artifacts))


# -- PLAN and ACK -----------------------------------------------------------------------------


def plan_message(plan: Plan, *, device_id: str, run_id: str) -> Message:
    meta = {"plan_hash": plan.plan_hash, "ratio": plan.ratio, "description": plan.description}
    return Message(MessageType.PLAN, run_id, 0, device_id, new_msg_id(MessageType.PLAN), meta, blobs=dict(plan.files),
                   tensors=dict(plan.init))


def parse_plan(msg: Message) -> Plan:
    kind = MessageType.PLAN
    meta = _expect(msg, kind)
    ratio = _number(_field(meta, "ratio", kind), "ratio", positive=True)
    if ratio > 1:
        raise MessageError(f"ratio must be in (0, 1], got {ratio}")
    description = _field(meta, "description", kind)
    if not isinstance(description, str):
        raise MessageError("plan description must be text")
    if msg.blobs and set(msg.blobs) not in ARTIFACT_BLOBS_BY_KIND.values():
        expected = " or ".join(str(sorted(files)) for files in ARTIFACT_BLOBS_BY_KIND.values())
        raise MessageError(f"plan files must be none or exactly {expected}, got {sorted(msg.blobs)}")
    return Plan(check_hash(_field(meta, "plan_hash", kind)), ratio, description, dict(msg.blobs),
                _float32_tensors(dict(msg.tensors), kind))


def ack_message(plan_hash: str, *, device_id: str, run_id: str) -> Message:
    return Message(MessageType.ACK, run_id, 0, device_id, new_msg_id(MessageType.ACK), {"plan_hash": plan_hash})


def parse_ack(msg: Message) -> str:
    return check_hash(_field(_expect(msg, MessageType.ACK), "plan_hash", MessageType.ACK))


# -- TASK and UPDATE --------------------------------------------------------------------------


def task_message(task: Task, *, plan_hash: str, device_id: str, run_id: str, payload: PayloadRef | None = None
                 ) -> Message:
    """A TASK carrying the task's weights, or (``payload``) naming the plan's payload that carries them: the device
    fetches it once for every task of its plan and round (device_runtime/payload.py), so a TASK stays small."""
    meta = {"plan_hash": plan_hash, "lam": task.lam, "mu": task.mu, "lr": task.lr,
            "phases": [[p.params, p.epochs] for p in task.phases], "returns": task.returns,
            "batch_size": task.batch_size, "seed": task.seed, "deadline": task.deadline,
            "aggregator": task.aggregator, "payload": None if payload is None else payload.to_meta()}
    if task.version is not None:  # async mode only: a sync task's message is as it was
        meta["version"] = task.version
    if task.secure is not None:  # a secure round's task (protocol 5): its SecAgg+ parameters
        meta["secure"] = secure_to_meta(task.secure)
    return Message(MessageType.TASK, run_id, task.round, device_id, new_msg_id(MessageType.TASK), meta,
                   tensors={} if payload is not None else dict(task.weights))


def task_payload(msg: Message) -> PayloadRef | None:
    """The payload a TASK names for its weights, or None where it carries them (or has none)."""
    value = _expect(msg, MessageType.TASK).get("payload")
    if value is None:
        return None
    try:
        ref = PayloadRef.from_meta(value)
    except ValueError as exc:
        raise MessageError(str(exc)) from None
    if msg.tensors:
        raise MessageError("a task names a payload and carries tensors: one or the other")
    return ref


def _phases(value: Any) -> tuple[Phase, ...]:
    """The phases of a TASK: a list of at most MAX_PHASES [params, epochs] pairs."""
    if not isinstance(value, list) or len(value) > MAX_PHASES:
        raise MessageError(f"task phases must be a list of at most {MAX_PHASES} [params, epochs] pairs, "
                           f"got {value!r:.60}")
    phases = []
    for entry in value:
        if not isinstance(entry, list) or len(entry) != 2 or entry[0] not in PARAM_GROUPS:
            raise MessageError(f"task phase must be [one of {list(PARAM_GROUPS)}, epochs], got {entry!r:.60}")
        phases.append(Phase(entry[0], _int(entry[1], "phase epochs", 1, 1 << 16)))
    return tuple(phases)


def parse_task(msg: Message) -> tuple[str, Task]:
    """(plan hash, Task) of a TASK message."""
    kind = MessageType.TASK
    meta = _expect(msg, kind)
    deadline = _field(meta, "deadline", kind)
    version = meta.get("version")
    returns = _field(meta, "returns", kind)
    if returns not in RETURNS:
        raise MessageError(f"task field 'returns' must be one of {list(RETURNS)}, got {returns!r:.40}")
    task = Task(round=_int(msg.round, "round", 1, MAX_ROUND), weights=_float32_tensors(msg.tensors, kind),
                lam=_number(_field(meta, "lam", kind), "lam", 0.0), mu=_number(_field(meta, "mu", kind), "mu", 0.0),
                lr=_number(_field(meta, "lr", kind), "lr", positive=True),
                phases=_phases(_field(meta, "phases", kind)), returns=returns,
                batch_size=_int(_field(meta, "batch_size", kind), "batch_size", 1, 1 << 20),
                seed=_int(_field(meta, "seed", kind), "seed", 0),
                deadline=None if deadline is None else _number(deadline, "deadline"),
                aggregator=_aggregator(meta.get("aggregator")),
                version=None if version is None else _int(version, "version", 0, MAX_ROUND))
    if meta.get("secure") is not None:
        task.secure = secure_from_meta(meta["secure"], msg.run_id, task.round, msg.device_id)
    return check_hash(_field(meta, "plan_hash", kind)), task


MAX_PARTICIPANTS = 4096
"""The most devices a secure round's TASK may name (their ids travel in the TASK's header)."""
MAX_DIMENSION = (1 << 31) // 8
"""The largest shared model a secure round may sum (d integers of 64 bits at most, within one envelope)."""


def secure_to_meta(spec: SecureSpec) -> dict[str, Any]:
    """A secure round's parameters as a TASK's ``secure`` field."""
    return {"context": spec.context.decode(), "participants": list(spec.participants), "neighbors": spec.neighbors,
            "threshold": spec.threshold, "min_survivors": spec.min_survivors, "graph_seed": spec.graph_seed.hex(),
            "bits": spec.quantizer.bits, "scale": spec.quantizer.scale, "clip": spec.clip, "l2": spec.l2,
            "noise_mu": spec.noise_mu, "weight": spec.weight,
            "dense_shapes": {k: list(v) for k, v in spec.dense_shapes.items()}}


def secure_from_meta(value: Any, run_id: str, round_index: int, device_id: str) -> SecureSpec:
    """The SecureSpec of a TASK's ``secure`` field, checked: bound to this run and round (its context), naming
    this device among at most MAX_PARTICIPANTS distinct, sorted participants, threshold and neighbours in range."""
    kind = MessageType.TASK
    if not isinstance(value, dict):
        raise MessageError("task field 'secure' must be an object")
    context = _field(value, "context", kind)
    if context != f"{run_id}|{round_index}":
        raise MessageError(f"secure context {context!r:.80} is not this task's run and round ({run_id}|{round_index})")
    participants = _field(value, "participants", kind)
    if (not isinstance(participants, list) or not 2 <= len(participants) <= MAX_PARTICIPANTS
            or not all(is_id(p) for p in participants) or participants != sorted(set(participants))):
        raise MessageError(f"secure participants must be 2..{MAX_PARTICIPANTS} distinct sorted device ids")
    if device_id not in participants:
        raise MessageError(f"secure participants do not name {device_id}")
    n = len(participants)
    neighbors = _int(_field(value, "neighbors", kind), "secure neighbors", 1, n - 1)
    threshold = _int(_field(value, "threshold", kind), "secure threshold", 1, neighbors)
    seed = _field(value, "graph_seed", kind)
    if not isinstance(seed, str) or _HASH_RE.fullmatch(seed) is None:
        raise MessageError("secure graph_seed must be 64 lowercase hex digits")
    if _field(value, "bits", kind) != BITS:
        raise MessageError(f"secure bits must be {BITS}, got {value['bits']!r:.20}")
    shapes = _field(value, "dense_shapes", kind)
    if not isinstance(shapes, dict) or not shapes or not all(
            isinstance(k, str) and isinstance(v, list) and 1 <= len(v) <= 4 and all(
                isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= 1 << 24 for d in v)
            for k, v in shapes.items()) or sum(math.prod(v) for v in shapes.values()) > MAX_DIMENSION:
        raise MessageError(f"secure dense_shapes must be tensor names with 1..4 sizes each, {MAX_DIMENSION} values "
                           "at most")
    l2 = _field(value, "l2", kind)
    if not isinstance(l2, bool):
        raise MessageError("secure l2 must be true or false")
    weight = _number(_field(value, "weight", kind), "secure weight", positive=True)
    if weight > 1:
        raise MessageError(f"secure weight must be in (0, 1], got {weight}")
    return SecureSpec(context.encode(), tuple(participants), neighbors, threshold,
                      _int(_field(value, "min_survivors", kind), "secure min_survivors", 1, n), bytes.fromhex(seed),
                      Quantizer(BITS, _number(_field(value, "scale", kind), "secure scale", positive=True)),
                      _number(_field(value, "clip", kind), "secure clip", positive=True), l2,
                      _number(_field(value, "noise_mu", kind), "secure noise_mu", 0.0),
                      {k: tuple(v) for k, v in shapes.items()}, weight)


def _aggregator(value: Any) -> str | None:
    """The aggregator a TASK routes its answer to: None (the server), or a topic-safe name."""
    if value is None:
        return None
    try:
        return check_id(value, "task aggregator")
    except ProtocolError as exc:
        raise MessageError(str(exc)) from None


def update_message(update: Update, *, plan_hash: str, device_id: str, run_id: str) -> Message:
    meta = {"plan_hash": plan_hash, "num_samples": update.num_samples, "train_loss": update.train_loss,
            "train_accuracy": update.train_accuracy, "metrics": dict(update.metrics)}
    return Message(MessageType.UPDATE, run_id, update.round, device_id, new_msg_id(MessageType.UPDATE), meta,
                   tensors=dict(update.weights))


def parse_update(msg: Message) -> tuple[str, Update]:
    """(plan hash, Update) of an UPDATE message; tensors are passed through unchecked (the server checks them
    against the device's plan)."""
    return parse_update_fields(_expect(msg, MessageType.UPDATE), msg.round, dict(msg.tensors))


def parse_update_fields(meta: dict, round_index: int, tensors: dict[str, np.ndarray]) -> tuple[str, Update]:
    """(plan hash, Update) from an UPDATE's fields, its round and its tensors (none where an aggregator verified
    and holds them: its receipt carries the device's fields)."""
    kind = MessageType.UPDATE
    if not isinstance(meta, dict):
        raise MessageError("update fields must be an object")
    metrics = _field(meta, "metrics", kind)
    if not isinstance(metrics, dict):
        raise MessageError("update field 'metrics' must be an object")
    accuracy = _number(_field(meta, "train_accuracy", kind), "train_accuracy", 0.0)
    if accuracy > 1:
        raise MessageError(f"train_accuracy must be in [0, 1], got {accuracy}")
    update = Update(round=_int(round_index, "round", 1, MAX_ROUND), weights=tensors,
                    num_samples=_int(_field(meta, "num_samples", kind), "num_samples", 0),
                    train_loss=_number(_field(meta, "train_loss", kind), "train_loss"),
                    train_accuracy=accuracy, metrics=metrics)
    return check_hash(_field(meta, "plan_hash", kind)), update


# -- ERROR ------------------------------------------------------------------------------------


def error_message(code: ErrorCode, detail: str, *, device_id: str, run_id: str = NO_RUN,
                  round_index: int = 0) -> Message:
    meta = {"code": ErrorCode(code).value, "detail": str(detail)[:MAX_DETAIL_CHARS]}
    return Message(MessageType.ERROR, run_id, round_index, device_id, new_msg_id(MessageType.ERROR), meta)


def receipt_message(*, device_id: str, run_id: str, round_index: int) -> Message:
    """The server's RECEIVED: ``device_id``'s answer to ``round_index`` is counted, so a re-ask that crossed it is not
    answered with it again (device_runtime/answer_receipt.py)."""
    return error_message(ErrorCode.RECEIVED, f"your answer to {round_index} is counted", device_id=device_id,
                         run_id=run_id, round_index=round_index)


def payload_request_message(ref: PayloadRef, detail: str, *, device_id: str, run_id: str, round_index: int
                            ) -> Message:
    """An ERROR asking the server to publish the payload ``ref`` again (``detail``: why, for its log)."""
    msg = error_message(ErrorCode.PAYLOAD_WANTED, detail, device_id=device_id, run_id=run_id, round_index=round_index)
    msg.meta["payload"] = ref.to_meta()
    return msg


def parse_payload_request(msg: Message) -> PayloadRef:
    """The payload a PAYLOAD_WANTED error asks for."""
    try:
        return PayloadRef.from_meta(_expect(msg, MessageType.ERROR).get("payload"))
    except ValueError as exc:
        raise MessageError(str(exc)) from None


def parse_error(msg: Message) -> ErrorReport:
    kind = MessageType.ERROR
    meta = _expect(msg, kind)
    code, detail = _field(meta, "code", kind), _field(meta, "detail", kind)
    if not isinstance(code, str) or code not in {c.value for c in ErrorCode}:
        raise MessageError(f"unknown error code {code!r:.40}")
    if not isinstance(detail, str):
        raise MessageError("error detail must be text")
    return ErrorReport(ErrorCode(code), detail[:MAX_DETAIL_CHARS])
