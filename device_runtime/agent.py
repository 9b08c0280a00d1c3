"""The device's event loop: join, install its plan's artifacts, answer every task, pick up after a restart.

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
import threading
import time
import uuid
from dataclasses import asdict
from pathlib import Path

import numpy as np

from device_runtime.artifact_contract import ArtifactError, artifact_files, verify_artifacts
from device_runtime.atomic_file import TMP_PREFIX, write_atomic
from device_runtime.broker_wait import wait_for_broker
from device_runtime.device_rules import (DeviceState, TaskAction, answered, on_task, starts_new_run,
                                         takes_initial_tensors)
from device_runtime.envelope import Message, MessageType, envelope_limit
from device_runtime.inbox import Screen
from device_runtime.link import Link, Refused
from device_runtime.local_round import load_weights, run_task
from device_runtime.messages import (NO_RUN, ErrorCode, Join, MessageError, ShardInfo, ack_message, check_hash,
                                     error_message, join_message, new_msg_id, parse_error, parse_plan, parse_task,
                                     update_message)
from device_runtime.model import DEFAULT_KEEP, ModelStore
from device_runtime.onnx_bake import GraphEditError
from device_runtime.profile import ResourceProfile
from device_runtime.runtimes import open_trainer
from device_runtime.shard import Shard
from device_runtime.task import Task, Update
from device_runtime.topics import Topics
from device_runtime.trainer import LocalTrainer
from device_runtime.transport import MqttEndpoint

LOG = logging.getLogger("fedara.device")
ARTIFACTS_DIR = "artifacts"
HEADS_DIR = "heads"
STATE_FILE = "state.json"
ANSWER_FILE = "last_answer.bin"
PREVIOUS_RUN_DIR = "previous_run"
HEAD_NAME = re.compile(r"([0-9a-f]{64})-(\d+)\.npz")
POLL_S = 0.2
PLAN_HEADROOM = 8
"""After a plan, the device takes messages up to this many times its plan's artifact files (plus a header): a
later run's plan may be denser (the smallest default tier, 0.125, stores about 1/8 of a dense layer)."""


def inbound_screen(link: Link, device_id: str, down_topic: str) -> Screen:
    """The screen of a device's inbox (device_runtime/inbox.py): only what its link would take now is queued, under
    its message type; the rest is dropped on arrival with the reason the agent would log, so a device that trains
    holds no junk and at most one message per type."""
    def screen(topic: str, payload: bytes) -> str | None:
        if topic != down_topic:
            return None
        try:
            return link.open(payload, NO_RUN, device_id=device_id, commit=False).type.value
        except Refused as exc:  # as text: the exception's context holds the payload, and a handler may keep records
            LOG.warning("dropped a message: %s", str(exc))
            return None
    return screen


class DeviceRefused(RuntimeError):
    """The server refused this device for the run (its shard does not fit the model, ...)."""


class Interrupted(BaseException):
    """Raised by the signal handler while the device computes, so a stop request does not wait for a round."""


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


