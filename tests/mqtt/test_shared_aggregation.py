"""Aggregation that scales out: ``server.broker_loop --aggregators N`` over Debian's mosquitto, routed by topic.

The engine names each device's member in its task; the device publishes its update, in chunks, on that member's
level of its update topic. The engine merges the members' float64 partial sums: the same sums grouped differently,
so the final global model equals the server-only run's to float32 rounding. Outsiders on the open broker that
subscribe to everything, plainly or through a shared subscription (``$share``, which took updates away from the
members when they shared one), only get copies: every update is still folded.
"""
from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from server import broker_loop
from server.outputs.checkpoint import CHECKPOINT_NAME, load_checkpoint
from server.outputs.report import METRICS_FILE, read_metrics
from tests.support.machine import missing_binary, require

QUICK = ["--dataset", "digits", "--max-samples", "600", "--local-epochs", "1", "--batch-size", "32", "--lr", "0.05",
         "--lam", "2", "--lam-warmup", "1", "--threads", "1", "--join-timeout", "300", "--round-deadline", "300"]
DEVICES, ROUNDS = 4, 2
TIERS = (1.0, 0.25)
PREFIX = "routed"
FRAME_BYTES = 8 << 10
"""The frame limit: below every update's size here (the smallest, at tier 0.25, is ~17 KiB), so each travels in
chunks."""
FOLDED = re.compile(r"(agg-\d+) folded (dev_\d+)'s update of round (\d+)")
MOSQUITTO_SUB = shutil.which("mosquitto_sub")


def federate(out: Path, cache: Path, broker: str, aggregators: int, *extra: str) -> Path:
    """A run of DEVICES device processes at two rank tiers (dense and factorized updates both folded), ROUNDS rounds
    unless ``extra`` says otherwise."""
    overrides = out.with_name(f"{out.name}-tiers.json")
    overrides.write_text(json.dumps({f"dev_{i:03d}": TIERS[i % len(TIERS)] for i in range(DEVICES)}))
    assert broker_loop.main([*QUICK, "--cache-dir", str(cache), "--out", str(out), "--broker", broker,
                             "--rounds", str(ROUNDS), "--local-devices", str(DEVICES), "--rank-overrides",
                             str(overrides), "--aggregators", str(aggregators), "--prefix", PREFIX,
                             "--max-message-bytes", str(FRAME_BYTES), *extra]) == 0
    return out


def folds(run: Path) -> list[tuple[str, str, int]]:
    """(aggregator, device, round) of every fold the aggregator processes logged."""
    logs = sorted((run / broker_loop.AGGREGATORS_DIR).glob("*.log"))
    return [(a, d, int(r)) for log in logs for a, d, r in FOLDED.findall(log.read_text())]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("artifacts")


