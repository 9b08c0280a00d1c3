"""The MQTT federation end to end: `python -m server.broker_loop` with real device processes over real brokers.

Small on purpose (digits, 600 samples, 5 devices, 1 epoch, batch 32, one thread each): the point is the
transport and the round logic, which must not change the math.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from device_runtime.answer_receipt import RECEIPT_WAIT_S
from device_runtime.__main__ import PASSWORD_ENV
from device_runtime.envelope import MessageType
from device_runtime.framing import DEFAULT_MAX_FRAME_BYTES, chunk
from device_runtime.messages import (DEFAULT_TOPIC_PREFIX, ErrorCode, Join, ShardInfo, ack_message, join_message,
                                     parse_error, parse_join, parse_plan, plan_message, task_message)
from device_runtime.profile import collect_profile
from device_runtime.status import parse_status
from device_runtime.topics import Topics, server_subscriptions
from device_runtime.transport import MqttEndpoint
from server import broker_loop
from server.outputs.checkpoint import CHECKPOINT_NAME, load_checkpoint
from server.engine.cost_model import predict
from server.mqtt.mosquitto_config import write_mosquitto_auth
from server.outputs.report import ACCURACY_PLOT, BYTES_PLOT, METRICS_FILE, REPORT_FILE, read_metrics
from server import simulate
from server.run_setup import RunFolder
from tests.support.waiting import wait_for
from tests.support.mqtt_peer import MqttPeer
from tests.support.sealing import device_link, enrollment_file, read, write_key
from tests.support.processes import child_env
from tests.support.device_agent import artifact_files, dense_task, deliver, make_agent, plan_for, tiny_shard

REPO_ROOT = Path(__file__).resolve().parents[2]
QUICK = ["--dataset", "digits", "--max-samples", "600", "--local-epochs", "1", "--batch-size", "32", "--lr", "0.05",
         "--lam", "2", "--lam-warmup", "1", "--threads", "1"]
DEVICES = 5
ROUNDS = 3
TIERS = (1.0, 0.25)  # assigned round-robin by an override file, as server.simulate --rank-tiers assigns them
BOUNDED = ["--join-timeout", "300", "--round-deadline", "300"]  # a broken run fails instead of hanging
WAIT_S = 20.0
SMALL_FRAME = 64 * 1024


def federate(out: Path, cache: Path, *extra: str) -> list[dict]:
    """Run the broker loop in this process; returns its metrics."""
    assert broker_loop.main([*QUICK, *BOUNDED, "--cache-dir", str(cache), "--out", str(out), *extra]) == 0
    return read_metrics(out / METRICS_FILE)


def tiered_overrides(path: Path) -> Path:
    path.write_text(json.dumps({f"dev_{i:03d}": TIERS[i % len(TIERS)] for i in range(DEVICES)}))
    return path


@pytest.fixture(scope="module")
def cache(shared_artifact_cache: Path) -> Path:
    return shared_artifact_cache


@pytest.fixture(scope="module")
def embedded_run(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Path:
    """Five device processes, two rank tiers, three rounds over the default (embedded) broker."""
    base = tmp_path_factory.mktemp("embedded")
    federate(base / "run", cache, "--rounds", str(ROUNDS), "--local-devices", str(DEVICES),
             "--rank-overrides", str(tiered_overrides(base / "overrides.json")))
    return base / "run"


# -- a federation over each broker ------------------------------------------------------------


def test_five_device_processes_federate_over_the_embedded_broker(embedded_run: Path):
    records = read_metrics(embedded_run / METRICS_FILE)
    assert [r["round"] for r in records] == [1, 2, 3]
    assert all(r["participants"] == r["selected"] == DEVICES and r["dropped"] == {} for r in records)
    assert all(r["evaluated"] == DEVICES and 0.0 <= r["accuracy"] <= 1.0 for r in records)
    assert set(records[0]["bytes_by_tier"]) == {"1", "0.25"}
    for name in (REPORT_FILE, ACCURACY_PLOT, BYTES_PLOT):
        assert (embedded_run / name).stat().st_size > 0


class PayloadObserver(MqttPeer):
    """Anyone on the broker reading every plan's payload (whole, as a device reassembles it), by topic."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.endpoint = MqttEndpoint(f"observer-{os.getpid()}", url, max_message_bytes=1 << 26, clean_session=True,
                                     subscriptions=[f"{DEFAULT_TOPIC_PREFIX}/payload/#"])
        self.payloads: dict[str, list[bytes]] = {}

    def on_message(self, topic: str, payload: bytes) -> None:
        self.payloads.setdefault(topic, []).append(payload)

    def genuine(self) -> dict[str, int]:
        """Payload topic -> how many times the payload its topic names was published whole."""
        return {t: sum(hashlib.sha256(p).hexdigest() == t.rsplit("/", 1)[1] for p in ps)
                for t, ps in self.payloads.items()}


