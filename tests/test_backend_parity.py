"""The device runtime (onnxruntime) and the PyTorch reference run the same federation to the same result."""
import numpy as np
import torch

from server.simulate import build_parser, make_backend, prepare, config_from_args, run_federation

ARGS = ["--dataset", "digits", "--clients", "4", "--rounds", "3", "--local-epochs", "1", "--batch-size", "32",
        "--max-samples", "800", "--lr", "0.05", "--lam", "2", "--lam-warmup", "1", "--rank-tiers", "1.0,0.25"]


def run(backend: str, cache_dir) -> tuple[dict, dict[str, torch.Tensor]]:
    args = build_parser().parse_args(ARGS + ["--backend", backend])
    clients, global_model = prepare(args)
    return run_federation(clients, global_model, config_from_args(args), make_backend(backend, clients, cache_dir),
                          progress=lambda line: None)


def test_ort_and_torch_backends_reach_the_same_accuracy_and_global_fe(tmp_path):
    torch_summary, torch_fe = run("torch", tmp_path)
    ort_summary, ort_fe = run("ort", tmp_path)
    assert abs(torch_summary["final_accuracy"] - ort_summary["final_accuracy"]) <= 0.01
    assert set(torch_fe) == set(ort_fe)
    for name in torch_fe:
        np.testing.assert_allclose(ort_fe[name].numpy(), torch_fe[name].numpy(), atol=1e-4, err_msg=name)
