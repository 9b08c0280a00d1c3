"""Fuzzing the server's inbound path with 11,000 generated and mutated envelopes.

Each envelope goes, on a device's up topic, to a fresh in-process server with round 1 open (see
tests/mqtt/test_hostile.py): decode with the inbound limit, parse, judge, aggregate. Nothing may escape but the
designed refusal. A refused envelope is logged once and leaves the global FE, the running average, the
registry and the plan bookkeeping bit for bit as they were, and adds no update or evaluation to the round
(it may only be recorded as a device's one answer when it is that device's own update for the open round).
An envelope the server takes is a well-formed JOIN, ACK, ERROR or UPDATE of the device whose topic it came
on. Derandomized: every run checks the same inputs, and each test checks it ran all of its examples.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from device_runtime.envelope import MAX_ROUND, Message, MessageType, decode
from device_runtime.messages import ErrorCode, Join, ack_message, error_message, join_message
from server.engine.coordinator import NO_ANSWER
from tests.support.envelope_edits import apply_edits, envelope, rehashed, split
from tests.support.envelope_edits import byte_edits as byte_edits_within
from tests.support.sealing import seal_up as encode  # as the device would seal it: the fuzz reaches behind the tag
from tests.support.hostile_world import (DENSE, EVAL, FACTORED, LOW_RANK, PROFILE, REFUSED, ROUND, RUN, SERVER_LOG,
                                         SHARD, STRANGER, TRAINER, UNASSIGNED, World, aggregated, close,
                                         genuine_update, open_server, server_state, up)

pytestmark = pytest.mark.slow
"""Thousands of envelopes: minutes on two loaded cores. One case per refusal stays in the default suite
(tests/mqtt/test_hostile.py, tests/wire/test_protocol.py)."""
DEVICES = (TRAINER, FACTORED, UNASSIGNED, STRANGER)
TOPICS = tuple(up(d) for d in DEVICES)
TAKEN = (MessageType.JOIN, MessageType.ACK, MessageType.ERROR, MessageType.UPDATE)
FLOAT_SPECIALS = (np.nan, np.inf, -np.inf, 3e38, -0.0)


def fuzz_settings(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    phases=(Phase.explicit, Phase.generate, Phase.shrink),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class ServerLog(logging.Handler):
    """The server's log lines, kept here and not passed on: 11,000 refusals would flood pytest's report."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> ServerLog:
        logger = logging.getLogger(SERVER_LOG)
        self.saved = logger.level, logger.propagate
        logger.addHandler(self)
        logger.setLevel(logging.WARNING)
        logger.propagate = False
        return self

    def __exit__(self, *exc_info: object) -> None:
        logger = logging.getLogger(SERVER_LOG)
        logger.removeHandler(self)
        logger.level, logger.propagate = self.saved

    def refusals(self) -> list[str]:
        return [line for line in self.lines if line.startswith(REFUSED)]


def check(world: World, topic: str, payload: bytes, log: ServerLog) -> None:
    """One envelope against a fresh server: refused and harmless, or well formed and taken."""
    server = open_server(world)
    before = server_state(server)
    log.lines.clear()
    server._handle(topic, payload)
    refused = log.refusals()
    after = server_state(server)
    taken = aggregated(server)
    result = close(server)
    if refused:
        assert len(refused) == 1, refused
        assert after == before, refused
        assert result.accepted == () and result.evaluations == {}, refused
        answered = {d for d, reason in result.dropped.items() if reason != NO_ANSWER}
        if answered:
            msg = decode(payload, max_bytes=server.max_inbound, allow_nonfinite=True)
            assert answered == {msg.device_id} and topic == up(msg.device_id)
            assert (msg.type, msg.run_id, msg.round) == (MessageType.UPDATE, RUN, ROUND)
        return
    msg = decode(payload, max_bytes=server.max_inbound, allow_nonfinite=True)
    assert msg.type in TAKEN and topic == up(msg.device_id)
    if msg.type == MessageType.UPDATE:
        assert result.accepted == (msg.device_id,) and taken == 1


