"""A re-ask of an answered round and the receipt of its answer (device_runtime/answer_receipt.py): the pure rule."""
from __future__ import annotations

from device_runtime.answer_receipt import RECEIPT_WAIT_S, AnswerReceipt, Reask

SERVER = 1_000  # the epoch of the server process start that asked for the answer
RESUMED = SERVER + 1  # the same server killed and resumed: its next process start


def answer_to_round_3() -> AnswerReceipt:
    return AnswerReceipt(round=3, sent_at=10.0, asker=SERVER)


def test_a_reask_that_crossed_the_answer_waits_for_its_receipt():
    answer = answer_to_round_3()
    assert answer.reask(10.5, SERVER) == Reask.HOLD
    assert not answer.due(10.0 + RECEIPT_WAIT_S - 0.1)


def test_the_receipt_drops_the_held_reask():
    answer = answer_to_round_3()
    answer.reask(10.5, SERVER)
    assert answer.receipt(3, SERVER)
    assert not answer.due(10.0 + RECEIPT_WAIT_S + 1)


def test_a_held_reask_whose_receipt_never_came_is_answered_once_when_its_wait_ends():
    answer = answer_to_round_3()
    answer.reask(10.5, SERVER)
    assert answer.due(10.0 + RECEIPT_WAIT_S)
    assert not answer.due(10.0 + RECEIPT_WAIT_S + 1)


def test_a_reask_after_the_receipt_sends_nothing():
    answer = answer_to_round_3()
    answer.receipt(3, SERVER)
    assert answer.reask(11.0, SERVER) == Reask.RECEIVED


def test_a_receipt_of_another_round_changes_nothing():
    answer = answer_to_round_3()
    assert not answer.receipt(2, SERVER)
    assert answer.reask(11.0, SERVER) == Reask.HOLD


def test_a_late_reask_gets_the_answer_at_once_receipt_or_not():
    answer = answer_to_round_3()
    answer.receipt(3, SERVER)
    assert answer.reask(10.0 + RECEIPT_WAIT_S, SERVER) == Reask.SEND
    assert answer_to_round_3().reask(10.0 + RECEIPT_WAIT_S, SERVER) == Reask.SEND


def test_a_resumed_servers_reask_gets_the_answer_at_once_however_soon_it_comes():
    """The killed process's receipt must not silence the process that resumed its round: that one counted nothing."""
    answer = answer_to_round_3()
    answer.receipt(3, SERVER)
    assert answer.reask(10.5, RESUMED) == Reask.SEND
    assert answer_to_round_3().reask(10.5, RESUMED) == Reask.SEND  # nor does it wait for a receipt it cannot send


def test_a_receipt_from_another_server_process_counts_for_nothing():
    answer = answer_to_round_3()
    assert not answer.receipt(3, RESUMED)
    assert answer.reask(11.0, SERVER) == Reask.HOLD
