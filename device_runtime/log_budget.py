"""A log budget against floods: on an open broker anyone can publish junk as fast as the broker takes it, and
every frame refused is a log line. Unbounded, that fills a board's SD card or the server's disk, and a full disk
stops the run (checkpoints, heads). Each kind of line (its logger and format string) gets a token bucket: a
burst, then a steady rate. Lines over the budget are held back and counted; the next line of that kind that
passes says how many were held back. Errors always pass. INFO lines are budgeted too (the transport's, the
server's, the engine's and the device's: each is caused by something that arrived, and anyone can make things
arrive), but an INFO line's kind also has its subject, its first argument when that is text (a device id): a
thousand devices joining at once each spend their own budget, while one device's line repeated a thousand times
is held back. Counters such as the transport's ``frames_rejected`` still count every refusal.
"""
from __future__ import annotations

import logging
from collections.abc import Hashable

BURST_LINES = 200
"""Lines of one kind that pass at once: more than any genuine run writes of one kind in a few seconds."""
LINES_PER_S = 20.0
"""Steady rate per kind once the burst is spent: about 5 KB/s of one kind instead of megabytes."""
FLOOD_LOGGERS = {"fedara.transport": logging.INFO, "fedara.server": logging.INFO,
                 "fedara.engine": logging.INFO, "fedara.aggregator": logging.WARNING,
                 "fedara.device": logging.INFO}
"""The loggers that write a line per inbound message (refused or taken), and the lowest level budgeted on each."""
MAX_KINDS = 10_000
"""Kinds of line a LineBudget tracks at once; past it, the longest-unused kind is forgotten (its budget refills)."""


class LineBudget:
    """One token bucket per key; the pure core of FloodFilter (time comes in as ``now``, seconds)."""

    def __init__(self, burst: int = BURST_LINES, per_s: float = LINES_PER_S) -> None:
        if burst < 1 or not per_s > 0:
            raise ValueError(f"burst must be >= 1 and per_s > 0, got {burst} and {per_s}")
        self.burst, self.per_s = burst, per_s
        self._tokens: dict[Hashable, tuple[float, float]] = {}  # key -> (tokens, at)
        self._held: dict[Hashable, int] = {}

    def admit(self, key: Hashable, now: float) -> int | None:
        """None when this line is held back; else how many lines of its kind were held back since the last one
        that passed."""
        tokens, at = self._tokens.pop(key, (float(self.burst), now))  # re-inserted below: the newest kind last
        tokens = min(float(self.burst), tokens + max(0.0, now - at) * self.per_s)
        if len(self._tokens) >= MAX_KINDS:
            oldest = next(iter(self._tokens))
            del self._tokens[oldest]
            self._held.pop(oldest, None)
        if tokens < 1.0:
            self._tokens[key] = (tokens, now)
            self._held[key] = self._held.get(key, 0) + 1
            return None
        self._tokens[key] = (tokens - 1.0, now)
        return self._held.pop(key, 0)


class FloodFilter(logging.Filter):
    """A logger filter spending a LineBudget per (logger, format string) on lines from ``lowest`` up to WARNING;
    a line that passes after some were held back ends with how many."""

    def __init__(self, budget: LineBudget | None = None, lowest: int = logging.WARNING) -> None:
        super().__init__()
        self.budget, self.lowest = budget or LineBudget(), lowest

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.lowest <= record.levelno < logging.ERROR:
            return True
        held = self.budget.admit(_kind(record), record.created)
        if held is None:
            return False
        if held:
            record.msg = f"{record.getMessage()} [{held} more like this held back by the log budget]"
            record.args = None
        return True


def _kind(record: logging.LogRecord) -> Hashable:
    """A line's kind: its logger and format string, and for an INFO line its subject (first argument, if text)."""
    args = record.args if isinstance(record.args, tuple) else ()
    subject = args[0] if record.levelno < logging.WARNING and args and isinstance(args[0], str) else None
    return record.name, str(record.msg), subject


def hold_back_floods(loggers: dict[str, int] | None = None) -> None:
    """Put a FloodFilter on each of ``loggers`` (default FLOOD_LOGGERS), all spending one LineBudget (a process's
    entry point calls this once; again replaces them)."""
    loggers = FLOOD_LOGGERS if loggers is None else loggers
    lift_flood_budget(loggers)
    budget = LineBudget()
    for name, lowest in loggers.items():
        logging.getLogger(name).addFilter(FloodFilter(budget, lowest))


def lift_flood_budget(loggers: dict[str, int] | None = None) -> None:
    """Take the FloodFilters off ``loggers`` (default FLOOD_LOGGERS): every line passes again."""
    for name in FLOOD_LOGGERS if loggers is None else loggers:
        logger = logging.getLogger(name)
        for flood in [f for f in logger.filters if isinstance(f, FloodFilter)]:
            logger.removeFilter(flood)
