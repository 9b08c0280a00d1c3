"""The reassembler's admission and per-sender budget, alone (device_runtime/framing.py): a frame from no sender buffers
nothing; one sender's flood pushes out only its own messages, and of those the unauthenticated and the older first;
the total budget stays the last guard. The server's admission (server/mqtt/admission.py) on real sealed envelopes."""
from __future__ import annotations

import random

import numpy as np
import pytest

from device_runtime.auth import KeyRing
from device_runtime.envelope import Message, MessageType, tagged_counter
from device_runtime.framing import FRAME_HEADER_BYTES, NotAdmitted, Reassembler, chunk
from device_runtime.topics import Topics, server_subscriptions
from server.mqtt.admission import SUBSCRIBED_IDS_MAX, aggregator_admission, server_admission, server_filters
from tests.support.sealing import KEY, seal_up

FRAME_1K = FRAME_HEADER_BYTES + 1000
HONEST, FLOODED = "dev/honest/update", "dev/flooded/update"


def payload_of(size: int, seed: int = 0) -> bytes:
    return random.Random(size * 31 + seed).randbytes(size)


def by_stream(stream: str) -> str | None:
    """Each stream its own sender, but for the stream named ``stranger``."""
    return None if stream == "stranger" else stream


def reassembler(**changes) -> Reassembler:
    return Reassembler(**{"max_message_bytes": 10_000, "timeout_s": 60.0, "max_pending": 64,
                          "max_pending_bytes": 100_000, "admit": by_stream, "max_pending_per_sender": 2,
                          "max_pending_bytes_per_sender": 10_000, **changes})


def test_a_frame_admitted_for_no_sender_is_refused_and_buffers_nothing():
    r = reassembler()
    with pytest.raises(NotAdmitted):
        r.feed(chunk(payload_of(3000), FRAME_1K, "junk")[0], 0.0, stream="stranger")
    assert r.pending_ids == () and r.pending_bytes == 0 and r.evicted == []


def test_a_flood_of_new_messages_from_one_sender_pushes_out_only_its_own():
    r = reassembler()
    honest = chunk(payload_of(3000), FRAME_1K, "honest")
    r.feed(honest[0], 0.0, stream=HONEST)
    for i in range(1000):
        r.feed(chunk(payload_of(3000, i), FRAME_1K, f"junk-{i}")[0], 1.0, stream=FLOODED)
    assert [r.feed(f, 2.0, stream=HONEST) for f in honest[1:]][-1] == payload_of(3000)
    assert all(stream == FLOODED for stream, _ in r.evicted)


def test_one_sender_holds_at_most_its_byte_budget_whatever_it_sends():
    r = reassembler(max_pending_per_sender=64)
    for i in range(100):
        r.feed(chunk(payload_of(9000, i), FRAME_1K, f"junk-{i}")[0], 1.0, stream=FLOODED)
        assert r.pending_bytes <= 10_000
    assert len(r.pending_ids) == 10


def test_a_message_over_the_byte_budget_of_its_sender_pushes_out_that_senders_older_one():
    r = reassembler()
    old, new = chunk(payload_of(6000, 1), FRAME_1K, "old"), chunk(payload_of(6000, 2), FRAME_1K, "new")
    for f in old[:5]:
        r.feed(f, 0.0, stream=FLOODED)
    got = [r.feed(f, 1.0, stream=FLOODED) for f in new]
    assert got[-1] == payload_of(6000, 2) and r.evicted == [(FLOODED, "old")]


def test_the_total_budget_still_bounds_many_senders_together():
    r = reassembler(max_pending=8)
    for i in range(100):
        r.feed(chunk(payload_of(3000, i), FRAME_1K, "m")[0], float(i), stream=f"dev/x{i}/update")
    assert len(r.pending_ids) == 8


# -- vouching: chunk 0's tagged header ranks a sender's messages ---------------------------------------------------


def sealed(msg_id: str, size: int = 3000) -> bytes:
    """A device's UPDATE-sized envelope, sealed under KEY with a fresh (higher) counter."""
    tensor = np.frombuffer(payload_of(size), dtype=np.uint8).copy()
    return seal_up(Message(MessageType.UPDATE, "run-1", 1, "dev_001", msg_id, {}, tensors={"w": tensor}))


def vouch_by_tag(sender, data) -> int | None:
    return tagged_counter(data, KEY)


def test_junk_under_a_senders_id_cannot_push_out_its_authenticated_message():
    r = reassembler(vouch=vouch_by_tag)
    genuine = sealed("update-1")
    frames = chunk(genuine, FRAME_1K, "update-1")
    r.feed(frames[0], 0.0, stream=FLOODED)
    for i in range(1000):
        r.feed(chunk(payload_of(3000, i), FRAME_1K, f"junk-{i}")[0], 1.0, stream=FLOODED)
    assert [r.feed(f, 2.0, stream=FLOODED) for f in frames[1:]][-1] == genuine
    assert r.evicted == []  # junk pushed out is not worth asking for again


def test_a_replay_of_a_senders_older_message_cannot_push_out_its_newest():
    r = reassembler(vouch=vouch_by_tag, max_pending_per_sender=1)
    older = chunk(sealed("update-old"), FRAME_1K, "update-old")
    newest_payload = sealed("update-new")
    newest = chunk(newest_payload, FRAME_1K, "update-new")
    r.feed(newest[0], 0.0, stream=FLOODED)
    r.feed(older[0], 1.0, stream=FLOODED)  # the replay ranks lower: it is the one dropped
    assert [r.feed(f, 2.0, stream=FLOODED) for f in newest[1:]][-1] == newest_payload
    assert r.evicted == [(FLOODED, "update-old")]


