"""A device's queue of complete inbound messages stays bounded whatever arrives while it trains (issue 19)."""
from __future__ import annotations

import logging
import subprocess
import threading
from pathlib import Path

import psutil
import pytest

from device_runtime.agent import inbound_screen
from device_runtime.envelope import MessageType
from device_runtime.framing import chunk
from device_runtime.inbox import Inbox
from device_runtime.messages import ErrorCode, error_message
from device_runtime.topics import Topics
from device_runtime.transport import MqttEndpoint
from tests.support.broker import MOSQUITTO_PUB, mosquitto_pub
from tests.support.waiting import wait_for
from tests.support.sealing import device_link, read, seal_down
from tests.support.machine import missing_binary, require

JUNK_FRAMES = 20
JUNK_BYTES = 15 * 1024 * 1024
RSS_BOUND_MIB = 6 * JUNK_BYTES / 2**20
"""The stated bound (docs/reliability.md): junk never queues, so what remains is the transient copies of the
largest packet the broker passes (paho's growing read buffer, its payload, the frame's chunk), which the allocator
keeps for the next one."""
WAIT_S = 60


def reset_peak_rss() -> None:
    """Start this process's peak RSS (VmHWM) over from its current RSS (Linux: clear_refs "5")."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss_mib() -> float:
    """This process's peak RSS since the last reset_peak_rss, MiB: the kernel's count, no sampling."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def kinds(payload_kind: dict[bytes, str | None]):
    return lambda topic, payload: payload_kind[payload]


def test_the_newest_message_of_a_kind_replaces_the_queued_one_and_junk_never_queues(caplog):
    inbox = Inbox(1000, kinds({b"plan-1": "plan", b"task-1": "task", b"junk": None, b"task-2": "task"}))
    with caplog.at_level(logging.WARNING, "fedara.transport"):
        for payload in (b"plan-1", b"task-1", b"junk", b"task-2"):
            inbox.put("t", payload)
    assert [inbox.get(0), inbox.get(0), inbox.get(0)] == [("t", b"plan-1"), ("t", b"task-2"), None]
    assert inbox.dropped == 2 and "a newer one of its kind arrived" in caplog.text


def test_past_its_byte_budget_the_oldest_queued_messages_go_first():
    inbox = Inbox(10, kinds({b"aaaa": "a", b"bbbb": "b", b"cccccc": "c", b"x" * 11: "x"}))
    for payload in (b"aaaa", b"bbbb", b"cccccc", b"x" * 11):
        inbox.put("t", payload)
    assert (inbox.get(0), inbox.get(0), inbox.dropped, inbox.held_bytes) == (("t", b"bbbb"), ("t", b"cccccc"), 2, 0)


def test_without_a_screen_every_message_queues():
    inbox = Inbox()
    for payload in (b"1", b"1", b"2"):
        inbox.put("t", payload)
    assert [inbox.get(0) for _ in range(4)] == [("t", b"1"), ("t", b"1"), ("t", b"2"), None]


def test_an_inbox_that_waits_never_holds_more_than_its_budget_and_drops_nothing():
    """The server's queue (backpressure): a writer faster than the reader waits for room instead of dropping."""
    inbox, sent = Inbox(10, wait=True), [bytes([i]) * 4 for i in range(20)]
    writer = threading.Thread(target=lambda: [inbox.put("t", payload) for payload in sent], daemon=True)
    writer.start()
    taken = []
    while len(taken) < len(sent):
        assert inbox.held_bytes <= 10
        item = inbox.get(WAIT_S)
        assert item is not None, f"{len(taken)} of {len(sent)} messages taken, then none came"
        taken.append(item[1])
    writer.join(WAIT_S)
    assert taken == sent and inbox.dropped == 0 and inbox.peak_bytes <= 10


def test_a_message_larger_than_a_waiting_inbox_queues_once_the_queue_is_empty():
    inbox = Inbox(10, wait=True)
    inbox.put("t", b"a" * 8)
    writer = threading.Thread(target=inbox.put, args=("t", b"b" * 30), daemon=True)
    writer.start()
    assert inbox.get(WAIT_S) == ("t", b"a" * 8)
    assert inbox.get(WAIT_S) == ("t", b"b" * 30)
    writer.join(WAIT_S)
    assert not writer.is_alive()


def test_release_ends_a_wait_for_room():
    inbox = Inbox(10, wait=True)
    inbox.put("t", b"a" * 8)
    writer = threading.Thread(target=inbox.put, args=("t", b"b" * 8), daemon=True)
    writer.start()
    inbox.release()
    writer.join(WAIT_S)
    assert not writer.is_alive() and inbox.held_bytes == 16


def test_an_inbox_that_waits_takes_no_screen():
    with pytest.raises(ValueError, match="no screen"):
        Inbox(10, kinds({}), wait=True)


@pytest.mark.slow
def test_junk_published_while_a_device_trains_costs_it_no_queued_memory(start_mosquitto, tmp_path: Path):
    """20 complete 15 MB junk messages (one frame each) reach a device that takes nothing from its queue (it
    trains): each is dropped on arrival, the device's RSS stays within the stated bound, and the genuine TASK that
    came before them is still there."""
    require(missing_binary("mosquitto_pub", "mosquitto-clients"))
    broker = start_mosquitto(max_frame_bytes=2 * JUNK_BYTES)
    topics = Topics("fedara", "dev_001")
    link = device_link("dev_001", tmp_path / "auth")
    endpoint = MqttEndpoint("dev_001", broker.url, subscriptions=[topics.down], max_message_bytes=4 * JUNK_BYTES,
                            screen=inbound_screen(link, "dev_001", topics.down), max_queued_bytes=4 * JUNK_BYTES)
    endpoint.start()
    try:
        endpoint.wait_connected(WAIT_S)
        task = seal_down(error_message(ErrorCode.REJOIN, "join", device_id="dev_001"))
        mosquitto_pub(broker.port, topics.down, chunk(task, 256 * 1024, "error-genuine")[0], tmp_path / "task.bin")
        junk = [tmp_path / f"junk-{i}.bin" for i in range(JUNK_FRAMES)]
        for i, path in enumerate(junk):  # written before the measurement: only the device's memory is measured
            path.write_bytes(chunk(bytes([i]) * JUNK_BYTES, 2 * JUNK_BYTES, f"junk-{i}")[0])
        rss_before = psutil.Process().memory_info().rss / 2**20
        reset_peak_rss()
        for path in junk:
            subprocess.run([MOSQUITTO_PUB, "-h", "127.0.0.1", "-p", str(broker.port), "-q", "1", "-t", topics.down,
                            "-f", str(path)], check=True, capture_output=True)
        wait_for(lambda: endpoint.stats["messages_dropped"] >= JUNK_FRAMES, WAIT_S,
                 f"{JUNK_FRAMES} junk frames dropped")
        peak, rss_after = peak_rss_mib(), psutil.Process().memory_info().rss / 2**20
        print(f"device RSS {rss_before:.0f} MiB before {JUNK_FRAMES} x {JUNK_BYTES >> 20} MiB of junk, "
              f"{peak:.0f} at most while they arrived, {rss_after:.0f} after; bound +{RSS_BOUND_MIB:.0f} MiB")
        assert peak - rss_before <= RSS_BOUND_MIB and rss_after - rss_before <= RSS_BOUND_MIB
        topic, payload = endpoint.get(1)
        assert read(payload).type == MessageType.ERROR and endpoint.get(0) is None  # the junk came after it
    finally:
        endpoint.stop()
