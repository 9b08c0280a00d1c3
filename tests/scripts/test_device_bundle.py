"""The flashable device bundle: what it holds, and that it installs into a fresh venv without torch and trains.

One module-scoped install (build the bundle, run its install.sh into a new virtual environment holding only the
device's requirements: stock onnxruntime, numpy, paho-mqtt, from the configured package index) serves the install
tests; one test runs the installed runtime's ``run_task`` on server-built portable step artifacts in the venv's
own interpreter, another runs the installed device CLI in a real federation over a local broker.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

from device_runtime.shard import SHARD_KEYS, Shard, save_shard
from device_runtime.artifact_contract import PORTABLE_KIND
from export.artifacts import build_artifacts_of_kind
from fedcore.lowrank import RankPlan, resolve_plan
from fedcore.models import build_model
from server.data.datasets import load_dataset
from server.mqtt.embedded_broker import EmbeddedBroker
from server.data.partition import make_client_shards, write_shards
from tests.support.scripts import load_script
from tests.support.sealing import enrollment_file, write_key
from tests.support.machine import missing_binary, require
from tests.support.processes import child_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "build_device_bundle.py"
INSTALL_TIMEOUT_S = 240
FEDERATION_TIMEOUT_S = 180
SHAPE = (1, 28, 28)
CLASSES = 10
TRAIN, TEST, BATCH = 40, 8, 16
ROUND_SCRIPT = """
import json, sys
import device_runtime
from device_runtime.local_round import run_task
from device_runtime.shard import load_shard
from device_runtime.task import Phase, Task
from device_runtime.runtimes import open_trainer

artifacts, shard_path, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
shard = load_shard(shard_path)
trainer = open_trainer(artifacts)
update = run_task(trainer, shard, Task(2, trainer.get_fe(), 1.0, 1e-3, 0.05, (Phase("all", 1),), batch, 0))
print(json.dumps(dict(runtime=device_runtime.__file__, trainer=type(trainer).__name__, steps=update.metrics["steps"],
                      loss=update.train_loss, fe=sorted(update.weights),
                      heavy=sorted(m for m in ("torch", "onnx") if m in sys.modules))))
