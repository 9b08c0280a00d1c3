"""A client's local data on disk: one .npz per client, readable with numpy alone.

The server writes shards; the device loads its own. The format is a plain
``np.savez`` archive (no pickled objects), so a shard can be read safely with
``allow_pickle=False`` and without torch.

``np.savez`` stores its members uncompressed, so :func:`load_shard` memory-maps the images
(``x_train``, ``x_test``) in place instead of reading them: a step gathers its batch from
the mapped file, and the kernel may drop clean pages under pressure, so a board's data may
be larger than its memory (half of Fashion-MNIST in one shard is 107 MB). A compressed
archive (``np.savez_compressed``) still loads, read whole.
"""

from __future__ import annotations

import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SHARD_KEYS = ("x_train", "y_train", "x_test", "y_test", "num_classes")
FEATURE_DTYPE = np.float32
LABEL_DTYPE = np.int64
SHARD_FILENAME = "client_{:03d}.npz"
ZIP_MAGIC = b"PK\x03\x04"
MAPPED_KEYS = ("x_train", "x_test")
MAX_SAMPLE_DIMS = 4
"""A sample has 1 to 4 dimensions: (C, H, W) images, (C, T) or (T, D) sequences, (D,) feature vectors."""
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, then file-name and extra-field lengths at offsets 26, 28
_CHECK_CHUNK_BYTES = 4 << 20  # the finiteness check reads this much at a time: no full-size temporary


class ShardError(ValueError):
    """A shard is malformed: missing keys, wrong dtypes or shapes, bad labels."""


@dataclass(frozen=True, eq=False)
class Shard:
    """One client's data: samples of any shape of 1 to 4 dimensions (float32: N×C×H×W images, N×C×T or N×T×D
    sequences, N×D feature vectors) and labels (int64), split train/test.

    Construction validates, so a Shard that exists is well formed.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    def __post_init__(self) -> None:
        _check_num_classes(self.num_classes)
        _check_split("train", self.x_train, self.y_train, self.num_classes)
        _check_split("test", self.x_test, self.y_test, self.num_classes)
        if len(self.x_train) == 0:
            raise ShardError("shard has no training samples")
        if self.x_train.shape[1:] != self.x_test.shape[1:]:
            raise ShardError(
                f"x_train samples are {self.x_train.shape[1:]} but x_test samples are "
                f"{self.x_test.shape[1:]}; both splits must share the sample shape"
            )

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Per-sample shape, e.g. (C, H, W)."""
        return tuple(self.x_train.shape[1:])


def _check_num_classes(num_classes: object) -> None:
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)):
        raise ShardError(f"num_classes must be an integer, got {type(num_classes).__name__}")
    if num_classes < 1:
        raise ShardError(f"num_classes must be at least 1, got {num_classes}")


