"""python -m server.shards: write the shard files that standalone devices train on.

    python -m server.shards --dataset fmnist --clients 5 --max-samples 6000 --out runs/shards
    python -m device_runtime --device-id dev_003 --data runs/shards/dev_003.npz ...

Each device gets ``dev_000.npz``, ``dev_001.npz``, ... (the ids ``server.broker_loop`` gives its local
devices), made exactly as the server makes them for ``--local-devices`` with the same data flags: the same
seeded subset (``--max-samples``), partition and 75/25 train/test split, so a run with standalone devices
can be compared with a local one.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from device_runtime.help_format import CommandParser, DefaultsHelpFormatter
from device_runtime.shard import Shard
from server.data import DATASETS, NPZ_PREFIX, dataset_arg
from server.data.datasets import DatasetFormatError, DatasetUnavailable, LabeledData, load_dataset
from server.data.partition import MIN_SAMPLES, PARTITIONS, PartitionError, make_client_shards, write_shards

DEVICE_ID = "dev_{:03d}"
"""A device's id from its index: the MQTT client id, topic level and username of device i."""
DEVICE_SHARD_FILENAME = DEVICE_ID + ".npz"
EXIT_BAD_INPUT = 2
NORMALIZATION_FILENAME = "normalization.npz"
"""Beside the shards of --dataset npz:PATH: the mean and std its samples were normalized with."""


def subset(data: LabeledData, max_samples: int | None, seed: int) -> LabeledData:
    """A seeded, order-preserving subset of ``max_samples`` samples (all of them when None or larger)."""
    if not max_samples or max_samples >= len(data.y):
        return data
    keep = np.sort(np.random.default_rng(seed).choice(len(data.y), max_samples, replace=False))
    return LabeledData(data.x[keep], data.y[keep], data.num_classes, data.name, data.normalization)


def data_from_args(args: argparse.Namespace) -> LabeledData:
    """The seeded subset (``--max-samples``) of ``--dataset`` that every driver partitions."""
    return subset(load_dataset(args.dataset, args.data_dir, seed=args.seed), args.max_samples, args.seed)


def partition_from_args(data: LabeledData, args: argparse.Namespace, clients: int) -> list[Shard]:
    """``data`` among ``clients`` by the partition flags, named as in server.simulate and server.broker_loop."""
    return make_client_shards(data, args.partition, clients, args.seed, alpha=args.alpha,
                              classes_per_client=args.classes_per_client, min_samples=args.min_samples)


def describe(path: Path, shard: Shard) -> str:
    """One line for the operator: the file, its sample counts and the classes it holds."""
    labels = np.concatenate([shard.y_train, shard.y_test])
    classes = np.flatnonzero(np.bincount(labels, minlength=shard.num_classes))
    return (f"wrote {path}: {len(shard.y_train)} train + {len(shard.y_test)} test samples, "
            f"{len(classes)} of {shard.num_classes} classes ({', '.join(map(str, classes))})")


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="python -m server.shards", description=__doc__.splitlines()[0],
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--dataset", type=dataset_arg, default="fmnist", metavar="NAME",
                   help=f"one of {', '.join(DATASETS)}, or {NPZ_PREFIX}PATH (your own arrays); read from local files, "
                        "never downloaded")
    p.add_argument("--data-dir", default=None, help="dataset folder (default: the dataset's standard place)")
    p.add_argument("--partition", choices=PARTITIONS, default="dirichlet", help="how labels are spread over devices")
    p.add_argument("--alpha", type=float, default=0.1, help="Dirichlet concentration (smaller: more skewed)")
    p.add_argument("--classes-per-client", type=int, default=2, help="classes per device (pathological partition)")
    p.add_argument("--min-samples", type=int, default=MIN_SAMPLES,
                   help="redraw the partition until every device has this many samples")
    p.add_argument("--max-samples", type=int, default=None,
                   help="use a seeded subset of this many samples (default: all); the server's --max-samples")
    p.add_argument("--clients", type=int, default=20, help="how many devices (dev_000 ...)")
    p.add_argument("--seed", type=int, default=0, help="the server's --seed")
    p.add_argument("--out", required=True, type=Path, help="folder for dev_NNN.npz")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first flag whose value cannot make shards."""
    if args.clients < 1:
        raise ValueError(f"--clients must be >= 1, got {args.clients}")
    if not args.alpha > 0:
        raise ValueError(f"--alpha must be positive, got {args.alpha}")
    if args.classes_per_client < 1:
        raise ValueError(f"--classes-per-client must be >= 1, got {args.classes_per_client}")
    if args.min_samples < 0:
        raise ValueError(f"--min-samples must be >= 0, got {args.min_samples}")
    if args.max_samples is not None and args.max_samples < 1:
        raise ValueError(f"--max-samples must be >= 1, got {args.max_samples}")
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} exists and is not a folder")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        data = data_from_args(args)
        shards = partition_from_args(data, args, args.clients)
    except PartitionError as exc:
        print(f"error: --partition {args.partition} of --dataset {args.dataset} (--max-samples {args.max_samples}) "
              f"among --clients {args.clients} (--min-samples {args.min_samples}): {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (DatasetUnavailable, DatasetFormatError) as exc:
        print(f"error: --dataset {args.dataset} (--data-dir {args.data_dir}): {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        paths = write_shards(shards, args.out, filename=DEVICE_SHARD_FILENAME)
    except OSError as exc:
        print(f"error: --out {args.out}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for path, shard in zip(paths, shards):
        print(describe(path, shard))
    if data.normalization is not None:  # a device holding raw samples of its own normalizes them the same way
        mean, std = data.normalization
        np.savez(args.out / NORMALIZATION_FILENAME, mean=mean, std=std)
        print(f"wrote {args.out / NORMALIZATION_FILENAME}: the mean and std the shards were normalized with "
              "((x - mean) / std, per sample)")
    return 0