@pytest.mark.slow
def test_five_device_processes_federate_over_mosquitto_in_chunks(start_mosquitto, tmp_path: Path, cache: Path):
    """mosquitto drops every publish above its limit: the run completes only if every message is chunked. The
    round's tensors go down once per plan: five devices of one plan, one payload a round, however many share it."""
    broker = start_mosquitto(max_frame_bytes=SMALL_FRAME)
    with PayloadObserver(broker.url) as observer:
        records = federate(tmp_path / "run", cache, "--rounds", "2", "--local-devices", str(DEVICES), "--rank-ratio",
                           "0.5", "--broker", broker.url, "--max-message-bytes", str(SMALL_FRAME))
        wait_for(lambda: len(observer.payloads) == 3, WAIT_S, "the payloads of 2 rounds and the final evaluation")
    assert [r["participants"] for r in records] == [DEVICES, DEVICES]
    assert records[0]["bytes_artifacts"] > 10 * SMALL_FRAME
    assert all(r["evaluated"] == DEVICES for r in records)
    asked_again = (tmp_path / "run" / broker_loop.SERVER_LOG).read_text().count("published again")
    published = observer.genuine()
    assert sum(published.values()) == len(published) + asked_again and len(published) == 3, published
    largest = max(len(p[0]) for p in observer.payloads.values())
    assert 0 < records[0]["bytes_down"] <= (1 + asked_again) * largest  # one payload, not five tasks' tensors


class PayloadAttacker(PayloadObserver):
    """Anyone on the open broker, with mosquitto_pub: on every new payload topic it publishes, retained, the last
    payload it saw (a replay of the round before, over the genuine frames) and a frame of junk beside them, so a device
    that subscribes after that finds both and no genuine copy until the server publishes it again."""

    def __init__(self, url: str, port: int, folder: Path) -> None:
        super().__init__(url)
        self.port, self.folder = port, folder
        self.attacked: list[str] = []
        self.last: bytes | None = None

    def on_message(self, topic: str, payload: bytes) -> None:
        first = topic not in self.payloads
        super().on_message(topic, payload)
        if not first or hashlib.sha256(payload).hexdigest() != topic.rsplit("/", 1)[1]:
            return
        frames = chunk(self.last, DEFAULT_MAX_FRAME_BYTES, f"replay-{len(self.attacked)}") if self.last else []
        frames.append(chunk(os.urandom(4096), DEFAULT_MAX_FRAME_BYTES, f"junk-{len(self.attacked)}")[0])
        for i, frame in enumerate(frames):
            path = self.folder / "frame.bin"
            path.write_bytes(frame)
            subprocess.run(["mosquitto_pub", "-h", "127.0.0.1", "-p", str(self.port), "-q", "1", "-r", "-t",
                            f"{topic}/{i}", "-f", str(path)], check=True, capture_output=True)
        self.attacked.append(topic)
        self.last = payload


@pytest.mark.slow
def test_junk_and_replayed_payloads_on_the_payload_topics_change_nothing(start_mosquitto, embedded_run: Path,
                                                                          tmp_path: Path, cache: Path):
    broker = start_mosquitto()
    with PayloadAttacker(broker.url, broker.port, tmp_path) as attacker:
        records = federate(tmp_path / "run", cache, "--rounds", str(ROUNDS), "--local-devices", str(DEVICES),
                           "--rank-overrides", str(tiered_overrides(tmp_path / "overrides.json")), "--broker",
                           broker.url)
    assert all(r["participants"] == DEVICES and r["evaluated"] == DEVICES for r in records)
    assert len(attacker.attacked) == len(TIERS) * (ROUNDS + 1)  # every plan's payload of every round, attacked
    got, expected = (load_checkpoint(run / CHECKPOINT_NAME).tensors for run in (tmp_path / "run", embedded_run))
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    refused = sum(log.read_text().count("refused a payload") for log in (tmp_path / "run" / "devices").glob("*.log"))
    again = (tmp_path / "run" / broker_loop.SERVER_LOG).read_text().count("published again")
    print(f"devices refused {refused} junk or replayed payload(s); the server published {again} again on request; "
          f"bytes down by round {[r['bytes_down'] for r in records]}, undisturbed "
          f"{[r['bytes_down'] for r in read_metrics(embedded_run / METRICS_FILE)]}")


