"""A subscriber endpoint in a process of its own, for tests that measure what one large packet costs a receiver:
``python -m tests.support.packet_receiver URL TOPIC_FILTER SENTINEL_TOPIC {5,3.1.1}`` subscribes, prints ``ready``,
waits for a message on SENTINEL_TOPIC, then prints its stats and its peak RSS growth as one JSON line."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from device_runtime.transport import MqttEndpoint

FRAME_BYTES = 256 * 1024
WAIT_S = 60.0


def peak_rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM")


def main(url: str, topic_filter: str, sentinel: str, version: str) -> None:
    endpoint = MqttEndpoint("packet-receiver", url, subscriptions=[topic_filter], clean_session=True,
                            max_frame_bytes=FRAME_BYTES, mqtt5=version == "5")
    endpoint.start()
    endpoint.wait_connected(WAIT_S)
    before = peak_rss_kib()
    print("ready", flush=True)
    while True:
        item = endpoint.get(WAIT_S)
        if item is None or item[0] == sentinel:
            break
    print(json.dumps({"sentinel": item is not None, "peak_rss_growth_mib": (peak_rss_kib() - before) / 1024,
                      **endpoint.stats}), flush=True)
    endpoint.stop()


if __name__ == "__main__":
    main(*sys.argv[1:])
