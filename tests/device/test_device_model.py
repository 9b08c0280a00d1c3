"""What a device owner gets: WORKDIR/model (a self-contained ONNX graph and model.json) after every round, the
``predict`` command and ``device_runtime.model.load``, in a process where torch and onnx cannot be imported."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest

import device_runtime.__main__ as device_main
from device_runtime import model as device_model
from device_runtime.atomic_file import write_atomic
from device_runtime.onnx_bake import GraphEditError
from device_runtime.runtimes import open_trainer
from device_runtime.shard import load_shard
from server import broker_loop
from server.outputs.report import METRICS_FILE, read_metrics
from tests.support.artifact_cache import ARTIFACT_CLASSES, ARTIFACT_SHAPE
from tests.support.commands import assert_bad_input
from tests.support.processes import child_env

REPO = Path(__file__).resolve().parents[2]
SHAPE, CLASSES = ARTIFACT_SHAPE, ARTIFACT_CLASSES  # the artifacts fixture's
TIMEOUT_S = 120
NO_TORCH_NO_ONNX = """
import runpy, sys

class NoTorchNoOnnx:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "onnx"):
            raise ImportError(f"{name} is not installed on this board")

sys.meta_path.insert(0, NoTorchNoOnnx())
"""
"""An interpreter where importing torch or onnx fails, as on a board (both are installed here)."""
RUN_DEVICE = 'sys.argv[0] = "device_runtime"\nrunpy.run_module("device_runtime", run_name="__main__", alter_sys=True)'


def lean_device(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m device_runtime ARGS`` where torch and onnx cannot be imported."""
    return subprocess.run([sys.executable, "-c", NO_TORCH_NO_ONNX + RUN_DEVICE, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=TIMEOUT_S, env=child_env(repo_on_path=True))


def test_the_lean_interpreter_cannot_import_torch_or_onnx():
    for module in ("torch", "onnx"):
        done = subprocess.run([sys.executable, "-c", NO_TORCH_NO_ONNX + f"import {module}"], capture_output=True,
                              text=True, timeout=TIMEOUT_S)
        assert f"ImportError: {module} is not installed on this board" in done.stderr


# -- a federation, then predict -------------------------------------------------------------------

QUICK = ["--dataset", "digits", "--max-samples", "400", "--local-epochs", "1", "--batch-size", "32", "--lr", "0.05",
         "--lam", "2", "--lam-warmup", "1", "--threads", "1", "--join-timeout", "300", "--round-deadline", "300"]
DEVICES, ROUNDS = 2, 2
TIERS = {"dev_000": 1.0, "dev_001": 0.25}


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory, shared_artifact_cache: Path) -> Path:
    """Two device processes (dense and rank 0.25) federate for two rounds and a final evaluation, then stop."""
    base = tmp_path_factory.mktemp("federation")
    (base / "tiers.json").write_text(json.dumps(TIERS))
    assert broker_loop.main([*QUICK, "--cache-dir", str(shared_artifact_cache), "--out", str(base / "run"), "--rounds",
                             str(ROUNDS), "--local-devices", str(DEVICES), "--rank-overrides",
                             str(base / "tiers.json")]) == 0
    return base / "run"


