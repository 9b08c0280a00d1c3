"""Specification of the wire protocol: envelope, topics, chunking and reassembly."""

from __future__ import annotations

import hashlib
import json
import random
import struct

import numpy as np
import pytest

from device_runtime.envelope import MAX_HEADER_BYTES, MAX_META_DEPTH, MAX_TENSOR_RANK, Message, MessageType, decode
from device_runtime.framing import DEFAULT_MAX_FRAME_BYTES, FRAME_HEADER_BYTES, Reassembler, chunk
from device_runtime.protocol import PROTOCOL_VERSION, ProtocolError
from device_runtime.topics import TopicKind, Topics, device_id_from_topic, server_subscriptions
from tests.support.sealing import FRAME_LAYOUT, KEY, encode

MAX_BYTES = 1 << 20
FRAME_1K = FRAME_HEADER_BYTES + 1000  # frames carrying 1000 payload bytes each


def make_message(**changes) -> Message:
    fields = dict(
        type=MessageType.UPDATE,
        run_id="run-1",
        round=7,
        device_id="board_03",
        msg_id="m-0001",
        meta={"samples": 120, "metrics": {"loss": 0.25, "acc": [0.5, 0.75]}, "note": None},
        tensors={"fe.conv1.U": np.arange(6, dtype=np.float32).reshape(2, 3)},
        blobs={"training_model.onnx": b"\x08\x07onnx"},
        counter=1,
    )
    fields.update(changes)
    return Message(**fields)


def assert_same_message(actual: Message, expected: Message) -> None:
    assert (actual.type, actual.run_id, actual.round, actual.device_id, actual.msg_id) == (
        expected.type, expected.run_id, expected.round, expected.device_id, expected.msg_id
    )
    assert actual.meta == expected.meta
    assert list(actual.tensors) == list(expected.tensors)
    for name, array in expected.tensors.items():
        assert actual.tensors[name].dtype == array.dtype.newbyteorder("=")
        np.testing.assert_array_equal(actual.tensors[name], array)
    assert actual.blobs == expected.blobs


PREFIX = 8 + 32  # magic, header length, tag


def split(data: bytes) -> tuple[dict, bytes]:
    (header_len,) = struct.unpack_from("<I", data, 4)
    return json.loads(data[PREFIX:PREFIX + header_len]), data[PREFIX + header_len:]


def assemble(header: dict | bytes, body: bytes, *, rehash: bool = True) -> bytes:
    """An envelope from a (possibly invalid) header, with body_sha256 fixed up unless told not."""
    if isinstance(header, dict):
        if rehash:
            header = {**header, "body_sha256": hashlib.sha256(body).hexdigest()}
        header = json.dumps(header).encode()
    return b"FAR2" + struct.pack("<I", len(header)) + bytes(32) + header + body


def reason_of(data: bytes, **kwargs) -> str:
    with pytest.raises(ProtocolError) as info:
        decode(data, max_bytes=kwargs.pop("max_bytes", MAX_BYTES), **kwargs)
    return info.value.reason


def with_header(**changes) -> bytes:
    header, body = split(encode(make_message()))
    return assemble({**header, **changes}, body)


# --- envelope round trips ---------------------------------------------------------------------


def test_round_trip_preserves_ids_round_meta_tensors_and_blobs():
    msg = make_message()
    assert_same_message(decode(encode(msg), max_bytes=MAX_BYTES), msg)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "int32", "uint8"])
def test_round_trip_preserves_values_and_dtype_of_each_allowed_dtype(dtype):
    array = (np.arange(24) % 251).astype(dtype).reshape(2, 3, 4)
    msg = make_message(tensors={"t": array})
    assert_same_message(decode(encode(msg), max_bytes=MAX_BYTES), msg)


def test_round_trip_zero_dim_and_empty_tensors_keep_their_shapes():
    tensors = {
        "scalar": np.array(3.5, dtype=np.float64),
        "empty": np.zeros((0,), dtype=np.int32),
        "empty_2d": np.zeros((4, 0), dtype=np.float32),
    }
    decoded = decode(encode(make_message(tensors=tensors)), max_bytes=MAX_BYTES)
    assert {n: a.shape for n, a in decoded.tensors.items()} == {
        "scalar": (), "empty": (0,), "empty_2d": (4, 0)
    }


def test_round_trip_blobs_including_empty_ones_in_order():
    blobs = {"checkpoint": bytes(range(256)) * 3, "empty.bin": b"", "eval_model.onnx": b"x"}
    decoded = decode(encode(make_message(blobs=blobs)), max_bytes=MAX_BYTES)
    assert list(decoded.blobs.items()) == list(blobs.items())


def test_round_trip_message_without_tensors_blobs_or_meta():
    msg = make_message(type=MessageType.JOIN, meta={}, tensors={}, blobs={})
    assert_same_message(decode(encode(msg), max_bytes=MAX_BYTES), msg)


