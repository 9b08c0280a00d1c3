"""Faults on real processes: a device SIGKILLed mid-round, mosquitto restarted mid-run, the server SIGKILLed
mid-round and resumed. The federation must go on, lose no completed round and count no update twice.

The server (``python -m server.broker_loop``) and five devices (``python -m device_runtime``) run as separate
processes over a mosquitto subprocess. One device, SLOW, trains on its shard repeated SLOW_REPEAT times, so
while the others have answered a round it is still computing: that is when a fault is injected, and it is
"mid-round" by construction, not by timing luck. Progress is read from what the processes leave on disk: the
server's checkpoint, metrics.jsonl and log, and each device's state.json.

Where nothing may be lost, the final global FE is compared with the in-process reference federation
(server.simulate's Simulation with --backend ort) on the same shards and seeds: the uninterrupted run with the
same updates. Batch seeds follow the device id, never the order devices join in, so the reference needs nothing
from the run but its flags. The last test kills the device agent in-process at a chosen point of
its commit, which no timing of a real SIGKILL could hit reliably.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from device_runtime.agent import DeviceAgent
from device_runtime.workdir import HEADS_DIR, STATE_FILE, Workdir
from device_runtime.artifact_contract import TRAINING_KIND
from device_runtime.envelope import Message, decode
from device_runtime.messages import ARTIFACT_BLOBS_BY_KIND, DEFAULT_TOPIC_PREFIX, Plan, parse_update, plan_message, task_message
from device_runtime.profile import collect_profile
from device_runtime.shard import Shard
from device_runtime.task import Phase, Task
from device_runtime.topics import Topics
from export.artifacts import build_artifacts
from fedcore.models import build_model
from server import broker_loop
from server.outputs.checkpoint import CHECKPOINT_NAME, STATE_KEY, load_checkpoint
from server.engine.coordinator import DEADLINE, NO_ANSWER
from server.data.partition import write_shards
from server.outputs.report import METRICS_FILE, read_metrics
from server import run_setup, simulate
from server.run_setup import RunFolder, load_shards

from tests.support.processes import stop_processes
from tests.support.waiting import wait_for
from tests.support.sealing import device_link, enrollment_file, seal_down, write_key
from tests.support.recording_endpoint import RecordingEndpoint

REPO_ROOT = Path(__file__).resolve().parents[2]

QUICK = ["--dataset", "digits", "--max-samples", "600", "--local-epochs", "1", "--batch-size", "32", "--lr", "0.05",
         "--lam", "2", "--lam-warmup", "1", "--threads", "1"]
DEVICES = [f"dev_{i:03d}" for i in range(5)]
SLOW = DEVICES[-1]
SLOW_REPEAT = 20  # SLOW's training set, repeated: its round takes seconds where the others take a fraction of one
RATIO = 0.5
ROUNDS = 3
FAULT_ROUND = 2
DEADLINE_S = 10.0  # test 1: long enough for SLOW's round on loaded cores, short enough to wait out once
NO_DEADLINE_S = 120.0  # tests 2 and 3: no answer may be missing, so no round should ever reach its deadline
RUN_TIMEOUT_S = 150.0
POLL_S = 0.02
STOP_TIMEOUT_S = 10.0
FE_ATOL = 1e-5
"""Runs observed here match the reference bit for bit; the server adds updates (in float64) in arrival order, so
a last-bit difference is allowed. One update lost from one round moves the final FE by ~5e-3."""
SERVER_OUT = "server.out"
SERVER_LISTENS = "fedara.server INFO run "  # the server's log line once it is connected and subscribed


# -- the processes -------------------------------------------------------------------------------


class FederationProcesses:
    """One run's processes, each logging into ``out``: the server and the devices."""

    def __init__(self, out: Path, broker_url: str, cache: Path, shard_paths: dict[str, Path]):
        self.out, self.broker_url, self.cache, self.shard_paths = out, broker_url, cache, shard_paths
        self.server: subprocess.Popen | None = None
        self.devices: dict[str, subprocess.Popen] = {}
        (out / broker_loop.DEVICES_DIR).mkdir(parents=True, exist_ok=True)

    def start_server(self, deadline_s: float, *extra: str) -> None:
        """Start the server and wait until it listens on the broker."""
        started = self.server_log().count(SERVER_LISTENS)
        command = [sys.executable, "-m", "server.broker_loop", *QUICK, "--rounds", str(ROUNDS), "--rank-ratio",
                   str(RATIO), "--broker", self.broker_url, "--min-devices", str(len(DEVICES)),
                   "--round-deadline", str(deadline_s), "--join-timeout", str(RUN_TIMEOUT_S),
                   "--cache-dir", str(self.cache), "--out", str(self.out),
                   "--enroll", str(enrollment_file(self.out / "enrollment.json", DEVICES)), *extra]
        self.server = self._spawn(command, self.out / SERVER_OUT)
        self.wait(lambda: self.server_log().count(SERVER_LISTENS) > started, "the server listening")

    def start(self, deadline_s: float) -> None:
        """The server, then every device."""
        self.start_server(deadline_s)
        for device_id in DEVICES:
            self.start_device(device_id)

    def start_device(self, device_id: str) -> None:
        command = [sys.executable, "-m", "device_runtime", "--broker", self.broker_url, "--device-id", device_id,
                   "--data", str(self.shard_paths[device_id]), "--workdir", str(self.workdir(device_id)),
                   "--threads", "1", "--runtime", TRAINING_KIND,  # the runtime of reference_fe's "ort" backend
                   "--key-file", str(write_key(self.out / "keys" / f"{device_id}.key"))]
        self.devices[device_id] = self._spawn(command, self.device_log(device_id))

    def _spawn(self, command: list[str], log_path: Path) -> subprocess.Popen:
        with open(log_path, "ab") as log:
            return subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)

    def workdir(self, device_id: str) -> Path:
        return self.out / broker_loop.DEVICES_DIR / device_id

    def device_log(self, device_id: str) -> Path:
        return self.out / broker_loop.DEVICES_DIR / f"{device_id}.log"

    def server_log(self) -> str:
        path = self.out / broker_loop.SERVER_LOG
        return path.read_text() if path.exists() else ""

    def answered(self, device_id: str) -> int:
        """The last round the device committed an answer to (its state.json, saved before it publishes)."""
        path = self.workdir(device_id) / STATE_FILE
        return json.loads(path.read_text())["answered_round"] if path.exists() else 0

    def checkpointed(self) -> int:
        """The last round the server completed: its checkpoint's round, read without its tensors."""
        path = self.out / CHECKPOINT_NAME
        if not path.exists():
            return 0
        with np.load(path) as checkpoint:
            return json.loads(checkpoint[STATE_KEY].tobytes())["round"]

    def alive(self) -> None:
        """Raise if the server exited, with the end of its output."""
        if self.server is not None and self.server.poll() is not None:
            raise AssertionError(f"the server exited with status {self.server.returncode}:\n{self._server_tail()}")

    def _server_tail(self) -> str:
        return (self.out / SERVER_OUT).read_text()[-3000:]

    def wait(self, condition: Callable[[], bool], what: str) -> None:
        wait_for(condition, RUN_TIMEOUT_S, what, alive=self.alive, poll_s=POLL_S)

    def wait_mid_round(self, round_index: int) -> None:
        """Until every device but SLOW answered ``round_index``: the round is open and SLOW is computing."""
        self.wait(lambda: all(self.answered(d) >= round_index for d in DEVICES if d != SLOW),
                  f"the fast devices answering round {round_index}")
        assert (self.answered(SLOW), self.checkpointed()) == (round_index - 1, round_index - 1)

    def finish(self) -> None:
        """Wait for the server to complete the run; it must exit 0."""
        try:
            self.server.wait(RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the run did not finish within {RUN_TIMEOUT_S:g} s") from None
        assert self.server.returncode == 0, self._server_tail()

    def kill_server(self) -> None:
        self.server.kill()
        self.server.wait()

    def kill_device(self, device_id: str) -> None:
        self.devices[device_id].kill()
        self.devices[device_id].wait()

    def stop(self) -> None:
        """End every process of this run still running: SIGTERM, then SIGKILL after STOP_TIMEOUT_S."""
        stop_processes((self.server, *self.devices.values()), STOP_TIMEOUT_S)


# -- data and the reference --------------------------------------------------------------------


def sim_args(cache: Path) -> argparse.Namespace:
    return simulate.build_parser().parse_args([*QUICK, "--clients", str(len(DEVICES)), "--rounds", str(ROUNDS),
                                               "--rank-ratio", str(RATIO), "--backend", "ort", "--cache-dir",
                                               str(cache)])


@pytest.fixture(scope="module")
def shards(cache: Path) -> dict[str, Shard]:
    """The partition server.broker_loop --local-devices would make, with SLOW's training set repeated."""
    _, _, by_device = load_shards(sim_args(cache), len(DEVICES))
    assert list(by_device) == DEVICES
    slow = by_device[SLOW]
    by_device[SLOW] = Shard(np.tile(slow.x_train, (SLOW_REPEAT, 1, 1, 1)), np.tile(slow.y_train, SLOW_REPEAT),
                            slow.x_test, slow.y_test, slow.num_classes)
    return by_device


@pytest.fixture(scope="module")
def shard_paths(shards: dict[str, Shard], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return dict(zip(shards, write_shards(list(shards.values()), tmp_path_factory.mktemp("shards"))))


@pytest.fixture(scope="module")
def cache(shared_artifact_cache: Path) -> Path:
    return shared_artifact_cache


@pytest.fixture
def federation(mosquitto_broker, tmp_path: Path, cache: Path,
               shard_paths: dict[str, Path]) -> Iterator[FederationProcesses]:
    processes = FederationProcesses(tmp_path / "run", mosquitto_broker.url, cache, shard_paths)
    yield processes
    processes.stop()


def reference_fe(shards: dict[str, Shard], out: Path, cache: Path, monkeypatch: pytest.MonkeyPatch,
                 ) -> dict[str, np.ndarray]:
    """The in-process federation's final global FE on the run's shards (SLOW's repeated one included)."""
    registry = load_checkpoint(out / CHECKPOINT_NAME).state["engine"]["registry"]["devices"]
    assert sorted(d["device_id"] for d in registry) == DEVICES
    args = sim_args(cache)
    model, input_shape, _ = load_shards(args, 0)
    with monkeypatch.context() as patch:
        patch.setattr(run_setup, "load_shards", lambda _args, count: (model, input_shape, dict(shards)))
        folder = out.parent / "reference"
        folder.mkdir()
        simulation = simulate.Simulation(args, RunFolder(folder))
        records = simulation.run()
    assert [r["participants"] for r in records] == [len(DEVICES)] * ROUNDS
    return simulation.engine.global_arrays()


def assert_final_fe_is(out: Path, expected: dict[str, np.ndarray]) -> None:
    got = load_checkpoint(out / CHECKPOINT_NAME).tensors
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=FE_ATOL, err_msg=name)


def assert_every_round_once_with_every_device(out: Path) -> None:
    records = read_metrics(out / METRICS_FILE)
    assert [r["round"] for r in records] == list(range(1, ROUNDS + 1))
    for r in records:
        assert (r["participants"], r["selected"], r["dropped"], r["evaluated"]) == (5, 5, {}, 5), r


# -- 1. a device killed mid-round ---------------------------------------------------------------


@pytest.mark.slow
def test_device_killed_mid_round_is_dropped_at_the_deadline_and_rejoins_with_its_cache_and_head(
        federation: FederationProcesses):
    """SLOW is SIGKILLed while training round 2: the round closes at its deadline with the other four and is
    aggregated; SLOW, restarted, rejoins from its workdir (no artifacts sent, its head restored) and trains round 3
    (the server's --min-devices 5 waits for it)."""
    federation.start(DEADLINE_S)
    federation.wait_mid_round(FAULT_ROUND)
    federation.kill_device(SLOW)
    federation.wait(lambda: federation.checkpointed() == FAULT_ROUND, f"round {FAULT_ROUND} closing without SLOW")
    federation.start_device(SLOW)
    federation.finish()

    records = read_metrics(federation.out / METRICS_FILE)
    assert [r["round"] for r in records] == list(range(1, ROUNDS + 1))
    faulty, after = records[FAULT_ROUND - 1], records[FAULT_ROUND]
    assert (faulty["dropped"], faulty["closed_by"]) == ({SLOW: NO_ANSWER}, DEADLINE)
    assert (faulty["participants"], faulty["selected"], faulty["aggregated"]) == (4, 5, True)
    assert (after["participants"], after["selected"], after["dropped"], after["bytes_artifacts"]) == (5, 5, {}, 0)
    log = federation.device_log(SLOW).read_text()
    assert log.count("installed artifacts") == 1 and log.count("restored the personal tensors of plan") == 1
    heads = [p.name for p in (federation.workdir(SLOW) / HEADS_DIR).iterdir()]
    assert len(heads) == 1 and heads[0].endswith(f"-{FAULT_ROUND + 1}.npz")  # trained the round after its restart


# -- 2. the broker restarted mid-run -----------------------------------------------------------


@pytest.mark.slow
def test_broker_restart_mid_round_loses_no_update_and_counts_none_twice(
        federation: FederationProcesses, mosquitto_broker, shards: dict[str, Shard], cache: Path,
        monkeypatch: pytest.MonkeyPatch):
    """mosquitto (no persistence: sessions, queued and retained messages die with it) stops in round 2 and stays
    down while SLOW finishes and publishes its answer. Everyone reconnects, every round counts all five devices
    once, and the final FE is the reference's: no update lost, none counted twice."""
    federation.start(NO_DEADLINE_S)
    federation.wait_mid_round(FAULT_ROUND)
    mosquitto_broker.stop()
    federation.wait(lambda: federation.answered(SLOW) == FAULT_ROUND, "SLOW answering while the broker is down")
    mosquitto_broker.start()
    federation.finish()

    assert "reconnected to a broker that held no session of the server; re-sending" in federation.server_log()
    assert_every_round_once_with_every_device(federation.out)
    assert_final_fe_is(federation.out, reference_fe(shards, federation.out, cache, monkeypatch))


@pytest.mark.slow
def test_broker_restart_that_kept_the_sessions_needs_no_task_sent_again(
        start_mosquitto, tmp_path: Path, shards: dict[str, Shard], cache: Path, shard_paths: dict[str, Path],
        monkeypatch: pytest.MonkeyPatch):
    """mosquitto with persistence stops in round 2 and comes back with every session: the server re-sends no task
    (the broker queued what came for it), and still no update is lost or counted twice."""
    (tmp_path / "mosquitto").mkdir()
    broker = start_mosquitto(persistence_dir=tmp_path / "mosquitto")
    federation = FederationProcesses(tmp_path / "run", broker.url, cache, shard_paths)
    try:
        federation.start(NO_DEADLINE_S)
        federation.wait_mid_round(FAULT_ROUND)
        broker.stop()
        federation.wait(lambda: federation.answered(SLOW) == FAULT_ROUND, "SLOW answering while the broker is down")
        broker.start()
        federation.finish()
    finally:
        federation.stop()

    assert "re-sending the open round's task" not in federation.server_log()
    assert_every_round_once_with_every_device(federation.out)
    assert_final_fe_is(federation.out, reference_fe(shards, federation.out, cache, monkeypatch))


# -- 3. the server killed mid-round, then --resume -------------------------------------------------


@pytest.mark.slow
def test_server_killed_mid_round_resumes_to_the_uninterrupted_global_fe(
        federation: FederationProcesses, shards: dict[str, Shard], cache: Path, monkeypatch: pytest.MonkeyPatch):
    """The server is SIGKILLed in round 2 (four answers in, SLOW computing); the devices run on. --resume re-runs
    round 2 from the round-1 checkpoint with the same tasks; the devices that answered re-send their saved answers,
    the dead server's queued copies are dropped as stale, and the final FE is the uninterrupted reference's."""
    federation.start(NO_DEADLINE_S)
    federation.wait_mid_round(FAULT_ROUND)
    federation.kill_server()
    assert federation.checkpointed() == FAULT_ROUND - 1
    federation.start_server(NO_DEADLINE_S, "--resume")
    federation.finish()

    assert_every_round_once_with_every_device(federation.out)
    assert_final_fe_is(federation.out, reference_fe(shards, federation.out, cache, monkeypatch))


# -- the device's commit, without a broker -----------------------------------------------------------


class Killed(BaseException):
    """Stands for a SIGKILL at a chosen point of the device's work."""


def device_agent(workdir: Path, shard: Shard) -> tuple[DeviceAgent, RecordingEndpoint]:
    outbox = RecordingEndpoint()
    agent = DeviceAgent("dev_c", shard, collect_profile(None, 1), outbox, Workdir(workdir),
                        Topics(DEFAULT_TOPIC_PREFIX, "dev_c"), device_link("dev_c", workdir.parent / f"{workdir.name}-auth"))
    return agent, outbox


def serve(agent: DeviceAgent, *messages: Message) -> None:
    for msg in messages:
        agent.handle(agent.topics.down, seal_down(msg))


def test_device_killed_before_committing_a_round_trains_it_again_from_its_committed_head(
        tmp_path: Path, cache: Path, shards: dict[str, Shard]):
    """Between saving a round's head and committing its answer, a kill must not leave the advanced head in use:
    the restarted device trains the round again from the head it started from, and answers as if never killed."""
    shard = shards[DEVICES[0]]
    model = build_model("fedavgcnn", shard.input_shape, shard.num_classes, seed=0)
    artifacts = build_artifacts(model, {}, shard.input_shape, shard.num_classes, cache)
    files = {name: (artifacts.directory / name).read_bytes() for name in ARTIFACT_BLOBS_BY_KIND[TRAINING_KIND]}
    fe = {k: v.detach().numpy().copy() for k, v in model.state_dict().items() if k.startswith("fe.")}
    head = {k: v.detach().numpy().copy() for k, v in model.state_dict().items() if k.startswith("head.")}
    plan = plan_message(Plan(artifacts.hash, 1.0, "dense", files, head), device_id="dev_c", run_id="run")
    first, second = (task_message(Task(round=r, weights=fe, lam=0.0, mu=0.0, lr=0.05, phases=(Phase("all", 1),),
                                       batch_size=16, seed=r),
                                  plan_hash=artifacts.hash, device_id="dev_c", run_id="run") for r in (1, 2))
    control, control_out = device_agent(tmp_path / "control", shard)
    serve(control, plan, first, second)
    killed, _ = device_agent(tmp_path / "killed", shard)
    serve(killed, plan, first)

    def kill(state: object) -> None:
        raise Killed()

    killed.workdir.save_state = kill  # round 2's head and answer are on disk; its commit is not
    with pytest.raises(Killed):
        serve(killed, second)
    restarted, restarted_out = device_agent(tmp_path / "killed", shard)
    serve(restarted, plan, second)  # the server answers its JOIN with the plan, then asks again

    (_, expected), (_, got) = (parse_update(decode(out.sent[-1], max_bytes=1 << 28))
                               for out in (control_out, restarted_out))
    for name, value in expected.weights.items():
        np.testing.assert_array_equal(got.weights[name], value, err_msg=name)
    for name, value in control.trainer.get_head().items():
        np.testing.assert_array_equal(restarted.trainer.get_head()[name], value, err_msg=name)
