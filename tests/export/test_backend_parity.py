"""The device runtime (onnxruntime) and the PyTorch reference run the same federation to the same result.

Two backends run different float32 kernels, so their trajectories are not bit-equal: rounding-level differences
flip ReLU and max-pool decisions and grow over the steps of a run, by an amount that depends on the CPU (oneDNN and
MLAS pick code paths by instruction set and thread count). No absolute tolerance holds on every CPU. What holds is
that the backends' disagreement is tiny against what training moved: each tensor's ‖FE_a − FE_b‖ is at most
``AGREEMENT`` of ‖FE_b − FE_initial‖. A wrong gradient (a scale, a missing term, a transposed factor) moves the result
by the order of the movement itself.
"""
from pathlib import Path

import numpy as np
import pytest

from server.run_setup import RunFolder
from server.simulate import Simulation, build_parser

ARGS = ["--dataset", "digits", "--clients", "4", "--rounds", "3", "--local-epochs", "1", "--batch-size", "32",
        "--max-samples", "800", "--lr", "0.05", "--lam", "2", "--lam-warmup", "1", "--rank-tiers", "1.0,0.25"]


AGREEMENT = 1.5e-2
"""Measured, largest over the tensors: ort vs torch 2.1e-6 (Intel, 2026-12-02) and 4e-3 (AMD EPYC), FedRep 1.4e-6
and 1e-5, portable vs ort 4.0e-3 (Intel: fe.fc1.bias, where ReLU/max-pool decisions flipped). The bound is 3.75x the
largest of these; a half-strength λ (``--lam 1`` for 2, the smallest bug named in issue 34) moves fe.conv1.weight
by 6.4e-2 of its movement, 4.3x the bound (checked below)."""


def run(backend: str, out: Path, cache: Path, *flags: str) -> tuple[list[dict], dict[str, np.ndarray],
                                                                     dict[str, np.ndarray]]:
    """A run's records, its final global model and its initial one."""
    args = build_parser().parse_args([*ARGS, "--backend", backend, "--cache-dir", str(cache), "--out", str(out),
                                      *flags])
    out.mkdir()
    simulation = Simulation(args, RunFolder(out))
    initial = {k: v.copy() for k, v in simulation.engine.global_arrays().items()}
    return simulation.run(), simulation.engine.global_arrays(), initial


def assert_agree(got: dict[str, np.ndarray], reference: dict[str, np.ndarray],
                 initial: dict[str, np.ndarray]) -> None:
    """Each tensor of ``got`` is within ``AGREEMENT`` of the distance ``reference`` moved from ``initial``."""
    assert set(got) == set(reference) == set(initial) and reference
    for name, value in reference.items():
        moved = float(np.linalg.norm(value - initial[name]))
        assert moved > 0, f"{name} did not train"
        apart = float(np.linalg.norm(got[name] - value))
        assert apart <= AGREEMENT * moved, f"{name}: backends {apart:.3g} apart, training moved it {moved:.3g}"


def assert_same_federation(tmp_path: Path, cache: Path, *flags: str) -> None:
    torch_records, torch_fe, initial = run("torch", tmp_path / "torch", cache, *flags)
    ort_records, ort_fe, _ = run("ort", tmp_path / "ort", cache, *flags)
    assert [r["round"] for r in ort_records] == [r["round"] for r in torch_records]
    assert abs(torch_records[-1]["accuracy"] - ort_records[-1]["accuracy"]) <= 0.01
    assert_agree(ort_fe, torch_fe, initial)


def test_a_half_strength_lambda_is_outside_the_agreement(tmp_path, shared_artifact_cache):
    """The bound can fail: the same backend at λ = 1 instead of 2 disagrees with itself by more than AGREEMENT."""
    _, full, initial = run("torch", tmp_path / "full", shared_artifact_cache)
    _, half, _ = run("torch", tmp_path / "half", shared_artifact_cache, "--lam", "1")
    with pytest.raises(AssertionError, match="backends .* apart"):
        assert_agree(half, full, initial)


def test_ort_and_torch_backends_reach_the_same_accuracy_and_global_fe(tmp_path, shared_artifact_cache):
    assert_same_federation(tmp_path, shared_artifact_cache)


@pytest.mark.slow
def test_fedrep_head_then_fe_phases_agree_across_backends(tmp_path, shared_artifact_cache):
    """FedRep's two phases (head on the frozen FE, then the FE with the head frozen) on both trainers."""
    assert_same_federation(tmp_path, shared_artifact_cache, "--algo", "fedrep", "--rounds", "2")


@pytest.mark.slow
def test_the_portable_runtime_runs_the_federation_of_the_training_runtime(tmp_path, shared_artifact_cache):
    """Stock onnxruntime's compiled step graph and onnxruntime-training's training API, over a whole federation."""
    portable_records, portable_fe, initial = run("portable", tmp_path / "portable", shared_artifact_cache)
    ort_records, ort_fe, _ = run("ort", tmp_path / "ort", shared_artifact_cache)
    assert_agree(portable_fe, ort_fe, initial)
    assert [r["accuracy"] for r in portable_records] == pytest.approx([r["accuracy"] for r in ort_records], abs=0.01)
