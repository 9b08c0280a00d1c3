"""The live view's Prometheus metrics: metric families built from the latest snapshot (``prometheus_client``), per
run (no global registry, no mutable metric)."""
from __future__ import annotations

from collections import Counter
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from server.outputs.refusals import all_refusals
from server.outputs.status_snapshot import Snapshot

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def metric_families(snapshot: Snapshot) -> list:
    """The snapshot as Prometheus metric families (sums over the completed rounds match metrics.jsonl)."""
    completed = snapshot["completed"]
    info = GaugeMetricFamily("fedara_run_info", "The run this server federates", labels=["run_id", "algorithm"])
    info.add_metric([snapshot["run_id"], snapshot["algorithm"]], 1)
    rounds = CounterMetricFamily("fedara_rounds_completed", "Rounds whose record is complete (lines of "
                                 "metrics.jsonl)")
    rounds.add_metric([], len(completed))
    trained = GaugeMetricFamily("fedara_last_trained_round", "The last round whose training closed")
    trained.add_metric([], snapshot["last_trained_round"] or 0)
    duration = SummaryMetricFamily("fedara_round_duration_seconds", "Seconds from a round's opening to its close",
                                   count_value=len(completed), sum_value=sum(c["seconds"] for c in completed))
    last_duration = GaugeMetricFamily("fedara_last_round_duration_seconds", "The last completed round's duration")
    last_duration.add_metric([], completed[-1]["seconds"] if completed else 0.0)
    participants = GaugeMetricFamily("fedara_last_round_devices", "Training devices of the last completed round",
                                     labels=["state"])
    if completed:
        participants.add_metric(["selected"], completed[-1]["selected"])
        participants.add_metric(["aggregated"], completed[-1]["participants"])
    missed = CounterMetricFamily("fedara_missed_answers", "Answers that had not come by a round's deadline")
    missed.add_metric([], sum(c["missed"] for c in completed))
    nbytes = CounterMetricFamily("fedara_bytes", "Payload bytes of the completed rounds, by direction and tier "
                                 "(down: training weights, eval: weights to evaluate, up: updates, artifacts: plans)",
                                 labels=["direction", "tier"])
    for (direction, tier), value in sorted(_bytes_by(completed).items()):
        nbytes.add_metric([direction, tier], value)
    wire = CounterMetricFamily("fedara_wire_bytes", "MQTT bytes of the completed rounds' traffic",
                               labels=["direction"])
    wire.add_metric(["out"], sum(c["wire_bytes_out"] for c in completed))
    wire.add_metric(["in"], sum(c["wire_bytes_in"] for c in completed))
    devices = GaugeMetricFamily("fedara_devices", "Devices by tier and state (joined: has a plan; online; ready: "
                                "acknowledged its plan)", labels=["tier", "state"])
    for (tier, state), value in sorted(_device_counts(snapshot["devices"]).items()):
        devices.add_metric([tier, state], value)
    open_round = snapshot["open_round"]
    round_gauge = GaugeMetricFamily("fedara_open_round", "The round now open (0: none)")
    round_gauge.add_metric([], open_round["round"] if open_round else 0)
    in_round = GaugeMetricFamily("fedara_open_round_devices", "Devices of the open round by tier: asked, answered",
                                 labels=["tier", "state"])
    for (tier, state), value in sorted(_round_counts(snapshot["devices"]).items()):
        in_round.add_metric([tier, state], value)
    deadline = GaugeMetricFamily("fedara_open_round_deadline_timestamp_seconds", "Unix time of the open round's "
                                 "deadline")
    if open_round:
        deadline.add_metric([], open_round["deadline_unix"])
    accuracy = GaugeMetricFamily("fedara_accuracy", "Accuracy of the last completed round (Σ correct / Σ test "
                                 "samples) by tier; tier=\"all\" over every device", labels=["tier"])
    evaluated = GaugeMetricFamily("fedara_evaluated_devices", "Devices that evaluated the last completed round's "
                                  "model, by tier", labels=["tier"])
    if completed:
        last = completed[-1]
        if last["accuracy"] is not None:
            accuracy.add_metric(["all"], last["accuracy"])
        for tier, values in sorted(last["per_tier"].items()):
            if values.get("accuracy") is not None:
                accuracy.add_metric([tier], values["accuracy"])
            evaluated.add_metric([tier], values.get("devices", 0))
    refusals = CounterMetricFamily("fedara_refusals", "Inbound messages refused, by reason", labels=["reason"])
    for reason, value in sorted(all_refusals(snapshot).items()):
        refusals.add_metric([reason], value)
    families = [info, rounds, trained, duration, last_duration, participants, missed, nbytes, wire, devices,
                round_gauge, in_round, deadline, accuracy, evaluated, refusals]
    if snapshot.get("privacy"):
        privacy = snapshot["privacy"]
        spent = GaugeMetricFamily("fedara_privacy_epsilon", "User-level ε spent so far (an upper bound) at the run's "
                                  "δ; target: --dp-target-epsilon (+Inf: none)", labels=["bound"])
        spent.add_metric(["spent"], privacy["epsilon"])
        target = privacy["target_epsilon"]
        spent.add_metric(["target"], float("inf") if target is None else target)
        delta = GaugeMetricFamily("fedara_privacy_delta", "The δ of every reported ε")
        delta.add_metric([], privacy["delta"])
        families += [spent, delta]
    secure = next((c["secagg"] for c in reversed(completed) if c.get("secagg")), None)
    if secure:
        figures = GaugeMetricFamily("fedara_secagg", "The last secure round's devices (survivors, dropped after "
                                    "sharing, recovered from neighbours' shares), threshold, and 1 if aggregated",
                                    labels=["figure"])
        for name in ("survivors", "dropped", "recovered", "threshold"):
            figures.add_metric([name], secure[name] if secure[name] is not None else float("nan"))
        figures.add_metric(["aggregated"], int(bool(secure["aggregated"])))
        phase_bytes = GaugeMetricFamily("fedara_secagg_phase_bytes", "Bytes into and out of the server in each "
                                        "SecAgg+ phase of the last secure round", labels=["phase", "direction"])
        phase_seconds = GaugeMetricFamily("fedara_secagg_phase_seconds", "Wall seconds of each SecAgg+ phase of the "
                                          "last secure round", labels=["phase"])
        for phase, cost in sorted(secure["phases"].items()):
            phase_bytes.add_metric([phase, "in"], cost["bytes_in"])
            phase_bytes.add_metric([phase, "out"], cost["bytes_out"])
            phase_seconds.add_metric([phase], cost["seconds"])
        families += [figures, phase_bytes, phase_seconds]
    if snapshot["aggregators"]:
        briefed = GaugeMetricFamily("fedara_aggregator_briefed_round", "The round whose brief an aggregator holds "
                                    "(0: started, -1: not yet)", labels=["aggregator"])
        told = GaugeMetricFamily("fedara_aggregator_updates", "Updates an aggregator was told to fold in the open "
                                 "round", labels=["aggregator"])
        awaited = GaugeMetricFamily("fedara_aggregator_partial_awaited", "1 while the open round waits for an "
                                    "aggregator's partial sums", labels=["aggregator"])
        for a in snapshot["aggregators"]:
            briefed.add_metric([a["name"]], -1 if a["briefed_round"] is None else a["briefed_round"])
            told.add_metric([a["name"]], a["told"])
            awaited.add_metric([a["name"]], int(a["partial_awaited"]))
        families += [briefed, told, awaited]
    return families


