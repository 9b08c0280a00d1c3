"""Accuracy benchmark: FedARA's aggregation rules, λ and partitions against its ablation and the baselines.

    nice -n 5 .venv/bin/python scripts/bench_accuracy.py --jobs 2        # docs/results/accuracy/accuracy.*: 71 min on 2 busy cores
    .venv/bin/python scripts/bench_accuracy.py --render-only             # redo the report from docs/results/accuracy/accuracy.json
    .venv/bin/python scripts/bench_accuracy.py --preset paper --estimate  # time a sample, print the expected total
    .venv/bin/python scripts/bench_accuracy.py --preset paper --jobs 8    # the paper's schedule (GPU: --device cuda)
    .venv/bin/python scripts/bench_accuracy.py --study curves --out-dir docs/results/accuracy/curves  # learning curves vs data size
    .venv/bin/python scripts/bench_accuracy.py --ray HEAD_IP:6379       # each run a Ray task (docs/cluster.md)

Fashion-MNIST, five studies (``--study``; the first three by default), each cell paired by seed (a seed is a
partition and an initial model):
- headline: heterogeneous FedARA on CNN1 with five rank tiers 1.0/0.75/0.5/0.25/0.125 (round-robin by device id)
  under ``--aggregate weights`` (the paper's rule) and ``updates``, each with its λ = 0 ablation, against
  local-only CNN1..CNN5 (device i trains CNN(i mod 5 + 1), so tier 1.0 sits beside CNN1 and 0.125 beside CNN5);
  homogeneous FedAvgCNN: FedARA (dense), FedARA* (rank 0.5), its λ = 0 ablation, FedAvg, FedRep, local.
  Per-tier accuracy for every heterogeneous row.
- lambda: the paper's λ sweep in the heterogeneous setting, both rules.
- partition: the pathological partition (2 classes per client) beside Dirichlet 0.1 and 0.5, heterogeneous
  FedARA (both rules) and local CNN1..5.
- curves: accuracy after every round for ``--curve-rounds`` rounds (40; paper 100) with the paper's 10-round λ
  warm-up, per amount of data per client (``--sizes``), heterogeneous FedARA (both rules) vs local CNN1..5 and
  homogeneous FedARA vs FedRep, local and FedAvg, ``--curve-seeds`` paired seeds; reports the final paired
  difference and the first round from which FedARA stays ahead, and plots ``accuracy_curves.png``.
- models: for each ``--model SPEC`` (a model of yours, docs/your_model.md), dense FedARA with the BatchNorm
  statistics personal and shared, FedAvg of the same model (everything shared) and local training, the headline
  seeds; personal − shared is what ``--bn-stats``'s default is chosen from.
The paper preset prints its measured estimate (one round of each cost class) before it starts, and every run
trains on the GPU (``server.simulate --device cuda``) where torch sees one (``--device``).
Every run is exactly one ``python -m server.simulate`` command (run in-process with its own functions; a run
two studies share runs once); the JSON keeps each command. Writes ``accuracy.json``, ``accuracy.md`` (tables,
paired differences with standard errors and wins), ``accuracy.png`` (accuracy vs round) and
``accuracy_lambda.png`` (final accuracy vs λ). Text below ``ANALYSIS_MARKER`` in an existing ``accuracy.md`` is
kept. ``--estimate`` runs one round of one run per cost class instead, and writes the expected total to
``accuracy_estimate.json`` (shown in ``accuracy.md`` when it lies beside it). ``--keep-runs`` reuses the runs of
an earlier ``accuracy.json`` that the benchmark plans (finishing an interrupted one, or adding rows to it).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import server.run_setup as run_setup  # noqa: E402
import server.data.shards as shards  # noqa: E402
import server.simulate as simulate  # noqa: E402
from server.cli import add_ray_flags, check_ray_args  # noqa: E402
from server.outputs.progress import Progress  # noqa: E402
from server.sweep_runner import Failure, Resources, SweepResult, failure_lines, run_sweep  # noqa: E402
from server.data import DATASETS  # noqa: E402
from server.engine.run_config import AGGREGATION_RULES, DEFAULT_LAM_WARMUP  # noqa: E402

PAPER_ROUNDS = 100
HOMOGENEOUS_MODEL = "fedavgcnn"
HETEROGENEOUS_MODEL = "cnn1"
LOCAL_HETEROGENEOUS_MODELS = ("cnn1", "cnn2", "cnn3", "cnn4", "cnn5")
RANK_TIERS = ("1.0", "0.75", "0.5", "0.25", "0.125")
FEDARA_STAR_RATIO = "0.5"
STUDIES = ("headline", "lambda", "partition", "curves", "models")
DEFAULT_STUDIES = ("headline", "lambda", "partition")
"""What a preset runs unless --study says otherwise; the curves and models studies are asked for by name."""
HETERO_LOCAL = "Local CNN1..5"
ANALYSIS_MARKER = "<!-- analysis: text below this line is written by hand and kept when the script rewrites the file -->"
JSON_NAME, MARKDOWN_NAME, PLOT_NAME = "accuracy.json", "accuracy.md", "accuracy.png"
LAMBDA_PLOT_NAME, ESTIMATE_NAME = "accuracy_lambda.png", "accuracy_estimate.json"
CURVES_PLOT_NAME = "accuracy_curves.png"
LEAD_START, LEAD_END = "<!-- lead: written by hand, kept when the script rewrites the file -->", "<!-- /lead -->"
COST_NEUTRAL_FLAGS = ("--seed", "--alpha", "--partition", "--classes-per-client", "--aggregate", "--lam")
"""Flags that change what a run learns but not (to first order) what it costs: one cost class for --estimate."""
MB = 1e6


@dataclass(frozen=True)
class BenchConfig:
    """Everything that defines the benchmark. The defaults (preset ``reduced``) are sized for ≤ 70 core-minutes
    on this machine; ``PAPER`` is the paper's schedule."""

    dataset: str = "fmnist"
    clients: int = 10
    seeds: tuple[int, ...] = tuple(range(10))
    study_seeds: tuple[int, ...] = (0, 1, 2)
    alpha: float = 0.5
    rounds: int = 10
    max_samples: int | None = 2000
    local_epochs: int = 1
    batch_size: int = 16
    lr: float = 0.05
    lam: float = 10.0
    lam_heterogeneous: float = 2.0
    lambdas: tuple[float, ...] = (0.0, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0)
    partition_alphas: tuple[float, ...] = (0.1, 0.5)
    classes_per_client: int = 2
    studies: tuple[str, ...] = DEFAULT_STUDIES
    threads: int = 1
    jobs: int = 2
    sizes: tuple[int, ...] = (100, 200, 600)
    curve_seeds: tuple[int, ...] = tuple(range(5))
    curve_rounds: int = 40
    curve_algorithms: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    device: str = "cpu"

    @property
    def lam_warmup(self) -> int:
        """The paper's 10 warm-up rounds of 100, scaled to ``rounds`` (at least 1)."""
        return max(1, math.ceil(DEFAULT_LAM_WARMUP * self.rounds / PAPER_ROUNDS))

    def to_dict(self) -> dict:
        return dict(asdict(self), lam_warmup=self.lam_warmup)


PRESETS = {
    "reduced": BenchConfig(),
    "paper": BenchConfig(clients=20, rounds=PAPER_ROUNDS, max_samples=None, local_epochs=5, lr=5e-3,
                         curve_rounds=PAPER_ROUNDS),
    "quick": BenchConfig(dataset="digits", clients=5, seeds=(0,), study_seeds=(0,), rounds=2, max_samples=400,
                         lambdas=(0.0, 2.0, 10.0), partition_alphas=(0.5,), jobs=1, sizes=(80, 120), curve_seeds=(0,),
                         curve_rounds=2),
}


