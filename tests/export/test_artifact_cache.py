"""The tests' artifact cache kept between runs: named by the compiler's code, so a change to it never reuses
graphs compiled before; caches of other code versions go once unused for long."""
from __future__ import annotations

import os
from pathlib import Path

from tests.support.artifact_cache import STALE_AFTER_S, compiler_digest, session_cache


def source_tree(root: Path) -> Path:
    for name in ("export/step_compiler.py", "fedcore/models.py", "device_runtime/artifact_contract.py",
                 "server/report.py"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"# {name}\n")
    return root


def test_a_change_to_the_compilers_code_changes_the_cache_folder(tmp_path: Path):
    root = source_tree(tmp_path)
    before = compiler_digest(root)
    (root / "export/step_compiler.py").write_text("# a changed pass\n")
    assert compiler_digest(root) != before


def test_a_change_outside_the_compiler_keeps_the_cache_folder(tmp_path: Path):
    root = source_tree(tmp_path)
    before = compiler_digest(root)
    (root / "server/report.py").write_text("# a changed report\n")
    assert compiler_digest(root) == before


def test_other_code_versions_caches_go_once_unused_for_long_and_recent_ones_stay(tmp_path: Path):
    first = session_cache(tmp_path, now=1_000.0)
    stale, recent = tmp_path / "stale", tmp_path / "recent"
    stale.mkdir()
    recent.mkdir()
    now = 1_000.0 + STALE_AFTER_S + 1
    os.utime(stale, (0.0, 0.0))
    os.utime(recent, (now, now))
    assert session_cache(tmp_path, now=now) == first
    assert first.exists() and recent.exists() and not stale.exists()
