"""Fuzzing decode() and Reassembler.feed(): valid inputs round-trip, anything else may only
raise ProtocolError. Derandomized, so every run checks the same 12,000 inputs."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from device_runtime.auth import MAX_COUNTER, Direction
from device_runtime.envelope import Message, MessageType, decode
from device_runtime.framing import FRAME_HEADER_BYTES, Reassembler, RepeatedFrame, chunk
from device_runtime.payload import PayloadMismatch, check_payload, payload_ref
from device_runtime.protocol import ProtocolError
from tests.support.envelope_edits import apply_edits, envelope, rehashed, split
from tests.support.sealing import FRAME_LAYOUT, encode
from tests.support.envelope_edits import byte_edits as byte_edits_within

pytestmark = pytest.mark.slow
"""Thousands of envelopes: minutes on two loaded cores. One case per refusal stays in the default suite
(tests/mqtt/test_hostile.py, tests/wire/test_protocol.py)."""
MAX_BYTES = 1 << 16


def fuzz_settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


ID_HEAD = "abcXYZ019_"
ids = st.builds(
    str.__add__, st.sampled_from(ID_HEAD), st.text(alphabet=ID_HEAD + ".-", max_size=15)
)
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63) + 1, 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def seeded_array(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Finite values from a seed: cheaper to generate than element-wise strategies."""
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return rng.normal(scale=1e3, size=shape).astype(dtype)
    return rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, size=shape, dtype=dtype,
                        endpoint=True)


arrays = st.builds(
    seeded_array,
    st.sampled_from(["<f4", "<f8", "<i8", "<i4", "u1"]),
    hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3),
    st.integers(0, 2**32 - 1),
)
messages = st.builds(
    Message,
    type=st.sampled_from(MessageType),
    run_id=ids,
    round=st.integers(0, 2**31 - 1),
    device_id=ids,
    msg_id=ids,
    meta=st.dictionaries(st.text(max_size=6), json_values, max_size=4),
    tensors=st.dictionaries(ids, arrays, max_size=3),
    blobs=st.dictionaries(ids, st.binary(max_size=32), max_size=2),
    direction=st.sampled_from(Direction),
    counter=st.integers(1, MAX_COUNTER),
)


def corpus_message(i: int) -> Message:
    """The i-th of a few varied valid messages: every dtype, 0-d/empty/3-d shapes, blobs, meta."""
    dtypes = ["<f4", "<f8", "<i8", "<i4", "u1"]
    shapes = [(), (0,), (2, 3), (1, 0, 4), (3, 1, 2)]
    tensors = {f"t{j}.w": seeded_array(dtypes[(i + j) % 5], shapes[(i * j) % 5], i + j)
               for j in range(i % 4)}
    blobs = {f"b{j}.onnx": bytes(range(j * 7 % 256))[: i * 5] for j in range(i % 3)}
    meta = {"lam": i / 3, "n": i, "ok": i % 2 == 0, "tags": ["x", None, {"deep": [i, -i]}]}
    return Message(list(MessageType)[i % len(MessageType)], f"run{i}", i, f"dev-{i}", f"m{i}",
                   meta if i % 4 else {}, tensors, blobs, counter=i + 1)


CORPUS = [encode(corpus_message(i)) for i in range(16)]


def fields_of(msg: Message) -> tuple:
    tensors = {n: (a.dtype.str, a.shape, a.tobytes()) for n, a in msg.tensors.items()}
    return (msg.type, msg.run_id, msg.round, msg.device_id, msg.msg_id, msg.direction, msg.counter,
            json.dumps(msg.meta), tensors, msg.blobs)


def decode_or_reject(data: bytes) -> Message | None:
    """decode(), where a ProtocolError is an accepted outcome and any other exception fails."""
    try:
        return decode(data, max_bytes=MAX_BYTES)
    except ProtocolError:
        return None


def assert_consistent_if_accepted(data: bytes) -> None:
    """Whatever decode accepts must survive its own re-encoding unchanged."""
    decoded = decode_or_reject(data)
    if decoded is not None:
        assert fields_of(decode(encode(decoded), max_bytes=MAX_BYTES)) == fields_of(decoded)


@fuzz_settings(2000)
@given(messages)
def test_valid_messages_round_trip(msg):
    assert fields_of(decode(encode(msg), max_bytes=MAX_BYTES)) == fields_of(msg)


byte_edits = byte_edits_within(1 << 16)


@fuzz_settings(3000)
@given(st.sampled_from(CORPUS), st.sampled_from(["envelope", "header", "body"]), byte_edits)
def test_byte_mutated_envelopes_raise_only_protocol_error(data, region, edits):
    """Edit raw bytes anywhere, or inside the header/body with the length and hash fixed up."""
    header, body = split(data)
    if region == "envelope":
        mutated = apply_edits(data, edits)
    elif region == "header":
        mutated = envelope(apply_edits(header, edits), body)
    else:
        body = apply_edits(body, edits)
        mutated = envelope(rehashed(header, body), body)
    assert_consistent_if_accepted(mutated)


header_keys = st.sampled_from(
    ["type", "version", "run_id", "round", "device_id", "msg_id", "meta", "tensors", "blobs",
     "body_sha256"]
)
entry_keys = st.sampled_from(["name", "dtype", "shape", "offset", "nbytes", "extra"])
hostile_values = (
    json_values
    | st.integers(-(2**70), 2**70)
    | st.lists(st.integers(-3, 2**33), max_size=10)
    | st.sampled_from(["float16", "object", "float32", "uint8", "join", "../x", "", "a/b"])
)