def run_fuzz(world: World, examples: int, strategy: st.SearchStrategy,
             make: Callable[..., tuple[str, bytes]]) -> None:
    """Check ``examples`` envelopes made by ``make(*drawn)``; fail unless every one of them ran."""
    ran = []

    @fuzz_settings(examples)
    @given(strategy)
    def fuzz(drawn):
        topic, payload = make(*drawn)
        with ServerLog() as log:
            check(world, topic, payload, log)
        ran.append(1)

    fuzz()
    assert len(ran) >= examples


# -- values ------------------------------------------------------------------------------------------

ID_HEAD = "abcXYZ019_"
ids = st.builds(str.__add__, st.sampled_from(ID_HEAD), st.text(alphabet=ID_HEAD + ".-", max_size=15))
json_scalars = (st.none() | st.booleans() | st.integers(-(2**63) + 1, 2**63 - 1)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
plausible_values = (json_values | st.sampled_from([0, 1, -1, 30, 10, 2**31, 0.5, 1.5, -0.5, "", "rejoin", "a1" * 32])
                    | st.builds(dict, st.just(EVAL)))
hostile_values = (plausible_values | st.integers(-(2**70), 2**70) | st.lists(st.integers(-3, 2**33), max_size=10)
                  | st.sampled_from(["float16", "object", "float32", "update", "../x", "a/b", "NaN"]))
rounds = st.sampled_from([0, ROUND, ROUND + 1, MAX_ROUND]) | st.integers(0, MAX_ROUND)
run_ids = st.sampled_from([RUN, "run0", "none"]) | ids


def seeded_array(dtype: str, shape: tuple[int, ...], seed: int, special: float | None) -> np.ndarray:
    """Values from a seed (cheap to generate), with one special float written in when asked."""
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        array = rng.normal(size=shape).astype(dtype)
        if special is not None and array.size:
            array.reshape(-1)[seed % array.size] = special
        return array
    return rng.integers(0, 100, size=shape).astype(dtype)


dtypes = st.sampled_from(["float32"] * 4 + ["float64", "int64", "int32", "uint8"])
specials = st.none() | st.none() | st.sampled_from(FLOAT_SPECIALS)


def plan_shapes(world: World) -> dict[str, tuple[int, ...]]:
    """Every FE tensor name of both plans with its shape."""
    shapes = {}
    for ratio in (DENSE, LOW_RANK):
        shapes.update(world.plans.get(ratio).fe_shapes)
    return shapes


def tensor_specs(world: World) -> st.SearchStrategy:
    """(base, specs): a plan's trained tensors or none, and tensors to add or replace, of the plans' names and
    shapes or any, in any dtype, some holding a special float."""
    shapes = plan_shapes(world)
    some_shape = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)
    spec = st.tuples(dtypes, some_shape | st.sampled_from(sorted(set(shapes.values()))), st.integers(0, 2**32 - 1),
                     specials)
    return st.tuples(st.sampled_from([None, DENSE, LOW_RANK]),
                     st.dictionaries(st.sampled_from(sorted(shapes)) | ids, spec, max_size=4))


def build_tensors(trained: dict[float, dict[str, np.ndarray]], base: float | None,
                  specs: dict[str, tuple]) -> dict[str, np.ndarray]:
    fe = dict(trained[base]) if base is not None else {}
    fe.update({name: seeded_array(*spec) for name, spec in specs.items()})
    return fe


def corpus(world: World) -> list[tuple[str, Message]]:
    """Well-formed messages of the kinds devices send, each with the topic it belongs on."""
    dense_hash = world.plans.get(DENSE).hash
    messages = [genuine_update(world, TRAINER), genuine_update(world, FACTORED),
                join_message(Join(PROFILE, SHARD, (dense_hash,)), device_id=TRAINER, run_id=RUN),
                join_message(Join(PROFILE, SHARD, ()), device_id=STRANGER),
                ack_message(dense_hash, device_id=TRAINER, run_id=RUN),
                error_message(ErrorCode.ARTIFACTS_CORRUPT, "checkpoint", device_id=TRAINER, run_id=RUN)]
    return [(up(m.device_id), m) for m in messages]


# -- generated envelopes -------------------------------------------------------------------------------


