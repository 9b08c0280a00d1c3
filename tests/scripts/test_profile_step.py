"""scripts/profile_step.py: a compiled step graph profiled by op type and node, with the session-settings study."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "profile_step.py"


@pytest.mark.slow
def test_a_compiled_step_is_profiled_and_its_session_settings_timed(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--config", "fedavgcnn:1x28x28", "--ratios", "0.25",
                           "--runs", "2", "--repeats", "1", "--sessions", "--torch", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "profile_step.json").read_text())["results"]
    assert set(results) == {"fedavgcnn 1x28x28 0.25", "PyTorch eager fedavgcnn 1x28x28 0.25"}
    eager = results.pop("PyTorch eager fedavgcnn 1x28x28 0.25")["torch"]
    assert {"convolution", "convolution_backward"} <= set(eager["by_op_us"])
    assert sum(eager["by_op_us"].values()) == pytest.approx(eager["ops_cpu_us"]) and eager["step_cpu_us"] > 0
    (label, result), = results.items()
    profile = result["profile"]
    assert sum(profile["by_op_us"].values()) == pytest.approx(profile["kernel_us"])
    assert "Gather" in profile["by_op_us"]  # conv2 runs by patches in this compiler
    assert set(result["sessions"]["1t"]) == {"basic", "extended", "all"}
    assert result["sessions"]["graphs_interleaved_1t"]["cpu_ms"] > 0
    assert set(result["sessions"]["load_ms"]) == {"graph_at_all", "saved_optimized"}
    assert "| fedavgcnn 1x28x28 0.25 |" in (tmp_path / "profile_step.md").read_text()


def test_a_graph_that_is_not_there_is_refused_naming_the_flag(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--graph", f"old={tmp_path / 'none.onnx'}", "--out-dir",
                           str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--graph old=" in done.stderr and "no file" in done.stderr
    assert "Traceback" not in done.stderr


def test_nothing_to_profile_is_refused(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "--config" in done.stderr and "--graph" in done.stderr