@pytest.mark.slow
@pytest.mark.parametrize("device_id", sorted(TIERS))
def test_predict_on_the_test_split_scores_the_reported_accuracy_without_torch_or_onnx(federation: Path,
                                                                                      device_id: str):
    last = read_metrics(federation / METRICS_FILE)[-1]
    reported = last["per_device"][device_id]["accuracy"]
    workdir = federation / "devices" / device_id
    shard_path = federation / "shards" / f"{device_id}.npz"
    shard = load_shard(shard_path)
    done = lean_device("predict", "--workdir", str(workdir), "--json", str(shard_path))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    predictions = np.array(result["predictions"])
    assert predictions.shape == shard.y_test.shape
    correct = int((predictions == shard.y_test).sum())
    assert correct / len(shard.y_test) == reported
    assert (result["correct"], result["total"]) == (correct, len(shard.y_test))
    info = json.loads((workdir / "model" / "model.json").read_text())
    assert (info["round"], info["rank_tier"]) == (ROUNDS, TIERS[device_id])  # the console's "accuracy after round"
    assert (info["local_test_correct"], info["local_test_samples"]) == (correct, len(shard.y_test))
    assert info["local_test_majority_baseline"] == result["majority_baseline"] == np.bincount(shard.y_test).max() / len(
        shard.y_test)
    assert info["local_test_predicted_classes"] == result["predicted_classes"] == len(set(result["predictions"]))
    # The round before, a training round: its model is the one evaluated before training, as the device reported.
    history = sorted((workdir / "models").iterdir())
    assert [d.name.split("-")[1] for d in history] == [f"round{ROUNDS - 1}", f"round{ROUNDS}"]
    earlier = lean_device("predict", "--model", str(history[0]), "--json", str(shard_path))
    assert earlier.returncode == 0, earlier.stderr
    earlier_correct = int((np.array(json.loads(earlier.stdout)["predictions"]) == shard.y_test).sum())
    records = read_metrics(federation / METRICS_FILE)
    assert earlier_correct / len(shard.y_test) == records[-2]["per_device"][device_id]["accuracy"]

    npy = workdir.parent / f"{device_id}-test.npy"
    np.save(npy, shard.x_test)
    plain = lean_device("predict", "--workdir", str(workdir), str(npy))
    assert plain.returncode == 0, plain.stderr
    assert [int(line.split("\t")[1]) for line in plain.stdout.splitlines()] == result["predictions"]

    api = device_model.load(workdir)
    assert api.predict(shard.x_test).tolist() == result["predictions"]
    assert api.predict(shard.x_test[0]).tolist() == result["predictions"][:1]
    np.testing.assert_allclose(api.predict_proba(shard.x_test).sum(axis=1), 1.0, atol=1e-5)


@pytest.mark.slow
def test_a_model_directory_is_self_contained(federation: Path, tmp_path: Path):
    """Rollback is a copy: a history directory copied elsewhere loads alone, checked against its sha256."""
    history = sorted((federation / "devices" / "dev_000" / "models").iterdir())
    copy = tmp_path / "pinned"
    copy.mkdir()
    for f in history[0].iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    pinned = device_model.load(copy)
    assert pinned.info["round"] == ROUNDS - 1
    graph = onnx.load(str(copy / "model.onnx"))
    onnx.checker.check_model(graph, full_check=True)
    assert [i.name for i in graph.graph.input] == ["input"]
    assert [o.name for o in graph.graph.output] == ["logits", "probabilities"]
    damaged = bytearray((copy / "model.onnx").read_bytes())
    damaged[-1] ^= 1
    (copy / "model.onnx").write_bytes(bytes(damaged))
    with pytest.raises(device_model.ModelError, match="does not match the sha256"):
        device_model.load(copy)


# -- the inference graph --------------------------------------------------------------------------


def write_round(store: device_model.ModelStore, trainer, round_index: int, weights=None) -> Path:
    return store.write(trainer.directory / "eval_model.onnx", weights or {**trainer.get_fe(), **trainer.get_head()},
                       input_shape=SHAPE, num_classes=CLASSES, run_id="run", round_index=round_index, rank_tier=0.5,
                       plan_hash="0" * 64, plan_description="test", correct=1, total=2)


def test_the_inference_graph_predicts_as_the_eval_path(artifacts, tmp_path: Path):
    trainer = open_trainer(artifacts.directory)
    rng = np.random.default_rng(0)
    trainer.set_head({k: rng.standard_normal(v.shape).astype(np.float32) for k, v in trainer.get_head().items()})
    x = rng.standard_normal((70, *SHAPE)).astype(np.float32)
    write_round(device_model.ModelStore(tmp_path), trainer, 1)
    model = device_model.load(tmp_path)
    expected = np.concatenate([trainer._forward(x[i:i + 64])[0] for i in range(0, len(x), 64)])
    logits = np.concatenate([model.session.run(["logits"], {"input": x[i:i + 64]})[0] for i in range(0, 70, 64)])
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5)
    assert model.predict(x).tolist() == expected.argmax(axis=1).tolist()
    assert model.predict(x).dtype == np.int64


def test_weights_that_are_not_graph_inputs_are_refused(artifacts, tmp_path: Path):
    trainer = open_trainer(artifacts.directory)
    with pytest.raises(GraphEditError, match="not inputs of the graph"):
        write_round(device_model.ModelStore(tmp_path), trainer, 1,
                    {**trainer.get_fe(), "stranger": np.zeros(3, np.float32)})
    assert not (tmp_path / "model").exists()


# -- history and crashes ----------------------------------------------------------------------------


