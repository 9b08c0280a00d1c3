"""Accuracy benchmark: FedARA against its λ = 0 ablation and the local / FedAvg / FedRep baselines.

    nice -n 10 .venv/bin/python scripts/bench_accuracy.py       # the committed docs/accuracy.*: ~1 h on 2 cores
    .venv/bin/python scripts/bench_accuracy.py --render-only    # redo accuracy.md/.png from docs/accuracy.json

Fashion-MNIST, 20 clients, Dirichlet label skew (α = 0.1 and 0.5), several seeds. Per α two settings:
- homogeneous (FedAvgCNN): FedARA (rank ratio 1.0, a dense FE: the paper's FedARA), FedARA* (ratio 0.5),
  FedARA with λ = 0, FedAvg, FedRep and local-only training;
- heterogeneous: FedARA on CNN1 with five rank tiers 1.0/0.75/0.5/0.25/0.125 (round-robin), its λ = 0
  ablation, and local-only CNN1..CNN5 (FedAvg and FedRep cannot average different architectures).
Every (setting, algorithm, seed) runs with ``server.simulate``'s own functions, so each run is exactly one
``python -m server.simulate`` command; the JSON keeps it. Writes ``accuracy.json`` (config and every run's
per-round records), ``accuracy.md`` (mean ± std over seeds) and ``accuracy.png`` (mean accuracy vs round,
one panel per setting). Text below ``ANALYSIS_MARKER`` in an existing ``accuracy.md`` is kept.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing
import platform
import shlex
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import server.shards as shards  # noqa: E402
import server.simulate as simulate  # noqa: E402
from server.objective import DEFAULT_LAM_WARMUP  # noqa: E402

PAPER_ROUNDS = 100
HOMOGENEOUS_MODEL = "fedavgcnn"
HETEROGENEOUS_MODEL = "cnn1"
LOCAL_HETEROGENEOUS_MODELS = "cnn1,cnn2,cnn3,cnn4,cnn5"
RANK_TIERS = "1.0,0.75,0.5,0.25,0.125"
FEDARA_STAR_RATIO = "0.5"
HOMOGENEOUS, HETEROGENEOUS = "homogeneous", "heterogeneous"
ANALYSIS_MARKER = "<!-- analysis: text below this line is written by hand and kept when the script rewrites the file -->"
JSON_NAME, MARKDOWN_NAME, PLOT_NAME = "accuracy.json", "accuracy.md", "accuracy.png"
MB = 1e6


@dataclass(frozen=True)
class BenchConfig:
    """Everything that defines the benchmark; the defaults are sized for ~1 h on 2 shared cores (docs/accuracy.md)."""

    dataset: str = "fmnist"
    clients: int = 20
    seeds: tuple[int, ...] = (0, 1, 2)
    alphas: tuple[float, ...] = (0.1, 0.5)
    rounds: int = 20
    max_samples: int | None = 4000
    local_epochs: int = 1
    batch_size: int = 16
    lr: float = 0.05
    lam: float = 10.0
    lam_heterogeneous: float = 2.0
    threads: int = 1
    jobs: int = 2

    @property
    def lam_warmup(self) -> int:
        """The paper's 10 warm-up rounds of 100, scaled to ``rounds`` (at least 1)."""
        return max(1, math.ceil(DEFAULT_LAM_WARMUP * self.rounds / PAPER_ROUNDS))

    def to_dict(self) -> dict:
        return dict(asdict(self), lam_warmup=self.lam_warmup)


QUICK = BenchConfig(dataset="digits", clients=5, seeds=(0,), alphas=(0.5,), rounds=2, max_samples=400,
                   jobs=1)


@dataclass(frozen=True)
class RunSpec:
    """One federation: which table cell it fills and the ``python -m server.simulate`` arguments that run it."""

    setting: str
    algorithm: str
    seed: int
    argv: tuple[str, ...]

    @property
    def command(self) -> str:
        return shlex.join(["python", "-m", "server.simulate", *self.argv])


def setting_name(kind: str, alpha: float) -> str:
    return f"{kind} α={alpha:g}"


