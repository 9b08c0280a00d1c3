"""A round engine driven directly for tests (no transport, explicit ``now``): one built fresh, a device joined
through it, and a device's answer to its task."""
from __future__ import annotations

import numpy as np
import torch

from device_runtime.artifact_contract import PORTABLE_KIND
from device_runtime.messages import Join, ShardInfo, update_message
from device_runtime.profile import ResourceProfile
from device_runtime.task import Update
from fedcore.models import build_model
from server.engine.coordinator import Coordinator, CoordinatorConfig
from server.engine.round_engine import RoundEngine, algorithm_for
from server.engine.run_config import DpSettings, FederationConfig
from server.run_setup import PlanBook, global_state, initial_personal

SHAPE = (1, 28, 28)
CLASSES = 10
PROFILE = ResourceProfile(None, 1, 1, "x86_64", "Linux", None, 1.0)
RUN = "run0"


def make_engine(algo: str = "fedara", *, tiers=(1.0,), predictor=None, min_completion: float = 0.5,
                rounds: int = 3, join_ratio: float = 1.0, remote: bool = False,
                privacy: DpSettings | None = None) -> RoundEngine:
    torch.manual_seed(0)
    model = build_model("fedavgcnn", SHAPE, CLASSES, seed=0)
    config = FederationConfig(algo=algo, rounds=rounds, local_epochs=2, join_ratio=join_ratio)
    algorithm = algorithm_for(config)
    coordinator = Coordinator(CoordinatorConfig(SHAPE, CLASSES, join_ratio=join_ratio, round_deadline_s=10.0,
                                                min_completion=min_completion), RUN)
    return RoundEngine(algorithm, config, coordinator, PlanBook(model, SHAPE, None, onnx=False),
                       global_state(model, algorithm), initial_personal([model], algorithm), tiers=tiers,
                       predictor=predictor, remote=remote, privacy=privacy)


def join(engine: RoundEngine, device_id: str, num_train: int = 50, budget: float | None = None,
         runtime: str = PORTABLE_KIND):
    profile = ResourceProfile(budget, 1, 1, "x86_64", "Linux", None, 1.0, runtime=runtime)
    admission = engine.join(device_id, Join(profile, ShardInfo(num_train, 10, SHAPE, CLASSES), ()))
    assert admission.refusal is None
    assert engine.acknowledge(device_id, admission.plan.plan_hash) is None
    return admission.plan


def answer(engine: RoundEngine, device_id: str, task, num_train: int = 50, scale: float = 1.0, now: float = 1.0,
           baseline: dict | None = None):
    weights = {k: v * np.float32(scale) for k, v in task.weights.items()}
    if task.returns == "none" or task.evaluate_only:
        weights = {}
    elif task.returns == "all":
        weights.update(engine._initial(device_id))
    update = Update(task.round, weights, 0 if task.evaluate_only else num_train, 1.0, 0.5,
                    {"eval_correct": 5, "eval_total": 10, "eval_loss": 1.0, **(baseline or {})})
    msg = update_message(update, plan_hash=engine.plan_info(device_id).hash, device_id=device_id, run_id=RUN)
    return engine.receive(device_id, msg, now)


def two_rounds_engine():
    """Two devices at two tiers: round 1 closes with both answers, round 2 is open with one answer in."""
    engine = make_engine(tiers=(1.0, 0.25), predictor=lambda profile, n: (lambda ratio: 100.0 * ratio))
    join(engine, "dev_000", budget=500.0)
    join(engine, "dev_001", budget=50.0)
    tasks = engine.open_round(1, 0.0)
    for device_id, task in tasks.items():
        assert answer(engine, device_id, task, now=1.0).accepted
    engine.close_round(2.0)
    tasks = engine.open_round(2, 3.0)
    assert answer(engine, "dev_000", tasks["dev_000"], now=4.0).accepted
    return engine
