"""Artifact export: content-hash cache, manifest, sizes, refusal of corrupt sets, the CLI."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import onnx
import pytest

from device_runtime.artifact_contract import (ARTIFACT_FILES_BY_KIND, MANIFEST_NAME, TRAINING_INPUTS, TRAINING_KIND,
                                              ArtifactError, verify_artifacts)
from export import artifacts
from export.artifacts import artifact_config, build_artifacts, config_hash, load_artifact_set
from fedcore.lowrank import RankPlan, factorize_model, fe_state, resolve_plan
from fedcore.models import build_model
from tests.support.artifact_cache import private_copy

MODEL, SHAPE, CLASSES = "fedavgcnn", (1, 28, 28), 10
MAX_ONNXRUNTIME_IR = 10


@pytest.fixture(scope="module")
def model():
    return build_model(MODEL, SHAPE, CLASSES, seed=0)


@pytest.fixture(scope="module")
def ranks(model):
    return resolve_plan(model, RankPlan(0.5)).ranks


@pytest.fixture(scope="module")
def cache(shared_artifact_cache) -> Path:
    return shared_artifact_cache


@pytest.fixture(scope="module")
def built(model, ranks, cache):
    return build_artifacts(model, ranks, SHAPE, CLASSES, cache)


def test_hash_names_the_directory_and_the_manifest(built):
    manifest = json.loads((built.directory / MANIFEST_NAME).read_text())
    assert built.directory.name == built.hash == manifest["hash"]
    assert re.fullmatch(r"[0-9a-f]{64}", built.hash)


def test_same_config_is_served_from_cache_without_exporting(built, model, ranks, cache, monkeypatch):
    manifest_mtime = (built.directory / MANIFEST_NAME).stat().st_mtime_ns

    def no_export(*args, **kwargs):
        raise AssertionError("a cached config was exported again")

    monkeypatch.setattr(artifacts, "_write_artifacts", no_export)
    again = build_artifacts(model, ranks, SHAPE, CLASSES, cache)
    assert again == built
    assert (built.directory / MANIFEST_NAME).stat().st_mtime_ns == manifest_mtime


@pytest.mark.parametrize("change", ["other_rank", "other_layers", "dense", "classes", "input_shape"])
def test_anything_that_shapes_the_graph_changes_the_hash(built, model, ranks, change):
    shape, classes, plan = SHAPE, CLASSES, dict(ranks)
    if change == "other_rank":
        plan["fe.fc1"] -= 1
    elif change == "other_layers":
        plan = {"fe.fc1": ranks["fe.fc1"]}
    elif change == "dense":
        plan = {}
    elif change == "classes":
        classes, model = 11, build_model(MODEL, SHAPE, 11, seed=0)
    else:
        shape, model = (1, 32, 32), build_model(MODEL, (1, 32, 32), CLASSES, seed=0)
    assert config_hash(artifact_config(model, plan, shape, classes)) != built.hash


def test_hash_ignores_weight_values(built, ranks):
    other_weights = build_model(MODEL, SHAPE, CLASSES, seed=123)
    assert config_hash(artifact_config(other_weights, ranks, SHAPE, CLASSES)) == built.hash


def test_sizes_are_the_file_sizes(built):
    assert set(built.sizes) == set(ARTIFACT_FILES_BY_KIND[TRAINING_KIND])
    for key, path in built.files.items():
        assert built.sizes[key] == path.stat().st_size > 0
    assert built.total_bytes == sum(built.sizes.values())


def test_graphs_hold_no_weights_the_checkpoint_does(built, model, ranks):
    parameter_bytes = sum(4 * v.numel() for v in factorize_model(model, ranks).state_dict().values())
    assert built.sizes["checkpoint"] >= parameter_bytes
    for key in ("training_model", "eval_model", "optimizer_model"):
        assert built.sizes[key] < parameter_bytes / 20


def test_manifest_names_the_factorized_fe_and_the_head(built, model, ranks):
    client = factorize_model(model, ranks)
    expected_fe = {k: tuple(v.shape) for k, v in fe_state(client).items()}
    assert built.fe_shapes == expected_fe and built.fe_names == tuple(expected_fe)
    assert built.head_shapes == {"head.weight": (CLASSES, 512), "head.bias": (CLASSES,)}
    assert (built.input_shape, built.num_classes, built.feature_dim) == (SHAPE, CLASSES, 512)


def test_training_graph_takes_round_settings_as_inputs(built):
    graph = onnx.load(built.files["training_model"])
    assert [i.name for i in graph.graph.input][:len(TRAINING_INPUTS)] == list(TRAINING_INPUTS)
    assert graph.ir_version <= MAX_ONNXRUNTIME_IR


def test_training_graph_leaves_the_frobenius_term_to_the_device(built):
    graph = onnx.load(built.files["training_model"]).graph
    assert "mu" not in {i.name for i in graph.input}
    factors = {name for name in built.fe_names if name.endswith((".u", ".v"))}
    assert factors and not any(node.op_type == "Gemm" and set(node.input) <= factors for node in graph.node)


def test_corrupt_file_is_refused(built, tmp_path):
    copy = private_copy(built.directory, tmp_path)
    target = copy / ARTIFACT_FILES_BY_KIND[TRAINING_KIND]["training_model"]
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="training_model.onnx is corrupt"):
        verify_artifacts(copy, built.hash)
    with pytest.raises(ArtifactError, match="corrupt"):
        load_artifact_set(copy)


def test_missing_file_is_refused(built, tmp_path):
    copy = private_copy(built.directory, tmp_path)
    (copy / ARTIFACT_FILES_BY_KIND[TRAINING_KIND]["checkpoint"]).unlink()
    with pytest.raises(ArtifactError, match="checkpoint is missing"):
        verify_artifacts(copy, built.hash)


def test_other_hash_is_refused(built):
    with pytest.raises(ArtifactError, match="expected"):
        verify_artifacts(built.directory, "0" * 64)


def test_losing_a_build_race_keeps_the_winner_and_no_temp_dir(model, tmp_path, monkeypatch):
    real_write = artifacts._write_artifacts
    final_dirs = []

    def write_then_lose_race(client, config, digest, directory):
        real_write(client, config, digest, directory)
        final_dirs.append(directory.parent / digest)
        shutil.copytree(directory, final_dirs[0])  # another builder renamed its copy into place first

    monkeypatch.setattr(artifacts, "_write_artifacts", write_then_lose_race)
    result = build_artifacts(model, {}, SHAPE, CLASSES, tmp_path)
    assert result.directory == final_dirs[0]
    assert [p.name for p in tmp_path.iterdir()] == [result.hash]


def test_num_classes_must_match_the_head(model, tmp_path):
    with pytest.raises(ValueError, match="num_classes 7"):
        build_artifacts(model, {}, SHAPE, 7, tmp_path)


def test_cli_prints_the_hash_and_sizes(built, cache, capsys):
    assert artifacts.main(["--model", MODEL, "--input-shape", "1,28,28", "--classes", str(CLASSES),
                           "--ratio", "0.5", "--out", str(cache)]) == 0
    out = capsys.readouterr().out
    assert f"hash {built.hash}" in out
    assert re.search(rf"checkpoint\s+{built.sizes['checkpoint']} B", out)
