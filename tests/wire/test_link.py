"""Specification of the authenticated link between a server and a device (seal, open, persistence)."""
from __future__ import annotations

from pathlib import Path

import pytest

from device_runtime.auth import KeyRing, Refusal, new_nonce
from device_runtime.envelope import Message, MessageType
from device_runtime.link import Link, Refused
from device_runtime.protocol import Reason
from device_runtime.status import Status
from device_runtime.topics import TopicKind

KEY, OTHER_KEY = bytes([7]) * 32, bytes([8]) * 32
RUN, OLD_RUN = "run-b", "run-a"
MAX = 1 << 20


def message(kind: MessageType, run_id: str = RUN, device_id: str = "dev_a") -> Message:
    return Message(kind, run_id, 0, device_id, f"{kind.value}-1", {"n": 1})


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Link, Link]:
    server = Link.server(KeyRing({"dev_a": KEY}), tmp_path / "server", MAX)
    device = Link.device("dev_a", KEY, tmp_path / "device", MAX)
    return server, device


def refusal(link: Link, payload: bytes, run: str = RUN, **kwargs: object) -> object:
    kwargs.setdefault("device_id", "dev_a")
    with pytest.raises(Refused) as info:
        link.open(payload, run, **kwargs)
    return info.value.reason


def test_server_opens_a_sealed_join_once(pair):
    server, device = pair
    join = device.seal(message(MessageType.JOIN, run_id="none"))
    assert server.open(join, RUN, device_id="dev_a").type == MessageType.JOIN
    assert refusal(server, join) == Refusal.REPLAY


def test_server_refuses_an_ack_of_another_run(pair):
    server, device = pair
    assert refusal(server, device.seal(message(MessageType.ACK, run_id=OLD_RUN))) == Refusal.WRONG_RUN


def test_server_refuses_a_message_on_another_devices_topic(pair):
    server, device = pair
    assert refusal(server, device.seal(message(MessageType.JOIN)), device_id="dev_b") == Reason.BAD_TOPIC


def test_server_refuses_garbage_as_a_protocol_error(pair):
    assert refusal(pair[0], b"not an envelope") == Reason.TRUNCATED


def test_a_restarted_server_still_refuses_a_join_it_accepted(pair, tmp_path):
    server, device = pair
    join = device.seal(message(MessageType.JOIN))
    server.open(join, RUN, device_id="dev_a")
    restarted = Link.server(KeyRing({"dev_a": KEY}), tmp_path / "server", MAX)
    assert refusal(restarted, join) == Refusal.REPLAY


def test_a_restarted_device_counts_above_its_last_start(pair, tmp_path):
    server, device = pair
    server.open(device.seal(message(MessageType.JOIN)), RUN, device_id="dev_a")
    restarted = Link.device("dev_a", KEY, tmp_path / "device", MAX)
    assert server.open(restarted.seal(message(MessageType.JOIN)), RUN, device_id="dev_a")


def joined(server: Link, device: Link) -> None:
    """The server opens the device's JOIN: it learns the device's session."""
    server.open(device.seal(message(MessageType.JOIN, run_id="none")), RUN, device_id="dev_a")


def test_device_takes_a_plan_of_a_new_run_but_not_an_old_runs_plan_after_it(pair, tmp_path):
    server, device = pair
    joined(server, device)
    old_plan = server.seal(message(MessageType.PLAN, run_id=OLD_RUN))
    new_plan = server.seal(message(MessageType.PLAN, run_id=RUN))
    assert device.open(new_plan, OLD_RUN, device_id="dev_a").run_id == RUN
    assert refusal(device, old_plan) == Refusal.REPLAY
    restarted = Link.device("dev_a", KEY, tmp_path / "device", MAX)
    assert refusal(restarted, old_plan) == Refusal.REPLAY


def test_device_refuses_an_old_runs_task_by_its_counter(pair):
    server, device = pair
    joined(server, device)
    old_task = server.seal(message(MessageType.TASK, run_id=OLD_RUN))
    device.open(server.seal(message(MessageType.PLAN, run_id=RUN)), OLD_RUN, device_id="dev_a")
    assert refusal(device, old_task) == Refusal.REPLAY


def test_device_refuses_a_forged_refusal_under_another_key(pair, tmp_path):
    _, device = pair
    forger = Link.server(KeyRing({"dev_a": OTHER_KEY}), tmp_path / "forger", MAX)
    assert refusal(device, forger.seal(message(MessageType.ERROR))) == Refusal.BAD_TAG


def test_device_refuses_messages_for_another_device(pair):
    server, device = pair
    server.keys = KeyRing({"dev_b": KEY})
    assert refusal(device, server.seal(message(MessageType.TASK, device_id="dev_b")), device_id="dev_b") == \
        Refusal.UNKNOWN_DEVICE


