"""FedAvg: every client trains the whole dense model (FE and head) and the server averages all of it."""
from __future__ import annotations

from device_runtime.task import Phase
from server.algorithms.base import Algorithm


class FedAvg(Algorithm):
    name = "fedavg"
    returns = "all"

    def phases(self, local_epochs: int) -> tuple[Phase, ...]:
        return (Phase("all", local_epochs),)