def test_decoded_tensors_are_writable_native_copies():
    data = encode(make_message())
    tensor = decode(data, max_bytes=MAX_BYTES).tensors["fe.conv1.U"]
    tensor[0, 0] = 42.0
    assert tensor.flags.writeable and tensor.flags.owndata and tensor.dtype.isnative
    np.testing.assert_array_equal(
        decode(data, max_bytes=MAX_BYTES).tensors["fe.conv1.U"][0, 0], 0.0
    )


def test_tensors_decoded_from_a_bytearray_are_writable_views_into_it():
    """What the reassembler hands over (a bytearray its caller owns) is read in place: no copy of every byte."""
    data = bytearray(encode(make_message(blobs={})))
    tensor = decode(data, max_bytes=MAX_BYTES).tensors["fe.conv1.U"]
    assert tensor.flags.writeable and not tensor.flags.owndata and tensor.dtype.isnative
    tensor[0, 0] = 42.0
    assert np.frombuffer(data, dtype=np.float32, count=1, offset=data.index(np.float32(42.0).tobytes()))[0] == 42.0


def test_tensors_of_a_message_with_blobs_are_copies_even_from_a_bytearray():
    """A view would keep the blobs' bytes alive twice (they are copied out): a device's plan is not held so."""
    tensor = decode(bytearray(encode(make_message())), max_bytes=MAX_BYTES).tensors["fe.conv1.U"]
    assert tensor.flags.writeable and tensor.flags.owndata


def test_reassembled_payloads_are_new_bytearrays():
    data = payload_of(3000)
    reassembler = new_reassembler()
    joined = [reassembler.feed(f, 0.0) for f in chunk(data, FRAME_1K, "m1")][-1]
    assert isinstance(joined, bytearray) and joined == data


def test_encode_writes_big_endian_and_strided_arrays_as_little_endian_c_order():
    array = np.arange(12, dtype=">i4").reshape(3, 4).T
    decoded = decode(encode(make_message(tensors={"t": array})), max_bytes=MAX_BYTES)
    np.testing.assert_array_equal(decoded.tensors["t"], array)


def test_body_is_little_endian_c_order_tensors_then_blobs():
    msg = make_message(
        tensors={"a": np.array([[1, 2], [3, 4]], dtype=np.int32)}, blobs={"b": b"xy"}
    )
    _, body = split(encode(msg))
    assert body == struct.pack("<4i", 1, 2, 3, 4) + b"xy"


def test_header_lists_the_schema_keys_and_body_hash():
    header, body = split(encode(make_message()))
    assert header["version"] == PROTOCOL_VERSION
    assert set(header) == {"type", "version", "run_id", "round", "device_id", "msg_id", "direction",
                           "counter", "meta", "tensors", "blobs", "body_sha256"}
    assert header["body_sha256"] == hashlib.sha256(body).hexdigest()


def test_message_type_values_are_wire_strings():
    assert MessageType("task") is MessageType.TASK and MessageType.TASK == "task"


# --- encode rejects what decode would reject --------------------------------------------------


def test_encode_rejects_unsupported_dtype():
    with pytest.raises(ProtocolError) as info:
        encode(make_message(tensors={"t": np.zeros(3, dtype=np.float16)}))
    assert info.value.reason == "bad_tensor"


def test_encode_rejects_meta_values_json_cannot_carry_exactly():
    with pytest.raises(ProtocolError) as info:
        encode(make_message(meta={"loss": np.float32(0.5)}))
    assert info.value.reason == "bad_meta" and "meta['loss']" in str(info.value)


def test_encode_rejects_nonfinite_meta_numbers():
    with pytest.raises(ProtocolError) as info:
        encode(make_message(meta={"lr": float("nan")}))
    assert info.value.reason == "bad_meta"


def test_encode_rejects_unknown_message_type():
    with pytest.raises(ProtocolError) as info:
        encode(make_message(type="train"))
    assert info.value.reason == "bad_type"


def test_encode_rejects_a_device_id_with_a_topic_separator():
    with pytest.raises(ProtocolError) as info:
        encode(make_message(device_id="a/b"))
    assert info.value.reason == "bad_id"


# --- decode rejections, one crafted input each ------------------------------------------------


def test_decode_rejects_non_bytes_input():
    assert reason_of("FAR2") == "bad_input"


def test_decode_rejects_input_shorter_than_the_prefix():
    assert reason_of(b"FAR2\x00") == "truncated"


def test_decode_rejects_header_length_running_past_the_end():
    assert reason_of(b"FAR2" + struct.pack("<I", 100) + bytes(32) + b"{}") == "truncated"


def test_decode_rejects_wrong_magic():
    assert reason_of(b"FARB" + encode(make_message())[4:]) == "bad_magic"


def test_decode_rejects_message_over_max_bytes():
    data = encode(make_message())
    assert reason_of(data, max_bytes=len(data) - 1) == "oversize"


def test_decode_accepts_message_of_exactly_max_bytes():
    data = encode(make_message())
    assert decode(data, max_bytes=len(data)).msg_id == "m-0001"


