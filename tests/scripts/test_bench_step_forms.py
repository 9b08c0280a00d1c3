"""scripts/bench_step_forms.py: how it counts the updates float16 weights lose, and its --arm64 flag's one-line
refusal where the emulation is missing (its measurements are benchmarks, not tests)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.support.processes import child_env
from tests.support.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_step_forms.py"


def test_lost_updates_count_only_the_parameters_the_float32_step_changes(tmp_path: Path):
    bench = load_script("bench_step_forms")
    start = np.array([1.0, 2.0, 3.0, 4.0], np.float32)  # float16-representable, as seed_weights writes them
    np.savez(tmp_path / "start.npz", w=start)
    np.savez(tmp_path / "f32.npz", w=np.array([1.0, 2.0001, 3.5, 4.0], np.float32))  # two change
    np.savez(tmp_path / "f16.npz", w=np.array([1.0, 2.0, 3.5, 4.0], np.float16))  # 2.0001 rounds back to 2
    lost = bench.lost_updates(str(tmp_path / "start.npz"), str(tmp_path / "f32.npz"), str(tmp_path / "f16.npz"))
    assert lost == dict(changed=0.5, float16_lost_of_changed=0.5)


def test_arm64_without_the_emulated_root_is_refused_in_one_line(tmp_path: Path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--arm64", "--out-dir", str(tmp_path)], capture_output=True,
                          text=True, timeout=60, env=child_env(FEDARA_ARM64_ROOT=str(tmp_path / "none")))
    assert done.returncode == 2
    assert done.stderr.startswith("error: --arm64: ") and len(done.stderr.strip().splitlines()) == 1


def test_every_pool_backward_form_routes_the_gradient_to_the_first_maximum_as_pytorch_does(tmp_path: Path):
    import onnxruntime as ort
    import torch
    bench = load_script("bench_step_forms")
    feeds = bench.pool_feeds(np.random.default_rng(1), 2, 3, 4, 6)  # the upper half: every window a tie
    x = torch.from_numpy(feeds["X"]).requires_grad_()
    y = torch.nn.functional.max_pool2d(x, 2)
    y.backward(torch.from_numpy(feeds["G"]))
    for form in bench.POOL_FORMS:
        session = ort.InferenceSession(bench._pool_graph(form, 2, 3, 4, 6), providers=["CPUExecutionProvider"])
        pooled, grad = session.run(["Y", "dX"], feeds)
        np.testing.assert_array_equal(pooled, y.detach().numpy(), err_msg=form)
        np.testing.assert_array_equal(grad, x.grad.numpy(), err_msg=form)
