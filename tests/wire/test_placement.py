"""A frame's chunk received straight into its message (framing.Reassembler.place/commit/abort): the payload is the one
``feed`` joins, what is held is counted as ``feed`` counts it, and a frame ``feed`` would treat otherwise (not admitted,
unauthenticated, delivered, pushed out, in the spill) is left to ``feed``."""
from __future__ import annotations

import pytest

from device_runtime.framing import FRAME_HEADER_BYTES, Placement, Reassembler, chunk
from device_runtime.spill import FileSpill
from tests.wire.test_sender_budget import FRAME_1K, payload_of, sealed, vouch_by_tag

STREAM = "dev/a/update"


def reassembler(**changes) -> Reassembler:
    return Reassembler(**{"max_message_bytes": 10_000, "timeout_s": 60.0, "max_pending": 8,
                          "max_pending_bytes": 40_000, "vouch": vouch_by_tag, **changes})


def place(r: Reassembler, frame: bytes, given: int | None = None, stream: str = STREAM) -> Placement | None:
    """Place ``frame`` with its header and ``given`` bytes of its chunk at hand (all but its last byte by default),
    and fill its place whole."""
    given = len(frame) - FRAME_HEADER_BYTES - 1 if given is None else given
    placement = r.place(memoryview(frame)[:FRAME_HEADER_BYTES + given], len(frame), 0.0, stream=stream)
    if placement is not None:
        placement.into[:] = memoryview(frame)[FRAME_HEADER_BYTES:]
    return placement


def test_frames_placed_in_order_give_the_payload_feed_would_join():
    genuine = sealed("update-1")
    r = reassembler()
    out = [r.commit(place(r, frame), 0.0) for frame in chunk(genuine, FRAME_1K, "update-1")]
    assert len(out) > 2 and out[:-1] == [None] * (len(out) - 1) and bytes(out[-1]) == genuine
    assert r.pending_bytes == 0 and r.pending_ids == ()


def test_a_placed_chunk_counts_as_held_from_its_placement():
    frames = chunk(sealed("update-1"), FRAME_1K, "update-1")
    r = reassembler()
    place(r, frames[0])
    assert r.pending_bytes == len(frames[0]) - FRAME_HEADER_BYTES


def test_chunks_fed_before_the_first_placement_are_moved_into_the_message():
    genuine = sealed("update-1")
    frames = chunk(genuine, FRAME_1K, "update-1")
    r = reassembler()
    assert r.feed(frames[0], 0.0, stream=STREAM) is None
    assert r.commit(place(r, frames[1]), 0.0) is None
    assert [r.feed(frame, 0.0, stream=STREAM) for frame in frames[2:-1]] == [None] * (len(frames) - 3)
    assert bytes(r.feed(frames[-1], 0.0, stream=STREAM)) == genuine


def test_an_aborted_placement_gives_its_place_back_and_the_frame_sent_again_completes_the_message():
    genuine = sealed("update-1")
    frames = chunk(genuine, FRAME_1K, "update-1")
    r = reassembler()
    r.commit(place(r, frames[0]), 0.0)
    r.abort(r.place(memoryview(frames[1])[:FRAME_HEADER_BYTES], len(frames[1]), 0.0, stream=STREAM))
    assert r.pending_bytes == len(frames[0]) - FRAME_HEADER_BYTES
    out = [r.commit(place(r, frame), 0.0) for frame in frames[1:]]
    assert bytes(out[-1]) == genuine


def test_a_chunk_0_whose_tagged_header_is_not_all_at_hand_is_left_to_feed():
    frames = chunk(sealed("update-1"), FRAME_1K, "update-1")
    r = reassembler()
    assert place(r, frames[0], given=10) is None
    assert r.pending_ids == ()  # nothing admitted: feed admits it, ranked by the whole chunk


def test_junk_under_a_senders_id_is_never_placed():
    r = reassembler()
    junk = chunk(payload_of(3000), FRAME_1K, "junk")
    assert place(r, junk[0]) is None
    r.feed(junk[0], 0.0, stream=STREAM)
    assert place(r, junk[1]) is None  # an unvouched message's later chunk too


def test_a_frame_admitted_for_no_sender_is_not_placed():
    r = reassembler(admit=lambda stream: None)
    assert place(r, chunk(sealed("update-1"), FRAME_1K, "update-1")[0]) is None
    assert r.pending_ids == ()