def test_decode_rejects_header_length_over_the_bound():
    header = b" " * (MAX_HEADER_BYTES + 1)
    assert reason_of(assemble(header, b""), max_bytes=4 * MAX_HEADER_BYTES) == "oversize"


def test_decode_rejects_malformed_json_header():
    assert reason_of(assemble(b'{"type": ', b"")) == "bad_header"


def test_decode_rejects_header_that_is_not_utf8():
    assert reason_of(assemble(b'{"type": "\xff"}', b"")) == "bad_header"


def test_decode_rejects_header_that_is_not_an_object():
    assert reason_of(assemble(b"[1, 2]", b"")) == "bad_header"


def test_decode_rejects_duplicate_header_keys():
    header, body = split(encode(make_message()))
    raw = json.dumps(header)[:-1] + ', "round": 8}'
    assert reason_of(assemble(raw.encode(), body)) == "bad_header"


def test_decode_rejects_nan_in_header_json():
    header, body = split(encode(make_message()))
    raw = json.dumps({**header, "meta": {"lr": float("nan")}})
    assert reason_of(assemble(raw.encode(), body)) == "bad_header"


def test_decode_rejects_number_overflowing_to_infinity():
    header, body = split(encode(make_message()))
    raw = json.dumps({**header, "meta": {}}).replace('"meta": {}', '"meta": {"lr": 1e999}')
    assert reason_of(assemble(raw.encode(), body)) == "bad_header"


def test_decode_rejects_deeply_nested_json_without_recursion_error():
    raw = b'{"meta": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert reason_of(assemble(raw, b"")) == "bad_header"


def test_decode_rejects_unknown_top_level_key():
    assert reason_of(with_header(extra=1)) == "bad_header"


def test_decode_rejects_missing_top_level_key():
    header, body = split(encode(make_message()))
    del header["msg_id"]
    assert reason_of(assemble(header, body)) == "bad_header"


def test_decode_rejects_other_protocol_version():
    assert reason_of(with_header(version=PROTOCOL_VERSION + 1)) == "bad_version"


def test_decode_rejects_version_given_as_string():
    assert reason_of(with_header(version=str(PROTOCOL_VERSION))) == "bad_version"


def test_decode_rejects_unknown_message_type():
    assert reason_of(with_header(type="train")) == "bad_type"


@pytest.mark.parametrize("device_id", ["dev/1", "dev+", "#", "", "x" * 65, "..", "dév", 7])
def test_decode_rejects_unsafe_device_id(device_id):
    assert reason_of(with_header(device_id=device_id)) == "bad_id"


@pytest.mark.parametrize("round_", [-1, True, 1.0, "3", 2**31])
def test_decode_rejects_round_that_is_not_a_small_non_negative_int(round_):
    assert reason_of(with_header(round=round_)) == "bad_header"


def test_decode_rejects_meta_that_is_not_an_object():
    assert reason_of(with_header(meta=[1, 2])) == "bad_meta"


def test_decode_rejects_meta_nested_too_deep():
    meta: dict = {}
    for _ in range(MAX_META_DEPTH):
        meta = {"k": meta}
    assert reason_of(with_header(meta=meta)) == "bad_meta"


def test_decode_rejects_meta_integer_beyond_64_bits():
    assert reason_of(with_header(meta={"n": 2**63})) == "bad_meta"


def test_decode_rejects_body_hash_that_is_not_hex():
    header, body = split(encode(make_message()))
    assert reason_of(assemble({**header, "body_sha256": "zz"}, body, rehash=False)) == "bad_header"


def test_decode_rejects_body_that_does_not_match_its_hash():
    data = bytearray(encode(make_message()))
    data[-1] ^= 0x01
    assert reason_of(bytes(data)) == "bad_hash"


def tensor_header(**changes) -> tuple[dict, bytes]:
    header, body = split(encode(make_message(blobs={})))
    header["tensors"] = [{**header["tensors"][0], **changes}]
    return header, body


@pytest.mark.parametrize("dtype", ["float16", "object", "<f4", "bool", 4])
def test_decode_rejects_dtype_outside_the_allowlist(dtype):
    assert reason_of(assemble(*tensor_header(dtype=dtype))) == "bad_tensor"


@pytest.mark.parametrize("shape", [[-2, -3], [2, 3.0], [True, 6], "23", [2, None]])
def test_decode_rejects_shape_with_non_int_or_negative_dims(shape):
    assert reason_of(assemble(*tensor_header(shape=shape))) == "bad_tensor"


def test_decode_rejects_rank_over_the_bound():
    shape = [1] * (MAX_TENSOR_RANK - 2) + [2, 3, 1]
    assert reason_of(assemble(*tensor_header(shape=shape))) == "bad_tensor"


def test_decode_rejects_empty_shape_whose_other_dims_are_unallocatable():
    header, _ = tensor_header(shape=[0, 2**40, 2**40], nbytes=0)
    assert reason_of(assemble(header, b"")) == "bad_tensor"


def test_decode_rejects_nbytes_that_disagrees_with_shape_and_dtype():
    assert reason_of(assemble(*tensor_header(shape=[3, 2, 1], nbytes=20))) == "bad_tensor"


