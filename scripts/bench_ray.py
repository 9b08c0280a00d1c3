"""Ray against the --workers pool on one machine: seconds per round side by side, the bytes a round moves through
Ray, and a projection of rounds per hour for many devices on N nodes.

    unshare -n sh -c 'ip link set lo up && exec .venv/bin/python scripts/bench_ray.py'   # docs/cluster.md's table

Runs ``python -m server.simulate`` twice on the same job (Fashion-MNIST, ``--clients`` devices, ``--rounds`` rounds,
FedARA with rank tiers 1/0.5/0.25 under ``--aggregate updates``): once with ``--workers W`` and once with ``--ray``
(a Ray the run starts on this machine, as many CPUs as it has: W here, on the machine this was written on, or the
cluster at ``--ray ADDRESS``). Prints per round the seconds of each (metrics.jsonl), their ratio and the megabytes
the Ray run's device tasks took and gave back (its ``ray:`` lines), checks that both runs end with the same
checkpoint, and projects rounds per hour for ``--project-devices`` devices on 1..64 nodes from the measured cost
per device task and bytes per device (assumptions in the JSON and in docs/cluster.md). Ray must talk over loopback
only here: the script refuses to start where an interface other than ``lo`` exists (run it under ``unshare -n``).
Writes ``--out`` (JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from server.cli import LOCAL_RAY  # noqa: E402
from server.outputs.checkpoint import CHECKPOINT_NAME, load_checkpoint  # noqa: E402
from server.outputs.machine import cpu_name  # noqa: E402
from server.outputs.report import METRICS_FILE, read_metrics  # noqa: E402

TRAFFIC = re.compile(r"^ray: (\d+) device task\(s\) on (\d+) node\(s\): ([\d.]+) MB to them, ([\d.]+) MB back", re.M)
NODES = (1, 2, 4, 8, 16, 32, 64)


def interfaces_up() -> list[str]:
    """The network interfaces of this process's network namespace other than loopback."""
    return [name for _, name in socket.if_nameindex() if name != "lo"]


def simulate(flags: list[str], out: Path) -> tuple[list[dict], str]:
    done = subprocess.run([sys.executable, "-m", "server.simulate", *flags, "--out", str(out)], capture_output=True,
                          text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"run failed: {' '.join(flags)}\n{done.stderr[-3000:]}")
    return read_metrics(out / METRICS_FILE), done.stdout


