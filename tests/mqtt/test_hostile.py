"""Hostile input at the server's door and at the device's.

Server side, the path under test is the broker loop's own inbound path, in process: a message's bytes and
topic go to ``Federation._handle`` (what the loop does with every reassembled message: decode with the
inbound size limit, parse, hand it to the RoundEngine, which judges it and folds what it accepts into the
round's average). Every malformed, forged or replayed message must be refused with a logged reason and leave
the global FE, the running average, the round's byte book, the registry and the plan bookkeeping as they
were, bit for bit. Chunk-level faults go through a real
MqttEndpoint. Device side, tampered artifacts and malformed tasks are refused by the agent.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import paho.mqtt.publish
import pytest

from device_runtime.agent import DeviceAgent
from device_runtime.workdir import HEADS_DIR, Workdir
from device_runtime.artifact_contract import MANIFEST_NAME
from device_runtime.envelope import Message, MessageType, decode
from device_runtime.framing import FRAME_HEADER_BYTES, chunk
from device_runtime.messages import (ErrorCode, Join, Plan, ack_message, error_message, join_message, parse_error,
                                     plan_message, task_message, update_message)
from device_runtime.profile import collect_profile
from device_runtime.protocol import PROTOCOL_VERSION, ProtocolError
from device_runtime.shard import Shard
from device_runtime.task import Phase, Task, Update
from device_runtime.topics import Topics, server_subscriptions
from device_runtime.transport import MqttEndpoint
from server import broker_loop, simulate
from server.outputs.checkpoint import CHECKPOINT_NAME, load_checkpoint
from server.outputs.progress import Progress
from server.outputs.report import METRICS_FILE, read_metrics
from server.run_setup import RunFolder
from server.engine.sampling import plan_key
from tests.support.mqtt_peer import MqttPeer
from tests.support.sealing import device_link, seal_down
from tests.support.sealing import seal_up as encode  # every message as its device would seal it, with a fresh counter
from tests.support.recording_endpoint import RecordingEndpoint
from tests.support.hostile_world import (CLASSES, DENSE, EVAL, FACTORED, INPUT_SHAPE, LOW_RANK, PREFIX, PROFILE, ROUND,
                                         RUN, SHARD, STRANGER, TRAINER, UNASSIGNED, WAIT_S, World, aggregated, close,
                                         genuine_update, open_server, refused, trained_fe, up, update_topic)


# -- the control: genuine updates count ------------------------------------------------------------


def test_genuine_updates_of_both_plans_are_averaged(world: World):
    server = open_server(world)
    for device_id in (TRAINER, FACTORED):
        server._handle(update_topic(device_id), encode(genuine_update(world, device_id)))
    assert aggregated(server) == 2
    result = close(server)
    assert result.accepted == (TRAINER, FACTORED) and result.enough


def test_a_device_reporting_a_non_finite_round_is_dropped_with_its_reason_and_counted(world: World):
    """The device whose model diverged sends ERROR non_finite (it cannot send a NaN loss): the broker loop refuses
    its answer for that reason, counts it, and aggregates only the genuine update."""
    server = open_server(world)
    server._handle(update_topic(TRAINER), encode(genuine_update(world, TRAINER)))
    report = error_message(ErrorCode.NON_FINITE, "round 1: train_loss is nan: no update sent", device_id=FACTORED,
                           run_id=RUN, round_index=ROUND)
    server._handle(up(FACTORED), encode(report))
    assert aggregated(server) == 1 and server.refusals == {"update non-finite": 1}
    result = close(server)
    assert result.accepted == (TRAINER,)
    assert result.dropped[FACTORED] == "non-finite: round 1: train_loss is nan: no update sent"


# -- tensors ---------------------------------------------------------------------------------------


def with_tensor(world: World, name: str, value: np.ndarray | None) -> dict[str, np.ndarray]:
    """TRAINER's trained FE with tensor ``name`` replaced (None: removed)."""
    fe = trained_fe(world, TRAINER)
    if value is None:
        del fe[name]
    else:
        fe[name] = value
    return fe


def poisoned(world: World, special: float) -> dict[str, np.ndarray]:
    fe = trained_fe(world, TRAINER)
    fe["fe.fc1.weight"][3, 5] = special
    return fe