def _check_split(split: str, x: object, y: object, num_classes: int) -> None:
    if not isinstance(x, np.ndarray) or not isinstance(y, np.ndarray):
        raise ShardError(f"x_{split} and y_{split} must be numpy arrays")
    if x.dtype != FEATURE_DTYPE:
        raise ShardError(f"x_{split} must be float32, got {x.dtype}")
    if y.dtype != LABEL_DTYPE:
        raise ShardError(f"y_{split} must be int64, got {y.dtype}")
    if not 2 <= x.ndim <= MAX_SAMPLE_DIMS + 1:
        raise ShardError(f"x_{split} must be (N, sample dims...) with 1 to {MAX_SAMPLE_DIMS} sample dims, e.g. "
                         f"(N, C, H, W), got shape {x.shape}")
    if y.ndim != 1:
        raise ShardError(f"y_{split} must be 1-D, got shape {y.shape}")
    if len(x) != len(y):
        raise ShardError(f"x_{split} has {len(x)} samples but y_{split} has {len(y)} labels")
    rows = max(1, _CHECK_CHUNK_BYTES // max(1, x[:1].nbytes))
    if not all(np.isfinite(x[start:start + rows]).all() for start in range(0, len(x), rows)):
        raise ShardError(f"x_{split} contains NaN or infinite values")
    if len(y) and (y.min() < 0 or y.max() >= num_classes):
        raise ShardError(
            f"y_{split} labels span [{y.min()}, {y.max()}], outside [0, {num_classes})"
        )


def save_shard(path: str | Path, shard: Shard) -> None:
    """Write ``shard`` to exactly ``path`` as an uncompressed, pickle-free .npz."""
    with open(path, "wb") as handle:
        np.savez(
            handle,
            x_train=shard.x_train,
            y_train=shard.y_train,
            x_test=shard.x_test,
            y_test=shard.y_test,
            num_classes=np.int64(shard.num_classes),
        )


def load_shard(path: str | Path) -> Shard:
    """Read and validate a shard written by ``save_shard``; raise ShardError naming the file and its problem.

    A file that is not a zip archive is refused by its first bytes (numpy would read a text file as a pickle and
    blame ``allow_pickle``); a damaged archive (truncated, bad CRC) is reported as corrupt, in one line.
    """
    with open(path, "rb") as handle:
        head = handle.read(len(ZIP_MAGIC))
    if head != ZIP_MAGIC:
        what = "is empty" if not head else f"starts with {head!r}"
        raise ShardError(f"{path} is not a .npz archive: it {what}, not a zip header (a shard is written by "
                         f"python -m server.shards)")
    try:
        with np.load(path, allow_pickle=False) as archive:
            missing = [key for key in SHARD_KEYS if key not in archive.files]
            if missing:
                raise ShardError(f"shard {path} lacks keys {missing}; expected {list(SHARD_KEYS)}")
            arrays = {key: _mapped(path, archive.zip, key) if key in MAPPED_KEYS else archive[key]
                      for key in SHARD_KEYS}
            arrays = {key: archive[key] if value is None else value for key, value in arrays.items()}
    except ShardError:
        raise
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as error:
        raise ShardError(f"shard {path} is corrupt ({error}); write it again") from error
    except ValueError as error:
        raise ShardError(f"shard {path} holds an array that is not a plain numpy array: {error}") from error
    num_classes = arrays.pop("num_classes")
    if num_classes.shape != () or not np.issubdtype(num_classes.dtype, np.integer):
        raise ShardError(
            f"num_classes in {path} must be an integer scalar, got "
            f"{num_classes.dtype} of shape {num_classes.shape}"
        )
    return Shard(num_classes=int(num_classes), **arrays)


def _mapped(path: str | Path, archive: zipfile.ZipFile, key: str) -> np.ndarray | None:
    """The member ``key`` of the .npz at ``path`` as a read-only memory map, or None where it cannot be mapped
    (compressed, an unknown .npy version, Fortran order, objects): the caller then reads it whole. Its CRC is
    checked by one streamed pass."""
    info = archive.getinfo(key + ".npy")
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    with open(path, "rb") as handle:
        handle.seek(info.header_offset)
        signature, name_length, extra_length = _LOCAL_HEADER.unpack(handle.read(_LOCAL_HEADER.size))
        if signature != ZIP_MAGIC:
            raise ShardError(f"shard {path} is corrupt (member {key} has no local header); write it again")
        member_start = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
        handle.seek(member_start)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                       (2, 0): np.lib.format.read_array_header_2_0}.get(np.lib.format.read_magic(handle))
        if read_header is None:
            return None
        shape, fortran_order, dtype = read_header(handle)
        offset = handle.tell()
    if fortran_order or dtype.hasobject:
        return None
    if (offset - member_start) + int(np.prod(shape)) * dtype.itemsize != info.file_size:
        raise ShardError(f"shard {path} is corrupt (member {key} is not the size its header says); write it again")
    with archive.open(info) as member:  # the CRC check, streamed: a damaged member is refused, as a read would be
        while member.read(_CHECK_CHUNK_BYTES):
            pass
    if not int(np.prod(shape)):
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)