def simulate_command(argv: Sequence[str]) -> str:
    """The ``server.simulate`` command line of a run: its key in the results, and what the JSON keeps."""
    return shlex.join(["python", "-m", "server.simulate", *argv])


@dataclass(frozen=True)
class Partition:
    """A label skew: Dirichlet(α) or pathological (``value`` classes per client)."""

    kind: str
    value: float

    @property
    def label(self) -> str:
        return f"Dirichlet α={self.value:g}" if self.kind == "dirichlet" else f"pathological {self.value:g} classes"

    def arguments(self) -> list[str]:
        if self.kind == "dirichlet":
            return ["--partition", "dirichlet", "--alpha", f"{self.value:g}"]
        return ["--partition", "pathological", "--classes-per-client", f"{self.value:g}"]


@dataclass(frozen=True)
class RunSpec:
    """One table cell's run: which (study, setting, algorithm, seed) it fills and the simulate arguments."""

    study: str
    setting: str
    algorithm: str
    seed: int
    argv: tuple[str, ...]

    @property
    def command(self) -> str:
        return simulate_command(self.argv)


@dataclass(frozen=True)
class Pair:
    """A paired comparison: ``first`` minus ``second`` in one (study, setting), seed by seed."""

    study: str
    setting: str
    first: str
    second: str


@dataclass
class BenchPlan:
    """What the selected studies run and compare."""

    specs: list[RunSpec] = field(default_factory=list)
    pairs: list[Pair] = field(default_factory=list)

    def unique(self) -> list[RunSpec]:
        """One spec per distinct command, seed-major (an interrupted benchmark still holds whole seeds)."""
        first: dict[str, RunSpec] = {}
        for spec in self.specs:
            first.setdefault(spec.command, spec)
        return sorted(first.values(), key=lambda s: s.seed)


def fedara_label(rule: str, lam: float | None = None) -> str:
    """'FedARA updates', 'FedARA weights λ=0', ...: the rule, and λ where it is not the setting's default."""
    return f"FedARA {rule}" + ("" if lam is None else f" λ={lam:g}")


def heterogeneous_fedara(rule: str, lam: float) -> list[str]:
    return ["--algo", "fedara", "--model", HETEROGENEOUS_MODEL, "--rank-tiers", ",".join(RANK_TIERS),
            "--aggregate", rule, "--lam", f"{lam:g}"]


def heterogeneous_local() -> list[str]:
    return ["--algo", "local", "--model", ",".join(LOCAL_HETEROGENEOUS_MODELS)]


def homogeneous_algorithms(lam: float) -> list[tuple[str, list[str]]]:
    """(label, simulate arguments) of the homogeneous FedAvgCNN setting (its first is the reference)."""
    fedara = ["--algo", "fedara", "--model", HOMOGENEOUS_MODEL]
    return [
        ("FedARA", fedara + ["--rank-ratio", "1.0", "--lam", f"{lam:g}"]),
        (f"FedARA* (r={FEDARA_STAR_RATIO})", fedara + ["--rank-ratio", FEDARA_STAR_RATIO, "--lam", f"{lam:g}"]),
        ("FedARA λ=0", fedara + ["--rank-ratio", "1.0", "--lam", "0"]),
        ("FedAvg", ["--algo", "fedavg", "--model", HOMOGENEOUS_MODEL]),
        ("FedRep", ["--algo", "fedrep", "--model", HOMOGENEOUS_MODEL]),
        ("Local", ["--algo", "local", "--model", HOMOGENEOUS_MODEL]),
    ]


def common_arguments(config: BenchConfig, partition: Partition, seed: int) -> list[str]:
    """The simulate arguments every run of one (partition, seed) shares, so all algorithms see the same data."""
    args = ["--dataset", config.dataset, "--clients", str(config.clients), *partition.arguments(),
            "--rounds", str(config.rounds), "--local-epochs", str(config.local_epochs),
            "--batch-size", str(config.batch_size), "--lr", f"{config.lr:g}", "--lam-warmup", str(config.lam_warmup),
            "--seed", str(seed)]
    if config.max_samples:
        args += ["--max-samples", str(config.max_samples)]
    return args + device_arguments(config)


def device_arguments(config: BenchConfig) -> list[str]:
    """``--device cuda`` where the benchmark runs on a GPU; nothing on the CPU (the commands stay as they were)."""
    return [] if config.device == "cpu" else ["--device", config.device]


def heterogeneous_setting(partition: Partition) -> str:
    return f"heterogeneous {partition.label}"


def headline_plan(config: BenchConfig) -> BenchPlan:
    """Both rules, their λ = 0 ablations and local CNN1..5 (heterogeneous); FedARA vs the baselines (homogeneous)."""
    partition = Partition("dirichlet", config.alpha)
    hetero, homo = heterogeneous_setting(partition), f"homogeneous {partition.label}"
    lam = config.lam_heterogeneous
    hetero_algorithms = [(fedara_label(rule), heterogeneous_fedara(rule, lam)) for rule in ("updates", "weights")]
    hetero_algorithms += [(fedara_label(rule, 0), heterogeneous_fedara(rule, 0)) for rule in ("updates", "weights")]
    hetero_algorithms.append((HETERO_LOCAL, heterogeneous_local()))
    plan = BenchPlan()
    for seed in config.seeds:
        common = common_arguments(config, partition, seed)
        for setting, algorithms in ((hetero, hetero_algorithms), (homo, homogeneous_algorithms(config.lam))):
            plan.specs += [RunSpec("headline", setting, label, seed, tuple(common + extra))
                           for label, extra in algorithms]
    updates, weights = fedara_label("updates"), fedara_label("weights")
    plan.pairs += [Pair("headline", hetero, updates, weights),
                   Pair("headline", hetero, updates, fedara_label("updates", 0)),
                   Pair("headline", hetero, weights, fedara_label("weights", 0)),
                   Pair("headline", hetero, updates, HETERO_LOCAL),
                   Pair("headline", hetero, weights, HETERO_LOCAL)]
    reference, *others = [label for label, _ in homogeneous_algorithms(config.lam)]
    plan.pairs += [Pair("headline", homo, reference, other) for other in others]
    return plan


def lambda_plan(config: BenchConfig) -> BenchPlan:
    """The λ sweep, heterogeneous Dirichlet(α), both rules; each λ compared across rules and against λ = 0."""
    partition = Partition("dirichlet", config.alpha)
    setting = heterogeneous_setting(partition)
    plan = BenchPlan()
    for seed in config.study_seeds:
        common = common_arguments(config, partition, seed)
        plan.specs += [RunSpec("lambda", setting, fedara_label(rule, lam), seed,
                               tuple(common + heterogeneous_fedara(rule, lam)))
                       for rule in AGGREGATION_RULES for lam in config.lambdas]
    for lam in config.lambdas:
        plan.pairs.append(Pair("lambda", setting, fedara_label("updates", lam), fedara_label("weights", lam)))
        if lam != 0 and 0 in config.lambdas:
            plan.pairs += [Pair("lambda", setting, fedara_label(rule, lam), fedara_label(rule, 0))
                           for rule in AGGREGATION_RULES]
    return plan


def partitions(config: BenchConfig) -> list[Partition]:
    return [Partition("pathological", config.classes_per_client)] + [Partition("dirichlet", a)
                                                                    for a in config.partition_alphas]