@pytest.mark.parametrize("special", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_update_with_a_non_finite_tensor_is_refused(world: World, special: float, caplog):
    server = open_server(world)
    reason = refused(server, update_topic(TRAINER), encode(genuine_update(world, fe=poisoned(world, special))), caplog)
    assert "tensor fe.fc1.weight holds NaN or infinity" in reason
    assert close(server).accepted == ()


@pytest.mark.parametrize("fe_edit, expected", [
    (("fe.fc1.weight", None), "missing ['fe.fc1.weight']"),
    (("fe.fc9.weight", np.zeros((2, 2), np.float32)), "unknown ['fe.fc9.weight']"),
    (("fe.fc1.u", np.zeros((512, 32), np.float32)), "unknown ['fe.fc1.u']"),
], ids=["missing", "unknown", "another-plans-factor"])
def test_update_with_wrong_tensor_names_is_refused(world: World, fe_edit, expected: str, caplog):
    reason = refused(open_server(world), update_topic(TRAINER),
                     encode(genuine_update(world, fe=with_tensor(world, *fe_edit))), caplog)
    assert "tensors do not match the plan" in reason and expected in reason


def test_update_with_a_wrong_shape_is_refused(world: World, caplog):
    fe = with_tensor(world, "fe.fc1.weight", np.zeros((64, 512), np.float32))
    reason = refused(open_server(world), update_topic(TRAINER), encode(genuine_update(world, fe=fe)), caplog)
    assert "tensor fe.fc1.weight: shape (64, 512), expected (512, 64)" in reason


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.uint8])
def test_update_with_a_wrong_dtype_is_refused(world: World, dtype, caplog):
    fe = with_tensor(world, "fe.conv1.bias", np.zeros(32, dtype))
    reason = refused(open_server(world), update_topic(TRAINER), encode(genuine_update(world, fe=fe)), caplog)
    assert f"tensor fe.conv1.bias: dtype {np.dtype(dtype).name}, expected float32" in reason


# -- envelopes -------------------------------------------------------------------------------------


