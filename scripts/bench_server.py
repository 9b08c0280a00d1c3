"""Server cost of one FedARA round for K clients, per phase, batched aggregation against the per-client path.

    .venv/bin/python scripts/bench_server.py --out docs/results/server/bench_server.json

FedAvgCNN clients take rank tiers round-robin from 1.0, 0.75, 0.5, 0.25, 0.125. Per (input shape, K) a fresh
subprocess measures, with ``--threads`` torch threads (default 2: both cores):
- factorize: ``factorize_per_plan`` for the round's plans (one SVD per factorized layer, truncated for every
  tier), and the SVDs alone.
- reconstruct+aggregate: ``StreamingAverage`` (batched folds) over K synthetic updates, then today's per-client
  path (``reconstruct_state`` + a float64 add per client) over the same updates, at most ``--per-client-limit``
  of them, its cost scaled to K above that. Updates are made one at a time (a template plus a slice of a fixed
  noise pool), so nothing holds K updates; making them is not timed. Memory per path: tracemalloc peak and the
  growth of peak RSS (VmHWM). Where both paths saw all K updates, their results are compared.
- the FLOP floor: Σ_k Σ_layers r_k·m·n multiply-adds of the factor products, against the float32 GEMM rate
  measured in the same worker on the fold's shape.
- checkpoint: ``save_checkpoint`` of the new global FE with per-device bookkeeping (bytes, seconds).
- bytes: each tier's task FE, and the round's task bytes for K clients.
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
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from device_runtime.task import tensor_bytes  # noqa: E402
from fedcore.lowrank import (RankPlan, ResolvedPlan, fe_state, matrix_shape, reconstruct_state, resolve_plan,  # noqa: E402
                            spectrum)
from fedcore.models import build_model  # noqa: E402
from server.engine.aggregate import DEFAULT_FOLD_COLUMNS, StreamingAverage  # noqa: E402
from server.outputs.checkpoint import CHECKPOINT_NAME, Checkpoint, save_checkpoint  # noqa: E402
from server.engine.sampling import factorize_per_plan, plan_key, to_numpy, to_torch  # noqa: E402

MODEL = "fedavgcnn"
NUM_CLASSES = 10
TIERS = (1.0, 0.75, 0.5, 0.25, 0.125)
DEFAULT_CLIENTS = "10,100,1000,10000"
DEFAULT_SHAPES = "3x32x32"
DEFAULT_PER_CLIENT_LIMIT = 1000
DEFAULT_THREADS = 2
QUICK_CLIENTS = (5, 10)
QUICK_PER_CLIENT_LIMIT = 5
ROUND = 1
NOISE_STD = 1e-3
NOISE_POOL = 2**22
SAMPLES_LOW, SAMPLES_HIGH = 40, 400
GEMM_REPEATS = 5
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


def time_factorize(global_fe: dict[str, torch.Tensor], client_plans: list[ResolvedPlan]) -> dict:
    """Seconds of ``factorize_per_plan`` for the round's plans, how many SVDs it ran, and the SVDs alone."""
    layers = sorted({name for plan in client_plans for name in plan.ranks})
    start = time.perf_counter()
    for name in layers:
        spectrum(global_fe[name + ".weight"])
    svd_seconds = time.perf_counter() - start
    start = time.perf_counter()
    factorize_per_plan(global_fe, client_plans)
    return dict(seconds=time.perf_counter() - start, svd_seconds=svd_seconds, svd_layers=len(layers),
                distinct_plans=len({plan_key(p) for p in client_plans}))


def client_samples(num_clients: int, seed: int) -> list[int]:
    """Each client's training sample count, the weight of its update."""
    return np.random.default_rng(seed).integers(SAMPLES_LOW, SAMPLES_HIGH, size=num_clients).tolist()


def synthetic_updates(templates: list[dict[str, torch.Tensor]], samples: list[int],
                      seed: int) -> Iterator[tuple[dict[str, torch.Tensor], int]]:
    """Client k's (FE, sample count): its plan's FE plus N(0, NOISE_STD²) noise, made only when asked for.

    The noise is a slice, at a random offset, of one fixed pool: distinct per client and tensor, and cheap to make.
    """
    pool = torch.randn(NOISE_POOL, generator=torch.Generator().manual_seed(seed)) * NOISE_STD
    for k, num_samples in enumerate(samples):
        rng = np.random.default_rng([seed, k])
        fe = {}
        for name, value in templates[k % len(templates)].items():
            offset = int(rng.integers(0, NOISE_POOL - value.numel()))
            fe[name] = value + pool[offset:offset + value.numel()].view(value.shape)
        yield fe, num_samples


