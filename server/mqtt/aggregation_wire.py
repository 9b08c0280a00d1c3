"""What the round engine and its aggregator processes say to each other over the broker, how it is sealed, and
which member takes which device's updates.

Routing is by topic: each round the engine assigns every device one member (``route``: rendezvous hashing of the
device id over the members alive, so a device keeps its member across rounds and only a lost member's devices
move), names it in the device's authenticated TASK, and the device publishes its UPDATE on
``PREFIX/dev/<id>/update/<member>``; a member subscribes only to ``PREFIX/dev/+/update/<member>``. So every frame
of a chunked update reaches the one member, on any MQTT broker, and another subscriber only gets a copy.

The broker is open (anyone may publish anything), so every message between them is an envelope sealed under the
enrollment file's server key, which no device holds (``server.mqtt.enrollment.load_server_key``), with the sender's
fresh counters: a forged or replayed message is refused by the receiver's ``Link`` before anything reads it.
Aggregator ``A`` speaks on ``PREFIX/agg/A/up`` (direction UP) and hears on ``PREFIX/agg/A/down`` (DOWN); every
message is of type AGGREGATION with ``meta["kind"]`` one of:

- ``ready``   A -> engine: subscribed (round 0), or holds round r's brief (round r); ``reconnected``: it connected
              again (what was published to it while away is lost: the engine asks its devices again);
- ``round``   engine -> A: round r's brief: the run, the dense shapes, each asked device's plan, sample count and
              whether it trains, and the tensors a training update of each plan carries;
- ``receipt`` A -> engine: A verified a device's update (the device's header fields, its counter, tensor bytes);
- ``lost``    A -> engine: the devices of round r whose updates A lost half-received (pushed out of its reassembly
              budget, or expired, where even its spill could not take them): the engine asks them again, as it does
              for its own (``server.mqtt.lost_updates``); at most as many as the round asks;
- ``verdict`` engine -> A: fold that update, or why not (the engine alone decides what counts);
- ``close``   engine -> A: round r closed, send your partial over these updates (every one it was told to
              fold: a lost verdict is made good here);
- ``partial`` A -> engine: float64 Σ n_k·W_k, Σ n_k and the devices folded (with DP: Σ clip_C(Δ_k), C and the
              count within C; the brief then carries C and each plan's sent weights).
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from device_runtime.auth import Direction, KeyRing, new_nonce
from device_runtime.envelope import Message, MessageType
from device_runtime.link import Link
from device_runtime.messages import new_msg_id
from device_runtime.protocol import ProtocolError, Reason, check_id
from device_runtime.topics import TopicKind, check_topic_prefix, device_id_from_topic, update_filter
from server.engine.aggregate import PartialSum
from server.engine.folding_records import Brief, Partial, Receipt
from server.engine.privacy import ClippedSum
from server.engine.update_rule import Asked

READY, ROUND, RECEIPT, VERDICT, CLOSE, PARTIAL = "ready", "round", "receipt", "verdict", "close", "partial"
LOST = "lost"
KINDS = (READY, ROUND, RECEIPT, LOST, VERDICT, CLOSE, PARTIAL)
NO_RUN = "none"


class WireError(ValueError):
    """An aggregation message whose fields do not fit its kind."""


def up_topic(prefix: str, aggregator: str) -> str:
    return f"{check_topic_prefix(prefix)}/agg/{check_id(aggregator, 'aggregator name')}/up"


def down_topic(prefix: str, aggregator: str) -> str:
    return f"{check_topic_prefix(prefix)}/agg/{check_id(aggregator, 'aggregator name')}/down"


def engine_filter(prefix: str) -> str:
    """What the engine subscribes to: every aggregator's up topic."""
    return f"{check_topic_prefix(prefix)}/agg/+/up"


def member_update_filter(prefix: str, aggregator: str) -> str:
    """What aggregator ``aggregator`` subscribes to: the update topics of the devices routed to it."""
    return f"{update_filter(prefix)}/{check_id(aggregator, 'aggregator name')}"


def device_from_member_topic(prefix: str, aggregator: str, topic: str) -> str:
    """The device whose update topic (routed to ``aggregator``) ``topic`` is; raises ProtocolError otherwise."""
    tail = f"/{aggregator}"
    if not (isinstance(topic, str) and topic.endswith(tail)):
        raise ProtocolError(Reason.BAD_TOPIC, f"topic {topic!r:.200} is not routed to aggregator {aggregator!r}")
    device_id, kind = device_id_from_topic(prefix, topic[:-len(tail)])
    if kind != TopicKind.UPDATE:
        raise ProtocolError(Reason.BAD_TOPIC, f"topic {topic!r:.200} is not an update topic")
    return device_id


