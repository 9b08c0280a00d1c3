"""The reassembler's spill (device_runtime/framing.py, device_runtime/spill.py): past the memory budget an authenticated
incomplete message goes to a file instead of being pushed out (and asked for again: sent twice), so a burst of many
devices' interleaved updates completes whole with bounded memory; junk never goes there, and the spill is bounded."""
from __future__ import annotations

from pathlib import Path

import pytest

from device_runtime.framing import Reassembler, chunk
from device_runtime.spill import FileSpill
from tests.wire.test_sender_budget import FRAME_1K, payload_of, sealed, vouch_by_tag


def reassembler(folder: Path, **changes) -> Reassembler:
    """Memory for 2 incomplete messages of 3,368 bytes (sealed); a spill of 4 such messages."""
    return Reassembler(**{"max_message_bytes": 10_000, "timeout_s": 60.0, "max_pending": 2,
                          "max_pending_bytes": 10_000, "max_pending_per_sender": 1,
                          "max_pending_bytes_per_sender": 10_000, "vouch": vouch_by_tag,
                          "spill": FileSpill(folder), "max_spill_bytes": 4 * 3_400, **changes})


def burst(r: Reassembler, names: list[str]) -> tuple[dict[str, bytes], list[bytes]]:
    """Every device's update, its frames interleaved one of each in turn (as mosquitto forwards a burst); what
    completed, in order."""
    payloads = {s: sealed(f"update-{s}") for s in names}
    frames = {s: chunk(p, FRAME_1K, f"update-{s}") for s, p in payloads.items()}
    done = []
    for i in range(max(len(f) for f in frames.values())):
        for s in names:
            if i < len(frames[s]):
                out = r.feed(frames[s][i], float(i), stream=f"dev/{s}/update")
                if out is not None:
                    done.append(bytes(out))
    return payloads, done


def test_past_the_memory_budget_authenticated_messages_go_to_the_spill_and_all_complete(tmp_path):
    r = reassembler(tmp_path)
    payloads, done = burst(r, ["a", "b", "c", "d", "e"])
    assert sorted(done) == sorted(payloads.values()) and r.evicted == []
    assert r.spills == 3 and r.spilled_bytes == 0 and r.pending_bytes == 0
    assert list(tmp_path.iterdir()) == []  # each file removed once read back


def test_memory_held_stays_within_the_budget_while_the_spill_takes_the_rest(tmp_path):
    r = reassembler(tmp_path, max_pending=64, max_message_bytes=4_000, max_pending_bytes=4_000,
                    max_pending_bytes_per_sender=4_000)
    payloads = {s: sealed(f"update-{s}") for s in "abcde"}
    for s, p in payloads.items():
        r.feed(chunk(p, FRAME_1K, f"update-{s}")[0], 0.0, stream=f"dev/{s}/update")
        r.feed(chunk(p, FRAME_1K, f"update-{s}")[1], 0.0, stream=f"dev/{s}/update")
        assert r.pending_bytes <= 4_000
    assert r.spills >= 1 and r.spilled_bytes == r.spills * len(payloads["a"])


def test_a_full_spill_pushes_out_the_newest_authenticated_message_as_before(tmp_path):
    r = reassembler(tmp_path, max_spill_bytes=4_000)  # room for one
    payloads, done = burst(r, ["a", "b", "c", "d"])
    assert r.evicted == [("dev/d/update", "update-d")]  # asked again
    assert sorted(done) == sorted(payloads[s] for s in "abc")


def test_unauthenticated_junk_never_goes_to_the_spill(tmp_path):
    r = reassembler(tmp_path, max_pending_per_sender=2)
    r.feed(chunk(sealed("update-a"), FRAME_1K, "update-a")[0], 0.0, stream="dev/a/update")
    r.feed(chunk(sealed("update-b"), FRAME_1K, "update-b")[0], 0.0, stream="dev/b/update")
    for i in range(50):
        r.feed(chunk(payload_of(3000, i), FRAME_1K, f"junk-{i}")[0], 1.0, stream=f"dev/x{i}/update")
    assert r.spills == 0 and list(tmp_path.iterdir()) == []
    assert r.pending_ids == ("update-a", "update-b")


def test_a_spilled_message_that_expires_is_named_for_asking_again_and_its_file_removed(tmp_path):
    r = reassembler(tmp_path, timeout_s=5.0)
    for s in "abc":
        r.feed(chunk(sealed(f"update-{s}"), FRAME_1K, f"update-{s}")[0], 0.0, stream=f"dev/{s}/update")
    assert r.spills == 1 and len(list(tmp_path.iterdir())) == 1
    r.expire(6.0)
    assert ("dev/c/update", "update-c") in r.expired_lost and list(tmp_path.iterdir()) == []
    assert r.spilled_bytes == 0


def test_a_spill_that_cannot_be_written_pushes_the_message_out_instead(tmp_path):
    class FullDisk(FileSpill):
        def write(self, key, offset, data):
            raise OSError(28, "No space left on device")

    r = reassembler(tmp_path, spill=FullDisk(tmp_path))
    payloads, done = burst(r, ["a", "b", "c"])
    assert r.evicted == [("dev/c/update", "update-c")] and sorted(done) == sorted(payloads[s] for s in "ab")


def test_a_spill_budget_needs_a_spill():
    with pytest.raises(ValueError, match="max_spill_bytes"):
        Reassembler(10_000, 60.0, 2, max_spill_bytes=1)


def test_a_file_spill_puts_chunks_at_their_offsets_and_gives_the_whole_back_once(tmp_path):
    spill = FileSpill(tmp_path)
    spill.write(("s", "m"), 3, b"def")
    spill.write(("s", "m"), 0, b"abc")
    assert spill.take(("s", "m"), 6) == bytearray(b"abcdef") and list(tmp_path.iterdir()) == []


def test_a_file_spill_removes_what_an_earlier_process_left(tmp_path):
    (tmp_path / "0123.part").write_bytes(b"old")
    FileSpill(tmp_path)
    assert list(tmp_path.iterdir()) == []