def test_decode_rejects_tensor_entry_with_unknown_key():
    assert reason_of(assemble(*tensor_header(order="F"))) == "bad_tensor"


def test_decode_rejects_tensor_name_with_path_separator():
    assert reason_of(assemble(*tensor_header(name="../x"))) == "bad_tensor"


def test_decode_rejects_blob_with_negative_size():
    header, body = split(encode(make_message(tensors={}, blobs={"a": b"", "b": b"xy"})))
    header["blobs"][0]["nbytes"] = -1
    header["blobs"][1]["offset"] = -1
    assert reason_of(assemble(header, body)) == "bad_layout"


def test_decode_rejects_duplicate_tensor_names():
    msg = make_message(tensors={"a": np.zeros(2, np.uint8), "b": np.ones(2, np.uint8)}, blobs={})
    header, body = split(encode(msg))
    header["tensors"][1]["name"] = "a"
    assert reason_of(assemble(header, body)) == "duplicate_name"


def test_decode_rejects_duplicate_blob_names():
    header, body = split(encode(make_message(tensors={}, blobs={"a": b"1", "b": b"2"})))
    header["blobs"][1]["name"] = "a"
    assert reason_of(assemble(header, body)) == "duplicate_name"


def two_blobs() -> tuple[dict, bytes]:
    return split(encode(make_message(tensors={}, blobs={"a": b"123", "b": b"456"})))


def test_decode_rejects_gap_between_entries():
    header, body = two_blobs()
    header["blobs"][1]["offset"] = 4
    header["blobs"][1]["nbytes"] = 2
    assert reason_of(assemble(header, body)) == "bad_layout"


def test_decode_rejects_overlapping_entries():
    header, body = two_blobs()
    header["blobs"][1]["offset"] = 2
    header["blobs"][1]["nbytes"] = 4
    assert reason_of(assemble(header, body)) == "bad_layout"


def test_decode_rejects_entry_running_past_the_body():
    header, body = two_blobs()
    header["blobs"][1]["nbytes"] = 4
    assert reason_of(assemble(header, body)) == "bad_layout"


def test_decode_rejects_trailing_bytes_after_the_last_entry():
    header, body = two_blobs()
    assert reason_of(assemble(header, body + b"\x00")) == "bad_layout"


def test_decode_rejects_blobs_placed_before_tensors():
    msg = make_message(tensors={"t": np.zeros(2, np.uint8)}, blobs={"b": b"xy"})
    header, body = split(encode(msg))
    header["tensors"][0]["offset"], header["blobs"][0]["offset"] = 2, 0
    assert reason_of(assemble(header, body[2:] + body[:2])) == "bad_layout"


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_decode_rejects_nonfinite_float_tensor(bad):
    data = encode(make_message(tensors={"t": np.array([1.0, bad])}))
    assert reason_of(data) == "nonfinite"


def test_decode_accepts_nonfinite_tensor_when_allowed():
    data = encode(make_message(tensors={"t": np.array([np.nan, np.inf], dtype=np.float32)}))
    decoded = decode(data, max_bytes=MAX_BYTES, allow_nonfinite=True)
    assert np.isnan(decoded.tensors["t"][0]) and np.isinf(decoded.tensors["t"][1])


def test_decode_rejects_nonpositive_max_bytes_as_a_caller_error():
    with pytest.raises(ValueError, match="max_bytes"):
        decode(encode(make_message()), max_bytes=0)


def test_protocol_error_names_its_reason_and_the_problem():
    with pytest.raises(ProtocolError) as info:
        decode(b"XXXX" + bytes(36), max_bytes=MAX_BYTES)
    assert isinstance(info.value, ValueError)
    assert "bad_magic" in str(info.value) and "FAR2" in info.value.message


# --- topics -----------------------------------------------------------------------------------


def test_topics_of_a_device():
    topics = Topics("fedara/lab", "board_03")
    assert (topics.down, topics.up, topics.status, topics.update) == (
        "fedara/lab/dev/board_03/down", "fedara/lab/dev/board_03/up",
        "fedara/lab/dev/board_03/status", "fedara/lab/dev/board_03/update",
    )


def test_server_subscribes_to_every_devices_up_status_and_update():
    assert server_subscriptions("fedara") == ["fedara/dev/+/up", "fedara/dev/+/status", "fedara/dev/+/update"]


def test_server_given_its_devices_subscribes_to_their_topics_only():
    assert server_subscriptions("fedara", ["dev_001", "dev_002"]) == [
        "fedara/dev/dev_001/up", "fedara/dev/dev_001/status", "fedara/dev/dev_001/update",
        "fedara/dev/dev_002/up", "fedara/dev/dev_002/status", "fedara/dev/dev_002/update"]


def test_an_update_routed_to_an_aggregator_goes_one_level_below_the_update_topic():
    topics = Topics("fedara", "dev_001")
    assert (topics.update_via(None), topics.update_via("agg-1")) == ("fedara/dev/dev_001/update",
                                                                      "fedara/dev/dev_001/update/agg-1")
    with pytest.raises(ProtocolError):
        topics.update_via("agg/+")