def test_generated_envelopes(world: World):
    """Messages of every type, from every kind of device id, on every device topic, with meta drawn from
    what each type should carry and edited, and tensors of the plans' names, shapes and dtypes or not."""
    templates = {m.type: m.meta for _, m in corpus(world)}
    trained = {DENSE: genuine_update(world, TRAINER).tensors, LOW_RANK: genuine_update(world, FACTORED).tensors}
    meta_edits = st.lists(st.tuples(st.sampled_from(sorted({k for t in templates.values() for k in t})) | ids,
                                    st.booleans(), plausible_values), max_size=3)
    strategy = st.tuples(st.sampled_from(MessageType), meta_edits, st.sampled_from(DEVICES), run_ids, rounds, ids,
                         tensor_specs(world), st.dictionaries(ids, st.binary(max_size=16), max_size=2),
                         st.integers(0, len(TOPICS) + 2))

    def make(kind, edits, device_id, run_id, round_index, msg_id, tensors, blobs, topic_index):
        meta = json.loads(json.dumps(templates.get(kind, {})))
        for key, delete, value in edits:
            set_or_delete(meta, key, delete, value)
        msg = Message(kind, run_id, round_index, device_id, msg_id, meta, build_tensors(trained, *tensors), blobs)
        return (TOPICS[topic_index] if topic_index < len(TOPICS) else up(device_id)), encode(msg)

    run_fuzz(world, 2500, strategy, make)


# -- mutated envelopes ----------------------------------------------------------------------------------

byte_edits = byte_edits_within(1 << 20)


def test_byte_mutated_envelopes(world: World):
    """Raw edits anywhere in a well-formed message, or in its header or body with the hash fixed up."""
    messages = [(topic, encode(m)) for topic, m in corpus(world)]

    def mutate(index: int, region: str, edits: list, near_start: bool, topic_shift: int) -> tuple[str, bytes]:
        topic, data = messages[index]
        header, body = split(data)
        if region == "envelope":
            mutated = apply_edits(data, edits, near_start)
        elif region == "header":
            mutated = envelope(apply_edits(header, edits, True), body)
        else:
            body = apply_edits(body, edits, near_start)
            mutated = envelope(rehashed(header, body), body)
        return TOPICS[(TOPICS.index(topic) + topic_shift) % len(TOPICS)] if topic_shift > 2 else topic, mutated

    strategy = st.tuples(st.integers(0, len(messages) - 1), st.sampled_from(["envelope", "header", "body"]),
                         byte_edits, st.booleans(), st.integers(0, 4))
    run_fuzz(world, 3000, strategy, mutate)


header_keys = st.sampled_from(["type", "version", "run_id", "round", "device_id", "msg_id", "meta", "tensors",
                               "blobs", "body_sha256", "extra"])
entry_keys = st.sampled_from(["name", "dtype", "shape", "offset", "nbytes", "extra"])


def test_schema_mutated_headers(world: World):
    """A well-formed message's header with keys of the envelope, its meta or a tensor entry set to odd values
    or removed, the body's hash fixed up or not."""
    messages = corpus(world)
    edit = st.tuples(st.sampled_from(["top", "meta", "tensors"]), st.integers(0, 7), st.booleans(),
                     header_keys | entry_keys | st.sampled_from(["num_samples", "metrics", "plan_hash", "code"]),
                     hostile_values)

    def mutate(index: int, edits: list, rehash: bool) -> tuple[str, bytes]:
        topic, msg = messages[index]
        raw_header, body = split(encode(msg))
        header = json.loads(raw_header)
        for where, position, delete, key, value in edits:
            target = header
            if where == "meta":
                target = header["meta"] if isinstance(header.get("meta"), dict) else header
            elif where == "tensors":
                entries = header.get("tensors")
                if isinstance(entries, list) and entries and isinstance(entries[position % len(entries)], dict):
                    target = entries[position % len(entries)]
            set_or_delete(target, key, delete, value)
        raw = json.dumps(header).encode()
        raw = rehashed(raw, body) if rehash else raw
        return topic, envelope(raw, body)

    strategy = st.tuples(st.integers(0, len(messages) - 1), st.lists(edit, min_size=1, max_size=3), st.booleans())
    run_fuzz(world, 2000, strategy, mutate)


