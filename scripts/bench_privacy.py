"""Privacy benchmark: accuracy against the user-level ε of DP-FedAvg on Fashion-MNIST with many simulated devices.

    nice -n 5 .venv/bin/python scripts/bench_privacy.py --jobs 2              # the full grid (30 runs: hours)
    .venv/bin/python scripts/bench_privacy.py --seeds 1 --epsilons inf,8,1    # a slice, in this order
    .venv/bin/python scripts/bench_privacy.py --first-seed 1 --seeds 2 --out part.json   # more seeds elsewhere
    .venv/bin/python scripts/bench_privacy.py --render-only                   # the table again from the JSON
    .venv/bin/python scripts/bench_privacy.py --keep-runs                     # finish an interrupted run
    .venv/bin/python scripts/bench_privacy.py --ray HEAD_IP:6379              # each run a Ray task (docs/cluster.md)
    .venv/bin/python scripts/bench_privacy.py --secure --epsilons 8 --out docs/results/privacy/privacy_secure.json

For each ε in ``--epsilons`` (inf: no DP, the same schedule) the noise multiplier is the smallest that keeps
``--rounds`` rounds within ε at δ = 1/N^1.1 (``server.engine.accountant.noise_multiplier_for``, PLD); every run
is one ``python -m server.simulate`` command with ``--dp-noise-multiplier z --dp-target-epsilon ε`` (in a child
process each), ``--clients`` devices, Poisson sampling at ``--join-ratio``, FedARA under ``--aggregate
updates`` in two settings: heterogeneous (rank tiers 1/0.5/0.25 round-robin by device id) and homogeneous (dense),
each for ``--seeds`` seeds (a seed is a partition and an initial model; DP's noise comes from the OS's generator,
as in a real run, so a rerun differs by the noise). Prints a table (final accuracy mean ± standard error over
seeds, and the paired drop from ε = inf) and writes the JSON (every run's command, rounds, ε spent).

``--secure``: distributed DP instead (``--secure-aggregation``: the devices clip and add Skellam noise, SecAgg+ sums
them), z the smallest the Skellam accountant allows for ε (``secure_rounds.skellam_noise_multiplier_for``); the
table then pairs each run with the central run of the same setting, ε and seed in ``--central`` (a JSON of this
script without --secure).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from server.engine.accountant import noise_multiplier_for  # noqa: E402
from server.cli import add_ray_flags, check_ray_args  # noqa: E402
from server.outputs.machine import cpu_name  # noqa: E402
from server.sweep_runner import failure_lines, run_sweep  # noqa: E402

SETTINGS = {"hetero": ["--rank-tiers", "1.0,0.5,0.25"], "homog": ["--rank-ratio", "1.0"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epsilons", default="1,2,4,8,inf", help="comma-separated targets; inf: without DP")
    p.add_argument("--settings", default="hetero,homog", help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0, help="seeds --first-seed .. --first-seed + --seeds - 1")
    p.add_argument("--clients", type=int, default=3000)
    p.add_argument("--join-ratio", type=float, default=0.1)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--local-epochs", type=int, default=3)
    p.add_argument("--max-samples", type=int, default=0, help="0: all of Fashion-MNIST (20 per device)")
    p.add_argument("--min-samples", type=int, default=2)
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet label skew")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--lam", type=float, default=1.0)
    p.add_argument("--clip", type=float, default=0.5, help="--dp-clip (the adaptive clip's start with --clip-quantile)")
    p.add_argument("--clip-quantile", type=float, default=0.0, help="--dp-clip-quantile (0: a fixed --clip)")
    p.add_argument("--accountant", default="pld")
    p.add_argument("--dp-test-seed", type=int, default=None,
                   help="TESTS ONLY: each run's --dp-test-seed (its noise and sampling reproducible, its guarantee gone)")
    p.add_argument("--secure", action="store_true", help="distributed DP: --secure-aggregation, the Skellam accountant")
    p.add_argument("--central", default="docs/results/privacy/privacy.json",
                   help="with --secure: the central runs to pair with")
    p.add_argument("--out", default="docs/results/privacy/privacy.json")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (child processes, one thread each)")
    add_ray_flags(p)
    p.add_argument("--render-only", action="store_true")
    p.add_argument("--keep-runs", action="store_true", help="reuse the runs --out already holds (same commands)")
    return p.parse_args(argv)


def run_argv(a: argparse.Namespace, setting: str, seed: int, z: float | None, eps: float) -> list[str]:
    argv = ["--dataset", "fmnist", "--algo", "fedara", "--aggregate", "updates", "--clients", str(a.clients),
            "--join-ratio", str(a.join_ratio), "--rounds", str(a.rounds), "--local-epochs", str(a.local_epochs),
            "--max-samples", str(a.max_samples), "--min-samples", str(a.min_samples), "--alpha", str(a.alpha),
            "--lr", str(a.lr), "--lam", str(a.lam), "--seed", str(seed), *SETTINGS[setting]]
    if z is not None:
        argv += ["--dp-noise-multiplier", f"{z:.6g}", "--dp-clip", str(a.clip), "--dp-target-epsilon", f"{eps:g}"]
        argv += ["--secure-aggregation"] if a.secure else ["--dp-accountant", a.accountant]
        argv += ["--dp-clip-quantile", str(a.clip_quantile)] if a.clip_quantile else []
        argv += ["--dp-test-seed", str(a.dp_test_seed)] if a.dp_test_seed is not None else []
    return argv


def command_of(argv: list[str]) -> str:
    """The command a run's JSON keeps (and --keep-runs finds it by)."""
    return shlex.join(["python", "-m", "server.simulate", *argv])