@pytest.mark.parametrize("kind", list(TopicKind))
def test_device_id_from_topic_inverts_topics(kind):
    topic = getattr(Topics("fedara", "board.7"), kind.value)
    assert device_id_from_topic("fedara", topic) == ("board.7", kind)


@pytest.mark.parametrize(
    "topic",
    ["other/dev/a/up", "fedara/dev/a/sideways", "fedara/dev/a/b/up", "fedara/dev/up", "fedara"],
)
def test_device_id_from_topic_rejects_topics_outside_the_layout(topic):
    with pytest.raises(ProtocolError) as info:
        device_id_from_topic("fedara", topic)
    assert info.value.reason == "bad_topic"


def test_device_id_from_topic_rejects_wildcard_device_id():
    with pytest.raises(ProtocolError) as info:
        device_id_from_topic("fedara", "fedara/dev/+/up")
    assert info.value.reason == "bad_id"


@pytest.mark.parametrize("device_id", ["a/b", "+", "#", "", "x" * 65, "-a", "a b", "a\x00"])
def test_topics_reject_unsafe_device_ids(device_id):
    with pytest.raises(ProtocolError) as info:
        Topics("fedara", device_id)
    assert info.value.reason == "bad_id"


@pytest.mark.parametrize("prefix", ["", "/fedara", "fedara/", "a//b", "a/+/b", "#", "$SYS"])
def test_topics_reject_unsafe_prefixes(prefix):
    with pytest.raises(ProtocolError) as info:
        Topics(prefix, "board")
    assert info.value.reason == "bad_topic"


# --- chunking and reassembly ------------------------------------------------------------------


def payload_of(size: int) -> bytes:
    return random.Random(size).randbytes(size)


def frame(msg_id: str, index: int, count: int, total: int, digest: bytes, data: bytes) -> bytes:
    ident = msg_id.encode()
    return FRAME_LAYOUT.pack(b"FACK", PROTOCOL_VERSION, len(ident), ident, index, count, total,
                             digest) + data


def feed_reason(reassembler: Reassembler, data: bytes, now: float = 0.0) -> str:
    with pytest.raises(ProtocolError) as info:
        reassembler.feed(data, now)
    return info.value.reason


def new_reassembler(**changes) -> Reassembler:
    return Reassembler(**{"max_message_bytes": MAX_BYTES, "timeout_s": 10.0, "max_pending": 4,
                          **changes})


def test_default_frame_size_is_below_common_broker_limits():
    assert FRAME_HEADER_BYTES < DEFAULT_MAX_FRAME_BYTES <= 1_000_000


def test_frame_header_has_the_documented_fixed_layout():
    data = payload_of(10)
    (head,) = chunk(data, FRAME_1K, "m1")
    assert FRAME_HEADER_BYTES == FRAME_LAYOUT.size
    assert FRAME_LAYOUT.unpack_from(head) == (
        b"FACK", PROTOCOL_VERSION, 2, b"m1".ljust(64, b"\x00"), 0, 1, 10,
        hashlib.sha256(data).digest(),
    )
    assert head[FRAME_HEADER_BYTES:] == data


def test_payload_that_fits_goes_as_a_single_frame():
    assert len(chunk(payload_of(100), DEFAULT_MAX_FRAME_BYTES, "m1")) == 1


def test_every_frame_respects_max_frame_bytes():
    frames = chunk(payload_of(10_000), FRAME_HEADER_BYTES + 300, "m1")
    assert len(frames) == 34 and max(map(len, frames)) == FRAME_HEADER_BYTES + 300


def test_chunk_rejects_frame_size_without_room_for_data():
    with pytest.raises(ValueError, match="max_frame_bytes"):
        chunk(b"abc", FRAME_HEADER_BYTES, "m1")


def test_chunk_rejects_unsafe_msg_id():
    with pytest.raises(ProtocolError) as info:
        chunk(b"abc", 1000, "x" * 65)
    assert info.value.reason == "bad_id"


def test_reassembles_large_payload_from_shuffled_frames_with_duplicates():
    data = payload_of(50_000)
    frames = chunk(data, FRAME_1K, "m1")
    stream = frames + frames[::3]
    random.Random(0).shuffle(stream)
    stream.remove(frames[5])
    stream.append(frames[5])
    reassembler = new_reassembler()
    results = [reassembler.feed(f, 1.0) for f in stream]
    assert results[-1] == data and results[:-1] == [None] * (len(stream) - 1)


def test_reassembles_empty_payload():
    (only,) = chunk(b"", FRAME_1K, "m1")
    assert new_reassembler().feed(only, 0.0) == b""


def test_encoded_message_survives_chunking():
    msg = make_message(tensors={"w": np.random.default_rng(0).normal(size=(300, 200))})
    frames = chunk(encode(msg), DEFAULT_MAX_FRAME_BYTES, msg.msg_id)
    reassembler = new_reassembler()
    payloads = [reassembler.feed(f, 0.0) for f in reversed(frames)]
    assert len(frames) > 1
    assert_same_message(decode(payloads[-1], max_bytes=MAX_BYTES), msg)


