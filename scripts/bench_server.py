"""Server cost of one FedARA round for K clients: decompose, reconstruct+aggregate, checkpoint; time and memory.

    nice -n 10 .venv/bin/python scripts/bench_server.py --clients 10,100,1000 --out docs/bench_server.json

FedAvgCNN clients take rank tiers round-robin from 1.0, 0.75, 0.5, 0.25, 0.125. Per (input shape, K) a fresh
subprocess measures:
- decompose: factorizing the global FE afresh for every client (naive), against ``factorize_per_plan``, one
  factorization per distinct plan shared by that plan's clients (cached), each followed by ``configure_fit``;
  and one full SVD per factorized layer (the floor if the SVD itself were shared: every tier truncates the
  same one). The naive cost is the same work repeated per client, so with K above ``--naive-limit`` it is
  measured on that many clients (all tiers equally when the limit is a multiple of 5) and scaled to K.
- reconstruct+aggregate: ``StreamingAverage.add`` for K synthetic updates (the plan's factors plus noise),
  made one at a time so neither the server nor the benchmark holds K updates; tracemalloc peak (numpy and
  Python objects) and the growth of the process's peak RSS (VmHWM, which also counts torch's buffers).
- checkpoint: ``save_checkpoint`` of the new global FE with per-device bookkeeping (bytes, seconds).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from device_runtime.task import Update, tensor_bytes  # noqa: E402
from server.aggregate import StreamingAverage  # noqa: E402
from server.checkpoint import CHECKPOINT_NAME, Checkpoint, save_checkpoint  # noqa: E402
from server.lowrank import (RankPlan, ResolvedPlan, decompose, factorize_state, fe_state, full_rank,  # noqa: E402
                            resolve_plan)
from server.models import build_model  # noqa: E402
from server.strategy import (FederationConfig, configure_fit, factorize_per_plan, plan_key, to_numpy,  # noqa: E402
                             to_torch)

MODEL = "fedavgcnn"
NUM_CLASSES = 10
TIERS = (1.0, 0.75, 0.5, 0.25, 0.125)
DEFAULT_CLIENTS = "10,100,1000"
DEFAULT_SHAPES = "1x28x28,3x32x32"
DEFAULT_NAIVE_LIMIT = 100
QUICK_CLIENTS = (5, 10)
QUICK_NAIVE_LIMIT = 5
ROUND = 1
NOISE_STD = 1e-3
SAMPLES_LOW, SAMPLES_HIGH = 40, 400
MIB = 2**20
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def parse_clients(text: str) -> tuple[int, ...]:
    """"10,100,1000" -> (10, 100, 1000); every count must be a positive integer."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError as exc:
        raise ValueError(f"--clients wants comma-separated integers, got {text!r}") from exc
    if not counts or min(counts) < 1:
        raise ValueError(f"--clients wants positive client counts, got {text!r}")
    return counts


def parse_shape(text: str) -> tuple[int, int, int]:
    """"3x32x32" -> (3, 32, 32)."""
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError as exc:
        raise ValueError(f"an input shape is CxHxW, e.g. 3x32x32; got {text!r}") from exc
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"an input shape is CxHxW with positive sizes, e.g. 3x32x32; got {text!r}")
    return shape


def shape_name(shape: tuple[int, int, int]) -> str:
    return "x".join(str(d) for d in shape)


def tier_plans(model: torch.nn.Module, tiers: tuple[float, ...]) -> list[ResolvedPlan]:
    """The resolved plan of each tier, in tier order; client k takes plans[k % len(plans)]."""
    return [resolve_plan(model, RankPlan(ratio)) for ratio in tiers]


def time_naive_decompose(global_fe: dict[str, torch.Tensor], plans: list[ResolvedPlan], config: FederationConfig,
                         num_clients: int) -> float:
    """Seconds to factorize the global FE afresh for each of ``num_clients`` clients and make its task."""
    start = time.perf_counter()
    for k in range(num_clients):
        plan = plans[k % len(plans)]
        configure_fit(to_numpy(factorize_state(global_fe, plan.ranks)), bool(plan.ranks), config, ROUND, k)
    return time.perf_counter() - start