def test_oversize_body_is_refused_before_it_is_parsed(world: World, caplog):
    server = open_server(world)
    fe = with_tensor(world, "fe.fc1.weight", np.zeros(server.max_inbound // 4, np.float32))
    reason = refused(server, update_topic(TRAINER), encode(genuine_update(world, fe=fe)), caplog)
    assert f"over max_bytes={server.max_inbound} [oversize]" in reason


@pytest.mark.parametrize("cut", [1, 1000, 10**6], ids=["last-byte", "into-the-body", "into-the-header"])
def test_truncated_envelope_is_refused(world: World, cut: int, caplog):
    payload = encode(genuine_update(world))
    reason = refused(open_server(world), update_topic(TRAINER), payload[:max(len(payload) - cut, 6)], caplog)
    assert reason.startswith(f"dropped a message on {update_topic(TRAINER)}") and \
        ("[bad_layout]" in reason or "[truncated]" in reason)


def test_body_that_does_not_match_its_hash_is_refused(world: World, caplog):
    payload = bytearray(encode(genuine_update(world)))
    payload[-7] ^= 0x40
    reason = refused(open_server(world), update_topic(TRAINER), bytes(payload), caplog)
    assert "body_sha256 does not match the body [bad_hash]" in reason


def test_header_naming_another_protocol_version_is_refused(world: World, caplog):
    other = PROTOCOL_VERSION + 1
    payload = encode(genuine_update(world)).replace(b'"version":%d' % PROTOCOL_VERSION, b'"version":%d' % other, 1)
    assert f"protocol version {other}" in refused(open_server(world), update_topic(TRAINER), payload, caplog)


def test_message_on_a_topic_outside_the_device_tree_is_refused(world: World, caplog):
    reason = refused(open_server(world), f"{PREFIX}/dev/{TRAINER}/up/extra", encode(genuine_update(world)), caplog)
    assert "[bad_topic]" in reason


# -- replays ---------------------------------------------------------------------------------------


def test_update_replayed_in_the_same_round_is_refused(world: World, caplog):
    server = open_server(world)
    payload = encode(genuine_update(world))
    server._handle(update_topic(TRAINER), payload)
    assert aggregated(server) == 1
    # the same bytes: the same counter
    assert refused(server, update_topic(TRAINER), payload, caplog).endswith("[replay]")
    resent = encode(genuine_update(world))  # the device's own re-send carries a fresh counter
    assert "duplicate update for round 1" in refused(server, update_topic(TRAINER), resent, caplog)


def test_update_replayed_in_a_later_round_is_refused(world: World, caplog):
    server = open_server(world)
    payload = encode(genuine_update(world))
    server._handle(update_topic(TRAINER), payload)
    close(server)
    server.engine.open_round(ROUND + 1, time.monotonic())
    assert refused(server, update_topic(TRAINER), payload, caplog).endswith("[replay]")
    resent = encode(genuine_update(world))
    assert "stale: update for round 1, round 2 is open" in refused(server, update_topic(TRAINER), resent, caplog)


def test_update_replayed_between_rounds_is_refused(world: World, caplog):
    server = open_server(world)
    payload = encode(genuine_update(world))
    server._handle(update_topic(TRAINER), payload)
    close(server)
    assert refused(server, update_topic(TRAINER), payload, caplog).endswith("[replay]")
    assert "no round is open" in refused(server, update_topic(TRAINER), encode(genuine_update(world)), caplog)


def test_update_of_another_run_is_refused(world: World, caplog):
    reason = refused(open_server(world), update_topic(TRAINER), encode(genuine_update(world, run_id="run0")), caplog)
    assert reason.endswith("run 'run0' is not this run [wrong_run]")


# -- identities ------------------------------------------------------------------------------------


def test_update_from_an_unknown_device_is_refused(world: World, caplog):
    msg = genuine_update(world, sender=STRANGER)
    assert "unknown device" in refused(open_server(world), update_topic(STRANGER), encode(msg), caplog)


def test_update_from_a_device_without_a_plan_is_refused(world: World, caplog):
    msg = genuine_update(world, sender=UNASSIGNED)
    assert "not asked in round 1" in refused(open_server(world), update_topic(UNASSIGNED), encode(msg), caplog)


def test_update_sent_for_another_device_is_refused_and_does_not_use_up_its_turn(world: World, caplog):
    server = open_server(world)
    forged = genuine_update(world, TRAINER)
    reason = refused(server, update_topic(FACTORED), encode(forged), caplog)
    assert f"a message of {TRAINER!r} on a topic of {FACTORED!r} [bad_topic]" in reason
    server._handle(update_topic(TRAINER), encode(genuine_update(world, TRAINER)))
    server._handle(update_topic(FACTORED), encode(genuine_update(world, FACTORED)))
    assert close(server).accepted == (TRAINER, FACTORED)


@pytest.mark.parametrize("make", [
    lambda world: join_message(Join(PROFILE, SHARD, ()), device_id=TRAINER),
    lambda world: ack_message(world.plans.get(DENSE).hash, device_id=TRAINER, run_id=RUN),
    lambda world: error_message(ErrorCode.ARTIFACTS_CORRUPT, "resend", device_id=TRAINER, run_id=RUN),
], ids=["join", "ack", "error"])
def test_other_messages_sent_for_another_device_are_refused(world: World, make, caplog):
    reason = refused(open_server(world), up(FACTORED), encode(make(world)), caplog)
    assert f"a message of {TRAINER!r} on a topic of {FACTORED!r} [bad_topic]" in reason


def test_status_frame_on_the_up_topic_is_refused(world: World, caplog):
    msg = Message(MessageType.STATUS, RUN, ROUND, TRAINER, "m1", {})
    assert "a status message on the up topic [bad_topic]" in refused(open_server(world), up(TRAINER),
                                                                          encode(msg), caplog)


@pytest.mark.parametrize("kind", [MessageType.PLAN, MessageType.TASK])
def test_server_bound_topic_refuses_message_types_devices_do_not_send(world: World, kind, caplog):
    msg = Message(kind, RUN, ROUND, TRAINER, "m1", {})
    assert f"dropped an unexpected {kind.value} from {TRAINER}" in refused(open_server(world), up(TRAINER),
                                                                          encode(msg), caplog)


# -- malformed fields ------------------------------------------------------------------------------


@pytest.mark.parametrize("meta, expected", [
    ({"code": ["rejoin"], "detail": "x"}, "unknown error code"),
    ({"code": {"a": 1}, "detail": "x"}, "unknown error code"),
    ({"code": "rejoin", "detail": 5}, "error detail must be text"),
], ids=["code-list", "code-object", "detail-number"])
def test_malformed_error_report_is_refused(world: World, meta: dict, expected: str, caplog):
    msg = Message(MessageType.ERROR, RUN, 0, TRAINER, "e1", meta)
    reason = refused(open_server(world), up(TRAINER), encode(msg), caplog)
    assert reason.startswith(f"dropped a malformed error from {TRAINER}") and expected in reason


def test_malformed_join_is_refused(world: World, caplog):
    msg = join_message(Join(PROFILE, SHARD, ()), device_id=STRANGER)
    msg.meta["shard"]["num_train"] = -1
    reason = refused(open_server(world), up(STRANGER), encode(msg), caplog)
    assert reason.startswith(f"refused {STRANGER}: malformed join") and "num_train" in reason


def test_acknowledgement_of_another_plan_is_refused(world: World, caplog):
    msg = ack_message(world.plans.get(LOW_RANK).hash, device_id=TRAINER, run_id=RUN)
    assert f"ignored an ACK from {TRAINER}" in refused(open_server(world), up(TRAINER), encode(msg), caplog)


@pytest.mark.parametrize("meta_edit, expected", [
    (("num_samples", 10**6), "num_samples 1000000, expected 30"),
    (("train_accuracy", 7.0), "train_accuracy must be in [0, 1]"),
    (("metrics", {"eval_correct": 11, "eval_total": 10, "eval_loss": 0.1}), "does not fit the 10 test samples"),
    (("plan_hash", "0" * 64), "the device's plan is"),
], ids=["samples", "accuracy", "evaluation", "plan"])
def test_update_with_implausible_fields_is_refused(world: World, meta_edit, expected: str, caplog):
    msg = genuine_update(world)
    msg.meta[meta_edit[0]] = meta_edit[1]
    assert expected in refused(open_server(world), update_topic(TRAINER), encode(msg), caplog)


# -- chunks, through a real endpoint ---------------------------------------------------------------

SMALL_FRAME = 16 * 1024


@pytest.fixture
def server_endpoint(embedded_broker, world: World) -> Iterator[MqttEndpoint]:
    """An endpoint set up as the broker loop sets up its own (size limit, subscriptions), on small frames."""
    endpoint = MqttEndpoint("hostile-test-server", embedded_broker.url, subscriptions=server_subscriptions(PREFIX),
                            max_message_bytes=world.max_inbound, max_frame_bytes=SMALL_FRAME,
                            clean_session=True)
    endpoint.start()
    endpoint.wait_connected(WAIT_S)
    yield endpoint
    endpoint.stop()


def publish_frames(broker_url: str, topic: str, frames: list[bytes]) -> None:
    """Publish raw frames in this order over one connection, then a one-frame marker on the same topic."""
    host, port = broker_url.rsplit("/", 1)[1].split(":")
    marker = chunk(b"end", SMALL_FRAME, "marker")
    paho.mqtt.publish.multiple([{"topic": topic, "payload": f, "qos": 1} for f in frames + marker],
                               hostname=host, port=int(port), client_id="hostile-frames")


def delivered(endpoint: MqttEndpoint) -> list[bytes]:
    """The payloads the endpoint reassembled, up to the marker."""
    payloads = []
    while (item := endpoint.get(WAIT_S)) is not None and item[1] != b"end":
        payloads.append(item[1])
    assert item is not None, "the marker never arrived"
    return payloads


def update_frames(world: World) -> tuple[bytes, list[bytes]]:
    payload = encode(genuine_update(world))
    frames = chunk(payload, SMALL_FRAME, "update-1")
    assert len(frames) > 3
    return payload, frames


def test_chunks_out_of_order_are_reassembled_into_the_same_update(world: World, server_endpoint, embedded_broker):
    payload, frames = update_frames(world)
    publish_frames(embedded_broker.url, update_topic(TRAINER), frames[::-1])
    assert delivered(server_endpoint) == [payload]
    server = open_server(world)
    server._handle(update_topic(TRAINER), payload)
    assert close(server).accepted == (TRAINER,)


def mangled(frames: list[bytes], how: str) -> list[bytes]:
    head, body = frames[1][:FRAME_HEADER_BYTES], frames[1][FRAME_HEADER_BYTES:]
    if how == "truncated":
        return [frames[0], frames[1][:FRAME_HEADER_BYTES - 9], *frames[2:]]
    if how == "empty":
        return [frames[0], head, *frames[2:]]
    raise ValueError(how)


@pytest.mark.parametrize("how, expected", [
    ("truncated", "[truncated]"),
    ("empty", "[bad_frame]"),
])
def test_broken_chunks_never_reach_the_server(world: World, server_endpoint, embedded_broker, how: str,
                                              expected: str, caplog):
    _, frames = update_frames(world)
    with caplog.at_level(logging.WARNING, logger="fedara.transport"):
        publish_frames(embedded_broker.url, up(TRAINER), mangled(frames, how))
        assert delivered(server_endpoint) == []
    assert expected in caplog.text and f"dropped frame on {up(TRAINER)}" in caplog.text


@pytest.mark.parametrize("genuine_too", [False, True], ids=["corrupted", "conflicting"])
def test_a_corrupted_chunk_is_joined_and_the_server_refuses_the_update_by_its_body_digest(
        world: World, server_endpoint, embedded_broker, caplog, genuine_too: bool):
    """The frames' payload hash is not computed again on arrival (it proves nothing on an open broker): the joined
    bytes reach the server, whose authenticated body digest refuses them; nothing changes. The genuine chunk that
    comes after the forged one is dropped as a conflict."""
    payload, frames = update_frames(world)
    head, body = frames[-2][:FRAME_HEADER_BYTES], frames[-2][FRAME_HEADER_BYTES:]
    forged = [head + bytes(len(body))] + ([frames[-2]] if genuine_too else [])
    with caplog.at_level(logging.WARNING, logger="fedara.transport"):
        publish_frames(embedded_broker.url, update_topic(TRAINER), [*frames[:-2], *forged, frames[-1]])
        (joined,) = delivered(server_endpoint)
    assert len(joined) == len(payload) and joined != payload
    assert ("[inconsistent_chunk]" in caplog.text) == genuine_too
    reason = refused(open_server(world), update_topic(TRAINER), joined, caplog)
    assert "body_sha256 does not match the body [bad_hash]" in reason


def test_chunks_announcing_an_oversize_message_are_refused(world: World, server_endpoint, embedded_broker, caplog):
    limit = world.max_inbound
    first_frame = chunk(bytes(limit + 1), SMALL_FRAME, "huge")[0]
    with caplog.at_level(logging.WARNING, logger="fedara.transport"):
        publish_frames(embedded_broker.url, up(TRAINER), [first_frame])
        assert delivered(server_endpoint) == []
    assert f"is {limit + 1} bytes, over {limit} [oversize]" in caplog.text


# -- the device --------------------------------------------------------------------------------------


def tiny_shard() -> Shard:
    rng = np.random.default_rng(0)
    x = rng.random((16, *INPUT_SHAPE), dtype=np.float32)
    y = np.arange(16, dtype=np.int64) % CLASSES
    return Shard(x[:12], y[:12], x[12:], y[12:], CLASSES)


def make_device(directory: Path) -> tuple[DeviceAgent, RecordingEndpoint]:
    """A device agent in ``directory/work``; its authentication state is kept beside it, in ``directory/auth``."""
    endpoint = RecordingEndpoint()
    agent = DeviceAgent(TRAINER, tiny_shard(), collect_profile(None, 1), endpoint, Workdir(directory / "work"),
                        Topics(PREFIX, TRAINER), device_link(TRAINER, directory / "auth"))
    return agent, endpoint


def deliver(agent: DeviceAgent, payload: bytes) -> None:
    agent.handle(agent.topics.down, payload)


def plan_with(world: World, files: dict[str, bytes], ratio: float = DENSE) -> bytes:
    plan = world.plans.get(ratio)
    return seal_down(plan_message(Plan(plan.hash, ratio, plan.description, files, world.personal["fedavgcnn"]),
                                  device_id=TRAINER, run_id=RUN))


def flipped(data: bytes, position: int) -> bytes:
    return data[:position] + bytes([data[position] ^ 0x01]) + data[position + 1:]


def retargeted_manifest(files: dict[str, bytes], field: str) -> dict[str, bytes]:
    """The files with a manifest that claims another set (``hash``) or another step-graph digest."""
    manifest = json.loads(files[MANIFEST_NAME])
    if field == "hash":
        manifest["hash"] = "f" * 64
    else:
        manifest["files"]["step_model"]["sha256"] = "0" * 64
    return {**files, MANIFEST_NAME: json.dumps(manifest).encode()}


def tampered_plans(world: World) -> dict[str, dict[str, bytes]]:
    files = world.plans.get(DENSE).files
    cases = {f"flipped-{name}": {**files, name: flipped(data, len(data) // 2)}
             for name, data in files.items() if name != MANIFEST_NAME}
    cases["manifest-of-another-set"] = retargeted_manifest(files, "hash")
    cases["manifest-with-another-digest"] = retargeted_manifest(files, "sha256")
    cases["files-of-another-plan"] = world.plans.get(LOW_RANK).files
    return cases


TAMPERINGS = ("flipped-step_model.onnx", "flipped-eval_model.onnx", "flipped-initial_weights.npz",
              "manifest-of-another-set", "manifest-with-another-digest", "files-of-another-plan")  # the portable kind


@pytest.mark.parametrize("tampering", TAMPERINGS)
def test_device_refuses_tampered_artifacts(world: World, tmp_path: Path, tampering: str):
    agent, endpoint = make_device(tmp_path)
    deliver(agent, plan_with(world, tampered_plans(world)[tampering]))
    (reply,) = endpoint.messages()
    assert reply.type == MessageType.ERROR and parse_error(reply).code == ErrorCode.ARTIFACTS_CORRUPT
    assert agent.workdir.held_artifacts() == () and agent.trainer is None


def test_tamperings_cover_every_artifact_file(world: World):
    assert set(TAMPERINGS) == set(tampered_plans(world))


def test_device_refuses_a_plan_carrying_a_foreign_file(world: World, tmp_path: Path, caplog):
    agent, endpoint = make_device(tmp_path)
    files = {**world.plans.get(DENSE).files, "run.sh": b"#!/bin/sh\n"}
    with caplog.at_level(logging.WARNING, logger="fedara.device"):
        deliver(agent, plan_with(world, files))
    assert endpoint.sent == [] and agent.workdir.held_artifacts() == ()
    assert "dropped a malformed plan message: plan files must be" in caplog.text


@pytest.fixture
def ready_device(world: World, tmp_path: Path) -> tuple[DeviceAgent, RecordingEndpoint]:
    """A device that installed the dense plan and acknowledged it."""
    agent, endpoint = make_device(tmp_path)
    deliver(agent, plan_with(world, world.plans.get(DENSE).files))
    (ack,) = endpoint.messages()
    assert ack.type == MessageType.ACK
    endpoint.sent.clear()
    return agent, endpoint


def task_payload(world: World, *, fe: dict[str, np.ndarray] | None = None, device_id: str = TRAINER,
                 **meta: object) -> bytes:
    """A dense-plan TASK for round 1 (one epoch of everything, FE sent back), with ``fe`` as its weights and meta
    fields as given (None deletes a field)."""
    start = world.round_fe[plan_key(world.plans.get(DENSE).resolved)]
    task = Task(round=ROUND, weights=dict(start) if fe is None else fe, lam=0.0, mu=0.0, lr=0.05,
                phases=(Phase("all", 1),), batch_size=4, seed=1, returns="fe")
    msg = task_message(task, plan_hash=world.plans.get(DENSE).hash, device_id=device_id, run_id=RUN)
    for key, value in meta.items():
        if value is None:
            del msg.meta[key]
        else:
            msg.meta[key] = value
    return seal_down(msg)


def dense_fe(world: World, name: str, value: np.ndarray | None) -> dict[str, np.ndarray]:
    fe = dict(world.round_fe[plan_key(world.plans.get(DENSE).resolved)])
    if value is None:
        del fe[name]
    else:
        fe[name] = value
    return fe


def device_state(agent: DeviceAgent) -> tuple:
    """What a refused task must leave as it was: the FE and head in the trainer, and the device's files."""
    files = {p.relative_to(agent.workdir.root): p.read_bytes() for p in agent.workdir.root.rglob("*") if p.is_file()}
    return ({k: v.tobytes() for k, v in agent.trainer.get_fe().items()},
            {k: v.tobytes() for k, v in agent.trainer.get_head().items()}, files)


@pytest.mark.parametrize("make, expected", [
    (lambda w: task_payload(w, fe=dense_fe(w, "fe.conv1.bias", np.zeros(32, np.float64))), "is float64"),
    (lambda w: task_payload(w, lr=0), "lr must be a finite number > 0"),
    (lambda w: task_payload(w, phases=[["all", -1]]), "phase epochs must be an integer"),
    (lambda w: task_payload(w, phases=[["bias", 1]]), "task phase must be [one of ['all', 'fe', 'head']"),
    (lambda w: task_payload(w, phases="all"), "task phases must be a list"),
    (lambda w: task_payload(w, phases=None), "lacks meta field 'phases'"),
    (lambda w: task_payload(w, returns="head"), "task field 'returns' must be one of"),
    (lambda w: task_payload(w, batch_size=0), "batch_size must be an integer"),
    (lambda w: task_payload(w, seed=None), "lacks meta field 'seed'"),
    (lambda w: task_payload(w, lam="2"), "lam must be a finite number"),
    (lambda w: task_payload(w, plan_hash="not-a-hash"), "plan_hash must be 64 lowercase hex digits"),
    (lambda w: task_payload(w, fe=dense_fe(w, "fe.conv1.bias", np.full(32, np.nan, np.float32))), "[nonfinite]"),
    (lambda w: task_payload(w)[:-5], "[bad_layout]"),
    (lambda w: task_payload(w, device_id=FACTORED), f"a message of {FACTORED!r} on a topic of {TRAINER!r} [bad_topic]"),
], ids=["dtype", "lr", "epochs", "phase-params", "phases-text", "missing-phases", "returns", "batch-size", "missing-seed", "lam-text", "plan-hash", "nan", "truncated",
        "other-device"])
def test_device_drops_a_malformed_task(world: World, ready_device, make, expected: str, caplog):
    agent, endpoint = ready_device
    before = device_state(agent)
    with caplog.at_level(logging.WARNING, logger="fedara.device"):
        deliver(agent, make(world))
    assert endpoint.sent == [] and expected in caplog.text
    assert device_state(agent) == before


@pytest.mark.parametrize("fe_edit", [
    ("fe.fc1.weight", np.zeros((64, 512), np.float32)),
    ("fe.fc1.weight", None),
    ("fe.fc9.weight", np.zeros(3, np.float32)),
], ids=["shape", "missing", "unknown"])
def test_device_answers_a_task_that_does_not_fit_its_plan_with_bad_task(world: World, ready_device, fe_edit):
    agent, endpoint = ready_device
    before = device_state(agent)
    deliver(agent, task_payload(world, fe=dense_fe(world, *fe_edit)))
    (reply,) = endpoint.messages()
    assert reply.type == MessageType.ERROR and parse_error(reply).code == ErrorCode.BAD_TASK
    assert device_state(agent) == before


# -- an impostor on the wire ---------------------------------------------------------------------------

QUICK = ["--dataset", "digits", "--max-samples", "300", "--local-epochs", "1", "--batch-size", "32", "--lr", "0.05",
         "--lam", "2", "--lam-warmup", "1", "--threads", "1", "--rank-ratio", str(LOW_RANK)]
WIRE_DEVICES = 3
WIRE_ROUNDS = 2
IMPOSTOR_ID = "dev_666"


class Impostor(MqttPeer):
    """A client of the open (embedded) broker that reads every device's traffic and, whenever dev_000 is sent
    a task, sends the server garbage, updates forged from that task, and replays of dev_000's own updates."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
        self.endpoint = MqttEndpoint("impostor", url, subscriptions=[f"{PREFIX}/dev/+/down",
                                                                         f"{PREFIX}/dev/+/update"])
        self.captured: list[bytes] = []
        self.attacks = 0

    def on_message(self, topic: str, payload: bytes) -> None:
        if not topic.startswith(f"{PREFIX}/dev/{TRAINER}/"):
            return
        try:
            msg = decode(payload, max_bytes=1 << 28, allow_nonfinite=True)
        except ProtocolError:
            return  # its own garbage
        if topic == update_topic(TRAINER) and msg.type == MessageType.UPDATE and payload not in self.captured:
            self.captured.append(payload)
            self._send(update_topic(TRAINER), payload)
        elif msg.type == MessageType.TASK:
            self._attack(msg)

    def _send(self, topic: str, payload: bytes) -> None:
        self.endpoint.publish(topic, payload, f"impostor-{uuid.uuid4().hex}")

    def _attack(self, task: Message) -> None:
        host, port = self.url.rsplit("/", 1)[1].split(":")
        paho.mqtt.publish.single(up(TRAINER), b"\x00garbage that is not a frame", qos=1, hostname=host, port=int(port),
                                 client_id="impostor-raw")
        self._send(up(TRAINER), b"FARA" + bytes(100))
        poisoned = Update(task.round, {k: v * np.float32(100) for k, v in task.tensors.items()}, 1000, 0.1, 1.0,
                          dict(EVAL))
        plan_hash = task.meta["plan_hash"]
        forgeries = ((update_topic(IMPOSTOR_ID), TRAINER, task.run_id),
                     (update_topic(IMPOSTOR_ID), IMPOSTOR_ID, task.run_id),
                     (update_topic(TRAINER), TRAINER, "run0"))
        for topic, sender, run_id in forgeries:
            self._send(topic, encode(update_message(poisoned, plan_hash=plan_hash, device_id=sender, run_id=run_id)))
        for payload in self.captured:
            self._send(update_topic(TRAINER), payload)
        self.attacks += 1


def test_impostor_on_an_open_broker_does_not_change_the_global_fe(embedded_broker, tmp_path: Path,
                                                                  shared_artifact_cache: Path):
    """Garbage, updates forged for another device, from an unknown device, of another run, and replays of a
    device's own updates, sent while a 3-device federation runs: the run ends with the global FE of the
    same federation run in process without any of it."""
    with Impostor(embedded_broker.url) as impostor:
        assert broker_loop.main([*QUICK, "--rounds", str(WIRE_ROUNDS), "--local-devices", str(WIRE_DEVICES),
                                 "--broker", embedded_broker.url, "--join-timeout", "300", "--round-deadline", "300",
                                 "--cache-dir", str(shared_artifact_cache), "--out", str(tmp_path / "run")]) == 0
    assert impostor.attacks >= WIRE_ROUNDS and impostor.captured
    records = read_metrics(tmp_path / "run" / METRICS_FILE)
    assert all(r["participants"] == r["selected"] == WIRE_DEVICES and r["dropped"] == {} for r in records)
    log = (tmp_path / "run" / broker_loop.SERVER_LOG).read_text()
    for refusal in (f"fedara-server-{PREFIX}: dropped frame on {up(TRAINER)}",
                    f"dropped a message on {up(TRAINER)}: protocol version 1 envelope",
                    f"tag does not verify under the key of {TRAINER!r} [bad_tag]",  # the update of run0
                    "[replay]"):  # the device's own updates, replayed byte for byte
        assert refusal in log
    assert update_topic(IMPOSTOR_ID) not in log  # an id not enrolled: the server never subscribed to its topics

    args = simulate.build_parser().parse_args([*QUICK, "--rounds", str(WIRE_ROUNDS), "--clients", str(WIRE_DEVICES),
                                               "--backend", "portable", "--cache-dir", str(shared_artifact_cache)])
    (tmp_path / "clean").mkdir()
    simulation = simulate.Simulation(args, RunFolder(tmp_path / "clean"), progress=Progress(WIRE_ROUNDS, emit=lambda line: None))
    simulation.run()
    clean = simulation.engine.global_state
    attacked = load_checkpoint(tmp_path / "run" / CHECKPOINT_NAME)
    assert attacked.round == WIRE_ROUNDS and set(attacked.tensors) == set(clean)
    for name, value in clean.items():  # nothing changed: the MQTT path is the in-process one bit for bit
        np.testing.assert_array_equal(attacked.tensors[name], value.numpy(), err_msg=name)


def test_refused_plan_of_another_run_keeps_the_current_runs_heads(world: World, tmp_path: Path):
    agent, endpoint = make_device(tmp_path)
    heads = agent.workdir.root / HEADS_DIR
    heads.mkdir(exist_ok=True)
    (heads / "kept-1.npz").write_bytes(b"a head of the current run")
    agent.state.run_id = "current-run"
    files = world.plans.get(DENSE).files
    deliver(agent, plan_with(world, {**files, "step_model.onnx": flipped(files["step_model.onnx"], 7)}))
    (reply,) = endpoint.messages()
    assert parse_error(reply).code == ErrorCode.ARTIFACTS_CORRUPT
    assert agent.state.run_id == "current-run" and (heads / "kept-1.npz").exists()
