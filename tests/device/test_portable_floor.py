"""The portable runtime's memory floors, checked where the server uses them: a device that trains with the compiled
step graph on stock onnxruntime (the device bundle's pinned build, in a virtual environment of its own), confined
to a memory cgroup, reports its limit and runtime; the round engine chooses its tier with the shipped cost model's
portable floors (server.run_setup.predictor_for, as a run does); the device does two local rounds at that tier on
Fashion-MNIST, the rounds the floors were measured with.

A limit just above a tier's predicted need (floor + margin) gets that tier and completes; just below it gets a
lower tier, which completes too; below the smallest tier's need, the server says in one line that none fits.
Needs root and a writable memory controller, the Debian Fashion-MNIST files and the package index the device
bundle installs from.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest

from device_runtime.artifact_contract import PORTABLE_KIND
from device_runtime.messages import Join, ShardInfo
from device_runtime.profile import ResourceProfile
from device_runtime.shard import save_shard
from fedcore.models import build_model
from server.data.datasets import load_dataset
from server.data.partition import make_client_shards
from server.engine.coordinator import Coordinator, CoordinatorConfig
from server.engine.round_engine import RoundEngine, algorithm_for
from server.engine.run_config import DEFAULT_TIERS, FederationConfig
from server.mqtt.cgroups import available
from server.run_setup import PlanBook, global_state, initial_personal, predictor_for
from tests.support.machine import missing_fmnist, needs
from tests.support.confined_group import confined_devices
from tests.support.stock_python import stock_python  # noqa: F401 (a fixture)

CGROUPS = available()
pytestmark = [pytest.mark.cgroup, pytest.mark.slow, needs(CGROUPS), needs(missing_fmnist())]

MODEL, INPUT_SHAPE, NUM_CLASSES = "cnn1", (1, 28, 28), 10
BATCH_SIZE, ROUNDS = 16, 2
SAMPLES, DEVICES = 3000, 5
DEVICE_ID = "dev_000"
TIER = 0.5  # the tier the limits are set around: tiers above and below it exist


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, int]:
    """The largest device shard of Fashion-MNIST (Dirichlet 0.1 over 5 devices): path, train and test samples."""
    data = load_dataset("fmnist")
    subset = type(data)(x=data.x[:SAMPLES], y=data.y[:SAMPLES], num_classes=data.num_classes, name=data.name)
    largest = max(make_client_shards(subset, "dirichlet", DEVICES, seed=0),
                  key=lambda s: len(s.x_train) + len(s.x_test))
    path = tmp_path_factory.mktemp("portable_floor") / "client.npz"
    save_shard(path, largest)
    return path, len(largest.x_train), len(largest.x_test)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, shared_artifact_cache: Path):
    """A fresh round engine per call, with the tiers and tier choice of a run (the shipped cost model) and its
    plans built as ONNX artifacts of the device's kind."""
    def make() -> RoundEngine:
        model = build_model(MODEL, INPUT_SHAPE, NUM_CLASSES, seed=0)
        config = FederationConfig(algo="fedara", rounds=ROUNDS)
        algorithm = algorithm_for(config)
        plans = PlanBook(model, INPUT_SHAPE, shared_artifact_cache)
        coordinator = Coordinator(CoordinatorConfig(INPUT_SHAPE, NUM_CLASSES, round_deadline_s=60.0), "run0")
        return RoundEngine(algorithm, config, coordinator, plans,
                           global_state(model, algorithm), initial_personal([model], algorithm),
                           tiers=DEFAULT_TIERS, predictor=predictor_for(plans, BATCH_SIZE))
    shared_artifact_cache.mkdir(parents=True, exist_ok=True)
    return make


@pytest.fixture
def confined(stock_python, shard):
    with confined_devices("portable-floor", shard[0], rounds=ROUNDS, batch_size=BATCH_SIZE,
                          python=stock_python) as start:
        yield start


def needs(engine, shard) -> dict[float, float]:
    """MiB each default tier needs on this shard by the shipped cost model, for a portable-runtime device."""
    profile = ResourceProfile(None, 1, 1, "x86_64", "Linux", None, 1.0, runtime=PORTABLE_KIND)
    predict = engine().predictor(profile, shard[1] + shard[2])
    return {tier: predict(tier) for tier in DEFAULT_TIERS}


def admit(engine: RoundEngine, profile: ResourceProfile, shard) -> tuple[float, Path]:
    """The tier the engine gives the device at its JOIN, and the directory of the artifacts it built for it."""
    admission = engine.join(DEVICE_ID, Join(profile, ShardInfo(shard[1], shard[2], INPUT_SHAPE, NUM_CLASSES), ()))
    assert admission.refusal is None
    ratio = admission.plan.ratio
    return ratio, engine.plans.get(ratio, profile.runtime).artifacts.directory


def test_the_shipped_cost_model_puts_the_tier_between_heavier_tiers_above_and_lighter_ones_below(engine, shard):
    """What the limits below rely on (not a monotone order: CNN1's 0.75 tier has a higher floor than dense)."""
    need = needs(engine, shard)
    assert min(need[t] for t in DEFAULT_TIERS if t > TIER) > math.ceil(need[TIER])
    assert max(need[t] for t in DEFAULT_TIERS if t < TIER) <= math.ceil(need[TIER]) - 1


def test_just_above_a_tiers_predicted_floor_the_device_gets_that_tier_and_completes_its_rounds(engine, shard,
                                                                                                 confined):
    limit = math.ceil(needs(engine, shard)[TIER])
    device = confined(limit)
    profile = device.profile()
    assert (profile.memory_limit_mb, profile.runtime) == (limit, PORTABLE_KIND)
    ratio, artifacts = admit(engine(), profile, shard)
    assert ratio == TIER

    status, result, err = device.train(artifacts)

    assert status == 0, err[-2000:]
    assert result["rounds"] == ROUNDS and not result["imported_torch"]
    evidence = device.group.evidence()
    assert evidence.oom_kills == 0 and evidence.peak_mb <= limit


def test_just_below_a_tiers_predicted_floor_the_device_gets_a_lower_tier_that_completes(engine, shard, confined):
    need = needs(engine, shard)
    limit = math.ceil(need[TIER]) - 1
    device = confined(limit)
    ratio, artifacts = admit(engine(), device.profile(), shard)
    assert ratio < TIER and need[ratio] <= limit

    status, _, err = device.train(artifacts)

    assert status == 0, err[-2000:]
    assert device.group.evidence().oom_kills == 0


def test_below_the_smallest_tiers_floor_the_server_says_in_one_line_that_no_tier_fits(engine, shard, confined,
                                                                                        caplog):
    smallest = min(DEFAULT_TIERS)
    limit = math.floor(needs(engine, shard)[smallest]) - 1
    device = confined(limit)
    with caplog.at_level(logging.WARNING):
        ratio, _ = admit(engine(), device.profile(), shard)
    assert ratio == smallest
    (line,) = [r.getMessage() for r in caplog.records if "no tier fits" in r.getMessage()]
    assert line.startswith(f"{DEVICE_ID}: no tier fits its {limit} MiB budget; the leanest, tier {smallest:g}")
