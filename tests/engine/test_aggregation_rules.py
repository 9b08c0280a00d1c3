"""--aggregate weights (the paper's) against updates: what each keeps of the global model."""
from __future__ import annotations

import numpy as np
import torch

from device_runtime.messages import Join, ShardInfo, update_message
from device_runtime.profile import ResourceProfile
from device_runtime.task import Update
from fedcore.models import build_model
from server.engine.coordinator import Coordinator, CoordinatorConfig
from server.engine.round_engine import RoundEngine, algorithm_for
from server.run_setup import PlanBook, global_state, initial_personal
from server.engine.run_config import FederationConfig

SHAPE, CLASSES, RUN = (1, 28, 28), 10, "run0"
FC = "fe.fc1.weight"  # 512×1024: rank 64 at ratio 0.125


def engine_for(rule: str, ratios: dict[str, float]) -> RoundEngine:
    model = build_model("fedavgcnn", SHAPE, CLASSES, seed=0)
    algorithm = algorithm_for(FederationConfig(aggregate=rule))
    coordinator = Coordinator(CoordinatorConfig(SHAPE, CLASSES, round_deadline_s=10.0), RUN)
    engine = RoundEngine(algorithm, FederationConfig(aggregate=rule), coordinator,
                         PlanBook(model, SHAPE, None, onnx=False), global_state(model, algorithm),
                         initial_personal([model], algorithm), tiers=tuple(sorted(set(ratios.values()), reverse=True)),
                         overrides=ratios)
    profile = ResourceProfile(None, 1, 1, "x86_64", "Linux", None, 1.0)
    for device_id in ratios:
        plan = engine.join(device_id, Join(profile, ShardInfo(50, 10, SHAPE, CLASSES), ())).plan
        engine.acknowledge(device_id, plan.plan_hash)
    return engine


def one_round(engine: RoundEngine, change: float = 0.0) -> dict[str, torch.Tensor]:
    """Every device sends back what it was sent, each tensor moved by ``change``; the new global model."""
    for device_id, task in engine.open_round(1, 0.0).items():
        weights = {k: v + np.float32(change) for k, v in task.weights.items()}
        update = Update(1, weights, 50, 1.0, 0.5, {"eval_correct": 1, "eval_total": 10, "eval_loss": 1.0})
        msg = update_message(update, plan_hash=engine.plan_info(device_id).hash, device_id=device_id, run_id=RUN)
        assert engine.receive(device_id, msg, 1.0).accepted
    engine.close_round(1.0)
    return engine.global_state


def energy_beyond(weight: torch.Tensor, rank: int) -> float:
    """Σ σ_i² over the singular values past ``rank``."""
    return float((torch.linalg.svdvals(weight.double())[rank:] ** 2).sum())


def test_with_one_dense_client_both_rules_give_the_same_model():
    a = one_round(engine_for("weights", {"dev_000": 1.0}), change=0.01)
    b = one_round(engine_for("updates", {"dev_000": 1.0}), change=0.01)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_dense_layers_aggregate_the_same_under_both_rules_with_tiers():
    tiers = {"dev_000": 1.0, "dev_001": 0.125}
    a = one_round(engine_for("weights", tiers), change=0.01)
    b = one_round(engine_for("updates", tiers), change=0.01)
    dense = [k for k in a if k.endswith(".bias") or k.startswith("fe.0.")]
    assert dense and all(torch.allclose(a[k], b[k], atol=1e-6) for k in dense)


def test_updates_keeps_the_energy_beyond_the_lowest_rank_and_weights_does_not():
    tiers = {"dev_000": 1.0, "dev_001": 0.125}
    before = energy_beyond(engine_for("weights", tiers).global_state[FC], 64)
    weights = energy_beyond(one_round(engine_for("weights", tiers))[FC], 64)
    updates = energy_beyond(one_round(engine_for("updates", tiers))[FC], 64)
    assert abs(updates - before) < 1e-6 * before  # an unchanged client changes nothing
    # Half the samples come from a client that cannot hold those directions: each is halved, its energy ×¼.
    assert abs(weights - 0.25 * before) < 1e-3 * before
