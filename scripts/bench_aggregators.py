"""Seconds per round and MB/s of a round's updates through a broker, with 0, 1, 2, 3 aggregator processes.

    .venv/bin/python scripts/bench_aggregators.py --clients 150 --aggregators 0,1,2,3 --brokers mosquitto,nats \
        --out docs/results/aggregators/bench_aggregators.json

K synthetic FedAvgCNN 3×32×32 devices at the five rank tiers round-robin (1.0, 0.75, 0.5, 0.25, 0.125) are enrolled
in a real round engine; a publisher process seals each device's update of the round under the device's key
(random tensors of its plan's shapes, built before the clock starts) and publishes all K as fast as mosquitto
takes them. The server side is the one ``server.broker_loop`` runs (its ``Federation``): with N = 0 the engine
reads and folds every update itself; with N ≥ 1, N ``python -m server.aggregator`` processes take the updates
routed to them (``PREFIX/dev/<id>/update/<member>``, the member the engine names for that device), send receipts,
fold what the engine accepts and send their partial sums at the close. Every message travels in frames of at most
``--max-message-bytes`` (1 MB, EMQX's default limit: the larger updates go in chunks). A round is timed from the publisher's start to the new global model (receipts, verdicts, partial sums
and the merge included; the factorization that opens a round is not: it does not depend on N). MB/s is the
round's update tensor bytes over that time. A first row, "broker only", takes the same publishes off the broker
with one plain subscriber that opens none of them: the ceiling the broker and the publisher set here.
``--brokers``: one Debian mosquitto on loopback, and/or a 3-node NATS cluster with MQTT on loopback
(scripts/nats_cluster.py) where the engine uses node 1, the publisher node 2, member i node i + 2 (mod 3) and the
plain subscriber node 3. Every process runs on this machine.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from device_runtime.auth import CounterSource, Direction, KeyRing, new_key  # noqa: E402
from device_runtime.envelope import seal  # noqa: E402
from device_runtime.link import Link  # noqa: E402
from device_runtime.messages import Join, ShardInfo, update_message  # noqa: E402
from device_runtime.profile import ResourceProfile  # noqa: E402
from device_runtime.spill import FileSpill  # noqa: E402
from device_runtime.task import Update  # noqa: E402
from device_runtime.topics import Topics, server_subscriptions, update_filter  # noqa: E402
from device_runtime.transport import MqttEndpoint, rotate_brokers  # noqa: E402
from fedcore.models import build_model  # noqa: E402
from server.engine import folding_records as folding  # noqa: E402
from server.outputs.machine import cpu_name  # noqa: E402
from server.mqtt import aggregation_wire as wire  # noqa: E402
from server.broker_loop import AGGREGATORS_DIR, Federation, inbound_limit  # noqa: E402
from server.broker_flags import DEFAULT_SECAGG_PHASE_TIMEOUT_S  # noqa: E402
from server.mqtt.admission import server_admission  # noqa: E402
from server.mqtt.read_budgets import SPILL_DIR, reader_budgets  # noqa: E402
from server.mqtt.local_processes import LocalDevices, aggregator_command  # noqa: E402
from server.engine.coordinator import Coordinator, CoordinatorConfig  # noqa: E402
from server.engine.round_engine import RoundEngine, algorithm_for  # noqa: E402
from server.mqtt.enrollment import load_server_key, save_enrollment  # noqa: E402
from server.mqtt.mosquitto_config import write_mosquitto_conf  # noqa: E402
from server.run_setup import PlanBook, RunFolder, global_state, initial_personal  # noqa: E402
from server.engine.run_config import FederationConfig  # noqa: E402

MODEL, SHAPE, CLASSES = "fedavgcnn", (3, 32, 32), 10
TIERS = (1.0, 0.75, 0.5, 0.25, 0.125)
PREFIX = "bench"
SAMPLES = 100
MOSQUITTO = "/usr/sbin/mosquitto"
BROKER_LIMIT = 64 << 20
TIMEOUT_S = 600.0
MB = 1e6
FRAME_BYTES = 1 << 20
NATS_NODES = 3


def nats_cluster_module():
    """scripts/nats_cluster.py, imported from beside this script."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("nats_cluster", Path(__file__).with_name("nats_cluster.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def start_broker(folder: Path) -> tuple[subprocess.Popen, str]:
    """A mosquitto on a free loopback port (its message limit well above the frames)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    conf = write_mosquitto_conf(folder / "mosquitto.conf", port, BROKER_LIMIT)
    with open(folder / "mosquitto.log", "wb") as log:  # its warnings (a client's queue dropping messages) stay readable
        proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"mqtt://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"mosquitto did not start on port {port}")


@contextlib.contextmanager
def broker_of(kind: str, folder: Path) -> Iterator[str]:
    """The --broker value of a fresh broker of ``kind`` for as long as the block runs."""
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "nats":
        with nats_cluster_module().NatsCluster(folder / "nats", NATS_NODES) as cluster:
            yield cluster.broker
        return
    proc, url = start_broker(folder)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait()



def make_engine(devices: list[str], remote: bool, rounds: int, shared_payloads: bool = False) -> RoundEngine:
    """A FedARA round engine with ``devices`` joined and ready, at the five tiers round-robin; with
    ``shared_payloads`` its tasks name their plan's payload, as ``server.broker_loop``'s do."""
    model = build_model(MODEL, SHAPE, CLASSES, seed=0)
    algorithm = algorithm_for(FederationConfig(rounds=rounds))
    coordinator = Coordinator(CoordinatorConfig(SHAPE, CLASSES, round_deadline_s=TIMEOUT_S), "bench-run")
    engine = RoundEngine(algorithm, FederationConfig(rounds=rounds), coordinator,
                         PlanBook(model, SHAPE, None, onnx=False), global_state(model, algorithm),
                         initial_personal([model], algorithm), tiers=TIERS,
                         overrides={d: TIERS[i % len(TIERS)] for i, d in enumerate(devices)}, remote=remote,
                         shared_payloads=shared_payloads)
    profile = ResourceProfile(None, 1, 1, "x86_64", "Linux", None, 1.0)
    for device_id in devices:
        plan = engine.join(device_id, Join(profile, ShardInfo(SAMPLES, 10, SHAPE, CLASSES), ())).plan
        engine.acknowledge(device_id, plan.plan_hash)
    return engine


def sealed_updates(brief: folding.Brief, keys: dict[str, bytes], counters: CounterSource
                   ) -> list[tuple[str, str, bytes]]:
    """Every asked device's update of the round (random, small tensors of its plan), sealed under its key:
    (device, msg_id, the sealed bytes), in device-id order."""
    rng = np.random.default_rng(brief.round)
    out = []
    for device_id, asked in sorted(brief.devices.items()):
        weights = {k: rng.standard_normal(s, dtype=np.float32) * np.float32(1e-2)
                   for k, s in brief.plan_shapes[asked.plan_hash].items()}
        update = Update(brief.round, weights, asked.num_samples, 1.0, 0.5,
                        {"eval_correct": 5, "eval_total": 10, "eval_loss": 1.0})
        msg = update_message(update, plan_hash=asked.plan_hash, device_id=device_id, run_id=brief.run_id)
        out.append((device_id, msg.msg_id, seal(msg, keys[device_id], Direction.UP, counters.next())))
    return out


def publisher(url: str, brief: folding.Brief, routes: dict[str, str | None], keys: dict[str, bytes], epoch: int,
              first_seq: int, ready: mp.Event, go: mp.Event) -> None:
    """Seal every asked device's update of the round, say ready, publish them all once told to go."""
    payloads = [(Topics(PREFIX, device_id).update_via(routes[device_id]), sealed, msg_id)
                for device_id, msg_id, sealed in sealed_updates(brief, keys, CounterSource(epoch, first_seq))]
    endpoint = MqttEndpoint(f"bench-devices-{brief.round}", url, max_frame_bytes=FRAME_BYTES, clean_session=True)
    endpoint.start()
    endpoint.wait_connected(30)
    ready.set()
    go.wait()
    for topic, payload, msg_id in payloads:
        endpoint.publish(topic, payload, msg_id)
    # Before the process ends: the broker acknowledged a last message published after all of them (a NATS cluster
    # takes them slower than mosquitto), and a few seconds more. The round's end is measured elsewhere.
    endpoint.publish(f"{PREFIX}/bench-done", b"done", f"done-{brief.round}", wait=True, timeout=TIMEOUT_S)
    time.sleep(5)
    endpoint.stop()


