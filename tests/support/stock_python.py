"""A fixture: an interpreter whose environment holds what the device bundle pins (stock onnxruntime, numpy,
paho-mqtt, cryptography), for tests that measure or run the portable runtime as a device installs it."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.processes import child_env
from tests.support.scripts import load_script

INSTALL_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def stock_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An interpreter whose environment holds what the device bundle pins (stock onnxruntime, numpy, paho-mqtt,
    cryptography), installed from the package index the bundle installs from."""
    bundle = load_script("build_device_bundle")
    venv = tmp_path_factory.mktemp("stock") / "venv"
    requirements = venv.parent / bundle.REQUIREMENTS_NAME
    requirements.write_text(bundle.pinned_requirements(bundle.installed_versions(bundle.PINNED)))
    for command in ([sys.executable, "-m", "venv", str(venv)],
                    [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--quiet",
                     "--disable-pip-version-check", "-r", str(requirements)]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S,
                              env=child_env(drop=("PYTHONPATH", "VIRTUAL_ENV")))
        assert done.returncode == 0, done.stdout + done.stderr
    return str(venv / "bin" / "python")
