"""How fast the server's endpoint drains a junk flood, and its CPU per frame (issue 44's read path).

    .venv/bin/python scripts/bench_drain.py --frames 9000 --repeats 2 --out drain.json

Debian's mosquitto on a free loopback port (the generated config, 16 KiB frames). Per MQTT version the broker
speaks to the endpoint (3.1.1 and 5) and per repeat: the server's endpoint (``server.broker_loop``'s admission:
enrolled ``dev_000`` only, persistent session) subscribes once and goes away; ``--frames`` QoS 1 frames of junk
(at most the generated config's ``max_queued_messages``, which mosquitto holds for an offline session)
(chunk 0 of 2, the flood of scripts/bench_flood.py) are queued for it on the update topic of ``dev_009``, an id
nobody enrolled; then it connects and drains them. Per run: the wall seconds until every frame was counted
(``frames_unadmitted``), frames a second, and the process's CPU microseconds a frame (its network thread's: the
main thread sleeps). A table, and the JSON with ``--out``. The machine's load shows in every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))  # bench_flood: the flood's frame

from device_runtime.auth import KeyRing  # noqa: E402
from device_runtime.topics import Topics, update_filter  # noqa: E402
from device_runtime.transport import MqttEndpoint  # noqa: E402
from bench_flood import MOSQUITTO, PREFIX, free_port, junk_frame  # noqa: E402
from server.mqtt.admission import server_admission  # noqa: E402
from server.mqtt.mosquitto_config import MAX_QUEUED_MESSAGES, write_mosquitto_conf  # noqa: E402

FRAME_BYTES = 16 * 1024
WAIT_S = 300.0
VERSIONS = {"3.1.1": False, "5": True}


def endpoint(url: str, mqtt5: bool, session: str) -> MqttEndpoint:
    admit, vouch = server_admission(PREFIX, KeyRing({"dev_000": bytes(32)}))
    return MqttEndpoint(f"bench-drain-{session}", url, subscriptions=[update_filter(PREFIX)], admit=admit, vouch=vouch,
                        max_frame_bytes=FRAME_BYTES, backpressure=True, clean_session=False, mqtt5=mqtt5)


def queue_junk(port: int, frames: int) -> None:
    """``frames`` QoS 1 junk frames on dev_009's update topic, each acknowledged by the broker."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bench-drain-flooder", protocol=mqtt.MQTTv311)
    client.max_inflight_messages_set(1000)
    client.connect("127.0.0.1", port)
    client.loop_start()
    topic = Topics(PREFIX, "dev_009").update
    for info in [client.publish(topic, junk_frame(), qos=1) for _ in range(frames)]:
        info.wait_for_publish(WAIT_S)
    client.loop_stop()
    client.disconnect()


def drain(url: str, port: int, frames: int, version: str, repeat: int) -> dict:
    session = f"{version}-{repeat}"  # a session of its own: no frame of another drain left in it
    first = endpoint(url, VERSIONS[version], session)
    first.start()
    first.wait_connected(WAIT_S)
    first.stop()
    queue_junk(port, frames)
    server = endpoint(url, VERSIONS[version], session)
    started, cpu = time.perf_counter(), time.process_time()
    server.start()
    while server.stats["frames_unadmitted"] < frames and time.perf_counter() - started < WAIT_S:
        time.sleep(0.01)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    drained = server.stats["frames_unadmitted"]
    server.stop()
    return {"mqtt": version, "frames": drained, "seconds": seconds, "frames_per_s": drained / seconds,
            "cpu_us_per_frame": cpu * 1e6 / max(drained, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=9_000,
                   help=f"junk frames queued for each drain (1..{MAX_QUEUED_MESSAGES}: what the broker queues)")
    p.add_argument("--repeats", type=int, default=2, help="drains per MQTT version")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    for flag, value, highest in (("--frames", args.frames, MAX_QUEUED_MESSAGES), ("--repeats", args.repeats, 100)):
        if not 1 <= value <= highest:
            print(f"error: {flag} must be in 1..{highest}, got {value}", file=sys.stderr)
            raise SystemExit(2)
    with tempfile.TemporaryDirectory(prefix="bench-drain-") as tmp:
        port = free_port()
        conf = write_mosquitto_conf(Path(tmp) / "mosquitto.conf", port, FRAME_BYTES,
                                    run_as_user="root" if os.geteuid() == 0 else None)
        with open(Path(tmp) / "mosquitto.log", "wb") as log:
            broker = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
        try:
            time.sleep(0.5)
            url = f"mqtt://127.0.0.1:{port}"
            runs = [drain(url, port, args.frames, version, i) for i in range(args.repeats) for version in VERSIONS]
        finally:
            broker.terminate()
            broker.wait()
    print(f"{'MQTT':<6} {'frames':>8} {'seconds':>8} {'frames/s':>9} {'CPU us/frame':>13}")
    for r in runs:
        print(f"{r['mqtt']:<6} {r['frames']:>8} {r['seconds']:>8.2f} {r['frames_per_s']:>9.0f} "
              f"{r['cpu_us_per_frame']:>13.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"frames": args.frames, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