def partition_plan(config: BenchConfig) -> BenchPlan:
    """Heterogeneous FedARA (both rules, the setting's λ) and local CNN1..5 under each label skew."""
    lam = config.lam_heterogeneous
    algorithms = [(fedara_label(rule), heterogeneous_fedara(rule, lam)) for rule in ("updates", "weights")]
    algorithms.append((HETERO_LOCAL, heterogeneous_local()))
    plan = BenchPlan()
    for seed in config.study_seeds:
        for partition in partitions(config):
            common = common_arguments(config, partition, seed)
            plan.specs += [RunSpec("partition", heterogeneous_setting(partition), label, seed, tuple(common + extra))
                           for label, extra in algorithms]
    for partition in partitions(config):
        setting = heterogeneous_setting(partition)
        updates, weights = fedara_label("updates"), fedara_label("weights")
        plan.pairs += [Pair("partition", setting, updates, weights), Pair("partition", setting, updates, HETERO_LOCAL),
                       Pair("partition", setting, weights, HETERO_LOCAL)]
    return plan


def size_setting(kind: str, partition: Partition, size: int) -> str:
    """'heterogeneous Dirichlet α=0.5, 100 samples/client': the curves study's settings."""
    return f"{kind} {partition.label}, {size} samples/client"


def curve_arguments(config: BenchConfig, partition: Partition, size: int, seed: int) -> list[str]:
    """One (data size, seed) of the curves study: ``size`` samples per client on average (a seeded subset of
    size × clients, split by the partition and 75/25 into train/test), ``curve_rounds`` rounds with the paper's
    10-round λ warm-up."""
    return ["--dataset", config.dataset, "--clients", str(config.clients), *partition.arguments(),
            "--rounds", str(config.curve_rounds), "--local-epochs", str(config.local_epochs),
            "--batch-size", str(config.batch_size), "--lr", f"{config.lr:g}", "--lam-warmup", str(DEFAULT_LAM_WARMUP),
            "--seed", str(seed), "--max-samples", str(size * config.clients), *device_arguments(config)]


def curves_plan(config: BenchConfig) -> BenchPlan:
    """Per data size: heterogeneous FedARA (both rules) against local CNN1..5, and homogeneous FedARA against
    FedRep, local and FedAvg, every round recorded, ``curve_seeds`` paired seeds."""
    partition = Partition("dirichlet", config.alpha)
    lam = config.lam_heterogeneous
    hetero = [(fedara_label(rule), heterogeneous_fedara(rule, lam)) for rule in ("updates", "weights")]
    hetero.append((HETERO_LOCAL, heterogeneous_local()))
    homo = [(label, extra) for label, extra in homogeneous_algorithms(config.lam)
            if label in ("FedARA", "FedRep", "Local", "FedAvg")]
    wanted = set(config.curve_algorithms or [label for label, _ in hetero + homo])
    plan = BenchPlan()
    for seed in config.curve_seeds:
        for size in config.sizes:
            common = curve_arguments(config, partition, size, seed)
            for kind, algorithms in (("heterogeneous", hetero), ("homogeneous", homo)):
                plan.specs += [RunSpec("curves", size_setting(kind, partition, size), label, seed,
                                       tuple(common + extra)) for label, extra in algorithms if label in wanted]
    for size in config.sizes:
        hetero_setting, homo_setting = (size_setting(kind, partition, size) for kind in ("heterogeneous", "homogeneous"))
        pairs = [Pair("curves", hetero_setting, fedara_label(rule), HETERO_LOCAL) for rule in ("updates", "weights")]
        pairs += [Pair("curves", homo_setting, "FedARA", other) for other in ("Local", "FedRep", "FedAvg")]
        plan.pairs += [p for p in pairs if {p.first, p.second} <= wanted]
    return plan


BN_PERSONAL, BN_SHARED = "FedARA BN personal", "FedARA BN shared"
MODEL_TIERS = ("1.0", "0.5", "0.25")
"""The models study's rank tiers, round-robin by device id: the three tiers its MQTT runs train at."""
TIERED = f"FedARA tiers {'/'.join(MODEL_TIERS)}, BN personal"


def model_algorithms(model: str, lam: float) -> list[tuple[str, list[str]]]:
    """(label, simulate arguments) of the models study for one model (``--model`` spec): dense FedARA with the
    BatchNorm statistics personal (FedBN) and shared (FedAvg-BN), FedARA at three rank tiers (personal
    statistics), FedAvg of the same model (everything shared, the global model evaluated) and local training."""
    fedara = ["--algo", "fedara", "--model", model, "--rank-ratio", "1.0", "--lam", f"{lam:g}"]
    tiered = ["--algo", "fedara", "--model", model, "--rank-tiers", ",".join(MODEL_TIERS), "--lam", f"{lam:g}"]
    return [(BN_PERSONAL, fedara + ["--bn-stats", "personal"]), (BN_SHARED, fedara + ["--bn-stats", "shared"]),
            (TIERED, tiered + ["--bn-stats", "personal"]),
            ("FedAvg", ["--algo", "fedavg", "--model", model, "--bn-stats", "shared"]),
            ("Local", ["--algo", "local", "--model", model])]


def model_setting(model: str, partition: Partition) -> str:
    """'dscnn.py:build, Dirichlet α=0.5': the models study's setting of one model."""
    return f"{Path(model.split(':')[0]).name}:{model.split(':')[-1]}, {partition.label}" if ":" in model \
        else f"{model}, {partition.label}"


def models_plan(config: BenchConfig) -> BenchPlan:
    """Per ``--model``: FedARA with BatchNorm statistics personal and shared, and at three rank tiers, against
    FedAvg and local training of the same model, Dirichlet(α), the headline seeds; personal − shared decides
    ``--bn-stats``'s default, tiers − dense says what the tiers cost."""
    partition = Partition("dirichlet", config.alpha)
    plan = BenchPlan()
    for model in config.models:
        setting = model_setting(model, partition)
        for seed in config.seeds:
            common = common_arguments(config, partition, seed)
            plan.specs += [RunSpec("models", setting, label, seed, tuple(common + extra))
                           for label, extra in model_algorithms(model, config.lam)]
        plan.pairs += [Pair("models", setting, BN_PERSONAL, BN_SHARED), Pair("models", setting, BN_PERSONAL, "FedAvg"),
                       Pair("models", setting, BN_PERSONAL, "Local"), Pair("models", setting, BN_SHARED, "FedAvg"),
                       Pair("models", setting, BN_SHARED, "Local"), Pair("models", setting, TIERED, BN_PERSONAL),
                       Pair("models", setting, TIERED, "FedAvg"), Pair("models", setting, TIERED, "Local")]
    return plan


STUDY_PLANS: dict[str, Callable[[BenchConfig], BenchPlan]] = {
    "headline": headline_plan, "lambda": lambda_plan, "partition": partition_plan, "curves": curves_plan,
    "models": models_plan}


def bench_plan(config: BenchConfig) -> BenchPlan:
    """Every cell and comparison of the selected studies."""
    plan = BenchPlan()
    for study in config.studies:
        part = STUDY_PLANS[study](config)
        plan.specs += part.specs
        plan.pairs += part.pairs
    return plan


# -- running -------------------------------------------------------------------------------------------------


def install_dataset_cache() -> Callable[[], None]:
    """Load the dataset once per process instead of once per run; returns the function that undoes it.

    ``shards.data_from_args`` reloads and re-standardizes the whole dataset for every run; the loaded arrays
    depend only on the arguments and the partition copies what each device keeps, so reusing them changes no
    number.
    """
    original = shards.load_dataset
    shards.load_dataset = functools.lru_cache(maxsize=1)(original)

    def restore() -> None:
        shards.load_dataset = original

    return restore


