"""The device's event loop: join, install its plan's artifacts, answer every task, pick up after a restart.

The workdir it keeps (what a restarted device needs) is ``device_runtime.workdir``'s.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from device_runtime.answer_receipt import AnswerReceipt, Reask
from device_runtime.auth import counter_epoch
from device_runtime.artifact_contract import ArtifactError, artifact_files, verify_artifacts
from device_runtime.device_admission import DeviceAdmission
from device_runtime.broker_wait import wait_for_broker
from device_runtime.device_rules import (TaskAction, answered, on_task, starts_new_run,
                                         takes_initial_tensors)
from device_runtime.envelope import Message, MessageType, envelope_limit
from device_runtime.inbox import Screen
from device_runtime.link import Link, Refused
from device_runtime.local_round import load_weights, run_task
from device_runtime.messages import (NO_RUN, ErrorCode, Join, MessageError, ShardInfo, ack_message,
                                     error_message, join_message, new_msg_id, parse_error, parse_plan, parse_task,
                                     payload_request_message, task_payload, update_message)
from device_runtime.model import DEFAULT_KEEP, ModelStore
from device_runtime.onnx_bake import GraphEditError
from device_runtime.payload import PayloadRef, decode_payload
from device_runtime.payload_wait import PayloadWait
from device_runtime.profile import ResourceProfile
from device_runtime.runtimes import open_trainer
from device_runtime.secagg_client import SecAggClient, SecAggRefusal, secure_answer
from device_runtime.secagg_noise import secure_generator
from device_runtime import secagg_wire
from device_runtime.shard import Shard
from device_runtime.task import Task, Update, non_finite
from device_runtime.protocol import ProtocolError
from device_runtime.topics import Topics, payload_filter, payload_topic
from device_runtime.trainer import LocalTrainer
from device_runtime.transport import MqttEndpoint
from device_runtime.workdir import PREVIOUS_RUN_DIR, Workdir

LOG = logging.getLogger("fedara.device")
POLL_S = 0.2
PLAN_HEADROOM = 8
"""After a plan, the device takes messages up to this many times its plan's artifact files (plus a header): a
later run's plan may be denser (the smallest default tier, 0.125, stores about 1/8 of a dense layer)."""


def inbound_screen(link: Link, device_id: str, down_topic: str, payloads: str | None = None,
                   admission: DeviceAdmission | None = None) -> Screen:
    """The screen of a device's inbox (device_runtime/inbox.py): only what its link would take now is queued, under
    its message type; the rest is dropped on arrival with the reason the agent would log, so a device that trains
    holds no junk and at most one message per type. A payload (on a topic under ``payloads``, the prefix's payload
    level) is queued under its topic when ``admission`` says it is the awaited one (its size and SHA-256: junk that
    completes after the genuine payload cannot replace it); the agent checks it against its TASK again. A receipt
    (``ErrorCode.RECEIVED``) is queued under a kind of its own."""
    def screen(topic: str, payload: bytes) -> str | None:
        if payloads is not None and topic.startswith(payloads):
            if admission is None or admission.takes_payload(topic, payload):
                return topic
            LOG.warning("dropped a payload of %d bytes on %s: not the size and SHA-256 the task names [bad_hash]",
                        len(payload), topic)
            return None
        if topic != down_topic:
            return None
        try:
            msg = link.open(payload, NO_RUN, device_id=device_id, commit=False)
        except Refused as exc:  # as text: the exception's context holds the payload, and a handler may keep records
            LOG.warning("dropped a message: %s", str(exc))
            return None
        if msg.type == MessageType.SECAGG:  # one queued per exchange: a secure round's steps come one by one
            return f"{msg.type.value}.{msg.meta.get('phase') if msg.meta.get('phase') in secagg_wire.PHASES else ''}"
        # a receipt is queued apart: it must not supersede a REJOIN or REFUSED (nor they it)
        return ErrorCode.RECEIVED.value if msg.meta.get("code") == ErrorCode.RECEIVED.value else msg.type.value
    return screen


class DeviceRefused(RuntimeError):
    """The server refused this device for the run (its shard does not fit the model, ...)."""


class Interrupted(BaseException):
    """Raised by the signal handler while the device computes, so a stop request does not wait for a round."""


@dataclass
class SecureTask:
    """A secure round this device takes part in: its plan, its task (trained once its neighbours' shares came) and
    the round's SecAgg+ client (its keys, seed and the shares it holds for its neighbours)."""

    plan_hash: str
    task: Task
    client: SecAggClient