def homogeneous_algorithms(lam: float) -> list[tuple[str, list[str]]]:
    """(label, simulate arguments) of the homogeneous FedAvgCNN setting."""
    fedara = ["--algo", "fedara", "--model", HOMOGENEOUS_MODEL]
    return [
        ("FedARA", fedara + ["--rank-ratio", "1.0", "--lam", f"{lam:g}"]),
        (f"FedARA* (r={FEDARA_STAR_RATIO})", fedara + ["--rank-ratio", FEDARA_STAR_RATIO, "--lam", f"{lam:g}"]),
        ("FedARA λ=0", fedara + ["--rank-ratio", "1.0", "--lam", "0"]),
        ("FedAvg", ["--algo", "fedavg", "--model", HOMOGENEOUS_MODEL]),
        ("FedRep", ["--algo", "fedrep", "--model", HOMOGENEOUS_MODEL]),
        ("Local", ["--algo", "local", "--model", HOMOGENEOUS_MODEL]),
    ]


def heterogeneous_algorithms(lam: float) -> list[tuple[str, list[str]]]:
    """(label, simulate arguments) of the heterogeneous setting: rank tiers of CNN1 against local CNN1..CNN5."""
    fedara = ["--algo", "fedara", "--model", HETEROGENEOUS_MODEL, "--rank-tiers", RANK_TIERS]
    return [
        ("FedARA (5 tiers)", fedara + ["--lam", f"{lam:g}"]),
        ("FedARA λ=0 (5 tiers)", fedara + ["--lam", "0"]),
        ("Local CNN1..5", ["--algo", "local", "--model", LOCAL_HETEROGENEOUS_MODELS]),
    ]


def common_arguments(config: BenchConfig, alpha: float, seed: int) -> list[str]:
    """The simulate arguments every run of one (α, seed) shares, so all algorithms see the same partition."""
    args = ["--dataset", config.dataset, "--clients", str(config.clients), "--partition", "dirichlet",
            "--alpha", f"{alpha:g}", "--rounds", str(config.rounds), "--local-epochs", str(config.local_epochs),
            "--batch-size", str(config.batch_size), "--lr", f"{config.lr:g}", "--lam-warmup", str(config.lam_warmup),
            "--seed", str(seed)]
    if config.max_samples:
        args += ["--max-samples", str(config.max_samples)]
    return args


def bench_runs(config: BenchConfig) -> list[RunSpec]:
    """Every run, seed-major, so that an interrupted benchmark still holds whole seeds."""
    runs = []
    for seed in config.seeds:
        for alpha in config.alphas:
            common = common_arguments(config, alpha, seed)
            for kind, algorithms in ((HOMOGENEOUS, homogeneous_algorithms(config.lam)),
                                     (HETEROGENEOUS, heterogeneous_algorithms(config.lam_heterogeneous))):
                for label, extra in algorithms:
                    runs.append(RunSpec(setting_name(kind, alpha), label, seed, tuple(common + extra)))
    return runs


def install_dataset_cache() -> Callable[[], None]:
    """Load the dataset once per process instead of once per run; returns the function that undoes it.

    ``simulate.prepare`` (through ``server.shards.dataset_shards``) reloads and re-standardizes the whole
    dataset for every run (seconds for Fashion-MNIST, ~5 % of the benchmark); the loaded arrays depend only on
    the arguments and the shards copy what they keep, so reusing them changes no number.
    """
    original = shards.load_dataset
    shards.load_dataset = functools.lru_cache(maxsize=1)(original)

    def restore() -> None:
        shards.load_dataset = original

    return restore


def execute(spec: RunSpec, verbose: bool = False) -> dict:
    """Run one federation in this process; its per-round records and how it was made."""
    args = simulate.build_parser().parse_args(list(spec.argv))
    federation = simulate.config_from_args(args)
    start = time.perf_counter()
    clients, global_model = simulate.prepare(args)
    summary, _ = simulate.run_federation(clients, global_model, federation, simulate.TorchBackend(),
                                         progress=print if verbose else lambda _: None)
    return dict(setting=spec.setting, algorithm=spec.algorithm, seed=spec.seed, command=spec.command,
                wall_s=time.perf_counter() - start, **summary)


def _worker_init(threads: int) -> None:
    torch.set_num_threads(threads)
    install_dataset_cache()