def _bytes_by(completed: list[dict[str, Any]]) -> dict[tuple[str, str], int]:
    totals: Counter = Counter()
    for c in completed:
        for tier, directions in c["bytes_by_tier"].items():
            for direction, value in directions.items():
                totals[direction, tier] += value
    return dict(totals)


def _device_counts(devices: list[dict[str, Any]]) -> dict[tuple[str, str], int]:
    counts: Counter = Counter()
    for d in devices:
        if d["tier"] == "-":
            continue
        counts[d["tier"], "joined"] += 1
        counts[d["tier"], "online"] += d["online"]
        counts[d["tier"], "ready"] += d["online"] and d["ready"]
    return dict(counts)


def _round_counts(devices: list[dict[str, Any]]) -> dict[tuple[str, str], int]:
    counts: Counter = Counter()
    for d in devices:
        if d["asked"]:
            counts[d["tier"], "asked"] += 1
            counts[d["tier"], "answered"] += d["answered"]
    return dict(counts)


class SnapshotCollector:
    """A prometheus_client collector over the latest snapshot (per run: no global registry, no mutable metric)."""

    def __init__(self, latest: Any) -> None:
        self.latest = latest

    def collect(self) -> list:
        snapshot = self.latest()
        return [] if snapshot is None else metric_families(snapshot)
