"""A round's record: what it moved and how its training went (``RoundBook``, kept while it is open), what closing
it decided (``TrainingRecord``), and its completion by the next round's evaluations into the metrics row.

Evaluation is piggy-backed (every task of round t+1 first evaluates the model of round t), so round t's record
waits, typed, until round t+1 closes; then it becomes the row written to metrics.jsonl, never changed after.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from server.engine.coordinator import Evaluation, RoundResult
from server.engine.evaluation import EVAL_DIRECTION, TIER_DIRECTIONS, evaluation_summary


def tier_label(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:g}"


def _tier_bucket() -> dict[str, int]:
    return dict.fromkeys((*TIER_DIRECTIONS, EVAL_DIRECTION), 0)


@dataclass
class RoundBook:
    """What a round moved and how its training went, while it is open."""

    opened_at: float
    bytes_down: int = 0
    bytes_down_eval: int = 0
    bytes_up: int = 0
    bytes_artifacts: int = 0
    by_tier: dict[str, dict[str, int]] = field(default_factory=dict)
    samples: int = 0
    loss_sum: float = 0.0
    accuracy_sum: float = 0.0

    def count(self, tier: str, direction: str, nbytes: int) -> None:
        self.by_tier.setdefault(tier, _tier_bucket())[direction] += nbytes


@dataclass
class TrainingRecord:
    """A closed training round, awaiting the evaluations of its model (they come with the next round)."""

    round: int
    participants: int
    selected: int
    dropped: dict[str, str]
    aggregated: bool
    algorithm: str
    aggregate: str
    closed_by: str
    train_loss: float | None
    train_accuracy: float | None
    bytes_down: int
    bytes_up: int
    bytes_artifacts: int
    bytes_down_eval: int
    bytes_by_tier: dict[str, dict[str, int]]
    seconds: float
    tiers: dict[str, str]  # device -> its tier label in this round (per-tier accuracy)
    wire_bytes_out: int | None = None  # the transport's own count, where there is one (MQTT)
    wire_bytes_in: int | None = None
    epsilon: float | None = None  # DP: ε spent up to and with this round, at the run's δ (None: no DP guarantee)
    sim_time: float | None = None  # the virtual clock when it closed, where the simulator keeps one
    secagg: dict[str, Any] | None = None  # secure aggregation: survivors, dropped, recovered, threshold, phases

    @classmethod
    def of(cls, result: RoundResult, book: RoundBook, *, aggregated: bool, algorithm: str, aggregate: str,
           tiers: dict[str, str], now: float, wire: tuple[int, int] | None,
           epsilon: float | None = None, sim_time: float | None = None,
           secagg: dict[str, Any] | None = None) -> TrainingRecord:
        return cls(result.round, len(result.accepted), len(result.train), result.dropped, aggregated, algorithm,
                   aggregate, result.closed_by,
                   book.loss_sum / book.samples if book.samples else None,
                   book.accuracy_sum / book.samples if book.samples else None,
                   book.bytes_down, book.bytes_up, book.bytes_artifacts, book.bytes_down_eval, book.by_tier,
                   now - book.opened_at, tiers, *(wire or (None, None)), epsilon, sim_time, secagg)

    def add_evaluation_bytes(self, book: RoundBook) -> None:
        """The downloads of the evaluation after the last round belong to the last round's record."""
        self.bytes_down_eval += book.bytes_down_eval
        for tier, counts in book.by_tier.items():
            bucket = self.bytes_by_tier.setdefault(tier, _tier_bucket())
            for direction, nbytes in counts.items():
                bucket[direction] += nbytes

    def row(self) -> dict[str, Any]:
        """The training half of the metrics row (without the evaluations)."""
        row = {k: v for k, v in asdict(self).items() if k != "tiers"}
        return {k: v for k, v in row.items()
                if not ((k.startswith("wire_") or k in ("sim_time", "secagg")) and v is None)}

    def completed(self, evaluations: dict[str, Evaluation]) -> dict[str, Any]:
        """The metrics row: this record with the evaluations of its model, in device-id order (never arrival
        order: the std and mean loss, float sums, must not depend on timing)."""
        per_device = {d: {"accuracy": e.correct / e.total if e.total else None, "tier": self.tiers.get(d, "-"),
                          "majority": e.majority / e.total if e.total and e.majority is not None else None,
                          "classes": e.classes, "samples": e.total}
                      for d, e in sorted(evaluations.items())}
        ordered = [evaluations[d] for d in sorted(evaluations)]
        return dict(self.row(), **evaluation_summary(ordered), per_device=per_device,
                    per_tier=per_tier(evaluations, self.tiers))

    def to_state(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> TrainingRecord:
        return cls(**{k: v for k, v in state.items() if k in cls.__dataclass_fields__})


def per_tier(evaluations: dict[str, Evaluation], tiers: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Accuracy (Σ correct / Σ total), device count and majority-class baseline (Σ majority / Σ total: each device
    answering its own most common label; None unless every device sent its count) per rank tier."""
    out: dict[str, dict[str, Any]] = {}
    for device_id, e in evaluations.items():
        bucket = out.setdefault(tiers.get(device_id, "-"), {"correct": 0, "total": 0, "devices": 0, "majority": 0})
        bucket["correct"] += e.correct
        bucket["total"] += e.total
        bucket["devices"] += 1
        known = e.majority is not None and bucket["majority"] is not None
        bucket["majority"] = bucket["majority"] + e.majority if known else None
    return {t: {"accuracy": b["correct"] / b["total"] if b["total"] else None, "devices": b["devices"],
                "majority": b["majority"] / b["total"] if b["total"] and b["majority"] is not None else None}
            for t, b in sorted(out.items())}
