"""The embedded broker (amqtt) keeps working while clients subscribe and disconnect at the same time, and says nothing
alarming about the MQTT 5 probe every endpoint sends it."""
from __future__ import annotations

import logging

from device_runtime.transport import speaks_mqtt5
from server.mqtt.embedded_broker import EmbeddedBroker, SubscriptionTable
from tests.support.endpoints import WAIT_S
from tests.support.waiting import wait_for


def test_the_subscription_table_can_change_while_it_is_iterated():
    table = SubscriptionTable({"a/#": [], "b/#": []})
    seen = []
    for topic in table:  # amqtt awaits inside such a loop: another client's subscribe and disconnect run meanwhile
        seen.append(topic)
        table[f"new/{topic}"] = []
        table.pop("b/#", None)
    assert seen == ["a/#", "b/#"] and set(table) == {"a/#", "new/a/#", "new/b/#"}


def test_the_running_broker_keeps_its_subscriptions_in_that_table():
    with EmbeddedBroker() as broker:
        assert type(broker._broker._subscriptions) is SubscriptionTable


def test_an_mqtt5_probe_it_refuses_is_no_warning(caplog):
    """Every endpoint probes the broker with an MQTT 5 CONNECT (speaks_mqtt5); amqtt refuses it, as expected, and
    its two lines about it are debug lines, not warnings on the user's console."""
    caplog.set_level(logging.DEBUG, logger="amqtt.broker")
    with EmbeddedBroker() as broker:
        assert not speaks_mqtt5(broker.url)
        wait_for(lambda: any("Invalid protocol" in r.getMessage() for r in caplog.records), WAIT_S,
                 "amqtt to log the refused MQTT 5 CONNECT")
    refusals = [r for r in caplog.records if r.name == "amqtt.broker" and "nvalid" in r.getMessage()]
    assert len(refusals) == 2 and all(r.levelno == logging.DEBUG for r in refusals)
