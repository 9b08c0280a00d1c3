"""The per-round progress lines both drivers print: training as a round closes, accuracy when the next round
(or the final evaluation) brings it, and an ETA from the mean round time so far."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

LOG = logging.getLogger("fedara.progress")


def print_and_log(line: str) -> None:
    """On the terminal, and in the run's log file (server.log) where one is attached."""
    print(line, flush=True)
    LOG.info(line)


class Progress:
    """Prints one line per closed round and one per completed evaluation."""

    def __init__(self, rounds: int, emit: Callable[[str], None] | None = None):
        self.rounds = rounds
        self.round_seconds: list[float] = []
        self.emit = emit or print_and_log

    def _eta(self, round_index: int) -> str:
        """The rounds left times the mean round so far (rounds only: compiling artifacts and waiting for devices
        to join happen once, before round 1)."""
        if not self.round_seconds:
            return "–"
        left = sum(self.round_seconds) / len(self.round_seconds) * (self.rounds - round_index)
        return f"{left / 60:.1f} min" if left >= 120 else f"{left:.0f} s"

    def trained(self, record: dict[str, Any]) -> None:
        self.round_seconds.append(record["seconds"])
        loss = record["train_loss"]
        self.emit(f"round {record['round']}/{self.rounds}  loss {'–' if loss is None else f'{loss:.4f}'}  "
                  f"participants {record['participants']}/{record['selected']}  dropped {len(record['dropped'])}  "
                  f"down {record['bytes_down'] / 1e6:.2f} MB  up {record['bytes_up'] / 1e6:.2f} MB  "
                  f"artifacts {record['bytes_artifacts'] / 1e6:.2f} MB  {record['seconds']:.1f}s  "
                  f"ETA {self._eta(record['round'])}")

    def evaluated(self, record: dict[str, Any] | None) -> None:
        if record is None:
            return
        accuracy = record["accuracy"]
        text = "–" if accuracy is None else f"{accuracy:.4f} ±{record['accuracy_std']:.4f}"
        tiers = "  ".join(f"{t}: {v['accuracy']:.4f}" for t, v in record.get("per_tier", {}).items()
                          if v["accuracy"] is not None)
        self.emit(f"  accuracy after round {record['round']}: {text} ({record['evaluated']} devices)"
                  + (f"  by tier {tiers}" if len(record.get("per_tier", {})) > 1 else ""))