def execute(argv: tuple[str, ...], verbose: bool = False) -> dict:
    """Run one federation in this process (server.simulate's engine, run folder in a temporary directory):
    its command, per-round records and each device's test-split size (for per-tier accuracy)."""
    args = simulate.build_parser().parse_args(list(argv))
    start, start_cpu = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory() as tmp:
        progress = Progress(args.rounds, emit=print if verbose else lambda _: None)
        simulation = simulate.Simulation(args, run_setup.RunFolder(Path(tmp)), progress)
        records = simulation.run()
    test_samples = {d: int(len(device.shard.y_test)) for d, device in sorted(simulation.devices.items())}
    return dict(command=simulate_command(argv), wall_s=time.perf_counter() - start,
                cpu_s=time.process_time() - start_cpu, test_samples=test_samples, rounds=records,
                **simulate.summary(records))


def _worker_init(threads: int) -> None:
    torch.set_num_threads(threads)
    install_dataset_cache()


def run_all(argvs: list[tuple[str, ...]], threads: int, jobs: int, on_result: Callable[[dict], None],
            verbose: bool = False, ray: str | None = None, gpus: float = 0.0) -> SweepResult:
    """Every run (``server.sweep_runner``): in this process (jobs = 1), in ``jobs`` worker processes, or as Ray
    tasks of ``threads`` CPUs (and ``gpus`` GPUs) on the cluster at ``ray``; results in ``argvs`` order, a run
    that fails twice reported in the result's failures."""
    common = dict(label=simulate_command, on_result=lambda _, result: on_result(result))
    if ray is not None:
        return run_sweep(execute, argvs, ray=ray, resources=Resources(threads, gpus), initializer=_worker_init,
                         init_args=(threads,), **common)
    if jobs > 1:
        return run_sweep(execute, argvs, jobs=jobs, initializer=_worker_init, init_args=(threads,), **common)
    torch.set_num_threads(threads)
    restore = install_dataset_cache()
    try:
        return run_sweep(functools.partial(execute, verbose=verbose), argvs, **common)
    finally:
        restore()


def cells(plan: BenchPlan, runs: list[dict]) -> list[dict]:
    """Each planned cell with its run's results (a run shared by two studies fills both; missing runs are skipped)."""
    by_command = {run["command"]: run for run in runs}
    return [dict(by_command[s.command], study=s.study, setting=s.setting, algorithm=s.algorithm, seed=s.seed)
            for s in plan.specs if s.command in by_command]


# -- statistics ----------------------------------------------------------------------------------------------


def standard_error(values: list[float]) -> float:
    """Sample standard deviation / √n (0 for a single value)."""
    return float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else 0.0


def _groups(results: Iterable[dict]) -> dict[tuple[str, str, str], list[dict]]:
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for result in results:
        groups.setdefault((result["study"], result["setting"], result["algorithm"]), []).append(result)
    return groups


def summarize(results: list[dict]) -> list[dict]:
    """One row per (study, setting, algorithm), in first-seen order: accuracy over seeds, client spread, cost."""
    rows = []
    for (study, setting, algorithm), runs in _groups(results).items():
        finals = [r["final_accuracy"] for r in runs]
        bests = [r["best_accuracy"] for r in runs]
        records = [record for r in runs for record in r["rounds"]]
        rows.append(dict(
            study=study, setting=setting, algorithm=algorithm, seeds=len(runs),
            final_mean=float(np.mean(finals)), final_se=standard_error(finals),
            best_mean=float(np.mean(bests)), best_se=standard_error(bests),
            client_std=float(np.mean([r["rounds"][-1]["accuracy_std"] for r in runs])),
            bytes_per_round=float(np.mean([rec["bytes_down"] + rec["bytes_up"] for rec in records])),
            seconds_per_round=float(np.mean([rec["seconds"] for rec in records])),
        ))
    return rows


def _per_seed(results: Iterable[dict], value: Callable[[dict], Any]) -> dict[tuple[str, str, str], dict[int, Any]]:
    """(study, setting, algorithm) -> seed -> ``value(run)``."""
    out: dict[tuple[str, str, str], dict[int, Any]] = {}
    for r in results:
        out.setdefault((r["study"], r["setting"], r["algorithm"]), {})[r["seed"]] = value(r)
    return out


def _finals(results: Iterable[dict]) -> dict[tuple[str, str, str], dict[int, float]]:
    return _per_seed(results, lambda r: r["final_accuracy"])


def paired(first: dict[int, float], second: dict[int, float]) -> dict:
    """first − second over the seeds both hold: mean, standard error, seeds where first is ahead, count."""
    seeds = sorted(set(first) & set(second))
    diffs = [first[s] - second[s] for s in seeds]
    return dict(seeds=len(diffs), mean=float(np.mean(diffs)) if diffs else math.nan, se=standard_error(diffs),
                ahead=sum(d > 0 for d in diffs))


def paired_differences(results: list[dict], pairs: list[Pair]) -> list[dict]:
    """Each planned pair in final accuracy, paired by seed.

    Runs of one (setting, seed) share the partition and the initial model, so the paired spread is the
    algorithms' difference without the partition-to-partition spread that dominates the plain spread.
    """
    finals = _finals(results)
    rows = []
    for p in pairs:
        first, second = finals.get((p.study, p.setting, p.first)), finals.get((p.study, p.setting, p.second))
        if first and second:
            rows.append(dict(asdict(p), **paired(first, second)))
    return rows


def tier_slots(clients: int) -> list[str]:
    """Device i's tier in the heterogeneous runs (round-robin by sorted device id, as server.simulate assigns it)."""
    return [RANK_TIERS[i % len(RANK_TIERS)] for i in range(clients)]


def tier_accuracy(run: dict) -> dict[str, float]:
    """Final accuracy (Σ correct / Σ test samples) of each tier's devices; for local CNN1..5 the same devices,
    so tier 1.0 is CNN1's and 0.125 is CNN5's."""
    per_device = run["rounds"][-1]["per_device"]
    devices = sorted(run["test_samples"])
    correct: dict[str, float] = {}
    total: dict[str, int] = {}
    for device, tier in zip(devices, tier_slots(len(devices))):
        n = run["test_samples"][device]
        correct[tier] = correct.get(tier, 0.0) + per_device[device]["accuracy"] * n
        total[tier] = total.get(tier, 0) + n
    return {tier: correct[tier] / total[tier] for tier in RANK_TIERS if tier in total}


def tier_rows(results: list[dict]) -> list[dict]:
    """Per heterogeneous (study, setting, algorithm): each tier's mean final accuracy and SE over seeds."""
    rows = []
    for (study, setting, algorithm), runs in _groups(results).items():
        if not setting.startswith("heterogeneous"):
            continue
        by_tier = [tier_accuracy(r) for r in runs]
        rows.append(dict(study=study, setting=setting, algorithm=algorithm, seeds=len(runs),
                         tiers={t: (float(np.mean([b[t] for b in by_tier])), standard_error([b[t] for b in by_tier]))
                                for t in RANK_TIERS if all(t in b for b in by_tier)}))
    return rows


def tier_differences(results: list[dict], pairs: list[Pair]) -> list[dict]:
    """Each heterogeneous pair, tier by tier, paired by seed."""
    per_run = _per_seed((r for r in results if r["setting"].startswith("heterogeneous")), tier_accuracy)
    rows = []
    for p in pairs:
        first, second = per_run.get((p.study, p.setting, p.first)), per_run.get((p.study, p.setting, p.second))
        if not first or not second:
            continue
        rows.append(dict(asdict(p), tiers={t: paired({s: a[t] for s, a in first.items()},
                                                     {s: a[t] for s, a in second.items()}) for t in RANK_TIERS
                                           if all(t in a for a in (*first.values(), *second.values()))}))
    return rows


