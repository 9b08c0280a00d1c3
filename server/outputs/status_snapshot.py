"""The live view's snapshot of a run: a pure function of the engine's state that returns plain, freshly built data.

The run loop calls :func:`fleet_snapshot` and hands the result to the status server (one reference swap); the
HTTP thread only ever reads the latest snapshot and never touches the engine.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from server.engine.coordinator import NO_ANSWER

Snapshot = Mapping[str, Any]


def _tier(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:g}"


def _last_answered(previous: Snapshot | None, records: list[dict[str, Any]], pending: dict[str, Any] | None,
                   answered_now: Iterable[str], open_round: int | None) -> dict[str, int]:
    """Device -> the last round whose task it answered: what the previous snapshot knew (a completed record does
    not list who trained), the ``records`` it had not seen (their evaluations came with the next round's answers),
    the pending record (who was asked, who dropped), the open round (who answered so far)."""
    last: dict[str, int] = {d["id"]: d["last_answered_round"] for d in (previous or {}).get("devices", ())
                            if d["last_answered_round"] is not None}

    def answered(device_id: str, round_index: int) -> None:
        last[device_id] = max(round_index, last.get(device_id, round_index))
    for record in records:
        for device_id in record.get("per_device", {}):
            answered(device_id, record["round"] + 1)
    if pending is not None:
        for device_id in pending.get("tiers", {}):
            if device_id not in pending.get("dropped", {}):
                answered(device_id, pending["round"])
    for device_id in answered_now:
        answered(device_id, open_round)
    return last


LAST_EVALUATION = {"last_accuracy": "accuracy", "last_majority": "majority", "last_classes": "classes",
                   "last_samples": "samples"}
"""A device's figures of its last evaluation (snapshot key -> its per_device key): the accuracy, the majority-class
baseline beside it, how many classes the model answered, over how many test samples."""


def _history(record: dict[str, Any]) -> dict[str, Any]:
    return {"round": record["round"], "accuracy": record.get("accuracy"),
            "per_tier": {t: v.get("accuracy") for t, v in record.get("per_tier", {}).items()}}


def fleet_snapshot(engine: Any, *, now: float, wall: float, transport: Mapping[str, int] | None = None,
                   refusals: Mapping[str, int] | None = None, aggregators: Mapping[str, int] | None = None,
                   rounds: int | None = None, previous: Snapshot | None = None,
                   finished: bool = False) -> dict[str, Any]:
    """Everything the status pages show, as fresh plain data (no reference into the engine survives).

    ``engine`` is a server.engine.round_engine.RoundEngine; ``now`` its monotonic clock, ``wall`` the Unix time at the same
    instant (deadlines are shown as Unix times); ``transport`` the endpoint's counters, ``refusals`` the loop's
    refusals by label, ``aggregators`` each aggregator's briefed round (0: started, absent: not yet). ``previous``,
    the snapshot before this one of the same run: what it knew of each device's last answer carries over, and
    the records it summed are not read again (but its last one: the final evaluation adds to it). ``finished``: the
    run is over (the last snapshot, served while --status-linger keeps the page up).

    Round numbers are the console's: the evaluation-only task after the last round counts as the last round's (it
    evaluates that round's model), so no device shows a round beyond ``rounds``."""
    records = engine.records
    done = len(previous["completed"]) if previous and len(previous["completed"]) <= len(records) else 0
    seen = max(0, done - 1)  # records the previous snapshot holds as they are now
    new = records[seen:]
    opened = engine.opened
    asked = {*opened.train, *opened.evaluate} if opened is not None else set()
    answered_now = {d for d in asked if not engine.awaits(d)}
    last_answered = _last_answered(previous, new, engine.pending, answered_now,
                                   opened.round if opened else None)
    last_evaluation = {d["id"]: {k: d[k] for k in LAST_EVALUATION} for d in previous["devices"]} if seen else {}
    last_evaluation.update({d: {k: v.get(key) for k, key in LAST_EVALUATION.items()}
                            for r in new for d, v in r.get("per_device", {}).items()})
    if rounds:
        last_answered = {d: min(r, rounds) for d, r in last_answered.items()}
    devices = []
    registry = engine.registry()
    for device_id in sorted(registry):
        record = registry[device_id]
        profile = engine.profiles.get(device_id)
        devices.append({
            "id": device_id, "tier": _tier(record.ratio), "online": record.online, "ready": record.ready,
            "budget_mb": record.budget_mb,
            "memory_limit_mb": profile.memory_limit_mb if profile else None,
            "memory_limit_source": profile.memory_limit_source if profile else None,
            "runtime": engine.kinds.get(device_id), "last_answered_round": last_answered.get(device_id),
            **last_evaluation.get(device_id, dict.fromkeys(LAST_EVALUATION)),
            "asked": device_id in asked, "answered": device_id in answered_now})
    open_round = None
    if opened is not None:
        open_round = {"round": opened.round, "train": len(opened.train), "evaluate": len(opened.evaluate),
                      "asked": len(asked), "answered": len(answered_now),
                      "deadline_unix": wall + (opened.deadline - now), "waiting_for": sorted(asked - answered_now)}
    kept = previous if seen else {"history": [], "completed": []}
    return {"run_id": engine.run_id, "algorithm": engine.algorithm.name, "rounds": rounds,
            "snapshot_unix": wall, "devices": devices, "open_round": open_round,
            "completed": kept["completed"][:seen] + [_completed(r) for r in new],
            "last_trained_round": (engine.pending or (records[-1] if records else {})).get("round"),
            "history": kept["history"][:seen] + [_history(r) for r in new],
            "transport": dict(transport or {}), "refusals": dict(refusals or {}),
            "aggregators": _aggregators(engine, aggregators), "finished": finished,
            "privacy": _privacy(engine)}


def _privacy(engine: Any) -> dict[str, Any] | None:
    """The budget of a differentially private run: ε spent (at δ), the target, the clip now; None without DP."""
    dp = engine.dp
    if dp is None:
        return None
    return {"epsilon": dp.epsilon, "delta": dp.settings.run_delta, "target_epsilon": dp.settings.target_epsilon,
            "rounds_charged": dp.accountant.rounds, "clip": dp.mechanism.clip}


def _completed(record: dict[str, Any]) -> dict[str, Any]:
    """The figures of one completed round (one line of metrics.jsonl) the metrics are summed from."""
    return {"round": record["round"], "seconds": record.get("seconds", 0.0),
            "participants": record.get("participants", 0), "selected": record.get("selected", 0),
            "missed": sum(1 for reason in record.get("dropped", {}).values() if reason == NO_ANSWER),
            "accuracy": record.get("accuracy"),
            "per_tier": {t: dict(v) for t, v in record.get("per_tier", {}).items()},
            "bytes_by_tier": {t: dict(v) for t, v in record.get("bytes_by_tier", {}).items()},
            "wire_bytes_out": record.get("wire_bytes_out", 0), "wire_bytes_in": record.get("wire_bytes_in", 0),
            "secagg": _secagg(record)}


def _secagg(record: dict[str, Any]) -> dict[str, Any] | None:
    """A secure round's figures (its record's ``secagg``), or None."""
    secagg = record.get("secagg")
    if not secagg:
        return None
    return {"round": record["round"], **{k: secagg.get(k) for k in ("survivors", "dropped", "recovered", "threshold",
                                                                      "aggregated", "failure")},
            "phases": {p: dict(v) for p, v in secagg.get("phases", {}).items()}}


def _aggregators(engine: Any, briefed: Mapping[str, int] | None) -> list[dict[str, Any]]:
    """What the engine knows of each aggregator: the round whose brief it holds, the updates it was told to fold in
    the open round, whether their partial sums are still awaited."""
    if not briefed and not engine.remote:
        return []
    told, missing = engine.told_to_fold(), set(engine.partials_missing())
    return [{"name": name, "briefed_round": (briefed or {}).get(name), "told": told.get(name, 0),
             "partial_awaited": name in missing} for name in sorted(set(briefed or {}) | set(told))]
