"""The device on arm64, by emulation: the bundle installs with pip from the package index inside an arm64 Debian,
trains a local round on server-built step artifacts, joins a federation whose server runs natively here, and
classifies its test split with the model it kept (``python -m device_runtime predict``).

Needs root on an x86_64 Debian host (``scripts/arm64_emulation.sh`` installs qemu-user-static, debootstrap and
binfmt-support, and builds the root file system once under .arm64/). Marked ``arm64``: the default suite leaves it
out; ``.ci/run`` runs it after the suite with ``pytest -m arm64``. The workload is tiny (emulation is ~100× slower).
"""
from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from device_runtime.artifact_contract import PORTABLE_KIND
from device_runtime.shard import Shard, save_shard
from export.artifacts import build_artifacts_of_kind
from fedcore.models import build_model
from server.data.datasets import load_dataset
from server.mqtt.enrollment import enroll_devices
from tests.support.machine import missing_root, require

pytestmark = pytest.mark.arm64

ROOT = Path(__file__).resolve().parents[2]
EMULATION = ROOT / "scripts" / "arm64_emulation.sh"
SETUP_TIMEOUT_S = 900
INSTALL_TIMEOUT_S = 900
ROUND_TIMEOUT_S = 600
TRAIN, TEST, BATCH = 48, 16, 16
PREFIX = "/opt/fedara-device"  # inside the emulated root file system
LOCAL_ROUND = """
import json, platform, sys
import numpy as np
from device_runtime.runtimes import open_trainer
from device_runtime.shard import load_shard

trainer = open_trainer(sys.argv[1])
shard = load_shard(sys.argv[2])
anchors, mask = trainer.compute_anchors(shard.x_train, shard.y_train)
result = trainer.train(shard.x_train, shard.y_train, anchors=anchors, mask=mask, lam=2.0, mu=1e-3, lr=0.05, epochs=1,
                       batch_size=int(sys.argv[3]), rng=np.random.default_rng(0))
print(json.dumps(dict(machine=platform.machine(), trainer=type(trainer).__name__, steps=result.steps,
                      loss=result.loss, heavy=sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "onnx")))))
"""
PARITY_EPOCH = """
import sys
import numpy as np
from device_runtime.runtimes import open_trainer

given = np.load(sys.argv[2])
trainer = open_trainer(sys.argv[1])
trainer.set_fe({k: given[k] for k in given.files if k.startswith("fe.")})
trainer.set_head({k: given[k] for k in given.files if k.startswith("head.")})
anchors, mask = trainer.compute_anchors(given["x"], given["y"], batch_size=8)
trainer.train(given["x"], given["y"], anchors=given["anchors"], mask=given["mask"], lam=float(given["lam"]), mu=1e-3,
              lr=0.05, epochs=1, batch_size=8, rng=np.random.default_rng(3))
np.savez(sys.argv[3], anchors=anchors, mask=mask, **trainer.get_fe(), **trainer.get_head())
"""


def _missing() -> str | None:
    """What the emulation lacks here, in words a user can act on; None: nothing."""
    if platform.machine() != "x86_64" or not sys.platform.startswith("linux"):
        return "an x86_64 Linux host (the emulation recipe is for one)"
    if not shutil.which("debootstrap") and not shutil.which("apt-get"):
        return "debootstrap not found (apt-get install debootstrap)"
    return missing_root("debootstrap, binfmt_misc and chroot need it")


