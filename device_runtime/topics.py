"""MQTT topic naming: the topics of one device under a prefix, the server's subscriptions, and a topic read back
as the device it belongs to.

Every device has four topics, ``PREFIX/dev/<device_id>/{down,up,status,update}``; an update routed to an aggregator
process goes one level below its update topic (server/mqtt/aggregation_wire.py).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum

from device_runtime.protocol import ProtocolError, Reason, check_device_id, check_id, is_id


class TopicKind(str, Enum):
    """Last level of a device topic."""

    DOWN = "down"  # server -> device
    UP = "up"  # device -> server
    STATUS = "status"  # device online/offline, carries its last will
    UPDATE = "update"  # device -> server: its UPDATEs only (one level below: to an aggregator, server/aggregator.py)


def check_topic_prefix(prefix: object) -> str:
    """Return ``prefix`` if it is a usable topic prefix: non-empty '/'-separated levels of
    safe identifiers (no wildcards, no empty levels, no leading '$')."""
    if not isinstance(prefix, str) or not all(is_id(lv) for lv in prefix.split("/")):
        raise ProtocolError(
            Reason.BAD_TOPIC,
            f"topic prefix must be '/'-separated levels of [A-Za-z0-9_.-], got {prefix!r:.100}",
        )
    return prefix


@dataclass(frozen=True)
class Topics:
    """The four MQTT topics of one device under ``prefix``."""

    prefix: str
    device_id: str

    def __post_init__(self) -> None:
        check_topic_prefix(self.prefix)
        check_device_id(self.device_id)

    def _topic(self, kind: TopicKind) -> str:
        return f"{self.prefix}/dev/{self.device_id}/{kind.value}"

    @property
    def down(self) -> str:
        """Server -> device."""
        return self._topic(TopicKind.DOWN)

    @property
    def up(self) -> str:
        """Device -> server."""
        return self._topic(TopicKind.UP)

    @property
    def status(self) -> str:
        """Device online/offline; the device's last will is published here."""
        return self._topic(TopicKind.STATUS)

    @property
    def update(self) -> str:
        """Device -> server, UPDATEs only (read by the server when it folds the updates itself)."""
        return self._topic(TopicKind.UPDATE)

    @property
    def payloads(self) -> str:
        """The level every plan's payload is published under (``payload_topic``), with its trailing '/'."""
        return f"{self.prefix}/{PAYLOAD_LEVEL}/"

    def update_via(self, aggregator: str | None) -> str:
        """Where this device's UPDATE goes: the update topic, or below it the level of the aggregator process its
        task names (each aggregator subscribes only to its own level: see server/aggregator.py)."""
        if aggregator is None:
            return self.update
        return f"{self.update}/{check_id(aggregator, 'aggregator name')}"


def update_filter(prefix: str) -> str:
    """The topic filter of every device's update topic."""
    check_topic_prefix(prefix)
    return f"{prefix}/dev/+/{TopicKind.UPDATE.value}"


def server_subscriptions(prefix: str, device_ids: Collection[str] | None = None) -> list[str]:
    """Topic filters the server subscribes to: the up, status and update topics of every device, or, given
    ``device_ids`` (a closed enrollment's), of those devices only: the broker then forwards nothing published under
    any other id, so a flood under an id nobody enrolled never reaches the server. With aggregators, an update routed
    to one goes a level below, out of these filters."""
    check_topic_prefix(prefix)
    if device_ids is None:
        return [f"{prefix}/dev/+/{TopicKind.UP.value}", f"{prefix}/dev/+/{TopicKind.STATUS.value}",
                update_filter(prefix)]
    return [topic for topics in (Topics(prefix, device_id) for device_id in device_ids)
            for topic in (topics.up, topics.status, topics.update)]


PAYLOAD_LEVEL = "payload"
_PAYLOAD_FRAME = re.compile(r"(.+/%s/[A-Za-z0-9_.-]{1,64}/[0-9a-f]{64})/(0|[1-9][0-9]{0,9})" % PAYLOAD_LEVEL)


def payload_topic(prefix: str, run_id: str, sha256: str) -> str:
    """The topic a plan's payload (device_runtime/payload.py) is published under: ``PREFIX/payload/<run_id>/<sha256>``;
    frame i of it is retained on ``.../<sha256>/<i>`` (a broker retains one message per topic). The run id (random,
    named in the sealed TASK) is the topic's per-run nonce: the same tensors of another run, or of a run not started
    yet, go elsewhere, so nobody can leave junk there before the run."""
    check_topic_prefix(prefix)
    check_id(run_id, "run_id")
    if not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise ProtocolError(Reason.BAD_TOPIC, f"payload sha256 must be 64 lowercase hex digits, got {sha256!r:.80}")
    return f"{prefix}/{PAYLOAD_LEVEL}/{run_id}/{sha256}"


def payload_filter(prefix: str, run_id: str, sha256: str) -> str:
    """The filter of every frame of one payload (a device subscribes to it while it fetches the payload)."""
    return f"{payload_topic(prefix, run_id, sha256)}/+"


def frame_stream(topic: str) -> str:
    """The stream a frame belongs to for reassembly: a payload frame's payload topic (its frames come one per topic
    level), any other topic itself."""
    match = _PAYLOAD_FRAME.fullmatch(topic)
    return topic if match is None else match.group(1)


def device_id_from_topic(prefix: str, topic: str) -> tuple[str, TopicKind]:
    """Split a device topic under ``prefix`` into (device_id, kind)."""
    check_topic_prefix(prefix)
    head = f"{prefix}/dev/"
    if not isinstance(topic, str) or not topic.startswith(head):
        raise ProtocolError(Reason.BAD_TOPIC, f"topic {topic!r:.200} is not under {head!r}")
    levels = topic[len(head):].split("/")
    kinds = {k.value: k for k in TopicKind}
    if len(levels) != 2 or levels[1] not in kinds:
        raise ProtocolError(
            Reason.BAD_TOPIC,
            f"topic {topic!r:.200} is not {head}<device_id>/{{{','.join(kinds)}}}",
        )
    return check_device_id(levels[0]), kinds[levels[1]]


def check_topic_device(topic_device: str, header_device: object) -> str:
    """Return ``header_device`` if it is ``topic_device``, the device whose topic the message came on: a message
    names its sender in its header and must arrive on that sender's topics; raises ProtocolError (BAD_TOPIC)."""
    if header_device != topic_device:
        raise ProtocolError(Reason.BAD_TOPIC, f"a message of {header_device!r} on a topic of {topic_device!r}")
    return topic_device