def run_all(specs: list[RunSpec], threads: int, jobs: int, on_result: Callable[[dict], None],
            verbose: bool = False) -> list[dict]:
    """Every run, in this process (jobs = 1) or in ``jobs`` worker processes; results in ``specs`` order."""
    results: list[dict] = []
    if jobs == 1:
        torch.set_num_threads(threads)
        restore = install_dataset_cache()
        try:
            for spec in specs:
                results.append(execute(spec, verbose))
                on_result(results[-1])
        finally:
            restore()
    else:
        with multiprocessing.get_context("spawn").Pool(jobs, _worker_init, (threads,)) as pool:
            for result in pool.imap_unordered(execute, specs):
                results.append(result)
                on_result(result)
    order = {(s.setting, s.algorithm, s.seed): i for i, s in enumerate(specs)}
    return sorted(results, key=lambda r: order[(r["setting"], r["algorithm"], r["seed"])])


def seed_std(values: list[float]) -> float:
    """Sample standard deviation over seeds (0 for a single seed)."""
    return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def _groups(results: Iterable[dict]) -> dict[tuple[str, str], list[dict]]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for result in results:
        groups.setdefault((result["setting"], result["algorithm"]), []).append(result)
    return groups


def summarize(results: list[dict]) -> list[dict]:
    """One row per (setting, algorithm), in first-seen order: accuracy over seeds, client spread, cost per round."""
    rows = []
    for (setting, algorithm), runs in _groups(results).items():
        finals = [r["final_accuracy"] for r in runs]
        bests = [r["best_accuracy"] for r in runs]
        records = [record for r in runs for record in r["rounds"]]
        rows.append(dict(
            setting=setting, algorithm=algorithm, seeds=len(runs),
            final_mean=float(np.mean(finals)), final_std=seed_std(finals),
            best_mean=float(np.mean(bests)), best_std=seed_std(bests),
            client_std=float(np.mean([r["rounds"][-1]["accuracy_std"] for r in runs])),
            bytes_per_round=float(np.mean([rec["bytes_down"] + rec["bytes_up"] for rec in records])),
            seconds_per_round=float(np.mean([rec["seconds"] for rec in records])),
        ))
    return rows


def paired_differences(results: list[dict]) -> list[dict]:
    """Per setting, its first algorithm (FedARA) minus each other one in final accuracy, paired by seed.

    Runs of one (setting, seed) share the partition and the initial model, so the paired spread is the
    algorithms' difference without the partition-to-partition spread that dominates the plain std.
    """
    finals: dict[str, dict[str, dict[int, float]]] = {}
    for r in results:
        finals.setdefault(r["setting"], {}).setdefault(r["algorithm"], {})[r["seed"]] = r["final_accuracy"]
    rows = []
    for setting, by_algorithm in finals.items():
        reference, *others = by_algorithm
        for other in others:
            seeds = sorted(set(by_algorithm[reference]) & set(by_algorithm[other]))
            diffs = [by_algorithm[reference][s] - by_algorithm[other][s] for s in seeds]
            rows.append(dict(setting=setting, reference=reference, other=other, seeds=len(diffs),
                             mean=float(np.mean(diffs)), std=seed_std(diffs), ahead=sum(d > 0 for d in diffs)))
    return rows


def curves(results: list[dict]) -> dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """setting -> algorithm -> (mean, sample std) accuracy per round over seeds."""
    out: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    for (setting, algorithm), runs in _groups(results).items():
        acc = np.array([[rec["accuracy"] for rec in r["rounds"]] for r in runs])
        spread = acc.std(axis=0, ddof=1) if len(runs) > 1 else np.zeros(acc.shape[1])
        out.setdefault(setting, {})[algorithm] = (acc.mean(axis=0), spread)
    return out


def _pct(mean: float, std: float) -> str:
    return f"{100 * mean:.2f} ± {100 * std:.2f}"


def results_table(rows: list[dict]) -> str:
    """The markdown table of ``summarize``'s rows (accuracies in %)."""
    lines = ["| setting | algorithm | seeds | final accuracy % (mean ± std) | best accuracy % | std over clients % "
             "| MB per round (down+up) | s per round |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['algorithm']} | {r['seeds']} | {_pct(r['final_mean'], r['final_std'])} "
                     f"| {_pct(r['best_mean'], r['best_std'])} | {100 * r['client_std']:.2f} "
                     f"| {r['bytes_per_round'] / MB:.1f} | {r['seconds_per_round']:.2f} |")
    return "\n".join(lines)