def test_interleaved_messages_reassemble_independently():
    a, b = payload_of(3000), payload_of(4000)
    fa, fb = chunk(a, FRAME_1K, "a"), chunk(b, FRAME_1K, "b")
    reassembler = new_reassembler()
    out = [reassembler.feed(f, 0.0) for pair in zip(fa, fb) for f in pair]
    out += [reassembler.feed(f, 0.0) for f in fb[len(fa):]]
    assert [p for p in out if p is not None] == [a, b]


def test_missing_frame_leaves_message_pending():
    frames = chunk(payload_of(5000), FRAME_1K, "m1")
    reassembler = new_reassembler()
    assert [reassembler.feed(f, 0.0) for f in frames[1:]] == [None] * (len(frames) - 1)
    assert reassembler.pending_ids == ("m1",)


def test_redelivered_frame_after_completion_is_refused_as_a_repeat_and_delivers_nothing():
    (only,) = chunk(payload_of(10), FRAME_1K, "m1")
    reassembler = new_reassembler()
    assert reassembler.feed(only, 0.0) is not None
    assert feed_reason(reassembler, only) == "repeat" and reassembler.pending_ids == ()


def test_rejects_frame_shorter_than_its_header():
    frames = chunk(payload_of(10), FRAME_1K, "m1")
    assert feed_reason(new_reassembler(), frames[0][: FRAME_HEADER_BYTES - 1]) == "truncated"


def test_rejects_frame_with_wrong_magic():
    frames = chunk(payload_of(10), FRAME_1K, "m1")
    assert feed_reason(new_reassembler(), b"FARA" + frames[0][4:]) == "bad_magic"


def test_rejects_frame_of_other_version():
    frames = chunk(payload_of(10), FRAME_1K, "m1")
    assert feed_reason(new_reassembler(), frames[0][:4] + bytes([PROTOCOL_VERSION + 1]) + frames[0][5:]) == "bad_version"


def test_rejects_a_version_1_frame_naming_both_versions():
    frames = chunk(payload_of(10), FRAME_1K, "m1")
    with pytest.raises(ProtocolError) as info:
        new_reassembler().feed(frames[0][:4] + b"\x01" + frames[0][5:], 0.0)
    assert info.value.reason == "bad_version" and "version 1" in info.value.message


def test_rejects_frame_with_garbage_after_its_msg_id():
    head = bytearray(chunk(payload_of(10), FRAME_1K, "m1")[0])
    head[6 + 10] = ord("x")
    assert feed_reason(new_reassembler(), bytes(head)) == "bad_frame"


def test_rejects_truncated_single_frame():
    data = payload_of(10)
    digest = hashlib.sha256(data).digest()
    assert feed_reason(new_reassembler(), frame("m1", 0, 1, 10, digest, data[:7])) == "bad_frame"


def test_rejects_last_chunk_longer_than_the_others_could_be():
    data = payload_of(10)
    digest = hashlib.sha256(data).digest()
    assert feed_reason(new_reassembler(), frame("m1", 1, 2, 10, digest, data[:6])) == "bad_frame"


def test_rejects_chunk_whose_length_contradicts_earlier_chunks():
    data = payload_of(30)
    digest = hashlib.sha256(data).digest()
    reassembler = new_reassembler()
    reassembler.feed(frame("m1", 0, 3, 30, digest, data[:10]), 0.0)
    assert feed_reason(reassembler, frame("m1", 1, 3, 30, digest, data[10:21])) == (
        "inconsistent_chunk"
    )


def test_rejects_index_out_of_range():
    digest = hashlib.sha256(b"ab").digest()
    assert feed_reason(new_reassembler(), frame("m1", 2, 2, 2, digest, b"a")) == "bad_index"


def test_rejects_empty_chunk_of_non_empty_payload():
    digest = hashlib.sha256(b"ab").digest()
    assert feed_reason(new_reassembler(), frame("m1", 0, 2, 2, digest, b"")) == "bad_frame"


def test_rejects_more_chunks_than_payload_bytes():
    digest = hashlib.sha256(b"ab").digest()
    assert feed_reason(new_reassembler(), frame("m1", 0, 3, 2, digest, b"a")) == "bad_frame"


def test_rejects_total_over_max_message_bytes():
    frames = chunk(payload_of(2000), FRAME_1K, "m1")
    assert feed_reason(new_reassembler(max_message_bytes=1999), frames[0]) == "oversize"


def test_rejects_frame_whose_count_contradicts_earlier_frames():
    data = payload_of(30)
    digest = hashlib.sha256(data).digest()
    reassembler = new_reassembler()
    reassembler.feed(frame("m1", 0, 3, 30, digest, data[:10]), 0.0)
    assert feed_reason(reassembler, frame("m1", 1, 2, 30, digest, data[10:20])) == (
        "inconsistent_chunk"
    )


