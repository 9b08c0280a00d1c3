"""How a command's refusal of a user's mistake looks from outside."""
from __future__ import annotations

import subprocess


def assert_bad_input(done: subprocess.CompletedProcess[str], *fragments: str) -> None:
    """A command refused its input as a user's mistake: exit status 2, no traceback, and a last stderr line that
    holds every fragment."""
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    for fragment in fragments:
        assert fragment in last, last
