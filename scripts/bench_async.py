"""Sync rounds against buffered async (FedBuff) on one simulated fleet: time to accuracy on the virtual clock.

    nice -n 5 .venv/bin/python scripts/bench_async.py                 # docs/results/async/async.json, docs/results/async/async.png
    .venv/bin/python scripts/bench_async.py --seeds 1 --rounds 3      # a smoke run
    .venv/bin/python scripts/bench_async.py --jobs 2                  # two runs at once (--ray ADDRESS: on a cluster)

Heterogeneous FedARA (rank tiers round-robin by device id) under ``--aggregate updates`` on sklearn's digits
(``--dataset fmnist --max-samples M``: Fashion-MNIST), with
``--clients`` in-process devices whose speeds are log-normal (σ = ``--sigma``) and which are away ``--away`` of the
time. Each seed (a partition, an initial model and a fleet trace) runs ``python -m server.simulate`` once in sync
mode for ``--rounds`` rounds and once per async arm for R·N/K versions (the same number of device tasks as N
devices for R rounds; away devices are not asked in sync, so sync does fewer). Both modes evaluate every device
after every round / version (a measurement: no virtual time), so accuracy is over the same test samples.
Per seed, paired:
- time to target: the first virtual time at which each mode reaches (sync's final accuracy − 1 pp); the ratio
  async / sync;
- accuracy at equal device compute: async's accuracy at the version where its accepted updates reach the number
  sync trained in all its rounds, minus sync's final accuracy.
Prints a table, writes the JSON (every command, every curve) and a plot of accuracy against virtual time.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import server.simulate as simulate  # noqa: E402
from server.cli import add_ray_flags, check_ray_args  # noqa: E402
from server.sweep_runner import failure_lines, run_sweep  # noqa: E402
from server.outputs.report import METRICS_FILE, read_metrics  # noqa: E402
from server.outputs.machine import cpu_name  # noqa: E402

TARGET_GAP = 0.01



def common_flags(args: argparse.Namespace, seed: int) -> list[str]:
    return ["--dataset", args.dataset, "--max-samples", str(args.max_samples), "--clients", str(args.clients),
            "--alpha", str(args.alpha), "--min-samples", str(args.min_samples), "--algo", "fedara", "--rank-tiers",
            args.tiers, "--aggregate", "updates",
            "--local-epochs", "1", "--batch-size", "16", "--lr", str(args.lr), "--lam", "1", "--lam-warmup", "1",
            "--seed", str(seed), "--device-speed", f"lognormal:{args.sigma:g}",
            "--availability", f"{1 - args.away:g},{args.mean_online_s:g}"]


def arms(args: argparse.Namespace) -> dict[str, list[str]]:
    """sync, and one async arm per (K, a, normalization) of the comma lists."""
    arms = {"sync": ["--mode", "sync", "--rounds", str(args.rounds)]}
    if args.sync_deadline:
        arms[f"sync deadline {args.sync_deadline:g} s"] = ["--mode", "sync", "--rounds", str(args.rounds),
                                                           "--virtual-deadline", f"{args.sync_deadline:g}"]
    for k in (int(v) for v in args.buffer_size.split(",") if v):
        for a in (float(v) for v in args.exponent.split(",")):
            for normalize in args.normalize.split(","):
                arms[f"async K={k} a={a:g} {normalize}"] = [
                    "--mode", "async", "--rounds", str(args.rounds * args.clients // k), "--buffer-size", str(k),
                    "--concurrency", str(args.concurrency), "--max-staleness", str(args.max_staleness),
                    "--staleness-exponent", f"{a:g}", "--server-lr", str(args.server_lr), "--buffer-normalize",
                    normalize]
    return arms


KEPT = ("round", "accuracy", "sim_time", "participants", "staleness_mean", "too_stale")


def run(flags: list[str]) -> dict[str, Any]:
    """One arm of one seed, in this process (a sweep worker's): its command, wall time and per-version records."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if simulate.main([*flags, "--out", tmp]) != 0:
            raise RuntimeError(f"run failed: python -m server.simulate {shlex.join(flags)}")
        records = read_metrics(Path(tmp) / METRICS_FILE)
    return {"command": "python -m server.simulate " + shlex.join(flags), "wall_s": time.perf_counter() - started,
            "records": [{k: r.get(k) for k in KEPT} for r in records]}


def time_to(records: list[dict[str, Any]], target: float) -> float | None:
    return next((r["sim_time"] for r in records if r["accuracy"] is not None and r["accuracy"] >= target), None)


def at_compute(records: list[dict[str, Any]], updates: int) -> float | None:
    done = 0
    for r in records:
        done += r["participants"]
        if done >= updates:
            return r["accuracy"]
    return None


def paired(values: list[float]) -> dict[str, float]:
    n = len(values)
    mean = sum(values) / n
    se = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n) if n > 1 else float("nan")
    return {"mean": mean, "se": se, "n": n}