def test_rejects_frame_whose_total_contradicts_earlier_frames():
    data = payload_of(30)
    digest = hashlib.sha256(data).digest()
    reassembler = new_reassembler()
    reassembler.feed(frame("m1", 0, 3, 30, digest, data[:10]), 0.0)
    assert feed_reason(reassembler, frame("m1", 1, 3, 29, digest, data[10:20])) == (
        "inconsistent_chunk"
    )


def test_rejects_duplicate_frame_carrying_other_bytes():
    frames = chunk(payload_of(3000), FRAME_1K, "m1")
    reassembler = new_reassembler()
    reassembler.feed(frames[0], 0.0)
    tampered = frames[0][:-1] + bytes([frames[0][-1] ^ 1])
    assert feed_reason(reassembler, tampered) == "inconsistent_chunk"


def test_rejected_frame_leaves_its_message_completable():
    data = payload_of(3000)
    frames = chunk(data, FRAME_1K, "m1")
    reassembler = new_reassembler()
    reassembler.feed(frames[0], 0.0)
    feed_reason(reassembler, frames[1][:-1] + bytes([frames[1][-1] ^ 1]) + b"extra")
    assert [reassembler.feed(f, 0.0) for f in frames[1:]][-1] == data


def test_a_tampered_chunk_is_joined_and_the_envelope_it_breaks_is_refused_by_its_body_digest():
    """The frames' payload hash names the message and is not computed again over the joined bytes (anyone on the
    broker can write a matching one): the reader checks what it reads, here the body digest of the envelope."""
    data = encode(make_message(tensors={"fe.fc1.U": np.arange(1000, dtype=np.float32)}))
    frames = chunk(data, FRAME_1K, "m1")
    reassembler = new_reassembler()
    for f in frames[:-1]:
        reassembler.feed(f, 0.0)
    joined = reassembler.feed(frames[-1][:-5] + bytes([frames[-1][-5] ^ 1]) + frames[-1][-4:], 0.0)
    assert len(joined) == len(data) and joined != data and reassembler.pending_ids == ()
    assert reason_of(joined) == "bad_hash"


def test_expire_drops_incomplete_messages_older_than_timeout():
    reassembler = new_reassembler(timeout_s=5.0)
    reassembler.feed(chunk(payload_of(3000), FRAME_1K, "old")[0], 0.0)
    reassembler.feed(chunk(payload_of(3000), FRAME_1K, "new")[0], 4.0)
    assert reassembler.expire(5.5) == ["old"]
    assert reassembler.pending_ids == ("new",)


def test_expired_message_does_not_complete_from_its_remaining_frames():
    frames = chunk(payload_of(3000), FRAME_1K, "m1")
    reassembler = new_reassembler(timeout_s=5.0)
    reassembler.feed(frames[0], 0.0)
    reassembler.expire(6.0)
    assert [reassembler.feed(f, 6.0) for f in frames[1:]] == [None, None]


def test_pending_bound_evicts_the_oldest_incomplete_message():
    reassembler = new_reassembler(max_pending=2)
    first_frames = {m: chunk(payload_of(3000), FRAME_1K, m) for m in ("a", "b", "c")}
    for t, frames in enumerate(first_frames.values()):
        reassembler.feed(frames[0], float(t))
    assert reassembler.pending_ids == ("b", "c")
    assert [reassembler.feed(f, 3.0) for f in first_frames["a"][1:]] == [None, None]


@pytest.mark.parametrize(
    "kwargs",
    [{"max_message_bytes": -1}, {"timeout_s": 0.0}, {"max_pending": 0}],
)
def test_reassembler_rejects_nonsensical_limits(kwargs):
    with pytest.raises(ValueError):
        new_reassembler(**kwargs)


# --- version 2: authentication fields and the total reassembly budget -------------------------


def test_round_trip_preserves_direction_and_counter_and_returns_the_tag_inputs():
    from device_runtime.auth import Direction, tag_matches

    data = encode(make_message(direction=Direction.DOWN, counter=(5 << 31) | 9))
    decoded = decode(data, max_bytes=MAX_BYTES)
    assert (decoded.direction, decoded.counter) == (Direction.DOWN, (5 << 31) | 9)
    assert tag_matches(KEY, decoded.signed_digest, decoded.tag)
    assert not tag_matches(bytes(32), decoded.signed_digest, decoded.tag)


def test_decode_refuses_a_version_1_envelope_by_its_magic_with_a_clear_reason():
    header, body = split(encode(make_message()))
    v1 = json.dumps({**header, "version": 1}).encode()
    with pytest.raises(ProtocolError) as info:
        decode(b"FARA" + struct.pack("<I", len(v1)) + v1 + body, max_bytes=MAX_BYTES)
    assert info.value.reason == "bad_version" and "version 1" in info.value.message


def test_encode_refuses_a_message_without_a_counter():
    with pytest.raises(ProtocolError, match="counter"):
        encode(make_message(counter=0))


