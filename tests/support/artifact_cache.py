"""The tests' artifact cache, kept between runs in the user's cache directory and content-addressed twice: the
folder is named by a hash of the code that compiles artifacts (export/, fedcore/ and the artifact contract), and
inside it each set is named, as in any cache, by the hash of all that shapes its graphs (kind, model, ranks,
shapes, tool versions). A change to the compiler's code so never reuses graphs it compiled before the change.

Sets are written by an atomic rename, so concurrent test processes share one compile of each. Tests that damage
or delete artifacts work on a copy (``private_copy``) or keep their own cache."""
from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

ARTIFACT_SHAPE, ARTIFACT_CLASSES = (1, 28, 28), 10
"""The input shape and classes of the ``artifacts`` fixture's model (tests/conftest.py)."""
REPO_ROOT = Path(__file__).resolve().parents[2]
COMPILER_SOURCES = ("export/*.py", "fedcore/*.py", "device_runtime/artifact_contract.py")
"""The code whose change may change compiled artifacts."""
CACHE_ENV = "FEDARA_TEST_ARTIFACT_CACHE"
"""Overrides where the cache lives (CI on a fresh machine, or a read-only home)."""
STALE_AFTER_S = 14 * 24 * 3600
"""Caches of other compiler versions unused for this long are removed when a session starts."""


def compiler_digest(root: Path = REPO_ROOT) -> str:
    """sha256 over the compiler's source files (path and bytes, in path order)."""
    digest = hashlib.sha256()
    for path in sorted(p for pattern in COMPILER_SOURCES for p in root.glob(pattern)):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def cache_root() -> Path:
    """$FEDARA_TEST_ARTIFACT_CACHE, else $XDG_CACHE_HOME/fedara-edge/test-artifacts (~/.cache by default)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "fedara-edge" / "test-artifacts"


def session_cache(root: Path | None = None, now: float | None = None) -> Path:
    """This code's artifact cache folder (created and marked used); other code versions' folders unused for
    STALE_AFTER_S are removed."""
    root = cache_root() if root is None else root
    now = time.time() if now is None else now
    folder = root / compiler_digest()
    folder.mkdir(parents=True, exist_ok=True)
    os.utime(folder, (now, now))
    for other in root.iterdir():
        if other != folder and other.is_dir() and now - other.stat().st_mtime > STALE_AFTER_S:
            shutil.rmtree(other, ignore_errors=True)
    return folder


def private_copy(directory: Path, into: Path) -> Path:
    """A writable copy of one artifact set (``into``/its hash), for a test that damages it."""
    target = into / directory.name
    shutil.copytree(directory, target)
    return target
