"""MQTT 5 where the broker speaks it (device_runtime/transport.py): the endpoint announces a Maximum Packet Size (its
frame size plus headroom) in CONNECT, so Debian's mosquitto never delivers it a larger packet, even where nothing
caps packets on the broker; a 3.1.1 endpoint reads such a packet whole before it refuses it (the cost docs/scale.md
states). The 3.1.1 brokers (amqtt, NATS) are found by ``speaks_mqtt5`` and keep 3.1.1."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from device_runtime.framing import chunk
from device_runtime.topics import Topics, payload_topic
from device_runtime.transport import speaks_mqtt5
from tests.support.broker import MOSQUITTO_BIN, MOSQUITTO_PUB, MosquittoProcess, free_loopback_port
from tests.support.machine import missing_binary, require
from tests.support.packet_receiver import FRAME_BYTES

REPO_ROOT = Path(__file__).resolve().parents[2]
JUNK_BYTES = 50 * 1024 * 1024
WAIT_S = 60
DEV1 = Topics("fedara", "dev_001")
RSS_SLACK_MIB = 16
"""What the MQTT 5 receiver's peak RSS may grow by while the 50 MB packet is published (it never comes)."""


@pytest.fixture
def uncapped_mosquitto(tmp_path: Path) -> Iterator[MosquittoProcess]:
    """Debian's mosquitto with no max_packet_size: it takes and relays packets up to MQTT's 256 MB."""
    require(missing_binary("mosquitto", "mosquitto", MOSQUITTO_BIN))
    require(missing_binary("mosquitto_pub", "mosquitto-clients"))
    port = free_loopback_port()
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\n"
                    + ("user root\n" if os.geteuid() == 0 else ""))
    broker = MosquittoProcess(conf, port, tmp_path / "mosquitto.log")
    broker.start()
    yield broker
    broker.stop()


def receive_after_junk(broker: MosquittoProcess, version: str, tmp_path: Path) -> dict:
    """A receiver process subscribed to payload topics; 50 MB retained on one of them, then a sentinel frame: the
    receiver's stats and peak RSS growth once the sentinel came."""
    topic = payload_topic("fedara", "run1", "ab" * 32)
    receiver = subprocess.Popen([sys.executable, "-m", "tests.support.packet_receiver", broker.url, "fedara/payload/#",
                                 f"{topic}/sentinel", version], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout.readline().strip() == "ready"
        junk, sentinel = tmp_path / "junk.bin", tmp_path / "sentinel.bin"
        junk.write_bytes(os.urandom(JUNK_BYTES))
        (frame,) = chunk(b"after the junk", FRAME_BYTES, "sentinel")
        sentinel.write_bytes(frame)
        for path, target, retain in ((junk, f"{topic}/0", ["-r"]), (sentinel, f"{topic}/sentinel", [])):
            subprocess.run([MOSQUITTO_PUB, "-h", "127.0.0.1", "-p", str(broker.port), "-q", "1", *retain, "-t", target,
                            "-f", str(path)], check=True, capture_output=True, timeout=WAIT_S)
        report = json.loads(receiver.stdout.readline())
    finally:
        receiver.wait(WAIT_S)
    print(f"MQTT {version}: {report}")
    assert report["sentinel"]
    return report


def test_the_broker_never_sends_an_mqtt5_endpoint_a_packet_over_its_maximum(uncapped_mosquitto, tmp_path: Path):
    report = receive_after_junk(uncapped_mosquitto, "5", tmp_path)
    assert report["frames_in"] == 1 and report["frames_rejected"] == 0  # the sentinel only
    assert report["peak_rss_growth_mib"] < RSS_SLACK_MIB


@pytest.mark.slow  # 150 MiB for a moment
def test_an_mqtt311_endpoint_reads_the_oversized_packet_whole_before_refusing_it(uncapped_mosquitto, tmp_path: Path):
    """Read whole, into one buffer of its size (device_runtime/transport.py's ``_Client._read_body``; paho's own
    reads held it about three times): the cost MQTT 5 removes."""
    report = receive_after_junk(uncapped_mosquitto, "3.1.1", tmp_path)
    assert report["frames_rejected"] == 1
    assert JUNK_BYTES / 2**20 - RSS_SLACK_MIB <= report["peak_rss_growth_mib"] <= JUNK_BYTES / 2**20 + RSS_SLACK_MIB


def test_mosquitto_speaks_mqtt5_and_the_embedded_broker_does_not(mosquitto_broker, embedded_broker):
    assert speaks_mqtt5(mosquitto_broker.url)
    assert not speaks_mqtt5(embedded_broker.url)


def test_an_mqtt5_persistent_session_gets_messages_sent_while_it_was_offline(mosquitto_broker, connect) -> None:
    connect("dev1", mosquitto_broker.url, subscriptions=[DEV1.down], mqtt5=True).stop()
    server = connect("server", mosquitto_broker.url, mqtt5=True)
    server.publish(DEV1.down, b"queued task", "down-1", wait=True)
    device = connect("dev1", mosquitto_broker.url, subscriptions=[DEV1.down], mqtt5=True)
    assert device.get(WAIT_S) == (DEV1.down, b"queued task")
