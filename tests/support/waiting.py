"""The one condition wait: tests wait on something they can observe, never a fixed sleep."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

WAIT_POLL_S = 0.05

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout: float, what: str, *,
             alive: Callable[[], None] | None = None, poll_s: float = WAIT_POLL_S) -> T:
    """Poll ``condition`` until it returns something truthy, and return that; fail naming ``what`` once
    ``timeout`` seconds passed. ``alive``, called before each poll, raises to fail early (the process that should
    bring the condition about has died)."""
    deadline = time.monotonic() + timeout
    while True:
        if alive is not None:
            alive()
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(poll_s)