class DeviceAgent:
    """One device: answers the server's PLAN, TASK and ERROR messages on its down topic, and in a secure round its
    SECAGG messages (SecAgg+'s exchanges: ``_start_secure``, ``_on_secagg``)."""

    def __init__(self, device_id: str, shard: Shard, profile: ResourceProfile, endpoint: MqttEndpoint,
                 workdir: Workdir, topics: Topics, link: Link, *, threads: int = 1, connect_timeout_s: float = 0.0,
                 keep_models: int = DEFAULT_KEEP, admission: DeviceAdmission | None = None):
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
        self.payload: tuple[PayloadRef, dict[str, np.ndarray]] | None = None  # the last payload fetched, checked
        self.waiting: PayloadWait | None = None  # a TASK whose payload is being fetched
        self.admission = admission  # the endpoint's: told which payload's frames to take (device_admission.py)
        self.secure: SecureTask | None = None  # the secure round under way (device_runtime/secagg_wire.py)
        self.answer: AnswerReceipt | None = None  # the last answer this process sent, and whether its receipt came
        self.server_start: int | None = None  # the epoch of the last down message taken: the server process serving
        self.reask_via: str | None = None  # the aggregator of a re-ask held for that receipt

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
                self.tend_payload(time.monotonic())
                self.tend_answer(time.monotonic())
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
            if self.waiting is not None and topic == self._payload_topic(self.waiting):
                self._on_payload(payload)
            else:
                LOG.debug("ignored a message on %s", topic)
            return
        try:  # authenticated before anything else looks at it; a forged REFUSED is dropped here, not obeyed
            msg = self.link.open(payload, self.state.run_id, device_id=self.device_id)
        except Refused as exc:
            LOG.warning("dropped a message: %s", exc)
            return
        self.server_start = counter_epoch(msg.counter)
        handlers = {MessageType.PLAN: self._on_plan, MessageType.TASK: self._on_task,
                    MessageType.ERROR: self._on_error, MessageType.SECAGG: self._on_secagg}
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
            self._reask(task)
            return
        ref = task_payload(msg)
        if ref is not None:
            weights = self._payload_for(ref, msg)
            if weights is None:
                return  # fetching it: the task runs when it is whole (_on_payload)
            task.weights = weights
        if task.secure is not None and not task.evaluate_only:
            self._start_secure(plan_hash, task, msg.run_id)
            return
        self._answer(plan_hash, task)

    def _answer(self, plan_hash: str, task: Task, secure: SecureTask | None = None,
                shares: dict[str, bytes] | None = None) -> None:
        """Run the task and send its answer (committed first: saved answer, state, head, model). In a secure round
        its change goes masked (``secure``'s client, the neighbours' ``shares``) and the UPDATE carries no tensor."""
        kept = self._kept_by(task)
        try:
            update = self._compute(task)
        except ValueError as exc:  # tensors that do not fit the plan (TensorMismatchError) or unknown names
            self._send_error(ErrorCode.BAD_TASK, str(exc), task.round)
            return
        problem = non_finite(update)
        if problem is not None:  # diverged: the wire cannot carry it; keep the head it had, answer nothing
            load_weights(self.trainer, kept)
            self._send_error(ErrorCode.NON_FINITE, f"round {task.round}: {problem}: no update sent", task.round)
            return
        masked = None
        if secure is not None:
            answer, x = secure_answer(update, task, secure_generator())
            try:
                masked = secure.client.masked_input(x, shares)
            except SecAggRefusal as exc:
                load_weights(self.trainer, kept)
                LOG.warning("round %d: secure aggregation: %s: no update sent", task.round, exc)
                self.secure = None
                return
            update = answer
        if not task.evaluate_only:
            held = {**self.trainer.get_fe(), **self.trainer.get_head()}
            self.workdir.save_personal(self.workdir.head_path(plan_hash, task.round),
                                       {k: held[k] for k in self.state.personal})
        message = update_message(update, plan_hash=plan_hash, device_id=self.device_id, run_id=self.state.run_id)
        if masked is not None:
            message.blobs[secagg_wire.MASKED_BLOB] = secagg_wire.masked_blob(masked, task.secure.quantizer.bits)
        payload = self.link.seal(message)
        self.workdir.save_answer(payload)
        self.state = answered(self.state, task.round, task.evaluate_only)
        self.workdir.save_state(self.state)
        if not task.evaluate_only:
            self.workdir.drop_heads_before(plan_hash, task.round)
            self.workdir.drop_previous_run()
        self._save_model(plan_hash, task, {**kept, **task.weights}, update.metrics)
        self.endpoint.publish(self.topics.update_via(task.aggregator), payload, new_msg_id(MessageType.UPDATE))
        self.answer = AnswerReceipt(task.round, time.monotonic(), self.server_start)

    # -- a re-asked round and the receipt of its answer (device_runtime/answer_receipt.py) ------------------------

    def _reask(self, task: Task) -> None:
        """The round it answered is asked again: the saved answer goes again, unless the server process that asks
        sent its receipt (or may send it: the re-ask crossed the answer, then it waits for the receipt)."""
        answer = self.answer
        verdict = (Reask.SEND if answer is None or answer.round != task.round
                   else answer.reask(time.monotonic(), self.server_start))
        if verdict == Reask.RECEIVED:
            LOG.info("round %d asked again: its answer's receipt came, so it is not sent again", task.round)
        elif verdict == Reask.HOLD:
            self.reask_via = task.aggregator
            LOG.info("round %d asked again %.1f s after its answer: waiting for the answer's receipt", task.round,
                     time.monotonic() - answer.sent_at)
        else:
            self._resend_answer(task.round, task.aggregator)

    def _resend_answer(self, round_index: int, aggregator: str | None) -> None:
        """The saved answer goes again, now the answer to the server process serving this device (whose receipt,
        and only whose, will count)."""
        LOG.info("round %d asked again: re-sending the saved answer", round_index)
        self.endpoint.publish(self.topics.update_via(aggregator), self.link.reseal(self.workdir.load_answer()),
                              new_msg_id(MessageType.UPDATE))
        self.answer = AnswerReceipt(round_index, time.monotonic(), self.server_start)

    def tend_answer(self, now: float) -> None:
        """Re-send the saved answer of a held re-ask whose receipt did not come in time."""
        if self.answer is not None and self.answer.due(now):
            self._resend_answer(self.answer.round, self.reask_via)

    # -- secure aggregation (device_runtime/secagg_wire.py) ---------------------------------------------------

    def _start_secure(self, plan_hash: str, task: Task, run_id: str) -> None:
        """A secure round's task: advertise this round's fresh keys; the task trains once the neighbours' shares
        came (``_on_secagg``). A task of the round under way again (re-sent) changes nothing."""
        if self.secure is not None and (self.secure.task.round, self.secure.client.spec.context) == (
                task.round, task.secure.context):
            LOG.info("round %d: secure round under way (%s): the task again changes nothing", task.round,
                     self.secure.client.step)
            return
        client = SecAggClient(self.device_id, task.secure)
        self.secure = SecureTask(plan_hash, task, client)
        self._send(secagg_wire.keys_message(client.advertise(), device_id=self.device_id, run_id=run_id,
                                            round_index=task.round))
        LOG.info("round %d: secure aggregation: keys advertised (%d participants, %d neighbours, t = %d)",
                 task.round, len(task.secure.participants), len(client.mine), task.secure.threshold)

    def _on_secagg(self, msg: Message) -> None:
        """One SecAgg+ exchange from the server, for the secure round under way; anything else is refused with its
        reason and reveals nothing."""
        secure = self.secure
        phase = secagg_wire.phase_of(msg)
        if secure is None or msg.round != secure.task.round or msg.run_id != self.state.run_id:
            LOG.warning("refused a secagg %s message for round %d: no secure round of it under way", phase, msg.round)
            return
        client, round_index = secure.client, msg.round
        try:
            if phase == secagg_wire.KEYS:
                sealed = client.share_keys(secagg_wire.parse_neighbour_keys(msg, client.mine))
                self._send(secagg_wire.shares_message(sealed, device_id=self.device_id, run_id=msg.run_id,
                                                      round_index=round_index))
                LOG.info("round %d: secure aggregation: shares sent to %d neighbour(s)", round_index, len(sealed))
            elif phase == secagg_wire.SHARES:
                shares = secagg_wire.parse_shares(msg, client.mine)
                LOG.info("round %d: secure aggregation: %d neighbour(s) shared; training", round_index, len(shares))
                self._answer(secure.plan_hash, secure.task, secure, shares)
            else:
                reveals = client.unmask(secagg_wire.parse_survivors(msg, client.spec.participants))
                self._send(secagg_wire.unmasking_message(reveals, device_id=self.device_id, run_id=msg.run_id,
                                                         round_index=round_index))
                LOG.info("round %d: secure aggregation: %d unmasking share(s) sent", round_index, len(reveals))
                self.secure = None
        except SecAggRefusal as exc:
            LOG.warning("refused a secagg %s message for round %d: %s", phase, round_index, exc)

    # -- the plan's payload (device_runtime/payload.py) ---------------------------------------------------------

    def _payload_for(self, ref: PayloadRef, msg: Message) -> dict[str, np.ndarray] | None:
        """The payload ``ref``'s tensors if this device holds them; else start fetching it for the TASK ``msg``."""
        if self.payload is not None and self.payload[0] == ref:
            return self.payload[1]
        if self.waiting is not None and self.waiting.ref == ref:
            self.waiting.task = msg  # the newest TASK runs (a re-sent one, or one naming another aggregator)
            return None
        self._stop_waiting()
        self.waiting = PayloadWait(ref, msg, time.monotonic())
        if self.admission is not None:  # before the subscription: its frames are taken from the first one
            self.admission.await_payload(self._payload_topic(self.waiting), ref)
        self.endpoint.follow(self._payload_filter(self.waiting))  # the retained copy comes on subscribe
        LOG.info("round %d: fetching payload %s (%d bytes)", msg.round, ref.sha256[:12], ref.nbytes)
        return None

    def _on_payload(self, data: bytes) -> None:
        """A payload on the awaited payload's topic: run the waiting TASK with it if its size and SHA-256 are the
        ones that TASK names; else refuse it, saying why, and ask the server again (see PayloadWait)."""
        wait = self.waiting
        try:
            tensors = decode_payload(data, wait.ref)
        except ProtocolError as exc:
            LOG.warning("refused a payload for round %d: %s", wait.task.round, exc)
            wait.refused = True
            self.tend_payload(time.monotonic())
            return
        LOG.info("round %d: payload %s fetched (%d bytes)", wait.task.round, wait.ref.sha256[:12], len(data))
        self.payload = (wait.ref, tensors)
        self._stop_waiting()
        try:
            self._on_task(wait.task)
        except MessageError as exc:
            LOG.warning("dropped a malformed task message: %s", exc)

    def tend_payload(self, now: float) -> None:
        """Ask the server for the awaited payload again when it is due (PayloadWait: only while the broker grants
        the subscription to its topic), and subscribe again: the broker then sends its retained copy once more."""
        wait = self.waiting
        if wait is None:
            return
        refused = wait.refused
        if not wait.ask_now(now, self.endpoint.granted_at(self._payload_filter(wait))):
            return
        detail = (f"a payload that did not match {wait.ref.sha256[:12]} came" if refused
                  else f"payload {wait.ref.sha256[:12]} not whole after {now - wait.since:.0f} s")
        self._send(payload_request_message(wait.ref, detail, device_id=self.device_id, run_id=self.state.run_id,
                                           round_index=wait.task.round))
        self.endpoint.follow(self._payload_filter(wait))

    def _payload_topic(self, wait: PayloadWait) -> str:
        """The topic of the payload ``wait`` fetches: its TASK's run and the payload's hash."""
        return payload_topic(self.topics.prefix, wait.task.run_id, wait.ref.sha256)

    def _payload_filter(self, wait: PayloadWait) -> str:
        return payload_filter(self.topics.prefix, wait.task.run_id, wait.ref.sha256)

    def _stop_waiting(self) -> None:
        if self.waiting is not None:
            if self.admission is not None:
                self.admission.clear()
            self.endpoint.unfollow(self._payload_filter(self.waiting))
            self.waiting = None

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

    def _save_model(self, plan_hash: str, task: Task, weights: dict, metrics: dict) -> None:
        """Write the model a task evaluated (``WORKDIR/model``), named for the round it was aggregated after (a task
        of round t evaluates round t - 1's model) or, in async mode, its version (``Task.model_name``); a failure
        is logged and costs only the file."""
        ratio, description = self.plan_tier or (None, "")
        round_index = task.round - 1 if task.version is None else task.version
        try:
            eval_graph = self.trainer.directory / artifact_files(self.trainer.manifest)["eval_model"]
            written = self.models.write(eval_graph, weights, input_shape=self.trainer.input_shape,
                                        num_classes=self.trainer.num_classes, run_id=self.state.run_id,
                                        round_index=round_index, name=task.model_name, rank_tier=ratio,
                                        plan_hash=plan_hash,
                                        plan_description=description, correct=metrics["eval_correct"],
                                        total=metrics["eval_total"], majority=metrics["eval_majority"],
                                        classes=metrics["eval_classes"])
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
            update = run_task(self.trainer, self.shard, task, self.state.personal)
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
        if report.code == ErrorCode.RECEIVED:
            if self.answer is not None and self.answer.receipt(msg.round, counter_epoch(msg.counter)):
                LOG.info("round %d: the server counted its answer (receipt)", msg.round)
        elif report.code == ErrorCode.REJOIN:
            LOG.info("server asks to rejoin: %s", report.detail)
            self.join()
        elif report.code == ErrorCode.REFUSED:
            raise DeviceRefused(report.detail)
        else:
            LOG.warning("server error %s: %s", report.code.value, report.detail)