def test_status_frames_belong_on_the_status_topic_only(pair):
    server, device = pair
    online = device.status_signer("dev_a")(True, new_nonce())
    assert refusal(server, online) == Reason.BAD_TOPIC
    assert server.open(online, RUN, device_id="dev_a", kind=TopicKind.STATUS).meta["state"] == "online"
    assert refusal(server, device.seal(message(MessageType.JOIN)), kind=TopicKind.STATUS) == Reason.BAD_TOPIC


def test_a_status_frame_is_opened_with_what_it_says_and_other_messages_with_none(pair):
    server, device = pair
    nonce, signer = new_nonce(), device.status_signer("dev_a")
    for online in (True, False):
        msg, status = server.open_with_status(signer(online, nonce), RUN, device_id="dev_a", kind=TopicKind.STATUS)
        assert msg.type == MessageType.STATUS and status == Status(online, nonce)
    assert server.open_with_status(device.seal(message(MessageType.JOIN)), RUN, device_id="dev_a")[1] is None


def test_updates_belong_on_the_update_topic_only(pair):
    server, device = pair
    assert refusal(server, device.seal(message(MessageType.UPDATE))) == Reason.BAD_TOPIC
    assert refusal(server, device.seal(message(MessageType.JOIN)), kind=TopicKind.UPDATE) == Reason.BAD_TOPIC
    assert server.open(device.seal(message(MessageType.UPDATE)), RUN, device_id="dev_a",
                       kind=TopicKind.UPDATE).type == MessageType.UPDATE


def test_open_mode_server_takes_any_id_under_the_shared_key(tmp_path):
    server = Link.server(KeyRing({}, shared_key=KEY), tmp_path / "server", MAX)
    device = Link.device("anyone_7", KEY, tmp_path / "device", MAX)
    assert server.open(device.seal(message(MessageType.JOIN, device_id="anyone_7")), RUN, device_id="anyone_7")


def test_sealing_for_an_unenrolled_device_names_it(pair):
    with pytest.raises(ValueError, match="dev_z"):
        pair[0].seal(message(MessageType.TASK, device_id="dev_z"))


def test_a_fresh_device_refuses_what_the_server_sealed_before_it_started(pair, tmp_path):
    """A refusal, PLAN and TASK sealed for an earlier process of the device (an earlier run's, left retained or
    queued on the broker) are refused by a fresh device although no counter of theirs was ever seen there."""
    server, device = pair
    joined(server, device)
    earlier = [server.seal(message(kind)) for kind in (MessageType.ERROR, MessageType.PLAN, MessageType.TASK)]
    fresh = Link.device("dev_a", KEY, tmp_path / "device", MAX)  # a new process: it has accepted nothing yet
    assert [refusal(fresh, payload) for payload in earlier] == [Refusal.STALE_SESSION] * 3
    joined(server, fresh)
    assert fresh.open(server.seal(message(MessageType.PLAN)), RUN, device_id="dev_a").type == MessageType.PLAN


def test_a_message_bound_to_no_session_is_refused_by_a_device(pair):
    server, device = pair
    assert refusal(device, server.seal(message(MessageType.ERROR))) == Refusal.STALE_SESSION


def test_the_server_binds_to_the_session_of_the_freshest_message_and_remembers_it(pair, tmp_path):
    server, device = pair
    late = device.status_signer("dev_a")(True, new_nonce())  # the old process's, delivered after the new one spoke
    restarted = Link.device("dev_a", KEY, tmp_path / "device", MAX)
    joined(server, restarted)
    server.open(late, RUN, device_id="dev_a", kind=TopicKind.STATUS)
    assert server.verifier.session_of("dev_a") == restarted.session != device.session
    again = Link.server(KeyRing({"dev_a": KEY}), tmp_path / "server", MAX)
    assert restarted.open(again.seal(message(MessageType.TASK)), RUN, device_id="dev_a").type == MessageType.TASK


def test_a_devices_status_frames_name_its_session(pair):
    server, device = pair
    server.open(device.status_signer("dev_a")(True, new_nonce()), RUN, device_id="dev_a", kind=TopicKind.STATUS)
    assert device.open(server.seal(message(MessageType.ERROR)), RUN, device_id="dev_a").type == MessageType.ERROR


def test_what_was_accepted_is_durable_before_anything_is_sealed(pair, monkeypatch):
    server, device = pair
    events: list[str] = []
    monkeypatch.setattr(server.store, "sync", lambda: events.append("sync"))
    server.open(device.seal(message(MessageType.JOIN, run_id="none")), RUN, device_id="dev_a")
    assert events == []  # accepts are group-committed: one fsync for all of them, when it matters
    sealed = server.seal(message(MessageType.PLAN))
    assert events == ["sync"] and sealed


def test_a_restarted_server_refuses_what_it_accepted_and_acted_on(pair, tmp_path):
    server, device = pair
    join = device.seal(message(MessageType.JOIN, run_id="none"))
    server.open(join, RUN, device_id="dev_a")
    server.persist()
    restarted = Link.server(KeyRing({"dev_a": KEY}), tmp_path / "server", MAX)
    assert refusal(restarted, join) == Refusal.REPLAY
