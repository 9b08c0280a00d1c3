"""Specification of the Verifier's state on disk (auth.VerifierStore): each accept is one short journal line, the
journal stays bounded, and a restarted receiver refuses everything it accepted before, whatever a crash cut."""
from __future__ import annotations

import json

import numpy as np

from device_runtime.auth import (COMPACT_MIN_LINES, JOURNAL_FILE, VERIFIER_FILE, CounterSource, Direction, KeyRing,
                                 Refusal, Verifier, VerifierStore, new_nonce)
from device_runtime.envelope import Message, MessageType, decode, seal
from device_runtime.status import StatusSigner, parse_status

RUN = "run-a"
KEYS = {f"dev_{i:04d}": bytes([i % 251 + 1]) * 32 for i in range(1000)}


def sealed(device_id: str, counter: int) -> Message:
    msg = Message(MessageType.UPDATE, RUN, 1, device_id, f"m-{counter}", {"num_samples": 4},
                  {"w": np.ones(2, dtype=np.float32)})
    return decode(seal(msg, KEYS[device_id], Direction.UP, counter), max_bytes=1 << 20)


def verifier(state=None) -> Verifier:
    return Verifier(KeyRing(KEYS), {Direction.UP, Direction.STATUS}, state)


def accept(v: Verifier, store: VerifierStore, device_id: str, counter: int) -> None:
    assert v.check(sealed(device_id, counter), {RUN}).accepted
    store.record(v, device_id)


def restarted(tmp_path) -> Verifier:
    return verifier(VerifierStore(tmp_path).load())


def test_a_restarted_receiver_refuses_what_the_journal_holds(tmp_path):
    v, store = verifier(), VerifierStore(tmp_path)
    accept(v, store, "dev_0001", 10)
    accept(v, store, "dev_0002", 7)
    again = restarted(tmp_path)
    assert again.check(sealed("dev_0001", 10), {RUN}).reason == Refusal.REPLAY
    assert again.check(sealed("dev_0002", 7), {RUN}).reason == Refusal.REPLAY
    assert again.check(sealed("dev_0002", 8), {RUN}).accepted


def test_an_accept_writes_one_line_however_many_senders_the_state_holds(tmp_path):
    v, store = verifier(), VerifierStore(tmp_path)
    for number, device_id in enumerate(KEYS, 1):
        assert v.check(sealed(device_id, number), {RUN}).accepted
    store.compact(v)
    snapshot = (tmp_path / VERIFIER_FILE).stat().st_size
    accept(v, store, "dev_0500", 5000)
    assert (tmp_path / VERIFIER_FILE).stat().st_size == snapshot
    assert (tmp_path / JOURNAL_FILE).stat().st_size < 200


def test_the_journal_is_folded_into_the_snapshot_once_long(tmp_path):
    v, store = verifier(), VerifierStore(tmp_path)
    for counter in range(1, 3 * COMPACT_MIN_LINES):
        accept(v, store, "dev_0003", counter)
        assert len((tmp_path / JOURNAL_FILE).read_bytes().splitlines()) <= COMPACT_MIN_LINES + 1
    assert restarted(tmp_path).last_counter("dev_0003", Direction.UP) == 3 * COMPACT_MIN_LINES - 1


def test_a_torn_last_line_is_ignored(tmp_path):
    v, store = verifier(), VerifierStore(tmp_path)
    accept(v, store, "dev_0001", 10)
    with open(tmp_path / JOURNAL_FILE, "ab") as journal:
        journal.write(b'{"device":"dev_0001","coun')  # a crash mid-append: the message was never acted on
    assert restarted(tmp_path).last_counter("dev_0001", Direction.UP) == 10


def test_a_crash_between_snapshot_and_truncation_loads_the_newest_state(tmp_path):
    v, store = verifier(), VerifierStore(tmp_path)
    accept(v, store, "dev_0001", 10)
    accept(v, store, "dev_0001", 11)
    journal = (tmp_path / JOURNAL_FILE).read_bytes()
    store.compact(v)
    (tmp_path / JOURNAL_FILE).write_bytes(journal)  # the snapshot landed, the journal was not yet emptied
    assert restarted(tmp_path).last_counter("dev_0001", Direction.UP) == 11


def test_a_closed_connection_stays_closed_after_a_restart(tmp_path):
    v, store, nonce = verifier(), VerifierStore(tmp_path), new_nonce()
    source = CounterSource(1)  # one source: the offline's counter is above the online's
    online = decode(StatusSigner("dev_0001", KEYS["dev_0001"], source)(True, nonce), max_bytes=1 << 20)
    offline = decode(StatusSigner("dev_0001", KEYS["dev_0001"], source)(False, nonce), max_bytes=1 << 20)
    for frame in (online, offline):
        status = parse_status(frame)
        assert v.check(frame, status=status.state, nonce=status.nonce).accepted
        store.record(v, "dev_0001")
    status = parse_status(online)
    again = restarted(tmp_path)
    assert again.check(online, status=status.state, nonce=status.nonce).reason == Refusal.REPLAY
    assert json.loads((tmp_path / JOURNAL_FILE).read_bytes().splitlines()[-1])["closed"] is True
