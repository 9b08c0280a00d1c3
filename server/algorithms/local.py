"""Local training: every client trains its own dense model on its own data; nothing is sent or averaged."""
from __future__ import annotations

from device_runtime.task import Phase
from server.algorithms.base import Algorithm


class Local(Algorithm):
    name = "local"
    returns = "none"

    def phases(self, local_epochs: int) -> tuple[Phase, ...]:
        return (Phase("all", local_epochs),)
