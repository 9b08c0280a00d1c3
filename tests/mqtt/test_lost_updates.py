"""Updates pushed out half-received: their devices are asked again, a few at a time (server/mqtt/lost_updates.py)."""
import pytest

from server.mqtt.lost_updates import LostUpdates


def test_at_most_at_once_lost_devices_are_asked_again_in_the_order_they_were_lost():
    lost = LostUpdates(at_once=2)
    lost.lost(["dev_3", "dev_1", "dev_2"])
    assert lost.to_ask(lambda d: True) == ["dev_3", "dev_1"]
    assert lost.to_ask(lambda d: True) == []  # both answers still awaited


def test_an_answer_that_came_makes_room_for_the_next():
    lost, awaited = LostUpdates(at_once=2), {"dev_1", "dev_2", "dev_3"}
    lost.lost(["dev_1", "dev_2", "dev_3"])
    lost.to_ask(awaited.__contains__)
    awaited.discard("dev_1")
    assert lost.to_ask(awaited.__contains__) == ["dev_3"]


def test_a_device_no_longer_awaited_is_not_asked():
    lost = LostUpdates()
    lost.lost(["dev_1", "dev_2"])
    assert lost.to_ask(lambda d: d == "dev_2") == ["dev_2"]


def test_an_answer_lost_again_is_asked_for_again():
    lost = LostUpdates(at_once=1)
    lost.lost(["dev_1", "dev_2"])
    assert lost.to_ask(lambda d: True) == ["dev_1"]
    lost.lost(["dev_1"])  # its re-sent answer was pushed out too: it no longer holds a place
    assert lost.to_ask(lambda d: True) == ["dev_2"]
    assert lost.waiting == {"dev_1": None}


def test_at_once_must_be_positive():
    with pytest.raises(ValueError, match="at_once"):
        LostUpdates(at_once=0)
