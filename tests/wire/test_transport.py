"""MQTT transport: chunked round trips over both brokers, last will, reconnect, ACLs and TLS."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import paho.mqtt.publish
import pytest

from paho.mqtt.enums import CallbackAPIVersion

from device_runtime import transport
from device_runtime.framing import chunk
from device_runtime.spill import FileSpill
from device_runtime.topics import Topics, server_subscriptions
from device_runtime.transport import (BrokerRefusedError, BrokerURL, ConnectTimeoutError, FrameTooLargeError,
                                      MqttEndpoint, PublishError, parse_brokers, rotate_brokers)
from server.mqtt.aggregation_wire import member_update_filter
from server.mqtt.mosquitto_config import TlsFiles, acl_text, mosquitto_password_hash, write_mosquitto_auth
from tests.support.endpoints import DEV1, DEV2, PREFIX, WAIT_S
from tests.support.processes import child_env
from tests.support.tls import make_ca
from tests.support.waiting import wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
SMALL_FRAME = 4096


def plain_status(online: bool, nonce: str) -> bytes:
    """Status frames as plain text: the transport carries whatever its status function returns."""
    return f"{'online' if online else 'offline'} {nonce}".encode()


def status_of(received: tuple[str, bytes] | None) -> tuple[str, str, str]:
    """(topic, state, nonce) of a received plain status frame."""
    assert received is not None, "no status frame arrived"
    topic, payload = received
    state, nonce = payload.decode().split()
    return topic, state, nonce


DYING_DEVICE = """
import sys
from device_runtime.transport import MqttEndpoint
url, status_topic = sys.argv[1:3]
frames = lambda online, nonce: f"{'online' if online else 'offline'} {nonce}".encode()
endpoint = MqttEndpoint("dying-device", url, status=(status_topic, frames))
endpoint.start()
endpoint.wait_connected(10)
print("ready", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def socket_bound_but_not_listening() -> Iterator[int]:
    """A loopback port where connections are refused for as long as the block runs."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


# -- broker URLs -----------------------------------------------------------------------------


def test_broker_url_parses_credentials_host_and_port() -> None:
    assert BrokerURL.parse("mqtt://server:p%40ss@127.0.0.1:1884") == BrokerURL(
        "mqtt", "127.0.0.1", 1884, "server", "p@ss", tls=False)


def test_mqtts_url_means_tls_on_port_8883_by_default() -> None:
    url = BrokerURL.parse("mqtts://broker.local")
    assert (url.tls, url.port, url.username) == (True, 8883, None)


def test_broker_url_with_unknown_scheme_is_rejected() -> None:
    with pytest.raises(ValueError, match="scheme must be one of"):
        BrokerURL.parse("http://127.0.0.1:1883")


def test_a_broker_list_parses_every_node_and_rotates() -> None:
    assert [str(b) for b in parse_brokers("mqtt://h1:1,mqtt://h2:2, mqtt://h3")] == [
        "mqtt://h1:1", "mqtt://h2:2", "mqtt://h3:1883"]
    assert rotate_brokers("mqtt://h1:1,mqtt://h2:2,mqtt://h3:3", 4) == "mqtt://h2:2,mqtt://h3:3,mqtt://h1:1"


@pytest.mark.parametrize("text, named", [("mqtt://h1:1,,mqtt://h2:2", "no empty entry"),
                                         ("mqtt://h1:1,h2:2", "scheme must be one of"),
                                         ("mqtt://h1:1,mqtts://h2:2", "mixes mqtt:// and mqtts://")])
def test_a_bad_broker_list_is_refused_naming_the_flag(text: str, named: str) -> None:
    with pytest.raises(ValueError, match="--broker") as info:
        parse_brokers(text)
    assert named in str(info.value)


def test_a_lost_broker_moves_the_endpoint_to_the_next_of_the_list(start_mosquitto, connect) -> None:
    """Two brokers stand for two nodes of a cluster: the one the endpoints use dies, both carry on on the other,
    keeping what they held (a message half-received stays pending, the stats go on)."""
    first, second = start_mosquitto(), start_mosquitto()
    brokers = f"{first.url},{second.url}"
    server = connect("server", brokers, subscriptions=[DEV1.up])
    device = connect("dev1", rotate_brokers(brokers, 2), max_frame_bytes=SMALL_FRAME)
    assert str(server.url) == str(device.url) == first.url
    first.stop()
    wait_for(lambda: not server.connected.is_set() and not device.connected.is_set(), WAIT_S,
             "both endpoints to see the broker gone")
    server.wait_connected(WAIT_S)
    device.wait_connected(WAIT_S)
    assert str(server.url) == str(device.url) == second.url
    payload = random.Random(1).randbytes(3 * SMALL_FRAME)
    device.publish(DEV1.up, payload, "up-after-failover", wait=True)
    assert server.get(WAIT_S) == (DEV1.up, payload)
    assert server.stats["reconnects"] == device.stats["reconnects"] == 1


def test_an_mqtt5_broker_announcing_a_small_receive_maximum_holds_the_sender_to_it(start_mosquitto, connect,
                                                                                   caplog) -> None:
    """mosquitto tells MQTT 5 clients its max_inflight_messages as its Receive Maximum: an endpoint sends at most
    that many unacknowledged messages (not its window of 1,000), says so, and a 40-frame message goes through."""
    broker = start_mosquitto(max_inflight=4)
    server = connect("server", broker.url, subscriptions=[DEV1.up], max_frame_bytes=SMALL_FRAME, mqtt5=True)
    with caplog.at_level(logging.INFO, logger="fedara.transport"):
        device = connect("dev1", broker.url, max_frame_bytes=SMALL_FRAME, mqtt5=True)
    assert "dev1: the broker's Receive Maximum bounds this endpoint to 4 unacknowledged messages" in caplog.text
    payload = random.Random(2).randbytes(40 * SMALL_FRAME)
    device.publish(DEV1.up, payload, "up-through-a-small-window", wait=True)
    assert server.get(WAIT_S) == (DEV1.up, payload)


def test_an_unreachable_first_broker_is_skipped(start_mosquitto, connect) -> None:
    with socket_bound_but_not_listening() as dead_port:
        broker = start_mosquitto()
        endpoint = connect("dev1", f"mqtt://127.0.0.1:{dead_port},{broker.url}")
        assert str(endpoint.url) == broker.url


# -- publish / receive over both brokers -----------------------------------------------------


def test_message_round_trips_between_server_and_device(broker_url: str, connect) -> None:
    server = connect("server", broker_url, subscriptions=server_subscriptions(PREFIX))
    device = connect("dev1", broker_url, subscriptions=[DEV1.down])
    device.publish(DEV1.up, b"update", "up-1", wait=True)
    assert server.get(WAIT_S) == (DEV1.up, b"update")
    server.publish(DEV1.down, b"task", "down-1", wait=True)
    assert device.get(WAIT_S) == (DEV1.down, b"task")


def test_a_stopped_endpoint_holds_no_socket(start_mosquitto) -> None:
    broker = start_mosquitto()
    before = len(os.listdir("/proc/self/fd"))
    endpoints = [MqttEndpoint(f"dev{i}", broker.url) for i in range(3)]
    for endpoint in endpoints:
        endpoint.start()
        endpoint.wait_connected(WAIT_S)
        endpoint.stop()
    assert len(os.listdir("/proc/self/fd")) == before  # the endpoints still referenced: nothing left to collect


def test_payload_five_times_the_frame_size_arrives_whole(broker_url: str, connect) -> None:
    payload = random.Random(0).randbytes(5 * SMALL_FRAME + 123)
    server = connect("server", broker_url, subscriptions=[DEV1.up], max_frame_bytes=SMALL_FRAME)
    device = connect("dev1", broker_url, max_frame_bytes=SMALL_FRAME)
    device.publish(DEV1.up, payload, "big-1", wait=True)
    assert server.get(WAIT_S) == (DEV1.up, payload)
    assert server.stats["frames_in"] == len(chunk(payload, SMALL_FRAME, "big-1")) > 5


def test_last_will_reaches_status_subscriber_within_a_second_of_sigkill(broker_url: str, connect) -> None:
    server = connect("server", broker_url, subscriptions=[DEV1.status])
    device = subprocess.Popen([sys.executable, "-c", DYING_DEVICE, broker_url, DEV1.status], cwd=REPO_ROOT,
                              env=child_env(repo_on_path=True),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        topic, state, nonce = status_of(server.get(WAIT_S))
        assert (topic, state) == (DEV1.status, "online")
        device.kill()
        assert status_of(server.get(timeout=1.0)) == (DEV1.status, "offline", nonce)
    finally:
        device.kill()
        device.wait()


def test_retained_online_status_reaches_a_later_subscriber(broker_url: str, connect) -> None:
    connect("dev1", broker_url, status=(DEV1.status, plain_status))
    server = connect("server", broker_url, subscriptions=[DEV1.status])
    assert status_of(server.get(WAIT_S))[:2] == (DEV1.status, "online")


def test_clean_stop_publishes_the_offline_status(broker_url: str, connect) -> None:
    server = connect("server", broker_url, subscriptions=[DEV1.status])
    device = connect("dev1", broker_url, status=(DEV1.status, plain_status))
    _, _, nonce = status_of(server.get(WAIT_S))
    device.stop()
    assert status_of(server.get(WAIT_S)) == (DEV1.status, "offline", nonce)


def test_every_connection_gets_its_own_status_nonce(broker_url: str, connect) -> None:
    server = connect("server", broker_url, subscriptions=[DEV1.status])
    connect("dev1", broker_url, status=(DEV1.status, plain_status)).stop()
    first = status_of(server.get(WAIT_S))[2]
    assert status_of(server.get(WAIT_S))[1:] == ("offline", first)
    connect("dev1", broker_url, status=(DEV1.status, plain_status))
    _, state, second = status_of(server.get(WAIT_S))
    assert state == "online" and second != first


def test_persistent_session_gets_messages_sent_while_it_was_offline(broker_url: str, connect) -> None:
    connect("dev1", broker_url, subscriptions=[DEV1.down]).stop()
    server = connect("server", broker_url)
    server.publish(DEV1.down, b"queued task", "down-1", wait=True)
    device = connect("dev1", broker_url, subscriptions=[DEV1.down])
    assert device.get(WAIT_S) == (DEV1.down, b"queued task")


def test_a_server_of_many_enrolled_devices_is_ready_once_every_packet_of_their_filters_is_granted(broker_url: str,
                                                                                                  connect) -> None:
    """Three filters a device, SUBSCRIBE_BATCH a packet: ready only once the last packet's are granted (a frame on the
    last filter arrives), and a frame under an id outside them is never forwarded."""
    ids = [f"dev_{i:03d}" for i in range(transport.SUBSCRIBE_BATCH)]  # 384 filters: 3 packets
    server = connect("server", broker_url, subscriptions=server_subscriptions(PREFIX, ids))
    device = connect("dev1", broker_url)
    device.publish(Topics(PREFIX, "dev_999").update, b"from an id not enrolled", "update-0", wait=True)
    device.publish(Topics(PREFIX, ids[-1]).update, b"from the last one", "update-1", wait=True)
    assert server.get(WAIT_S) == (Topics(PREFIX, ids[-1]).update, b"from the last one") and server.get(0) is None


def test_a_filter_dropped_from_the_subscriptions_is_unsubscribed_from_the_persistent_session(broker_url: str,
                                                                                         connect) -> None:
    """A server restarted with other filters (say, with aggregators reading the updates) under the same client id
    would otherwise still receive what its earlier run subscribed to."""
    connect("server", broker_url, subscriptions=[DEV1.up, DEV1.update]).stop()
    server = connect("server", broker_url, subscriptions=[DEV1.up], unsubscriptions=[DEV1.up, DEV1.update])
    device = connect("dev1", broker_url)
    device.publish(DEV1.update, b"for the aggregators", "update-1", wait=True)
    device.publish(DEV1.up, b"for the server", "up-1", wait=True)
    # The update went first, on the same connection: had it been delivered, it would be queued before this.
    assert server.get(WAIT_S) == (DEV1.up, b"for the server") and server.get(0) is None


def test_broker_with_persistence_keeps_retained_status_across_restart(start_mosquitto, connect,
                                                                     tmp_path: Path) -> None:
    broker = start_mosquitto(persistence_dir=tmp_path)
    connect("dev1", broker.url, status=(DEV1.status, plain_status)).stop()
    broker.stop()
    broker.start()
    server = connect("server", broker.url, subscriptions=[DEV1.status])
    assert status_of(server.get(WAIT_S))[:2] == (DEV1.status, "offline")


@pytest.mark.parametrize("broker_fixture", ["embedded_broker", "mosquitto_broker"])
def test_endpoint_reconnects_and_resubscribes_after_broker_restart(broker_fixture: str, request, connect) -> None:
    broker = request.getfixturevalue(broker_fixture)
    server = connect("server", broker.url, subscriptions=[DEV1.up])
    device = connect("dev1", broker.url)
    broker.stop()
    wait_for(lambda: not server.connected.is_set() and not device.connected.is_set(), WAIT_S,
             "both endpoints to see the broker gone")
    broker.start()
    server.wait_connected(WAIT_S)
    device.wait_connected(WAIT_S)
    device.publish(DEV1.up, b"after restart", "up-2", wait=True)
    assert server.get(WAIT_S) == (DEV1.up, b"after restart")
    assert server.stats["reconnects"] == device.stats["reconnects"] == 1


@pytest.mark.parametrize("persistent", [True, False], ids=["session-kept", "session-lost"])
def test_a_reconnect_counts_a_lost_session_only_where_the_broker_held_none(start_mosquitto, connect, tmp_path: Path,
                                                                           persistent: bool) -> None:
    """A broker that kept the session queued what came meanwhile (the server then re-sends nothing); one restarted
    without persistence held none, and the endpoint says so."""
    broker = start_mosquitto(persistence_dir=tmp_path) if persistent else start_mosquitto()
    server = connect("server", broker.url, subscriptions=[DEV1.up])
    broker.stop()
    wait_for(lambda: not server.connected.is_set(), WAIT_S, "the server to see the broker gone")
    broker.start()
    server.wait_connected(WAIT_S)
    assert server.stats["reconnects"] == 1
    assert server.stats["sessions_lost"] == (0 if persistent else 1)


def test_a_followed_filter_is_granted_only_once_the_broker_acknowledged_it_on_this_connection(mosquitto_broker,
                                                                                              connect) -> None:
    """What a device needs before it waits for a retained copy (device_runtime/payload_wait.py): a publish reaches it
    only while its subscription is granted, and a lost connection takes the grant with it until the next SUBACK."""
    device = connect("dev1", mosquitto_broker.url, subscriptions=[DEV1.down])
    assert device.granted_at(DEV1.update) is None
    device.follow(DEV1.update)
    wait_for(lambda: device.granted_at(DEV1.update) is not None, WAIT_S, "the SUBACK of the followed filter")
    first = device.granted_at(DEV1.update)
    mosquitto_broker.stop()
    wait_for(lambda: device.granted_at(DEV1.update) is None, WAIT_S, "the grant to go with the connection")
    mosquitto_broker.start()
    wait_for(lambda: device.granted_at(DEV1.update) is not None, WAIT_S, "the grant of the next connection")
    assert device.granted_at(DEV1.update) > first
    device.unfollow(DEV1.update)
    assert device.granted_at(DEV1.update) is None


@pytest.mark.parametrize("mqtt5", [False, True])
def test_a_qos0_flood_that_keeps_the_reader_busy_holds_back_no_acknowledgement(mosquitto_broker, connect,
                                                                               mqtt5: bool) -> None:
    """A flood faster than the endpoint reads keeps its read buffer full; the PUBACKs it owes (and anything it
    publishes) still go out between reads: mosquitto sends a 3.1.1 client at most 20 unacknowledged QoS 1 frames, so a
    message of 60 frames arrives only if they do (it waited for the keepalive's disconnect, 45 s, before). An MQTT 5
    endpoint announces a Receive Maximum of 65,535 (transport.RECEIVE_MAXIMUM) instead of being held to those 20."""
    server = connect("server", mosquitto_broker.url, subscriptions=[DEV1.up, DEV2.up], max_frame_bytes=SMALL_FRAME,
                     mqtt5=mqtt5)
    device = connect("dev1", mosquitto_broker.url, max_frame_bytes=SMALL_FRAME)
    flooder = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="flooder", protocol=mqtt.MQTTv311)
    flooder.connect("127.0.0.1", mosquitto_broker.port)
    flooder.loop_start()
    stop = threading.Event()

    def flood() -> None:
        while not stop.is_set():
            for _ in range(100):
                flooder.publish(DEV2.up, b"junk, not a frame", qos=0)
            time.sleep(0.001)

    worker = threading.Thread(target=flood, daemon=True)
    worker.start()
    try:
        wait_for(lambda: server.stats["frames_rejected"] > 1000, WAIT_S, "the flood reaching the server")
        payload = random.Random(2).randbytes(60 * (SMALL_FRAME - 512))
        device.publish(DEV1.up, payload, "big-1", wait=True)
        assert server.get(WAIT_S) == (DEV1.up, payload)
    finally:
        stop.set()
        worker.join(WAIT_S)
        flooder.loop_stop()


def test_invalid_frame_is_dropped_logged_and_counted(mosquitto_broker, connect, caplog) -> None:
    server = connect("server", mosquitto_broker.url, subscriptions=[DEV1.up])
    with caplog.at_level(logging.WARNING, logger="fedara.transport"):
        paho.mqtt.publish.single(DEV1.up, b"not a frame", qos=1, hostname="127.0.0.1",
                                 port=mosquitto_broker.port, client_id="rogue")
        wait_for(lambda: server.stats["frames_rejected"] == 1, WAIT_S, "the frame rejected")
    assert "[truncated]" in caplog.text
    assert server.stats["messages_in"] == 0


def test_a_frame_sent_again_is_delivered_once_and_its_repeat_logged_and_counted(mosquitto_broker, connect, caplog):
    """An exact replay seconds later looks like a QoS 1 re-delivery: dropped with a logged reason, not delivered."""
    server = connect("server", mosquitto_broker.url, subscriptions=[DEV1.up])
    (frame,) = chunk(b"payload", SMALL_FRAME, "up-1")
    with caplog.at_level(logging.INFO, logger="fedara.transport"):
        for _ in range(2):
            paho.mqtt.publish.single(DEV1.up, frame, qos=1, hostname="127.0.0.1", port=mosquitto_broker.port)
        wait_for(lambda: server.stats["frames_repeated"] == 1, WAIT_S, "the repeat dropped")
    assert server.get(WAIT_S) == (DEV1.up, b"payload") and server.get(0) is None  # both frames were handled
    assert server.stats["messages_in"] == 1 and server.stats["frames_rejected"] == 0
    assert "message 'up-1' was delivered moments ago (a re-delivery or a replay) [repeat]" in caplog.text


class CountAtLog(logging.Handler):
    """The endpoint's rejected-frame count at the moment each warning is logged."""

    def __init__(self, endpoint: MqttEndpoint) -> None:
        super().__init__(logging.WARNING)
        self.endpoint, self.counts = endpoint, []

    def emit(self, record: logging.LogRecord) -> None:
        self.counts.append(self.endpoint.stats["frames_rejected"])


def test_rejected_frame_is_logged_before_it_is_counted(embedded_broker, connect) -> None:
    """Whoever sees the count go up (a test, a health check) finds the reason already in the log."""
    server = connect("server", embedded_broker.url, subscriptions=[DEV1.up])
    spy = CountAtLog(server)
    logging.getLogger("fedara.transport").addHandler(spy)
    try:
        paho.mqtt.publish.single(DEV1.up, b"not a frame", qos=1, hostname="127.0.0.1",
                                 port=embedded_broker.port, client_id="rogue")
        wait_for(lambda: server.stats["frames_rejected"] == 1, WAIT_S, "the frame rejected")
    finally:
        logging.getLogger("fedara.transport").removeHandler(spy)
    assert spy.counts == [0]


# -- publish guards ---------------------------------------------------------------------------


def test_oversize_frame_is_refused_before_it_reaches_the_broker(mosquitto_broker, connect, monkeypatch) -> None:
    server = connect("server", mosquitto_broker.url, subscriptions=[DEV1.up])
    device = connect("dev1", mosquitto_broker.url, max_frame_bytes=SMALL_FRAME)
    monkeypatch.setattr(transport, "chunk", lambda payload, size, msg_id: chunk(payload, size + 1, msg_id))
    with pytest.raises(FrameTooLargeError, match=f"exceeds max_frame_bytes={SMALL_FRAME}"):
        device.publish(DEV1.up, bytes(2 * SMALL_FRAME), "too-big")
    assert device.stats["bytes_out"] == 0
    monkeypatch.undo()
    device.publish(DEV1.up, b"next", "up-3", wait=True)
    assert server.get(WAIT_S) == (DEV1.up, b"next")


def test_retained_message_longer_than_one_frame_is_rejected() -> None:
    endpoint = MqttEndpoint("dev1", "mqtt://127.0.0.1:1", max_frame_bytes=SMALL_FRAME)
    with pytest.raises(ValueError, match="must fit in one frame"):
        endpoint.publish(DEV1.status, bytes(2 * SMALL_FRAME), "status-1", retain=True)


def test_publish_wait_reports_unacknowledged_frames_when_no_broker_answers(connect) -> None:
    with socket_bound_but_not_listening() as port:
        device = connect("dev1", f"mqtt://127.0.0.1:{port}", wait=False)
        with pytest.raises(PublishError, match=r"1 of 1 frames not acknowledged within 0.2 s \(disconnected\)"):
            device.publish(DEV1.up, b"lost", "up-4", wait=True, timeout=0.2)


# -- credentials and ACL (mosquitto) ------------------------------------------------------------


def test_password_hash_matches_mosquitto_passwd_output() -> None:
    line = ("$7$101$6E3pTp5rAMrRFM4+$nyPViXbVi0gCDgJVDnnIhLgVbmNmatlxkZBVgYKUwNhUz6pAmIyVl3EnJwZbIJq80CdK6P"
            "EiMZvlugZEOpvIOA==")
    assert mosquitto_password_hash("secret", salt=bytes.fromhex("e84de94e9e6b00cad114ce3e"), iterations=101) == line


def test_acl_grants_each_device_only_its_own_topics() -> None:
    device_block = acl_text(PREFIX, "server", ["dev1"]).split("\n\n")[1]
    assert device_block.splitlines() == [
        "user dev1", f"topic write {DEV1.up}", f"topic write {DEV1.update}", f"topic write {DEV1.update}/+",
        f"topic write {DEV1.status}", f"topic read {DEV1.down}", f"topic read {PREFIX}/payload/#"]


@pytest.fixture
def secured_broker(tmp_path: Path, start_mosquitto):
    passwd, acl = write_mosquitto_auth(tmp_path / "auth", "server", "server-pw",
                                       {"dev1": "pw1", "dev2": "pw2"}, PREFIX)
    return start_mosquitto(password_file=passwd, acl_file=acl)


def test_device_cannot_publish_to_another_devices_up_topic(secured_broker, connect) -> None:
    server = connect("server", secured_broker.url, username="server", password="server-pw",
                     subscriptions=server_subscriptions(PREFIX))
    device = connect("dev1", secured_broker.url, username="dev1", password="pw1")
    device.publish(DEV2.up, b"forged", "up-5", wait=True)
    device.publish(DEV1.up, b"own", "up-6", wait=True)
    assert server.get(WAIT_S) == (DEV1.up, b"own")


def test_each_aggregator_reads_only_the_updates_routed_to_it_under_the_server_user(secured_broker, connect) -> None:
    """The ACL lets the server user's aggregators read the update levels routed to them, and a device write its own
    (in chunks: every frame reaches the one member) but not another device's."""
    members = [connect(f"agg-{i}", secured_broker.url, username="server", password="server-pw",
                       subscriptions=[member_update_filter(PREFIX, f"agg-{i}")]) for i in range(2)]
    device = connect("dev1", secured_broker.url, username="dev1", password="pw1", max_frame_bytes=SMALL_FRAME)
    payloads = [random.Random(i).randbytes(3 * SMALL_FRAME) for i in range(2)]
    device.publish(DEV2.update_via("agg-0"), b"forged", "update-forged", wait=True)
    for i, payload in enumerate(payloads):
        device.publish(DEV1.update_via(f"agg-{i}"), payload, f"update-{i}", wait=True)
    for i, member in enumerate(members):  # what a member must not get went before its own, on one connection
        assert member.get(WAIT_S) == (DEV1.update_via(f"agg-{i}"), payloads[i])
        assert member.get(0) is None


def test_device_cannot_read_another_devices_down_topic(secured_broker, connect) -> None:
    server = connect("server", secured_broker.url, username="server", password="server-pw")
    device = connect("dev1", secured_broker.url, username="dev1", password="pw1",
                     subscriptions=[DEV1.down, DEV2.down])
    server.publish(DEV2.down, b"for dev2", "down-2", wait=True)
    server.publish(DEV1.down, b"for dev1", "down-3", wait=True)
    assert device.get(WAIT_S) == (DEV1.down, b"for dev1")


def test_bad_password_is_refused(secured_broker, connect) -> None:
    device = connect("dev1", secured_broker.url, username="dev1", password="wrong", wait=False)
    with pytest.raises(BrokerRefusedError, match="refused the connection"):
        device.wait_connected(WAIT_S)


# -- TLS (mosquitto) ----------------------------------------------------------------------------


def test_tls_round_trip_with_the_test_ca(tls_files: TlsFiles, start_mosquitto, connect) -> None:
    broker = start_mosquitto(tls=tls_files)
    server = connect("server", broker.url, tls_ca=str(tls_files.cafile), subscriptions=[DEV1.up])
    device = connect("dev1", broker.url, tls_ca=str(tls_files.cafile))
    device.publish(DEV1.up, b"over tls", "up-7", wait=True)
    assert server.get(WAIT_S) == (DEV1.up, b"over tls")


def test_tls_refuses_a_broker_certificate_from_another_ca(tls_files: TlsFiles, start_mosquitto, connect,
                                                         tmp_path: Path) -> None:
    broker = start_mosquitto(tls=tls_files)
    _, other_ca = make_ca(tmp_path, "other-ca")
    device = connect("dev1", broker.url, tls_ca=str(other_ca), wait=False)
    with pytest.raises(ConnectTimeoutError):
        device.wait_connected(1.0)


def test_first_frames_on_1000_topics_hold_at_most_the_pending_budget(broker_url: str, connect) -> None:
    budget = 64 * SMALL_FRAME
    server = connect("server", broker_url, subscriptions=server_subscriptions(PREFIX), max_frame_bytes=SMALL_FRAME,
                     max_message_bytes=budget, max_pending_messages=10_000)
    first = chunk(random.Random(1).randbytes(budget), SMALL_FRAME, "flood")[0]
    host, port = BrokerURL.parse(broker_url).host, BrokerURL.parse(broker_url).port
    paho.mqtt.publish.multiple([(Topics(PREFIX, f"x{i}").up, first, 1, False) for i in range(1000)],
                               hostname=host, port=port)
    wait_for(lambda: server.stats["frames_in"] >= 1000, WAIT_S, "1000 frames in")
    assert server.stats["frames_in"] == 1000
    assert server.pending_bytes <= budget


def test_an_update_pushed_out_half_received_is_named_for_asking_its_sender_again(mosquitto_broker, connect) -> None:
    """Two multi-frame messages half-received with room for one: the first is pushed out, and its topic waits in
    take_lost (the server sends that device its task again: nothing else brings the update back)."""
    server = connect("server", mosquitto_broker.url, subscriptions=server_subscriptions(PREFIX),
                     max_frame_bytes=SMALL_FRAME, max_message_bytes=4 * SMALL_FRAME, max_pending_messages=1)
    first, second = (chunk(bytes([i]) * 2 * SMALL_FRAME, SMALL_FRAME, f"up-{i}")[0] for i in (1, 2))
    for topic, frame in ((DEV1.update, first), (DEV2.update, second)):
        paho.mqtt.publish.single(topic, frame, qos=1, hostname="127.0.0.1", port=mosquitto_broker.port)
    wait_for(lambda: server.stats["frames_in"] == 2, WAIT_S, "both first frames in")
    assert server.take_lost() == [DEV1.update] and server.take_lost() == []
    assert server.stats["messages_evicted"] == 1


def test_with_a_spill_an_update_past_the_memory_budget_completes_instead_of_being_pushed_out(mosquitto_broker, connect,
                                                                                             tmp_path: Path) -> None:
    """The same two half-received messages with room for one in memory: the second waits in the spill's file (every
    message vouched for here), both complete, nothing is named for asking again."""
    server = connect("server", mosquitto_broker.url, subscriptions=server_subscriptions(PREFIX),
                     max_frame_bytes=SMALL_FRAME, max_message_bytes=4 * SMALL_FRAME, max_pending_messages=1,
                     vouch=lambda sender, chunk0: 1, spill=FileSpill(tmp_path), max_spill_bytes=8 * SMALL_FRAME)
    payloads = {DEV1.update: bytes([1]) * 2 * SMALL_FRAME, DEV2.update: bytes([2]) * 2 * SMALL_FRAME}
    frames = {topic: chunk(p, SMALL_FRAME, f"up-{i}") for i, (topic, p) in enumerate(payloads.items())}
    for index in range(len(frames[DEV1.update])):  # interleaved, as the broker forwards a burst
        for topic in frames:
            paho.mqtt.publish.single(topic, frames[topic][index], qos=1, hostname="127.0.0.1",
                                     port=mosquitto_broker.port)
    got = dict(server.get(WAIT_S) for _ in payloads)
    assert got == payloads and server.take_lost() == []
    assert server.stats["messages_spilled"] == 1 and server.stats["messages_evicted"] == 0


def test_with_backpressure_the_queue_never_holds_more_than_its_budget_and_loses_nothing(mosquitto_broker,
                                                                                       connect) -> None:
    """A reader slower than the broker: past max_queued_bytes the network thread waits (the broker holds the rest)."""
    budget = 3 * SMALL_FRAME
    server = connect("server", mosquitto_broker.url, subscriptions=[DEV1.up], max_frame_bytes=2 * SMALL_FRAME,
                     max_queued_bytes=budget, backpressure=True)
    sent = [bytes([i]) * SMALL_FRAME for i in range(12)]
    paho.mqtt.publish.multiple([(DEV1.up, chunk(p, 2 * SMALL_FRAME, f"up-{i}")[0], 1, False)
                                for i, p in enumerate(sent)], hostname="127.0.0.1", port=mosquitto_broker.port)
    wait_for(lambda: server.stats["inbox_peak_bytes"] == budget, WAIT_S, "the queue full")
    taken = [server.get(WAIT_S) for _ in sent]
    assert taken == [(DEV1.up, p) for p in sent]
    assert server.stats["inbox_peak_bytes"] == budget and server.stats["messages_dropped"] == 0


@pytest.mark.parametrize("mqtt5", [False, True], ids=["mqtt311", "mqtt5"])
def test_a_burst_of_small_qos1_frames_arrives_whole_and_in_order(mosquitto_broker, connect, mqtt5: bool) -> None:
    """The endpoint reads its socket in blocks and acknowledges each PUBLISH on its own loop's next turn
    (transport._Client): every frame of a burst far beyond the broker's in-flight window (20) arrives, in order, so
    every acknowledgement went out."""
    server = connect("server", mosquitto_broker.url, subscriptions=[DEV1.up], mqtt5=mqtt5)
    device = connect("dev1", mosquitto_broker.url, mqtt5=mqtt5)
    sent = [f"frame {i}".encode() for i in range(2000)]
    for i, payload in enumerate(sent):
        device.publish(DEV1.up, payload, f"up-{i}")
    assert [server.get(WAIT_S) for _ in sent] == [(DEV1.up, p) for p in sent]
