"""DP in the async mode (``server.engine.privacy.BufferDp`` inside ``server.engine.async_engine``): each buffer flush is
a Gaussian mechanism on the sum of at most K clipped changes, each device once per buffer, noise N(0, (z·C)²) on the
sum, charged per version without sampling amplification, and checked against the Gaussian mechanism's exact ε."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from device_runtime.messages import Join, ShardInfo, update_message
from device_runtime.profile import ResourceProfile
from device_runtime.task import Update
from fedcore.models import build_model
from server.engine.accountant import epsilon
from server.engine.async_engine import AsyncEngine
from server.engine.coordinator import Coordinator, CoordinatorConfig
from server.engine.privacy import BufferDp, l2_norm
from server.engine.round_engine import algorithm_for
from server.engine.run_config import BufferRule, DpSettings, FederationConfig
from server.outputs.status_snapshot import fleet_snapshot
from server.run_setup import PlanBook, global_state, initial_personal

K = 4
SHAPES = {"fe.w": (200,), "fe.b": (50,)}


def buffer_dp(z: float = 1.0, clip: float = 0.5, **kw) -> BufferDp:
    return BufferDp(DpSettings(z, 1.0, K, clip, delta=1e-5, test_seed=7, **kw), SHAPES)


def change(scale: float, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: scale * torch.randn(s, generator=gen, dtype=torch.float64) for k, s in SHAPES.items()}


def flush(dp: BufferDp, changes: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    for i, delta in enumerate(changes):
        dp.add(f"dev_{i:03d}", delta)
    return dp.release()


def test_a_change_far_too_large_moves_the_flush_by_at_most_clip_over_k():
    small = [change(1e-3, seed) for seed in range(1, K)]
    base = flush(buffer_dp(), [change(0.0), *small])
    huge = flush(buffer_dp(), [change(1000.0), *small])  # the same noise (test seed): only the clip differs
    moved = l2_norm({k: huge[k] - base[k] for k in SHAPES})
    assert moved == pytest.approx(0.5 / K, rel=1e-9)


def test_noise_std_on_the_flush_is_z_clip_over_k_within_its_sampling_error():
    step = flush(buffer_dp(z=1.3, clip=0.5), [change(0.0)])
    values = torch.cat([v.flatten() for v in step.values()]).numpy()
    expected = 1.3 * 0.5 / K
    n = values.size
    assert abs(values.std(ddof=1) - expected) < 5 * expected / math.sqrt(2 * (n - 1))


def test_a_device_counts_once_per_buffer_and_again_after_the_flush():
    dp = buffer_dp()
    dp.add("dev_000", change(0.1))
    with pytest.raises(ValueError, match="once per flush"):
        dp.add("dev_000", change(0.1))
    dp.release()
    assert not dp.holds("dev_000")
    dp.add("dev_000", change(0.1))


def exact_gaussian_epsilon(z: float, versions: int, delta: float) -> float:
    """ε of ``versions`` Gaussian mechanisms of multiplier z (sensitivity 1): μ-GDP with μ = √T/z, whose exact
    δ(ε) = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2) (Dong, Roth & Su 2019; Balle & Wang 2018), solved by bisection."""
    mu = math.sqrt(versions) / z
    phi = lambda x: 0.5 * math.erfc(-x / math.sqrt(2))  # noqa: E731

    def delta_of(eps: float) -> float:
        return phi(-eps / mu + mu / 2) - math.exp(eps) * phi(-eps / mu - mu / 2)

    low, high = 0.0, 100.0
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if delta_of(mid) > delta else (low, mid)
    return high


@pytest.mark.parametrize("z, versions, delta", [(1.0, 10, 1e-5), (4.0, 100, 3000 ** -1.1)])
def test_epsilon_per_version_is_the_unsampled_gaussians_within_one_percent(z: float, versions: int, delta: float):
    dp = BufferDp(DpSettings(z, 1.0, K, 0.5, delta=delta, test_seed=1), SHAPES)
    for _ in range(versions):
        dp.add("dev_000", change(0.1))
        dp.release()
    exact = exact_gaussian_epsilon(z, versions, delta)
    assert dp.epsilon == pytest.approx(epsilon(1.0, z, versions, delta))
    assert exact <= dp.epsilon <= 1.01 * exact  # PLD: an upper bound, tight


def test_the_flush_that_would_pass_the_target_is_refused():
    target = (epsilon(1.0, 1.0, 2, 1e-5) + epsilon(1.0, 1.0, 3, 1e-5)) / 2
    dp = BufferDp(DpSettings(1.0, 1.0, K, 0.5, delta=1e-5, target_epsilon=target, test_seed=1), SHAPES)
    for _ in range(2):
        dp.add("dev_000", change(0.1))
        dp.release()
    assert dp.refusal().startswith("privacy budget: round 3 would spend")
    dp.add("dev_000", change(0.1))
    with pytest.raises(RuntimeError, match="privacy budget"):
        dp.release()
    assert dp.accountant.rounds == 2


# -- inside the async engine ------------------------------------------------------------------------------------

SHAPE, CLASSES, RUN = (1, 28, 28), 10, "run0"
DEVICES = [f"dev_{i:03d}" for i in range(4)]


def private_engine(buffer_size: int = 2, target_epsilon: float | None = None) -> AsyncEngine:
    model = build_model("fedavgcnn", SHAPE, CLASSES, seed=0)
    config = FederationConfig(algo="fedavg", rounds=3, local_epochs=1, aggregate="updates")
    algorithm = algorithm_for(config)
    engine = AsyncEngine(algorithm, config, Coordinator(CoordinatorConfig(SHAPE, CLASSES, round_deadline_s=10.0), RUN),
                         PlanBook(model, SHAPE, None, onnx=False), global_state(model, algorithm),
                         initial_personal([model], algorithm), tiers=(1.0,),
                         rule=BufferRule(buffer_size, 3, 0.5, concurrency=4),
                         privacy=DpSettings(1.0, 1.0, buffer_size, 0.01, delta=1e-5, target_epsilon=target_epsilon,
                                            test_seed=3))
    for device_id in DEVICES:
        admission = engine.join(device_id, Join(ResourceProfile(None, 1, 1, "x86_64", "Linux", None, 1.0),
                                                ShardInfo(50, 10, SHAPE, CLASSES), ()))
        engine.acknowledge(device_id, admission.plan.plan_hash)
    return engine


def reply(engine: AsyncEngine, device_id: str, task, scale: float = 1.1):
    weights = {k: v * np.float32(scale) for k, v in task.weights.items()}
    update = Update(task.round, weights, 50, 1.0, 0.5, {"eval_correct": 5, "eval_total": 10, "eval_loss": 1.0})
    msg = update_message(update, plan_hash=engine.plan_info(device_id).hash, device_id=device_id, run_id=RUN)
    return engine.receive(device_id, msg, 1.0)


def test_a_device_whose_update_waits_in_the_buffer_gets_no_task_until_the_flush():
    engine = private_engine(buffer_size=3)
    tasks = engine.dispatch(DEVICES[:2])
    assert reply(engine, "dev_000", tasks["dev_000"]).accepted
    assert engine.dispatch(["dev_000"]) == {}  # free, but its update is in the buffer
    assert reply(engine, "dev_001", tasks["dev_001"]).accepted
    third = engine.dispatch(["dev_002"])
    assert reply(engine, "dev_002", third["dev_002"]).accepted and engine.version == 1
    assert set(engine.dispatch(["dev_000"])) == {"dev_000"}


def test_each_version_moves_the_model_by_the_noised_mean_and_charges_one_gaussian():
    engine = private_engine()
    before = {k: v.clone() for k, v in engine.global_state.items()}
    tasks = engine.dispatch(DEVICES[:2])
    for device_id in DEVICES[:2]:
        assert reply(engine, device_id, tasks[device_id], scale=50.0).accepted  # far beyond the clip 0.01
    moved = l2_norm({k: engine.global_state[k].double() - before[k].double() for k in before})
    noise = 1.0 * 0.01 / 2 * math.sqrt(sum(v.numel() for v in before.values()))  # ‖N(0, (zC/K)²·I)‖ ≈ zC/K·√d
    assert engine.version == 1 and engine.dp.epsilon == pytest.approx(epsilon(1.0, 1.0, 1, 1e-5))
    assert abs(moved - noise) < 2 * 0.01 / 2 + 0.05 * noise  # the clipped mean (≤ C) beside the noise


def test_once_the_next_version_would_pass_the_target_no_task_is_given_and_no_update_is_taken():
    """What the MQTT loop relies on: updates keep arriving after the last version the budget allows, and none of
    them may fill a buffer that would then be released past the target."""
    engine = private_engine(target_epsilon=(epsilon(1.0, 1.0, 1, 1e-5) + epsilon(1.0, 1.0, 2, 1e-5)) / 2)
    tasks = engine.dispatch(DEVICES)
    for device_id in DEVICES[:2]:
        assert reply(engine, device_id, tasks[device_id]).accepted
    assert engine.version == 1 and engine.budget_refusal().startswith("privacy budget: round 2 would spend")
    assert engine.makes_no_more() and engine.dispatch(DEVICES) == {}
    late = [reply(engine, device_id, tasks[device_id]) for device_id in DEVICES[2:]]  # a full buffer's worth
    assert not any(v.accepted for v in late) and "privacy budget: round 2" in late[0].reason
    assert engine.version == 1 and engine.dp.accountant.rounds == 1


def test_the_status_page_and_metrics_snapshot_show_the_versions_budget():
    engine = private_engine(target_epsilon=5.0)
    tasks = engine.dispatch(DEVICES[:2])
    for device_id in DEVICES[:2]:
        assert reply(engine, device_id, tasks[device_id]).accepted
    privacy = fleet_snapshot(engine, now=0.0, wall=0.0)["privacy"]
    assert privacy["epsilon"] == pytest.approx(epsilon(1.0, 1.0, 1, 1e-5)) and privacy["rounds_charged"] == 1
    assert privacy["target_epsilon"] == 5.0 and privacy["delta"] == 1e-5
