"""The server's read path from a complete message to the fold, in one process, no broker: its CPU per byte.

    .venv/bin/python scripts/bench_read_path.py --clients 100 --rounds 2 --out read_path.json

K synthetic FedAvgCNN 3×32×32 devices at the five rank tiers round-robin (scripts/bench_aggregators.py's engine, one
torch thread as ``server.broker_loop`` runs by default) each send one sealed update a round (random tensors of
their plan's shapes, sealed before the clock starts); the server's link opens each (``Link.open_with_status``:
the frames of each, as the server's endpoint gets them, joined by its ``Reassembler`` with the server's limits;
decode, SHA-256 of the body, tag, counters) and the round engine takes it (``RoundEngine.receive``: checks, the
fold in device-id order), then the round closes (the new model). Per round: wall and CPU seconds (CPU is what a
loaded machine cannot stretch) of opening, receiving and closing, and MB/s of update tensor bytes over the round's
CPU seconds. ``--profile`` adds a cProfile of the last round, on CPU time, to the JSON's ``profile`` (the top
functions by cumulative CPU). Only paho's socket reads and MQTT parsing (the server's network thread) are not in it.

Apart, the round's own messages, which the server over MQTT sends and this read path does not
(``messages_cpu_s``): every asked device's TASK (built as ``server.broker_loop`` builds it, naming its plan's payload,
each plan's payload framed once), sealed and framed, and a RECEIVED receipt for every update taken, sealed and framed
(the sealing makes the verifier's accepts durable first: one fsync each, as the server does); not their publishes.
``scripts/fleet_load.py``'s server CPU per update compares with ``cpu_s + messages_cpu_s``.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))  # bench_aggregators

from device_runtime.auth import CounterSource, KeyRing, new_key  # noqa: E402
from device_runtime.framing import DEFAULT_MAX_FRAME_BYTES, FRAME_HEADER_BYTES, Reassembler, chunk  # noqa: E402
from device_runtime.link import Link  # noqa: E402
from device_runtime.messages import receipt_message, task_message  # noqa: E402
from device_runtime.topics import TopicKind  # noqa: E402
from server.broker_loop import inbound_limit  # noqa: E402
from server.mqtt.read_budgets import PENDING_MESSAGES, PENDING_UPDATES_BUDGETED  # noqa: E402
from server.compute_threads import use_server_threads  # noqa: E402
from server.outputs.machine import cpu_name  # noqa: E402
import bench_aggregators  # noqa: E402  (scripts/, beside this one)

MB = 1e6
PROFILE_LINES = 25


def sealed_updates(engine, keys: dict[str, bytes], max_inbound: int, round_index: int) -> list[tuple[str, bytes]]:
    """Every asked device's sealed update of the open round (bench_aggregators', as its publisher sends them)."""
    counters = CounterSource(int(time.time()) + round_index, 0)
    return [(device_id, sealed) for device_id, _, sealed in
            bench_aggregators.sealed_updates(engine.brief(max_inbound), keys, counters)]


def send_tasks(engine, link: Link, tasks: dict, now: float, frame_bytes: int) -> None:
    """Every task of the opened round as the server sends it (``Federation._send_built_task``), but not published: its
    plan's payload framed (once per plan), the TASK naming it sealed and framed."""
    for device_id, task in tasks.items():
        ref = None
        if task.weights and engine.shares_payloads:
            ref, data = engine.payload(device_id, task, now)
            if data is not None:
                chunk(data, frame_bytes, f"payload-{ref.sha256[:16]}")
        msg = task_message(task, plan_hash=engine.plan_info(device_id).hash, device_id=device_id,
                           run_id=engine.run_id, payload=ref)
        chunk(link.seal(msg), frame_bytes, msg.msg_id)


def send_receipt(link: Link, device_id: str, run_id: str, round_index: int, frame_bytes: int) -> None:
    """The RECEIVED of a taken update as the server sends it (``Federation._send_receipt``), sealed and framed."""
    msg = receipt_message(device_id=device_id, run_id=run_id, round_index=round_index)
    chunk(link.seal(msg), frame_bytes, msg.msg_id)