# -- transport must not change the math ------------------------------------------------------


def simulate_ort(out: Path, cache: Path, *flags: str) -> tuple[list[dict], dict[str, np.ndarray]]:
    """``python -m server.simulate --backend portable`` (the runtime MQTT devices run by default) in this process:
    its records and final global model."""
    args = simulate.build_parser().parse_args([*QUICK, "--backend", "portable", "--cache-dir", str(cache),
                                               "--out", str(out), *flags])
    out.mkdir(parents=True)
    simulation = simulate.Simulation(args, RunFolder(out))
    return simulation.run(), simulation.engine.global_arrays()


UNTIMED = ("seconds", "wire_bytes_out", "wire_bytes_in", "sim_time")
"""What a record measures of the machine or of the driver's clock (the simulator's virtual one, the broker loop's
wall clock), not of the federation."""
DOWNLOADS = ("bytes_down", "bytes_down_eval")
"""What the driver sends down: each task's tensors in process, each plan's payload once over MQTT."""


def comparable(records: list[dict]) -> list[dict]:
    return [{**{k: v for k, v in r.items() if k not in UNTIMED + DOWNLOADS},
             "bytes_by_tier": {t: {d: n for d, n in b.items() if d not in ("down", "eval")}
                               for t, b in r["bytes_by_tier"].items()}} for r in records]


def test_mqtt_run_ends_with_the_in_process_ort_runs_global_fe(embedded_run: Path, cache: Path, tmp_path: Path):
    records, expected = simulate_ort(tmp_path / "sim", cache, "--rounds", str(ROUNDS), "--clients", str(DEVICES),
                                     "--rank-tiers", ",".join(map(str, TIERS)))
    got = load_checkpoint(embedded_run / CHECKPOINT_NAME)
    assert got.round == ROUNDS and set(got.tensors) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(got.tensors[name], value, rtol=0, atol=1e-5, err_msg=name)
    mqtt_accuracy = [r["accuracy"] for r in read_metrics(embedded_run / METRICS_FILE)]
    assert mqtt_accuracy == pytest.approx([r["accuracy"] for r in records], abs=1e-6)


ALGO_DEVICES, ALGO_ROUNDS = 3, 2


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["fedara", "fedavg", "fedrep", "local"])
def test_each_algorithm_over_mqtt_is_the_in_process_ort_run_exactly(algo: str, tmp_path: Path, cache: Path):
    """Same seed and flags, three device processes: the MQTT run's final global model is bit-identical to
    ``server.simulate --backend portable``'s (local training has none: its per-device accuracies are compared), and
    every record matches round by round (what was measured in seconds aside)."""
    flags = ("--algo", algo, "--rounds", str(ALGO_ROUNDS), "--rank-ratio", "0.5")
    mqtt = federate(tmp_path / "mqtt", cache, *flags, "--local-devices", str(ALGO_DEVICES))
    records, expected = simulate_ort(tmp_path / "sim", cache, *flags, "--clients", str(ALGO_DEVICES))
    assert [r["round"] for r in mqtt] == list(range(1, ALGO_ROUNDS + 1))
    assert all(r["participants"] == ALGO_DEVICES and r["evaluated"] == ALGO_DEVICES for r in mqtt)
    got = load_checkpoint(tmp_path / "mqtt" / CHECKPOINT_NAME)
    assert got.round == ALGO_ROUNDS and set(got.tensors) == set(expected)
    if algo == "local":
        assert expected == {}
        per_device = [{d: e["accuracy"] for d, e in r["per_device"].items()} for r in mqtt]
        assert per_device == [{d: e["accuracy"] for d, e in r["per_device"].items()} for r in records]
        assert all(len(p) == ALGO_DEVICES for p in per_device)
    else:
        assert any(k.startswith("head.") for k in expected) == (algo == "fedavg")
        for name, value in expected.items():
            np.testing.assert_array_equal(got.tensors[name], value, err_msg=name)
    assert comparable(mqtt) == comparable(records)


# -- artifacts travel once per device and plan ------------------------------------------------


