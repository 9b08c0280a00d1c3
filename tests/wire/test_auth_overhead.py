"""What authentication costs on the wire: the tag and the counter fields, per message, against a model update."""
from __future__ import annotations

import json

import numpy as np

from device_runtime.auth import MAX_COUNTER, TAG_BYTES, Direction
from device_runtime.envelope import seal
from device_runtime.messages import update_message
from device_runtime.task import Update
from fedcore.lowrank import RankPlan, fe_state, resolve_plan
from fedcore.models import build_model
from server.engine.run_config import DEFAULT_TIERS
from server.engine.sampling import factorize_per_plan, plan_key
from tests.support.envelope_edits import split

MAX_SHARE = 0.001
"""Authentication may add at most 0.1 % to a model update."""


def smallest_update() -> Update:
    """The update of the smallest plan shipped: FedAvgCNN on 1x28x28 at the lowest default tier."""
    model = build_model("fedavgcnn", (1, 28, 28), 10, seed=0)
    plan = resolve_plan(model, RankPlan(min(DEFAULT_TIERS)))
    weights = factorize_per_plan(fe_state(model), [plan])[plan_key(plan)]
    return Update(round=1, weights=weights, num_samples=100, train_loss=1.0, train_accuracy=0.5,
                  metrics={"eval_correct": 1, "eval_total": 2, "eval_loss": 0.5})


def authentication_bytes(envelope: bytes) -> int:
    """Bytes the tag and the direction and counter fields take in ``envelope``."""
    header, _ = split(envelope)
    fields = json.loads(header)
    counter_fields = len(json.dumps({k: fields[k] for k in ("direction", "counter")}, separators=(",", ":"))) - 2 + 1
    return TAG_BYTES + counter_fields  # the two fields, their comma, and the tag


def test_authentication_adds_at_most_0_1_percent_to_the_smallest_model_update():
    update = smallest_update()
    envelope = seal(update_message(update, plan_hash="ab" * 32, device_id="dev_000", run_id="0123456789abcdef"),
                    bytes(32), Direction.UP, MAX_COUNTER)
    overhead = authentication_bytes(envelope)
    tensors = sum(np.asarray(v).nbytes for v in update.weights.values())
    print(f"authentication: {overhead} bytes per message; smallest update {tensors} tensor bytes, "
          f"{len(envelope)} on the wire: {100 * overhead / len(envelope):.4f} %")
    assert overhead == TAG_BYTES + len(',"direction":"up","counter":') + len(str(MAX_COUNTER))
    assert overhead <= MAX_SHARE * len(envelope)
