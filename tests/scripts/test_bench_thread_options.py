"""scripts/bench_thread_options.py: every variant it times is a session onnxruntime opens and runs, and a bad flag
is refused in one line (its timings are benchmarks, not tests)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from tests.support.processes import child_env
from tests.support.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_thread_options.py"


def test_every_variant_opens_a_session_that_runs(tmp_path: Path):
    bench = load_script("bench_thread_options")
    value = helper.make_tensor_value_info
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [value("x", TensorProto.FLOAT, [4])],
                              [value("y", TensorProto.FLOAT, [4])])
    path = tmp_path / "relu.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString())
    x = np.array([-1.0, 0.0, 1.0, 2.0], np.float32)
    for variant in bench.VARIANTS:
        session = ort.InferenceSession(str(path), bench._options(ort, variant), providers=["CPUExecutionProvider"])
        assert session.run(None, {"x": x})[0].tolist() == [0.0, 0.0, 1.0, 2.0], variant


def test_a_bad_config_is_refused_in_one_line_naming_the_flag(tmp_path: Path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--config", "fedavgcnn", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, env=child_env())
    assert done.returncode == 2
    assert done.stderr.startswith("error: --config: ") and len(done.stderr.strip().splitlines()) == 1
