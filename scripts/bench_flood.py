"""An incomplete-message flood on the update topic of an id not enrolled, then of an enrolled one, during a run,
against an undisturbed run (issue 44's goal).

    .venv/bin/python scripts/bench_flood.py --rate 10000 --rounds 4 --out flood.json

Debian's mosquitto on a free loopback port; three runs of ``python -m server.broker_loop`` (digits, 3 local devices,
``--rounds`` rounds, seed 0, frames of ``--frame-bytes`` so every update travels as several frames): undisturbed;
flooded on the update topic of an id nobody enrolled (``dev_009``); flooded on the update topic of an enrolled device
of the run (``dev_001``). The flood starts once round 1 is printed and lasts until the run ends: a paho client
publishing, QoS 0, ``--rate`` frames a second of chunk 0 of a 2-chunk message, a fresh msg_id each (the project's
framing code). Per run: each round's seconds, its participants, the flood's frames and achieved rate, the server
log's lines naming the flooded topic (0: no frame of it reached the server, or none was worth a line), and whether
the final model is bit-identical to the undisturbed run's; a table, and the JSON with ``--out``. The machine's load
shows in every figure: the flooder, the broker, the server and the devices share its cores.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from device_runtime.framing import FRAME_HEADER_BYTES, chunk  # noqa: E402
from device_runtime.topics import Topics  # noqa: E402
from server.mqtt.enrollment import enroll, save_enrollment  # noqa: E402
from server.mqtt.mosquitto_config import write_mosquitto_conf  # noqa: E402
from server.outputs.checkpoint import CHECKPOINT_NAME, load_checkpoint  # noqa: E402
from server.outputs.report import METRICS_FILE, read_metrics  # noqa: E402

PREFIX = "fedara"
MOSQUITTO = "/usr/sbin/mosquitto"
TICK_S = 0.01
JUNK_CHUNK_BYTES = 200
"""Chunk 0's bytes of a junk frame: small frames, so one Python flooder reaches ~10,000 a second."""
TARGETS = {"unenrolled": Topics(PREFIX, "dev_009").update, "enrolled": Topics(PREFIX, "dev_001").update}


def free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def junk_frame() -> bytes:
    return chunk(os.urandom(2 * JUNK_CHUNK_BYTES), FRAME_HEADER_BYTES + JUNK_CHUNK_BYTES,
                 f"flood-{uuid.uuid4().hex[:12]}")[0]