def test_keep_models_keeps_the_newest_and_model_points_at_the_last(artifacts, tmp_path: Path):
    trainer = open_trainer(artifacts.directory)
    store = device_model.ModelStore(tmp_path, keep=2)
    for r in (1, 2, 3, 3):  # a round answered twice gets a directory of its own
        write_round(store, trainer, r)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["000003-round3", "000004-round3"]
    assert os.readlink(tmp_path / "model") == "models/000004-round3"
    assert device_model.load(tmp_path).info["seq"] == 4


def test_an_async_model_is_named_by_its_version_and_kept_in_the_same_history(artifacts, tmp_path: Path):
    trainer = open_trainer(artifacts.directory)
    store = device_model.ModelStore(tmp_path, keep=2)
    write_round(store, trainer, 4)
    store.write(trainer.directory / "eval_model.onnx", {**trainer.get_fe(), **trainer.get_head()}, name="version2",
                input_shape=SHAPE, num_classes=CLASSES, run_id="run", round_index=2, rank_tier=0.5,
                plan_hash="0" * 64, plan_description="test", correct=1, total=2)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["000001-round4", "000002-version2"]
    assert os.readlink(tmp_path / "model") == "models/000002-version2"


def test_readers_always_find_a_complete_model_while_rounds_are_written(artifacts, tmp_path: Path):
    """keep=1 prunes each model right after the link moves: a reader that resolved the link just before resolves
    again; no load fails and every prediction comes from a whole model."""
    trainer = open_trainer(artifacts.directory)
    store = device_model.ModelStore(tmp_path, keep=1)
    write_round(store, trainer, 0)
    x = np.zeros((2, *SHAPE), np.float32)
    expected = device_model.load(tmp_path).predict(x).tolist()
    writer = threading.Thread(target=lambda: [write_round(store, trainer, r) for r in range(1, 11)])
    writer.start()
    loads = 0
    while writer.is_alive() or loads == 0:
        assert device_model.load(tmp_path).predict(x).tolist() == expected
        loads += 1
    writer.join()
    assert device_model.load(tmp_path).info["round"] == 10


def test_a_directory_put_in_place_of_the_link_is_named_and_left_alone(artifacts, tmp_path: Path):
    trainer = open_trainer(artifacts.directory)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.txt").write_text("a copy")
    with pytest.raises(FileExistsError, match="is not the link this device keeps there"):
        write_round(device_model.ModelStore(tmp_path), trainer, 1)
    assert (tmp_path / "model" / "mine.txt").read_text() == "a copy"


@pytest.mark.parametrize("fail_at", ["model.json", "rename", "link"])
def test_a_crash_while_writing_leaves_the_previous_model_loadable(artifacts, tmp_path: Path, monkeypatch, fail_at):
    trainer = open_trainer(artifacts.directory)
    store = device_model.ModelStore(tmp_path)
    write_round(store, trainer, 1)

    def crash(*args, **kwargs):
        raise OSError(28, "No space left on device")

    if fail_at == "model.json":  # after the graph is written
        monkeypatch.setattr(device_model, "write_atomic", lambda path, data: (
            crash() if Path(path).name == "model.json" else write_atomic(path, data)))
    elif fail_at == "rename":
        monkeypatch.setattr(device_model.os, "rename", crash)
    else:
        monkeypatch.setattr(device_model.os, "replace", crash)
    with pytest.raises(OSError):
        write_round(store, trainer, 2)
    monkeypatch.undo()
    assert device_model.load(tmp_path).info["round"] == 1
    write_round(store, trainer, 3)
    assert device_model.load(tmp_path).info["round"] == 3
    assert not list((tmp_path / "models").glob(".tmp-*")) and not list(tmp_path.glob(".tmp-*"))


