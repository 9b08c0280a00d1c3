"""The secure step's memory (``secagg_client.secure_step_bytes``): an upper bound on what a device allocates to
build, round and mask its full-rank change, checked against tracemalloc on FedAvgCNN's shared model at each tier;
and the tier choice adds it to every tier's need under --secure-aggregation (``server.run_setup.predictor_for``)."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from device_runtime.artifact_contract import PORTABLE_KIND
from device_runtime.profile import ResourceProfile
from device_runtime.secagg_client import SecAggClient, SecureSpec, secure_input, secure_step_bytes
from device_runtime.secagg_quantize import plain_quantizer
from fedcore.lowrank import factorize_state, rank_for_ratio
from fedcore.models import build_model
from server.engine.rank_assignment import assign_tier
from server.engine.round_engine import algorithm_for
from server.engine.run_config import DEFAULT_TIERS, FederationConfig
from server.run_setup import PlanBook, predictor_for, secure_step_mb

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


def test_under_secure_aggregation_every_tier_needs_the_secure_step_more_and_a_tight_device_drops_a_tier(tmp_path):
    model = build_model("fedavgcnn", (1, 28, 28), 10)
    algorithm = algorithm_for(FederationConfig(algo="fedara"))
    plans = PlanBook(model, (1, 28, 28), tmp_path, onnx=False)
    profile = ResourceProfile(None, 1, 1, "x86_64", "Linux", None, 1.0, runtime=PORTABLE_KIND)
    extra = secure_step_mb(model, algorithm)
    plain = predictor_for(plans, 16)(profile, 100)
    secure = predictor_for(plans, 16, extra)(profile, 100)
    assert 15 < extra < 30
    assert all(secure(t) == pytest.approx(plain(t) + extra) for t in DEFAULT_TIERS)
    budget = plain(1.0) + 1  # fits the dense tier's floor and margin, not the secure step beside it
    assert assign_tier(budget, DEFAULT_TIERS, plain) == 1.0
    assert assign_tier(budget, DEFAULT_TIERS, secure) < 1.0
