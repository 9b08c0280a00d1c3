"""Who the server takes frames from, before it buffers any (framing.Admit, framing.Vouch).

On an open broker anyone publishes on any topic the server reads. A frame on a device topic counts for that device
only when the device is enrolled (its key is in the run's key ring): every other frame is dropped at the frame,
counted (the transport's ``frames_unadmitted``), never buffered. A frame on an aggregator's up topic counts for that
aggregator when it is one of the run's. Each sender then holds at most PENDING_PER_SENDER incomplete messages of at
most one largest inbound message in all (the endpoint's per-sender budget): a flood under one id, enrolled or not,
pushes out only that id's messages, and of those the unauthenticated first: chunk 0 of a device's message carries
its envelope's tagged header, so the device's own update (tag valid, newest counter) outranks junk and replays
under its id (``envelope.tagged_counter``). An aggregator process (server/aggregator.py) admits the same way the
updates routed to it (``aggregator_admission``) and the engine's messages on its down topic.

Before all that, the broker itself admits: a server whose enrollment is closed (each device enrolled with its own
key, at most SUBSCRIBED_IDS_MAX of them) subscribes to those devices' topics only (``server_filters``), so nothing
published under another id reaches it at all, at any rate: a flood under an id nobody enrolled costs the server
nothing (where it subscribed to the wildcard, it read every such frame before dropping it, and a flood faster than
it drains queued the honest frames behind it at the broker). An open enrollment (``--enroll open``: any id's key
derives from the run key) keeps the wildcard filters.
"""
from __future__ import annotations

from collections.abc import Hashable

from device_runtime.auth import KeyRing
from device_runtime.envelope import tagged_counter
from device_runtime.framing import Admit, Vouch
from device_runtime.protocol import ProtocolError
from device_runtime.topics import device_id_from_topic, server_subscriptions
from server.mqtt.aggregation_wire import aggregator_from_topic, device_from_member_topic, down_topic

PENDING_PER_SENDER = 4
"""Incomplete messages one sender may hold at once: a device's update, a re-send of it and a small message or two."""
SUBSCRIBED_IDS_MAX = 1024
"""Enrolled devices a server subscribes to one by one (3 filters each); beyond, the wildcard filters (a broker's
subscriptions cost it memory and, on NATS, a JetStream consumer each)."""
STREAMS_REMEMBERED = 8192
"""Streams whose admission the server remembers (a flood on one topic costs a dict lookup a frame); past it, forgotten
all at once (a flood over fresh topics costs the topic's parse a frame)."""


def _remembered(sender_of: Admit) -> Admit:
    """``sender_of`` with each stream's answer remembered (STREAMS_REMEMBERED at most)."""
    known: dict[str, Hashable | None] = {}

    def admit(stream: str) -> Hashable | None:
        try:
            return known[stream]
        except KeyError:
            if len(known) >= STREAMS_REMEMBERED:
                known.clear()
            sender = known[stream] = sender_of(stream)
            return sender

    return admit


def server_filters(prefix: str, keys: KeyRing) -> list[str]:
    """The device topics the server subscribes to: each enrolled device's where the enrollment is closed and at most
    SUBSCRIBED_IDS_MAX ids, else every device's (see the module docstring)."""
    closed = keys.shared_key is None and len(keys.device_ids) <= SUBSCRIBED_IDS_MAX
    return server_subscriptions(prefix, keys.device_ids if closed else None)


def aggregator_admission(prefix: str, name: str, keys: KeyRing, server_key: bytes) -> tuple[Admit, Vouch]:
    """Aggregator ``name``'s admission: the updates routed to it of enrolled devices (each its own sender, vouched
    under its key) and the engine's messages on its down topic (vouched under the server key)."""
    engine_topic = down_topic(prefix, name)

    def sender_of(stream: str) -> Hashable | None:
        if stream == engine_topic:
            return ("engine",)
        try:
            device_id = device_from_member_topic(prefix, name, stream)
        except ProtocolError:
            return None
        return device_id if keys.enrolled(device_id) else None

    def vouch(sender: Hashable, chunk: memoryview) -> int | None:
        key = keys.key_for(sender) if isinstance(sender, str) else server_key
        return None if key is None else tagged_counter(chunk, key)

    return _remembered(sender_of), vouch


def server_admission(prefix: str, keys: KeyRing, aggregators: tuple[str, ...] = ()) -> tuple[Admit, Vouch]:
    """The server endpoint's admission (enrolled devices and the run's aggregators, see the module docstring) and
    vouch (a device message's chunk 0 whose tag verifies under that device's key ranks by its counter)."""
    def sender_of(stream: str) -> Hashable | None:
        if aggregators:
            name = aggregator_from_topic(prefix, stream)
            if name is not None:
                return ("aggregator", name) if name in aggregators else None
        try:
            device_id, _ = device_id_from_topic(prefix, stream)
        except ProtocolError:
            return None
        return device_id if keys.enrolled(device_id) else None

    def vouch(sender: Hashable, chunk: memoryview) -> int | None:
        key = keys.key_for(sender) if isinstance(sender, str) else None
        return None if key is None else tagged_counter(chunk, key)

    return _remembered(sender_of), vouch
