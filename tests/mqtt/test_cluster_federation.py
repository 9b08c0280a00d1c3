"""A federation on a 3-node NATS cluster (Debian's ``nats-server``, scripts/nats_cluster.py), one node killed.

The server starts on node 1, its two aggregators on nodes 2 and 3, device i on node i mod 3 (every process has the
whole list and moves to the next node when its node goes). Mid-round 2 node 2 is SIGKILLed, as a crashed machine
would go: with it go the connections of agg-0 and of dev_001 and dev_004. They reconnect to the other nodes; what was
in flight is recovered by the protocol's re-send rules (a device that says online while the round awaits it is sent
its task again, an aggregator that connected again has its devices asked again, and a device that already
answered re-sends its saved answer). Every round completes with every device, each (device, round) is folded once,
and the final model is the undisturbed run's on the same cluster up to float rounding carried on by training.
"""
from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fedcore.models import build_model
from server import broker_loop
from server.engine.round_engine import algorithm_for
from server.engine.run_config import FederationConfig
from server.outputs.checkpoint import CHECKPOINT_NAME, load_checkpoint
from server.data.datasets import load_dataset
from server.outputs.report import METRICS_FILE, read_metrics
from server.run_setup import global_state
from tests.support.scripts import load_script
from tests.support.machine import missing_binary, require

QUICK = ["--dataset", "digits", "--max-samples", "600", "--local-epochs", "1", "--batch-size", "32", "--lr", "0.05",
         "--threads", "1", "--join-timeout", "300", "--round-deadline", "300", "--aggregator-timeout", "60"]
DEVICES, ROUNDS, AGGREGATORS = 6, 3, 2
KILLED = 1
"""Node 2 of 3 (index 1): agg-0's, dev_001's and dev_004's."""
FOLDED = re.compile(r"(agg-\d+) folded (dev_\d+)'s update of round (\d+)")
AGREEMENT = 1e-2
"""The two runs differ only in how float sums are grouped (which member folds which update, merged in float64 and
rounded to float32 once a round: at most an ulp of a weight). Training carries that on, and a ulp can flip a
max-pool or ReLU decision of the next round, which moves a weight by ~lr·|grad|: measured here, max |Δ| / max |W|
from 2.2e-7 (no flip) to 3.5e-4 (one flip), i.e. ‖Δ‖ ≤ 3.3e-4 of what training moved each tensor. The bound is 1 %
of that movement: 30× that room, while a lost or doubly folded update of one of 6 devices shifts a round by a
sixth of a device's update. The folds themselves are counted exactly above."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    require(missing_binary("nats-server", "nats-server"))  # scripts/nats_cluster.py runs it from PATH
    module = load_script("nats_cluster")
    nodes = module.NatsCluster(tmp_path_factory.mktemp("nats"), 3).start()
    yield nodes
    nodes.stop()


def federate(out: Path, cache: Path, brokers: str) -> Path:
    assert broker_loop.main([*QUICK, "--cache-dir", str(cache), "--out", str(out), "--broker", brokers,
                             "--rounds", str(ROUNDS), "--local-devices", str(DEVICES),
                             "--aggregators", str(AGGREGATORS)]) == 0
    return out


def kill_during_round_2(cluster, run: Path, killed: list[int], stop: threading.Event) -> None:
    """SIGKILL node KILLED once an aggregator folded a round-2 update (round 2 is open and under way); ``killed``
    gets the length of the server's log then."""
    while not stop.is_set():
        logs = sorted((run / broker_loop.AGGREGATORS_DIR).glob("*.log"))
        if any("update of round 2" in log.read_text() for log in logs):
            cluster.kill(KILLED)
            killed.append(len((run / broker_loop.SERVER_LOG).read_text()))
            return
        time.sleep(0.05)


def folds(run: Path) -> list[tuple[str, str, int]]:
    logs = sorted((run / broker_loop.AGGREGATORS_DIR).glob("*.log"))
    return [(a, d, int(r)) for log in logs for a, d, r in FOLDED.findall(log.read_text())]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_node_killed_mid_round_2_loses_no_device_and_no_update(cluster, tmp_path: Path):
    cache = tmp_path / "artifacts"
    undisturbed = federate(tmp_path / "undisturbed", cache, cluster.broker)

    run, killed, stop = tmp_path / "killed", [], threading.Event()
    killer = threading.Thread(target=kill_during_round_2, args=(cluster, run, killed, stop), daemon=True)
    killer.start()
    try:
        federate(run, cache, cluster.broker)
    finally:
        stop.set()
        killer.join()
    assert killed, "the run ended before round 2 folded anything"
    server_log = (run / broker_loop.SERVER_LOG).read_text()
    assert "round 2/" not in server_log[:killed[0]] and "round 2/" in server_log  # killed while round 2 was open

    records = read_metrics(run / METRICS_FILE)
    assert [r["round"] for r in records] == list(range(1, ROUNDS + 1))
    assert all(r["participants"] == r["selected"] == DEVICES and r["dropped"] == {} for r in records), records
    assert all(len(r["per_device"]) == DEVICES for r in records)  # every device evaluated every model
    folded = sorted((d, r) for _, d, r in folds(run))
    assert folded == sorted((f"dev_{i:03d}", r) for i in range(DEVICES) for r in range(1, ROUNDS + 1))

    expected, got = load_checkpoint(undisturbed / CHECKPOINT_NAME), load_checkpoint(run / CHECKPOINT_NAME)
    assert got.round == ROUNDS and set(got.tensors) == set(expected.tensors)
    data = load_dataset("digits")
    initial = global_state(build_model("fedavgcnn", data.input_shape, data.num_classes, seed=0), algorithm_for(FederationConfig()))
    relative = {name: float(np.linalg.norm(got.tensors[name] - value) / np.linalg.norm(value - initial[name].numpy()))
                for name, value in expected.tensors.items()}
    print(f"largest ‖killed - undisturbed‖ / ‖undisturbed - initial‖ over the tensors: {max(relative.values()):.3g}")
    assert max(relative.values()) <= AGREEMENT, relative
