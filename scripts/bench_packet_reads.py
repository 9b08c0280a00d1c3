"""The server's network thread alone: paho reading PUBLISH packets of update frames and the endpoint's reassembler
joining them, in CPU seconds of the reading thread. No broker: the packets (MQTT 5, QoS 1, 1 MiB frames of
2.2 MB updates, as scripts/fleet_load.py's devices send them) are written into one end of a socket pair by another
thread and read at the other by ``transport._Client``, as its network thread reads a broker's socket.

    .venv/bin/python scripts/bench_packet_reads.py --updates 200 --out packet_reads.json

Per repeat: MB read, the reading thread's CPU seconds (``time.thread_time``) and CPU ms per update. The reassembler is
the bench_read_path's (no admission, no vouch); the PUBACKs the reader owes are dropped, not written.
"""
from __future__ import annotations

import argparse
import json
import select
import socket
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import paho.mqtt.client as mqtt  # noqa: E402
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402
from paho.mqtt.properties import VariableByteIntegers  # noqa: E402

from device_runtime import transport  # noqa: E402
from device_runtime.framing import Reassembler, chunk  # noqa: E402
from server.outputs.machine import cpu_name  # noqa: E402

MB = 1e6
UPDATE_BYTES = 2_210_000
"""A FedAvgCNN update's envelope at scripts/fleet_load.py's tiers, about."""
FRAME_BYTES = 1 << 20
"""scripts/fleet_load.py's --max-message-bytes."""



def publish_packet(payload: bytes, mid: int, topic: str) -> bytes:
    """An MQTT 5 QoS 1 PUBLISH with no properties, as mosquitto forwards a device's frame."""
    body = len(topic).to_bytes(2, "big") + topic.encode() + mid.to_bytes(2, "big") + b"\x00" + payload
    return b"\x32" + VariableByteIntegers.encode(len(body)) + body


def measure(updates: int) -> dict:
    """Read ``updates`` updates' packets once; the reading thread's CPU."""
    packets = []
    for i in range(updates):
        for frame in chunk(bytes(UPDATE_BYTES), FRAME_BYTES, f"update-{i}"):
            packets.append(publish_packet(frame, len(packets) % 65535 + 1, f"fleet/dev/dev_{i:05d}/up"))
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    client = transport._Client(CallbackAPIVersion.VERSION2, client_id="reader", protocol=mqtt.MQTTv5)
    client._sock = ours  # noqa: SLF001
    reassembler = Reassembler(64 << 20, 600.0, 512, 128 << 20)
    complete = [0]

    def on_message(_client: object, _userdata: object, message: mqtt.MQTTMessage) -> None:
        if reassembler.feed(message.payload, time.monotonic(), stream=message.topic) is not None:
            complete[0] += 1

    client.on_message = on_message
    writer = threading.Thread(target=lambda: [theirs.sendall(p) for p in packets], daemon=True)
    writer.start()
    cpu = time.thread_time()
    while complete[0] < updates:
        select.select([ours], [], [], 1.0)
        client.loop_read()
        client._out_packet.clear()  # noqa: SLF001  (the PUBACKs: nobody reads them here)
    cpu = time.thread_time() - cpu
    writer.join(10)
    ours.close()
    theirs.close()
    nbytes = sum(map(len, packets))
    return {"updates": updates, "mb": nbytes / MB, "reader_cpu_s": cpu, "ms_per_update": cpu / updates * 1000}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--updates", type=int, default=200, help="updates read per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    for flag, value in (("--updates", args.updates), ("--repeats", args.repeats)):
        if value < 1:
            print(f"error: {flag} must be >= 1, got {value}", file=sys.stderr)
            return 2
    rows = [measure(args.updates) for _ in range(args.repeats)]
    print("| repeat | MB | reader CPU s | CPU ms per update |\n|---:|---:|---:|---:|")
    for i, row in enumerate(rows, 1):
        print(f"| {i} | {row['mb']:.0f} | {row['reader_cpu_s']:.3f} | {row['ms_per_update']:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"cpu": cpu_name(), "rounds": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
