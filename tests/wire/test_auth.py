"""Specification of message authentication: keys, tags, counters, and the Verifier's rules."""
from __future__ import annotations

import numpy as np
import pytest

from device_runtime.auth import (MAX_COUNTER, MAX_EPOCH, MAX_SEQ, SEQ_BITS, STATUS_OFFLINE, STATUS_ONLINE,
                                 CounterExhausted, CounterSource, Direction, KeyRing, Refusal, Verifier,
                                 load_verifier_state, new_key, new_nonce, next_epoch, save_verifier_state,
                                 start_counters)
from device_runtime.envelope import Message, MessageType, decode, encode, seal
from device_runtime.status import Status, StatusError, StatusSigner, parse_status

KEY_A, KEY_B = bytes([1]) * 32, bytes([2]) * 32
RUN, OTHER_RUN = "run-a", "run-b"


def sealed(device_id: str = "dev_a", *, key: bytes = KEY_A, direction: Direction = Direction.UP, counter: int = 10,
           run_id: str = RUN) -> Message:
    """A message as a receiver sees it after decode."""
    msg = Message(MessageType.UPDATE, run_id, 1, device_id, f"m-{counter}", {"num_samples": 440},
                  {"w": np.ones(3, dtype=np.float32)})
    return decode(seal(msg, key, direction, counter), max_bytes=1 << 20)


def server_verifier(**state) -> Verifier:
    return Verifier(KeyRing({"dev_a": KEY_A, "dev_b": KEY_B}), {Direction.UP, Direction.STATUS}, state or None)


def status_frame(online: bool, nonce: str, counter: int, key: bytes = KEY_A) -> Message:
    source = CounterSource(1, counter - (1 << SEQ_BITS) - 1)
    return decode(StatusSigner("dev_a", key, source)(online, nonce), max_bytes=1 << 20)


def check_status(verifier: Verifier, msg: Message):
    status = parse_status(msg)
    return verifier.check(msg, status=status.state, nonce=status.nonce)


# -- tags ------------------------------------------------------------------------------------------------------


def test_accepts_a_genuine_message_and_remembers_its_counter():
    verifier = server_verifier()
    assert verifier.check(sealed(counter=10), {RUN}).accepted
    assert verifier.last_counter("dev_a", Direction.UP) == 10


def test_refuses_a_message_tagged_under_another_devices_key():
    assert server_verifier().check(sealed(key=KEY_B), {RUN}).reason == Refusal.BAD_TAG


def test_refuses_a_device_that_is_not_enrolled():
    assert server_verifier().check(sealed("dev_c"), {RUN}).reason == Refusal.UNKNOWN_DEVICE


@pytest.mark.parametrize("cut", [1, 16, 31, 32])
def test_refuses_a_truncated_tag(cut):
    msg = sealed()
    msg.tag = msg.tag[:-cut]
    assert server_verifier().check(msg, {RUN}).reason == Refusal.BAD_TAG


def test_refuses_any_header_field_changed_after_sealing():
    """The tag covers the header: here the sample count, which a replayed JOIN once overwrote."""
    data = seal(Message(MessageType.JOIN, RUN, 0, "dev_a", "j-1", {"num_samples": 440}), KEY_A, Direction.UP, 10)
    forged = data.replace(b'"num_samples":440', b'"num_samples":449')
    assert server_verifier().check(decode(forged, max_bytes=1 << 20)).reason == Refusal.BAD_TAG


def test_refuses_a_changed_body_through_the_body_hash_the_tag_covers():
    data = bytearray(encode(sealed(), key=KEY_A))
    data[-1] ^= 1
    with pytest.raises(ValueError, match="body_sha256"):
        decode(bytes(data), max_bytes=1 << 20)


# -- direction and run -----------------------------------------------------------------------------------------


def test_refuses_a_genuine_server_message_reflected_onto_the_up_topic():
    assert server_verifier().check(sealed(direction=Direction.DOWN), {RUN}).reason == Refusal.WRONG_DIRECTION


