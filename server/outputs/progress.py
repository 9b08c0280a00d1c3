"""The progress lines both drivers print: training as a round closes (or, in ``--mode async``, as a version is
made), accuracy when its row is complete (the next round's evaluations; in async mode whenever the evaluations a
version's row waits for are in), and an ETA in wall seconds from the mean round (version) time so far."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

LOG = logging.getLogger("fedara.progress")
SHARED_DOWN = " (one payload per tier)"
"""How the bytes down are labelled where each tier's weights are published once for its devices (the MQTT sync
loop), not sent with every device's task (the simulator, async mode): the same figure means less there."""


def final_line(records: Sequence[dict[str, Any]], folder: Path, report: Path) -> str:
    """The line a run ends with (both drivers): its last accuracy, named by its round as the progress lines name
    it, and what it wrote."""
    evaluated = [r for r in records if r.get("accuracy") is not None]
    unit = "version" if evaluated and evaluated[-1].get("mode") == "async" else "round"
    final = f"{evaluated[-1]['accuracy']:.4f} (after {unit} {evaluated[-1]['round']})" if evaluated else "–"
    return f"final accuracy {final}; wrote {folder / 'metrics.jsonl'}, metrics.csv and {report}"


def print_and_log(line: str) -> None:
    """On the terminal, and in the run's log file (server.log) where one is attached."""
    print(line, flush=True)
    LOG.info(line)


class Progress:
    """Prints one line per closed round and one per completed evaluation. ``unit``: what ``--rounds`` counts
    ("round", or "version" in async mode); ``clock``: the wall clock async versions are timed on (a version's record
    holds engine time); ``virtual``: that engine time is the simulator's virtual clock, shown beside the wall time;
    ``shared_down``: the bytes down are each tier's payload, published once (MQTT), not every device's task's."""

    def __init__(self, rounds: int, emit: Callable[[str], None] | None = None, unit: str = "round",
                 clock: Callable[[], float] = time.monotonic, virtual: bool = False, shared_down: bool = False):
        self.rounds = rounds
        self.down = f"down{SHARED_DOWN}" if shared_down else "down"
        self.unit = unit
        self.virtual = virtual
        self.round_seconds: list[float] = []
        self.emit = emit or print_and_log
        self.clock = clock
        self._shown_rows = 0  # rows of the engine's records whose accuracy line is out (``follow``)
        self._shown_version = 0
        self._last_at = clock()

    def begin(self, version: int, records: Sequence[dict[str, Any]]) -> None:
        """Async mode: the run (or its resume) starts at ``version`` with ``records`` written before it (not shown
        again); the first version is timed from now."""
        self._shown_version, self._shown_rows, self._last_at = version, len(records), self.clock()

    def follow(self, version: int, made: dict[str, Any] | None, records: Sequence[dict[str, Any]]) -> None:
        """Async mode, after anything that may make a version or complete a row: the accuracy line of every row
        completed since the last call (rows complete late and out of step with versions: a row waits for the
        evaluations asked of its version), then the line of the version just made (``made``: its record, while
        its row is pending). A driver calls this after every update it hands the engine (one update makes at most
        one version), so no version and no row goes unsaid."""
        for row in records[self._shown_rows:]:
            self.evaluated(row)
        self._shown_rows = len(records)
        if version > self._shown_version and made is not None:
            self._shown_version = version
            now = self.clock()
            self.trained(made, wall_seconds=now - self._last_at)
            self._last_at = now

    def _eta(self, round_index: int) -> str:
        """The rounds left times the mean round so far (rounds only: compiling artifacts and waiting for devices
        to join happen once, before round 1)."""
        if not self.round_seconds:
            return "–"
        left = sum(self.round_seconds) / len(self.round_seconds) * (self.rounds - round_index)
        return f"{left / 60:.1f} min" if left >= 120 else f"{left:.0f} s"

    def trained(self, record: dict[str, Any], wall_seconds: float | None = None) -> None:
        """A round's (version's) line. ``wall_seconds``: async mode's wall time since the previous version (the
        record's ``seconds`` are then engine time, and the simulator's virtual clock is added as ``virtual``)."""
        seconds = record["seconds"] if wall_seconds is None else wall_seconds
        self.round_seconds.append(seconds)
        loss = record["train_loss"]
        who = (f"participants {record['participants']}/{record['selected']}" if wall_seconds is None
               else f"updates {record['participants']}")
        virtual = (f"  virtual {record['sim_time']:.1f}s" if self.virtual and record.get("sim_time") is not None
                   else "")
        self.emit(f"{self.unit} {record['round']}/{self.rounds}  loss {'–' if loss is None else f'{loss:.4f}'}  "
                  f"{who}  dropped {len(record['dropped'])}  "
                  f"{self.down} {record['bytes_down'] / 1e6:.2f} MB  up {record['bytes_up'] / 1e6:.2f} MB  "
                  f"artifacts {record['bytes_artifacts'] / 1e6:.2f} MB  {seconds:.1f}s{virtual}  "
                  f"ETA {self._eta(record['round'])}")

    def evaluated(self, record: dict[str, Any] | None) -> None:
        if record is None:
            return
        accuracy = record["accuracy"]
        text = "–" if accuracy is None else f"{accuracy:.4f} ±{record['accuracy_std']:.4f}"
        tiers = "  ".join(f"{t}: {v['accuracy']:.4f}" for t, v in record.get("per_tier", {}).items()
                          if v["accuracy"] is not None)
        self.emit(f"  accuracy after {self.unit} {record['round']}: {text} ({record['evaluated']} devices)"
                  + (f"  by tier {tiers}" if len(record.get("per_tier", {})) > 1 else ""))
