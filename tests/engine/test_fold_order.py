"""The fold order (server.engine.fold_order): accepted updates are folded in device-id order, never arrival order."""
from server.engine.fold_order import FoldOrder


def test_an_update_waits_for_a_lower_id_that_may_still_answer():
    folds = FoldOrder(["dev_2", "dev_0", "dev_1"])
    folds.hold("dev_1", "u1", 10)
    assert folds.ready(lambda d: True) == []  # dev_0 may still answer
    folds.hold("dev_0", "u0", 10)
    assert folds.ready(lambda d: True) == [("dev_0", "u0"), ("dev_1", "u1")]


def test_a_device_that_cannot_answer_any_more_is_passed_over():
    folds = FoldOrder(["dev_0", "dev_1"])
    folds.hold("dev_1", "u1", 10)
    assert folds.ready(lambda d: d != "dev_0") == [("dev_1", "u1")]


def test_arrival_order_does_not_change_the_fold_order():
    orders = []
    for arrival in (["dev_0", "dev_1", "dev_2"], ["dev_2", "dev_1", "dev_0"], ["dev_1", "dev_2", "dev_0"]):
        folds, folded = FoldOrder(arrival), []
        for device_id in arrival:
            folds.hold(device_id, device_id, 1)
            folded += folds.ready(lambda d: True)
        orders.append([d for d, _ in folded])
    assert orders == [["dev_0", "dev_1", "dev_2"]] * 3


def test_closing_folds_everything_held_in_id_order():
    folds = FoldOrder(["dev_0", "dev_1", "dev_2"])
    folds.hold("dev_2", "u2", 10)
    folds.hold("dev_1", "u1", 10)
    assert folds.ready(lambda d: True, closing=True) == [("dev_1", "u1"), ("dev_2", "u2")]
    assert folds.held == {} and folds.held_bytes == 0


def test_past_the_held_bytes_bound_waiting_updates_are_folded_at_once():
    folds = FoldOrder(["dev_0", "dev_1", "dev_2"], max_held_bytes=15)
    folds.hold("dev_1", "u1", 10)
    assert folds.ready(lambda d: True) == [] and not folds.overflowing
    folds.hold("dev_2", "u2", 10)
    assert folds.overflowing
    assert folds.ready(lambda d: True) == [("dev_1", "u1"), ("dev_2", "u2")]
    assert not folds.overflowing


def test_an_update_arriving_after_its_turn_was_passed_over_is_folded_at_once():
    """Past the bound the order moves on without dev_0; its update, when it comes, is folded, not held for good."""
    folds = FoldOrder(["dev_0", "dev_1", "dev_2"], max_held_bytes=5)
    folds.hold("dev_1", "u1", 10)
    assert folds.ready(lambda d: True) == [("dev_1", "u1")]
    folds.hold("dev_0", "u0", 10)
    assert folds.ready(lambda d: True) == [("dev_0", "u0")]
    assert folds.held == {} and folds.held_bytes == 0
