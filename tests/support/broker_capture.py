"""Following a server run from outside, as the replay and freshness attacks do: every frame on the devices' topics
recorded by a plain paho subscriber (with a marker frame to know when it saw all before it), the run's printed
lines, and its memory."""
from __future__ import annotations

import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from device_runtime.framing import frame_msg_id

PREFIX = "fedara"
SUBSCRIBE_WAIT_S = 30
"""Bound on the recorder's subscription (a moment; only a failing test waits this long)."""
MARKER_TOPIC = f"{PREFIX}/dev/xmarker/up"
"""A marker sent after what a subscriber must have seen: the broker forwards messages to one subscriber in the
order it took them in, so once the marker arrived, so did everything before it. The server refuses it (no
such device) with a logged line."""


@dataclass
class Capture:
    """Every frame seen on ``PREFIX/dev/#`` by a plain paho subscriber: (topic, frame bytes)."""

    frames: list[tuple[str, bytes]] = field(default_factory=list)
    subscribed: threading.Event = field(default_factory=threading.Event)
    marked: threading.Event = field(default_factory=threading.Event)
    """Set when the marker arrived (it is not recorded)."""

    def on_message(self, _client, _userdata, message) -> None:
        if message.topic == MARKER_TOPIC:
            self.marked.set()
        else:
            self.frames.append((message.topic, bytes(message.payload)))

    def of(self, topic: str, msg_id_prefix: str) -> list[bytes]:
        """The frames on ``topic`` of the first message whose msg_id starts with ``msg_id_prefix``, in order."""
        chosen = None
        found = []
        for t, frame in self.frames:
            ident = frame_msg_id(frame)
            if t == topic and ident.startswith(msg_id_prefix) and ident == (chosen or ident):
                chosen = ident
                found.append(frame)
        assert found, f"nothing captured on {topic} with a msg_id starting {msg_id_prefix!r}"
        return found


def record(url_port: int, stop: threading.Event, capture: Capture) -> threading.Thread:
    """A plain paho subscriber to ``PREFIX/dev/#`` recording into ``capture`` until ``stop``; returns once it
    subscribed."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="recorder", protocol=mqtt.MQTTv311)
    client.on_connect = lambda c, *_: c.subscribe(f"{PREFIX}/dev/#", qos=1)
    client.on_subscribe = lambda *_: capture.subscribed.set()
    client.on_message = capture.on_message

    def run() -> None:
        client.connect("127.0.0.1", url_port)
        client.loop_start()
        stop.wait()
        client.loop_stop()
        client.disconnect()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert capture.subscribed.wait(SUBSCRIBE_WAIT_S), "the recorder did not subscribe"
    return thread


def wait_for_line(proc: subprocess.Popen, text: str, lines: list[str]) -> None:
    for line in proc.stdout:
        lines.append(line)
        if text in line:
            return
    raise AssertionError(f"the server ended without printing {text!r}:\n{''.join(lines[-30:])}")


def finish(proc: subprocess.Popen, lines: list[str], timeout: float = 300) -> None:
    lines.extend(proc.stdout)
    assert proc.wait(timeout) == 0, "".join(lines[-40:])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")