def differences_table(rows: list[dict]) -> str:
    """The markdown table of ``paired_differences`` (percentage points)."""
    lines = ["| setting | difference | Δ final accuracy, pp (mean ± std over seeds) | seeds where the first is ahead |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['reference']} − {r['other']} | {100 * r['mean']:+.2f} ± {100 * r['std']:.2f} "
                     f"| {r['ahead']}/{r['seeds']} |")
    return "\n".join(lines)


def config_table(config: BenchConfig) -> str:
    lines = ["| parameter | value |", "|---|---|"]
    for key, value in config.to_dict().items():
        shown = ", ".join(f"{v:g}" for v in value) if isinstance(value, tuple) else value
        lines.append(f"| {key} | {shown} |")
    return "\n".join(lines)


def markdown_report(config: BenchConfig, command: str, rows: list[dict], runs: list[dict], wall_s: float,
                    analysis: str) -> str:
    """accuracy.md: command, config, the measured table, one simulate command per algorithm, then ``analysis``."""
    examples = {}
    for run in runs:
        examples.setdefault((run["setting"].split()[0], run["algorithm"]), run["command"])
    parts = [
        f"# Accuracy benchmark: FedARA vs baselines on {config.dataset}",
        "",
        "Generated by `scripts/bench_accuracy.py`. Command:",
        "",
        "```", command, "```",
        "",
        f"Wall time: {wall_s / 60:.1f} min ({len(runs)} runs, {config.jobs} job(s) × {config.threads} thread(s), "
        f"{platform.machine()}, torch {torch.__version__}).",
        "",
        "## Config", "", config_table(config), "",
        f"## Results (final round; mean ± sample std over {len(config.seeds)} seed(s))", "", results_table(rows), "",
        "Accuracy is Σ correct / Σ test samples over every client's local test split, each client with its own "
        "personalized model (FedAvg: the global model); 'std over clients' is the spread of the clients' own "
        "accuracies at the final round, averaged over seeds.",
        "",
        "### FedARA minus each other algorithm, paired by seed (same partition and initial model)", "",
        differences_table(paired_differences(runs)), "",
        "![accuracy vs round](accuracy.png)",
        "",
        "## One run per algorithm (first seed and α; the JSON keeps every run's command)", "",
        *[f"- {kind} {algorithm}: `{cmd}`" for (kind, algorithm), cmd in examples.items()],
        "",
        ANALYSIS_MARKER,
    ]
    return "\n".join(parts) + "\n" + analysis


def kept_analysis(previous: str | None) -> str:
    """The hand-written part of an earlier accuracy.md (everything after ANALYSIS_MARKER), or nothing."""
    if not previous or ANALYSIS_MARKER not in previous:
        return ""
    return previous.split(ANALYSIS_MARKER, 1)[1].lstrip("\n")


def plot(curve_data: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]], path: Path) -> None:
    """Mean accuracy vs round (band: ± std over seeds), one panel per setting."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    settings = list(curve_data)
    cols = min(2, len(settings))
    rows = math.ceil(len(settings) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 4.2 * rows), squeeze=False)
    for ax, setting in zip(axes.flat, settings):
        for algorithm, (mean, std) in curve_data[setting].items():
            x = np.arange(1, len(mean) + 1)
            (line,) = ax.plot(x, 100 * mean, label=algorithm, linewidth=1.6)
            ax.fill_between(x, 100 * (mean - std), 100 * (mean + std), color=line.get_color(), alpha=0.15)
        ax.set_title(setting)
        ax.set_xlabel("round")
        ax.set_ylabel("mean client accuracy %")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    for ax in list(axes.flat)[len(settings):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"want comma-separated integers, got {text!r}") from exc
    return values


def _alpha_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"want comma-separated numbers, got {text!r}") from exc
    if min(values) <= 0:
        raise argparse.ArgumentTypeError(f"Dirichlet α must be positive, got {text!r}")
    return values


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"want a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny run on digits (5 clients, 2 rounds) to check the script")
    p.add_argument("--seeds", type=_int_list, help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--alphas", type=_alpha_list, help="comma-separated Dirichlet α (default 0.1,0.5)")
    p.add_argument("--rounds", type=_positive)
    p.add_argument("--max-samples", type=_positive, help="seeded subset of the dataset (default 4000)")
    p.add_argument("--local-epochs", type=_positive)
    p.add_argument("--lr", type=float)
    p.add_argument("--dataset", choices=simulate.DATASETS)
    p.add_argument("--clients", type=_positive)
    p.add_argument("--threads", type=_positive, help="torch threads per run (default 1)")
    p.add_argument("--jobs", type=_positive, help="parallel worker processes (default 2; --quick: 1)")
    p.add_argument("--out-dir", type=Path, default=Path("docs"))
    p.add_argument("--verbose", action="store_true", help="print every round (with --jobs 1)")
    p.add_argument("--render-only", action="store_true",
                   help="rewrite accuracy.md and accuracy.png from OUT_DIR/accuracy.json without running")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The --quick or default config, with every option given on the command line replacing its value."""
    base = QUICK if args.quick else BenchConfig()
    fields = ("seeds", "alphas", "rounds", "max_samples", "local_epochs", "lr", "dataset", "clients", "threads", "jobs")
    overrides = {name: getattr(args, name) for name in fields if getattr(args, name) is not None}
    config = replace(base, **overrides)
    if config.lr <= 0:
        raise ValueError(f"--lr must be positive, got {config.lr}")
    return config


