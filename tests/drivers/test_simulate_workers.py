"""``server.simulate --workers N`` (devices trained in N spawned worker processes) gives the model of the
sequential run bit for bit; worker errors and ``--device cuda`` without a GPU are clear errors.

The torch case runs in the default suite; the portable (ONNX) case exports and compiles two plans, minutes under
load, so it is marked slow, as is the local-training case."""
import subprocess
import sys

import numpy as np
import pytest

from server.outputs.checkpoint import CHECKPOINT_NAME, load_checkpoint
from server.parallel_devices import DevicePool, WorkerError, WorkerSettings, assign
from server.simulate import main
from tests.support.processes import child_env

SMALL = ["--dataset", "digits", "--clients", "4", "--rounds", "2", "--local-epochs", "1", "--batch-size", "32",
         "--max-samples", "240", "--lr", "0.05", "--lam", "1", "--lam-warmup", "1", "--seed", "3"]


def final_tensors(out, *flags: str) -> dict[str, np.ndarray]:
    assert main([*SMALL, "--out", str(out), *flags]) == 0
    return load_checkpoint(out / CHECKPOINT_NAME).tensors


def assert_identical(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert set(a) == set(b)
    different = sorted(k for k in a if not np.array_equal(a[k], b[k]))
    assert not different, f"differ: {different[:5]}"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", pytest.param("portable", marks=pytest.mark.timeout(1200))])
def test_two_workers_give_the_sequential_runs_checkpoint_bit_for_bit(backend, tmp_path):
    flags = ["--backend", backend, "--algo", "fedara", "--model", "fedavgcnn", "--rank-tiers", "1.0,0.5",
             "--aggregate", "updates", "--cache-dir", str(tmp_path / "cache")]
    sequential = final_tensors(tmp_path / "one", *flags, "--workers", "1")
    parallel = final_tensors(tmp_path / "two", *flags, "--workers", "2")
    assert any(k.startswith("device/") for k in parallel)  # the devices' heads came back from the workers
    assert_identical(sequential, parallel)


@pytest.mark.slow
def test_local_training_keeps_each_workers_devices_models_across_rounds(tmp_path):
    """Local training: the whole model is personal and lives in the worker between rounds."""
    flags = ["--algo", "local", "--model", "fedavgcnn"]
    assert_identical(final_tensors(tmp_path / "one", *flags), final_tensors(tmp_path / "two", *flags, "--workers", "3",
                                                                          "--device", "cpu"))


def test_devices_go_round_robin_to_the_workers():
    assert assign(["d2", "d0", "d1", "d3", "d4"], 2) == {"d0": 0, "d1": 1, "d2": 0, "d3": 1, "d4": 0}


class FakeDevice:
    shard, plan_hash, personal = None, "no-such-plan", {}


def test_an_error_in_a_worker_names_the_worker_the_device_and_the_error():
    pool = DevicePool({"dev_000": FakeDevice()}, {}, WorkerSettings("torch", 1), workers=2)
    try:
        with pytest.raises(WorkerError, match=r"simulate worker 0 failed on dev_000: KeyError: 'no-such-plan'"):
            pool.answer({"dev_000": object()})
    finally:
        pool.close()


def run_simulate(*flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.simulate", *flags], capture_output=True, text=True,
                          timeout=120, env=child_env(**(env or {})))


def test_cuda_without_a_gpu_is_a_one_line_error():
    done = run_simulate("--device", "cuda", env={"CUDA_VISIBLE_DEVICES": ""})  # no GPU visible, on any machine
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: --device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); use --device cpu"]


@pytest.mark.parametrize("flags, fix", [(["--device", "cuda", "--backend", "ort"], "use --backend torch"),
                                        (["--workers", "0"], "--workers must be >= 1")])
def test_flag_mistakes_exit_2_naming_the_flag(flags, fix):
    done = run_simulate(*flags)
    assert done.returncode == 2 and fix in done.stderr and "Traceback" not in done.stderr