@st.composite
def header_edits(draw):
    """Replace, delete or add a top-level key, or a key of one tensor/blob entry."""
    where = draw(st.sampled_from(["top", "tensors", "blobs"]))
    op = draw(st.sampled_from(["set", "delete"]))
    key = draw(entry_keys if where != "top" else header_keys | st.just("extra"))
    return where, draw(st.integers(0, 3)), op, key, draw(hostile_values)


def edit_header(header: dict, edit) -> dict:
    where, index, op, key, value = edit
    target = header
    if where != "top":
        entries = header.get(where)
        if not isinstance(entries, list) or not entries:
            return header
        target = entries[index % len(entries)]
        if not isinstance(target, dict):
            return header
    if op == "set":
        target[key] = value
    else:
        target.pop(key, None)
    return header


@fuzz_settings(3000)
@given(st.sampled_from(CORPUS), st.lists(header_edits(), min_size=1, max_size=3), st.booleans(),
       st.binary(max_size=8))
def test_schema_mutated_headers_raise_only_protocol_error(data, edits, rehash, body_suffix):
    raw_header, body = split(data)
    body += body_suffix
    header = json.loads(raw_header)
    for edit in edits:
        header = edit_header(header, edit)
    if rehash:
        header["body_sha256"] = hashlib.sha256(body).hexdigest()
    assert_consistent_if_accepted(envelope(json.dumps(header).encode(), body))


@fuzz_settings(1000)
@given(st.sampled_from([b"", b"FARA", b"FAR2", b"FAR2\x10\x00\x00\x00" + bytes(32)]), st.binary(max_size=64))
def test_arbitrary_bytes_raise_only_protocol_error(prefix, tail):
    assert_consistent_if_accepted(prefix + tail)


frame_sizes = st.integers(FRAME_HEADER_BYTES + 1, FRAME_HEADER_BYTES + 64)


@fuzz_settings(1000)
@given(st.binary(max_size=600), frame_sizes, st.randoms(use_true_random=False), ids)
def test_shuffled_frames_with_duplicates_reassemble(payload, frame_size, rnd, msg_id):
    frames = chunk(payload, frame_size, msg_id)
    stream = frames + rnd.sample(frames, rnd.randint(0, len(frames)))
    rnd.shuffle(stream)
    reassembler = Reassembler(max_message_bytes=len(payload), timeout_s=1.0, max_pending=1)
    results = []
    for frame in stream:
        try:
            results.append(reassembler.feed(frame, 0.0))
        except RepeatedFrame:  # a duplicate after the message completed: refused, delivers nothing
            results.append("repeat")
    delivered = [r for r in results if r is not None]
    assert delivered[0] == payload and set(delivered[1:]) <= {"repeat"}


@st.composite
def random_frames(draw) -> bytes:
    """Frames whose header fields are each mostly plausible, sometimes out of range."""
    ident = draw(st.sampled_from([b"m1", b"m1", b"m2", b"", b"a/b", b"\xff", b"x" * 64]))
    data = draw(st.binary(max_size=12))
    n = len(data)
    head = FRAME_LAYOUT.pack(
        draw(st.sampled_from([b"FACK"] * 4 + [b"FARA"])),
        draw(st.sampled_from([2] * 4 + [0, 1, 3])),
        draw(st.sampled_from([len(ident)] * 4 + [0, 65, 255])),
        ident + draw(st.sampled_from([b""] * 4 + [b"\x00", b"z"])),
        draw(st.sampled_from([0, 0, 1, 2, 2**32 - 1])),
        draw(st.sampled_from([1, 1, 2, 3, 0, 2**32 - 1])),
        draw(st.sampled_from([n, n, 2 * n, max(2 * n - 1, 0), 3 * n, n + 1, 0, 2**64 - 1])),
        draw(st.sampled_from([hashlib.sha256(data).digest()] * 2 + [bytes(32)])),
    )
    return head[:draw(st.sampled_from([len(head)] * 4 + [40]))] + data


@fuzz_settings(1000)
@given(st.lists(random_frames(), min_size=1, max_size=4))
def test_random_frames_raise_only_protocol_error(frames):
    reassembler = Reassembler(max_message_bytes=1 << 20, timeout_s=1.0, max_pending=2)
    for f in frames:
        try:
            result = reassembler.feed(f, 0.0)
        except ProtocolError:
            continue
        assert result is None or len(result) == FRAME_LAYOUT.unpack_from(f)[6]  # the total its frames named


@fuzz_settings(1000)
@given(st.binary(min_size=1, max_size=400), frame_sizes, byte_edits, st.integers(0, 64),
       st.randoms(use_true_random=False))
def test_mutated_frames_raise_only_protocol_error_and_never_pass_the_readers_check(
    payload, frame_size, edits, target, rnd
):
    """The reassembler does not hash what it joins (anyone can forge the frames' hash): mutated bytes may be joined,
    and the reader's own check (here a plan payload's, against the hash its sealed TASK names) refuses them."""
    ref = payload_ref(payload)
    frames = chunk(payload, frame_size, "m1")
    frames[target % len(frames)] = apply_edits(frames[target % len(frames)], edits)
    rnd.shuffle(frames)
    reassembler = Reassembler(max_message_bytes=1 << 20, timeout_s=1.0, max_pending=2)
    for f in frames:
        try:
            result = reassembler.feed(f, 0.0)
        except ProtocolError:
            continue
        if result is not None and result != payload:
            with pytest.raises(PayloadMismatch):
                check_payload(result, ref)
