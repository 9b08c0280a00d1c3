"""A full local round through device_runtime, in a fresh interpreter, never loads torch or onnx, on either runtime.

torch and onnx are installed in this environment (the server needs them), so the check is real: the training
build's own ``onnxruntime/__init__`` would import both; the device must load the ORT bindings without it (runtime
detection included). And it starts lean: one malloc arena for all its threads, its compute probe run before its
agent's modules load.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from device_runtime.shard import Shard, save_shard
from tests.support.processes import child_env
from tests.support.sealing import write_key

REPO = Path(__file__).resolve().parents[2]
ROUND_TIMEOUT_S = 60

DEVICE_ROUND = """
import json, sys
import numpy as np
from device_runtime.artifact_contract import verify_artifacts
from device_runtime.runtimes import detect, open_trainer

directory, expected_hash = sys.argv[1], sys.argv[2]
verify_artifacts(directory, expected_hash)
detect("auto")
trainer = open_trainer(directory)
rng = np.random.default_rng(0)
x = rng.standard_normal((12, 1, 28, 28)).astype(np.float32)
y = rng.integers(0, 10, 12).astype(np.int64)
trainer.set_fe(trainer.get_fe())
anchors, mask = trainer.compute_anchors(x, y)
result = trainer.train(x, y, anchors=anchors, mask=mask, lam=2.0, mu=1e-3, lr=0.01, epochs=1, batch_size=8, rng=rng)
evaluation = trainer.evaluate(x, y)
update = trainer.get_fe()
forbidden = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "onnx"))
print(json.dumps({"steps": result.steps, "total": evaluation.total, "tensors": len(update), "forbidden": forbidden}))
"""


def test_a_device_round_loads_neither_torch_nor_onnx(artifacts):
    done = subprocess.run([sys.executable, "-c", DEVICE_ROUND, str(artifacts.directory), artifacts.hash],
                          cwd=REPO, capture_output=True, text=True, timeout=ROUND_TIMEOUT_S,
                          env=child_env(repo_on_path=True))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["forbidden"] == []
    assert (report["steps"], report["total"], report["tensors"]) == (2, 12, len(artifacts.fe_names))


def test_a_plain_device_never_loads_the_crypto_library():
    """``cryptography`` (about 7 MiB resident) is loaded at the first secure-aggregation key, never by a device that
    only trains: the measured tier floors hold no such library."""
    probe = ("import sys, device_runtime.__main__, device_runtime.agent, device_runtime.messages; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'cryptography'))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                          timeout=ROUND_TIMEOUT_S, env=child_env(repo_on_path=True))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"



DEVICE_START = """
import json, sys, threading
import device_runtime.malloc_arenas as arenas
import device_runtime.probe as probe
events = []
measure, share = probe.probe_gflops, arenas.share_one_arena

def probe_spy(*args, **kwargs):
    events.append(["probe", sorted(m for m in sys.modules if m == "device_runtime.agent" or "onnxruntime" in m)])
    return measure(*args, **kwargs)

def share_spy():
    events.append(["one arena", threading.active_count()])
    return share()

probe.probe_gflops, arenas.share_one_arena = probe_spy, share_spy
from device_runtime.__main__ import main
print(json.dumps({"status": main(sys.argv[1:]), "events": events}))
"""


@pytest.fixture(scope="module")
def device_start(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A device's start-up, seen by spies on its malloc arenas and its compute probe: it stops at its first bad
    flag after its profile (--max-inbound-mb 0)."""
    folder = tmp_path_factory.mktemp("device_start")
    shard = folder / "dev_000.npz"
    rng = np.random.default_rng(0)
    save_shard(shard, Shard(rng.random((4, 3), dtype=np.float32), np.arange(4) % 2,
                            rng.random((2, 3), dtype=np.float32), np.arange(2) % 2, 2))
    args = ["--broker", "mqtt://127.0.0.1:1", "--device-id", "dev_000", "--data", str(shard),
            "--workdir", str(folder / "work"), "--key-file", str(write_key(folder / "dev_000.key")),
            "--max-inbound-mb", "0"]
    done = subprocess.run([sys.executable, "-c", DEVICE_START, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=ROUND_TIMEOUT_S, env=child_env(repo_on_path=True))
    assert "--max-inbound-mb" in done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_device_shares_one_malloc_arena_before_any_thread_starts(device_start):
    """device_runtime.malloc_arenas: set once a second thread has allocated, the network thread's would be its own."""
    assert device_start["status"] == 2 and device_start["events"][0] == ["one arena", 1]


def test_the_device_runs_its_compute_probe_once_before_it_loads_its_agent_and_onnxruntime(device_start):
    """The probe's arrays (12 MiB, device_runtime.probe) come and go while the process holds little more than
    numpy: beside the agent's modules and the onnxruntime bindings they set a small model's device peak."""
    assert [event for event in device_start["events"] if event[0] == "probe"] == [["probe", []]]
