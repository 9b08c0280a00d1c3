"""Round checkpoints: the global state after a completed round, written atomically, read without pickle.

A checkpoint is one ``.npz`` (tensors by name) holding a JSON ``__state__`` entry for everything else
(round, config, per-device bookkeeping). It is written to a temporary file, fsynced and renamed, so a
crash leaves either the previous checkpoint or the new one, never half of one.
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from device_runtime.atomic_file import write_atomic

STATE_KEY = "__state__"
CHECKPOINT_NAME = "checkpoint.npz"


class CheckpointError(ValueError):
    pass


def folder_taken(folder: str | Path, resume: bool) -> str | None:
    """Why ``folder`` (--out) cannot take a new run: it holds one (a checkpoint) and --resume was not given; None
    when it can; also when it is a file, not a folder. The drivers ask before anything heavy loads, and again when
    they set the run up."""
    if Path(folder).exists() and not Path(folder).is_dir():
        return f"--out {folder} is a file, not a folder: name a folder for the run (or leave --out out for a new one)"
    if resume or not (Path(folder) / CHECKPOINT_NAME).exists():
        return None
    return (f"--out {folder} holds a run ({CHECKPOINT_NAME}); pass --resume to continue it, or leave --out out to "
            "start a new run in a fresh folder")


@dataclass
class Checkpoint:
    round: int
    tensors: dict[str, np.ndarray]
    state: dict


def save_checkpoint(path: Path, checkpoint: Checkpoint) -> int:
    """Atomically write ``checkpoint`` to ``path``; returns the bytes written."""
    if STATE_KEY in checkpoint.tensors:
        raise CheckpointError(f"tensor name {STATE_KEY!r} is reserved")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = json.dumps(dict(checkpoint.state, round=checkpoint.round)).encode()
    buffer = io.BytesIO()
    np.savez(buffer, **{STATE_KEY: np.frombuffer(meta, dtype=np.uint8)}, **checkpoint.tensors)
    write_atomic(path, buffer.getvalue())
    return buffer.getbuffer().nbytes


def load_checkpoint(path: Path) -> Checkpoint:
    """Read a checkpoint written by :func:`save_checkpoint`; anything else raises CheckpointError."""
    try:
        with np.load(Path(path), allow_pickle=False) as data:
            if STATE_KEY not in data.files:
                raise CheckpointError(f"{path} is not a FedARA checkpoint (no {STATE_KEY})")
            state = json.loads(data[STATE_KEY].tobytes().decode())
            tensors = {k: data[k].copy() for k in data.files if k != STATE_KEY}
    except (OSError, ValueError, json.JSONDecodeError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    round_index = state.pop("round", None)
    if not isinstance(round_index, int):
        raise CheckpointError(f"checkpoint {path} has no round number")
    return Checkpoint(round_index, tensors, state)
