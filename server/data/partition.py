"""Split a dataset among clients (Dirichlet or pathological label skew), PFLlib-style.

Pure, seeded functions on label arrays return index arrays; ``make_client_shards``
turns them into per-client Shards split 75/25 into train/test, and ``write_shards``
is the only part that touches the disk.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from device_runtime.shard import SHARD_FILENAME, Shard, save_shard
from server.data.datasets import LabeledData

PARTITIONS = ("dirichlet", "pathological")
MIN_SAMPLES = 40
MAX_DRAWS = 1000
TRAIN_FRACTION = 0.75


class PartitionError(ValueError):
    """A partition cannot be made with the requested settings."""


def _check_labels(labels: np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise PartitionError(
            f"labels must be a 1-D integer array, got {labels.dtype} of shape {labels.shape}"
        )
    return labels


def _check_sizes(num_samples: int, num_clients: int, min_samples: int) -> None:
    if num_clients < 1:
        raise PartitionError(f"num_clients must be at least 1, got {num_clients}")
    if min_samples < 0:
        raise PartitionError(f"min_samples must be non-negative, got {min_samples}")
    if num_clients * min_samples > num_samples:
        raise PartitionError(
            f"{num_clients} clients × {min_samples} samples each need "
            f"{num_clients * min_samples} samples, but the dataset has {num_samples}"
        )


def _dirichlet_draw(
    labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator
) -> list[list[np.ndarray]]:
    """One PFLlib draw: per class, Dirichlet(alpha) proportions over the clients that are
    still below an equal share; returns each client's index chunks."""
    fair_share = len(labels) / num_clients
    chunks: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    sizes = np.zeros(num_clients, dtype=np.int64)
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        open_clients = sizes < fair_share
        weights = rng.dirichlet(np.full(num_clients, alpha)) * open_clients
        if weights.sum() == 0:
            weights = open_clients.astype(float)
        cuts = (np.cumsum(weights / weights.sum()) * len(members)).astype(int)[:-1]
        for client, part in enumerate(np.split(members, cuts)):
            chunks[client].append(part)
            sizes[client] += len(part)
    return chunks


def dirichlet_partition(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    seed: int,
    min_samples: int = MIN_SAMPLES,
    *,
    max_draws: int = MAX_DRAWS,
) -> list[np.ndarray]:
    """Sorted sample indices per client, label proportions ~ Dirichlet(alpha) per class.

    Redraws (PFLlib convention) until every client holds at least ``min_samples``;
    raises PartitionError after ``max_draws`` failed draws. Every sample is assigned once.
    """
    labels = _check_labels(labels)
    if not alpha > 0:
        raise PartitionError(f"alpha must be positive, got {alpha}")
    _check_sizes(len(labels), num_clients, min_samples)
    rng = np.random.default_rng(seed)
    for _ in range(max_draws):
        chunks = _dirichlet_draw(labels, num_clients, alpha, rng)
        parts = [np.sort(np.concatenate(c)).astype(np.int64) for c in chunks]
        if min(len(p) for p in parts) >= min_samples:
            return parts
    raise PartitionError(
        f"no Dirichlet(alpha={alpha}) draw gave all {num_clients} clients at least "
        f"{min_samples} of {len(labels)} samples in {max_draws} draws; raise alpha, "
        f"lower min_samples or use fewer clients"
    )


def pathological_partition(
    labels: np.ndarray,
    num_clients: int,
    classes_per_client: int,
    seed: int,
    min_samples: int = MIN_SAMPLES,
) -> list[np.ndarray]:
    """Sorted sample indices per client; each client holds exactly ``classes_per_client`` classes.

    Classes are dealt round-robin over a seeded permutation (client k takes slots
    k·c .. k·c+c-1), so classes are shared as evenly as possible; each class's samples
    are shuffled and split evenly among the clients holding it.
    """
    labels = _check_labels(labels)
    classes = np.unique(labels)
    _check_sizes(len(labels), num_clients, min_samples)
    if not 1 <= classes_per_client <= len(classes):
        raise PartitionError(
            f"classes_per_client must be in [1, {len(classes)}] for {len(classes)} classes, "
            f"got {classes_per_client}"
        )
    if num_clients * classes_per_client < len(classes):
        raise PartitionError(
            f"{num_clients} clients × {classes_per_client} classes cover fewer than the "
            f"{len(classes)} classes, so some samples would belong to no client"
        )
    rng = np.random.default_rng(seed)
    order = rng.permutation(classes)
    slots = np.arange(num_clients * classes_per_client).reshape(num_clients, classes_per_client)
    held = order[slots % len(classes)]
    chunks: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for cls in classes:
        holders = np.flatnonzero((held == cls).any(axis=1))
        members = rng.permutation(np.flatnonzero(labels == cls))
        if len(members) < len(holders):
            raise PartitionError(
                f"class {cls} has {len(members)} samples for {len(holders)} clients holding it"
            )
        for client, part in zip(holders, np.array_split(members, len(holders))):
            chunks[client].append(part)
    parts = [np.sort(np.concatenate(c)).astype(np.int64) for c in chunks]
    smallest = min(len(p) for p in parts)
    if smallest < min_samples:
        raise PartitionError(
            f"a client holds only {smallest} samples (< min_samples={min_samples}); "
            f"use fewer clients or more classes per client"
        )
    return parts


