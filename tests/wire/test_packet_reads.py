"""The endpoint's paho client reads packets as paho would (transport._Client): a long body read into one buffer, a
PUBLISH decoded in place. No broker: packets written by hand into one end of a socket pair."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.exception import MalformedPacket
from paho.mqtt.properties import VariableByteIntegers

from device_runtime import transport

TOPIC = "fedara/dev/dev_001/up"



def publish_packet(payload: bytes, *, qos: int = 1, mid: int = 7, topic: str = TOPIC, retain: bool = False,
                   properties: bytes | None = None) -> bytes:
    """A PUBLISH as a broker sends it (``properties``: MQTT 5's property bytes, without their length)."""
    body = len(topic).to_bytes(2, "big") + topic.encode()
    if qos:
        body += mid.to_bytes(2, "big")
    if properties is not None:
        body += VariableByteIntegers.encode(len(properties)) + properties
    body += payload
    return bytes([0x30 | qos << 1 | int(retain)]) + VariableByteIntegers.encode(len(body)) + body


@pytest.fixture(params=[mqtt.MQTTv311, mqtt.MQTTv5], ids=["mqtt311", "mqtt5"])
def client(request) -> Iterator[tuple[transport._Client, socket.socket, list[mqtt.MQTTMessage]]]:
    """A client reading one end of a socket pair (the broker's side is the other), and the messages it delivered."""
    ours, broker = socket.socketpair()
    ours.setblocking(False)
    client = transport._Client(CallbackAPIVersion.VERSION2, client_id="reader", protocol=request.param)
    client._sock = ours  # noqa: SLF001
    delivered: list[mqtt.MQTTMessage] = []
    client.on_message = lambda _client, _userdata, message: delivered.append(message)
    yield client, broker, delivered
    broker.close()
    ours.close()


def read_all(client: transport._Client) -> MQTTErrorCode:
    """paho's read loop, until the socket has nothing more to give."""
    rc = MQTTErrorCode.MQTT_ERR_SUCCESS
    while rc == MQTTErrorCode.MQTT_ERR_SUCCESS:
        rc = client._packet_read()  # noqa: SLF001
    return rc


def mqtt5_properties(client: transport._Client) -> bytes | None:
    return b"" if client._protocol == mqtt.MQTTv5 else None  # noqa: SLF001


def test_a_body_longer_than_one_read_arrives_whole_once_its_last_byte_is_in(client) -> None:
    reader, broker, delivered = client
    payload = bytes(range(256)) * 1200  # 300 KB: several socket reads, past the 64 KiB read-ahead
    packet = publish_packet(payload, properties=mqtt5_properties(reader))
    for start in range(0, len(packet) - 1, 100_000):
        broker.sendall(packet[start:min(start + 100_000, len(packet) - 1)])
        assert read_all(reader) == MQTTErrorCode.MQTT_ERR_AGAIN
        assert delivered == []
    broker.sendall(packet[-1:])
    read_all(reader)
    assert [(m.topic, m.mid, m.qos, bytes(m.payload)) for m in delivered] == [(TOPIC, 7, 1, payload)]


def test_packets_back_to_back_in_one_read_each_arrive_with_their_own_payload(client) -> None:
    reader, broker, delivered = client
    payloads = [b"a" * 10, b"b" * 100_000, b"", b"c" * 70_000]
    broker.sendall(b"".join(publish_packet(p, mid=i + 1, properties=mqtt5_properties(reader))
                            for i, p in enumerate(payloads)))
    read_all(reader)
    assert [(m.mid, bytes(m.payload)) for m in delivered] == [(i + 1, p) for i, p in enumerate(payloads)]


def test_a_qos1_publish_is_acknowledged_with_its_packet_id(client) -> None:
    reader, broker, _ = client
    broker.sendall(publish_packet(b"frame", mid=513, properties=mqtt5_properties(reader)))
    read_all(reader)
    assert [p["packet"] for p in reader._out_packet] == [bytes([transport.PUBACK, 2, 2, 1])]  # noqa: SLF001


def test_a_qos0_retained_publish_has_no_packet_id_and_says_retained(client) -> None:
    reader, broker, delivered = client
    broker.sendall(publish_packet(b"frame", qos=0, retain=True, properties=mqtt5_properties(reader)))
    read_all(reader)
    assert [(m.mid, m.qos, m.retain, bytes(m.payload)) for m in delivered] == [(0, 0, True, b"frame")]
    assert not reader._out_packet  # noqa: SLF001


def test_mqtt5_properties_are_read_and_the_payload_starts_after_them() -> None:
    ours, broker = socket.socketpair()
    ours.setblocking(False)
    reader = transport._Client(CallbackAPIVersion.VERSION2, client_id="reader", protocol=mqtt.MQTTv5)
    reader._sock = ours  # noqa: SLF001
    delivered: list[mqtt.MQTTMessage] = []
    reader.on_message = lambda _c, _u, message: delivered.append(message)
    expiry = bytes([0x02]) + (60).to_bytes(4, "big")  # Message Expiry Interval: 60 s
    broker.sendall(publish_packet(b"x" * 80_000, properties=expiry))
    read_all(reader)
    assert delivered[0].properties.MessageExpiryInterval == 60
    assert bytes(delivered[0].payload) == b"x" * 80_000
    ours.close()
    broker.close()


@pytest.mark.parametrize("body", [b"\x00", b"\x00\x09top", b"\x00\x03top\x00"], ids=["no-topic-length",
                                                                                      "topic-cut", "packet-id-cut"])
def test_a_truncated_publish_is_malformed_and_delivers_nothing(client, body: bytes) -> None:
    reader, _, delivered = client
    reader._in_packet.update(command=0x32, packet=bytearray(body))  # noqa: SLF001  (QoS 1)
    with pytest.raises(MalformedPacket):
        reader._handle_publish()  # noqa: SLF001
    assert delivered == []


def test_a_closed_connection_drops_what_was_read_ahead_of_it(client) -> None:
    reader, broker, delivered = client
    packet = publish_packet(b"y" * 200_000, properties=mqtt5_properties(reader))
    broker.sendall(packet[:150_000])
    read_all(reader)
    reader._sock_close()  # noqa: SLF001
    ours, broker2 = socket.socketpair()
    ours.setblocking(False)
    reader._sock = ours  # noqa: SLF001
    reader._in_packet.update(command=0, have_remaining=0, remaining_count=[], remaining_mult=1,  # noqa: SLF001
                             remaining_length=0, packet=bytearray(), to_process=0, pos=0)
    broker2.sendall(publish_packet(b"fresh", properties=mqtt5_properties(reader)))
    read_all(reader)
    assert [bytes(m.payload) for m in delivered] == [b"fresh"]
    ours.close()
    broker2.close()


@pytest.mark.parametrize("cut", [1, 2, 3], ids=["after-type", "inside-length", "after-length"])
def test_a_fixed_header_cut_at_a_read_boundary_is_read_once_the_rest_arrives(client, cut: int) -> None:
    reader, broker, delivered = client
    payload = b"z" * 20_000  # remaining length in 2 bytes: the cut can fall between them
    packet = publish_packet(payload, properties=mqtt5_properties(reader))
    broker.sendall(packet[:cut])
    assert read_all(reader) == MQTTErrorCode.MQTT_ERR_AGAIN
    broker.sendall(packet[cut:])
    read_all(reader)
    assert [(m.mid, bytes(m.payload)) for m in delivered] == [(7, payload)]


def test_a_remaining_length_longer_than_four_bytes_is_a_protocol_error(client) -> None:
    reader, broker, delivered = client
    broker.sendall(bytes([0x32, 0x80, 0x80, 0x80, 0x80, 0x01]) + b"x" * 64)
    assert read_all(reader) == MQTTErrorCode.MQTT_ERR_PROTOCOL
    assert delivered == []