def test_a_device_killed_while_writing_leaves_the_previous_model_loadable(artifacts, tmp_path: Path):
    """A real kill (SIGKILL) of a process in the middle of a write, after the graph file is on disk."""
    trainer = open_trainer(artifacts.directory)
    write_round(device_model.ModelStore(tmp_path), trainer, 1)
    script = f"""
import os, signal, sys
from pathlib import Path
from device_runtime import model
from device_runtime.runtimes import open_trainer
real = model.write_atomic
def killed(path, data):
    real(path, data)
    if Path(path).name == "model.onnx":
        os.kill(os.getpid(), signal.SIGKILL)
model.write_atomic = killed
t = open_trainer({str(artifacts.directory)!r})
model.ModelStore({str(tmp_path)!r}).write(t.directory / "eval_model.onnx", {{**t.get_fe(), **t.get_head()}},
    input_shape={SHAPE!r}, num_classes={CLASSES}, run_id="run", round_index=2, rank_tier=0.5, plan_hash="0" * 64,
    plan_description="", correct=0, total=1)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=child_env(repo_on_path=True))
    assert done.returncode == -9, done.stderr
    assert list((tmp_path / "models").glob(".tmp-*"))  # it died mid-write
    assert device_model.load(tmp_path).info["round"] == 1


# -- the command's errors -------------------------------------------------------------------------


def predict(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "device_runtime", "predict", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=TIMEOUT_S, env=child_env(repo_on_path=True))


def one_class_model(trainer, label: int) -> None:
    """A head that answers ``label`` whatever the input: zero weights, a bias on that class."""
    head = {k: np.zeros_like(v) for k, v in trainer.get_head().items()}
    next(v for v in head.values() if v.ndim == 1)[label] = 5.0
    trainer.set_head(head)


@pytest.mark.parametrize("trivial", [True, False])
def test_predict_puts_the_majority_baseline_beside_the_accuracy_and_flags_a_one_class_model(
        artifacts, tmp_path: Path, capsys, trivial: bool):
    trainer = open_trainer(artifacts.directory)
    rng = np.random.default_rng(0)
    if trivial:
        one_class_model(trainer, 3)
    else:
        trainer.set_head({k: rng.standard_normal(v.shape).astype(np.float32) for k, v in trainer.get_head().items()})
    write_round(device_model.ModelStore(tmp_path / "w"), trainer, 1)
    shard = tmp_path / "shard.npz"
    np.savez(shard, x_test=rng.standard_normal((40, *SHAPE)).astype(np.float32), y_test=np.array([3] * 30 + [1] * 10))
    assert device_model.predict_main(["--workdir", str(tmp_path / "w"), "--json", str(shard)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["majority_class"], result["majority_correct"], result["majority_baseline"]) == (3, 30, 0.75)
    assert result["one_class"] is trivial and (result["predicted_classes"] == 1) is trivial
    assert device_model.predict_main(["--workdir", str(tmp_path / "w"), str(shard)]) == 0
    summary = capsys.readouterr().err
    assert "majority-class baseline 0.7500" in summary and ("ONE CLASS" in summary) is trivial
    if trivial:
        assert result["correct"] == 30


def test_predict_before_any_round_says_there_is_no_model_yet(tmp_path: Path):
    np.save(tmp_path / "x.npy", np.zeros((1, *SHAPE), np.float32))
    assert_bad_input(predict("--workdir", str(tmp_path), str(tmp_path / "x.npy")),
                     f"error: --workdir {tmp_path}:", "holds no model yet")


@pytest.fixture
def workdir_with_model(artifacts, tmp_path: Path) -> Path:
    write_round(device_model.ModelStore(tmp_path / "w"), open_trainer(artifacts.directory), 1)
    return tmp_path / "w"


@pytest.mark.parametrize("array, fragments", [
    (np.zeros((2, 3, 28, 28), np.float32), ("must be N×1×28×28", "got shape (2, 3, 28, 28)")),
    (np.zeros((2, 1, 28, 28), np.uint8), ("must be floats, normalized as the shard's x arrays", "got uint8")),
])
def test_input_of_the_wrong_shape_or_type_names_input_and_what_fits(workdir_with_model: Path, array, fragments):
    path = workdir_with_model.parent / "bad.npy"
    np.save(path, array)
    assert_bad_input(predict("--workdir", str(workdir_with_model), str(path)), f"error: INPUT {path}:", *fragments)


def test_input_that_is_not_npy_or_a_shard_is_named(workdir_with_model: Path):
    text = workdir_with_model.parent / "x.csv"
    text.write_text("1,2\n")
    assert_bad_input(predict("--workdir", str(workdir_with_model), str(text)), "must be a .npy array")
    archive = workdir_with_model.parent / "other.npz"
    np.savez(archive, images=np.zeros((1, *SHAPE), np.float32))
    assert_bad_input(predict("--workdir", str(workdir_with_model), str(archive)), "holds no x_test (keys: images)",
                     "--split")
    assert_bad_input(predict("--workdir", str(workdir_with_model), str(text) + ".npy"), "No such file")


def test_the_agent_cli_refuses_keep_models_below_one():
    args = device_main.build_parser().parse_args(["--broker", "mqtt://h", "--device-id", "d", "--data", "x",
                                                  "--workdir", "w", "--key-file", "k", "--keep-models", "0"])
    with pytest.raises(ValueError, match="--keep-models must be >= 1"):
        device_main.check_args(args)
    assert device_main.DEFAULT_KEEP_MODELS == device_model.DEFAULT_KEEP