def run(clients: int, rounds: int, profile: bool, folder: Path, frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> dict:
    """The read path's rounds, every message in frames of ``frame_bytes`` (as the server's and its devices')."""
    use_server_threads(1)
    logging.getLogger("fedara.engine").setLevel(logging.ERROR)
    devices = [f"dev_{i:05d}" for i in range(clients)]
    keys = {d: new_key() for d in devices}
    engine = bench_aggregators.make_engine(devices, False, rounds, shared_payloads=True)
    max_inbound = inbound_limit(engine.global_state, {})
    link = Link.server(KeyRing(keys), folder / "server-state", max_inbound)
    reassembler = Reassembler(max_inbound, timeout_s=600.0, max_pending=PENDING_MESSAGES,
                              max_pending_bytes=PENDING_UPDATES_BUDGETED * max_inbound)
    results, profiler = [], None
    for r in range(1, rounds + 1):
        tasks = engine.open_round(r, time.monotonic())
        tasks_cpu = time.process_time()
        send_tasks(engine, link, tasks, time.monotonic(), frame_bytes)
        tasks_cpu = time.process_time() - tasks_cpu
        payloads = sealed_updates(engine, keys, max_inbound, r)
        framed = [(device_id, chunk(payload, frame_bytes, f"r{r}-{device_id}"))
                  for device_id, payload in payloads]
        if profile and r == rounds:
            profiler = cProfile.Profile(time.process_time)
            profiler.enable()
        wall, cpu = time.perf_counter(), time.process_time()
        join_wall = join_cpu = open_wall = open_cpu = receipts_cpu = 0.0
        for device_id, frames in framed:
            w, c = time.perf_counter(), time.process_time()
            for frame in frames:
                payload = reassembler.feed(frame, time.monotonic(), stream=device_id)
            join_wall += time.perf_counter() - w
            join_cpu += time.process_time() - c
            w, c = time.perf_counter(), time.process_time()
            msg, _ = link.open_with_status(payload, engine.run_id, device_id=device_id, kind=TopicKind.UPDATE)
            open_wall += time.perf_counter() - w
            open_cpu += time.process_time() - c
            verdict = engine.receive(device_id, msg, time.monotonic())
            if not verdict.accepted:
                raise SystemExit(f"error: {device_id}'s update was refused: {verdict.reason}")
            c = time.process_time()
            send_receipt(link, device_id, engine.run_id, r, frame_bytes)
            receipts_cpu += time.process_time() - c
        received_wall, received_cpu = time.perf_counter(), time.process_time()
        engine.close_round(time.monotonic())
        end_wall, end_cpu = time.perf_counter(), time.process_time()
        if profiler is not None:
            profiler.disable()
        nbytes = engine.pending["bytes_up"]
        row = {"round": r, "update_bytes": nbytes, "envelope_bytes": sum(len(p) for _, p in payloads),
               "join_s": join_wall, "join_cpu_s": join_cpu, "open_s": open_wall, "open_cpu_s": open_cpu,
               "receive_s": received_wall - wall - join_wall - open_wall,
               "receive_cpu_s": received_cpu - cpu - join_cpu - open_cpu - receipts_cpu,
               "close_s": end_wall - received_wall, "close_cpu_s": end_cpu - received_cpu,
               "seconds": end_wall - wall, "cpu_s": end_cpu - cpu - receipts_cpu,
               "mb_per_cpu_s": nbytes / MB / (end_cpu - cpu - receipts_cpu),
               "messages_cpu_s": tasks_cpu + receipts_cpu, "tasks_cpu_s": tasks_cpu, "receipts_cpu_s": receipts_cpu,
               "load_average_1min": os.getloadavg()[0]}
        results.append(row)
        print(f"round {r}: {nbytes / MB:.0f} MB, join {join_cpu:.3f} CPU s, open {open_cpu:.3f}, receive (checks, "
              f"fold) {row['receive_cpu_s']:.3f}, close {row['close_cpu_s']:.3f}; {row['cpu_s']:.3f} CPU s in "
              f"{row['seconds']:.3f} s: {row['mb_per_cpu_s']:.0f} MB per CPU s; apart, the round's messages "
              f"{tasks_cpu + receipts_cpu:.3f} (tasks {tasks_cpu:.3f}, receipts {receipts_cpu:.3f}); "
              f"load {row['load_average_1min']:.1f}",
              flush=True)
    out = {"clients": clients, "frame_bytes": frame_bytes, "cpu": cpu_name(), "rounds": results}
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(PROFILE_LINES)
        out["profile"] = text.getvalue()
        print(out["profile"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=100, help="sealed updates per round (K)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--frame-bytes", type=int, default=DEFAULT_MAX_FRAME_BYTES,
                   help="frame size of every message (the server's --max-message-bytes)")
    p.add_argument("--profile", action="store_true", help="cProfile the last round on CPU time")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    for flag, value in (("--clients", args.clients), ("--rounds", args.rounds)):
        if value < 1:
            print(f"error: {flag} must be >= 1, got {value}", file=sys.stderr)
            return 2
    if args.frame_bytes <= FRAME_HEADER_BYTES:
        print(f"error: --frame-bytes must exceed the {FRAME_HEADER_BYTES}-byte frame header, got {args.frame_bytes}",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="read-path-") as tmp:
        result = run(args.clients, args.rounds, args.profile, Path(tmp), args.frame_bytes)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