def test_field_mutated_updates(world: World):
    """Well-formed updates with their fields, metrics and tensors changed one to three at a time and encoded
    properly, so every change reaches the parser and the judge."""
    shapes = plan_shapes(world)
    tensor_ops = st.sampled_from(["special", "scale", "float64", "transpose", "delete", "empty", "add"])
    edit = st.one_of(
        st.tuples(st.just("meta"), st.sampled_from(["num_samples", "train_loss", "train_accuracy", "plan_hash",
                                                    "metrics", "extra"]), st.booleans(), plausible_values),
        st.tuples(st.just("metrics"), st.sampled_from(["eval_correct", "eval_total", "eval_loss", "seconds"]),
                  st.booleans(), plausible_values),
        st.tuples(st.just("tensor"), st.sampled_from(sorted(shapes)), tensor_ops, st.sampled_from(FLOAT_SPECIALS)),
        st.tuples(st.just("header"), st.sampled_from(["round", "run_id", "device_id"]), st.integers(0, 3), rounds),
    )

    updates = [genuine_update(world, device_id) for device_id in (TRAINER, FACTORED)]

    def mutate(device_index: int, edits: list, on_own_topic: bool) -> tuple[str, bytes]:
        msg = copy_of(updates[device_index])
        for kind, key, how, value in edits:
            if kind == "meta":
                set_or_delete(msg.meta, key, how, value)
            elif kind == "metrics" and isinstance(msg.meta.get("metrics"), dict):
                set_or_delete(msg.meta["metrics"], key, how, value)
            elif kind == "tensor":
                edit_tensor(msg.tensors, key, how, value, shapes[key])
            elif kind == "header":
                if key == "round":
                    msg.round = value
                elif key == "run_id":
                    msg.run_id = (RUN, "run0", "none", "x")[how]
                else:
                    msg.device_id = DEVICES[how]
        return up(msg.device_id) if on_own_topic else up((TRAINER, FACTORED)[device_index]), encode(msg)

    strategy = st.tuples(st.integers(0, 1), st.lists(edit, min_size=1, max_size=3), st.booleans())
    run_fuzz(world, 2500, strategy, mutate)


def copy_of(msg: Message) -> Message:
    """A copy whose meta and tensor dicts can be edited (edits replace arrays, never write into them)."""
    return Message(msg.type, msg.run_id, msg.round, msg.device_id, msg.msg_id, json.loads(json.dumps(msg.meta)),
                   dict(msg.tensors), dict(msg.blobs))


def set_or_delete(target: dict, key: str, delete: bool, value: object) -> None:
    if delete:
        target.pop(key, None)
    else:
        target[key] = value


def edit_tensor(tensors: dict[str, np.ndarray], name: str, how: str, special: float, shape: tuple[int, ...]) -> None:
    """Add, delete, empty, poison, scale, widen or transpose one tensor (never writing into a shared array)."""
    value = tensors.get(name)
    if how == "add" or value is None:
        tensors[name] = np.ones(shape, np.float32)
    elif how == "delete":
        del tensors[name]
    elif how == "empty" or not value.size:
        tensors[name] = np.zeros((0,), np.float32)
    elif how == "special":
        value = value.copy()
        value.reshape(-1)[value.size // 2] = special
        tensors[name] = value
    elif how == "scale":
        with np.errstate(over="ignore"):
            tensors[name] = value * np.float32(1e6)
    elif how == "float64":
        tensors[name] = value.astype(np.float64)
    else:
        tensors[name] = np.ascontiguousarray(value.reshape(value.shape[0], -1).T)


def test_arbitrary_bytes(world: World):
    """Bytes that are not an envelope at all, or stop right after its magic or length."""
    strategy = st.tuples(st.sampled_from([b"", b"FARA", b"FARA\x10\x00\x00\x00", b"FACK"]), st.binary(max_size=64),
                         st.sampled_from(TOPICS))
    run_fuzz(world, 1000, strategy, lambda prefix, tail, topic: (topic, prefix + tail))
