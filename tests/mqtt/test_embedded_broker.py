"""The embedded broker (amqtt) keeps working while clients subscribe and disconnect at the same time."""
from __future__ import annotations

from server.mqtt.embedded_broker import EmbeddedBroker, SubscriptionTable


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
