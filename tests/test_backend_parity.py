"""The device runtime (onnxruntime) and the PyTorch reference run the same federation to the same result."""
from pathlib import Path

import numpy as np

from server.run_setup import RunFolder
from server.simulate import Simulation, build_parser

ARGS = ["--dataset", "digits", "--clients", "4", "--rounds", "3", "--local-epochs", "1", "--batch-size", "32",
        "--max-samples", "800", "--lr", "0.05", "--lam", "2", "--lam-warmup", "1", "--rank-tiers", "1.0,0.25"]


def run(backend: str, out: Path, cache: Path, *flags: str) -> tuple[list[dict], dict[str, np.ndarray]]:
    args = build_parser().parse_args([*ARGS, "--backend", backend, "--cache-dir", str(cache), "--out", str(out),
                                      *flags])
    out.mkdir()
    simulation = Simulation(args, RunFolder(out))
    return simulation.run(), simulation.engine.global_arrays()


def assert_same_federation(tmp_path: Path, *flags: str) -> None:
    torch_records, torch_fe = run("torch", tmp_path / "torch", tmp_path / "cache", *flags)
    ort_records, ort_fe = run("ort", tmp_path / "ort", tmp_path / "cache", *flags)
    assert [r["round"] for r in ort_records] == [r["round"] for r in torch_records]
    assert abs(torch_records[-1]["accuracy"] - ort_records[-1]["accuracy"]) <= 0.01
    assert set(torch_fe) == set(ort_fe) and torch_fe
    for name in torch_fe:
        np.testing.assert_allclose(ort_fe[name], torch_fe[name], atol=1e-4, err_msg=name)


def test_ort_and_torch_backends_reach_the_same_accuracy_and_global_fe(tmp_path):
    assert_same_federation(tmp_path)


def test_fedrep_head_then_fe_phases_agree_across_backends(tmp_path):
    """FedRep's two phases (head on the frozen FE, then the FE with the head frozen) on both trainers."""
    assert_same_federation(tmp_path, "--algo", "fedrep", "--rounds", "2")


def test_the_portable_runtime_runs_the_federation_of_the_training_runtime(tmp_path):
    """Stock onnxruntime's compiled step graph and onnxruntime-training's training API, over a whole federation."""
    portable_records, portable_fe = run("portable", tmp_path / "portable", tmp_path / "cache")
    ort_records, ort_fe = run("ort", tmp_path / "ort", tmp_path / "cache")
    assert set(portable_fe) == set(ort_fe) and portable_fe
    for name in ort_fe:
        np.testing.assert_allclose(portable_fe[name], ort_fe[name], atol=1e-4, err_msg=name)
    assert [r["accuracy"] for r in portable_records] == [r["accuracy"] for r in ort_records]