def plan_bytes(devices: Path, device_id: str) -> int:
    """Bytes of the artifact files (the PLAN's blobs) a device installed."""
    (directory,) = (devices / device_id / "artifacts").iterdir()
    return sum(path.stat().st_size for path in directory.iterdir())


def test_artifacts_go_down_once_per_device(embedded_run: Path):
    records = read_metrics(embedded_run / METRICS_FILE)
    devices = embedded_run / broker_loop.DEVICES_DIR
    per_device = {f"dev_{i:03d}": plan_bytes(devices, f"dev_{i:03d}") for i in range(DEVICES)}
    assert [r["bytes_artifacts"] for r in records] == [sum(per_device.values()), 0, 0]
    by_tier = records[0]["bytes_by_tier"]
    assert by_tier["1"]["artifacts"] == sum(b for d, b in per_device.items() if int(d[-3:]) % 2 == 0)
    assert by_tier["0.25"]["artifacts"] == sum(b for d, b in per_device.items() if int(d[-3:]) % 2 == 1)


@pytest.mark.slow
def test_resumed_run_reuses_the_devices_cached_artifacts(embedded_run: Path, tmp_path: Path, cache: Path):
    """Extending the finished run by a round respawns the devices: they rejoin listing their cache."""
    out = tmp_path / "run"
    shutil.copytree(embedded_run, out)
    records = federate(out, cache, "--resume", "--rounds", str(ROUNDS + 1), "--local-devices", str(DEVICES),
                       "--rank-overrides", str(tiered_overrides(tmp_path / "overrides.json")))
    assert [r["round"] for r in records] == [1, 2, 3, 4]
    assert records[3]["bytes_artifacts"] == 0 and records[3]["participants"] == DEVICES
    assert records[:3] == read_metrics(embedded_run / METRICS_FILE)


# -- stragglers ------------------------------------------------------------------------------


class SilentDevice(MqttPeer):
    """Joins (again when asked), acknowledges its plan, and never answers a task."""

    def __init__(self, url: str, device_id: str, shard: ShardInfo, state_dir: Path):
        super().__init__()
        self.device_id, self.shard = device_id, shard
        self.topics = Topics(DEFAULT_TOPIC_PREFIX, device_id)
        self.link = device_link(device_id, state_dir)
        self.endpoint = MqttEndpoint(device_id, url, subscriptions=[self.topics.down],
                                     status=(self.topics.status, self.link.status_signer(device_id)))
        self.tasks = 0

    def on_connected(self) -> None:
        self.join()

    def join(self) -> None:
        join = join_message(Join(collect_profile(None, 1), self.shard, ()), device_id=self.device_id)
        self.endpoint.publish(self.topics.up, self.link.seal(join), join.msg_id)

    def on_message(self, topic: str, payload: bytes) -> None:
        if topic != self.topics.down:
            return
        msg = read(payload)  # a scripted device: it believes anything
        if msg.type == MessageType.PLAN:
            ack = ack_message(parse_plan(msg).plan_hash, device_id=self.device_id, run_id=msg.run_id)
            self.endpoint.publish(self.topics.up, self.link.seal(ack), ack.msg_id)
        elif msg.type == MessageType.TASK:
            self.tasks += 1
        elif msg.type == MessageType.ERROR and parse_error(msg).code == ErrorCode.REJOIN:
            self.join()


@pytest.mark.slow
def test_device_that_never_answers_is_dropped_at_the_deadline(embedded_broker, tmp_path: Path, cache: Path):
    """The silent device connects before the server listens: the server finds it by its status and asks it to join."""
    deadline_s = 4.0
    enrolled = enrollment_file(tmp_path / "enroll.json", [f"dev_{i:03d}" for i in range(4)] + ["dev_silent"])
    with SilentDevice(embedded_broker.url, "dev_silent", ShardInfo(50, 10, (1, 28, 28), 10), tmp_path / "s") as silent:
        records = federate(tmp_path / "run", cache, "--rounds", "1", "--local-devices", "4", "--min-devices", "5",
                           "--broker", embedded_broker.url, "--round-deadline", str(deadline_s),
                           "--enroll", str(enrolled))
    (record,) = records
    assert record["dropped"] == {"dev_silent": "no answer by the deadline"}
    assert (record["participants"], record["selected"], record["closed_by"]) == (4, 5, "deadline")
    # closed by its deadline, not before it (a loaded machine only lengthens a round; the test's timeout bounds it)
    assert record["aggregated"] and record["seconds"] >= deadline_s
    assert silent.tasks == 2  # the round's task and the final evaluation