def summarize(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    seeds = sorted(results)
    for arm in [a for a in results[seeds[0]] if a != "sync"]:
        ratios, diffs, reached, won = [], [], 0, 0
        for seed in seeds:
            sync, other = results[seed]["sync"]["records"], results[seed][arm]["records"]
            target = sync[-1]["accuracy"] - TARGET_GAP
            t_sync, t_async = time_to(sync, target), time_to(other, target)
            results[seed][arm]["time_to_target"] = t_async
            results[seed]["sync"]["time_to_target"] = t_sync
            if t_async is not None and t_sync:
                reached += 1
                ratios.append(t_async / t_sync)
                won += t_async < t_sync
            updates = sum(r["participants"] for r in sync)
            accuracy = at_compute(other, updates)
            if accuracy is not None:
                diffs.append(accuracy - sync[-1]["accuracy"])
        summary[arm] = {"time_ratio": paired(ratios) if ratios else None, "reached": reached, "faster": won,
                        "accuracy_diff_equal_compute": paired(diffs) if diffs else None, "seeds": len(seeds)}
    return summary


def plot(results: dict[str, dict[str, Any]], path: Path, dataset: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    figure = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    colors = {}
    for seed, arms_of in sorted(results.items()):
        for arm, result in arms_of.items():
            points = [(r["sim_time"], r["accuracy"]) for r in result["records"] if r["accuracy"] is not None]
            line, = ax.plot(*zip(*points), color=colors.get(arm), alpha=0.6, lw=1,
                            label=None if arm in colors else arm)
            colors.setdefault(arm, line.get_color())
    ax.set_xscale("log")
    ax.set_xlabel("virtual time (s), log scale")
    ax.set_ylabel("accuracy (all devices)")
    ax.set_title(f"{dataset}, FedARA tiers 1/0.5/0.25, log-normal speeds, devices away (a line per seed)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--dataset", default="digits", help="digits, or fmnist (Debian's dataset-fashion-mnist)")
    p.add_argument("--max-samples", type=int, default=0, help="a seeded subset of the dataset (0: all of it)")
    p.add_argument("--clients", type=int, default=50)
    p.add_argument("--rounds", type=int, default=20, help="sync rounds (async: rounds x clients / buffer size)")
    p.add_argument("--tiers", default="1.0,0.5,0.25")
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--min-samples", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--away", type=float, default=0.3, help="share of the time a device is away")
    p.add_argument("--mean-online-s", type=float, default=2.0, help="mean online period, virtual seconds")
    p.add_argument("--sync-deadline", type=float, default=None,
                   help="also a sync arm whose rounds close after this many virtual seconds")
    p.add_argument("--buffer-size", default="10", help="async arms: K values, comma-separated")
    p.add_argument("--concurrency", type=int, default=20)
    p.add_argument("--max-staleness", type=int, default=20)
    p.add_argument("--exponent", default="0.5", help="async arms: staleness exponents a, comma-separated")
    p.add_argument("--server-lr", type=float, default=1.0)
    p.add_argument("--normalize", default="samples,staleness", help="async arms: --buffer-normalize values")
    p.add_argument("--out", default="docs/results/async/async.json")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (worker processes)")
    add_ray_flags(p)
    args = p.parse_args(argv)
    out = Path(args.out)
    try:
        check_ray_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cells = [(seed, arm, [*common_flags(args, seed), *flags]) for seed in range(args.seeds)
             for arm, flags in arms(args).items()]
    finished: dict[tuple[int, str], dict[str, Any]] = {}
    load_start, started = os.getloadavg(), time.perf_counter()

    def record(index: int, result: dict[str, Any]) -> None:
        seed, arm, _ = cells[index]
        finished[seed, arm] = result
        final = result["records"][-1]
        print(f"seed {seed} {arm:26s} final accuracy {final['accuracy']:.4f} at virtual {final['sim_time']:.2f} s"
              f"  ({len(result['records'])} rows, {result['wall_s']:.0f} s wall)", flush=True)

    sweep = run_sweep(run, [command for _, _, command in cells], jobs=args.jobs, ray=args.ray, on_result=record,
                      label=lambda command: "python -m server.simulate " + shlex.join(command))
    failed_seeds = {seed for seed, arm, _ in cells if (seed, arm) not in finished}
    results = {seed: {arm: finished[seed, arm] for s, arm, _ in cells if s == seed}
               for seed in range(args.seeds) if seed not in failed_seeds}
    if not results:
        print("\n".join(failure_lines(sweep.failures)), file=sys.stderr)
        return 1
    summary = summarize(results)
    print(f"\n{'arm':26s} {'time to sync final-1pp (async/sync)':38s} {'faster':>7s} {'acc. at equal compute (pp)':>28s}")
    for arm, s in summary.items():
        ratio = s["time_ratio"]
        diff = s["accuracy_diff_equal_compute"]
        ratio_text = "-" if ratio is None else f"{ratio['mean']:.3f} ± {ratio['se']:.3f} ({s['reached']}/{s['seeds']} reached)"
        diff_text = "-" if diff is None else f"{100 * diff['mean']:+.2f} ± {100 * diff['se']:.2f}"
        print(f"{arm:26s} {ratio_text:38s} {s['faster']:>3d}/{s['seeds']:<3d} {diff_text:>28s}")
    document = {"settings": vars(args), "summary": summary, "results": {str(k): v for k, v in results.items()},
                "failed": [vars(f) for f in sweep.failures], "seeds_left_out": sorted(failed_seeds),
                "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(), "loadavg_at_start": list(load_start),
                            "loadavg_at_end": list(os.getloadavg())},
                "wall_s": time.perf_counter() - started}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=1) + "\n")
    plot(results, out.with_suffix(".png"), args.dataset)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    if sweep.failures:  # reported, never dropped: the summary is over the seeds whose every arm finished
        print("\n".join(failure_lines(sweep.failures)), file=sys.stderr)
        print(f"seeds left out of the summary: {sorted(failed_seeds)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
