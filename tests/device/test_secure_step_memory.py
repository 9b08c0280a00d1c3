"""The secure step's memory: ``secagg_client.secure_step_bytes``, an upper bound on what a device allocates to
build, round and mask its full-rank change, checked against tracemalloc on FedAvgCNN's shared model at each tier;
under --secure-aggregation the tier choice (``server.run_setup.predictor_for``) takes the floors measured with the
secure step in a memory cgroup where the cost model has them (``scripts/bench_device.py --memory-floor --secure``),
else adds the bound to every tier's need; and a device confined to a tier's secure need completes its rounds
(root, a memory controller, the device bundle's stock onnxruntime)."""
from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

from device_runtime.artifact_contract import PORTABLE_KIND, TRAINING_KIND
from device_runtime.profile import ResourceProfile
from device_runtime.secagg_client import SecAggClient, SecureSpec, secure_input, secure_step_bytes
from device_runtime.secagg_quantize import plain_quantizer
from fedcore.lowrank import factorize_state, rank_for_ratio
from fedcore.models import build_model
from server.engine.cost_model import predict
from server.engine.rank_assignment import assign_tier
from server.engine.round_engine import algorithm_for
from server.engine.run_config import DEFAULT_TIERS, FederationConfig
from server.mqtt.cgroups import available
from server.run_setup import PlanBook, predictor_for, secure_step_mb
from tests.support.machine import needs
from tests.support.scripts import load_script
from tests.support.stock_python import stock_python  # noqa: F401 (a fixture)

IDS = tuple(f"d{i}" for i in range(4))


@pytest.mark.parametrize("ratio", [1.0, 0.25])
def test_the_secure_step_allocates_no_more_than_its_bound(ratio):
    model = build_model("fedavgcnn", (1, 28, 28), 10)
    fe = {k: v.detach() for k, v in model.state_dict().items() if k.startswith("fe.")}
    shapes = {k: tuple(v.shape) for k, v in fe.items()}
    ranks = {} if ratio == 1.0 else {k.rsplit(".", 1)[0]: rank_for_ratio(ratio, tuple(v.shape))
                                     for k, v in fe.items() if k.endswith(".weight") and v.dim() > 1}
    sent = {k: v.numpy() for k, v in factorize_state(fe, ranks).items()}
    returned = {k: v + np.float32(0.01) for k, v in sent.items()}
    spec = SecureSpec(b"mem|1", IDS, 3, 3, 3, b"graph", plain_quantizer(8.0, 4), 8.0, False, 0.0, shapes, 0.25)
    clients = {i: SecAggClient(i, spec) for i in IDS}
    keys = {i: c.advertise() for i, c in clients.items()}
    shares = {i: c.share_keys({v: keys[v] for v in c.mine}) for i, c in clients.items()}
    mine = {v: shares[v][IDS[0]] for v in clients[IDS[0]].mine}
    tracemalloc.start()
    try:
        x = secure_input(returned, sent, spec, np.random.default_rng(0))
        clients[IDS[0]].masked_input(x, mine)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    bound = secure_step_bytes(shapes)
    assert peak <= bound < 1.5 * peak


def plan_book(name: str, tmp_path) -> tuple[PlanBook, object]:
    model = build_model(name, (1, 28, 28), 10)
    return PlanBook(model, (1, 28, 28), tmp_path, onnx=False), model


PORTABLE = ResourceProfile(None, 1, 1, "x86_64", "Linux", None, 1.0, runtime=PORTABLE_KIND)


def test_under_secure_aggregation_each_tier_needs_its_floor_measured_with_the_secure_step(tmp_path):
    """FedAvgCNN 1×28×28 has portable floors measured with the secure step (scripts/bench_device.py --memory-floor
    --secure): each tier's need is that floor plus the margin, more than the plain need; a device that fits the
    dense tier's plain need only drops a tier."""
    plans, model = plan_book("fedavgcnn", tmp_path)
    extra = secure_step_mb(model, algorithm_for(FederationConfig(algo="fedara")))
    plain = predictor_for(plans, 16)(PORTABLE, 100)
    secure = predictor_for(plans, 16, extra)(PORTABLE, 100)
    for tier in DEFAULT_TIERS:
        measured = predict("fedavgcnn", (1, 28, 28), tier, 16, PORTABLE, shard_samples=100, secure=True)
        assert measured.secure_floor and secure(tier) == pytest.approx(measured.need_mb) and secure(tier) > plain(tier)
    budget = plain(1.0) + 1  # fits the dense tier's floor and margin, not the secure step beside it
    assert assign_tier(budget, DEFAULT_TIERS, plain) == 1.0
    assert assign_tier(budget, DEFAULT_TIERS, secure) < 1.0


def test_a_runtime_without_secure_floors_needs_its_plain_floor_plus_the_bound(tmp_path):
    """onnxruntime-training has plain floors of FedAvgCNN 1×28×28 only: under secure aggregation the tier choice
    adds secure_step_bytes to them."""
    plans, model = plan_book("fedavgcnn", tmp_path)
    extra = secure_step_mb(model, algorithm_for(FederationConfig(algo="fedara")))
    training = ResourceProfile(None, 1, 1, "x86_64", "Linux", None, 1.0, runtime=TRAINING_KIND)
    plain = predictor_for(plans, 16)(training, 100)
    secure = predictor_for(plans, 16, extra)(training, 100)
    assert 15 < extra < 30 and all(secure(t) == pytest.approx(plain(t) + extra) for t in DEFAULT_TIERS)
    assert predict("fedavgcnn", (1, 28, 28), 1.0, 16, training, secure=True).floor_runtime == TRAINING_KIND


@pytest.mark.cgroup
@pytest.mark.slow
@needs(available())
def test_a_device_confined_to_its_tiers_secure_need_completes_rounds_that_end_with_the_secure_step(
        stock_python, tmp_path, shared_artifact_cache):
    """At every tier, the benchmark's device worker (the agent's round, then its secure step under distributed DP
    and the masked UPDATE sealed and framed: scripts/bench_device.py) completes its two rounds in a memory cgroup of
    the need the tier choice gives (secure floor + margin, on the floors' own synthetic shard), on the device
    bundle's stock onnxruntime."""
    bench = load_script("bench_device")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "fedara").symlink_to(shared_artifact_cache)
    plans = bench.prepare_plans((("fedavgcnn", (1, 28, 28)),), DEFAULT_TIERS, tmp_path / "cache", tmp_path,
                                bench.FLOOR_TRAIN_SAMPLES)
    for plan in plans:
        ratio = min(plan["ratios"])
        need = predict("fedavgcnn", (1, 28, 28), ratio, 16, PORTABLE, secure=True).need_mb
        spec = {k: plan[k] for k in ("model", "input_shape", "ranks", "portable_artifacts", "shard", "label")}
        spec.update(batch_size=16, rounds=bench.FLOOR_ROUNDS,
                    secure=bench.secure_settings(plan["model"], plan["input_shape"]))
        run = bench.run_in_group("floor-portable", spec, math.ceil(need), bench.FLOOR_TIME_SLACK_S * 6, stock_python)
        assert run["completed"], (ratio, need, run)