def run_publisher(url: str, brief: folding.Brief, routes: dict[str, str | None], keys: dict[str, bytes], epoch: int,
                  first_seq: int) -> tuple[mp.Process, mp.Event]:
    """The publisher process of one round, its payloads built; returns it and the event that starts it."""
    ready, go = mp.Event(), mp.Event()
    proc = mp.Process(target=publisher, args=(url, brief, routes, keys, epoch, first_seq, ready, go))
    proc.start()
    if not ready.wait(TIMEOUT_S):
        raise SystemExit("the publisher did not get ready")
    return proc, go


def update_bytes(brief: folding.Brief) -> int:
    return sum(int(np.prod(s)) * 4 for a in brief.devices.values() for s in brief.plan_shapes[a.plan_hash].values())


def measure_broker(url: str, clients: int, rounds: int) -> dict:
    """The ceiling: the same publishes taken off the broker by one plain subscriber that opens none of them."""
    devices = [f"dev_{i:05d}" for i in range(clients)]
    keys = {d: new_key() for d in devices}
    engine = make_engine(devices, False, rounds)  # for its briefs only: its rounds close with no answer taken
    engine_log = logging.getLogger("fedara.engine")
    level = engine_log.level
    engine_log.setLevel(logging.ERROR)
    sink = MqttEndpoint("bench-sink", rotate_brokers(url, 2), subscriptions=[update_filter(PREFIX)],
                        max_frame_bytes=FRAME_BYTES,
                        max_message_bytes=BROKER_LIMIT, max_pending_bytes=4 * BROKER_LIMIT, clean_session=True)
    sink.start()
    sink.wait_connected(30)
    results = []
    try:
        for r in range(1, rounds + 1):
            engine.open_round(r, time.monotonic())
            brief = engine.brief(BROKER_LIMIT)
            proc, go = run_publisher(rotate_brokers(url, 1), brief, dict.fromkeys(devices), keys, int(time.time()), 0)
            load = os.getloadavg()[0]
            start = time.perf_counter()
            go.set()
            got = sum(1 for _ in range(clients) if sink.get(TIMEOUT_S) is not None)
            seconds = time.perf_counter() - start
            proc.join()
            engine.close_round(time.monotonic())
            nbytes = update_bytes(brief)
            results.append({"round": r, "seconds": seconds, "update_bytes": nbytes, "mb_per_s": nbytes / MB / seconds,
                            "participants": got, "load_average_1min": load})
            print(f"  broker only round {r}: {seconds:.2f} s, {nbytes / MB / seconds:.1f} MB/s, {got}/{clients} "
                  f"updates, load {load:.1f}", flush=True)
    finally:
        sink.stop()
        engine_log.setLevel(level)
    return {"aggregators": "broker only", "clients": clients, "rounds": results, "folded_per_aggregator": {}}


