"""Client shards on disk: a pickle-free .npz that loads back validated."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from device_runtime.shard import ZIP_MAGIC, Shard, ShardError, load_shard, save_shard
from tests.support.processes import child_env

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVER_ONLY = {"torch", "onnx", "scipy", "sklearn"}


def _arrays(num_train=6, num_test=2, num_classes=3):
    rng = np.random.default_rng(0)
    return {
        "x_train": rng.normal(size=(num_train, 1, 4, 4)).astype(np.float32),
        "y_train": np.arange(num_train, dtype=np.int64) % num_classes,
        "x_test": rng.normal(size=(num_test, 1, 4, 4)).astype(np.float32),
        "y_test": np.arange(num_test, dtype=np.int64) % num_classes,
        "num_classes": num_classes,
    }


def _write_raw(path, **overrides):
    arrays = {**_arrays(), **overrides}
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
    return path


def test_save_then_load_returns_identical_arrays(tmp_path):
    shard = Shard(**_arrays())
    save_shard(tmp_path / "client_000.npz", shard)
    loaded = load_shard(tmp_path / "client_000.npz")
    for key in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(loaded, key), getattr(shard, key))
        assert getattr(loaded, key).dtype == getattr(shard, key).dtype
    assert loaded.num_classes == 3
    assert loaded.input_shape == (1, 4, 4)


def test_save_writes_exactly_the_given_path(tmp_path):
    save_shard(tmp_path / "shard.bin", Shard(**_arrays()))
    assert [p.name for p in tmp_path.iterdir()] == ["shard.bin"]


def test_load_rejects_missing_key(tmp_path):
    path = _write_raw(tmp_path / "s.npz", y_test=None)
    with pytest.raises(ShardError, match="y_test"):
        load_shard(path)


def test_load_rejects_float64_images(tmp_path):
    path = _write_raw(tmp_path / "s.npz", x_train=np.zeros((6, 1, 4, 4)))
    with pytest.raises(ShardError, match="x_train must be float32"):
        load_shard(path)


def test_load_rejects_int32_labels(tmp_path):
    path = _write_raw(tmp_path / "s.npz", y_train=np.zeros(6, dtype=np.int32))
    with pytest.raises(ShardError, match="y_train must be int64"):
        load_shard(path)


def test_load_rejects_samples_that_are_scalars(tmp_path):
    path = _write_raw(tmp_path / "s.npz", x_test=np.zeros(2, dtype=np.float32), y_test=np.zeros(2, dtype=np.int64))
    with pytest.raises(ShardError, match="1 to 4 sample dims"):
        load_shard(path)


def test_load_rejects_a_test_split_of_another_sample_shape(tmp_path):
    path = _write_raw(tmp_path / "s.npz", x_test=np.zeros((2, 16), dtype=np.float32), y_test=np.zeros(2, np.int64))
    with pytest.raises(ShardError, match="both splits must share the sample shape"):
        load_shard(path)


@pytest.mark.parametrize("sample", [(7,), (3, 5), (2, 4, 4)])
def test_a_shard_of_1d_2d_and_3d_samples_round_trips(tmp_path, sample):
    rng = np.random.default_rng(0)
    shard = Shard(rng.normal(size=(6, *sample)).astype(np.float32), np.arange(6, dtype=np.int64) % 3,
                  rng.normal(size=(2, *sample)).astype(np.float32), np.zeros(2, np.int64), 3)
    save_shard(tmp_path / "s.npz", shard)
    loaded = load_shard(tmp_path / "s.npz")
    assert loaded.input_shape == sample and np.array_equal(loaded.x_train, shard.x_train)


def test_load_rejects_mismatched_sample_and_label_counts(tmp_path):
    path = _write_raw(tmp_path / "s.npz", y_train=np.zeros(5, dtype=np.int64))
    with pytest.raises(ShardError, match="6 samples but y_train has 5"):
        load_shard(path)


def test_load_rejects_label_outside_num_classes(tmp_path):
    path = _write_raw(tmp_path / "s.npz", y_test=np.array([0, 3], dtype=np.int64))
    with pytest.raises(ShardError, match=r"outside \[0, 3\)"):
        load_shard(path)


def test_load_rejects_pickled_object_array(tmp_path):
    path = _write_raw(tmp_path / "s.npz", x_train=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ShardError, match="pickle"):
        load_shard(path)


def test_load_rejects_a_file_that_is_not_npz(tmp_path):
    path = tmp_path / "s.npz"
    path.write_text("not an archive")
    with pytest.raises(ShardError, match=r"s\.npz is not a \.npz archive: it starts with b'not '"):
        load_shard(path)


def test_load_reports_a_shard_damaged_in_the_middle_as_corrupt(tmp_path):
    path = tmp_path / "s.npz"
    save_shard(path, Shard(**_arrays()))
    raw = bytearray(path.read_bytes())
    raw[raw.index(ZIP_MAGIC, 1) - 1] ^= 0xFF  # the last data byte of the first member (x_train.npy)
    path.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match=r"s\.npz is corrupt \(Bad CRC-32"):
        load_shard(path)


def test_load_reports_a_truncated_shard_as_corrupt(tmp_path):
    path = tmp_path / "s.npz"
    save_shard(path, Shard(**_arrays()))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ShardError, match=r"s\.npz is corrupt"):
        load_shard(path)


def test_construction_rejects_empty_training_split():
    arrays = _arrays()
    arrays["x_train"] = arrays["x_train"][:0]
    arrays["y_train"] = arrays["y_train"][:0]
    with pytest.raises(ShardError, match="no training samples"):
        Shard(**arrays)


def test_construction_rejects_splits_with_different_image_shapes():
    arrays = _arrays()
    arrays["x_test"] = np.zeros((2, 1, 5, 5), dtype=np.float32)
    with pytest.raises(ShardError, match="share the sample shape"):
        Shard(**arrays)


def test_construction_rejects_non_finite_images():
    arrays = _arrays()
    arrays["x_train"][0, 0, 0, 0] = np.nan
    with pytest.raises(ShardError, match="NaN"):
        Shard(**arrays)


def test_importing_shard_module_loads_no_server_side_library():
    code = "import sys, device_runtime.shard; print(sorted(set(sys.modules) & {SERVER_ONLY}))"
    result = subprocess.run(
        [sys.executable, "-c", code.replace("{SERVER_ONLY}", repr(SERVER_ONLY))],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_load_maps_the_images_in_place_and_reads_a_compressed_shard_whole(tmp_path):
    shard = Shard(**_arrays())
    save_shard(tmp_path / "stored.npz", shard)
    mapped = load_shard(tmp_path / "stored.npz")
    assert isinstance(mapped.x_train, np.memmap) and isinstance(mapped.x_test, np.memmap)
    assert not mapped.x_train.flags.writeable
    np.savez_compressed(tmp_path / "deflated.npz", **_arrays())
    read = load_shard(tmp_path / "deflated.npz")
    assert not isinstance(read.x_train, np.memmap)
    np.testing.assert_array_equal(read.x_train, mapped.x_train)


def _anon_rss_mib_after_loading(path: Path) -> float:
    """RssAnon (memory the kernel cannot drop) of a fresh process after it loads the shard and gathers a batch."""
    code = ("import sys, numpy as np; from device_runtime.shard import load_shard; s = load_shard(sys.argv[1]); "
            "batch = s.x_train[np.arange(0, len(s.x_train), 97)[:16]]; "
            "print(next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('RssAnon:')) / 1024)")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True,
                          cwd=REPO_ROOT, env=child_env(repo_on_path=True))
    return float(done.stdout)


def test_loading_a_large_shard_holds_no_copy_of_its_images(tmp_path):
    """96 MiB of images: the loaded process holds a few MiB of them, not 96 (they are mapped, read on demand)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((24 * 1024, 1, 32, 32), dtype=np.float32)
    save_shard(tmp_path / "big.npz", Shard(x, np.zeros(len(x), np.int64), x[:8], np.zeros(8, np.int64), 3))
    del x
    small = tmp_path / "small.npz"
    save_shard(small, Shard(**_arrays()))
    assert _anon_rss_mib_after_loading(tmp_path / "big.npz") < _anon_rss_mib_after_loading(small) + 16