"""


CLEAN = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
"""What of this environment the bundle's processes must not see: the test venv leaking in."""


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The extracted fedara-device-<version>/ folder of a freshly built bundle."""
    out = tmp_path_factory.mktemp("bundle")
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    bundle = Path(done.stdout.strip())
    assert bundle.parent == out and bundle.name.startswith("fedara-device-") and bundle.name.endswith(".tar.gz")
    with tarfile.open(bundle) as tar:
        tar.extractall(out / "x", filter="data")
    (folder,) = (out / "x").iterdir()
    return folder


@pytest.fixture(scope="module")
def prefix(bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """install.sh run into a new prefix; returns the prefix."""
    target = tmp_path_factory.mktemp("install") / "fedara-device"
    done = subprocess.run(["bash", str(bundle_dir / "install.sh"), "--prefix", str(target), "--python", sys.executable],
                          capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, env=child_env(drop=CLEAN), cwd=target.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    return target


def venv_python(prefix: Path) -> str:
    return str(prefix / "venv" / "bin" / "python")


def test_bundle_holds_wheel_requirements_installer_unit_settings_and_guide(bundle_dir: Path):
    names = sorted(p.name for p in bundle_dir.iterdir())
    version = load_script("build_device_bundle").project_version(ROOT / "pyproject.toml")
    assert bundle_dir.name == f"fedara-device-{version}"
    assert names == sorted([f"fedara_device-{version}-py3-none-any.whl", "requirements-device.txt", "install.sh",
                            "fedara-device.service", "fedara-device.env", "DEVICE.md"])
    assert os.access(bundle_dir / "install.sh", os.X_OK)


def test_the_bundles_guide_is_written_for_a_board_owner(bundle_dir: Path):
    guide = (bundle_dir / "DEVICE.md").read_text()
    assert guide == (ROOT / "scripts" / "device_bundle" / "DEVICE.md").read_text()
    for needed in ("--key-file", "/etc/fedara/device.key", "LoadCredential=", "journalctl -u fedara-device",
                   "fedara-device.env", *SHARD_KEYS, "float32", "int64"):
        assert needed in guide, needed
    for outside_the_bundle in (".ci/run", "tests/", "python -m server", "server/", "pytest"):
        assert outside_the_bundle not in guide, outside_the_bundle


def test_the_unit_hands_the_root_only_key_to_its_dynamic_user_as_a_credential(bundle_dir: Path):
    unit = (bundle_dir / "fedara-device.service").read_text()
    assert "DynamicUser=yes" in unit and "LoadCredential=device.key:/etc/fedara/device.key" in unit
    assert "--key-file ${CREDENTIALS_DIRECTORY}/device.key" in unit
    assert "KEY_FILE" not in (bundle_dir / "fedara-device.env").read_text()


def test_systemd_finds_nothing_wrong_with_the_installed_unit(bundle_dir: Path, tmp_path: Path):
    require(missing_binary("systemd-analyze", "systemd"))
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").symlink_to(sys.executable)
    shutil.copy(bundle_dir / "fedara-device.env", tmp_path)
    unit = tmp_path / "fedara-device.service"
    unit.write_text((bundle_dir / "fedara-device.service").read_text().replace("@PREFIX@", str(tmp_path)))
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


def test_wheel_is_pure_python_and_holds_only_device_runtime(bundle_dir: Path):
    (wheel,) = bundle_dir.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        top = {name.split("/")[0] for name in archive.namelist()}
        modules = {name for name in archive.namelist() if name.endswith(".py")}
        wheel_meta = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/WHEEL"))).decode()
    assert top == {"device_runtime", wheel.name.removesuffix("-py3-none-any.whl") + ".dist-info"}
    assert modules == {f"device_runtime/{p.name}" for p in (ROOT / "device_runtime").glob("*.py")}  # predict's too
    assert "Root-Is-Purelib: true" in wheel_meta and "Tag: py3-none-any" in wheel_meta


def test_requirements_pin_numpy_paho_cryptography_and_stock_onnxruntime_and_nothing_heavy(bundle_dir: Path):
    pins = [line for line in (bundle_dir / "requirements-device.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    assert [line.split("==")[0] for line in pins] == ["numpy", "paho-mqtt", "cryptography", "cffi", "pycparser",
                                                     "onnxruntime"]
    assert all("==" in line for line in pins)


@pytest.mark.slow
def test_install_leaves_torch_and_onnx_out_of_the_venv(prefix: Path):
    for module in ("torch", "onnx"):
        done = subprocess.run([venv_python(prefix), "-c", f"import {module}"], capture_output=True, text=True,
                              env=child_env(drop=CLEAN), cwd=prefix)
        assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr


@pytest.mark.slow
def test_install_writes_the_unit_and_settings_for_its_prefix(prefix: Path):
    unit = (prefix / "fedara-device.service").read_text()
    assert f"ExecStart={prefix}/venv/bin/python -m device_runtime " in unit
    assert f"EnvironmentFile={prefix}/fedara-device.env" in unit and "@PREFIX@" not in unit
    assert "FEDARA_BROKER=" in (prefix / "fedara-device.env").read_text()


@pytest.mark.slow
def test_installed_device_trains_a_local_round(prefix: Path, tmp_path: Path, shared_artifact_cache: Path):
    model = build_model("fedavgcnn", SHAPE, CLASSES, seed=0)
    artifacts = build_artifacts_of_kind(PORTABLE_KIND, model, resolve_plan(model, RankPlan(0.25)).ranks, SHAPE, CLASSES,
                                        shared_artifact_cache)
    rng = np.random.default_rng(0)
    save_shard(tmp_path / "shard.npz", Shard(rng.standard_normal((TRAIN, *SHAPE), dtype=np.float32),
                                             rng.integers(0, CLASSES, TRAIN).astype(np.int64),
                                             rng.standard_normal((TEST, *SHAPE), dtype=np.float32),
                                             rng.integers(0, CLASSES, TEST).astype(np.int64), CLASSES))
    script = tmp_path / "round.py"
    script.write_text(ROUND_SCRIPT)
    done = subprocess.run([venv_python(prefix), str(script), str(artifacts.directory), str(tmp_path / "shard.npz"),
                           str(BATCH)], capture_output=True, text=True, env=child_env(drop=CLEAN), cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(result["runtime"]).is_relative_to(prefix / "venv")
    assert result["steps"] == math.ceil(TRAIN / BATCH) and math.isfinite(result["loss"])
    assert result["fe"] == sorted(artifacts.fe_names) and result["heavy"] == []
    assert result["trainer"] == "PortableTrainer"


@pytest.mark.slow
def test_installed_device_joins_a_federation_over_a_local_broker_and_trains(prefix: Path, tmp_path: Path,
                                                                            shared_artifact_cache: Path):
    data = load_dataset("digits")
    (shard_path,) = write_shards(make_client_shards(data, "dirichlet", 1, seed=0, alpha=1.0), tmp_path / "shards")
    out = tmp_path / "run"
    with EmbeddedBroker() as broker:
        url = broker.url
        server = subprocess.Popen([sys.executable, "-m", "server.broker_loop", "--dataset", "digits", "--broker", url,
                                   "--min-devices", "1", "--rounds", "1", "--batch-size", "64", "--max-samples", "0",
                                   "--rank-ratio", "0.25", "--round-deadline", "300", "--join-timeout", "300",
                                   "--cache-dir", str(shared_artifact_cache), "--out", str(out),
                                   "--enroll", str(enrollment_file(tmp_path / "enroll.json", ["dev_000"]))],
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        device = subprocess.Popen([venv_python(prefix), "-m", "device_runtime", "--broker", url, "--device-id", "dev_000",
                                   "--data", str(shard_path), "--workdir", str(tmp_path / "device"),
                                   "--key-file", str(write_key(tmp_path / "dev_000.key"))],
                                  cwd=tmp_path, env=child_env(drop=CLEAN), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
        try:
            server_log, _ = server.communicate(timeout=FEDERATION_TIMEOUT_S)
        finally:
            device.terminate()
            device_log, _ = device.communicate(timeout=30)
            server.kill()
    assert server.returncode == 0, server_log + device_log
    (record,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert record["round"] == 1 and record["participants"] == 1 and record["bytes_up"] > 0
    assert (tmp_path / "device" / "artifacts").is_dir()


def test_modules_importing_beyond_the_device_dependencies_are_named(tmp_path: Path):
    package = tmp_path / "device_runtime"
    package.mkdir()
    (package / "ok.py").write_text("import json\nimport numpy as np\nfrom paho.mqtt import client\nfrom . import ok\n")
    (package / "heavy.py").write_text("import torch.nn\nfrom onnx import helper\n")
    assert load_script("build_device_bundle").foreign_imports(package) == {"device_runtime/heavy.py": ["onnx", "torch"]}


def test_the_shipped_device_runtime_imports_only_device_dependencies():
    assert load_script("build_device_bundle").foreign_imports(ROOT / "device_runtime") == {}


STOCK_IMPORT_PROBE = """
import importlib.util, json, sys
sys.path.append(sys.argv[1])  # this environment's packages, behind the venv's own
importable = [bool(importlib.util.find_spec(name)) for name in ("torch", "onnx")]
import onnxruntime
from device_runtime.runtimes import detect
print(json.dumps(dict(importable=importable, onnxruntime=onnxruntime.__file__, kind=detect("auto"),
                      loaded=sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "onnx")))))
"""


@pytest.mark.slow
def test_stock_onnxruntime_imports_neither_torch_nor_onnx_even_where_both_are_importable(prefix: Path):
    import torch

    site = str(Path(torch.__file__).parents[1])
    done = subprocess.run([venv_python(prefix), "-c", STOCK_IMPORT_PROBE, site], capture_output=True, text=True,
                          env=child_env(drop=CLEAN), cwd=prefix)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["importable"] == [True, True] and result["loaded"] == []
    assert Path(result["onnxruntime"]).is_relative_to(prefix / "venv") and result["kind"] == PORTABLE_KIND