def test_a_senders_newer_authenticated_message_pushes_out_its_older_one():
    r = reassembler(vouch=vouch_by_tag, max_pending_per_sender=1)
    older = chunk(sealed("update-old"), FRAME_1K, "update-old")
    newer_payload = sealed("update-new")
    newer = chunk(newer_payload, FRAME_1K, "update-new")
    r.feed(older[0], 0.0, stream=FLOODED)
    assert [r.feed(f, 1.0, stream=FLOODED) for f in newer][-1] == newer_payload
    assert r.evicted == [(FLOODED, "update-old")]


def test_tagged_counter_refuses_a_chunk_under_another_key_or_cut_inside_its_header():
    data = sealed("update-1")
    assert tagged_counter(data, KEY) is not None
    assert tagged_counter(data, bytes(32)) is None
    assert tagged_counter(data[:60], KEY) is None


# -- the server's admission -----------------------------------------------------------------------------------------


def test_the_server_admits_enrolled_devices_and_the_runs_aggregators_only():
    admit, _ = server_admission("fedara", KeyRing({"dev_001": KEY}), aggregators=("agg-0",))
    assert admit(Topics("fedara", "dev_001").update) == "dev_001"
    assert admit(Topics("fedara", "dev_009").up) is None
    assert admit("fedara/agg/agg-0/up") == ("aggregator", "agg-0")
    assert admit("fedara/agg/agg-9/up") is None
    assert admit("elsewhere/dev/dev_001/up") is None


def test_a_server_of_a_closed_enrollment_subscribes_to_its_devices_topics_only():
    """The broker then forwards no frame published under another id: an unenrolled flood never reaches the server."""
    assert server_filters("fedara", KeyRing({"dev_001": KEY, "dev_002": KEY})) == server_subscriptions(
        "fedara", ["dev_001", "dev_002"])


def test_a_server_of_an_open_enrollment_or_of_too_many_devices_subscribes_to_every_devices_topics():
    many = KeyRing({f"dev_{i:05d}": KEY for i in range(SUBSCRIBED_IDS_MAX + 1)})
    for keys in (KeyRing({"dev_001": KEY}, shared_key=KEY), many):
        assert server_filters("fedara", keys) == server_subscriptions("fedara")


def test_the_server_vouches_for_a_message_sealed_under_the_devices_key_only():
    _, vouch = server_admission("fedara", KeyRing({"dev_001": KEY, "dev_002": bytes(32)}))
    data = sealed("update-1")
    assert vouch("dev_001", memoryview(data)) == tagged_counter(data, KEY)
    assert vouch("dev_002", memoryview(data)) is None


def test_an_authenticated_message_that_expires_incomplete_is_named_for_asking_again_and_junk_is_not():
    r = reassembler(vouch=vouch_by_tag, timeout_s=5.0)
    r.feed(chunk(sealed("update-1"), FRAME_1K, "update-1")[0], 0.0, stream=FLOODED)
    r.feed(chunk(payload_of(3000), FRAME_1K, "junk")[0], 0.0, stream=FLOODED)
    assert sorted(r.expire(6.0)) == ["junk", "update-1"] and r.expired_lost == [(FLOODED, "update-1")]


def test_past_the_total_budget_the_newest_authenticated_message_goes_and_the_older_ones_complete():
    r = reassembler(vouch=vouch_by_tag, max_pending=2, max_pending_per_sender=1)
    payloads = {s: sealed(f"update-{s}") for s in ("a", "b", "c")}
    frames = {s: chunk(p, FRAME_1K, f"update-{s}") for s, p in payloads.items()}
    for s in payloads:  # interleaved, as a burst of many devices reaches the server
        r.feed(frames[s][0], 0.0, stream=f"dev/{s}/update")
    assert r.evicted == [("dev/c/update", "update-c")]  # the newcomer, asked again; not "a", which holds the most
    done = [r.feed(f, 1.0, stream=f"dev/{s}/update") for s in ("a", "b") for f in frames[s][1:]]
    assert [d for d in done if d is not None] == [payloads["a"], payloads["b"]]


def test_past_the_total_budget_unauthenticated_junk_goes_before_any_authenticated_message():
    r = reassembler(vouch=vouch_by_tag, max_pending=2, max_pending_per_sender=1)
    r.feed(chunk(payload_of(3000), FRAME_1K, "junk")[0], 0.0, stream="dev/x/update")
    r.feed(chunk(sealed("update-a"), FRAME_1K, "update-a")[0], 0.0, stream="dev/a/update")
    r.feed(chunk(sealed("update-b"), FRAME_1K, "update-b")[0], 0.0, stream="dev/b/update")
    assert r.pending_ids == ("update-a", "update-b") and r.evicted == []


def test_an_aggregator_admits_the_updates_routed_to_it_of_enrolled_devices_and_its_engine_only():
    admit, vouch = aggregator_admission("fedara", "agg-0", KeyRing({"dev_001": KEY}), server_key=bytes(32))
    assert admit(f"{Topics('fedara', 'dev_001').update}/agg-0") == "dev_001"
    assert admit(f"{Topics('fedara', 'dev_009').update}/agg-0") is None
    assert admit(f"{Topics('fedara', 'dev_001').update}/agg-1") is None
    assert admit("fedara/agg/agg-0/down") == ("engine",)
    data = sealed("update-1")
    assert vouch("dev_001", memoryview(data)) == tagged_counter(data, KEY) and vouch(("engine",), data) is None
