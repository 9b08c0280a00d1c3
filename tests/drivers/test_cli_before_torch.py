"""The drivers answer --help and a mistake in their flags before torch loads: one line, exit 2, in a blink."""
import subprocess
import sys

import pytest

from fedcore.models import ARCHITECTURES
from server.engine import run_config
from server.algorithms import REGISTRY


def imported_modules(stderr: str) -> set[str]:
    """The modules ``python -X importtime`` reports as imported."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def run_driver(driver: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-X", "importtime", "-m", driver, *flags], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("driver", ["server.broker_loop", "server.simulate"])
def test_a_bad_flag_value_is_refused_before_torch_is_imported(driver):
    done = run_driver(driver, "--lam", "-1")
    errors = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert done.returncode == 2
    assert errors == ["error: --lam must be non-negative, got -1"]
    modules = imported_modules(done.stderr)
    assert "server.cli" in modules and "torch" not in modules


@pytest.mark.parametrize("driver", ["server.broker_loop", "server.simulate"])
def test_a_flag_typo_is_one_line_naming_the_close_flag_not_the_usage_before_it(driver):
    done = run_driver(driver, "--rouns", "3")
    errors = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert done.returncode == 2
    assert errors == [f"error: unrecognized arguments: --rouns 3; --rouns: did you mean --rounds? (all flags: "
                      f"python -m {driver} --help)"]
    assert "torch" not in imported_modules(done.stderr)


@pytest.mark.parametrize("driver", ["server.broker_loop", "server.simulate"])
def test_a_data_dir_without_the_dataset_is_named_before_torch_is_imported(driver, tmp_path):
    done = run_driver(driver, "--dataset", "fmnist", "--data-dir", str(tmp_path))
    errors = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert done.returncode == 2 and len(errors) == 1
    assert errors[0].startswith("error: --dataset fmnist: Fashion-MNIST files [")
    assert f"not found in {tmp_path}: install the Debian package" in errors[0]
    assert "torch" not in imported_modules(done.stderr)


@pytest.mark.parametrize("driver", ["server.broker_loop", "server.simulate"])
def test_an_out_folder_that_holds_a_run_is_named_before_torch_is_imported(driver, tmp_path):
    (tmp_path / "checkpoint.npz").write_bytes(b"")
    done = run_driver(driver, "--dataset", "digits", "--out", str(tmp_path))
    errors = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert done.returncode == 2
    assert errors == [f"error: --out {tmp_path} holds a run (checkpoint.npz); pass --resume to continue it, or leave "
                      "--out out to start a new run in a fresh folder"]
    assert "torch" not in imported_modules(done.stderr)


@pytest.mark.parametrize("driver", ["server.broker_loop", "server.simulate"])
def test_help_is_printed_without_importing_torch(driver):
    done = run_driver(driver, "--help")
    assert done.returncode == 0 and "--rounds" in done.stdout
    assert "torch" not in imported_modules(done.stderr)


def test_the_names_the_command_line_offers_are_the_registries():
    assert tuple(REGISTRY) == run_config.ALGORITHMS
    assert tuple(ARCHITECTURES) == run_config.MODELS


@pytest.mark.parametrize("driver", ["server.broker_loop", "server.simulate"])
def test_the_drivers_help_reads_as_plain_text_without_rst_literal_marks(driver):
    module = __import__(driver, fromlist=["build_parser"])
    text = module.build_parser().format_help()
    assert "``" not in text and "python -m" in text