@pytest.mark.slow
def test_chunked_updates_routed_to_two_members_fold_once_while_outsiders_subscribe_to_everything(
        start_mosquitto, tmp_path: Path, cache: Path):
    require(missing_binary("mosquitto_sub", "mosquitto-clients"))
    broker = start_mosquitto(max_frame_bytes=FRAME_BYTES)
    alone = federate(tmp_path / "alone", cache, broker.url, 0)
    outsiders = {name: tmp_path / f"{name}.topics" for name in ("plain", "shared")}
    filters = {"plain": f"{PREFIX}/#", "shared": f"$share/thieves/{PREFIX}/#"}
    subs = []
    for name, path in outsiders.items():
        with open(path, "wb") as out:
            subs.append(subprocess.Popen([MOSQUITTO_SUB, "-h", "127.0.0.1", "-p", str(broker.port), "-q", "1",
                                          "-t", filters[name], "-F", "%t"], stdout=out, stderr=subprocess.STDOUT))
    try:
        routed = federate(tmp_path / "routed", cache, broker.url, 2)
    finally:
        for sub in subs:
            sub.terminate()
            sub.wait()

    expected, got = load_checkpoint(alone / CHECKPOINT_NAME), load_checkpoint(routed / CHECKPOINT_NAME)
    assert got.round == ROUNDS and set(got.tensors) == set(expected.tensors)
    for name, value in expected.tensors.items():  # float32 rounding of round 1's sums, grown by round 2's training
        np.testing.assert_allclose(got.tensors[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    records = read_metrics(routed / METRICS_FILE)
    assert [r["participants"] for r in records] == [DEVICES] * ROUNDS
    assert [r["bytes_up"] for r in records] == [r["bytes_up"] for r in read_metrics(alone / METRICS_FILE)]
    assert min(records[0]["bytes_up"] // DEVICES, records[1]["bytes_up"] // DEVICES) > FRAME_BYTES

    folded = folds(routed)
    assert {a for a, _, _ in folded} == {"agg-0", "agg-1"}, f"an aggregator folded nothing: {folded}"
    assert sorted((d, r) for _, d, r in folded) == sorted(
        (f"dev_{i:03d}", r) for i in range(DEVICES) for r in range(1, ROUNDS + 1))
    for name, path in outsiders.items():  # each outsider got copies of the routed frames, chunks of every update
        update_frames = [t for t in path.read_text().split() if re.fullmatch(rf"{PREFIX}/dev/dev_\d+/update/agg-\d", t)]
        assert len(update_frames) > DEVICES * ROUNDS, (name, len(update_frames))


DP = ["--aggregate", "updates", "--join-ratio", "1", "--dp-noise-multiplier", "0.05", "--dp-clip", "0.5",
      "--dp-accountant", "rdp", "--dp-test-seed", "5"]
"""Every device sampled (E = 4); the test seed makes both runs draw the same noise."""


@pytest.mark.slow
def test_dp_through_two_members_gives_the_server_only_runs_model(start_mosquitto, tmp_path: Path, cache: Path):
    """Each member clips its devices' changes by the engine's rule (the brief carries C and the weights sent), the
    engine adds the noise once: the same model as without aggregators, to float32 rounding grown by round 2."""
    broker = start_mosquitto(max_frame_bytes=FRAME_BYTES)
    alone = federate(tmp_path / "alone", cache, broker.url, 0, *DP)
    routed = federate(tmp_path / "routed", cache, broker.url, 2, *DP)
    expected, got = load_checkpoint(alone / CHECKPOINT_NAME), load_checkpoint(routed / CHECKPOINT_NAME)
    for name, value in expected.tensors.items():
        np.testing.assert_allclose(got.tensors[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    records, reference = read_metrics(routed / METRICS_FILE), read_metrics(alone / METRICS_FILE)
    assert [r["epsilon"] for r in records] == [r["epsilon"] for r in reference] and records[-1]["epsilon"] > 0
    assert [r["participants"] for r in records] == [DEVICES] * ROUNDS
    clipped = [log.name for log in sorted((routed / broker_loop.AGGREGATORS_DIR).glob("*.log"))
               if "(DP clip 0.5)" in log.read_text()]
    assert clipped == ["agg-0.log", "agg-1.log"]  # both members applied the clip


def kill_member_mid_round_2(run: Path, victim: str, killed: list[str], stop: threading.Event) -> None:
    """SIGKILL aggregator ``victim`` once it folded a round-2 update (its share of the round is half done)."""
    log = run / broker_loop.AGGREGATORS_DIR / f"{victim}.log"
    while not stop.is_set():
        if log.exists() and "update of round 2" in log.read_text():
            for child in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if "server.aggregator" in child.cmdline() and victim in child.cmdline():
                        child.kill()
                        killed.append(victim)
                        return
        time.sleep(0.05)


@pytest.mark.slow
def test_a_member_killed_mid_round_loses_its_devices_to_the_other_and_no_update(start_mosquitto, tmp_path: Path,
                                                                                 cache: Path):
    """agg-0 takes dev_000, dev_001 and dev_003 (rendezvous hashing over agg-0 and agg-1). Killed after its first
    round-2 fold, it stops answering: after --aggregator-timeout the engine asks its devices again, naming agg-1, and
    the updates agg-0 was told to fold are awaited again. Every round still has every device."""
    broker = start_mosquitto(max_frame_bytes=FRAME_BYTES)
    run, killed, stop = tmp_path / "killed", [], threading.Event()
    killer = threading.Thread(target=kill_member_mid_round_2, args=(run, "agg-0", killed, stop), daemon=True)
    killer.start()
    try:
        federate(run, cache, broker.url, 2, "--rounds", "3", "--aggregator-timeout", "8")
    finally:
        stop.set()
        killer.join()
    assert killed == ["agg-0"]
    assert "aggregator agg-0 stopped answering" in (run / broker_loop.SERVER_LOG).read_text()
    records = read_metrics(run / METRICS_FILE)
    assert [(r["round"], r["participants"], r["dropped"]) for r in records] == [(r, DEVICES, {}) for r in (1, 2, 3)]
    survivor = {(d, r) for a, d, r in folds(run) if a == "agg-1"}
    assert {(d, 3) for d in ("dev_000", "dev_001", "dev_003")} <= survivor


@pytest.mark.parametrize("flags, named", [
    (["--aggregators", "2"], "--broker"),
    (["--aggregators", "2", "--broker", "mqtt://127.0.0.1:1", "--enroll", "open"], "--enroll FILE"),
    (["--aggregators", "-1", "--broker", "mqtt://127.0.0.1:1"], "--aggregators must be >= 0"),
    (["--broker", "mqtt://127.0.0.1:1,tcp://127.0.0.1:2"], "--broker: broker URL 'tcp://127.0.0.1:2'"),
])
def test_aggregators_without_what_they_need_exit_2_naming_the_flag(flags: list[str], named: str, capsys):
    assert broker_loop.main([*QUICK, "--local-devices", "2", *flags]) == 2
    assert named in capsys.readouterr().err