@pytest.mark.parametrize("counter", [0, -1, 2**63, True, "1", 1.0])
def test_decode_rejects_a_counter_that_is_not_a_positive_int_below_2_63(counter):
    assert reason_of(with_header(counter=counter)) == "bad_header"


@pytest.mark.parametrize("direction", ["sideways", None, 1])
def test_decode_rejects_an_unknown_direction(direction):
    assert reason_of(with_header(direction=direction)) == "bad_header"


def test_decode_rejects_a_prefix_cut_inside_the_tag():
    assert reason_of(encode(make_message())[:8 + 31]) == "truncated"


def test_same_msg_id_on_two_streams_reassembles_separately():
    a, b = payload_of(1500), payload_of(1700)
    frames_a, frames_b = chunk(a, FRAME_1K, "m1"), chunk(b, FRAME_1K, "m1")
    reassembler = new_reassembler()
    assert reassembler.feed(frames_a[0], 0.0, stream="t/a") is None
    assert reassembler.feed(frames_b[0], 0.0, stream="t/b") is None
    assert reassembler.feed(frames_b[1], 0.0, stream="t/b") == b
    assert reassembler.feed(frames_a[1], 0.0, stream="t/a") == a


def test_chunks_beyond_the_total_byte_budget_evict_the_oldest_message_of_any_stream():
    reassembler = new_reassembler(max_message_bytes=2600, max_pending_bytes=2600, max_pending=64)
    old = chunk(payload_of(2500), FRAME_1K, "old")
    reassembler.feed(old[0], 0.0, stream="t/a")
    reassembler.feed(old[1], 0.0, stream="t/a")
    reassembler.feed(chunk(payload_of(2600), FRAME_1K, "new")[0], 1.0, stream="t/b")
    assert reassembler.pending_ids == ("new",) and reassembler.pending_bytes == 1000


def test_a_flood_of_first_frames_on_1000_streams_stays_within_the_budget():
    budget = 20 * 1000
    reassembler = new_reassembler(max_message_bytes=budget, max_pending_bytes=budget, max_pending=10_000)
    first = chunk(payload_of(5000), FRAME_1K, "m1")[0]
    for i in range(1000):
        reassembler.feed(first, float(i), stream=f"fedara/dev/x{i}/up")
        assert reassembler.pending_bytes <= budget
    assert len(reassembler.pending_ids) == 20


def test_a_message_as_large_as_the_budget_completes_after_evicting_the_others():
    reassembler = new_reassembler(max_message_bytes=3000, max_pending_bytes=3000)
    reassembler.feed(chunk(payload_of(2500), FRAME_1K, "junk")[0], 0.0, stream="t/x")
    whole = payload_of(3000)
    assert [reassembler.feed(f, 1.0, stream="t/a") for f in chunk(whole, FRAME_1K, "m1")][-1] == whole


def test_budget_below_the_largest_message_is_a_caller_error():
    with pytest.raises(ValueError, match="max_pending_bytes"):
        new_reassembler(max_message_bytes=3000, max_pending_bytes=2999)


def test_lowered_message_limit_refuses_larger_messages_from_then_on():
    reassembler = new_reassembler()
    reassembler.set_max_message_bytes(1000)
    assert feed_reason(reassembler, chunk(payload_of(1001), FRAME_1K, "m1")[0]) == "oversize"
    assert reassembler.feed(chunk(payload_of(1000), FRAME_1K, "m2")[0], 0.0) == payload_of(1000)


def test_message_limit_cannot_rise_above_the_budget():
    with pytest.raises(ValueError, match="max_message_bytes"):
        new_reassembler().set_max_message_bytes(MAX_BYTES + 1)


def test_an_incomplete_message_pushed_out_for_room_is_named_with_its_stream():
    reassembler = Reassembler(4096, 60.0, max_pending=1)
    first, second = chunk(payload_of(2000), FRAME_1K, "m1"), chunk(payload_of(2001), FRAME_1K, "m2")
    reassembler.feed(first[0], 0.0, stream="dev/a/update")
    reassembler.feed(second[0], 0.0, stream="dev/b/update")
    assert reassembler.evicted == [("dev/a/update", "m1")] and reassembler.pending_ids == ("m2",)


def test_the_rest_of_a_message_pushed_out_is_dropped_and_pushes_out_nothing_more():
    reassembler = Reassembler(4096, 60.0, max_pending=1)
    first, second = chunk(payload_of(2000), FRAME_1K, "m1"), chunk(payload_of(2001), FRAME_1K, "m2")
    reassembler.feed(first[0], 0.0, stream="dev/a/update")
    reassembler.feed(second[0], 0.0, stream="dev/b/update")  # pushes m1 out
    assert [reassembler.feed(f, 0.0, stream="dev/a/update") for f in first[1:]] == [None] * (len(first) - 1)
    assert reassembler.pending_ids == ("m2",) and reassembler.evicted == [("dev/a/update", "m1")]
    assert [reassembler.feed(f, 0.0, stream="dev/b/update") for f in second[1:]][-1] == payload_of(2001)
