"""The log budget: a flood of refused input is counted in full but written to the log at a bounded rate, so it
cannot fill a disk; what was held back is said with the next line of its kind."""
from __future__ import annotations

import logging
import time

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from device_runtime.log_budget import (BURST_LINES, FLOOD_LOGGERS, LINES_PER_S, MAX_KINDS, FloodFilter, LineBudget,
                                      hold_back_floods)
from server.cli import console_logging
from tests.support.waiting import wait_for
from tests.support.endpoints import DEV1, WAIT_S

JUNK_FRAMES = 1000


def test_a_burst_of_lines_passes_then_the_rest_is_held_back():
    budget = LineBudget(burst=3, per_s=1.0)
    assert [budget.admit("k", 0.0) for _ in range(5)] == [0, 0, 0, None, None]


def test_the_budget_refills_at_its_rate_and_the_next_line_says_how_many_were_held_back():
    budget = LineBudget(burst=1, per_s=2.0)
    assert [budget.admit("k", t) for t in (0.0, 0.1, 0.2, 0.5)] == [0, None, None, 2]


def test_each_kind_of_line_has_its_own_budget():
    budget = LineBudget(burst=1, per_s=1.0)
    assert [budget.admit(k, 0.0) for k in ("a", "a", "b")] == [0, None, 0]


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def budgeted() -> tuple[logging.Logger, Lines]:
    """A logger with a 2-line burst refilled at 1 line/s, and the lines it writes."""
    logger, lines = logging.getLogger("fedara.test.budget"), Lines()
    logger.addHandler(lines)
    flood = FloodFilter(LineBudget(burst=2, per_s=1.0))
    logger.addFilter(flood)
    yield logger, lines
    logger.removeFilter(flood)
    logger.removeHandler(lines)


def log_at(logger: logging.Logger, level: int, created: float, msg: str, *args: object) -> None:
    record = logger.makeRecord(logger.name, level, __file__, 0, msg, args, None)
    record.created = created
    logger.handle(record)


def test_the_filter_holds_back_a_flood_and_the_next_line_of_its_kind_says_how_many(budgeted):
    logger, lines = budgeted
    for i in range(5):
        log_at(logger, logging.WARNING, 100.0, "dropped frame %d", i)
    log_at(logger, logging.WARNING, 101.0, "dropped frame %d", 5)
    assert lines.lines == ["dropped frame 0", "dropped frame 1",
                           "dropped frame 5 [3 more like this held back by the log budget]"]


def test_errors_pass_whatever_the_budget(budgeted):
    logger, lines = budgeted
    for i in range(4):
        log_at(logger, logging.ERROR, 100.0, "cannot write checkpoint %d", i)
    assert len(lines.lines) == 4


def test_lines_below_the_budgeted_level_pass_whatever_the_budget(budgeted):
    logger, lines = budgeted
    for i in range(4):
        log_at(logger, logging.DEBUG, 100.0, "frame %d", i)
    assert len(lines.lines) == 4


@pytest.fixture
def info_budgeted(budgeted) -> tuple[logging.Logger, Lines]:
    """``budgeted`` with its budget spent on INFO lines too (as on the server's, engine's and device's loggers)."""
    logger, lines = budgeted
    flood = FloodFilter(LineBudget(burst=2, per_s=1.0), logging.INFO)
    logger.filters = [flood]
    return logger, lines


def test_info_lines_caused_by_one_devices_messages_are_budgeted(info_budgeted):
    logger, lines = info_budgeted
    for _ in range(100):
        log_at(logger, logging.INFO, 100.0, "%s is online while round %d awaits it", "dev_001", 2)
    assert len(lines.lines) == 2


def test_info_lines_of_a_fleets_devices_each_spend_their_own_budget(info_budgeted):
    """A thousand devices joining at once all get their line."""
    logger, lines = info_budgeted
    for i in range(1000):
        log_at(logger, logging.INFO, 100.0, "%s joined", f"dev_{i:04d}")
    assert len(lines.lines) == 1000


def test_the_budget_tracks_a_bounded_number_of_kinds():
    budget = LineBudget(burst=1, per_s=1.0)
    for i in range(MAX_KINDS + 10):
        budget.admit(i, 0.0)
    assert len(budget._tokens) == MAX_KINDS


def test_the_server_cli_logging_puts_the_budget_on_every_flood_logger():
    console_logging()
    assert all(any(isinstance(f, FloodFilter) for f in logging.getLogger(name).filters) for name in FLOOD_LOGGERS)


def test_a_junk_flood_on_an_endpoint_is_counted_in_full_and_logged_within_the_budget(mosquitto_broker, connect,
                                                                                      caplog):
    hold_back_floods()
    server = connect("server", mosquitto_broker.url, subscriptions=[DEV1.up])
    rogue = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="rogue", protocol=mqtt.MQTTv311)
    rogue.connect("127.0.0.1", mosquitto_broker.port)
    rogue.loop_start()
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="fedara.transport"):
        for i in range(JUNK_FRAMES):
            rogue.publish(DEV1.up, f"junk {i}".encode(), qos=1)
        wait_for(lambda: server.stats["frames_rejected"] == JUNK_FRAMES, WAIT_S * 6,
                 f"{JUNK_FRAMES} frames rejected")
    elapsed = time.monotonic() - start
    rogue.loop_stop()
    rogue.disconnect()
    dropped = [r for r in caplog.records if "dropped frame" in r.getMessage()]
    print(f"{JUNK_FRAMES} junk frames counted, {len(dropped)} lines logged, in {elapsed:.2f} s")
    assert BURST_LINES <= len(dropped) <= BURST_LINES + LINES_PER_S * elapsed + 1, (len(dropped), elapsed)
