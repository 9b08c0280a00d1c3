"""Secure aggregation over MQTT (``python -m server.broker_loop --secure-aggregation``): the server and real device
processes (``python -m device_runtime``) over Debian's mosquitto, SecAgg+'s four exchanges in sealed envelopes.

- a clean run: 4 devices, 3 rounds, every device a survivor of every round;
- an attacked run (one round): anyone on the open broker replays a device's sealed shares, re-addresses a relayed
  share to another device, replays and forges unmasking requests and answers (``mosquitto_pub``-made frames), and
  an enrolled device outside the round sends keys, a masked input and unmasking shares: each is refused with a
  logged reason, and the model is the plain engine's on the same updates within the bound;
- distributed DP over MQTT: each round charged as the Skellam mechanism, the run stopped at its target;
- a device SIGKILLed after sharing (one round; its training made slow by a repeated shard, so the kill lands
  between its shares and its masked input by construction): its masks are removed with its neighbours' shares and
  the model is the plain aggregate of the three survivors within the bound.

Where a model is compared, the run is one round of digits on dense tiers (rank 1.0): its model is the plain
engine's on the same updates within the round's quantization bound (``secagg.quantization_bound``, stated in its
metrics row) plus float32 rounding. The reference is the in-process federation (``server.simulate --backend
portable``, the runtime the devices run), plain, on the same shards and seeds (devices train the same batches
whatever the transport). Later rounds would train on models that already differ by up to that much, so one round
is what the bound speaks for.
The flags secure aggregation cannot serve over MQTT are refused in one line (exit 2).
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from device_runtime import secagg_wire
from device_runtime.framing import DEFAULT_MAX_FRAME_BYTES, FRAME_HEADER_BYTES, chunk, frame_msg_id
from device_runtime.messages import update_message
from device_runtime.secagg_client import SELF_SEED, AdvertisedKeys
from device_runtime.shard import Shard
from device_runtime.task import Update
from server import broker_loop, run_setup, simulate
from server.data.partition import write_shards
from device_runtime.dense_delta import dimension
from server.engine.accountant import SkellamAccountant
from server.engine.run_config import DpSettings
from server.engine.secure_rounds import dp_noise
from server.outputs.checkpoint import CHECKPOINT_NAME, load_checkpoint
from server.outputs.report import METRICS_FILE, read_metrics
from server.run_setup import RunFolder, load_shards
from tests.support.processes import stop_processes
from tests.support.broker import mosquitto_pub
from tests.support.broker_capture import Capture, record
from device_runtime.auth import CounterSource, Direction
from device_runtime.envelope import seal
from tests.support.sealing import KEY, enrollment_file, read, seal_up, write_key
from tests.support.waiting import wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
QUICK = ["--dataset", "digits", "--max-samples", "600", "--local-epochs", "1", "--batch-size", "32", "--lr", "0.05",
         "--lam", "2", "--lam-warmup", "1", "--threads", "1", "--aggregate", "updates", "--rank-ratio", "1.0",
         "--min-completion", "0.5"]
SECURE = ["--secure-aggregation"]
PREFIX = "fedara"
INSIDER = "dev_009"  # enrolled (the test holds its key), never joins: a device outside every round
SLOW_REPEAT = 30
RUN_TIMEOUT_S = 240.0
POLL_S = 0.05
STOP_TIMEOUT_S = 10.0
FORGER = CounterSource(int(time.time()) + 10**6)
"""Counters above any a process of this test run holds: a forgery is refused for what it is, not as stale."""


def device_ids(n: int) -> list[str]:
    return [f"dev_{i:03d}" for i in range(n)]


def sim_args(cache: Path, clients: int, out: Path) -> object:
    return simulate.build_parser().parse_args([*QUICK, "--clients", str(clients), "--rounds", "1", "--backend",
                                               "portable", "--cache-dir", str(cache), "--out", str(out)])


def shards_for(cache: Path, clients: int, tmp: Path, slow: str | None = None) -> dict[str, Shard]:
    """The partition --local-devices would make (``slow``'s training set repeated SLOW_REPEAT times)."""
    _, _, by_device = load_shards(sim_args(cache, clients, tmp), clients)
    if slow is not None:
        s = by_device[slow]
        by_device[slow] = Shard(np.tile(s.x_train, (SLOW_REPEAT, 1, 1, 1)), np.tile(s.y_train, SLOW_REPEAT),
                                s.x_test, s.y_test, s.num_classes)
    return by_device


def plain_reference(cache: Path, shards: dict[str, Shard], out: Path, monkeypatch: pytest.MonkeyPatch,
                    silent: frozenset[str] = frozenset()) -> dict[str, np.ndarray]:
    """The plain engine's model after round 1 on these shards, the devices ``silent`` not answering: the
    sample-weighted mean change of the others (the in-process federation, portable runtime)."""
    args = sim_args(cache, len(shards), out)
    model, input_shape, _ = load_shards(args, 0)
    with monkeypatch.context() as patch:
        patch.setattr(run_setup, "load_shards", lambda _args, count: (model, input_shape, dict(shards)))
        out.mkdir(parents=True)
        simulation = simulate.Simulation(args, RunFolder(out))
        answers = simulation._answers
        patch.setattr(simulation, "_answers", lambda tasks: answers({d: t for d, t in tasks.items()
                                                                     if d not in silent}))
        simulation._round(1)
    return simulation.engine.global_arrays()


class Federation:
    """A secure run's processes over one broker: the server, then one device process per shard."""

    def __init__(self, out: Path, broker_url: str, cache: Path, shards: dict[str, Shard]):
        self.out, self.broker_url, self.cache = out, broker_url, cache
        (out / "devices").mkdir(parents=True, exist_ok=True)
        self.shard_paths = dict(zip(shards, write_shards(list(shards.values()), out / "shards")))
        self.server: subprocess.Popen | None = None
        self.devices: dict[str, subprocess.Popen] = {}

    def start(self, rounds: int = 1, *extra: str) -> None:
        ids = list(self.shard_paths)
        command = [sys.executable, "-m", "server.broker_loop", *QUICK, *SECURE, "--rounds", str(rounds), "--broker",
                   self.broker_url, "--min-devices", str(len(ids)), "--round-deadline", str(RUN_TIMEOUT_S),
                   "--join-timeout", str(RUN_TIMEOUT_S), "--secagg-phase-timeout", str(RUN_TIMEOUT_S),
                   "--cache-dir", str(self.cache), "--out", str(self.out),
                   "--enroll", str(enrollment_file(self.out / "enrollment.json", [*ids, INSIDER])), *extra]
        self.server = self._spawn(command, self.out / "server.out")
        for device_id, shard in self.shard_paths.items():
            self.devices[device_id] = self._spawn(
                [sys.executable, "-m", "device_runtime", "--broker", self.broker_url, "--device-id", device_id,
                 "--data", str(shard), "--workdir", str(self.out / "devices" / device_id), "--threads", "1",
                 "--key-file", str(write_key(self.out / "keys" / f"{device_id}.key"))], self.device_log(device_id))

    def _spawn(self, command: list[str], log_path: Path) -> subprocess.Popen:
        with open(log_path, "ab") as log:
            return subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)

    def device_log(self, device_id: str) -> Path:
        return self.out / "devices" / f"{device_id}.log"

    def log_of(self, device_id: str) -> str:
        path = self.device_log(device_id)
        return path.read_text() if path.exists() else ""

    def server_log(self) -> str:
        path = self.out / broker_loop.SERVER_LOG
        return path.read_text() if path.exists() else ""

    def alive(self) -> None:
        if self.server.poll() not in (None, 0):
            raise AssertionError(f"the server exited with {self.server.returncode}:\n"
                                 f"{(self.out / 'server.out').read_text()[-3000:]}")

    def wait(self, condition: Callable[[], bool], what: str) -> None:
        wait_for(condition, RUN_TIMEOUT_S, what, alive=self.alive, poll_s=POLL_S)

    def finish(self) -> tuple[list[dict], dict[str, np.ndarray]]:
        """Wait for the run's end: its metrics rows and its model."""
        try:
            self.server.wait(RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the run did not finish within {RUN_TIMEOUT_S:g} s") from None
        assert self.server.returncode == 0, (self.out / "server.out").read_text()[-3000:]
        tensors = load_checkpoint(self.out / CHECKPOINT_NAME).tensors
        return read_metrics(self.out / METRICS_FILE), {k: v for k, v in tensors.items()
                                                        if not k.startswith("device/")}

    def stop(self) -> None:
        stop_processes((self.server, *self.devices.values()), STOP_TIMEOUT_S)


@pytest.fixture(scope="module")
def cache(shared_artifact_cache: Path) -> Path:
    return shared_artifact_cache


@pytest.fixture
def processes(mosquitto_broker, tmp_path: Path, cache: Path) -> Iterator[Callable[..., Federation]]:
    made: list[Federation] = []

    def make(shards: dict[str, Shard]) -> Federation:
        made.append(Federation(tmp_path / "run", mosquitto_broker.url, cache, shards))
        return made[-1]
    yield make
    for federation in made:
        federation.stop()


def assert_within_bound(row: dict, got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    """The secure model is the plain one within the round's stated bound plus one float32 rounding of each."""
    bound = row["secagg"]["quantization_bound"]
    assert got.keys() == expected.keys() and 0 < bound < 1e-6
    for key, value in expected.items():
        slack = bound + 2 * np.spacing(np.abs(value).astype(np.float32))
        assert np.all(np.abs(got[key].astype(np.float64) - value) <= slack), key


# -- a clean run -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_four_device_processes_aggregate_three_rounds_securely(processes, cache, tmp_path):
    shards = shards_for(cache, 4, tmp_path / "partition")
    federation = processes(shards)
    federation.start(rounds=3)
    rows, _ = federation.finish()
    assert [r["round"] for r in rows] == [1, 2, 3]
    for row in rows:
        s = row["secagg"]
        assert (s["participants"], s["survivors"], s["dropped"], s["recovered"], s["aggregated"]) == (4, 4, 0, 0, True)
        assert all(s["phases"][p]["bytes_in"] > 0 for p in ("keys", "shares", "masked", "unmask"))
        assert s["phases"]["masked"]["bytes_in"] == 4 * s["dimension"] * 4 and 0 < s["quantization_bound"] < 1e-6
    for device_id in shards:
        log = federation.log_of(device_id)
        assert log.count("secure aggregation: keys advertised") == log.count("unmasking share(s) sent") == 3


@pytest.mark.slow
def test_distributed_dp_over_mqtt_charges_the_skellam_mechanism_and_stops_at_the_target(cache, tmp_path):
    """The simulator's distributed-DP run (tests/drivers/test_secure_federation.py) over MQTT, four local device
    processes on the embedded broker: the devices add the noise, each round is charged as the Skellam mechanism, the
    run stops at --dp-target-epsilon."""
    out = tmp_path / "run"
    assert broker_loop.main([*QUICK, *SECURE, "--local-devices", "4", "--rounds", "5", "--round-deadline",
                             str(RUN_TIMEOUT_S), "--join-timeout", str(RUN_TIMEOUT_S), "--cache-dir", str(cache),
                             "--out", str(out), "--dp-noise-multiplier", "2.0", "--dp-clip", "0.05", "--join-ratio",
                             "1", "--dp-target-epsilon", "1"]) == 0
    rows = read_metrics(out / METRICS_FILE)
    model = {k: v for k, v in load_checkpoint(out / CHECKPOINT_NAME).tensors.items() if not k.startswith("device/")}
    shapes = {k: v.shape for k, v in model.items() if not k.startswith("head.")}
    mu, l2 = dp_noise(DpSettings(2.0, 1.0, 4, 0.05), dimension(shapes))
    accountant = SkellamAccountant(1.0, mu, l2, dimension(shapes), 4 ** -1.1)
    assert [r["epsilon"] for r in rows] == pytest.approx([accountant.epsilon_after(i + 1) for i in range(len(rows))])
    assert len(rows) == 3 and all(r["secagg"]["aggregated"] and r["secagg"]["noise_mu_per_device"] > 0 for r in rows)


# -- hostile: anyone on the open broker, and an enrolled device outside the round -------------------------------


class Attacker(Capture):
    """Sees every frame on the devices' topics and, as round 1's exchanges pass, publishes with mosquitto_pub:
    dev_000's sealed shares again (a replay), dev_001's relayed shares on dev_002's down topic (a share for another
    device), dev_001's unmasking request again (a replayed request) and dev_000's unmasking answer again, a request
    sealed under the device key but for no session (forged), and as INSIDER (enrolled, not in the round) a masked
    input and unmasking shares."""

    def __init__(self, port: int, folder: Path, participants: list[str]):
        super().__init__()
        self.port, self.folder, self.participants = port, folder, participants
        self.seen: dict[str, list[str]] = {}  # topic -> the secagg msg ids seen there, in order
        self.done: list[str] = []
        self.lock = threading.Lock()

    def publish(self, topic: str, frames: list[bytes], what: str) -> None:
        for i, frame in enumerate(frames):
            mosquitto_pub(self.port, topic, frame, self.folder / f"frame-{uuid.uuid4().hex}.bin")
        self.done.append(what)

    def on_message(self, client, userdata, message) -> None:
        super().on_message(client, userdata, message)
        frame, topic = bytes(message.payload), message.topic
        ident = frame_msg_id(frame)
        if not ident.startswith("secagg-"):
            return
        with self.lock:
            seen = self.seen.setdefault(topic, [])
            if ident in seen:
                return
            seen.append(ident)
            threading.Thread(target=self.attack, args=(topic, len(seen), frame), daemon=True).start()

    def attack(self, topic: str, nth: int, frame: bytes) -> None:
        """The ``nth`` secagg message seen on ``topic`` (whole in one frame: they are small)."""
        up0, down0, down1 = (f"{PREFIX}/dev/dev_000/up", f"{PREFIX}/dev/dev_000/down", f"{PREFIX}/dev/dev_001/down")
        run_id = read(frame[FRAME_HEADER_BYTES:]).run_id
        insider = f"{PREFIX}/dev/{INSIDER}"
        if topic == up0 and nth == 1:  # dev_000 advertised its keys: the keys phase is open
            self.publish(f"{insider}/up", self.frames_of(seal_up(secagg_wire.keys_message(
                AdvertisedKeys(bytes(32), bytes(32)), device_id=INSIDER, run_id=run_id, round_index=1))),
                "keys from outside the round")
            masked = update_message(Update(1, {}, 50, 1.0, 0.5, {}), plan_hash="0" * 64, device_id=INSIDER,
                                    run_id=run_id)
            masked.blobs[secagg_wire.MASKED_BLOB] = bytes(8)
            self.publish(f"{insider}/update", self.frames_of(seal_up(masked)), "masked input from outside the round")
            answer = secagg_wire.unmasking_message({"dev_000": (SELF_SEED, 1)}, device_id=INSIDER, run_id=run_id,
                                                   round_index=1)
            self.publish(f"{insider}/up", self.frames_of(seal_up(answer)), "forged unmasking answer")
        elif topic == up0 and nth == 2:  # dev_000's sealed shares
            self.publish(up0, [frame], "replayed share")
        elif topic == down1 and nth == 2:  # the shares relayed to dev_001
            self.publish(f"{PREFIX}/dev/dev_002/down", [frame], "share for another device")
        elif topic == down1 and nth == 3:  # dev_001's unmasking request
            self.publish(down1, [frame], "replayed unmasking request")
            forged = secagg_wire.survivors_message(self.participants[:2], device_id="dev_000", run_id=run_id,
                                                   round_index=1)
            self.publish(down0, self.frames_of(seal(forged, KEY, Direction.DOWN, FORGER.next())),
                         "forged unmasking request")
        elif topic == up0 and nth == 3:  # dev_000's unmasking answer
            self.publish(up0, [frame], "replayed unmasking answer")

    @staticmethod
    def frames_of(envelope: bytes) -> list[bytes]:
        return chunk(envelope, DEFAULT_MAX_FRAME_BYTES, f"attack-{uuid.uuid4().hex}")


@pytest.mark.slow
def test_replayed_misaddressed_and_forged_exchanges_are_refused_and_move_nothing(processes, mosquitto_broker, cache,
                                                                                 tmp_path, monkeypatch):
    shards = shards_for(cache, 3, tmp_path / "partition")
    federation = processes(shards)
    attacker = Attacker(mosquitto_broker.port, tmp_path, list(shards))
    stop = threading.Event()
    recorder = record(mosquitto_broker.port, stop, attacker)
    try:
        federation.start()
        (row,), model = federation.finish()
        wait_for(lambda: len(attacker.done) == 8, 30, "every attack sent")
    finally:
        stop.set()
        recorder.join(10)
    assert sorted(attacker.done) == sorted(["replayed share", "keys from outside the round",
                                            "share for another device", "replayed unmasking request",
                                            "forged unmasking request", "masked input from outside the round",
                                            "forged unmasking answer", "replayed unmasking answer"])
    s = row["secagg"]
    assert (s["survivors"], s["dropped"], s["aggregated"]) == (3, 0, True)
    assert_within_bound(row, model, plain_reference(cache, shards, tmp_path / "reference", monkeypatch))
    server = federation.server_log()
    assert refused_again(server, f"{PREFIX}/dev/dev_000/up")  # the replayed share (and answer)
    assert f"refused keys from {INSIDER} for secure aggregation (round 1)" in server  # not a participant, or too late
    assert (f"refused unmask from {INSIDER} for secure aggregation (round 1): unmasking shares for ['dev_000'], "
            "not this round") in server
    assert f"dropped an update from {INSIDER} (round 1): unknown device" in server  # its masked input
    assert "a message of 'dev_001' on a topic of 'dev_002'" in federation.log_of("dev_002")  # sealed for dev_001
    assert "[stale_session]" in federation.log_of("dev_000")  # the forged request: sealed for no session of it
    assert refused_again(federation.log_of("dev_001"), down_topic("dev_001"))  # the replayed request


def down_topic(device_id: str) -> str:
    return f"{PREFIX}/dev/{device_id}/down"


def refused_again(log: str, topic: str) -> bool:
    """Whether a frame on ``topic`` was refused as one already taken: dropped as a re-delivery within moments
    (``[repeat]``) or, later, by its counter (``[replay]``)."""
    return any(topic in line and ("[repeat]" in line or "[replay]" in line) for line in log.splitlines()) or (
        "[replay]" in log)


# -- a device SIGKILLed after sharing ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_device_killed_after_sharing_is_recovered_and_the_survivors_plain_aggregate_results(processes, cache,
                                                                                              tmp_path, monkeypatch):
    ids = device_ids(4)
    slow = ids[-1]
    shards = shards_for(cache, 4, tmp_path / "partition", slow=slow)
    federation = processes(shards)
    federation.start()
    federation.wait(lambda: "neighbour(s) shared; training" in federation.log_of(slow), f"{slow} training")
    federation.devices[slow].kill()  # it shared, and its training (a repeated shard) takes seconds: no masked input
    federation.devices[slow].wait()
    (row,), model = federation.finish()
    s = row["secagg"]
    assert (s["participants"], s["survivors"], s["dropped"], s["recovered"], s["aggregated"]) == (4, 3, 1, 1, True)
    assert "unmasking share(s) sent" not in federation.log_of(slow)
    reference = plain_reference(cache, shards, tmp_path / "reference", monkeypatch, silent=frozenset({slow}))
    assert_within_bound(row, model, reference)


# -- what it cannot serve ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags,says", [
    (["--mode", "async"], "--mode sync"),
    (["--aggregators", "2", "--broker", "mqtt://127.0.0.1:1"], "--aggregators 2"),
    (["--update-norm-bound", "1"], "leave --update-norm-bound out"),
    (["--secagg-phase-timeout", "0"], "--secagg-phase-timeout must be positive"),
])
def test_what_secure_aggregation_cannot_serve_over_mqtt_is_refused_in_one_line(flags, says, tmp_path, capsys):
    assert broker_loop.main(["--dataset", "digits", "--local-devices", "3", "--aggregate", "updates", *SECURE,
                             "--out", str(tmp_path / "run"), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
