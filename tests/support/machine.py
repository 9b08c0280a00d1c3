"""The one rule for what a test needs from the machine (a binary, root, a memory controller, a dataset folder):
skipped with the reason on a developer's machine, a failure under CI=true, where a skipped test did not run.

``require(missing)`` in a test or fixture, ``needs(missing)`` as a mark (checked by conftest before fixtures);
the ``missing_*`` helpers say what to install or enable, None when it is there."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CI = os.environ.get("CI") == "true"
"""A CI run: what a test needs from the machine must be there (a skipped test did not run)."""
NEEDS_MARKER = "needs"


def require(missing: str | None) -> None:
    """The one rule for a test that needs something from the machine (a binary, root, a memory controller, a
    dataset folder): ``missing`` None means it is there; otherwise ``missing`` says what to install or enable, and
    the test fails with it under CI=true (a CI step that skips did not run) or skips with it elsewhere."""
    if missing is None:
        return
    if CI:
        pytest.fail(f"CI=true and this machine lacks what the test needs: {missing}", pytrace=False)
    pytest.skip(missing)


def needs(missing: str | None) -> pytest.MarkDecorator:
    """``require(missing)`` as a mark, checked before the test's fixtures are set up: for a test, a class, or a
    module's ``pytestmark``."""
    return getattr(pytest.mark, NEEDS_MARKER)(missing)


def missing_binary(name: str, package: str, path: Path | None = None) -> str | None:
    """None when ``name`` is at ``path`` (where the test runs it from), or on PATH when no path is given; else what
    to install."""
    if (path.exists() if path is not None else shutil.which(name) is not None):
        return None
    return f"{name} not found (apt-get install {package}; scripts/setup.sh installs it)"


def missing_fmnist() -> str | None:
    """None when Debian's Fashion-MNIST files are in their folder; else what to install."""
    from server.data.datasets import FMNIST_DIR, FMNIST_FILES, FMNIST_PACKAGE

    absent = [name for pair in FMNIST_FILES.values() for name in pair if not (FMNIST_DIR / name).is_file()]
    return f"Fashion-MNIST {absent} not in {FMNIST_DIR} (apt-get install {FMNIST_PACKAGE})" if absent else None


def missing_root(why: str) -> str | None:
    """None when this process is root; else that the test must run as root, and ``why``."""
    return None if os.geteuid() == 0 else f"run as root: {why}"


def ci_verdict(exitstatus: int, skipped: list[str]) -> tuple[int, str | None]:
    """The session's exit status under CI=true, and a line naming the skipped tests (None: none skipped). A session
    that ran no test already fails (pytest's exit 5); one that skipped a test fails too: it did not run them all."""
    if not skipped:
        return exitstatus, None
    return (pytest.ExitCode.TESTS_FAILED if exitstatus == pytest.ExitCode.OK else exitstatus,
            f"CI=true: {len(skipped)} test(s) skipped, so this step did not run them all: {', '.join(skipped[:10])}"
            + (" ..." if len(skipped) > 10 else ""))