def aggregator_from_topic(prefix: str, topic: str) -> str | None:
    """The aggregator whose up topic ``topic`` is, or None when it is not one."""
    head, tail = f"{prefix}/agg/", "/up"
    if not (topic.startswith(head) and topic.endswith(tail)):
        return None
    try:
        return check_id(topic[len(head):-len(tail)], "aggregator name")
    except ProtocolError:
        return None


def engine_link(server_key: bytes, state_dir: str | os.PathLike[str], max_inbound: int) -> Link:
    """The engine's side: sends DOWN to any aggregator name, takes UP sealed under the server key. The last
    counter it took from each member is kept in ``state_dir`` (the deployment's), so no run takes what an
    earlier run's members sent, not even before a member of this run has spoken."""
    return Link.on_disk(KeyRing({}, shared_key=server_key), Direction.DOWN, {Direction.UP}, {MessageType.AGGREGATION},
                        max_inbound, state_dir, allow_nonfinite=True)


def aggregator_link(server_key: bytes, state_dir: str | os.PathLike[str], max_inbound: int) -> Link:
    """An aggregator's side: sends UP, takes DOWN sealed under the server key. The last counter it took from the
    engine is kept in ``state_dir``: a member started again there refuses an earlier engine's briefs. Like a
    device, it has a session fresh at every start (its READY names it): it takes only what the engine bound to it."""
    return Link.on_disk(KeyRing({}, shared_key=server_key), Direction.UP, {Direction.DOWN}, {MessageType.AGGREGATION},
                        max_inbound, state_dir, session=new_nonce())


def message(kind: str, aggregator: str, *, run_id: str = NO_RUN, round_index: int = 0, tensors: dict | None = None,
            **fields: Any) -> Message:
    """An AGGREGATION message of ``kind`` to or from ``aggregator``."""
    return Message(MessageType.AGGREGATION, run_id, round_index, aggregator, new_msg_id(MessageType.AGGREGATION),
                   {"kind": kind, **fields}, tensors=dict(tensors or {}))


def kind_of(msg: Message) -> str:
    if msg.type != MessageType.AGGREGATION or msg.meta.get("kind") not in KINDS:
        raise WireError(f"expected an aggregation message, got {msg.type.value} {msg.meta.get('kind')!r:.20}")
    return msg.meta["kind"]


# -- round brief -------------------------------------------------------------------------------


def brief_message(brief: Brief, aggregator: str) -> Message:
    """The brief; with DP also the round's clip and each plan's sent weights (tensors ``p<i>.<name>``, plan i of
    ``sent_plans``)."""
    sent_plans = sorted(brief.sent)
    tensors = {f"p{i}.{k}": v for i, h in enumerate(sent_plans) for k, v in brief.sent[h].items()}
    return message(ROUND, aggregator, run_id=brief.run_id, round_index=brief.round, tensors=tensors,
                   dense={k: list(v) for k, v in brief.dense_shapes.items()},
                   plans={h: {k: list(v) for k, v in s.items()} for h, s in brief.plan_shapes.items()},
                   devices={d: [a.plan_hash, a.num_samples, a.trains] for d, a in brief.devices.items()},
                   max_inbound=brief.max_inbound, dp_clip=brief.dp_clip, sent_plans=sent_plans)


def parse_brief(msg: Message) -> Brief:
    try:
        meta = msg.meta
        devices = {check_id(d, "device id"): Asked(str(h), int(n), bool(t)) for d, (h, n, t) in meta["devices"].items()}
        plans = {str(h): {str(k): tuple(int(x) for x in v) for k, v in s.items()} for h, s in meta["plans"].items()}
        dense = {str(k): tuple(int(x) for x in v) for k, v in meta["dense"].items()}
        clip = meta.get("dp_clip")
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
            raise ValueError(f"dp_clip {clip!r:.20}")
        sent_plans = [str(h) for h in meta.get("sent_plans", [])]
        sent: dict[str, dict[str, np.ndarray]] = {h: {} for h in sent_plans}
        for name, value in msg.tensors.items():
            index, _, key = name.partition(".")
            sent[sent_plans[int(index.removeprefix("p"))]][key] = value
        if clip is not None and any(sent.get(devices[d].plan_hash) is None for d in devices if devices[d].trains):
            raise ValueError("a training device's plan has no sent weights")
        return Brief(msg.run_id, msg.round, dense, plans, devices, int(meta["max_inbound"]),
                     dp_clip=None if clip is None else float(clip), sent=sent)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise WireError(f"malformed round brief: {exc!r:.200}") from None


# -- receipt and verdict -----------------------------------------------------------------------


def receipt_message(receipt: Receipt, aggregator: str) -> Message:
    return message(RECEIPT, aggregator, run_id=receipt.run_id, round_index=receipt.round, device=receipt.device_id,
                   msg_id=receipt.msg_id, counter=receipt.counter, update=receipt.meta, bytes=receipt.nbytes)


