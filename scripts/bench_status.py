"""What the live status view (--status-port, server/outputs/status_server.py) costs the server: the run loop's snapshot (the
first of a run, and the next ones, which build on the one before), a /metrics scrape and an /api/status answer,
for fleets of N devices after R rounds.

    .venv/bin/python scripts/bench_status.py [--devices 100,1000,10000] [--records 100] [--out docs/results/status/bench_status.json]

The engine is a real RoundEngine whose devices joined (two rank tiers); its R round records are synthesized with the
shape the engine writes (every device evaluated in every round), so no training runs. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from device_runtime.messages import Join, ShardInfo  # noqa: E402
from device_runtime.profile import ResourceProfile  # noqa: E402
from fedcore.models import build_model  # noqa: E402
from server.engine.coordinator import Coordinator, CoordinatorConfig  # noqa: E402
from server.outputs.machine import cpu_name  # noqa: E402
from server.engine.round_engine import RoundEngine, algorithm_for  # noqa: E402
from server.outputs.prometheus_metrics import SnapshotCollector  # noqa: E402
from server.outputs.status_snapshot import fleet_snapshot  # noqa: E402
from server.run_setup import PlanBook, global_state, initial_personal  # noqa: E402
from server.engine.run_config import FederationConfig  # noqa: E402

SHAPE, CLASSES, TIERS = (1, 28, 28), 10, (1.0, 0.25)


def fleet(devices: int, records: int) -> RoundEngine:
    """A fedara engine with ``devices`` joined devices (tiers by budget) and ``records`` completed round records."""
    model = build_model("fedavgcnn", SHAPE, CLASSES, seed=0)
    algorithm = algorithm_for(FederationConfig(rounds=records))
    engine = RoundEngine(algorithm, FederationConfig(rounds=records), Coordinator(CoordinatorConfig(SHAPE, CLASSES),
                         "bench"), PlanBook(model, SHAPE, None, onnx=False), global_state(model, algorithm),
                         initial_personal([model], algorithm), tiers=TIERS,
                         predictor=lambda profile, n: (lambda ratio: 100.0 * ratio))
    ids = [f"dev_{i:05d}" for i in range(devices)]
    for i, device_id in enumerate(ids):
        profile = ResourceProfile(500.0 if i % 2 else 50.0, 1, 1, "x86_64", "Linux", None, 1.0)
        engine.join(device_id, Join(profile, ShardInfo(50, 10, SHAPE, CLASSES), ()))
    tiers = {d: f"{engine.coordinator.devices[d].ratio:g}" for d in ids}
    for r in range(1, records + 1):
        engine.records.append({
            "round": r, "participants": devices, "selected": devices, "dropped": {}, "seconds": 1.0,
            "accuracy": 0.5, "per_device": {d: {"accuracy": 0.5, "tier": tiers[d]} for d in ids},
            "per_tier": {t: {"accuracy": 0.5, "devices": devices // 2} for t in ("1", "0.25")},
            "bytes_by_tier": {t: {"down": 1, "up": 1, "artifacts": 0, "eval": 0} for t in ("1", "0.25")},
            "wire_bytes_out": 1, "wire_bytes_in": 1})
    return engine



def best_of(fn, repeats: int = 5) -> float:
    """The fastest of ``repeats`` calls, in milliseconds."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", default="100,1000,10000", help="fleet sizes, comma-separated")
    p.add_argument("--records", type=int, default=100, help="completed rounds")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    rows = []
    print(f"{'devices':>8} {'rounds':>6} {'first snapshot ms':>18} {'snapshot ms':>12} {'/metrics ms':>12} "
          f"{'/api/status ms':>15} {'JSON KB':>8}")
    for devices in (int(n) for n in args.devices.split(",")):
        engine = fleet(devices, args.records)
        snapshot = fleet_snapshot(engine, now=0.0, wall=time.time(), rounds=args.records)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(SnapshotCollector(lambda: snapshot))
        row = {"devices": devices, "rounds": args.records,
               "first_snapshot_ms": best_of(lambda: fleet_snapshot(engine, now=0.0, wall=0.0,
                                                                   rounds=args.records)),
               "snapshot_ms": best_of(lambda: fleet_snapshot(engine, now=0.0, wall=0.0, rounds=args.records,
                                                             previous=snapshot)),
               "metrics_ms": best_of(lambda: generate_latest(registry)),
               "api_status_ms": best_of(lambda: json.dumps(snapshot).encode()),
               "json_kb": len(json.dumps(snapshot)) / 1024}
        rows.append(row)
        print(f"{devices:>8} {args.records:>6} {row['first_snapshot_ms']:>18.1f} {row['snapshot_ms']:>12.1f} "
              f"{row['metrics_ms']:>12.1f} "
              f"{row['api_status_ms']:>15.1f} {row['json_kb']:>8.0f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"cpu": cpu_name(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