def emulated(command: str, work: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run a shell command line inside the arm64 root file system, ``work`` bind-mounted at its own path."""
    return subprocess.run([str(EMULATION), "run", "--bind", str(work), command], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require(_missing())
    done = subprocess.run([str(EMULATION), "setup"], capture_output=True, text=True, timeout=SETUP_TIMEOUT_S)
    if done.returncode != 0 and "binfmt" in done.stderr:
        require(f"binfmt_misc with qemu-aarch64 enabled (scripts/arm64_emulation.sh setup: {done.stderr.strip()})")
    assert done.returncode == 0, done.stdout + done.stderr
    return tmp_path_factory.mktemp("arm64")


@pytest.fixture(scope="module")
def installed(work: Path) -> str:
    """The bundle built here, installed inside the emulated arm64 Debian by its install.sh; the install's output."""
    bundle = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_device_bundle.py"), "--out",
                             str(work / "dist")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bundle.returncode == 0, bundle.stderr
    tarball = Path(bundle.stdout.strip())
    done = emulated(f"rm -rf {PREFIX} && cd {work} && tar xzf {tarball} && "
                    f"bash {work}/{tarball.name.removesuffix('.tar.gz')}/install.sh --prefix {PREFIX}",
                    work, INSTALL_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def shard(work: Path) -> Path:
    """A tiny digits shard (the server's own loader, so its shapes match the server's model)."""
    data = load_dataset("digits")
    rng = np.random.default_rng(0)
    order = rng.permutation(len(data.y))
    train, test = order[:TRAIN], order[TRAIN:TRAIN + TEST]
    path = work / "client_000.npz"
    save_shard(path, Shard(data.x[train], data.y[train], data.x[test], data.y[test], data.num_classes))
    return path


def test_the_bundle_installs_with_pip_on_aarch64_and_picks_stock_onnxruntime(installed: str):
    assert f"runtime: {PORTABLE_KIND}, aarch64" in installed


def test_the_arm64_device_trains_a_local_round_on_server_built_artifacts(installed: str, work: Path, shard: Path):
    data = load_dataset("digits")
    model = build_model("fedavgcnn", data.input_shape, data.num_classes, seed=0)
    artifacts = build_artifacts_of_kind(PORTABLE_KIND, model, {}, data.input_shape, data.num_classes, work / "cache")
    (work / "round.py").write_text(LOCAL_ROUND)
    done = emulated(f"{PREFIX}/venv/bin/python {work}/round.py {artifacts.directory} {shard} {BATCH}", work,
                    ROUND_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(result)
    assert result["machine"] == "aarch64" and result["trainer"] == "PortableTrainer" and result["heavy"] == []
    assert result["steps"] == TRAIN // BATCH and np.isfinite(result["loss"])


def test_the_arm64_device_joins_a_native_federation_and_its_update_is_aggregated(installed: str, work: Path,
                                                                                  shard: Path, start_mosquitto):
    broker = start_mosquitto()
    out = work / "run"
    enroll_devices(work / "enrollment.json", ["arm64_000"], work / "keys")  # the key crosses into the chroot by bind
    server = subprocess.Popen([sys.executable, "-m", "server.broker_loop", "--dataset", "digits", "--broker",
                               broker.url, "--enroll", str(work / "enrollment.json"),
                               "--min-devices", "1", "--rounds", "1", "--batch-size", str(BATCH),
                               "--max-samples", str(TRAIN + TEST), "--local-epochs", "1", "--join-timeout",
                               str(ROUND_TIMEOUT_S), "--round-deadline", str(ROUND_TIMEOUT_S), "--cache-dir",
                               str(work / "cache"), "--out", str(out)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    device = subprocess.Popen([str(EMULATION), "run", "--bind", str(work),
                               f"uname -m >&2; exec {PREFIX}/venv/bin/python -m device_runtime --broker {broker.url} "
                               f"--device-id arm64_000 --data {shard} --workdir {work}/device "
                               f"--key-file {work}/keys/arm64_000.key"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        server_log, _ = server.communicate(timeout=2 * ROUND_TIMEOUT_S)
    finally:
        device.terminate()
        device_log, _ = device.communicate(timeout=60)
        server.kill()
    print(device_log[-3000:])
    assert server.returncode == 0, server_log[-3000:] + device_log[-3000:]
    assert device_log.splitlines()[0] == "aarch64"
    (record,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert record["round"] == 1 and record["participants"] == 1 and record["bytes_up"] > 0  # arm64_000 alone

    # The owner's model, on the board, broker gone: predict scores what the device reported for the final model.
    done = emulated(f"{PREFIX}/venv/bin/python -m device_runtime predict --workdir {work}/device --json {shard}",
                    work, ROUND_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    predictions = np.array(json.loads(done.stdout.strip().splitlines()[-1])["predictions"])
    y_test = np.load(shard)["y_test"]
    assert predictions.shape == y_test.shape
    assert (predictions == y_test).sum() / len(y_test) == record["per_device"]["arm64_000"]["accuracy"]

@pytest.mark.parametrize("ranks, lam", [({}, 0.0), ({"fe.conv2": 80, "fe.fc1": 256}, 2.0)], ids=["dense", "factorized"])
def test_an_arm64_epoch_equals_the_pytorch_reference(installed: str, work: Path, ranks: dict, lam: float):
    """tests/export/test_parity.py's oracle on aarch64's kernels (MLAS's NEON paths, numpy's OpenBLAS for ARM): one epoch
    of the portable step graph, anchors included, against PyTorch on this host, within the same 1e-5."""
    from fedcore.lowrank import factorize_model, fe_state
    from fedcore.objective import compute_anchors
    from server.training import train_local
    from tests.support.parity import CLASSES, PARAM_ATOL, SHAPE

    model = build_model("fedavgcnn", SHAPE, CLASSES, seed=0)
    reference = factorize_model(model, ranks)
    rng = np.random.default_rng(1)
    y = rng.integers(0, CLASSES - 2, 20).astype(np.int64)
    x = rng.standard_normal((20, *SHAPE)).astype(np.float32)
    anchors, mask = compute_anchors(reference.fe, x, y, CLASSES, batch_size=8)
    start = {k: v.detach().numpy().copy() for k, v in reference.state_dict().items()}
    given, got = work / f"parity-in-{len(ranks)}.npz", work / f"parity-out-{len(ranks)}.npz"
    np.savez(given, x=x, y=y, anchors=anchors, mask=mask, lam=lam,
             **{k: v for k, v in start.items() if k in fe_state(reference) or k.startswith("head.")})
    train_local(reference, x, y, anchors=anchors, mask=mask, lam=lam, mu=1e-3, lr=0.05, epochs=1, batch_size=8,
                rng=np.random.default_rng(3))
    artifacts = build_artifacts_of_kind(PORTABLE_KIND, model, ranks, SHAPE, CLASSES, work / "cache")
    (work / "parity.py").write_text(PARITY_EPOCH)
    done = emulated(f"{PREFIX}/venv/bin/python {work}/parity.py {artifacts.directory} {given} {got}", work,
                    ROUND_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    device = dict(np.load(got))
    np.testing.assert_array_equal(device.pop("mask"), mask)
    np.testing.assert_allclose(device.pop("anchors"), anchors, atol=1e-5)
    expected = {k: v.detach().numpy() for k, v in reference.state_dict().items()}
    assert set(device) == set(expected)
    moved = max(float(np.abs(expected[k] - start[k]).max()) for k in expected)
    assert moved > 100 * PARAM_ATOL  # the epoch moved the weights far beyond the tolerance
    for name, value in device.items():
        np.testing.assert_allclose(value, expected[name], rtol=0, atol=PARAM_ATOL, err_msg=name)
