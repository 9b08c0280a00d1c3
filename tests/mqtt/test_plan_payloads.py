"""The round's tensors once per plan (issue 31): a TASK names its plan's payload by SHA-256, the device fetches it
from the broker and believes only the payload its authenticated TASK names."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import paho.mqtt.publish
import pytest

from device_runtime.answer_receipt import RECEIPT_WAIT_S
from device_runtime.device_admission import DeviceAdmission
from device_runtime.envelope import MessageType
from device_runtime.framing import FRAME_HEADER_BYTES, chunk
from device_runtime.protocol import PROTOCOL_VERSION
from device_runtime.messages import (ErrorCode, error_message, parse_error, parse_payload_request, plan_message,
                                     task_message, task_payload)
from device_runtime.payload import PayloadMismatch, PayloadRef, decode_payload, encode_payload, payload_ref
from device_runtime.payload_wait import ASK_AGAIN_S, MIN_ASK_S, PayloadWait
from device_runtime.topics import frame_stream, payload_filter, payload_topic
from device_runtime.transport import MqttEndpoint
from server.engine.plan_payloads import REPUBLISH_MAX_S, REPUBLISH_MIN_S, PlanPayloads
from tests.support.mqtt_peer import WAIT_S
from tests.support.sealing import FRAME_LAYOUT, read, resumed_server, seal_down
from tests.support.waiting import wait_for
from tests.support.device_agent import artifact_files, dense_task, deliver, make_agent, plan_for, tiny_shard

PREFIX = "fedara"


def tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"fe.a": rng.standard_normal((3, 4)).astype(np.float32), "fe.b": rng.standard_normal(5).astype(np.float32)}


# -- the payload itself ---------------------------------------------------------------------------


def test_a_payload_decodes_to_its_tensors_once_its_hash_matches():
    sent = tensors(0)
    data = encode_payload(sent)
    got = decode_payload(data, payload_ref(data))
    assert list(got) == list(sent)
    for name, value in sent.items():
        np.testing.assert_array_equal(got[name], value)


def test_a_payload_of_another_round_is_refused_by_its_hash():
    round_1, round_2 = encode_payload(tensors(1)), encode_payload(tensors(2))
    assert len(round_1) == len(round_2)  # same shapes: only the hash tells them apart
    with pytest.raises(PayloadMismatch, match="sha256"):
        decode_payload(round_1, payload_ref(round_2))


def test_a_payload_of_another_size_is_refused_before_it_is_hashed():
    data = encode_payload(tensors(0))
    with pytest.raises(PayloadMismatch, match="bytes"):
        decode_payload(data + b"\0", payload_ref(data))


def test_a_task_names_its_payload_and_carries_no_tensors(dense_artifacts):
    model, artifacts = dense_artifacts
    ref = PayloadRef("ab" * 32, 1234)
    msg = read_back(task_message(dense_task(model), plan_hash=artifacts.hash, device_id="dev_t", run_id="run1",
                                 payload=ref))
    assert task_payload(msg) == ref and msg.tensors == {}


def read_back(msg):
    from tests.support.sealing import seal_down
    return read(seal_down(msg))


def test_payload_frames_join_as_one_stream_whatever_their_index():
    topic = payload_topic(PREFIX, "run1", "0f" * 32)
    assert frame_stream(f"{topic}/0") == frame_stream(f"{topic}/17") == topic
    assert frame_stream(f"{PREFIX}/dev/dev_0/down") == f"{PREFIX}/dev/dev_0/down"
    assert frame_stream(f"{topic}/x") == f"{topic}/x"


# -- the server side: once per plan --------------------------------------------------------------


def test_a_payload_is_handed_out_to_publish_once_per_plan_however_many_devices_share_it():
    payloads = PlanPayloads()
    published = []
    for device in range(50):
        plan = device % 5
        ref, data = payloads.get(plan, tensors(plan), now=0.0)
        if data is not None:
            published.append(ref)
    assert len(published) == 5 and len({r.sha256 for r in published}) == 5


def test_a_payload_asked_again_is_published_again_at_most_once_a_second():
    payloads = PlanPayloads()
    ref, _ = payloads.get("p", tensors(0), now=0.0)
    assert payloads.requested(ref, now=0.5) is None  # the publish of 0.5 s ago serves
    assert payloads.requested(ref, now=REPUBLISH_MIN_S) is not None
    assert payloads.requested(ref, now=REPUBLISH_MIN_S + 0.1) is None


def test_a_payload_asked_for_all_round_long_is_published_again_with_a_growing_gap_up_to_its_cap():
    payloads = PlanPayloads()
    ref, _ = payloads.get("p", tensors(0), now=0.0)
    published = [t / 10 for t in range(1, 1200) if payloads.requested(ref, now=t / 10) is not None]  # asked 10/s
    assert published == [1.0, 3.0, 7.0, 15.0, 31.0, 31.0 + REPUBLISH_MAX_S, 31.0 + 2 * REPUBLISH_MAX_S,
                         31.0 + 3 * REPUBLISH_MAX_S, 31.0 + 4 * REPUBLISH_MAX_S, 31.0 + 5 * REPUBLISH_MAX_S]


def test_the_back_off_starts_again_in_the_next_round():
    payloads = PlanPayloads()
    ref, _ = payloads.get("p", tensors(0), now=0.0)
    assert payloads.requested(ref, now=1.0) is not None and payloads.requested(ref, now=2.0) is None
    payloads.open_round()
    ref, _ = payloads.get("p", tensors(0), now=10.0)
    assert payloads.requested(ref, now=11.0) is not None


def test_a_payload_of_a_closed_round_is_not_published_again():
    payloads = PlanPayloads()
    ref, _ = payloads.get("p", tensors(0), now=0.0)
    payloads.open_round()
    assert payloads.requested(ref, now=10.0) is None
    assert payloads.requested(PayloadRef("cd" * 32, 10), now=10.0) is None  # never one of ours


def test_payloads_no_version_in_use_names_are_forgotten_and_handed_back_to_delete():
    payloads = PlanPayloads()
    old, _ = payloads.get((1, "p"), tensors(1), now=0.0)
    kept, _ = payloads.get((2, "p"), tensors(2), now=0.0)
    assert payloads.keep_only({(2, "p")}) == [old]
    assert payloads.requested(old, now=10.0) is None  # no longer published again
    assert payloads.get((2, "p"), tensors(2), now=10.0) == (kept, None)  # still published: nothing to send


def test_a_payload_two_versions_share_is_kept_while_either_is_in_use():
    payloads = PlanPayloads()
    ref, _ = payloads.get((1, "p"), tensors(1), now=0.0)
    assert payloads.get((2, "p"), tensors(1), now=0.0) == (ref, None)  # an unchanged model: the same payload
    assert payloads.keep_only({(2, "p")}) == []
    assert payloads.requested(ref, now=10.0) is not None


# -- the device: fetch, check, refuse, ask again -------------------------------------------------


def test_a_waiting_device_asks_again_after_silence_and_soon_after_a_refusal():
    wait = PayloadWait(PayloadRef("ab" * 32, 10), task=None, since=0.0)
    assert not wait.ask_now(ASK_AGAIN_S - 0.1, granted_at=0.0) and wait.ask_now(ASK_AGAIN_S, granted_at=0.0)
    wait.refused = True
    assert not wait.ask_now(ASK_AGAIN_S + MIN_ASK_S - 0.1, granted_at=0.0)
    assert wait.ask_now(ASK_AGAIN_S + MIN_ASK_S, granted_at=0.0)


def test_a_device_asks_nothing_while_its_payload_subscription_is_not_granted():
    wait = PayloadWait(PayloadRef("ab" * 32, 10), task=None, since=0.0)
    assert not wait.ask_now(10 * ASK_AGAIN_S, granted_at=None)  # a publish could not reach it


def test_a_device_waits_for_the_retained_copy_after_its_subscription_is_granted_before_it_asks():
    wait = PayloadWait(PayloadRef("ab" * 32, 10), task=None, since=0.0)
    granted = 3 * ASK_AGAIN_S  # refused by a cluster node until then
    assert not wait.ask_now(granted + ASK_AGAIN_S - 0.1, granted_at=granted)
    assert wait.ask_now(granted + ASK_AGAIN_S, granted_at=granted)


class PayloadWorld:
    """A device agent with its plan installed, given tasks that name their payload."""

    def __init__(self, dense_artifacts, tmp_path: Path):
        self.model, self.artifacts = dense_artifacts
        self.agent, self.endpoint = make_agent(tmp_path / "work", tiny_shard(tmp_path / "shard.npz"))
        deliver(self.agent, plan_message(plan_for(self.artifacts, artifact_files(self.artifacts), self.model),
                                         device_id="dev_t", run_id="run1"))

    def task(self, round_index: int) -> tuple[bytes, PayloadRef]:
        task = dense_task(self.model, round_index)
        data = encode_payload({k: v + round_index for k, v in task.weights.items()})
        ref = payload_ref(data)
        deliver(self.agent, task_message(task, plan_hash=self.artifacts.hash, device_id="dev_t", run_id="run1",
                                         payload=ref))
        return data, ref

    def give(self, ref: PayloadRef, data: bytes) -> None:
        self.agent.handle(payload_topic(PREFIX, "run1", ref.sha256), data)

    def sent(self, kind: MessageType) -> list:
        return [m for m in self.endpoint.messages() if m.type == kind]


@pytest.fixture
def world(dense_artifacts, tmp_path: Path) -> PayloadWorld:
    return PayloadWorld(dense_artifacts, tmp_path)


def test_a_device_fetches_the_payload_its_task_names_and_answers(world: PayloadWorld):
    data, ref = world.task(1)
    assert world.endpoint.followed == [payload_filter(PREFIX, "run1", ref.sha256)] and not world.sent(MessageType.UPDATE)
    world.give(ref, data)
    (update,) = world.sent(MessageType.UPDATE)
    assert update.round == 1 and world.endpoint.followed == []  # it stops listening once it holds it


def test_a_payload_that_does_not_match_is_refused_and_asked_for_again(world: PayloadWorld, caplog):
    data, ref = world.task(1)
    junk = bytearray(data)
    junk[-1] ^= 1
    world.give(ref, bytes(junk))
    assert "refused a payload for round 1" in caplog.text and not world.sent(MessageType.UPDATE)
    world.agent.tend_payload(world.agent.waiting.since + MIN_ASK_S)
    (request,) = world.sent(MessageType.ERROR)
    assert parse_error(request).code == ErrorCode.PAYLOAD_WANTED and parse_payload_request(request) == ref
    world.give(ref, data)
    assert len(world.sent(MessageType.UPDATE)) == 1


def test_a_replayed_payload_of_the_last_round_is_refused_by_its_hash(world: PayloadWorld, caplog):
    old, old_ref = world.task(1)
    world.give(old_ref, old)
    data, ref = world.task(2)
    world.give(ref, old)  # anyone on the broker may publish round 1's payload again, on round 2's topic
    assert "refused a payload for round 2" in caplog.text and len(world.sent(MessageType.UPDATE)) == 1
    world.give(ref, data)
    assert [u.round for u in world.sent(MessageType.UPDATE)] == [1, 2]


def receipt(round_index: int):
    return error_message(ErrorCode.RECEIVED, "counted", device_id="dev_t", run_id="run1", round_index=round_index)


def test_a_reask_that_crossed_the_answer_sends_nothing_once_the_receipt_comes(world: PayloadWorld):
    data, ref = world.task(1)
    world.give(ref, data)
    world.task(1)  # asked again before the server had the answer (a client-id takeover)
    deliver(world.agent, receipt(1))
    world.agent.tend_answer(world.agent.answer.sent_at + RECEIPT_WAIT_S)
    assert len(world.sent(MessageType.UPDATE)) == 1


def test_a_reask_whose_receipt_never_comes_gets_the_saved_answer_once(world: PayloadWorld):
    data, ref = world.task(1)
    world.give(ref, data)
    world.task(1)
    assert len(world.sent(MessageType.UPDATE)) == 1  # held for the receipt
    world.agent.tend_answer(world.agent.answer.sent_at + RECEIPT_WAIT_S)
    world.agent.tend_answer(world.agent.answer.sent_at + 2 * RECEIPT_WAIT_S)
    assert [u.round for u in world.sent(MessageType.UPDATE)] == [1, 1]


def reask_from_a_resumed_server(world: PayloadWorld, ref: PayloadRef) -> None:
    """The round-1 task again, from the server killed and resumed at once (its next process start)."""
    msg = task_message(dense_task(world.model, 1), plan_hash=world.artifacts.hash, device_id="dev_t", run_id="run1",
                       payload=ref)
    world.agent.handle(world.agent.topics.down, seal_down(msg, counters=resumed_server()))


def test_a_resumed_server_asking_within_the_wait_gets_the_answer_its_killed_predecessor_counted(world: PayloadWorld):
    """The killed process's receipt came; the resumed one asks within RECEIPT_WAIT_S: it counted nothing, so the saved
    answer goes again at once (tests/mqtt/test_faults.py's server killed mid-round)."""
    data, ref = world.task(1)
    world.give(ref, data)
    deliver(world.agent, receipt(1))
    reask_from_a_resumed_server(world, ref)
    assert [u.round for u in world.sent(MessageType.UPDATE)] == [1, 1]


def test_a_resumed_server_asking_within_the_wait_is_not_held_for_a_receipt(world: PayloadWorld):
    data, ref = world.task(1)
    world.give(ref, data)
    reask_from_a_resumed_server(world, ref)
    assert [u.round for u in world.sent(MessageType.UPDATE)] == [1, 1]


def test_a_task_sent_again_costs_no_payload(world: PayloadWorld):
    data, ref = world.task(1)
    world.give(ref, data)
    task = dense_task(world.model, 1)
    deliver(world.agent, task_message(task, plan_hash=world.artifacts.hash, device_id="dev_t", run_id="run1",
                                      payload=ref))
    world.agent.tend_answer(world.agent.answer.sent_at + RECEIPT_WAIT_S)  # no receipt came
    assert len(world.sent(MessageType.UPDATE)) == 2 and world.endpoint.followed == []  # the saved answer again


# -- over a real broker: the retained copy ------------------------------------------------------


FRAME = 8 * 1024


def payload_endpoint(url: str, client_id: str, **kwargs) -> MqttEndpoint:
    endpoint = MqttEndpoint(client_id, url, max_frame_bytes=FRAME, clean_session=False, **kwargs)
    endpoint.start()
    endpoint.wait_connected(WAIT_S)
    return endpoint


def test_a_device_that_subscribes_after_the_publish_gets_the_retained_payload(mosquitto_broker):
    data = encode_payload({"fe.w": np.arange(20000, dtype=np.float32)})  # 80 kB: 10 frames of 8 KiB
    ref, topic = payload_ref(data), payload_topic(PREFIX, "run1", payload_ref(data).sha256)
    server = payload_endpoint(mosquitto_broker.url, "server")
    assert server.publish_retained(topic, data, "p-1") == 10
    server.publish(f"{PREFIX}/flush", b"", "flush-1", wait=True)  # the broker holds every frame before a device asks
    device = payload_endpoint(mosquitto_broker.url, "dev_late", subscriptions=["unused/topic"])
    device.follow(payload_filter(PREFIX, "run1", ref.sha256))
    assert device.get(WAIT_S) == (topic, data)
    device.stop()
    server.stop()


def test_a_device_away_when_the_payload_was_published_gets_it_when_it_reconnects(mosquitto_broker):
    data = encode_payload({"fe.w": np.arange(20000, dtype=np.float32)})
    ref, topic = payload_ref(data), payload_topic(PREFIX, "run1", payload_ref(data).sha256)
    device = payload_endpoint(mosquitto_broker.url, "dev_away", subscriptions=["unused/topic"])
    device.follow(payload_filter(PREFIX, "run1", ref.sha256))
    following = device.subscriptions
    device.stop()  # gone mid-round, its task in hand
    server = payload_endpoint(mosquitto_broker.url, "server")
    server.publish_retained(topic, data, "p-2")
    server.publish(f"{PREFIX}/flush", b"", "flush-2", wait=True)
    back = payload_endpoint(mosquitto_broker.url, "dev_away", subscriptions=following)  # what it followed, again
    assert back.get(WAIT_S) == (topic, data)
    back.stop()
    server.clear_retained(topic, 10)
    server.stop()


# -- junk that cannot displace the payload, a restarted device (issue 44) ---------------------------------------------


def retain_frame(broker, topic: str, frame: bytes) -> None:
    """One raw frame retained on ``topic``, as anyone on an open broker can."""
    paho.mqtt.publish.single(topic, frame, qos=1, retain=True, hostname="127.0.0.1", port=broker.port)


def awaiting_device(url: str, client_id: str, topic: str, ref: PayloadRef | None) -> tuple[MqttEndpoint,
                                                                                          DeviceAdmission]:
    """A device's endpoint with its admission (device_admission.py), awaiting payload ``ref`` on ``topic`` (None:
    none yet)."""
    admission = DeviceAdmission(f"{PREFIX}/dev/{client_id}/down", bytes(32))
    if ref is not None:
        admission.await_payload(topic, ref)
    device = payload_endpoint(url, client_id, subscriptions=["unused/topic"], admit=admission.admit,
                              check=admission.check, vouch=admission.vouch,
                              screen=lambda t, p: t if admission.takes_payload(t, p) else None)
    return device, admission


def test_junk_retained_on_the_payloads_topic_neither_displaces_it_nor_costs_a_byte_of_the_payload(mosquitto_broker):
    """Junk of the payload's claimed size and hash (a candidate, kept beside the genuine frames) and junk of another
    size (dropped at its first frame), both retained on the payload's topic: the device queues the genuine payload
    once, and nothing else."""
    data = encode_payload({"fe.w": np.arange(20000, dtype=np.float32)})
    ref, topic = payload_ref(data), payload_topic(PREFIX, "run1", payload_ref(data).sha256)
    server = payload_endpoint(mosquitto_broker.url, "server")
    frames = server.publish_retained(topic, data, "p-3")
    claims_the_hash = chunk(bytes(len(data)), FRAME, "junk-same-claim")
    claims_the_hash = [f[:FRAME_HEADER_BYTES - 32] + bytes.fromhex(ref.sha256) + f[FRAME_HEADER_BYTES:]
                       for f in claims_the_hash]
    retain_frame(mosquitto_broker, f"{topic}/{frames}", claims_the_hash[0])
    retain_frame(mosquitto_broker, f"{topic}/{frames + 1}", chunk(os.urandom(3000), FRAME, "junk-other")[0])
    device, _ = awaiting_device(mosquitto_broker.url, "dev_junk", topic, ref)
    device.follow(payload_filter(PREFIX, "run1", ref.sha256))
    assert device.get(WAIT_S) == (topic, data)
    wait_for(lambda: device.stats["frames_in"] == frames + 2, WAIT_S, "every retained frame")
    assert device.get(0.5) is None and device.stats["messages_dropped"] == 0
    assert device.stats["frames_unadmitted"] == 1 and device.pending_bytes == len(claims_the_hash[0]) - \
        FRAME_HEADER_BYTES
    device.stop()
    server.clear_retained(topic, frames + 2)
    server.stop()


def test_an_oversized_retained_frame_is_refused_at_its_first_frame(mosquitto_broker):
    """A frame announcing a 50 MB message on the awaited payload's topic: refused by the size the TASK names at its
    first frame, nothing of it held."""
    data = encode_payload({"fe.w": np.arange(2000, dtype=np.float32)})
    ref, topic = payload_ref(data), payload_topic(PREFIX, "run1", payload_ref(data).sha256)
    step = FRAME - FRAME_HEADER_BYTES
    huge = FRAME_LAYOUT.pack(b"FACK", PROTOCOL_VERSION, 9, b"junk-huge", 0, -(-50_000_000 // step), 50_000_000,
                             bytes.fromhex(ref.sha256)) + bytes(step)
    retain_frame(mosquitto_broker, f"{topic}/0", huge)
    device, _ = awaiting_device(mosquitto_broker.url, "dev_huge", topic, ref)
    device.follow(payload_filter(PREFIX, "run1", ref.sha256))
    wait_for(lambda: device.stats["frames_unadmitted"] == 1, WAIT_S, "the oversized frame refused")
    assert device.pending_bytes == 0 and device.get(0.2) is None
    device.stop()
    retain_frame(mosquitto_broker, f"{topic}/0", b"")


def test_a_restarted_device_fetches_its_payload_without_waiting_to_ask_again(mosquitto_broker):
    """Killed while it fetched a payload, a device's persistent session keeps the subscription, and the broker queues
    the payload for it. Its restarted process takes none of that copy (no payload awaited yet: dropped at the frame),
    so the retained copy the broker sends when it subscribes again reassembles at once, instead of being refused as
    a repeat of the copy it dropped (then it waited ASK_AGAIN_S for the server to publish again)."""
    data = encode_payload({"fe.w": np.arange(20000, dtype=np.float32)})
    ref, topic = payload_ref(data), payload_topic(PREFIX, "run1", payload_ref(data).sha256)
    topic_filter = payload_filter(PREFIX, "run1", ref.sha256)
    device = payload_endpoint(mosquitto_broker.url, "dev_restart", subscriptions=[topic_filter])
    device.stop()  # killed mid-fetch: the subscription stays in its session
    server = payload_endpoint(mosquitto_broker.url, "server")
    frames = server.publish_retained(topic, data, "p-4")
    server.publish(f"{PREFIX}/flush", b"", "flush-4", wait=True)
    restarted, admission = awaiting_device(mosquitto_broker.url, "dev_restart", topic, None)  # no TASK again yet
    wait_for(lambda: restarted.stats["frames_in"] >= frames, WAIT_S, "the copy queued in the session")
    assert restarted.get(0) is None and restarted.stats["frames_unadmitted"] == frames
    admission.await_payload(topic, ref)  # the TASK again: the payload awaited, its filter followed again
    restarted.follow(topic_filter)
    assert restarted.get(ASK_AGAIN_S - 1) == (topic, data)
    restarted.stop()
    server.clear_retained(topic, frames)
    server.stop()
