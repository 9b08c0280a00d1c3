"""Waiting for the broker at start-up (a device, the server, an aggregator): when to say why, when to give up, and
what the reason says."""
from __future__ import annotations

import logging
import socket
import threading

import pytest

from device_runtime.broker_wait import (BrokerUnreachableError, REPORT_EVERY_S, final_reason, report_due, timed_out,
                                        unreachable_reason, wait_for_broker)
from tests.support.broker import free_loopback_port
from device_runtime.transport import MqttEndpoint


def test_the_first_failure_is_reported_at_once():
    assert report_due(None, now=0.5)


def test_reports_repeat_no_more_often_than_every_report_interval():
    assert not report_due(10.0, now=10.0 + REPORT_EVERY_S - 0.1)
    assert report_due(10.0, now=10.0 + REPORT_EVERY_S)


def test_the_wait_ends_at_the_connect_timeout():
    assert not timed_out(100.0, now=399.9, timeout_s=300.0)
    assert timed_out(100.0, now=400.0, timeout_s=300.0)


def test_a_zero_connect_timeout_waits_for_ever():
    assert not timed_out(0.0, now=1e9, timeout_s=0.0)


def test_a_port_nobody_listens_on_is_connection_refused():
    port = free_loopback_port()
    assert unreachable_reason("127.0.0.1", port) == f"connection refused (is the broker running at 127.0.0.1:{port}?)"


def test_a_listener_that_speaks_no_mqtt_is_told_apart_from_a_missing_broker():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert "accepts TCP connections but no MQTT session" in unreachable_reason("127.0.0.1", port)


def test_an_unknown_host_is_named():
    reason = unreachable_reason("no-such-host.invalid", 1883)
    assert reason.startswith("cannot resolve the broker host 'no-such-host.invalid'")


def test_a_refused_broker_is_named_after_the_first_try_and_the_timeout_names_its_flag(caplog):
    """What the server and its aggregators do at start (``--broker-connect-timeout``): the cause comes with the first
    failed try, not only when the wait is over."""
    port = free_loopback_port()
    endpoint = MqttEndpoint("wait-test", f"mqtt://127.0.0.1:{port}", subscriptions=[])
    endpoint.start()
    caplog.set_level(logging.WARNING, logger="fedara.server")
    try:
        with pytest.raises(BrokerUnreachableError) as raised:
            wait_for_broker(endpoint, threading.Event(), 2.5, flag="--broker-connect-timeout",
                            log=logging.getLogger("fedara.server"))
    finally:
        endpoint.stop()
    warnings = [r.getMessage() for r in caplog.records if r.name == "fedara.server"]
    assert warnings[0] == (f"connection refused (is the broker running at 127.0.0.1:{port}?); retrying until "
                           "--broker-connect-timeout 2.5 s")
    assert str(raised.value) == (f"no broker at 127.0.0.1:{port} after --broker-connect-timeout 2.5 s: connection "
                                 f"refused (is the broker running at 127.0.0.1:{port}?)")


def test_the_server_and_its_aggregators_take_the_one_connect_timeout_flag():
    from server import aggregator, broker_loop

    for parser in (broker_loop.build_parser(), aggregator.build_parser()):
        action = next(a for a in parser._actions if a.dest == "broker_connect_timeout")
        assert action.option_strings == ["--broker-connect-timeout"] and action.default == 30.0


def test_a_loopback_port_nobody_listens_on_is_final_at_once():
    port = free_loopback_port()
    assert final_reason("127.0.0.1", port, grace_s=0.0).startswith(
        f"connection refused: nothing listens on 127.0.0.1:{port} on this machine")


def test_a_name_that_does_not_resolve_is_final_and_a_listener_is_not():
    assert final_reason("no-such-host.invalid", 1883).startswith("cannot resolve the broker host")
    with socket.create_server(("127.0.0.1", 0)) as server:
        assert final_reason("127.0.0.1", server.getsockname()[1]) is None


def test_a_loopback_broker_that_starts_within_the_grace_is_not_refused():
    """A broker started beside the server (`mosquitto -p PORT & python -m server.broker_loop ...`) listens late."""
    port = free_loopback_port()
    started: list[socket.socket] = []

    def pause(seconds: float) -> None:  # the broker comes up while the probe waits
        if not started:
            started.append(socket.create_server(("127.0.0.1", port)))

    try:
        assert final_reason("127.0.0.1", port, grace_s=5.0, pause=pause) is None
    finally:
        for server in started:
            server.close()


def test_the_server_gives_up_on_a_refused_loopback_broker_at_the_first_try():
    port = free_loopback_port()
    endpoint = MqttEndpoint("wait-final", f"mqtt://127.0.0.1:{port}", subscriptions=[])
    endpoint.start()
    try:
        with pytest.raises(BrokerUnreachableError, match=f"no broker at 127.0.0.1:{port}: connection refused"):
            wait_for_broker(endpoint, threading.Event(), 300.0, final_at_once=True)
    finally:
        endpoint.stop()


def test_a_listener_whose_session_is_not_up_yet_is_not_called_broken_in_the_first_seconds(caplog):
    """A healthy broker may take a few seconds to bring the first MQTT session up (NATS's MQTT gateway): no false
    alarm before SESSION_GRACE_S; the timeout still names the cause."""
    caplog.set_level(logging.WARNING, logger="fedara.server")
    with socket.create_server(("127.0.0.1", 0)) as server:
        endpoint = MqttEndpoint("wait-grace", f"mqtt://127.0.0.1:{server.getsockname()[1]}", subscriptions=[])
        endpoint.start()
        try:
            with pytest.raises(BrokerUnreachableError, match="accepts TCP connections but no MQTT session"):
                wait_for_broker(endpoint, threading.Event(), 2.5, log=logging.getLogger("fedara.server"),
                                final_at_once=True)
        finally:
            endpoint.stop()
    assert [r for r in caplog.records if r.name == "fedara.server"] == []
