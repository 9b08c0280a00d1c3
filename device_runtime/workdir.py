"""A device's working directory: what a restarted device needs, each file written atomically.

Workdir layout (everything a restarted device needs):

    artifacts/<hash>/    verified artifact sets, kept across runs (a rejoining device lists them and is
                         not sent them again)
    heads/<hash>-<round>.npz   the personal tensors (the head; for local training also the FE) trained under a
                         plan of the current run, by round
    state.json           run id, plan hash and the last task answered
    last_answer.bin      the encoded answer to that round, re-sent as is if the same task comes again
    previous_run/        heads/, state.json and last_answer.bin of the last run that committed a head, kept while
                         a newer run has committed none: a PLAN of that run (a server resuming it after the newer
                         one aborted) brings them back; the newer run's first committed training round drops them
    model -> models/...  the personalized model each answered round evaluated, as files an application loads
                         (device_runtime.model)

Every file is written to a temporary name and renamed, so a kill leaves the old version or the new one.
Order per task: train, save the head under the round's name, save the answer, save the state (the commit:
the round is answered), drop older heads, publish. A restarted device loads the newest head of a committed
round, so a kill before the commit trains the round again from the head it started from (the same answer,
given the same task), and a kill after it re-sends the saved answer when the task comes again.
"""
from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path

import numpy as np

from device_runtime.artifact_contract import ArtifactError, verify_artifacts
from device_runtime.atomic_file import TMP_PREFIX, write_atomic
from device_runtime.device_rules import DeviceState
from device_runtime.messages import NO_RUN, check_hash

LOG = logging.getLogger("fedara.device")
ARTIFACTS_DIR = "artifacts"
HEADS_DIR = "heads"
STATE_FILE = "state.json"
ANSWER_FILE = "last_answer.bin"
PREVIOUS_RUN_DIR = "previous_run"
HEAD_NAME = re.compile(r"([0-9a-f]{64})-(\d+)\.npz")