def measure(url: str, clients: int, aggregators: int, rounds: int, folder: Path) -> dict:
    """Rounds of ``clients`` updates through the broker with ``aggregators`` processes (0: the engine alone)."""
    devices = [f"dev_{i:05d}" for i in range(clients)]
    keys = {d: new_key() for d in devices}
    engine = make_engine(devices, aggregators > 0, rounds)
    max_inbound = inbound_limit(engine.global_state, {})
    enrollment = save_enrollment(folder / "enrollment.json", keys)
    names = tuple(f"agg-{i}" for i in range(aggregators))
    args = SimpleNamespace(prefix=PREFIX, join_timeout=120.0, aggregator_timeout=TIMEOUT_S, username=None,
                           tls_ca=None, tls_cert=None, tls_key=None, max_message_bytes=FRAME_BYTES,
                           secagg_phase_timeout=DEFAULT_SECAGG_PHASE_TIMEOUT_S)
    subscriptions = server_subscriptions(PREFIX) + ([wire.engine_filter(PREFIX)] if names else [])
    admit, vouch = server_admission(PREFIX, KeyRing(keys), names)
    endpoint = MqttEndpoint(f"bench-engine-{aggregators}", url, subscriptions=subscriptions,  # broker_loop's limits
                            max_frame_bytes=FRAME_BYTES, admit=admit, vouch=vouch,
                            **reader_budgets(max_inbound, len(keys)), spill=FileSpill(folder / SPILL_DIR),
                            backpressure=True, clean_session=True)
    link = Link.server(KeyRing(keys), folder / "server-state", max_inbound)
    aggregator_link = wire.engine_link(load_server_key(enrollment), folder / "engine-state", max_inbound)
    federation = Federation(args, engine, endpoint, RunFolder(folder), LocalDevices(), {}, max_inbound, link, names,
                            aggregator_link)
    members = LocalDevices("aggregator")
    (folder / AGGREGATORS_DIR).mkdir(parents=True, exist_ok=True)
    endpoint.start()
    endpoint.wait_connected(30)
    results = []
    try:
        for i, name in enumerate(names):
            members.spawn(name, aggregator_command(args, rotate_brokers(url, i + 2), name, enrollment,
                                                   folder / AGGREGATORS_DIR / name),
                          folder / AGGREGATORS_DIR / f"{name}.log")
        if names:
            federation.channel.wait_for_start()
        epoch = int(time.time())
        for r in range(1, rounds + 1):
            engine.open_round(r, time.monotonic())
            if names:
                federation.channel.brief_members()
            brief = engine.brief(max_inbound)
            routes = {d: engine.route(d) for d in devices}
            devices_proc, go = run_publisher(rotate_brokers(url, 1), brief, routes, keys, epoch, (r - 1) * clients)
            nbytes = update_bytes(brief)
            load = os.getloadavg()[0]
            start = time.perf_counter()
            go.set()
            federation.gather(r)
            engine.close_round(time.monotonic())
            seconds = time.perf_counter() - start
            devices_proc.join()
            record = engine.pending
            results.append({"round": r, "seconds": seconds, "update_bytes": nbytes,
                            "mb_per_s": nbytes / MB / seconds, "participants": record["participants"],
                            "load_average_1min": load})
            print(f"  aggregators {aggregators} round {r}: {seconds:.2f} s, {nbytes / MB / seconds:.1f} MB/s, "
                  f"{record['participants']}/{clients} updates, load {load:.1f}", flush=True)
    finally:
        members.stop()
        endpoint.stop()
    folded = {name: (folder / AGGREGATORS_DIR / f"{name}.log").read_text().count(" folded ") for name in names}
    return {"aggregators": aggregators, "clients": clients, "rounds": results, "folded_per_aggregator": folded}