# -- the device process --------------------------------------------------------------------------


@pytest.fixture
def server_endpoint(embedded_broker) -> Iterator[MqttEndpoint]:
    endpoint = MqttEndpoint("test-server", embedded_broker.url, subscriptions=server_subscriptions(DEFAULT_TOPIC_PREFIX))
    endpoint.start()
    endpoint.wait_connected(WAIT_S)
    yield endpoint
    endpoint.stop()


def next_on(endpoint: MqttEndpoint, topic: str) -> bytes:
    while (item := endpoint.get(WAIT_S)) is not None:
        if item[0] == topic:
            return item[1]
    raise AssertionError(f"nothing on {topic} within {WAIT_S} s")


@pytest.fixture
def secured_broker(tmp_path: Path, start_mosquitto):
    """mosquitto with a password file and an ACL confining dev_sec to its own topics."""
    passwd, acl = write_mosquitto_auth(tmp_path / "auth", "server", "server-pw", {"dev_sec": "dev-pw"},
                                       DEFAULT_TOPIC_PREFIX)
    return start_mosquitto(password_file=passwd, acl_file=acl)


def device_process(url: str, device_id: str, tmp_path: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "device_runtime", "--broker", url, "--device-id", device_id,
                             "--data", str(tiny_shard(tmp_path / "shard.npz")), "--workdir", str(tmp_path / "work"),
                             "--key-file", str(write_key(tmp_path / "device.key")), *extra], cwd=REPO_ROOT,
                            stderr=subprocess.PIPE, env=child_env(**(env or {})))


def test_device_joins_and_exits_cleanly_on_sigterm(embedded_broker, server_endpoint, tmp_path: Path):
    topics = Topics(DEFAULT_TOPIC_PREFIX, "dev_sig")
    device = device_process(embedded_broker.url, "dev_sig", tmp_path, "--memory-budget-mb", "96")
    try:
        join = read(next_on(server_endpoint, topics.up))
        assert join.type == MessageType.JOIN and join.meta["profile"]["memory_budget_mb"] == 96.0
        assert join.meta["shard"] == {"num_train": 12, "num_test": 4, "input_shape": [1, 28, 28], "num_classes": 10}
        device.send_signal(signal.SIGTERM)
        assert device.wait(WAIT_S) == 0
        assert not parse_status(read(next_on(server_endpoint, topics.status))).online
    finally:
        device.kill()
        device.wait()


def test_device_joins_with_its_credentials_from_the_environment(secured_broker, tmp_path: Path):
    server = MqttEndpoint("server", secured_broker.url, subscriptions=server_subscriptions(DEFAULT_TOPIC_PREFIX),
                          username="server", password="server-pw")
    server.start()
    device = device_process(secured_broker.url, "dev_sec", tmp_path, "--username", "dev_sec",
                            env={PASSWORD_ENV: "dev-pw"})
    try:
        server.wait_connected(WAIT_S)
        assert read(next_on(server, Topics(DEFAULT_TOPIC_PREFIX, "dev_sec").up)).type == MessageType.JOIN
    finally:
        device.terminate()
        device.wait(WAIT_S)
        server.stop()


def test_device_with_a_wrong_password_exits_with_status_2(secured_broker, tmp_path: Path):
    device = device_process(secured_broker.url, "dev_sec", tmp_path, "--username", "dev_sec", "--password", "nope")
    assert device.wait(WAIT_S) == 2
    assert b"refused the connection" in device.stderr.read()


# -- the device's event loop, without a broker ----------------------------------------------------


def test_device_refuses_artifacts_that_fail_verification(dense_artifacts, tmp_path: Path):
    _, artifacts = dense_artifacts
    agent, endpoint = make_agent(tmp_path / "work", tiny_shard(tmp_path / "shard.npz"))
    files = artifact_files(artifacts)
    files["checkpoint"] = bytes([files["checkpoint"][0] ^ 1]) + files["checkpoint"][1:]
    deliver(agent, plan_message(plan_for(artifacts, files), device_id="dev_t", run_id="run1"))
    (reply,) = endpoint.messages()
    assert parse_error(reply).code == ErrorCode.ARTIFACTS_CORRUPT
    assert agent.workdir.held_artifacts() == ()