def test_device_refuses_a_message_in_the_up_direction():
    device = Verifier(KeyRing({"dev_a": KEY_A}), {Direction.DOWN})
    assert device.check(sealed(direction=Direction.UP)).reason == Refusal.WRONG_DIRECTION


def test_refuses_a_message_of_another_run():
    assert server_verifier().check(sealed(run_id=OTHER_RUN), {RUN}).reason == Refusal.WRONG_RUN


def test_any_run_is_taken_where_none_is_expected_but_only_with_a_fresh_counter():
    verifier = server_verifier()
    assert verifier.check(sealed(run_id=OTHER_RUN, counter=5)).accepted
    assert verifier.check(sealed(run_id=RUN, counter=5)).reason == Refusal.REPLAY


# -- counters ----------------------------------------------------------------------------------------------------


def test_refuses_a_byte_exact_replay():
    verifier = server_verifier()
    msg = sealed(counter=10)
    assert verifier.check(msg, {RUN}).accepted
    assert verifier.check(msg, {RUN}).reason == Refusal.REPLAY


def test_refuses_a_reordered_older_message():
    verifier = server_verifier()
    assert verifier.check(sealed(counter=11), {RUN}).accepted
    assert verifier.check(sealed(counter=10), {RUN}).reason == Refusal.REPLAY


def test_counters_are_separate_per_device_and_direction():
    verifier = server_verifier()
    assert verifier.check(sealed("dev_a", counter=10), {RUN}).accepted
    assert verifier.check(sealed("dev_b", key=KEY_B, counter=10), {RUN}).accepted
    assert verifier.check(sealed(direction=Direction.STATUS, counter=10), {RUN}).accepted


def test_a_refused_message_changes_no_state():
    verifier = server_verifier()
    verifier.check(sealed(key=KEY_B, counter=99), {RUN})
    verifier.check(sealed(run_id=OTHER_RUN, counter=99), {RUN})
    assert verifier.to_state() == {"counters": {}, "nonces": {}, "closed": [], "sessions": {}}
    assert verifier.check(sealed(counter=98), {RUN}).accepted


def test_counters_increase_within_a_start_and_across_starts():
    first = CounterSource(next_epoch(None, 1_700_000_000))
    a, b = first.next(), first.next()
    second = CounterSource(next_epoch(first.epoch, 1_700_000_000))  # restarted within the same second
    assert a < b < second.next()


def test_a_clock_set_back_still_gets_a_later_epoch_from_the_persisted_one():
    assert next_epoch(1_800_000_000, 0) == 1_800_000_001


def test_a_lost_epoch_file_still_gets_a_later_epoch_from_the_clock():
    assert next_epoch(None, 1_800_000_000.7) == 1_800_000_000


def test_counter_source_raises_instead_of_wrapping_at_rollover():
    source = CounterSource(7, seq=MAX_SEQ - 1)
    assert source.next() == (7 << SEQ_BITS) | MAX_SEQ
    with pytest.raises(CounterExhausted, match="restart"):
        source.next()


def test_a_wrapped_counter_would_be_refused_as_a_replay():
    verifier = server_verifier()
    assert verifier.check(sealed(counter=(7 << SEQ_BITS) | MAX_SEQ), {RUN}).accepted
    assert verifier.check(sealed(counter=7 << SEQ_BITS), {RUN}).reason == Refusal.REPLAY


def test_largest_counter_stays_a_signed_64_bit_json_integer():
    assert MAX_COUNTER == (MAX_EPOCH << SEQ_BITS) | MAX_SEQ < 2**63
    with pytest.raises(ValueError, match="epoch"):
        next_epoch(MAX_EPOCH, 0)


def test_start_counters_persists_the_epoch_before_the_first_message(tmp_path):
    first = start_counters(tmp_path, now_unix=100.0)
    second = start_counters(tmp_path, now_unix=50.0)
    assert (first.epoch, second.epoch) == (100, 101)


def test_verifier_state_survives_a_restart(tmp_path):
    verifier = server_verifier()
    verifier.check(sealed(counter=10), {RUN})
    save_verifier_state(tmp_path, verifier)
    restarted = server_verifier(**load_verifier_state(tmp_path))
    assert restarted.check(sealed(counter=10), {RUN}).reason == Refusal.REPLAY