def lambda_rows(results: list[dict], config: BenchConfig) -> list[dict]:
    """The λ sweep: per rule and λ, mean final accuracy and SE over seeds."""
    finals = _finals([r for r in results if r["study"] == "lambda"])
    rows = []
    for rule in AGGREGATION_RULES:
        for lam in config.lambdas:
            label = fedara_label(rule, lam)
            values = [v for (_, _, a), by_seed in finals.items() if a == label for v in by_seed.values()]
            if values:
                rows.append(dict(rule=rule, lam=lam, seeds=len(values), mean=float(np.mean(values)),
                                 se=standard_error(values)))
    return rows


def curves(results: list[dict], studies: Iterable[str] = ("headline", "partition")
           ) -> dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """'study: setting' -> algorithm -> (mean, SE) accuracy per round over seeds, for ``studies``."""
    out: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    for (study, setting, algorithm), runs in _groups(results).items():
        if study not in studies:
            continue
        acc = np.array([[rec["accuracy"] for rec in r["rounds"]] for r in runs])
        se = acc.std(axis=0, ddof=1) / math.sqrt(len(runs)) if len(runs) > 1 else np.zeros(acc.shape[1])
        out.setdefault(f"{study}: {setting}", {})[algorithm] = (acc.mean(axis=0), se)
    return out


def ahead_from(mean_difference: Sequence[float]) -> int | None:
    """The first round (1-based) from which the mean paired difference stays above 0 to the last round; None
    when it is not ahead at the last round."""
    first = None
    for t, d in enumerate(mean_difference, start=1):
        if d > 0:
            first = first or t
        else:
            first = None
    return first


def _accuracy_per_round(run: dict) -> np.ndarray:
    return np.array([rec["accuracy"] for rec in run["rounds"]], dtype=float)


def curve_differences(results: list[dict], pairs: list[Pair]) -> list[dict]:
    """Each curves-study pair: the final paired difference (mean, SE, seeds ahead), the mean paired difference
    after every round and the round from which the first stays ahead (``ahead_from``)."""
    per_seed = _per_seed((r for r in results if r["study"] == "curves"), _accuracy_per_round)
    rows = []
    for p in pairs:
        first, second = per_seed.get((p.study, p.setting, p.first)), per_seed.get((p.study, p.setting, p.second))
        if p.study != "curves" or not first or not second:
            continue
        seeds = sorted(set(first) & set(second))
        diffs = np.array([first[s] - second[s] for s in seeds])
        mean = diffs.mean(axis=0)
        final = paired({s: first[s][-1] for s in seeds}, {s: second[s][-1] for s in seeds})
        rows.append(dict(asdict(p), **final, rounds=len(mean), per_round=[float(v) for v in mean],
                         ahead_from=ahead_from(mean)))
    return rows


# -- report --------------------------------------------------------------------------------------------------


def _pct(mean: float, se: float) -> str:
    return f"{100 * mean:.2f} ± {100 * se:.2f}"


def results_table(rows: list[dict]) -> str:
    """The markdown table of ``summarize``'s rows (accuracies in %)."""
    lines = ["| setting | algorithm | seeds | final accuracy % (mean ± SE) | best accuracy % | std over clients % "
             "| MB per round (down+up) | s per round |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['algorithm']} | {r['seeds']} | {_pct(r['final_mean'], r['final_se'])} "
                     f"| {_pct(r['best_mean'], r['best_se'])} | {100 * r['client_std']:.2f} "
                     f"| {r['bytes_per_round'] / MB:.1f} | {r['seconds_per_round']:.2f} |")
    return "\n".join(lines)


def _diff(d: dict) -> str:
    return f"{100 * d['mean']:+.2f} ± {100 * d['se']:.2f}"


def differences_table(rows: list[dict]) -> str:
    """The markdown table of ``paired_differences`` (percentage points)."""
    lines = ["| setting | difference | Δ final accuracy, pp (paired mean ± SE) | seeds where the first is ahead |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['first']} − {r['second']} | {_diff(r)} | {r['ahead']}/{r['seeds']} |")
    return "\n".join(lines)


def tier_table(rows: list[dict]) -> str:
    """Per-tier final accuracy % (mean ± SE); the local row's tier columns are CNN1..CNN5 on the same devices."""
    header = " | ".join(f"tier {t} (local: CNN{i + 1})" for i, t in enumerate(RANK_TIERS))
    lines = [f"| setting | algorithm | seeds | {header} |", "|---|---|---|" + "---|" * len(RANK_TIERS)]
    for r in rows:
        cols = " | ".join(_pct(*r["tiers"][t]) if t in r["tiers"] else "–" for t in RANK_TIERS)
        lines.append(f"| {r['setting']} | {r['algorithm']} | {r['seeds']} | {cols} |")
    return "\n".join(lines)


def tier_differences_table(rows: list[dict]) -> str:
    """Each pair tier by tier: paired mean ± SE in pp and the seeds where the first is ahead."""
    lines = ["| setting | difference | " + " | ".join(f"tier {t}" for t in RANK_TIERS) + " |",
             "|---|---|" + "---|" * len(RANK_TIERS)]
    for r in rows:
        cols = " | ".join(f"{_diff(r['tiers'][t])} ({r['tiers'][t]['ahead']}/{r['tiers'][t]['seeds']})"
                          if t in r["tiers"] else "–" for t in RANK_TIERS)
        lines.append(f"| {r['setting']} | {r['first']} − {r['second']} | {cols} |")
    return "\n".join(lines)


def lambda_table(rows: list[dict], differences: list[dict]) -> str:
    """λ rows: each rule's mean ± SE, updates − weights and each rule against its λ = 0, paired."""
    by = {(r["rule"], r["lam"]): r for r in rows}
    diff = {(d["first"], d["second"]): d for d in differences if d["study"] == "lambda"}

    def paired_cell(first: str, second: str) -> str:
        d = diff.get((first, second))
        return f"{_diff(d)} ({d['ahead']}/{d['seeds']})" if d else "–"

    lines = ["| λ | weights % | updates % | updates − weights, pp | weights − its λ=0, pp | updates − its λ=0, pp |",
             "|---|---|---|---|---|---|"]
    for lam in sorted({r["lam"] for r in rows}):
        cols = [_pct(by[(rule, lam)]["mean"], by[(rule, lam)]["se"]) if (rule, lam) in by else "–"
                for rule in ("weights", "updates")]
        lines.append(f"| {lam:g} | {cols[0]} | {cols[1]} "
                     f"| {paired_cell(fedara_label('updates', lam), fedara_label('weights', lam))} "
                     f"| {paired_cell(fedara_label('weights', lam), fedara_label('weights', 0))} "
                     f"| {paired_cell(fedara_label('updates', lam), fedara_label('updates', 0))} |")
    return "\n".join(lines)


def curves_table(rows: list[dict]) -> str:
    """The curves study: per setting and pair, the final paired difference and where the first pulls ahead."""
    lines = ["| setting | difference | Δ final accuracy, pp (paired mean ± SE) | seeds where the first is ahead "
             "| first ahead from round (mean paired Δ > 0 to the end) |", "|---|---|---|---|---|"]
    for r in rows:
        since = f"round {r['ahead_from']}" if r["ahead_from"] else f"never within {r['rounds']} rounds"
        lines.append(f"| {r['setting']} | {r['first']} − {r['second']} | {_diff(r)} | {r['ahead']}/{r['seeds']} "
                     f"| {since} |")
    return "\n".join(lines)


def config_table(config: BenchConfig) -> str:
    """The config as a table (the curves study's fields only where it runs)."""
    lines = ["| parameter | value |", "|---|---|"]
    for key, value in config.to_dict().items():
        if key in ("sizes", "curve_seeds", "curve_rounds", "curve_algorithms") and "curves" not in config.studies:
            continue
        shown = ", ".join(f"{v:g}" if isinstance(v, (int, float)) else str(v) for v in value) \
            if isinstance(value, (tuple, list)) else ("all" if value is None else value)
        lines.append(f"| {key} | {shown} |")
    return "\n".join(lines)