class Workdir:
    """The device's files (see the module docstring)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        for sub in (ARTIFACTS_DIR, HEADS_DIR):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def artifact_dir(self, plan_hash: str) -> Path:
        return self.root / ARTIFACTS_DIR / check_hash(plan_hash)

    def head_path(self, plan_hash: str, round_index: int) -> Path:
        """Where the head trained under ``plan_hash`` in round ``round_index`` is kept."""
        return self.root / HEADS_DIR / f"{check_hash(plan_hash)}-{round_index}.npz"

    def _head_rounds(self, plan_hash: str) -> list[int]:
        pattern = re.compile(rf"{re.escape(check_hash(plan_hash))}-(\d+)\.npz")
        return [int(m.group(1)) for f in (self.root / HEADS_DIR).iterdir() if (m := pattern.fullmatch(f.name))]

    def committed_head(self, plan_hash: str, answered_round: int) -> Path | None:
        """The plan's newest head from a round up to ``answered_round`` (a later one was never committed)."""
        rounds = [r for r in self._head_rounds(plan_hash) if r <= answered_round]
        return self.head_path(plan_hash, max(rounds)) if rounds else None

    def drop_heads_before(self, plan_hash: str, round_index: int) -> None:
        for r in self._head_rounds(plan_hash):
            if r < round_index:
                self.head_path(plan_hash, r).unlink(missing_ok=True)

    def held_artifacts(self) -> tuple[str, ...]:
        """Hashes of the artifact sets that verify; a set that fails is deleted (it will be sent again)."""
        held = []
        for directory in sorted((self.root / ARTIFACTS_DIR).iterdir()):
            if directory.name.startswith(TMP_PREFIX):
                shutil.rmtree(directory, ignore_errors=True)
                continue
            try:
                verify_artifacts(directory, directory.name)
            except ArtifactError as exc:
                LOG.warning("deleting cached artifacts %s: %s", directory.name[:12], exc)
                shutil.rmtree(directory, ignore_errors=True)
                continue
            held.append(directory.name)
        return tuple(held)

    def install_artifacts(self, plan_hash: str, files: dict[str, bytes]) -> Path:
        """Write received artifact files, verify them against ``plan_hash`` and move them into the cache.

        Raises ArtifactError (and keeps nothing) when they do not verify."""
        final = self.artifact_dir(plan_hash)
        tmp = self.root / ARTIFACTS_DIR / f"{TMP_PREFIX}{plan_hash[:12]}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            for name, data in files.items():
                (tmp / name).write_bytes(data)
            verify_artifacts(tmp, plan_hash)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    def load_state(self, folder: Path | None = None) -> DeviceState:
        """The state saved in ``folder`` (default: the workdir), NO_RUN when there is none or it is unreadable."""
        path = (folder or self.root) / STATE_FILE
        try:
            state = json.loads(path.read_text())
            return DeviceState(**dict(state, personal=tuple(state.get("personal", ()))))
        except FileNotFoundError:
            return DeviceState(NO_RUN)
        except (OSError, ValueError, TypeError) as exc:
            LOG.warning("ignoring unreadable %s: %s", path, exc)
            return DeviceState(NO_RUN)

    def save_state(self, state: DeviceState) -> None:
        write_atomic(self.root / STATE_FILE, json.dumps(asdict(state)).encode())

    def save_answer(self, payload: bytes) -> None:
        write_atomic(self.root / ANSWER_FILE, payload)

    def load_answer(self) -> bytes | None:
        try:
            return (self.root / ANSWER_FILE).read_bytes()
        except FileNotFoundError:
            return None

    def save_personal(self, path: Path, tensors: dict[str, np.ndarray]) -> None:
        buffer = io.BytesIO()
        np.savez(buffer, **tensors)
        write_atomic(path, buffer.getvalue())

    def forget_run(self) -> None:
        """Drop the heads and the saved answer of an earlier run (the artifact cache stays)."""
        for head in (self.root / HEADS_DIR).iterdir():
            head.unlink()
        (self.root / ANSWER_FILE).unlink(missing_ok=True)

    def switch_run(self, state: DeviceState, run_id: str) -> DeviceState:
        """Leave the run of ``state`` for ``run_id``; return the state to go on with.

        A run that committed a head is copied to previous_run/ (replacing it) before its files are dropped; one
        that committed none is dropped and previous_run/ stays. When previous_run/ holds ``run_id``, its files come
        back and so does its state. Every step leaves a workdir a restart handles: the copies are made before
        the originals go, and previous_run/ is dropped last."""
        previous = self.root / PREVIOUS_RUN_DIR
        if self._holds_committed_head(state.answered_round):
            staging = self.root / f"{TMP_PREFIX}{PREVIOUS_RUN_DIR}"
            shutil.rmtree(staging, ignore_errors=True)
            self._copy_run(self.root, staging, (ANSWER_FILE, STATE_FILE))
            shutil.rmtree(previous, ignore_errors=True)
            os.rename(staging, previous)
        self.forget_run()
        kept = self.load_state(previous)
        if kept.run_id != run_id:
            return DeviceState(run_id=run_id)
        self._copy_run(previous, self.root, (ANSWER_FILE,))
        self.save_state(kept)
        self.drop_previous_run()
        return kept

    def kept_run(self) -> str | None:
        """The run whose files previous_run/ holds, if any."""
        run_id = self.load_state(self.root / PREVIOUS_RUN_DIR).run_id
        return None if run_id == NO_RUN else run_id

    def drop_previous_run(self) -> None:
        """Forget the previous run's files (this run committed a trained head of its own)."""
        shutil.rmtree(self.root / PREVIOUS_RUN_DIR, ignore_errors=True)

    def _holds_committed_head(self, answered_round: int) -> bool:
        return any((m := HEAD_NAME.fullmatch(f.name)) and int(m.group(2)) <= answered_round
                   for f in (self.root / HEADS_DIR).iterdir())

    @staticmethod
    def _copy_run(source: Path, target: Path, names: tuple[str, ...]) -> None:
        """Copy a run's heads and the files ``names`` from ``source`` to ``target``, each file whole."""
        (target / HEADS_DIR).mkdir(parents=True, exist_ok=True)
        heads = [f.relative_to(source) for f in (source / HEADS_DIR).iterdir() if HEAD_NAME.fullmatch(f.name)]
        for name in [*heads, *names]:
            if (source / name).is_file():
                write_atomic(target / name, (source / name).read_bytes())