def split_train_test(
    indices: np.ndarray, seed: int | Sequence[int], train_fraction: float = TRAIN_FRACTION
) -> tuple[np.ndarray, np.ndarray]:
    """Shuffle one client's indices and cut them into (train, test), round(fraction·n) train."""
    if not 0 < train_fraction < 1:
        raise PartitionError(f"train_fraction must be in (0, 1), got {train_fraction}")
    shuffled = np.random.default_rng(seed).permutation(np.asarray(indices))
    num_train = int(round(train_fraction * len(shuffled)))
    return shuffled[:num_train], shuffled[num_train:]


def partition_indices(
    labels: np.ndarray,
    partition: str,
    num_clients: int,
    seed: int,
    *,
    alpha: float,
    classes_per_client: int,
    min_samples: int,
) -> list[np.ndarray]:
    """Dispatch to the named partition (one of PARTITIONS)."""
    if partition == "dirichlet":
        return dirichlet_partition(labels, num_clients, alpha, seed, min_samples)
    if partition == "pathological":
        return pathological_partition(labels, num_clients, classes_per_client, seed, min_samples)
    raise PartitionError(f"unknown partition {partition!r}; choose one of {PARTITIONS}")


def make_client_shards(
    data: LabeledData,
    partition: str,
    num_clients: int,
    seed: int,
    alpha: float = 0.1,
    classes_per_client: int = 2,
    min_samples: int = MIN_SAMPLES,
) -> list[Shard]:
    """Partition ``data`` among clients and split each client's share 75/25 into train/test."""
    parts = partition_indices(
        data.y,
        partition,
        num_clients,
        seed,
        alpha=alpha,
        classes_per_client=classes_per_client,
        min_samples=min_samples,
    )
    shards = []
    for client, part in enumerate(parts):
        train, test = split_train_test(part, (seed, client))
        shards.append(
            Shard(
                x_train=data.x[train],
                y_train=data.y[train],
                x_test=data.x[test],
                y_test=data.y[test],
                num_classes=data.num_classes,
            )
        )
    return shards


def shard_key(shard: Shard) -> str:
    """A shard's content address: sha256 over its arrays (dtype, shape, bytes) and class count."""
    digest = hashlib.sha256(str(shard.num_classes).encode())
    for array in (shard.x_train, shard.y_train, shard.x_test, shard.y_test):
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def _cached(shard: Shard, cache: Path) -> Path:
    """The shard's file in ``cache``, named by its content (written once, atomically, the first time)."""
    path = cache / f"{shard_key(shard)}.npz"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        save_shard(partial, shard)
        os.replace(partial, path)
    return path


def write_shards(shards: Sequence[Shard], directory: str | Path, *, filename: str = SHARD_FILENAME,
                 cache: str | Path | None = None) -> list[Path]:
    """Write shard i to ``directory / filename.format(i)`` (client_000.npz, ...); return their paths.

    Shard files of the same name pattern left from an earlier, larger run are removed so the
    directory holds exactly this partition. With ``cache`` each shard is kept there once, named by its content
    (``shard_key``), and the directory gets a hard link to it (a copy across file systems): runs of the same data
    flags share one copy instead of writing megabytes each.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / filename.format(client) for client in range(len(shards))]
    written = set(paths)
    stale_pattern = _index_pattern(filename)
    for stale in directory.iterdir():
        if stale_pattern.fullmatch(stale.name) and stale not in written:
            stale.unlink()
    for path, shard in zip(paths, shards):
        if cache is None:
            save_shard(path, shard)
            continue
        source = _cached(shard, Path(cache))
        path.unlink(missing_ok=True)
        try:
            os.link(source, path)
        except OSError:  # another file system, or links not allowed there
            shutil.copyfile(source, path)
    return paths


def _index_pattern(filename: str) -> re.Pattern[str]:
    """The names ``filename.format(i)`` gives for any i >= 0, e.g. client_\\d+\\.npz for client_{:03d}.npz."""
    before, _, after = re.split(r"(\{[^}]*\})", filename, maxsplit=1)
    return re.compile(re.escape(before) + r"\d+" + re.escape(after))


def partition_summary(shards: Sequence[Shard]) -> dict:
    """JSON-ready per-client sample counts, overall and per class, for logs."""
    clients = []
    for client, shard in enumerate(shards):
        train_counts = np.bincount(shard.y_train, minlength=shard.num_classes)
        test_counts = np.bincount(shard.y_test, minlength=shard.num_classes)
        clients.append(
            {
                "client": client,
                "train": int(train_counts.sum()),
                "test": int(test_counts.sum()),
                "train_per_class": train_counts.tolist(),
                "test_per_class": test_counts.tolist(),
                "classes": int(np.count_nonzero(train_counts + test_counts)),
            }
        )
    return {
        "num_clients": len(shards),
        "num_classes": shards[0].num_classes if shards else 0,
        "clients": clients,
    }