def class_label(command: str) -> str:
    """A cost class in a few words: the algorithm, model and rank flags of its sample command."""
    argv = shlex.split(command)
    keep = ("--algo", "--model", "--rank-ratio", "--rank-tiers")
    return " ".join(f"{flag} {argv[argv.index(flag) + 1]}" for flag in keep if flag in argv)


def estimate_section(estimate: dict | None) -> list[str]:
    """The measured run-time estimate (``--estimate``), when one lies beside the report."""
    if not estimate:
        return []
    config = estimate["config"]
    lines = ["## Expected run time (measured on a sample)", "",
             f"Command: `{estimate['command']}`. The first run of each cost class ran {estimate['sample_rounds']} "
             "round(s); the last is the per-round cost, the rest of its wall time the setup; core time is wall time "
             "× the sample's CPU time / wall time (the machine was shared: load average "
             f"{estimate['load_average']} at the end; {estimate['machine']}).", "",
             "| cost class | runs | setup s | s per round (wall) | share of a core | expected core-min |",
             "|---|---|---|---|---|---|"]
    for c in estimate["classes"]:
        lines.append(f"| `{class_label(c['sample_command'])}` | {c['runs']} | {c['setup_s']:.1f} | {c['round_s']:.1f} "
                     f"| {c['cpu_share']:.0%} | {c['expected_core_s'] / 60:.1f} |")
    lines += ["", f"Expected: {estimate['total_core_s'] / 3600:.1f} core-hours for {estimate['runs']} runs of "
                  f"{config['rounds']} rounds × {config['local_epochs']} epoch(s), "
                  f"{estimate['total_core_s'] / config['jobs'] / 3600:.1f} h on {config['jobs']} job(s) with a core "
                  f"each (sampled in {estimate['wall_s'] / 60:.1f} min).", ""]
    return lines


def markdown_report(config: BenchConfig, command: str, results: list[dict], pairs: list[Pair], wall_s: float,
                    analysis: str, runs: int, estimate: dict | None = None, lead: str = "") -> str:
    """accuracy.md: ``lead`` (kept from the last version), command, config, each study's tables, the estimate,
    example commands, then ``analysis``."""
    differences = paired_differences(results, pairs)
    rows = summarize(results)
    planned = len(bench_plan(config).unique())
    examples: dict[str, str] = {}
    for r in results:
        examples.setdefault(r["command"].replace(f"--seed {r['seed']}", "--seed SEED"),
                            f"{r['setting'].split()[0]} {r['algorithm']}")
    parts = [
        f"# Accuracy benchmark: FedARA vs baselines on {config.dataset}", "",
        *([lead, ""] if lead else []),
        "Generated by `scripts/bench_accuracy.py`. Command:", "", "```", command, "```", "",
        *([f"**Incomplete: {runs} of the {planned} planned runs** (an interrupted benchmark; the tables pair the "
             "seeds both sides of a comparison hold).", ""] if runs < planned else []),
        f"Wall time: {wall_s / 60:.1f} min ({runs} runs, {config.jobs} job(s) × {config.threads} thread(s), "
        f"{platform.machine()}, torch {torch.__version__}). A seed is a partition and an initial model; every "
        "algorithm of one (setting, seed) sees the same ones. ± is the standard error over seeds (sample std / √n); "
        "paired differences are taken seed by seed.", "",
        "## Config", "", config_table(config), "",
    ]
    for study in config.studies:
        study_rows = [r for r in rows if r["study"] == study]
        study_diffs = [d for d in differences if d["study"] == study]
        study_results = [r for r in results if r["study"] == study]
        if not study_rows:
            continue
        parts += [f"## Study: {study}", ""]
        if study == "curves":
            parts += [f"{config.curve_rounds} rounds × {config.local_epochs} local epoch(s) per run, the paper's λ "
                      f"warm-up ({DEFAULT_LAM_WARMUP} rounds), λ {config.lam_heterogeneous:g} heterogeneous and "
                      f"{config.lam:g} homogeneous, seeds {', '.join(map(str, config.curve_seeds))}; 'N samples/client' "
                      "is the average share of a seeded subset of N × clients samples, split 75/25 into train/test "
                      "(the config's rounds, seeds, max_samples and lam_warmup are the other studies').", "",
                      "### Final accuracy", "", results_table(study_rows), "",
                      "### Paired differences over the rounds", "",
                      curves_table(curve_differences(study_results, [p for p in pairs if p.study == study])), "",
                      f"![accuracy after every round, ± SE over seeds]({CURVES_PLOT_NAME})", ""]
            continue
        if study == "lambda":
            parts += ["Final accuracy vs λ (heterogeneous, 5 tiers), mean ± SE over seeds; paired columns give the "
                      "seeds where the first is ahead.", "", lambda_table(lambda_rows(results, config), study_diffs),
                      "", f"![final accuracy vs λ]({LAMBDA_PLOT_NAME})", ""]
            continue
        parts += ["### Final accuracy", "", results_table(study_rows), "",
                  "### Paired differences", "", differences_table(study_diffs), ""]
        tiers = tier_rows(study_results)
        if tiers:
            parts += ["### Per tier (final accuracy of each tier's devices)", "", tier_table(tiers), "",
                      tier_differences_table(tier_differences(study_results, [p for p in pairs if p.study == study])),
                      ""]
    parts += [
        "Accuracy is Σ correct / Σ test samples over every client's local test split, each client with its own "
        "personalized model (FedAvg: the global model); 'std over clients' is the spread of the clients' own "
        "accuracies at the final round, averaged over seeds.", "",
        *([f"![accuracy vs round]({PLOT_NAME})", ""] if {"headline", "partition"} & set(config.studies) else []),
        *estimate_section(estimate),
        "## The runs (SEED: each seed of the table; the JSON keeps every run's command)", "",
        *[f"- {label}: `{cmd}`" for cmd, label in examples.items()],
        "",
        ANALYSIS_MARKER,
    ]
    return "\n".join(parts) + "\n" + analysis


def kept_lead(previous: str | None) -> str:
    """The hand-written lead of an earlier accuracy.md (LEAD_START .. LEAD_END, markers included), or nothing."""
    if not previous or LEAD_START not in previous or LEAD_END not in previous:
        return ""
    return LEAD_START + previous.split(LEAD_START, 1)[1].split(LEAD_END, 1)[0] + LEAD_END