def write_json(path: Path, config: BenchConfig, command: str, results: list[dict], complete: bool,
               wall_s: float) -> None:
    document = dict(command=command, config=config.to_dict(), complete=complete, wall_s=wall_s,
                    machine=dict(platform=platform.platform(), torch=torch.__version__),
                    summary=summarize(results) if results else [], runs=results)
    path.write_text(json.dumps(document, indent=1, ensure_ascii=False))


def write_reports(out_dir: Path, config: BenchConfig, command: str, results: list[dict], wall_s: float) -> None:
    """accuracy.md (keeping its hand-written analysis) and accuracy.png from finished runs."""
    md_path = out_dir / MARKDOWN_NAME
    previous = md_path.read_text() if md_path.exists() else None
    md_path.write_text(markdown_report(config, command, summarize(results), results, wall_s, kept_analysis(previous)))
    plot(curves(results), out_dir / PLOT_NAME)
    print(f"wrote {out_dir / JSON_NAME}, {md_path}, {out_dir / PLOT_NAME} ({wall_s / 60:.1f} min of runs)", flush=True)


def config_from_json(saved: dict) -> BenchConfig:
    """The BenchConfig that ``BenchConfig.to_dict`` wrote (lists back to tuples, the derived warm-up dropped)."""
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k != "lam_warmup"}
    return BenchConfig(**fields)


def render_from_json(out_dir: Path) -> int:
    """Rewrite the markdown and the plot from a complete accuracy.json, without running anything."""
    path = out_dir / JSON_NAME
    if not path.is_file():
        print(f"error: --render-only needs {path}, which does not exist", file=sys.stderr)
        return 2
    document = json.loads(path.read_text())
    if not document.get("complete"):
        print(f"error: {path} holds an unfinished benchmark; rerun it", file=sys.stderr)
        return 2
    write_reports(out_dir, config_from_json(document["config"]), document["command"], document["runs"],
                  document["wall_s"])
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.render_only:
        return render_from_json(args.out_dir)
    command = shlex.join([".venv/bin/python", "scripts/bench_accuracy.py", *argv])
    specs = bench_runs(config)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / JSON_NAME
    print(f"{len(specs)} runs; config {config.to_dict()}", flush=True)
    start = time.perf_counter()
    done: list[dict] = []

    def on_result(result: dict) -> None:
        done.append(result)
        elapsed = time.perf_counter() - start
        print(f"[{len(done)}/{len(specs)}] {result['setting']} | {result['algorithm']} | seed {result['seed']}: "
              f"final {100 * result['final_accuracy']:.2f}%  best {100 * result['best_accuracy']:.2f}%  "
              f"({result['wall_s']:.0f} s; {elapsed / 60:.1f} min elapsed)", flush=True)
        write_json(json_path, config, command, done, complete=False, wall_s=elapsed)

    results = run_all(specs, config.threads, config.jobs, on_result, args.verbose)
    wall_s = time.perf_counter() - start
    write_json(json_path, config, command, results, complete=True, wall_s=wall_s)
    write_reports(args.out_dir, config, command, results, wall_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