# -- status frames -------------------------------------------------------------------------------------------------


def test_offline_of_the_current_connection_is_believed():
    verifier, nonce = server_verifier(), new_nonce()
    assert check_status(verifier, status_frame(True, nonce, (1 << SEQ_BITS) + 2)).accepted
    will = status_frame(False, nonce, (1 << SEQ_BITS) + 1)  # minted at CONNECT, before the online
    assert check_status(verifier, will).accepted


def test_offline_of_an_earlier_connection_is_refused():
    verifier, old, new = server_verifier(), new_nonce(), new_nonce()
    check_status(verifier, status_frame(True, old, (1 << SEQ_BITS) + 2))
    captured_will = status_frame(False, old, (1 << SEQ_BITS) + 1)
    check_status(verifier, status_frame(True, new, (1 << SEQ_BITS) + 4))
    assert check_status(verifier, captured_will).reason == Refusal.STALE_CONNECTION


def test_offline_before_any_online_is_refused():
    assert check_status(server_verifier(), status_frame(False, new_nonce(), 5 + (1 << SEQ_BITS))).reason == \
        Refusal.STALE_CONNECTION


def test_replayed_online_cannot_make_an_old_connection_current():
    verifier, old, new = server_verifier(), new_nonce(), new_nonce()
    old_online = status_frame(True, old, (1 << SEQ_BITS) + 2)
    check_status(verifier, old_online)
    check_status(verifier, status_frame(True, new, (1 << SEQ_BITS) + 4))
    assert check_status(verifier, old_online).reason == Refusal.REPLAY
    assert verifier.current_nonce("dev_a") == new


def test_the_retained_online_of_the_open_connection_is_taken_again_by_a_restarted_server(tmp_path):
    verifier, nonce = server_verifier(), new_nonce()
    online = status_frame(True, nonce, (1 << SEQ_BITS) + 2)
    check_status(verifier, online)
    save_verifier_state(tmp_path, verifier)
    restarted = server_verifier(**load_verifier_state(tmp_path))
    assert check_status(restarted, online).accepted


def test_the_online_of_a_connection_that_went_offline_is_a_replay():
    verifier, nonce = server_verifier(), new_nonce()
    online = status_frame(True, nonce, (1 << SEQ_BITS) + 2)
    check_status(verifier, online)
    assert check_status(verifier, status_frame(False, nonce, (1 << SEQ_BITS) + 1)).accepted
    assert check_status(verifier, online).reason == Refusal.REPLAY


def test_status_under_a_wrong_key_is_refused():
    msg = status_frame(False, new_nonce(), (1 << SEQ_BITS) + 1, key=KEY_B)
    assert check_status(server_verifier(), msg).reason == Refusal.BAD_TAG


def test_status_without_a_hex_nonce_is_malformed():
    msg = status_frame(True, new_nonce(), (1 << SEQ_BITS) + 1)
    msg.meta["nonce"] = "zz"
    with pytest.raises(StatusError, match="nonce"):
        parse_status(msg)


def test_status_round_trips_its_state():
    nonce = new_nonce()
    assert parse_status(status_frame(True, nonce, (1 << SEQ_BITS) + 1)) == Status(True, nonce)
    assert Status(False, nonce).state == STATUS_OFFLINE and Status(True, nonce).state == STATUS_ONLINE


# -- key ring ---------------------------------------------------------------------------------------------------------


def test_open_key_ring_admits_any_id_under_the_shared_key():
    ring = KeyRing({}, shared_key=KEY_A)
    assert ring.key_for("anyone") == KEY_A


def test_enrolled_key_ring_admits_only_its_ids():
    ring = KeyRing({"dev_a": KEY_A})
    assert ring.key_for("dev_b") is None


def test_keys_must_be_32_bytes():
    with pytest.raises(ValueError, match="32 bytes"):
        KeyRing({"dev_a": b"short"})
    assert len(new_key()) == 32