def kept_analysis(previous: str | None) -> str:
    """The hand-written part of an earlier accuracy.md (everything after ANALYSIS_MARKER), or nothing."""
    if not previous or ANALYSIS_MARKER not in previous:
        return ""
    return previous.split(ANALYSIS_MARKER, 1)[1].lstrip("\n")


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot(curve_data: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]], path: Path) -> None:
    """Mean accuracy vs round (band: ± SE over seeds), one panel per setting."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    settings = list(curve_data)
    cols = min(2, len(settings))
    rows = math.ceil(len(settings) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 4.2 * rows), squeeze=False)
    for ax, setting in zip(axes.flat, settings):
        for algorithm, (mean, se) in curve_data[setting].items():
            x = np.arange(1, len(mean) + 1)
            (line,) = ax.plot(x, 100 * mean, label=algorithm, linewidth=1.6)
            ax.fill_between(x, 100 * (mean - se), 100 * (mean + se), color=line.get_color(), alpha=0.15)
        ax.set_title(setting, fontsize=10)
        ax.set_xlabel("round")
        ax.set_ylabel("mean client accuracy %")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    for ax in list(axes.flat)[len(settings):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_lambda(rows: list[dict], path: Path) -> None:
    """Final accuracy vs λ, one line per rule, error bars ± SE over seeds; symlog x so that λ = 0 sits at the
    left on a linear stretch and 0.1..20 spread evenly."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for rule in AGGREGATION_RULES:
        mine = sorted((r for r in rows if r["rule"] == rule), key=lambda r: r["lam"])
        if mine:
            ax.errorbar([r["lam"] for r in mine], [100 * r["mean"] for r in mine], yerr=[100 * r["se"] for r in mine],
                        marker="o", capsize=3, label=f"--aggregate {rule}")
    lambdas = sorted({r["lam"] for r in rows})
    positive = [lam for lam in lambdas if lam > 0]
    ax.set_xscale("symlog", linthresh=min(positive) if positive else 1.0, linscale=0.5)
    ax.set_xticks(lambdas)
    ax.set_xticklabels([f"{lam:g}" for lam in lambdas])
    ax.set_xlabel("λ (anchor-loss weight; symlog axis)")
    ax.set_ylabel("final mean client accuracy %")
    seeds = max((r["seeds"] for r in rows), default=0)
    ax.set_title(f"heterogeneous FedARA (5 tiers), ± SE over {seeds} seed(s)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- command line --------------------------------------------------------------------------------------------


def _list(convert: Callable[[str], object], what: str) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        try:
            return tuple(convert(part) for part in text.split(","))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"want comma-separated {what}, got {text!r}") from exc
    return parse


def _studies(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(","))
    unknown = [n for n in names if n not in STUDIES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown study {', '.join(unknown)}; choose from {','.join(STUDIES)}")
    return names


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"want a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    preset = p.add_mutually_exclusive_group()
    preset.add_argument("--preset", choices=tuple(PRESETS), default="reduced",
                        help="reduced: 10 clients, 10 rounds × 1 epoch, 2000 samples, lr 0.05 (≤ 70 core-min here); "
                             "paper: 20 clients, 100 rounds × 5 epochs, full data, lr 5e-3")
    preset.add_argument("--quick", action="store_const", const="quick", dest="preset",
                        help="the quick preset: digits, 5 clients, 2 rounds, one seed (checks the script)")
    p.add_argument("--study", type=_studies, dest="studies", help=f"comma-separated subset of {','.join(STUDIES)}")
    p.add_argument("--seeds", type=_list(int, "integers"), help="headline seeds (reduced: 0..9)")
    p.add_argument("--study-seeds", type=_list(int, "integers"), help="λ and partition study seeds (reduced: 0,1,2)")
    p.add_argument("--lambdas", type=_list(float, "numbers"), help="the λ sweep (default the paper's 0..20)")
    p.add_argument("--rounds", type=_positive)
    p.add_argument("--max-samples", type=_positive, help="seeded subset of the dataset")
    p.add_argument("--local-epochs", type=_positive)
    p.add_argument("--lr", type=float)
    p.add_argument("--dataset", choices=DATASETS)
    p.add_argument("--clients", type=_positive)
    p.add_argument("--sizes", type=_list(_positive, "positive integers"),
                   help="curves study: samples per client, on average (default 100,200,600)")
    p.add_argument("--curve-seeds", type=_list(int, "integers"), help="curves study seeds (default 0..4)")
    p.add_argument("--curve-rounds", type=_positive, help="curves study rounds (default 40; paper: 100)")
    p.add_argument("--curve-algorithms", type=_list(str, "labels"),
                   help="curves study: only these rows, e.g. 'FedARA updates,Local CNN1..5,FedARA,Local' (default all)")
    p.add_argument("--model", action="append", dest="models", metavar="SPEC",
                   help="models study: a model of yours (PATH.py:FUNCTION or MODULE:FUNCTION); repeat for more")
    p.add_argument("--keep-runs", action="store_true",
                   help="reuse the runs of OUT_DIR/accuracy.json that this benchmark plans (finish an interrupted one)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the PyTorch runs train (server.simulate --device); auto: cuda when torch sees one")
    p.add_argument("--threads", type=_positive, help="torch threads per run (default 1)")
    p.add_argument("--jobs", type=_positive, help="parallel worker processes (default 2; --quick: 1)")
    add_ray_flags(p)
    p.add_argument("--out-dir", type=Path, default=Path("docs/results/accuracy"))
    p.add_argument("--verbose", action="store_true", help="print every round (with --jobs 1)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--render-only", action="store_true",
                      help="rewrite accuracy.md and the plots from OUT_DIR/accuracy.json without running")
    p.add_argument("--partial", action="store_true",
                   help="with --render-only: report the runs an interrupted benchmark's JSON holds")
    mode.add_argument("--estimate", action="store_true",
                      help="run --estimate-rounds rounds of one run per cost class and write the expected total "
                           f"to OUT_DIR/{ESTIMATE_NAME} instead of running the benchmark")
    p.add_argument("--estimate-rounds", type=_positive, default=2,
                   help="rounds per --estimate sample (the last one is timed; 1 where a round takes minutes)")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The preset's config, with every option given on the command line replacing its value."""
    fields = ("studies", "seeds", "study_seeds", "lambdas", "rounds", "max_samples", "local_epochs", "lr", "dataset",
              "clients", "threads", "jobs", "sizes", "curve_seeds", "curve_rounds", "curve_algorithms")
    overrides = {name: getattr(args, name) for name in fields if getattr(args, name) is not None}
    if args.models:
        overrides["models"] = tuple(args.models)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available() and args.ray is None:  # --ray: the nodes' GPUs
        raise ValueError("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); "
                         "use --device cpu or auto")
    config = replace(PRESETS[args.preset], device=device, **overrides)
    if ("models" in config.studies) != bool(config.models):
        raise ValueError("--study models needs --model SPEC (e.g. --model examples/dscnn.py:build), and --model "
                         "is read by the models study only")
    check_ray_args(args)
    if args.ray is not None and args.jobs is not None:
        raise ValueError(f"--ray runs as many runs at once as the cluster holds: leave out --jobs {args.jobs}")
    if config.lr <= 0:
        raise ValueError(f"--lr must be positive, got {config.lr:g}")
    if min(config.lambdas) < 0:
        raise ValueError(f"--lambdas must be ≥ 0, got {','.join(f'{v:g}' for v in config.lambdas)}")
    return config


def config_from_json(saved: dict) -> BenchConfig:
    """The BenchConfig that ``BenchConfig.to_dict`` wrote (lists back to tuples, the derived warm-up dropped)."""
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k != "lam_warmup"}
    return BenchConfig(**fields)


def write_json(path: Path, config: BenchConfig, command: str, plan: BenchPlan, runs: list[dict], complete: bool,
               wall_s: float, failed: Sequence[Failure] = ()) -> None:
    """Every run once (its command, records, test sizes) and the cells that read it; the runs that failed."""
    document = dict(command=command, config=config.to_dict(), complete=complete, wall_s=wall_s,
                    failed=[asdict(f) for f in failed],
                    machine=dict(platform=platform.platform(), torch=torch.__version__),
                    summary=summarize(cells(plan, runs)),
                    cells=[dict(study=s.study, setting=s.setting, algorithm=s.algorithm, seed=s.seed, command=s.command)
                           for s in plan.specs],
                    runs=runs)
    path.write_text(json.dumps(document, indent=1, ensure_ascii=False))


