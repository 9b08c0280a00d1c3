"""python -m server.shards: the shards a standalone device needs, equal to the server's own for local devices."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from device_runtime.shard import load_shard
from server import broker_loop
from server.run_setup import load_shards

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA_FLAGS = ["--dataset", "digits", "--max-samples", "600", "--alpha", "0.5", "--min-samples", "30", "--seed", "3"]
CLIENTS = 3
TIMEOUT_S = 120


def run_shards(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.shards", *flags], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=TIMEOUT_S)


def test_shards_equal_what_the_server_makes_for_its_local_devices(tmp_path: Path):
    done = run_shards(*DATA_FLAGS, "--clients", str(CLIENTS), "--out", str(tmp_path / "shards"))
    assert done.returncode == 0, done.stderr
    args = broker_loop.build_parser().parse_args([*DATA_FLAGS, "--local-devices", str(CLIENTS),
                                                  "--out", str(tmp_path / "run")])
    _, _, expected = load_shards(args, CLIENTS)
    for device_id, shard in expected.items():
        written = load_shard(tmp_path / "shards" / f"{device_id}.npz")
        for key in ("x_train", "y_train", "x_test", "y_test"):
            np.testing.assert_array_equal(getattr(written, key), getattr(shard, key))


def test_shards_prints_one_line_per_file_with_samples_and_classes(tmp_path: Path):
    done = run_shards(*DATA_FLAGS, "--clients", str(CLIENTS), "--out", str(tmp_path))
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"wrote {tmp_path / f'dev_00{i}.npz'}" for i in range(CLIENTS)]
    shard = load_shard(tmp_path / "dev_000.npz")
    assert f"{len(shard.y_train)} train + {len(shard.y_test)} test samples" in lines[0]
    assert "of 10 classes" in lines[0]


def test_shards_refuses_zero_clients_naming_the_flag(tmp_path: Path):
    done = run_shards(*DATA_FLAGS, "--clients", "0", "--out", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip() == "error: --clients must be >= 1, got 0"


def test_shards_names_the_data_dir_that_holds_no_dataset(tmp_path: Path):
    done = run_shards("--dataset", "fmnist", "--data-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path))
    assert done.returncode == 2
    assert f"--data-dir {tmp_path / 'nowhere'}" in done.stderr and "Traceback" not in done.stderr


def test_shards_explains_a_partition_that_cannot_be_made(tmp_path: Path):
    done = run_shards(*DATA_FLAGS, "--clients", "30", "--min-samples", "40", "--out", str(tmp_path))
    assert done.returncode == 2
    assert "--clients 30" in done.stderr and "--min-samples 40" in done.stderr and "Traceback" not in done.stderr
