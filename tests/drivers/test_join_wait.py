"""The server's wait for devices measures the devices: time it spends handling their messages (building their
artifacts, seconds each on a loaded machine) moves the --join-timeout deadline on."""
from __future__ import annotations

import time

from tests.support.hostile_world import open_server

HANDLE_S = 0.4
MESSAGES = 4
TIMEOUT_S = 1.0
"""Handling all messages takes longer than the timeout; waiting between them takes no time at all."""


def pump_slow_messages(server, handling_counts: bool) -> tuple[bool, int]:
    handled = []

    def slow_handle(topic: str, payload: bytes) -> None:
        time.sleep(HANDLE_S)
        handled.append(topic)

    server._handle = slow_handle
    server.endpoint.get = lambda timeout: ("fedara/dev/x/up", b"")
    done = server._pump(lambda: len(handled) == MESSAGES, time.monotonic() + TIMEOUT_S,
                        handling_counts=handling_counts)
    return done, len(handled)


def test_the_join_wait_does_not_count_the_time_spent_handling_messages(world) -> None:
    assert pump_slow_messages(open_server(world), handling_counts=False) == (True, MESSAGES)


def test_a_round_wait_counts_the_time_spent_handling_messages(world) -> None:
    done, handled = pump_slow_messages(open_server(world), handling_counts=True)
    assert not done and handled < MESSAGES
