"""The README's main command, as written there, runs twice in a row from a clean clone (a newcomer pastes it
twice): both exit 0, each into its own run folder with a report. Run by .ci/run (marker ``readme``)."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 600
pytestmark = [pytest.mark.readme, pytest.mark.slow]


def readme_commands() -> list[str]:
    """The two set-up-and-go commands: the first two ```bash blocks of the README."""
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text(), re.S)[:2]


def test_the_readme_opens_with_a_run_command_and_a_test_command():
    run, test = readme_commands()
    assert run.startswith("scripts/setup.sh && .venv/bin/python -m server.broker_loop")
    assert test == "scripts/setup.sh && .venv/bin/python -m pytest -q"


def test_the_main_command_runs_twice_from_a_clean_clone(tmp_path: Path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    setup, command = readme_commands()[0].split(" && ", 1)
    argv = shlex.split(command)
    assert setup == "scripts/setup.sh" and argv[0] == ".venv/bin/python"
    for attempt in (1, 2):
        done = subprocess.run([sys.executable, *argv[1:]], cwd=clone, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
        assert done.returncode == 0, f"run {attempt}: {done.stderr[-3000:]}"
        assert "accuracy after round 5" in done.stdout
    folders = sorted((clone / "runs").iterdir())
    assert len(folders) == 2 and all((f / "report.md").is_file() and (f / "metrics.jsonl").is_file() for f in folders)