def table(runs: list[dict]) -> str:
    lines = ["| broker | aggregators | K | update MB per round | seconds per round (rounds) | MB/s "
             "| updates folded per aggregator, all rounds |",
             "|---|---:|---:|---:|---|---:|---|"]
    for run in runs:
        rounds = run["rounds"]
        seconds = [r["seconds"] for r in rounds]
        best = min(seconds)
        label = "0 (engine alone)" if run["aggregators"] == 0 else run["aggregators"]
        lines.append(f"| {run['broker']} | {label} | {run['clients']} | "
                     f"{rounds[0]['update_bytes'] / MB:.0f} | {' / '.join(f'{s:.1f}' for s in seconds)} | "
                     f"{rounds[0]['update_bytes'] / MB / best:.0f} (best round) | "
                     f"{', '.join(f'{n}' for n in run['folded_per_aggregator'].values()) or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=150, help="synthetic devices per round (K)")
    p.add_argument("--aggregators", default="0,1,2,3", help="comma-separated aggregator counts, run side by side")
    p.add_argument("--rounds", type=int, default=2, help="rounds per aggregator count")
    p.add_argument("--brokers", default="mosquitto", help="comma-separated: mosquitto (one Debian mosquitto), nats "
                   "(a 3-node NATS cluster, scripts/nats_cluster.py)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    try:
        counts = [int(n) for n in args.aggregators.split(",")]
    except ValueError:
        p.error(f"--aggregators wants comma-separated counts such as 0,1,2,3, got {args.aggregators!r}")
    if args.clients < 1 or args.rounds < 1 or any(n < 0 for n in counts):
        p.error("--clients and --rounds must be >= 1, aggregator counts >= 0")
    brokers = args.brokers.split(",")
    if not brokers or set(brokers) - {"mosquitto", "nats"}:
        p.error(f"--brokers wants mosquitto and/or nats, comma-separated, got {args.brokers!r}")
    torch.set_num_threads(1)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in brokers:
            with broker_of(kind, Path(tmp) / kind) as url:
                print(f"{kind}: {url}", flush=True)
                rows = [measure_broker(url, args.clients, args.rounds)]
                rows += [measure(url, args.clients, n, args.rounds, Path(tmp) / kind / f"n{n}") for n in counts]
            runs += [dict(row, broker=kind) for row in rows]
    print(table(runs))
    if args.out:
        Path(args.out).write_text(json.dumps({"cpu_count": os.cpu_count(), "cpu": cpu_name(), "runs": runs},
                                             indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