class DeviceAgent:
    """One device: answers the server's PLAN, TASK and ERROR messages on its down topic."""

    def __init__(self, device_id: str, shard: Shard, profile: ResourceProfile, endpoint: MqttEndpoint,
                 workdir: Workdir, topics: Topics, link: Link, *, threads: int = 1, connect_timeout_s: float = 0.0,
                 keep_models: int = DEFAULT_KEEP):
        self.device_id = device_id
        self.shard = shard
        self.profile = profile
        self.endpoint = endpoint
        self.workdir = workdir
        self.topics = topics
        self.threads = threads
        self.link = link
        self.connect_timeout_s = connect_timeout_s  # 0: wait for the broker for ever
        self.state = workdir.load_state()
        self.trainer: LocalTrainer | None = None
        self.loaded_hash: str | None = None
        self.computing = False  # true while training or evaluating: a stop request may interrupt it
        self.models = ModelStore(workdir.root, keep_models)
        self.plan_tier: tuple[float, str] | None = None  # the loaded plan's (ratio, description), for model.json

    # -- lifecycle ----------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Connect, join and serve until ``stop`` is set. Raises BrokerRefusedError, BrokerUnreachableError or
        DeviceRefused."""
        self.endpoint.start()
        try:
            if not self._wait_connected(stop):
                return
            self.join()
            while not stop.is_set():
                item = self.endpoint.get(POLL_S)
                if item is not None:
                    self.handle(*item)
        finally:
            self._drop_trainer()
            self.endpoint.stop()

    def _wait_connected(self, stop: threading.Event) -> bool:
        return wait_for_broker(self.endpoint, stop, self.connect_timeout_s)

    def join(self) -> None:
        """Announce this device: its resource profile, what its shard holds, the artifact sets it caches.

        After a restart too, it serves tasks only once the server's PLAN answers (a task before that gets
        UNKNOWN_PLAN and a JOIN), so a device killed for memory never reloads the plan that killed it."""
        join = Join(self.profile, ShardInfo.of(self.shard), self.workdir.held_artifacts())
        self._send(join_message(join, device_id=self.device_id, run_id=self.state.run_id))
        LOG.info("joined with %d cached artifact set(s)", len(join.artifacts))

    def _send(self, msg: Message) -> None:
        self.endpoint.publish(self.topics.up, self.link.seal(msg), msg.msg_id)

    def _send_error(self, code: ErrorCode, detail: str, round_index: int = 0, run_id: str | None = None) -> None:
        LOG.warning("%s: %s", code.value, detail)
        self._send(error_message(code, detail, device_id=self.device_id, run_id=run_id or self.state.run_id,
                                 round_index=round_index))

    # -- messages -----------------------------------------------------------------------------

    def handle(self, topic: str, payload: bytes) -> None:
        """Act on one payload from the down topic; what cannot be understood is logged and dropped.

        Other topics are ignored: amqtt 0.12 also hands new subscribers retained messages of other topics."""
        if topic != self.topics.down:
            LOG.debug("ignored a message on %s", topic)
            return
        try:  # authenticated before anything else looks at it; a forged REFUSED is dropped here, not obeyed
            msg = self.link.open(payload, self.state.run_id, device_id=self.device_id)
        except Refused as exc:
            LOG.warning("dropped a message: %s", exc)
            return
        handlers = {MessageType.PLAN: self._on_plan, MessageType.TASK: self._on_task,
                    MessageType.ERROR: self._on_error}
        handler = handlers.get(msg.type)
        if handler is None:
            LOG.warning("dropped an unexpected %s message", msg.type.value)
            return
        try:
            handler(msg)
        except MessageError as exc:
            LOG.warning("dropped a malformed %s message: %s", msg.type.value, exc)

    def _on_plan(self, msg: Message) -> None:
        plan = parse_plan(msg)
        directory = self.workdir.artifact_dir(plan.plan_hash)
        try:
            if plan.files:
                self.workdir.install_artifacts(plan.plan_hash, plan.files)
                LOG.info("installed artifacts %s (%d bytes)", plan.plan_hash[:12],
                         sum(len(f) for f in plan.files.values()))
            else:
                verify_artifacts(directory, plan.plan_hash)
        except ArtifactError as exc:
            code = ErrorCode.ARTIFACTS_CORRUPT if plan.files else ErrorCode.ARTIFACTS_MISSING
            self._send_error(code, f"artifacts {plan.plan_hash}: {exc}", run_id=msg.run_id)
            return
        if starts_new_run(self.state, msg.run_id):
            # Only a verified plan of a new run may set this run's heads aside.
            was = self.state.run_id
            self._drop_trainer()
            self.state = self.workdir.switch_run(self.state, msg.run_id)
            if self.state.answered_round:
                LOG.info("run %s resumes (was %s): its heads are back, round %d answered", msg.run_id, was,
                         self.state.answered_round)
            else:
                kept = self.workdir.kept_run()
                LOG.info("run %s starts (was %s): fresh heads%s", msg.run_id, was, "" if kept is None else
                         f"; run {kept}'s stay in {PREVIOUS_RUN_DIR}/ until this run commits a trained round")
        if self.loaded_hash != plan.plan_hash:
            self._load_plan(plan.plan_hash)
        self._limit_inbound(plan.plan_hash)
        committed = self.workdir.committed_head(plan.plan_hash, self.state.answered_round) is not None
        if takes_initial_tensors(self.state, committed):
            try:
                load_weights(self.trainer, plan.init)  # nothing of this run held yet: start where the server says
            except ValueError as exc:
                self._send_error(ErrorCode.BAD_TASK, f"plan {plan.plan_hash[:12]}: initial tensors: {exc}",
                                 run_id=msg.run_id)
                return
            self.state.personal = tuple(sorted(plan.init))
        self.state.plan_hash = plan.plan_hash
        self.plan_tier = (plan.ratio, plan.description)
        self.workdir.save_state(self.state)
        LOG.info("plan %s: ratio %s (%s)", plan.plan_hash[:12], plan.ratio, plan.description)
        self._send(ack_message(plan.plan_hash, device_id=self.device_id, run_id=self.state.run_id))

    def _limit_inbound(self, plan_hash: str) -> None:
        """Take no message larger than this model needs (PLAN_HEADROOM times its artifact files)."""
        held = sum(f.stat().st_size for f in self.workdir.artifact_dir(plan_hash).iterdir() if f.is_file())
        self.endpoint.set_max_message_bytes(min(self.link.max_inbound, envelope_limit(PLAN_HEADROOM * held)))

    def _load_plan(self, plan_hash: str) -> None:
        self._drop_trainer()
        self.trainer = open_trainer(self.workdir.artifact_dir(plan_hash), threads=self.threads)
        self.loaded_hash = plan_hash
        head = self.workdir.committed_head(plan_hash, self.state.answered_round)
        if head is not None:
            try:
                with np.load(head, allow_pickle=False) as archive:
                    load_weights(self.trainer, {name: archive[name] for name in archive.files})
                LOG.info("restored the personal tensors of plan %s", plan_hash[:12])
            except (OSError, ValueError, KeyError) as exc:
                LOG.warning("head %s unusable (%s): starting from the initial head", head, exc)

    def _drop_trainer(self) -> None:
        self.trainer, self.loaded_hash = None, None

    def _on_task(self, msg: Message) -> None:
        plan_hash, task = parse_task(msg)
        action = on_task(self.state, self.loaded_hash, msg.run_id, plan_hash, task.round, task.evaluate_only,
                         self.workdir.load_answer() is not None)
        if action == TaskAction.UNKNOWN_PLAN:
            self._send_error(ErrorCode.UNKNOWN_PLAN, f"task for run {msg.run_id} plan {plan_hash[:12]}, I hold run "
                             f"{self.state.run_id} plan {(self.loaded_hash or 'none')[:12]}", task.round)
            self.join()
            return
        if action == TaskAction.STALE:
            LOG.warning("ignored a task for round %d: round %d is answered", task.round, self.state.answered_round)
            return
        if action == TaskAction.RESEND:
            LOG.info("round %d asked again: re-sending the saved answer", task.round)
            self.endpoint.publish(self.topics.update_via(task.aggregator),
                                  self.link.reseal(self.workdir.load_answer()),
                                  new_msg_id(MessageType.UPDATE))
            return
        kept = self._kept_by(task)
        try:
            update = self._compute(task)
        except ValueError as exc:  # tensors that do not fit the plan (TensorMismatchError) or unknown names
            self._send_error(ErrorCode.BAD_TASK, str(exc), task.round)
            return
        if not task.evaluate_only:
            held = {**self.trainer.get_fe(), **self.trainer.get_head()}
            self.workdir.save_personal(self.workdir.head_path(plan_hash, task.round),
                                       {k: held[k] for k in self.state.personal})
        payload = self.link.seal(update_message(update, plan_hash=plan_hash, device_id=self.device_id,
                                                run_id=self.state.run_id))
        self.workdir.save_answer(payload)
        self.state = answered(self.state, task.round, task.evaluate_only)
        self.workdir.save_state(self.state)
        if not task.evaluate_only:
            self.workdir.drop_heads_before(plan_hash, task.round)
            self.workdir.drop_previous_run()
        self._save_model(plan_hash, task.round, {**kept, **task.weights}, update.metrics)
        self.endpoint.publish(self.topics.update_via(task.aggregator), payload, new_msg_id(MessageType.UPDATE))

    def _kept_by(self, task: Task) -> dict[str, np.ndarray]:
        """Copies of the tensors the task's weights do not replace (the head, for FedARA): with the task's weights,
        the model the round evaluates."""
        received = set(task.weights)
        kept = {}
        for names, read in ((self.trainer.fe_names, self.trainer.get_fe), (self.trainer.head_names,
                                                                           self.trainer.get_head)):
            if not received.issuperset(names):
                kept |= read()
        return kept

    def _save_model(self, plan_hash: str, round_index: int, weights: dict, metrics: dict) -> None:
        """Write the model this round evaluated (``WORKDIR/model``); a failure is logged and costs only the file."""
        ratio, description = self.plan_tier or (None, "")
        try:
            eval_graph = self.trainer.directory / artifact_files(self.trainer.manifest)["eval_model"]
            written = self.models.write(eval_graph, weights, input_shape=self.trainer.input_shape,
                                        num_classes=self.trainer.num_classes, run_id=self.state.run_id,
                                        round_index=round_index, rank_tier=ratio, plan_hash=plan_hash,
                                        plan_description=description, correct=metrics["eval_correct"],
                                        total=metrics["eval_total"])
        except (OSError, GraphEditError) as exc:
            LOG.warning("round %d: the model file was not written: %s", round_index, exc)
            return
        LOG.info("round %d: model written to %s", round_index, written)

    def _compute(self, task: Task) -> Update:
        """Evaluate the received FE with this device's head, then train (unless the task is evaluation only)."""
        if task.deadline is not None and time.time() > task.deadline:
            LOG.warning("round %d: task arrived after its deadline; answering anyway", task.round)
        start = time.perf_counter()
        self.computing = True
        try:
            update = run_task(self.trainer, self.shard, task)
        finally:
            self.computing = False
        update.metrics["seconds"] = time.perf_counter() - start
        if task.evaluate_only:  # not sampled to train, or the run's final evaluation (its round is rounds + 1)
            LOG.info("evaluated the model of round %d (evaluation only) in %.2f s", task.round - 1,
                     update.metrics["seconds"])
        else:
            LOG.info("round %d: trained in %.2f s", task.round, update.metrics["seconds"])
        return update

    def _on_error(self, msg: Message) -> None:
        report = parse_error(msg)
        if report.code == ErrorCode.REJOIN:
            LOG.info("server asks to rejoin: %s", report.detail)
            self.join()
        elif report.code == ErrorCode.REFUSED:
            raise DeviceRefused(report.detail)
        else:
            LOG.warning("server error %s: %s", report.code.value, report.detail)