class PerClientAverage:
    """Today's path, for comparison: each update reconstructed to full rank on its own, added in float64."""

    def __init__(self, dense_shapes: dict[str, tuple[int, ...]]):
        self.dense_shapes = dense_shapes
        self.sums = {k: torch.zeros(shape, dtype=torch.float64) for k, shape in dense_shapes.items()}
        self.total_weight = 0.0

    def add(self, client_fe: dict[str, torch.Tensor], num_samples: int) -> None:
        for key, value in reconstruct_state(client_fe, self.dense_shapes).items():
            self.sums[key].add_(value.double(), alpha=float(num_samples))
        self.total_weight += num_samples

    def result(self, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
        return {k: (s / self.total_weight).to(dtype) for k, s in self.sums.items()}


def floor_multiply_adds(client_plans: list[ResolvedPlan], dense_shapes: dict[str, tuple[int, ...]]) -> int:
    """Σ_k Σ_layers r_k·m·n: the multiply-adds of the factor products, the floor of reconstruct+aggregate."""
    total = 0
    for plan in client_plans:
        for layer, rank in plan.ranks.items():
            rows, cols = matrix_shape(dense_shapes[layer + ".weight"])
            total += rank * rows * cols
    return total


def gemm_flops_per_second(rows: int, inner: int, cols: int) -> float:
    """Best-of-GEMM_REPEATS float32 (rows×inner)·(inner×cols) rate, FLOP/s (2 per multiply-add)."""
    a, b = torch.randn(rows, inner), torch.randn(inner, cols)
    a @ b
    best = float("inf")
    for _ in range(GEMM_REPEATS):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2.0 * rows * inner * cols / best


def measure_path(make_average: Callable[[], StreamingAverage | PerClientAverage],
                 updates: Iterator[tuple[dict[str, torch.Tensor], int]]) -> tuple[dict, dict[str, torch.Tensor]]:
    """Time add (over ``updates``) + result of one aggregation path; its memory peaks; the new FE in float64."""
    gc.collect()
    rss_before = psutil.Process().memory_info().rss
    hwm_reset = reset_peak_rss()
    tracemalloc.start()
    timed = update_bytes = 0.0
    clients = 0
    average = make_average()
    for client_fe, num_samples in updates:
        update_bytes += sum(4 * v.numel() for v in client_fe.values())
        start = time.perf_counter()
        average.add(client_fe, num_samples)
        timed += time.perf_counter() - start
        clients += 1
    start = time.perf_counter()
    new_fe = average.result(torch.float64)
    timed += time.perf_counter() - start
    _, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    stats = dict(seconds=timed, clients=clients, tracemalloc_peak_bytes=traced_peak,
                 rss_peak_growth_bytes=peak_rss_bytes() - rss_before, hwm_reset=hwm_reset,
                 updates_total_bytes=int(update_bytes))
    return stats, new_fe


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of max|a − b| / max|b|."""
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-300)) for k in b)


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


def measure_checkpoint(global_fe: dict[str, torch.Tensor], plans: list[ResolvedPlan], num_clients: int,
                       samples: list[int], directory: Path) -> dict:
    """Seconds and bytes to save the new global FE with per-device bookkeeping (plan, samples, last round)."""
    devices = {f"client_{k:04d}": dict(plan=plans[k % len(plans)].describe(), num_samples=samples[k],
                                       last_round=ROUND) for k in range(num_clients)}
    start = time.perf_counter()
    written = save_checkpoint(directory / CHECKPOINT_NAME,
                              Checkpoint(ROUND, to_numpy(global_fe), dict(devices=devices)))
    return dict(seconds=time.perf_counter() - start, bytes=written)


def run_configuration(input_shape: tuple[int, int, int], num_clients: int, per_client_limit: int, fold_columns: int,
                      seed: int) -> dict:
    """Every phase for one (input shape, K), in this process; meant to run in a fresh subprocess."""
    model = build_model(MODEL, input_shape, NUM_CLASSES, seed=seed)
    global_fe = fe_state(model)
    dense_shapes = {k: tuple(v.shape) for k, v in global_fe.items()}
    plans = tier_plans(model, TIERS)
    client_plans = [plans[k % len(plans)] for k in range(num_clients)]
    per_plan = factorize_per_plan(global_fe, plans)  # also warms LAPACK up before the timed run
    factorize = time_factorize(global_fe, client_plans)
    templates = [to_torch(per_plan[plan_key(plan)]) for plan in plans]
    samples = client_samples(num_clients, seed)
    rows, cols = max((matrix_shape(dense_shapes[layer + ".weight"]) for plan in plans for layer in plan.ranks),
                     key=lambda shape: shape[0] * shape[1])  # the fold that dominates: fc1
    gemm_rate = gemm_flops_per_second(rows, fold_columns, cols)
    peak_before_aggregation = peak_rss_bytes()
    batched, new_fe = measure_path(lambda: StreamingAverage(dense_shapes, fold_columns),
                                   synthetic_updates(templates, samples, seed))
    measured = num_clients if per_client_limit == 0 else min(num_clients, per_client_limit)
    per_client, reference = measure_path(lambda: PerClientAverage(dense_shapes),
                                         synthetic_updates(templates, samples[:measured], seed))
    per_client.update(scaled_seconds=per_client["seconds"] * num_clients / measured,
                      max_relative_difference=max_relative_difference(new_fe, reference)
                      if measured == num_clients else None)
    multiply_adds = floor_multiply_adds(client_plans, dense_shapes)
    floor_seconds = 2.0 * multiply_adds / gemm_rate
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = measure_checkpoint(new_fe, plans, num_clients, samples, Path(tmp))
    return dict(input_shape=shape_name(input_shape), clients=num_clients, plans=[p.describe() for p in plans],
                plan_task_bytes=[tensor_bytes(per_plan[plan_key(p)]) for p in plans],
                tasks_total_bytes=sum(tensor_bytes(per_plan[plan_key(p)]) for p in client_plans),
                factorize=factorize, batched=batched, per_client=per_client,
                per_client_over_batched=per_client["scaled_seconds"] / batched["seconds"],
                floor=dict(multiply_adds=multiply_adds, gemm_shape=[rows, fold_columns, cols],
                           gemm_flops_per_second=gemm_rate, seconds=floor_seconds,
                           fraction_reached=floor_seconds / batched["seconds"]),
                checkpoint=checkpoint, fe_parameters=sum(v.numel() for v in global_fe.values()),
                process_peak_rss_bytes=max(peak_before_aggregation, peak_rss_bytes()))


def run_in_subprocess(input_shape: tuple[int, int, int], num_clients: int, per_client_limit: int, fold_columns: int,
                      seed: int, threads: int) -> dict:
    """run_configuration in a fresh interpreter, so its memory peaks are its own."""
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--input-shape", shape_name(input_shape),
               "--clients", str(num_clients), "--per-client-limit", str(per_client_limit),
               "--fold-columns", str(fold_columns), "--seed", str(seed), "--threads", str(threads)]
    env = dict(os.environ, **{name: str(threads) for name in THREAD_ENV})
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"worker for {shape_name(input_shape)} K={num_clients} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def flatness(results: list[dict]) -> dict[str, dict]:
    """Per input shape: batched aggregation memory at the largest K over that at the smallest (1.0 = flat)."""
    out = {}
    for shape in dict.fromkeys(r["input_shape"] for r in results):
        rows = sorted((r for r in results if r["input_shape"] == shape), key=lambda r: r["clients"])
        low, high = rows[0]["batched"], rows[-1]["batched"]
        out[shape] = dict(clients_low=rows[0]["clients"], clients_high=rows[-1]["clients"],
                          tracemalloc_peak_ratio=high["tracemalloc_peak_bytes"] / low["tracemalloc_peak_bytes"],
                          rss_peak_growth_ratio=max(high["rss_peak_growth_bytes"], 1)
                          / max(low["rss_peak_growth_bytes"], 1))
    return out


def markdown_tables(results: list[dict], flat: dict[str, dict]) -> str:
    """A time table, a memory table and the flatness line per input shape."""
    time_rows = ["| input | K | factorize s (SVDs s, layers) | batched s (ms/client) | per-client s (ms/client) "
                 "| per-client/batched | floor GFLOP | GEMM GFLOP/s | floor s | floor reached | max rel. diff "
                 "| checkpoint s | checkpoint MiB |",
                 "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    memory_rows = ["| input | K | batched tracemalloc peak MiB | batched peak-RSS growth MiB "
                   "| per-client peak-RSS growth MiB | K updates if held MiB | process VmHWM MiB |",
                   "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        f, b, p, fl, c = r["factorize"], r["batched"], r["per_client"], r["floor"], r["checkpoint"]
        k = r["clients"]
        scaled = "" if p["clients"] == k else f" [{p['clients']} measured, scaled]"
        diff = "—" if p["max_relative_difference"] is None else f"{p['max_relative_difference']:.1e}"
        time_rows.append(
            f"| {r['input_shape']} | {k} | {f['seconds']:.2f} ({f['svd_seconds']:.2f}, {f['svd_layers']}) "
            f"| {b['seconds']:.2f} ({1e3 * b['seconds'] / k:.2f}) "
            f"| {p['scaled_seconds']:.2f} ({1e3 * p['scaled_seconds'] / k:.2f}){scaled} "
            f"| {r['per_client_over_batched']:.1f}× | {2 * fl['multiply_adds'] / 1e9:.0f} "
            f"| {fl['gemm_flops_per_second'] / 1e9:.0f} | {fl['seconds']:.2f} | {100 * fl['fraction_reached']:.0f} % "
            f"| {diff} | {c['seconds']:.3f} | {c['bytes'] / MIB:.2f} |")
        memory_rows.append(
            f"| {r['input_shape']} | {k} | {b['tracemalloc_peak_bytes'] / MIB:.2f} "
            f"| {b['rss_peak_growth_bytes'] / MIB:.1f} | {p['rss_peak_growth_bytes'] / MIB:.1f} "
            f"| {b['updates_total_bytes'] / MIB:.0f} | {r['process_peak_rss_bytes'] / MIB:.0f} |")
    lines = [f"- {shape}: batched aggregation memory at K={f['clients_high']} / K={f['clients_low']}: "
             f"tracemalloc peak ×{f['tracemalloc_peak_ratio']:.2f}, peak-RSS growth ×{f['rss_peak_growth_ratio']:.2f}"
             for shape, f in flat.items()]
    return "\n".join(time_rows + [""] + memory_rows + [""] + lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", default=DEFAULT_CLIENTS, help="comma-separated client counts K")
    p.add_argument("--quick", action="store_true",
                   help=f"tiny run: K={QUICK_CLIENTS}, per-client limit {QUICK_PER_CLIENT_LIMIT}")
    p.add_argument("--input-shape", default=DEFAULT_SHAPES, help="comma-separated CxHxW inputs of FedAvgCNN")
    p.add_argument("--per-client-limit", type=int, default=DEFAULT_PER_CLIENT_LIMIT,
                   help="run the per-client path on at most this many updates and scale its time to K (0: all)")
    p.add_argument("--fold-columns", type=int, default=DEFAULT_FOLD_COLUMNS,
                   help="StreamingAverage fold width (Σ rank of the clients folded in one product)")
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="torch threads")
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
    per_client_limit = QUICK_PER_CLIENT_LIMIT if args.quick else args.per_client_limit
    if per_client_limit < 0:
        parser.error(f"--per-client-limit must be >= 0 (0: all), got {per_client_limit}")
    if args.threads < 1 or args.fold_columns < 1:
        parser.error(f"--threads and --fold-columns must be >= 1, got {args.threads} and {args.fold_columns}")
    torch.set_num_threads(args.threads)
    if args.worker:
        print(json.dumps(run_configuration(shapes[0], clients[0], per_client_limit, args.fold_columns, args.seed)))
        return 0
    started, load = time.perf_counter(), os.getloadavg()
    results = []
    for shape in shapes:
        for k in clients:
            results.append(run_in_subprocess(shape, k, per_client_limit, args.fold_columns, args.seed, args.threads))
            print(f"{shape_name(shape)} K={k}: done", file=sys.stderr)
    flat = flatness(results)
    print(markdown_tables(results, flat))
    report = dict(command=" ".join([Path(sys.executable).name, *sys.argv]), model=MODEL, tiers=list(TIERS),
                  threads=args.threads, per_client_limit=per_client_limit, fold_columns=args.fold_columns,
                  seed=args.seed, torch=torch.__version__,
                  machine=dict(platform=platform.platform(), cpus=os.cpu_count(), loadavg_at_start=list(load),
                               loadavg_at_end=list(os.getloadavg())),
                  wall_seconds=time.perf_counter() - started, results=results, flatness=flat)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