def time_cached_decompose(global_fe: dict[str, torch.Tensor], plans: list[ResolvedPlan], config: FederationConfig,
                          num_clients: int) -> float:
    """Seconds to make ``num_clients`` tasks from one factorization per distinct plan (factorize_per_plan)."""
    start = time.perf_counter()
    client_plans = [plans[k % len(plans)] for k in range(num_clients)]
    per_plan = factorize_per_plan(global_fe, client_plans)
    for k, plan in enumerate(client_plans):
        configure_fit(per_plan[plan_key(plan)], bool(plan.ranks), config, ROUND, k)
    return time.perf_counter() - start


def time_shared_svd(global_fe: dict[str, torch.Tensor], plans: list[ResolvedPlan]) -> float:
    """Seconds for one full SVD of each layer any plan factorizes: every tier's factors truncate it."""
    layers = sorted({name for plan in plans for name in plan.ranks})
    start = time.perf_counter()
    for name in layers:
        weight = global_fe[name + ".weight"]
        decompose(weight, full_rank(tuple(weight.shape)))
    return time.perf_counter() - start


def client_samples(num_clients: int, seed: int) -> list[int]:
    """Each client's training sample count, the weight of its update."""
    return np.random.default_rng(seed).integers(SAMPLES_LOW, SAMPLES_HIGH, size=num_clients).tolist()


def synthetic_updates(templates: list[dict[str, np.ndarray]], samples: list[int], seed: int) -> Iterator[Update]:
    """Client k's update: its plan's FE plus Gaussian noise, made only when asked for."""
    for k, num_samples in enumerate(samples):
        rng = np.random.default_rng([seed, k])
        fe = {name: value + NOISE_STD * rng.standard_normal(value.shape, dtype=np.float32)
              for name, value in templates[k % len(templates)].items()}
        yield Update(ROUND, fe, num_samples, 0.0, 0.0)