def write_reports(out_dir: Path, config: BenchConfig, command: str, plan: BenchPlan, runs: list[dict],
                  wall_s: float) -> None:
    """accuracy.md (keeping its hand-written analysis) and the plots from finished runs."""
    results = cells(plan, runs)
    md_path = out_dir / MARKDOWN_NAME
    previous = md_path.read_text() if md_path.exists() else None
    estimate_path = out_dir / ESTIMATE_NAME
    estimate = json.loads(estimate_path.read_text()) if estimate_path.is_file() else None
    md_path.write_text(markdown_report(config, command, results, plan.pairs, wall_s, kept_analysis(previous),
                                       len(runs), estimate, kept_lead(previous)))
    written = [md_path]
    for studies, name in ((("headline", "partition"), PLOT_NAME), (("curves",), CURVES_PLOT_NAME)):
        data = curves(results, studies)
        if data:
            plot(data, out_dir / name)
            written.append(out_dir / name)
    lam_rows = lambda_rows(results, config)
    if lam_rows:
        plot_lambda(lam_rows, out_dir / LAMBDA_PLOT_NAME)
        written.append(out_dir / LAMBDA_PLOT_NAME)
    print(f"wrote {out_dir / JSON_NAME}, {', '.join(map(str, written))} ({wall_s / 60:.1f} min of runs)", flush=True)


def render_from_json(out_dir: Path, partial: bool = False) -> int:
    """Rewrite the markdown and the plots from a complete accuracy.json (or, with ``partial``, from the runs an
    interrupted one holds: the report says how many of the planned runs it has), without running anything."""
    path = out_dir / JSON_NAME
    if not path.is_file():
        print(f"error: --render-only needs {path}, which does not exist; run the benchmark first", file=sys.stderr)
        return 2
    document = json.loads(path.read_text())
    if not document.get("complete") and not partial:
        print(f"error: {path} holds an unfinished benchmark; rerun it with --keep-runs, or report what it holds "
              "with --render-only --partial", file=sys.stderr)
        return 2
    config = config_from_json(document["config"])
    write_reports(out_dir, config, document["command"], bench_plan(config), document["runs"], document["wall_s"])
    return 0


def cost_class(argv: tuple[str, ...]) -> tuple[str, ...]:
    """The arguments that set a run's cost: argv without COST_NEUTRAL_FLAGS and their values."""
    kept, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token in COST_NEUTRAL_FLAGS:
            skip = True
        else:
            kept.append(token)
    return tuple(kept)


def with_rounds(argv: tuple[str, ...], rounds: int) -> tuple[str, ...]:
    out = list(argv)
    out[out.index("--rounds") + 1] = str(rounds)
    return tuple(out)


def estimate(config: BenchConfig, command: str, out_dir: Path, sample_rounds: int) -> dict:
    """Run the first run of each cost class for ``sample_rounds`` rounds and project the benchmark: Σ over runs
    of setup + rounds × seconds per round.

    The last sampled round is the per-round cost (round 1 also builds every plan's factorization, seconds that
    do not repeat); setup is the rest of the sample's wall time (data, plans, the final evaluation). Wall time
    depends on what else the machine runs, so the projection is also given in core time: scaled by the
    sample's CPU time / wall time (its share of a core; one torch thread per run)."""
    unique = bench_plan(config).unique()
    classes: dict[tuple[str, ...], list[RunSpec]] = {}
    for spec in unique:
        classes.setdefault(cost_class(spec.argv), []).append(spec)
    torch.set_num_threads(config.threads)
    start = time.perf_counter()
    measured = []
    for members in classes.values():
        result = execute(with_rounds(members[0].argv, sample_rounds))
        round_s = result["rounds"][-1]["seconds"]
        setup_s = result["wall_s"] - sample_rounds * round_s
        cpu_share = result["cpu_s"] / result["wall_s"]
        expected = len(members) * (setup_s + config.rounds * round_s)
        measured.append(dict(sample_command=result["command"], runs=len(members), setup_s=setup_s, round_s=round_s,
                             cpu_share=cpu_share, expected_s=expected, expected_core_s=expected * cpu_share))
        print(f"{len(members):3d} runs like `{result['command']}`: setup {setup_s:.1f} s, {round_s:.1f} s per round "
              f"at {cpu_share:.0%} of a core -> {expected * cpu_share / 60:.1f} core-min", flush=True)
    total_core = sum(c["expected_core_s"] for c in measured)
    document = dict(command=command, config=config.to_dict(), runs=len(unique), sample_rounds=sample_rounds,
                    classes=measured, total_core_s=total_core, total_wall_s=sum(c["expected_s"] for c in measured),
                    wall_s=time.perf_counter() - start, load_average=" ".join(f"{v:.1f}" for v in os.getloadavg()),
                    machine=f"{platform.machine()}, torch {torch.__version__}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / ESTIMATE_NAME).write_text(json.dumps(document, indent=1, ensure_ascii=False))
    print(f"expected: {total_core / 3600:.2f} core-hours for {len(unique)} runs, {total_core / config.jobs / 3600:.2f} h "
          f"on {config.jobs} job(s) with a core each; {document['total_wall_s'] / config.jobs / 3600:.2f} h of wall "
          f"time at the samples' speed on {config.device} ({config.jobs} job(s)); wrote {out_dir / ESTIMATE_NAME}",
          flush=True)
    return document


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.render_only:
        return render_from_json(args.out_dir, args.partial)
    command = shlex.join([".venv/bin/python", "scripts/bench_accuracy.py", *argv])
    if args.estimate:
        estimate(config, command, args.out_dir, args.estimate_rounds)
        return 0
    if args.preset == "paper":  # days on a CPU, hours on a GPU: say which before starting
        estimate(config, command, args.out_dir, sample_rounds=1)
    plan = bench_plan(config)
    unique = plan.unique()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / JSON_NAME
    print(f"{len(unique)} runs ({len(plan.specs)} cells); config {config.to_dict()}", flush=True)
    label = {s.command: s for s in reversed(plan.specs)}
    done: list[dict] = []
    earlier_s = 0.0
    if args.keep_runs and json_path.is_file():
        saved = json.loads(json_path.read_text())
        done = [run for run in saved["runs"] if run["command"] in label]
        earlier_s = saved["wall_s"] if done else 0.0
        print(f"kept {len(done)} run(s) of {json_path} ({earlier_s / 60:.1f} min)", flush=True)
    kept = {run["command"] for run in done}
    unique = [s for s in unique if s.command not in kept]
    start = time.perf_counter() - earlier_s

    def on_result(result: dict) -> None:
        done.append(result)
        elapsed = time.perf_counter() - start
        spec = label[result["command"]]
        print(f"[{len(done)}/{len(unique) + len(kept)}] {spec.setting} | {spec.algorithm} | seed {spec.seed}: "
              f"final {100 * result['final_accuracy']:.2f}%  best {100 * result['best_accuracy']:.2f}%  "
              f"({result['wall_s']:.0f} s; {elapsed / 60:.1f} min elapsed)", flush=True)
        write_json(json_path, config, command, plan, done, complete=False, wall_s=elapsed)

    earlier = list(done)
    sweep = run_all([s.argv for s in unique], config.threads, config.jobs, on_result, args.verbose, args.ray,
                    args.ray_gpus if config.device == "cuda" else 0.0)
    runs = earlier + sweep.finished
    wall_s = time.perf_counter() - start
    if sweep.failures:  # the finished runs are kept: --keep-runs reruns only the failed ones
        write_json(json_path, config, command, plan, runs, complete=False, wall_s=wall_s, failed=sweep.failures)
        print("\n".join(failure_lines(sweep.failures)), file=sys.stderr, flush=True)
        print(f"{len(sweep.failures)} of {len(unique)} runs failed; {json_path} holds the others (rerun with "
              "--keep-runs, or --render-only --partial)", file=sys.stderr, flush=True)
        return 1
    write_json(json_path, config, command, plan, runs, complete=True, wall_s=wall_s)
    write_reports(args.out_dir, config, command, plan, runs, wall_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
