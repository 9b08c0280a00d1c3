"""A re-ask of an answered round and the receipt of its answer (device_runtime/answer_receipt.py): the pure rule."""
from __future__ import annotations

from device_runtime.answer_receipt import RECEIPT_WAIT_S, AnswerReceipt, Reask


def test_a_reask_that_crossed_the_answer_waits_for_its_receipt():
    answer = AnswerReceipt(round=3, sent_at=10.0)
    assert answer.reask(10.5) == Reask.HOLD
    assert not answer.due(10.0 + RECEIPT_WAIT_S - 0.1)


def test_the_receipt_drops_the_held_reask():
    answer = AnswerReceipt(round=3, sent_at=10.0)
    answer.reask(10.5)
    assert answer.receipt(3)
    assert not answer.due(10.0 + RECEIPT_WAIT_S + 1)


def test_a_held_reask_whose_receipt_never_came_is_answered_once_when_its_wait_ends():
    answer = AnswerReceipt(round=3, sent_at=10.0)
    answer.reask(10.5)
    assert answer.due(10.0 + RECEIPT_WAIT_S)
    assert not answer.due(10.0 + RECEIPT_WAIT_S + 1)


def test_a_reask_after_the_receipt_sends_nothing():
    answer = AnswerReceipt(round=3, sent_at=10.0)
    answer.receipt(3)
    assert answer.reask(11.0) == Reask.RECEIVED


def test_a_receipt_of_another_round_changes_nothing():
    answer = AnswerReceipt(round=3, sent_at=10.0)
    assert not answer.receipt(2)
    assert answer.reask(11.0) == Reask.HOLD


def test_a_late_reask_gets_the_answer_at_once_receipt_or_not():
    """Only a server that lost the answer asks late (a restart, a resume): an earlier process's receipt must not
    silence it."""
    answer = AnswerReceipt(round=3, sent_at=10.0)
    answer.receipt(3)
    assert answer.reask(10.0 + RECEIPT_WAIT_S) == Reask.SEND
    assert AnswerReceipt(round=3, sent_at=10.0).reask(10.0 + RECEIPT_WAIT_S) == Reask.SEND
