"""Every bash block of README.md and docs/*.md run as tests/support/doc_blocks.py describes: as written (or its
short twin), from the root of a scratch copy of this tree with the venv and the artifact cache linked in, so a
command's outputs land in the copy and the clone stays clean. One slow test per block; the fast check that every
block runs, is shortened or is skipped for a reason is tests/architecture/test_doc_blocks.py."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.support.doc_blocks import REPO, Block, command_blocks
from tests.support.processes import child_env

pytestmark = pytest.mark.slow
LINKED = (".venv", "artifacts_cache")  # the interpreter, and compiled artifacts (content-keyed: safe to share)


def scratch_copy(into: Path) -> Path:
    """This tree's files (tracked, and new ones git does not ignore) copied under ``into``, LINKED linked."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                            check=True).stdout.decode().split("\0")
    root = into / "repo"
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name)
    for name in LINKED:
        if (REPO / name).exists():
            (root / name).symlink_to(REPO / name)
    return root


@pytest.mark.parametrize("block", [pytest.param(b, id=b.name, marks=pytest.mark.timeout(b.timeout_s + 120))
                                   for b in command_blocks() if b.skip is None])
def test_the_documented_command_runs(block: Block, tmp_path: Path):
    root = scratch_copy(tmp_path)
    log = tmp_path / "output.txt"  # a file, not a pipe: a broker the block leaves running holds no pipe open
    with open(log, "w") as output:
        process = subprocess.Popen(["bash", "-e", "-c", block.script()], cwd=root, stdout=output,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                   env=child_env(PATH=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"))
        try:
            process.wait(timeout=block.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            pytest.fail(f"{block.name} ran past {block.timeout_s} s:\n{log.read_text()[-3000:]}")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)  # what the block left in the background (a broker)
    assert process.returncode == 0, f"{block.name} exited {process.returncode}:\n{log.read_text()[-4000:]}"