def execute(argv: list[str]) -> dict:
    """One simulate run in a child process (its memory goes back when it ends); its records from metrics.jsonl."""
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "server.simulate", *argv, "--out", tmp],
                              capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
        if done.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv)} failed: {done.stderr.strip()[-2000:]}")
        records = [json.loads(line) for line in Path(tmp, "metrics.jsonl").read_text().splitlines()]
    accuracies = [r["accuracy"] for r in records if r.get("accuracy") is not None]
    return {"command": command_of(argv), "wall_s": time.perf_counter() - start,
            "final_accuracy": accuracies[-1] if accuracies else None, "rounds_run": len(records),
            "epsilon": records[-1].get("epsilon") if records else None,
            "accuracy_by_round": [r.get("accuracy") for r in records]}


def se(values: list[float]) -> float:
    return float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else 0.0


def table(doc: dict) -> str:
    """Final accuracy per (setting, ε) over seeds, and the paired drop from ε = inf (seed by seed)."""
    lines = ["| setting | target ε | z | ε spent | rounds | final accuracy (mean ± se) | drop vs ε=inf (paired) | seeds |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    runs = doc["runs"]
    for setting in doc["config"]["settings"]:
        base = {r["seed"]: r["final_accuracy"] for r in runs if r["setting"] == setting and r["target"] == "inf"}
        for target in doc["config"]["epsilons"]:
            cell = [r for r in runs if r["setting"] == setting and r["target"] == target]
            if not cell:
                continue
            acc = [r["final_accuracy"] for r in cell]
            drops = [base[r["seed"]] - r["final_accuracy"] for r in cell if r["seed"] in base and target != "inf"]
            z = cell[0]["z"]
            spent = [r["epsilon"] for r in cell if r["epsilon"] is not None]
            lines.append(f"| {setting} | {target} | {'-' if z is None else f'{z:.3f}'} | "
                         f"{'-' if not spent else f'{max(spent):.3f}'} | {cell[0]['rounds_run']} | "
                         f"{np.mean(acc):.4f} ± {se(acc):.4f} | "
                         f"{'-' if not drops else f'{100 * np.mean(drops):+.2f} ± {100 * se(drops):.2f} pp'} | "
                         f"{len(cell)} |")
    return "\n".join(lines)


def shared_dimension() -> int:
    """d: the shared numbers of the runs' model (fedavgcnn's FE on Fashion-MNIST), what distributed DP noises."""
    from device_runtime.dense_delta import dimension
    from fedcore.models import build_model
    model = build_model("fedavgcnn", (1, 28, 28), 10)
    return dimension({k: tuple(v.shape) for k, v in model.state_dict().items() if k.startswith("fe.")})


def noise_multiplier(a: argparse.Namespace, target: str, delta: float) -> float | None:
    """z for a target ε: central (PLD or RDP) or, with --secure, distributed (Skellam)."""
    if target == "inf":
        return None
    if a.secure:
        from server.engine.secure_rounds import skellam_noise_multiplier_for
        return skellam_noise_multiplier_for(float(target), a.rounds, a.join_ratio, delta, shared_dimension())
    return noise_multiplier_for(float(target), a.rounds, a.join_ratio, delta, a.accountant)


def paired_table(doc: dict, central: dict) -> str:
    """Distributed against central DP: each secure run beside the central run of its setting, ε and seed."""
    theirs = {(r["setting"], r["target"], r["seed"]): r for r in central["runs"]}
    lines = ["| setting | ε | seed | central z | central acc | distributed z | distributed acc | "
             "distributed − central (pp) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    diffs: dict[tuple[str, str], list[float]] = {}
    for r in doc["runs"]:
        other = theirs.get((r["setting"], r["target"], r["seed"]))
        if other is None or r["target"] == "inf":
            continue
        diff = r["final_accuracy"] - other["final_accuracy"]
        diffs.setdefault((r["setting"], r["target"]), []).append(diff)
        lines.append(f"| {r['setting']} | {r['target']} | {r['seed']} | {other['z']:.3f} | "
                     f"{other['final_accuracy']:.4f} | {r['z']:.3f} | {r['final_accuracy']:.4f} | {100 * diff:+.2f} |")
    for (setting, target), values in diffs.items():
        lines.append(f"| {setting} | {target} | mean of {len(values)} | | | | | "
                     f"{100 * np.mean(values):+.2f} ± {100 * se(values):.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        check_ray_args(a)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(a.out)
    if a.render_only:
        doc = json.loads(out.read_text())
        print(table(doc))
        if doc["config"].get("secure"):
            print("\n" + paired_table(doc, json.loads(Path(a.central).read_text())))
        return 0
    delta = a.clients ** -1.1
    targets = a.epsilons.split(",")
    settings = a.settings.split(",")
    z_for = {t: noise_multiplier(a, t, delta) for t in targets}
    cpu = cpu_name()
    doc = {"config": dict(vars(a), epsilons=targets, settings=settings, delta=delta), "cpu": cpu,
           "load_before": os.getloadavg(), "noise_multipliers": z_for, "runs": []}
    kept = {r["command"]: r for r in json.loads(out.read_text())["runs"]} if a.keep_runs and out.exists() else {}
    print(f"N = {a.clients}, q = {a.join_ratio}, {a.rounds} rounds, δ = {delta:.3g}: noise multipliers "
          + ", ".join(f"ε {t}: {'-' if z is None else f'{z:.3f}'}" for t, z in z_for.items()), flush=True)
    # seed by seed, the ε's in the order asked, both settings each: a cut-short grid keeps paired cells
    seeds = range(a.first_seed, a.first_seed + a.seeds)
    cells = [(target, seed, setting) for seed in seeds for target in targets for setting in settings]
    argvs = {cell: run_argv(a, cell[2], cell[1], z_for[cell[0]], math.inf if cell[0] == "inf" else float(cell[0]))
             for cell in cells}
    to_run = [cell for cell in cells if command_of(argvs[cell]) not in kept]
    out.parent.mkdir(parents=True, exist_ok=True)

    def record(cell: tuple[str, int, str], run: dict) -> None:
        target, seed, setting = cell
        result = dict(run, setting=setting, target=target, seed=seed, z=z_for[target])
        doc["runs"].append(result)
        print(f"{setting} ε {target} seed {seed}: accuracy {result['final_accuracy']:.4f}, ε spent "
              f"{result['epsilon']}, {result['wall_s']:.0f} s", flush=True)
        doc["load_after"] = os.getloadavg()
        out.write_text(json.dumps(doc, indent=1))

    for cell in cells:
        if cell not in to_run:
            record(cell, kept[command_of(argvs[cell])])
    sweep = run_sweep(execute, [argvs[cell] for cell in to_run], jobs=a.jobs, ray=a.ray, label=command_of,
                      on_result=lambda index, run: record(to_run[index], run))
    order = {command_of(argvs[cell]): i for i, cell in enumerate(cells)}
    doc["runs"].sort(key=lambda r: order[r["command"]])  # seed by seed, as asked, whatever finished first
    doc["failed"] = [vars(f) for f in sweep.failures]
    out.write_text(json.dumps(doc, indent=1))
    if sweep.failures:
        print("\n".join(failure_lines(sweep.failures)), file=sys.stderr, flush=True)
    print(table(doc))
    if a.secure and Path(a.central).exists():
        print("\n" + paired_table(doc, json.loads(Path(a.central).read_text())))
    return 1 if sweep.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