def peak_rss_bytes() -> int:
    """VmHWM of this process (Linux)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM: peak RSS needs Linux")


def reset_peak_rss() -> bool:
    """Set VmHWM back to the current RSS (Linux ≥ 4.0); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def measure_aggregation(global_fe: dict[str, torch.Tensor], templates: list[dict[str, np.ndarray]],
                        samples: list[int], seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """Time StreamingAverage.add over K lazily made updates; memory peaks of the whole phase; the new FE."""
    dense_shapes = {k: tuple(v.shape) for k, v in global_fe.items()}
    gc.collect()
    rss_before = psutil.Process().memory_info().rss
    hwm_reset = reset_peak_rss()
    tracemalloc.start()
    add_seconds = update_bytes = 0.0
    start = time.perf_counter()
    average = StreamingAverage(dense_shapes)
    for update in synthetic_updates(templates, samples, seed):
        update_bytes += tensor_bytes(update.fe)
        added = time.perf_counter()
        average.add(to_torch(update.fe), update.num_samples)
        add_seconds += time.perf_counter() - added
    new_fe = average.result()
    phase_seconds = time.perf_counter() - start
    _, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    stats = dict(seconds=add_seconds, synth_seconds=phase_seconds - add_seconds, tracemalloc_peak_bytes=traced_peak,
                 rss_peak_growth_bytes=peak_rss_bytes() - rss_before, hwm_reset=hwm_reset,
                 updates_total_bytes=int(update_bytes))
    return stats, new_fe


def measure_checkpoint(global_fe: dict[str, torch.Tensor], plans: list[ResolvedPlan], num_clients: int,
                       samples: list[int], directory: Path) -> dict:
    """Seconds and bytes to save the new global FE with per-device bookkeeping (plan, samples, last round)."""
    devices = {f"client_{k:04d}": dict(plan=plans[k % len(plans)].describe(), num_samples=samples[k],
                                       last_round=ROUND) for k in range(num_clients)}
    start = time.perf_counter()
    written = save_checkpoint(directory / CHECKPOINT_NAME,
                              Checkpoint(ROUND, to_numpy(global_fe), dict(devices=devices)))
    return dict(seconds=time.perf_counter() - start, bytes=written)


def run_configuration(input_shape: tuple[int, int, int], num_clients: int, naive_limit: int, seed: int) -> dict:
    """Every phase for one (input shape, K), in this process; meant to run in a fresh subprocess."""
    model = build_model(MODEL, input_shape, NUM_CLASSES, seed=seed)
    global_fe = fe_state(model)
    plans = tier_plans(model, TIERS)
    config = FederationConfig(seed=seed)
    per_plan = factorize_per_plan(global_fe, plans)
    templates = [per_plan[plan_key(plan)] for plan in plans]
    samples = client_samples(num_clients, seed)
    peak_before_aggregation = peak_rss_bytes()
    aggregation, new_fe = measure_aggregation(global_fe, templates, samples, seed)
    naive_clients = num_clients if naive_limit == 0 else min(num_clients, naive_limit)
    naive_measured = time_naive_decompose(global_fe, plans, config, naive_clients)
    naive_per_client = naive_measured / naive_clients
    cached = time_cached_decompose(global_fe, plans, config, num_clients)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = measure_checkpoint(new_fe, plans, num_clients, samples, Path(tmp))
    decompose_stats = dict(naive_seconds=naive_per_client * num_clients, naive_per_client_seconds=naive_per_client,
                           naive_measured_clients=naive_clients, cached_seconds=cached,
                           naive_over_cached=naive_per_client * num_clients / cached,
                           shared_svd_seconds=time_shared_svd(global_fe, plans),
                           distinct_plans=len({plan_key(p) for p in plans[:num_clients]}))
    return dict(input_shape=shape_name(input_shape), clients=num_clients,
                plans=[p.describe() for p in plans], decompose=decompose_stats, aggregate=aggregation,
                checkpoint=checkpoint, fe_parameters=sum(v.numel() for v in global_fe.values()),
                process_peak_rss_bytes=max(peak_before_aggregation, peak_rss_bytes()))


def run_in_subprocess(input_shape: tuple[int, int, int], num_clients: int, naive_limit: int, seed: int,
                      threads: int) -> dict:
    """run_configuration in a fresh interpreter, so its memory peaks are its own."""
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--input-shape", shape_name(input_shape),
               "--clients", str(num_clients), "--naive-limit", str(naive_limit), "--seed", str(seed),
               "--threads", str(threads)]
    env = dict(os.environ, **{name: str(threads) for name in THREAD_ENV})
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"worker for {shape_name(input_shape)} K={num_clients} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def flatness(results: list[dict]) -> dict[str, dict]:
    """Per input shape: aggregation memory at the largest K over that at the smallest (1.0 = flat)."""
    out = {}
    for shape in dict.fromkeys(r["input_shape"] for r in results):
        rows = sorted((r for r in results if r["input_shape"] == shape), key=lambda r: r["clients"])
        low, high = rows[0], rows[-1]
        out[shape] = dict(clients_low=low["clients"], clients_high=high["clients"],
                          tracemalloc_peak_ratio=high["aggregate"]["tracemalloc_peak_bytes"]
                          / low["aggregate"]["tracemalloc_peak_bytes"],
                          rss_peak_growth_ratio=max(high["aggregate"]["rss_peak_growth_bytes"], 1)
                          / max(low["aggregate"]["rss_peak_growth_bytes"], 1))
    return out


