"""The README's commands as a newcomer pastes them: every Python command runs the project's venv interpreter (a bare
``python`` outside the venv ends in ModuleNotFoundError), a run command can be pasted twice (no fixed run folder
that refuses the second time), and nothing is written into the clone outside ``runs/`` (which .gitignore covers)."""
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DRIVERS = ("server.broker_loop", "server.simulate")


def command_lines() -> list[list[str]]:
    """Each command of the README's ```bash blocks, continuation lines joined, split by && into argv lists."""
    blocks = re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text(), re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [shlex.split(part, comments=True) for line in lines for part in line.split(" && ")]


def test_every_python_command_runs_the_venv_interpreter():
    pythons = [argv for argv in command_lines() for word in argv if re.fullmatch(r"(\S*/)?python3?", word)]
    assert pythons, "no python command found in the README"
    assert [argv for argv in pythons if ".venv/bin/python" not in argv] == []


def test_a_run_command_names_no_fixed_run_folder():
    runs = [argv for argv in command_lines() if any(d in argv for d in DRIVERS)]
    assert runs and [argv for argv in runs if "--out" in argv] == []


def test_what_a_command_writes_goes_under_runs_which_git_ignores():
    outs = [argv[argv.index(flag) + 1] for argv in command_lines() for flag in ("--out", "--dir")
            if flag in argv and argv[argv.index(flag) + 1].split("/")[0] not in ("", "/etc")]
    assert outs and all(out.startswith("runs/") for out in outs), outs
    assert "runs/" in (ROOT / ".gitignore").read_text().splitlines()
