"""The one rule for what a test needs from the machine (tests/support/machine.py, hooked in by tests/conftest.py): a local run skips naming what is missing;
under CI=true it fails naming it, and a session that skipped anything fails, so a green CI step ran every test."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import machine
from tests.support.processes import child_env

REPO = Path(__file__).resolve().parents[2]
MISSING = "frobnicator not found (apt-get install frobnicator)"
TIMEOUT_S = 120


def test_nothing_missing_is_no_skip():
    machine.require(None)


@pytest.mark.parametrize("ci, outcome", [(False, pytest.skip.Exception), (True, pytest.fail.Exception)])
def test_a_missing_dependency_skips_locally_and_fails_under_ci(monkeypatch: pytest.MonkeyPatch, ci, outcome):
    monkeypatch.setattr(machine, "CI", ci)
    with pytest.raises(outcome, match=r"frobnicator not found \(apt-get install frobnicator\)"):
        machine.require(MISSING)


@pytest.mark.parametrize("status", [pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED])
def test_under_ci_a_session_that_skipped_fails_naming_the_tests(status):
    verdict, why = machine.ci_verdict(status, ["tests/test_x.py::test_a"])
    assert verdict == pytest.ExitCode.TESTS_FAILED and "1 test(s) skipped" in why and "tests/test_x.py::test_a" in why


@pytest.mark.parametrize("status", [pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED,
                                    pytest.ExitCode.NO_TESTS_COLLECTED])
def test_under_ci_a_session_without_skips_keeps_its_status(status):
    assert machine.ci_verdict(status, []) == (status, None)


def run_session(tmp_path: Path, ci: bool) -> subprocess.CompletedProcess[str]:
    """pytest on a module with a test marked ``needs(MISSING)``, one that skips by hand and one that passes, under
    tests/conftest.py's hooks."""
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import (pytest_configure, pytest_runtest_logreport, pytest_runtest_setup,\n"
        "                            pytest_sessionfinish)\n")
    (tmp_path / "test_sample.py").write_text(
        "import pytest\nfrom tests.support.machine import needs\n\n"
        f"@needs({MISSING!r})\ndef test_needs():\n    pass\n\n"
        "def test_skips_by_hand():\n    pytest.skip('no reason')\n\n"
        "def test_passes():\n    pass\n")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=child_env(drop=("CI",), PYTHONPATH=str(REPO), **({"CI": "true"} if ci else {})))


def test_a_local_session_skips_with_the_reason(tmp_path: Path):
    done = run_session(tmp_path, ci=False)
    assert done.returncode == 0, done.stdout
    assert MISSING in done.stdout and "1 passed, 2 skipped" in done.stdout


def test_a_ci_session_fails_naming_what_is_missing_and_what_skipped(tmp_path: Path):
    done = run_session(tmp_path, ci=True)
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout
    assert f"CI=true and this machine lacks what the test needs: {MISSING}" in done.stdout
    assert "CI=true: 1 test(s) skipped" in done.stdout and "test_skips_by_hand" in done.stdout
