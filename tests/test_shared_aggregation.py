"""Aggregation that scales out on the broker: ``server.broker_loop --aggregators N`` over Debian's mosquitto.

N aggregator processes share the devices' updates through ``$share/GROUP/PREFIX/dev/+/update``; the engine merges
their float64 partial sums. The sums are the same sums grouped differently, so the final global model equals the
server-only run's to float32 rounding, whatever member got which update.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from server import broker_loop
from server.checkpoint import CHECKPOINT_NAME, load_checkpoint
from server.report import METRICS_FILE, read_metrics

QUICK = ["--dataset", "digits", "--max-samples", "600", "--local-epochs", "1", "--batch-size", "32", "--lr", "0.05",
         "--lam", "2", "--lam-warmup", "1", "--threads", "1", "--join-timeout", "300", "--round-deadline", "300"]
DEVICES, ROUNDS = 4, 2
TIERS = (1.0, 0.25)
BROKER_LIMIT = 16 << 20
"""mosquitto's message size limit here: an update crosses a shared subscription as one PUBLISH, never chunked."""
FOLDED = re.compile(r"(agg-\d+) folded (dev_\d+)'s update of round (\d+)")


def federate(out: Path, cache: Path, broker: str, aggregators: int) -> Path:
    """A run of DEVICES device processes at two rank tiers (dense and factorized updates both folded)."""
    overrides = out.with_name(f"{out.name}-tiers.json")
    overrides.write_text(json.dumps({f"dev_{i:03d}": TIERS[i % len(TIERS)] for i in range(DEVICES)}))
    assert broker_loop.main([*QUICK, "--cache-dir", str(cache), "--out", str(out), "--broker", broker,
                             "--rounds", str(ROUNDS), "--local-devices", str(DEVICES), "--rank-overrides",
                             str(overrides), "--aggregators", str(aggregators)]) == 0
    return out


def folds(run: Path) -> list[tuple[str, str, int]]:
    """(aggregator, device, round) of every fold the aggregator processes logged."""
    logs = sorted((run / broker_loop.AGGREGATORS_DIR).glob("*.log"))
    return [(a, d, int(r)) for log in logs for a, d, r in FOLDED.findall(log.read_text())]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("artifacts")


@pytest.mark.slow
@pytest.mark.parametrize("aggregators", [2, 3])
def test_aggregators_sharing_the_updates_end_with_the_server_only_runs_model(start_mosquitto, tmp_path: Path,
                                                                               cache: Path, aggregators: int):
    broker = start_mosquitto(max_frame_bytes=BROKER_LIMIT)
    alone = federate(tmp_path / "alone", cache, broker.url, 0)
    shared = federate(tmp_path / "shared", cache, broker.url, aggregators)

    expected, got = load_checkpoint(alone / CHECKPOINT_NAME), load_checkpoint(shared / CHECKPOINT_NAME)
    assert got.round == ROUNDS and set(got.tensors) == set(expected.tensors)
    for name, value in expected.tensors.items():  # float32 rounding of round 1's sums, grown by round 2's training
        np.testing.assert_allclose(got.tensors[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    records = read_metrics(shared / METRICS_FILE)
    assert [r["participants"] for r in records] == [DEVICES] * ROUNDS
    assert [r["bytes_up"] for r in records] == [r["bytes_up"] for r in read_metrics(alone / METRICS_FILE)]
    assert set(records[0]["bytes_by_tier"]) == {"1", "0.25"}

    folded = folds(shared)
    members = {a for a, _, _ in folded}
    assert members == {f"agg-{i}" for i in range(aggregators)}, f"an aggregator folded nothing: {folded}"
    each_once = sorted((d, r) for _, d, r in folded)
    assert each_once == sorted((f"dev_{i:03d}", r) for i in range(DEVICES) for r in range(1, ROUNDS + 1))


@pytest.mark.parametrize("flags, named", [
    (["--aggregators", "2"], "--broker"),
    (["--aggregators", "2", "--broker", "mqtt://127.0.0.1:1", "--enroll", "open"], "--enroll FILE"),
    (["--aggregators", "-1", "--broker", "mqtt://127.0.0.1:1"], "--aggregators must be >= 0"),
])
def test_aggregators_without_what_they_need_exit_2_naming_the_flag(flags: list[str], named: str, capsys):
    assert broker_loop.main([*QUICK, "--local-devices", "2", *flags]) == 2
    assert named in capsys.readouterr().err