def markdown_tables(results: list[dict], flat: dict[str, dict]) -> str:
    """A time table, a memory table and the flatness line per input shape."""
    time_rows = ["| input | K | plans | decompose naive s (ms/client) | decompose cached s | naive/cached "
                 "| one SVD/layer s | reconstruct+aggregate s (ms/client) | checkpoint s | checkpoint MiB |",
                 "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    memory_rows = ["| input | K | aggregation tracemalloc peak MiB | aggregation peak-RSS growth MiB "
                   "| K updates if held MiB | process VmHWM MiB |",
                   "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        d, a, c = r["decompose"], r["aggregate"], r["checkpoint"]
        naive_note = "" if d["naive_measured_clients"] == r["clients"] else f" [{d['naive_measured_clients']} measured]"
        time_rows.append(
            f"| {r['input_shape']} | {r['clients']} | {d['distinct_plans']} | {d['naive_seconds']:.2f} "
            f"({1e3 * d['naive_per_client_seconds']:.0f}){naive_note} | {d['cached_seconds']:.2f} "
            f"| {d['naive_over_cached']:.1f}× | {d['shared_svd_seconds']:.2f} | {a['seconds']:.2f} "
            f"({1e3 * a['seconds'] / r['clients']:.1f}) | {c['seconds']:.3f} | {c['bytes'] / MIB:.2f} |")
        memory_rows.append(
            f"| {r['input_shape']} | {r['clients']} | {a['tracemalloc_peak_bytes'] / MIB:.1f} "
            f"| {a['rss_peak_growth_bytes'] / MIB:.1f} | {a['updates_total_bytes'] / MIB:.0f} "
            f"| {r['process_peak_rss_bytes'] / MIB:.0f} |")
    lines = [f"- {shape}: aggregation memory at K={f['clients_high']} / K={f['clients_low']}: "
             f"tracemalloc peak ×{f['tracemalloc_peak_ratio']:.2f}, peak-RSS growth ×{f['rss_peak_growth_ratio']:.2f}"
             for shape, f in flat.items()]
    return "\n".join(time_rows + [""] + memory_rows + [""] + lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", default=DEFAULT_CLIENTS, help="comma-separated client counts K")
    p.add_argument("--quick", action="store_true", help=f"tiny run: K={QUICK_CLIENTS}, naive limit {QUICK_NAIVE_LIMIT}")
    p.add_argument("--input-shape", default=DEFAULT_SHAPES, help="comma-separated CxHxW inputs of FedAvgCNN")
    p.add_argument("--naive-limit", type=int, default=DEFAULT_NAIVE_LIMIT,
                   help="measure naive decompose on at most this many clients and scale to K (0: all)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        shapes = tuple(parse_shape(s) for s in args.input_shape.split(","))
        clients = QUICK_CLIENTS if args.quick else parse_clients(args.clients)
    except ValueError as exc:
        parser.error(str(exc))
    naive_limit = QUICK_NAIVE_LIMIT if args.quick else args.naive_limit
    if naive_limit < 0 or args.threads < 1:
        parser.error("--naive-limit must be >= 0 and --threads >= 1")
    torch.set_num_threads(args.threads)
    if args.worker:
        print(json.dumps(run_configuration(shapes[0], clients[0], naive_limit, args.seed)))
        return 0
    started, load = time.perf_counter(), os.getloadavg()
    results = []
    for shape in shapes:
        for k in clients:
            results.append(run_in_subprocess(shape, k, naive_limit, args.seed, args.threads))
            print(f"{shape_name(shape)} K={k}: done", file=sys.stderr)
    flat = flatness(results)
    print(markdown_tables(results, flat))
    report = dict(command=" ".join([Path(sys.executable).name, *sys.argv]), model=MODEL, tiers=list(TIERS),
                  threads=args.threads, naive_limit=naive_limit, seed=args.seed, torch=torch.__version__,
                  machine=dict(platform=platform.platform(), cpus=os.cpu_count(), loadavg_at_start=list(load)),
                  wall_seconds=time.perf_counter() - started, results=results, flatness=flat)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