def test_a_chunk_already_held_a_delivered_message_and_a_pushed_out_one_are_left_to_feed():
    genuine = sealed("update-1")
    frames = chunk(genuine, FRAME_1K, "update-1")
    r = reassembler()
    r.commit(place(r, frames[0]), 0.0)
    assert place(r, frames[0]) is None  # held: feed compares it
    for frame in frames[1:]:
        r.commit(place(r, frame), 0.0)
    assert place(r, frames[0]) is None  # delivered: feed says repeated
    pushed = reassembler(max_pending_per_sender=1)
    older, newer = chunk(sealed("update-2"), FRAME_1K, "update-2"), chunk(sealed("update-3"), FRAME_1K, "update-3")
    pushed.commit(place(pushed, older[0]), 0.0)
    pushed.commit(place(pushed, newer[0]), 0.0)  # the newer counter: the older one goes
    assert pushed.evicted and place(pushed, older[1]) is None


def test_a_frame_contradicting_its_message_is_left_to_feed():
    frames = chunk(sealed("update-1"), FRAME_1K, "update-1")
    other = chunk(sealed("update-1", size=5000), FRAME_1K, "update-1")  # same msg_id, another total
    r = reassembler()
    r.commit(place(r, frames[0]), 0.0)
    assert place(r, other[1]) is None


def spilling(folder, **changes) -> Reassembler:
    """Memory for 5,000 bytes of chunks; a spill for 20,000."""
    return reassembler(**{"max_pending_bytes": 5_000, "max_message_bytes": 5_000, "spill": FileSpill(folder),
                          "max_spill_bytes": 20_000, **changes})


def test_a_placed_message_moved_to_the_spill_completes_from_it(tmp_path):
    first, second = sealed("update-1"), sealed("update-2")
    r = spilling(tmp_path)
    a, b = chunk(first, FRAME_1K, "update-1"), chunk(second, FRAME_1K, "update-2")
    for frame in a[:-1]:
        r.commit(place(r, frame, stream="dev/a/update"), 0.0)
    for frame in b[:2]:  # 5,000 bytes held: the budget
        r.commit(place(r, frame, stream="dev/b/update"), 0.0)
    assert r.spilled_bytes == 0
    out = [r.commit(place(r, frame, stream="dev/b/update"), 0.0) for frame in b[2:]]  # past it: b, the newest, spills
    assert r.spilled_bytes == 0 and r.spills == 1  # it went there, and came back whole
    assert bytes(out[-1]) == second
    assert r.pending_bytes == sum(len(f) - FRAME_HEADER_BYTES for f in a[:-1])
    assert bytes(r.commit(place(r, a[-1], stream="dev/a/update"), 0.0)) == first


def test_an_aborted_placement_of_a_spilled_message_gives_its_place_back(tmp_path):
    second = sealed("update-2")
    r = spilling(tmp_path, max_pending_bytes=10_000, max_message_bytes=5_000)
    b = chunk(second, FRAME_1K, "update-2")
    r.commit(place(r, b[0], stream="dev/b/update"), 0.0)
    r._to_spill(("dev/b/update", "update-2"))  # noqa: SLF001  (as the total budget would)
    r.abort(r.place(memoryview(b[1])[:FRAME_HEADER_BYTES], len(b[1]), 0.0, stream="dev/b/update"))
    out = [r.commit(place(r, frame, stream="dev/b/update"), 0.0) for frame in b[1:]]
    assert bytes(out[-1]) == second


class FailingSpill(FileSpill):
    def write(self, key, offset, data) -> None:
        raise OSError("no space left on device")


def test_a_spilled_chunk_that_cannot_be_written_pushes_its_message_out(tmp_path):
    second = sealed("update-2")
    r = reassembler(max_pending_bytes=10_000, max_message_bytes=5_000, spill=FailingSpill(tmp_path),
                    max_spill_bytes=20_000)
    b = chunk(second, FRAME_1K, "update-2")
    key = ("dev/b/update", "update-2")
    r.commit(place(r, b[0], stream="dev/b/update"), 0.0)
    r._pending[key].pieces, r._pending[key].spilled = {0: None}, True  # noqa: SLF001  (already in the spill)
    assert r.commit(place(r, b[1], stream="dev/b/update"), 0.0) is None
    assert r.evicted == [key] and r.pending_ids == ()


@pytest.mark.parametrize("vouch", [None, vouch_by_tag], ids=["nothing-vouches", "vouched"])
def test_payloads_joined_and_placed_are_equal_whatever_the_order(vouch):
    genuine = sealed("update-1", size=7000)
    frames = chunk(genuine, FRAME_1K, "update-1")
    order = [0, 3, 1, 6, 2, 5, 4, 7][:len(frames)]
    r = reassembler(vouch=vouch)
    done = None
    for i in order:
        placement = place(r, frames[i])
        done = r.feed(frames[i], 0.0, stream=STREAM) if placement is None else r.commit(placement, 0.0)
    assert bytes(done) == genuine