def test_device_answers_a_repeated_task_with_its_saved_answer(dense_artifacts, tmp_path: Path):
    model, artifacts = dense_artifacts
    agent, endpoint = make_agent(tmp_path / "work", tiny_shard(tmp_path / "shard.npz"))
    deliver(agent, plan_message(plan_for(artifacts, artifact_files(artifacts), model), device_id="dev_t",
                                run_id="run1"))
    task = task_message(dense_task(model), plan_hash=artifacts.hash, device_id="dev_t", run_id="run1")
    deliver(agent, task)
    deliver(agent, task)
    agent.tend_answer(agent.answer.sent_at + RECEIPT_WAIT_S)  # asked again at once: no receipt came in its wait
    ack, first, second = endpoint.messages()
    assert ack.type == MessageType.ACK and first.type == second.type == MessageType.UPDATE
    assert first.meta == second.meta and second.counter > first.counter  # the same answer, sealed afresh
    for name, value in first.tensors.items():
        np.testing.assert_array_equal(second.tensors[name], value)


def test_restarted_device_lists_its_artifacts_and_keeps_its_head(dense_artifacts, tmp_path: Path):
    model, artifacts = dense_artifacts
    shard = tiny_shard(tmp_path / "shard.npz")
    agent, _ = make_agent(tmp_path / "work", shard)
    deliver(agent, plan_message(plan_for(artifacts, artifact_files(artifacts), model), device_id="dev_t",
                                run_id="run1"))
    deliver(agent, task_message(dense_task(model), plan_hash=artifacts.hash, device_id="dev_t", run_id="run1"))
    trained_head = agent.trainer.get_head()
    restarted, endpoint = make_agent(tmp_path / "work", shard)
    restarted.join()
    assert parse_join(endpoint.messages()[0]).artifacts == (artifacts.hash,)
    # The server answers its JOIN with the plan and the run's initial head: a device that holds a trained head
    # of this run keeps it.
    deliver(restarted, plan_message(plan_for(artifacts, {}, model), device_id="dev_t", run_id="run1"))
    assert endpoint.messages()[-1].type == MessageType.ACK
    for name, value in trained_head.items():
        np.testing.assert_array_equal(restarted.trainer.get_head()[name], value)


def test_task_for_a_plan_the_device_lacks_makes_it_rejoin(dense_artifacts, tmp_path: Path):
    model, artifacts = dense_artifacts
    agent, endpoint = make_agent(tmp_path / "work", tiny_shard(tmp_path / "shard.npz"))
    deliver(agent, task_message(dense_task(model), plan_hash=artifacts.hash, device_id="dev_t", run_id="run1"))
    error, join = endpoint.messages()
    assert parse_error(error).code == ErrorCode.UNKNOWN_PLAN and join.type == MessageType.JOIN


IMPORT_CHECK = """
import runpy, sys
sys.argv = ["device_runtime", "--help"]
try:
    runpy.run_module("device_runtime", run_name="__main__")
except SystemExit as exit:
    assert exit.code == 0, exit.code
import device_runtime.agent
print(sorted({m.split(".")[0] for m in sys.modules} & {"torch", "onnx"}))
"""


def test_device_cli_and_agent_import_neither_torch_nor_onnx():
    done = subprocess.run([sys.executable, "-c", IMPORT_CHECK], cwd=REPO_ROOT, capture_output=True, text=True,
                          check=True)
    assert "usage: python -m device_runtime" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.slow
def test_devices_get_the_largest_tier_the_cost_model_fits_in_their_memory_budget(tmp_path: Path, cache: Path):
    """Budgets against the shipped cost model (device_runtime/cost_model.json): ample memory trains dense, a
    budget that only the smallest tier's predicted need (its measured floor plus margin) fits gets a tier at most
    that heavy."""
    predicted = {r: predict("fedavgcnn", (1, 28, 28), r, 32, collect_profile(None, 1)).need_mb
                 for r in (1.0, 0.75, 0.5, 0.25, 0.125)}
    tight = predicted[0.125]
    federate(tmp_path / "run", cache, "--local-devices", "2", "--rounds", "1", "--local-memory-mb", f"10000,{tight}")
    registry = load_checkpoint(tmp_path / "run" / CHECKPOINT_NAME).state["engine"]["registry"]["devices"]
    ratios = {d["device_id"]: d["ratio"] for d in registry}
    assert ratios["dev_000"] == 1.0
    assert ratios["dev_001"] < 1.0 and predicted[ratios["dev_001"]] <= tight
