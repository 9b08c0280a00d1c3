"""Sync rounds against buffered async (FedBuff) over MQTT, on the wall clock: real device processes, really slow.

    nice -n 10 .venv/bin/python scripts/bench_async_mqtt.py                             # docs/results/async/async_mqtt.json
    .venv/bin/python scripts/bench_async_mqtt.py --seeds 1 --rounds 2 --out /tmp/a.json  # a smoke run

``python -m server.broker_loop`` with ``--local-devices 6`` on digits, each device process in a CPU cgroup of
``--cpu-limits`` cores (round-robin by device id: 1, 1, 0.5, 0.5, 0.1, 0.1), FedARA at rank tiers ``--tiers``
1/0.5/0.25 given to device i by ``--rank-overrides`` (round-robin by device id: over MQTT a tier otherwise comes from
the device's memory budget, and devices without one all train dense), checked in every run's rows (a run whose
devices trained at other tiers stops the benchmark), under ``--aggregate updates``, the same seed, partition and initial model for both
modes, for each of ``--seeds`` seeds. Sync runs ``--rounds`` R rounds (every device trains each round; a round
waits for its slowest device); async runs m·R·N/K versions with ``--buffer-size`` K and ``--concurrency`` N,
once per m of ``--async-multiples`` (m = 1: the same number of device tasks as sync). The arms run one after the other, never together. Each row's
``sim_time`` is the wall clock since the run began. Reported per arm:
- versions per wall minute, between the first version's row and the last (device start-up excluded);
- wall time to (sync's final accuracy − 1 pp).
A row's accuracy is the mean over the devices that evaluated that model: every device in every sync row; in async
only the idle devices and the tasks that started from that version (``evaluated``: often 1-2 of 6, fast devices
first), except the last row, which every device evaluates. So async's time to target is taken from the last rows
only (each async arm's end: the first arm whose last row reaches the target); the time to target over every async
row, whatever its evaluators, is reported beside it (``time_to_target_any_row_s``), as the noisier figure.
Needs root and a writable cpu cgroup controller (else the devices run unconfined and the result says nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from server.outputs.report import METRICS_FILE, read_metrics  # noqa: E402
from server.outputs.machine import cpu_name  # noqa: E402

TARGET_GAP = 0.01
DEVICES = 6



def tier_overrides(tiers: str, folder: Path) -> Path:
    """A --rank-overrides file giving local device i the tier i mod len(tiers)."""
    ratios = [float(t) for t in tiers.split(",")]
    path = folder / "tiers.json"
    path.write_text(json.dumps({f"dev_{i:03d}": ratios[i % len(ratios)] for i in range(DEVICES)}))
    return path


def fleet_tiers(records: list[dict[str, Any]]) -> dict[str, str]:
    """Each device's tier, from the rows' per-device entries (the latest that names it)."""
    tiers: dict[str, str] = {}
    for r in records:
        tiers.update({d: str(e["tier"]) for d, e in (r.get("per_device") or {}).items()})
    return dict(sorted(tiers.items()))


def common_flags(args: argparse.Namespace, seed: int) -> list[str]:
    return ["--rank-overrides", str(args.overrides), "--dataset", "digits", "--alpha", "0.5", "--min-samples", "20", "--algo", "fedara",
            "--rank-tiers", args.tiers, "--aggregate", "updates", "--local-epochs", str(args.local_epochs),
            "--batch-size", "16", "--lr", "0.05", "--lam", "1", "--lam-warmup", "1", "--threads", "1",
            "--seed", str(seed), "--local-devices", str(DEVICES), "--local-cpu-limit", args.cpu_limits,
            "--join-timeout", "900", "--round-deadline", "900"]


def arms(args: argparse.Namespace) -> dict[str, list[str]]:
    versions = args.rounds * DEVICES // args.buffer_size
    found = {"sync": ["--rounds", str(args.rounds)]}
    for multiple in (float(m) for m in args.async_multiples.split(",")):
        found[f"async x{multiple:g}"] = ["--mode", "async", "--rounds", str(round(multiple * versions)),
                                         "--buffer-size", str(args.buffer_size), "--concurrency", str(DEVICES),
                                         "--task-timeout", str(args.task_timeout)]
    return found


def run(flags: list[str], out: Path) -> tuple[list[dict[str, Any]], float, str]:
    """One broker_loop run in its own process (its devices in their cgroups); its rows, wall seconds, stdout."""
    command = [sys.executable, "-m", "server.broker_loop", *flags, "--out", str(out)]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"run failed ({done.returncode}): {shlex.join(command)}\n{done.stderr[-2000:]}")
    if "--local-cpu-limit ignored" in done.stdout:
        raise SystemExit("the devices ran without CPU limits (no cpu cgroups here): the measurement says nothing")
    return read_metrics(out / METRICS_FILE), time.perf_counter() - started, done.stdout


def time_to(records: list[dict[str, Any]], target: float) -> float | None:
    return next((r["sim_time"] for r in records if r["accuracy"] is not None and r["accuracy"] >= target), None)


def per_minute(records: list[dict[str, Any]]) -> float | None:
    """Versions (rounds) made per wall minute between the first row and the last."""
    if len(records) < 2:
        return None
    return 60.0 * (len(records) - 1) / (records[-1]["sim_time"] - records[0]["sim_time"])


def run_seed(args: argparse.Namespace, seed: int, tmp: Path) -> dict[str, Any]:
    """Every arm on one seed (a partition, an initial model), one after the other; the seed's arms and summary."""
    results: dict[str, Any] = {}
    for name, extra in arms(args).items():
        flags = [*common_flags(args, seed), *extra]
        load = os.getloadavg()
        records, wall, _ = run(flags, tmp / f"{seed}-{name.replace(' ', '')}")
        tiers = fleet_tiers(records)
        if sorted(set(tiers.values()), key=float) != sorted({f"{float(t):g}" for t in args.tiers.split(",")},
                                                             key=float):
            raise SystemExit(f"seed {seed} {name}: the devices trained at tiers {tiers}, not {args.tiers}")
        results[name] = {"command": "python -m server.broker_loop " + shlex.join(flags), "wall_s": wall,
                         "tiers": tiers,
                         "loadavg_before": list(load), "loadavg_after": list(os.getloadavg()),
                         "curve": [{k: r.get(k) for k in ("round", "sim_time", "accuracy", "evaluated",
                                                          "participants", "staleness_mean", "timed_out")}
                                   for r in records]}
        print(f"seed {seed} {name}: {len(records)} rows in {wall:.0f} s, load {load[0]:.1f} -> "
              f"{os.getloadavg()[0]:.1f}", flush=True)
    sync_final = results["sync"]["curve"][-1]["accuracy"]
    target = sync_final - TARGET_GAP
    for name, result in results.items():
        curve = result["curve"]
        last = curve[-1]
        result.update(versions=len(curve), versions_per_minute=per_minute(curve),
                      time_to_target_any_row_s=time_to(curve, target), final_accuracy=last["accuracy"],
                      final_evaluated=last["evaluated"], last_sim_time_s=last["sim_time"])
    sync = results["sync"]
    async_arms = sorted((r for n, r in results.items() if n != "sync"), key=lambda r: r["last_sim_time_s"])
    async_to_target = next((r["last_sim_time_s"] for r in async_arms
                            if r["final_accuracy"] is not None and r["final_accuracy"] >= target), None)
    sync_to_target = time_to(sync["curve"], target)
    first_async = next(iter(r for n, r in results.items() if n != "sync"))
    summary = {"target_accuracy": target, "sync_final_accuracy": sync_final,
               "versions_per_minute_ratio": first_async["versions_per_minute"] / sync["versions_per_minute"],
               "sync_time_to_target_s": sync_to_target, "async_time_to_target_s": async_to_target,
               "time_to_target_ratio": (async_to_target / sync_to_target
                                        if async_to_target is not None and sync_to_target else None)}
    print(f"\n{'seed ' + str(seed):10} {'versions':>8} {'per wall min':>12} {'final acc (evaluators)':>22} "
          f"{'last row (s)':>12} {'any row to target (s)':>21}")
    for name, r in results.items():
        to = "never" if r["time_to_target_any_row_s"] is None else f"{r['time_to_target_any_row_s']:.1f}"
        print(f"{name:10} {r['versions']:8d} {r['versions_per_minute']:12.2f} "
              f"{r['final_accuracy']:16.3f} ({r['final_evaluated']}) {r['last_sim_time_s']:12.1f} {to:>21}")
    print(f"target {target:.3f} (sync final − 1 pp): sync reaches it at {sync_to_target} s, async (a whole-fleet "
          f"evaluation) at {async_to_target} s; async/sync versions per wall minute "
          f"{summary['versions_per_minute_ratio']:.2f}\n", flush=True)
    return {"summary": summary, "arms": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10, help="sync rounds R (async: R·6/K versions)")
    p.add_argument("--buffer-size", type=int, default=3, help="async K")
    p.add_argument("--async-multiples", default="1,2", help="async arms: this many times sync's device tasks")
    p.add_argument("--cpu-limits", default="1,1,0.5,0.5,0.1,0.1", help="cores of local device i, round-robin")
    p.add_argument("--tiers", default="1.0,0.5,0.25", help="rank tier of local device i, round-robin (by "
                                                           "--rank-overrides)")
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--task-timeout", type=float, default=600.0, help="async --task-timeout (a bound, not a tuning)")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..S-1, each its own partition and initial model")
    p.add_argument("--out", default=str(REPO / "docs" / "results" / "async" / "async_mqtt.json"))
    args = p.parse_args(argv)
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-async-mqtt-") as tmp:
        args.overrides = tier_overrides(args.tiers, Path(tmp))
        seeds = {seed: run_seed(args, seed, Path(tmp)) for seed in range(args.seeds)}
    rates = [s["summary"]["versions_per_minute_ratio"] for s in seeds.values()]
    times = [s["summary"]["time_to_target_ratio"] for s in seeds.values()]
    overall = {"versions_per_minute_ratio_by_seed": rates, "time_to_target_ratio_by_seed": times,
               "async_sooner_on": sum(1 for t in times if t is not None and t < 1), "seeds": args.seeds}
    print(f"async/sync versions per wall minute by seed: {', '.join(f'{r:.2f}' for r in rates)}; time to target "
          f"async/sync: {', '.join('never' if t is None else f'{t:.2f}' for t in times)}")
    document = {"benchmark": "scripts/bench_async_mqtt.py", "argv": sys.argv[1:] if argv is None else argv,
                "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(), "loadavg_at_start": list(load_start),
                            "loadavg_at_end": list(os.getloadavg())},
                "overall": overall, "seeds": {str(k): v for k, v in seeds.items()}}
    Path(args.out).write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
