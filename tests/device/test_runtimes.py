"""Runtime detection and opening the trainer an artifact directory's kind asks for."""
from __future__ import annotations

import numpy as np
import pytest

from device_runtime.artifact_contract import KINDS, PORTABLE_KIND, TRAINING_KIND, ArtifactError
from device_runtime.portable_trainer import PortableTrainer
from device_runtime.profile import ProfileError, ResourceProfile, collect_profile
from device_runtime.runtimes import RuntimeUnavailable, detect, open_trainer
from device_runtime.trainer import DeviceTrainer
from export.artifacts import build_artifacts_of_kind
from fedcore.models import build_model

SHAPE, CLASSES = (1, 28, 28), 10


@pytest.fixture(scope="module")
def sets(shared_artifact_cache):
    model = build_model("fedavgcnn", SHAPE, CLASSES, seed=0)
    return {kind: build_artifacts_of_kind(kind, model, {}, SHAPE, CLASSES, shared_artifact_cache) for kind in KINDS}


def test_auto_takes_the_portable_runtime_whenever_onnxruntime_is_installed():
    assert detect("auto") == PORTABLE_KIND


def test_a_named_runtime_that_is_installed_is_taken():  # this environment has the training build
    assert detect(TRAINING_KIND) == TRAINING_KIND


def test_the_training_runtime_without_the_training_api_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr("device_runtime.runtimes._has_training_api", lambda: False)
    with pytest.raises(RuntimeUnavailable, match="--runtime onnxruntime-training: .* no training API"):
        detect(TRAINING_KIND)


def test_an_unknown_runtime_is_refused():
    with pytest.raises(ValueError, match="--runtime must be one of auto, onnxruntime, onnxruntime-training"):
        detect("tensorflow")


@pytest.mark.parametrize("kind, trainer", [(PORTABLE_KIND, PortableTrainer), (TRAINING_KIND, DeviceTrainer)])
def test_open_trainer_picks_the_trainer_of_the_manifests_kind(sets, kind, trainer):
    assert type(open_trainer(sets[kind].directory)) is trainer


@pytest.mark.parametrize("trainer, other", [(PortableTrainer, TRAINING_KIND), (DeviceTrainer, PORTABLE_KIND)])
def test_a_trainer_refuses_artifacts_of_the_other_kind(sets, trainer, other):
    with pytest.raises(ArtifactError, match="open_trainer picks by kind"):
        trainer(sets[other].directory)


def test_the_profile_names_the_runtime_and_the_server_parses_it():
    profile = collect_profile(None, 1, runtime=TRAINING_KIND)
    assert ResourceProfile.from_meta(profile.to_meta()).runtime == TRAINING_KIND


def test_a_profile_with_an_unknown_runtime_is_refused():
    meta = collect_profile(None, 1).to_meta() | {"runtime": "tensorflow"}
    with pytest.raises(ProfileError, match="profile field runtime must be one of"):
        ResourceProfile.from_meta(meta)


def test_the_device_cli_names_a_missing_runtime_and_exits_2(tmp_path, monkeypatch, capsys):
    from device_runtime.__main__ import main
    from device_runtime.shard import Shard, save_shard
    rng = np.random.default_rng(0)
    save_shard(tmp_path / "shard.npz", Shard(rng.standard_normal((4, *SHAPE), dtype=np.float32), np.arange(4),
                                             rng.standard_normal((2, *SHAPE), dtype=np.float32), np.arange(2), CLASSES))
    monkeypatch.setattr("device_runtime.runtimes._has_training_api", lambda: False)
    code = main(["--broker", "mqtt://127.0.0.1:1", "--device-id", "dev_x", "--data", str(tmp_path / "shard.npz"),
                 "--workdir", str(tmp_path / "work"), "--key-file", str(tmp_path / "dev_x.key"),
                 "--runtime", TRAINING_KIND])
    assert code == 2
    assert "--runtime onnxruntime-training" in capsys.readouterr().err