def parse_receipt(msg: Message) -> Receipt:
    meta = msg.meta
    try:
        receipt = Receipt(check_id(meta["device"], "device id"), msg.run_id, msg.round, str(meta["msg_id"]),
                          meta["counter"], meta["update"], meta["bytes"])
    except (KeyError, ProtocolError) as exc:
        raise WireError(f"malformed receipt: {exc!r:.200}") from None
    if not (isinstance(receipt.counter, int) and isinstance(receipt.nbytes, int) and isinstance(receipt.meta, dict)):
        raise WireError("malformed receipt: counter and bytes must be integers, update an object")
    return receipt


def lost_message(aggregator: str, run_id: str, round_index: int, devices: Iterable[str]) -> Message:
    """The devices of round ``round_index`` whose updates ``aggregator`` lost half-received."""
    return message(LOST, aggregator, run_id=run_id, round_index=round_index, devices=sorted(devices))


def parse_lost(msg: Message, max_devices: int) -> tuple[str, ...]:
    """The devices a LOST names (each once), at most ``max_devices`` (the round's asked devices: no member serves
    more); raises WireError otherwise."""
    devices = msg.meta.get("devices")
    if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices):
        raise WireError("malformed lost: needs devices, a list of device ids")
    if len(devices) > max_devices:
        raise WireError(f"malformed lost: {len(devices)} devices named, the round asks {max_devices}")
    try:
        return tuple(dict.fromkeys(check_id(d, "device id") for d in devices))
    except ProtocolError as exc:
        raise WireError(f"malformed lost: {exc}") from None


def verdict_message(aggregator: str, round_index: int, device_id: str, fold: bool, reason: str) -> Message:
    return message(VERDICT, aggregator, round_index=round_index, device=device_id, fold=fold, reason=reason)


def parse_verdict(msg: Message) -> tuple[str, bool, str]:
    """(device, fold, reason) of a verdict."""
    meta = msg.meta
    if not isinstance(meta.get("device"), str) or not isinstance(meta.get("fold"), bool):
        raise WireError("malformed verdict: needs a device and a boolean fold")
    return meta["device"], meta["fold"], str(meta.get("reason", ""))


# -- close -------------------------------------------------------------------------------------


def close_message(aggregator: str, round_index: int, fold: Iterable[str]) -> Message:
    """The engine's request for round ``round_index``'s partial, naming every update it told the member to fold:
    a verdict lost on the way (the member was away from the broker) is made good here, as a CLOSE is sent again
    until its partial comes."""
    return message(CLOSE, aggregator, round_index=round_index, fold=sorted(fold))


def parse_close(msg: Message) -> tuple[str, ...]:
    """The devices a CLOSE names to fold."""
    fold = msg.meta.get("fold")
    if not isinstance(fold, list) or not all(isinstance(d, str) for d in fold):
        raise WireError("malformed close: needs fold, a list of device ids")
    try:
        return tuple(check_id(d, "device id") for d in fold)
    except ProtocolError as exc:
        raise WireError(f"malformed close: {exc}") from None


# -- partial sums ------------------------------------------------------------------------------


def partial_message(partial: Partial, aggregator: str) -> Message:
    """Σ n_k·W_k with Σ n_k, or with DP Σ clip_C(Δ_k) with its clip and the count within it."""
    total = partial.sum
    fields = ({"clip": total.clip, "within": total.within} if isinstance(total, ClippedSum)
              else {"total_weight": total.total_weight})
    return message(PARTIAL, aggregator, round_index=partial.round,
                   tensors={k: v.numpy() for k, v in total.sums.items()}, devices=list(partial.devices),
                   count=total.count, **fields)


def parse_partial(msg: Message) -> Partial:
    meta = msg.meta
    devices, count = meta.get("devices"), meta.get("count")
    clipped = "clip" in meta
    numbers = [meta.get(k) for k in (("clip",) if clipped else ("total_weight",))]
    if (not isinstance(devices, list) or not all(isinstance(d, str) for d in devices) or not isinstance(count, int)
            or any(not isinstance(n, (int, float)) or isinstance(n, bool) for n in numbers)
            or (clipped and not isinstance(meta.get("within"), int))):
        raise WireError("malformed partial: needs devices (strings), count, and total_weight (or clip and within)")
    if any(t.dtype != np.float64 for t in msg.tensors.values()):
        raise WireError("malformed partial: sums travel as float64")
    sums = {k: torch.from_numpy(np.array(v)) for k, v in msg.tensors.items()}
    total = (ClippedSum(float(meta["clip"]), sums, count, meta["within"]) if clipped
             else PartialSum(sums, float(meta["total_weight"]), count))
    return Partial(msg.round, total, tuple(devices))