def projection(device_cpu_s: float, device_bytes: float, cpus_per_node: int, devices: int, bandwidth_mb_s: float,
               driver_s: float) -> list[dict]:
    """Rounds per hour on N nodes: a round = the driver's own work + its devices' CPU seconds spread over the
    nodes' CPUs + their bytes through the driver's link."""
    rows = []
    for nodes in NODES:
        compute = devices * device_cpu_s / (nodes * cpus_per_node)
        transfer = devices * device_bytes / (bandwidth_mb_s * 1e6)
        round_s = driver_s + compute + transfer
        rows.append(dict(nodes=nodes, round_s=round_s, compute_s=compute, transfer_s=transfer,
                         rounds_per_hour=3600 / round_s))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-samples", type=int, default=0, help="0: all of Fashion-MNIST")
    p.add_argument("--min-samples", type=int, default=40, help="server.simulate's (a smaller --max-samples needs less)")
    p.add_argument("--local-epochs", type=int, default=5, help="the paper's 5 (1: a fifth of the work)")
    p.add_argument("--ray", nargs="?", const=LOCAL_RAY, default=LOCAL_RAY, metavar="ADDRESS",
                   help="the cluster (default: a Ray the run starts here)")
    p.add_argument("--project-devices", type=int, default=1000)
    p.add_argument("--cpus-per-node", type=int, default=16, help="projection: CPUs of each node")
    p.add_argument("--bandwidth-mb-s", type=float, default=125.0, help="projection: the driver's link (1 Gbit/s)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "cluster" / "cluster_bench.json")
    args = p.parse_args(argv)
    up = interfaces_up()
    if up:
        print(f"error: interfaces {up} are here: Ray would use them; run this under "
              "`unshare -n sh -c 'ip link set lo up && exec .venv/bin/python scripts/bench_ray.py'`", file=sys.stderr)
        return 2
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    job = ["--dataset", "fmnist", "--clients", str(args.clients), "--rounds", str(args.rounds), "--algo", "fedara",
           "--rank-tiers", "1.0,0.5,0.25", "--aggregate", "updates", "--max-samples", str(args.max_samples),
           "--local-epochs", str(args.local_epochs), "--min-samples", str(args.min_samples),
           "--seed", "0"]
    load_start, started = os.getloadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        local, _ = simulate([*job, "--workers", str(args.workers)], Path(tmp) / "workers")
        ray_flags = ["--ray"] if args.ray == LOCAL_RAY else ["--ray", args.ray]
        on_ray, output = simulate([*job, *ray_flags], Path(tmp) / "ray")
        a = load_checkpoint(Path(tmp) / "workers" / CHECKPOINT_NAME).tensors
        b = load_checkpoint(Path(tmp) / "ray" / CHECKPOINT_NAME).tensors
        identical = set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)
    traffic = [dict(tasks=int(t), nodes=int(n), sent_mb=float(s), returned_mb=float(r))
               for t, n, s, r in TRAFFIC.findall(output)]
    cpus = re.search(r"node\(s\), ([\d.]+) CPUs", output)
    ray_cpus = float(cpus.group(1)) if cpus else float("nan")
    rows = []
    print(f"{'round':>5} {'--workers ' + str(args.workers) + ' s':>14} {'--ray s':>9} {'ray/workers':>11} "
          f"{'MB to tasks':>11} {'MB back':>8}")
    for index, (w, r) in enumerate(zip(local, on_ray)):
        t = traffic[index] if index < len(traffic) else {}
        rows.append(dict(round=w["round"], workers_s=w["seconds"], ray_s=r["seconds"], ratio=r["seconds"] / w["seconds"],
                         **{k: t.get(k) for k in ("tasks", "sent_mb", "returned_mb")}))
        print(f"{w['round']:>5} {w['seconds']:>14.2f} {r['seconds']:>9.2f} {r['seconds'] / w['seconds']:>11.2f} "
              f"{t.get('sent_mb', float('nan')):>11.2f} {t.get('returned_mb', float('nan')):>8.2f}")
    steady = rows[1:] or rows  # round 1 also builds each tier's plan
    workers_s, ray_s = np.mean([r["workers_s"] for r in steady]), np.mean([r["ray_s"] for r in steady])
    per_round_bytes = np.mean([(r["sent_mb"] + r["returned_mb"]) * 1e6 for r in steady if r["sent_mb"] is not None])
    device_cpu_s = ray_s * ray_cpus / args.clients  # CPU seconds per device task, the driver's share included
    device_bytes = per_round_bytes / args.clients
    plan = projection(device_cpu_s, device_bytes, args.cpus_per_node, args.project_devices, args.bandwidth_mb_s, 0.0)
    print(f"\nrounds 2..{args.rounds}: --workers {args.workers} {workers_s:.2f} s, --ray {ray_s:.2f} s a round "
          f"({ray_s / workers_s:.2f}x); {per_round_bytes / 1e6:.1f} MB a round through Ray "
          f"({device_bytes / 1e6:.3f} MB a device); checkpoints identical: {identical}")
    print(f"projection, {args.project_devices} devices, {args.cpus_per_node} CPUs a node, {device_cpu_s:.3f} CPU-s "
          f"and {device_bytes / 1e6:.3f} MB a device, a {args.bandwidth_mb_s:g} MB/s link at the driver:")
    for row in plan:
        print(f"  {row['nodes']:>3} node(s): {row['round_s']:8.1f} s a round ({row['compute_s']:.1f} s compute, "
              f"{row['transfer_s']:.1f} s transfer) -> {row['rounds_per_hour']:7.1f} rounds an hour")
    document = dict(command=" ".join([".venv/bin/python", "scripts/bench_ray.py", *(argv or sys.argv[1:])]),
                    job=job, workers=args.workers, ray_cpus=ray_cpus, rounds=rows, traffic=traffic,
                    steady_workers_s=workers_s, steady_ray_s=ray_s, ratio=ray_s / workers_s,
                    bytes_per_round=per_round_bytes, bytes_per_device=device_bytes, device_cpu_s=device_cpu_s,
                    checkpoints_identical=identical,
                    projection=dict(devices=args.project_devices, cpus_per_node=args.cpus_per_node,
                                    bandwidth_mb_s=args.bandwidth_mb_s, rows=plan),
                    machine=dict(cpu=cpu_name(), cpus=os.cpu_count(), loadavg_at_start=list(load_start),
                                 loadavg_at_end=list(os.getloadavg())),
                    wall_s=time.perf_counter() - started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