def flood(port: int, topic: str, rate: float, stop: threading.Event) -> tuple[int, float]:
    """Publish ``rate`` junk frames a second on ``topic`` until ``stop``; (frames sent, seconds)."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"flooder-{uuid.uuid4().hex[:8]}",
                         protocol=mqtt.MQTTv311)
    client.connect("127.0.0.1", port)
    client.loop_start()
    sent, started = 0, time.monotonic()
    while not stop.is_set():
        due = int((time.monotonic() - started + TICK_S) * rate)
        while sent < due and not stop.is_set():
            client.publish(topic, junk_frame(), qos=0)
            sent += 1
        time.sleep(TICK_S)
    seconds = time.monotonic() - started
    client.loop_stop()
    client.disconnect()
    return sent, seconds


def run(name: str, folder: Path, url: str, port: int, enrollment: Path, args: argparse.Namespace) -> dict:
    out = folder / name
    command = [sys.executable, "-m", "server.broker_loop", "--dataset", "digits", "--max-samples", "600",
               "--local-epochs", "1", "--batch-size", "32", "--lr", "0.05", "--threads", "1", "--join-timeout", "300",
               "--round-deadline", str(args.round_deadline), "--prefix", PREFIX, "--rounds", str(args.rounds),
               "--local-devices", "3",
               "--seed", "0", "--max-message-bytes", str(args.frame_bytes), "--broker", url, "--enroll",
               str(enrollment), "--out", str(out)]
    if args.cache_dir:
        command += ["--cache-dir", args.cache_dir]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, stop, result = [], threading.Event(), {}
    flooder = None
    for line in proc.stdout:
        lines.append(line)
        if name in TARGETS and flooder is None and line.startswith("round 1/"):
            flooder = threading.Thread(target=lambda: result.update(
                zip(("frames", "seconds"), flood(port, TARGETS[name], args.rate, stop))), daemon=True)
            flooder.start()
    code = proc.wait()
    stop.set()
    if flooder is not None:
        flooder.join()
    if code != 0:
        raise SystemExit(f"{name}: the run failed:\n{''.join(lines[-30:])}")
    records = read_metrics(out / METRICS_FILE)
    log = (out / "server.log").read_text()
    return {"run": name, "round_seconds": [r["seconds"] for r in records],
            "participants": [r["participants"] for r in records], "bytes_down": [r["bytes_down"] for r in records],
            "asked_again": log.count("pushed out half-received"), "flood_frames": result.get("frames", 0),
            "flood_lines_logged": log.count(TARGETS[name]) if name in TARGETS else 0,
            "flood_rate": result.get("frames", 0) / result["seconds"] if result.get("seconds") else 0.0,
            "folder": str(out)}


def same_model(a: Path, b: Path) -> bool:
    x, y = load_checkpoint(a / CHECKPOINT_NAME).tensors, load_checkpoint(b / CHECKPOINT_NAME).tensors
    return x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=10_000.0, help="flood frames per second")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--frame-bytes", type=int, default=16 * 1024, help="the run's --max-message-bytes")
    p.add_argument("--round-deadline", type=float, default=120.0, help="the run's --round-deadline")
    p.add_argument("--cache-dir", default=None, help="the runs' --cache-dir (compiled artifacts)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    for flag, value, lowest in (("--rate", args.rate, 1.0), ("--rounds", args.rounds, 2),
                                ("--frame-bytes", args.frame_bytes, FRAME_HEADER_BYTES + 1),
                                ("--round-deadline", args.round_deadline, 1.0)):
        if not value >= lowest:
            print(f"error: {flag} must be >= {lowest:g}, got {value:g}", file=sys.stderr)
            raise SystemExit(2)
    with tempfile.TemporaryDirectory(prefix="bench-flood-") as tmp:
        folder, port = Path(tmp), free_port()
        conf = write_mosquitto_conf(folder / "mosquitto.conf", port, args.frame_bytes,
                                    run_as_user="root" if os.geteuid() == 0 else None)
        with open(folder / "mosquitto.log", "wb") as log:
            broker = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
        try:
            time.sleep(0.5)
            enrollment = save_enrollment(folder / "enroll.json", enroll({}, [f"dev_{i:03d}" for i in range(3)]))
            url = f"mqtt://127.0.0.1:{port}"
            results = [run(name, folder, url, port, enrollment, args) for name in ("undisturbed", *TARGETS)]
            for r in results:
                r["model_equal"] = same_model(Path(results[0]["folder"]), Path(r["folder"]))
        finally:
            broker.terminate()
            broker.wait()
    base = results[0]["round_seconds"]
    print(f"{'run':<12} {'flood /s':>9} {'frames':>8} {'logged':>6} {'asked again':>11} {'model equal':>11}  "
          "round s (vs undisturbed)")
    for r in results:
        rounds = " ".join(f"{s:.2f}({s - b:+.2f})" for s, b in zip(r["round_seconds"], base))
        print(f"{r['run']:<12} {r['flood_rate']:>9.0f} {r['flood_frames']:>8} {r['flood_lines_logged']:>6} "
              f"{r['asked_again']:>11} "
              f"{str(r['model_equal']):>11}  {rounds}  participants {r['participants']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"rate": args.rate, "rounds": args.rounds, "runs": results},
                                             indent=1) + "\n")


if __name__ == "__main__":
    main()
