"""In-process reference federation: ``python -m server.simulate``.

Runs FedARA (and the local / FedAvg / FedRep baselines) with every client in this process, no transport.
``--backend torch`` trains with the PyTorch reference; ``--backend ort`` with the device runtime's
onnxruntime trainer, so the two paths can be compared on the same seeds.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from device_runtime.shard import Shard
from device_runtime.task import Task, Update, tensor_bytes
from device_runtime.trainer import EvalResult
from server.data import DATASETS
from server.lowrank import RankPlan, ResolvedPlan, factorize_model, fe_state, resolve_plan
from server.models import MODELS, SplitModel, build_model
from server.objective import compute_anchors
from server.robust import NormBound, add_norm_bound_arguments, bound_updates, norm_bound_from_args
from server.shards import shards_from_args
from server.strategy import (FederationConfig, aggregate_fit, configure_fit, factorize_per_plan, plan_key,
                             sample_clients, to_numpy, to_torch, weighted_accuracy)
from server.training import evaluate, train_local

log = logging.getLogger("fedara.simulate")
BACKENDS = ("torch", "ort")
FEDREP_HEAD_EPOCHS = 1


@dataclass
class SimClient:
    """One simulated device: its shard, its rank plan and its personal model (the head persists here)."""

    cid: str
    index: int
    shard: Shard
    plan: ResolvedPlan
    model: SplitModel  # the client's personal model (factorized at its plan); its head persists here
    template: SplitModel  # the dense architecture it was factorized from (shared, never trained)


def load_tensors(model: torch.nn.Module, tensors: dict[str, np.ndarray]) -> None:
    """Write named tensors into ``model``; a name or shape it does not have is an error."""
    state = model.state_dict()
    for name, value in tensors.items():
        if name not in state:
            raise KeyError(f"model has no tensor {name!r}")
        if tuple(state[name].shape) != tuple(value.shape):
            raise ValueError(f"{name}: shape {tuple(value.shape)} != model's {tuple(state[name].shape)}")
    model.load_state_dict(to_torch(tensors), strict=False)


def shared_state(model: torch.nn.Module, algo: str) -> dict[str, torch.Tensor]:
    """What the server aggregates: the whole model for FedAvg, the FE otherwise."""
    if algo == "fedavg":
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return fe_state(model)


class TorchBackend:
    """Local training with the PyTorch reference."""

    def fit(self, client: SimClient, task: Task, algo: str) -> Update:
        model, shard = client.model, client.shard
        load_tensors(model, task.fe)
        rng = np.random.default_rng(task.seed)
        anchors = mask = None
        if task.lam > 0:
            anchors, mask = compute_anchors(model.fe, shard.x_train, shard.y_train, shard.num_classes)
        common = dict(anchors=anchors, mask=mask, lam=task.lam, mu=task.mu, lr=task.lr, batch_size=task.batch_size, rng=rng)
        if algo == "fedrep":
            train_local(model, shard.x_train, shard.y_train, epochs=FEDREP_HEAD_EPOCHS,
                        params=list(model.head.parameters()), **common)
            stats = train_local(model, shard.x_train, shard.y_train, epochs=task.epochs,
                                params=list(model.fe.parameters()), **common)
        else:
            stats = train_local(model, shard.x_train, shard.y_train, epochs=task.epochs, **common)
        return Update(task.round, to_numpy(shared_state(model, algo)), stats.num_samples, stats.loss, stats.accuracy)

    def evaluate(self, client: SimClient, shared: dict[str, np.ndarray] | None) -> EvalResult:
        if shared is not None:
            load_tensors(client.model, shared)
        return evaluate(client.model, client.shard.x_test, client.shard.y_test)


def make_backend(name: str, clients: list[SimClient], cache_dir: Path, threads: int = 1):
    if name == "torch":
        return TorchBackend()
    from server.ort_backend import OrtBackend
    return OrtBackend(clients, cache_dir, threads)


def parse_tiers(text: str | None) -> list[float] | None:
    if not text:
        return None
    try:
        return [float(t) for t in text.split(",")]
    except ValueError as exc:
        raise ValueError(f"--rank-tiers wants comma-separated ratios, got {text!r}") from exc


def build_clients(shards: list[Shard], model_names: list[str], input_shape: tuple[int, int, int], algo: str,
                  rank_ratio: float, tiers: list[float] | None, seed: int) -> tuple[list[SimClient], SplitModel]:
    """Clients with round-robin models/tiers; every client starts from the same initial model."""
    if len(set(model_names)) > 1 and algo != "local":
        raise ValueError("different models per client (--model a,b,..) only make sense with --algo local")
    num_classes = shards[0].num_classes
    templates = {name: build_model(name, input_shape, num_classes, seed=seed) for name in model_names}
    global_model = templates[model_names[0]]
    clients, factorized = [], {}
    for i, shard in enumerate(shards):
        name = model_names[i % len(model_names)]
        ratio = tiers[i % len(tiers)] if tiers else rank_ratio
        plan = resolve_plan(templates[name], RankPlan(ratio)) if algo == "fedara" else ResolvedPlan({})
        key = (name, plan_key(plan))
        if key not in factorized:
            factorized[key] = factorize_model(templates[name], plan.ranks)
        clients.append(SimClient(f"client_{i:03d}", i, shard, plan, copy.deepcopy(factorized[key]), templates[name]))
    return clients, global_model


def run_federation(clients: list[SimClient], global_model: SplitModel, config: FederationConfig, backend,
                   progress=print, norm_bound: NormBound | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """Run ``config.rounds`` rounds; returns the per-round summary and the final global (shared) state.

    With ``norm_bound`` only the updates it lets through (clipped where it clips) are aggregated; a round
    where it refuses every update keeps the global state."""
    algo = config.algo
    global_state = {} if algo == "local" else shared_state(global_model, algo)
    dense_shapes = {k: tuple(v.shape) for k, v in global_state.items()}
    ids = [c.cid for c in clients]
    by_id = {c.cid: c for c in clients}
    rounds = []
    plans = [c.plan for c in clients]
    per_plan = factorize_per_plan(global_state, plans)
    for t in range(1, config.rounds + 1):
        start = time.perf_counter()
        selected = sample_clients(ids, config.join_ratio, t, config.seed)
        updates, bytes_down, bytes_up = [], 0, 0
        for cid in selected:
            client = by_id[cid]
            task = configure_fit(per_plan[plan_key(client.plan)], bool(client.plan.ranks), config, t, client.index)
            update = backend.fit(client, task, algo)
            bytes_down += tensor_bytes(task.fe)
            if algo != "local":
                bytes_up += tensor_bytes(update.fe)
            updates.append(update)
        if algo != "local":
            counted = bound_updates(updates, global_state, norm_bound)
            global_state = aggregate_fit(counted, dense_shapes) if counted else global_state
            per_plan = factorize_per_plan(global_state, plans)
        evals = [backend.evaluate(c, None if algo == "local" else per_plan[plan_key(c.plan)]) for c in clients]
        accuracy, accuracy_std = weighted_accuracy([e.correct for e in evals], [e.total for e in evals])
        samples = sum(u.num_samples for u in updates)
        train_loss = sum(u.train_loss * u.num_samples for u in updates) / samples
        record = dict(round=t, accuracy=accuracy, accuracy_std=accuracy_std, train_loss=train_loss,
                      bytes_down=bytes_down, bytes_up=bytes_up, seconds=time.perf_counter() - start,
                      participants=len(selected))
        rounds.append(record)
        progress(f"[{algo}] round {t}/{config.rounds}  acc {accuracy:.4f} ±{accuracy_std:.4f}  "
                 f"loss {train_loss:.4f}  down {bytes_down / 1e6:.2f} MB  up {bytes_up / 1e6:.2f} MB  "
                 f"{record['seconds']:.1f}s")
    summary = dict(rounds=rounds, final_accuracy=rounds[-1]["accuracy"],
                   best_accuracy=max(r["accuracy"] for r in rounds))
    return summary, global_state


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m server.simulate", description=__doc__.splitlines()[0])
    p.add_argument("--dataset", choices=DATASETS, default="fmnist")
    p.add_argument("--data-dir", default=None, help="dataset folder (default: the dataset's standard place)")
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--partition", choices=("dirichlet", "pathological"), default="dirichlet")
    p.add_argument("--alpha", type=float, default=0.1, help="Dirichlet concentration")
    p.add_argument("--classes-per-client", type=int, default=2, help="pathological partition")
    p.add_argument("--min-samples", type=int, default=40, help="redraw the partition until every client has this many")
    p.add_argument("--model", default="fedavgcnn", help=f"one of {', '.join(MODELS)}, or a comma list (round-robin, --algo local)")
    p.add_argument("--algo", choices=("fedara", "fedavg", "fedrep", "local"), default="fedara")
    tiers = p.add_mutually_exclusive_group()
    tiers.add_argument("--rank-ratio", type=float, default=1.0, help="homogeneous rank ratio (1.0 = dense)")
    tiers.add_argument("--rank-tiers", default=None, help="heterogeneous: comma-separated ratios, assigned round-robin")
    d = FederationConfig()
    p.add_argument("--lam", type=float, default=d.lam, help="anchor-loss weight λ (paper: 10 homogeneous)")
    p.add_argument("--lam-warmup", type=int, default=d.lam_warmup)
    p.add_argument("--frob", type=float, default=d.mu, help="Frobenius decay μ on factorized layers")
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--local-epochs", type=int, default=d.local_epochs)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--join-ratio", type=float, default=d.join_ratio)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=1, help="compute threads (torch and onnxruntime)")
    p.add_argument("--backend", choices=BACKENDS, default="torch")
    p.add_argument("--max-samples", type=int, default=None, help="use a seeded subset of the dataset (quick runs)")
    p.add_argument("--cache-dir", default="artifacts_cache", help="ONNX artifact cache (--backend ort)")
    p.add_argument("--out", default=None, help="write the run's JSON here")
    add_norm_bound_arguments(p)
    return p


def config_from_args(args: argparse.Namespace) -> FederationConfig:
    return FederationConfig(algo=args.algo, rounds=args.rounds, lam=args.lam, lam_warmup=args.lam_warmup, mu=args.frob,
                            lr=args.lr, local_epochs=args.local_epochs, batch_size=args.batch_size,
                            join_ratio=args.join_ratio, seed=args.seed)


def prepare(args: argparse.Namespace) -> tuple[list[SimClient], SplitModel]:
    """Data, partition and clients for the parsed arguments."""
    shards = shards_from_args(args)
    return build_clients(shards, args.model.split(","), shards[0].input_shape, args.algo, args.rank_ratio,
                         parse_tiers(args.rank_tiers), args.seed)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is available", file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
        norm_bound = norm_bound_from_args(args)
        clients, global_model = prepare(args)
        if args.backend == "ort" and config.algo != "fedara":
            raise ValueError("--backend ort runs FedARA (the device runtime); baselines use --backend torch")
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    backend = make_backend(args.backend, clients, Path(args.cache_dir), args.threads)
    for client in clients:
        client.model.to(args.device)
    summary, _ = run_federation(clients, global_model, config, backend, norm_bound=norm_bound)
    document = dict(config=dict(vars(args)), **summary)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(document, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
