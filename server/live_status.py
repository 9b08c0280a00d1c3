"""An operator's live view of a running federation: ``--status-port PORT`` on ``python -m server.broker_loop``.

Three read-only pages, from the engine's own records (the same ones metrics.jsonl is written from):

- ``/metrics``: the Prometheus text format (``prometheus_client``), for Prometheus and Grafana;
- ``/``: a status page with the device table, the open round and accuracy per tier over rounds (an inline SVG
  that updates itself by fetching ``/api/status``; no external assets, so it works on an air-gapped site);
- ``/api/status``: the snapshot the page draws, as JSON.

Functional core, thin shell: :func:`fleet_snapshot` is a pure function of the engine's state that returns
plain, freshly built data; the run loop calls it and hands the result to :meth:`StatusServer.publish` (one
reference swap). The HTTP thread only ever reads the latest snapshot: it never touches the engine, so nothing
on a page or the endpoint can change the run. GET and HEAD only; any other method gets 405. The port closes
when the run ends.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from server.coordinator import NO_ANSWER

LOG = logging.getLogger("fedara.status")
Snapshot = Mapping[str, Any]
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_REFUSAL_KINDS = 64
"""Distinct refusal labels kept; any further kind counts as "other" (the label set, and memory, stay bounded)."""
UPDATE_REFUSALS = (("stale", "stale"), ("late", "late"), ("duplicate", "duplicate"), ("replay", "replay"),
                   ("not asked", "not asked"), ("malformed", "malformed"), ("unknown device", "unknown device"),
                   ("a message of", "wrong topic"), ("update of run", "wrong run"),
                   ("update for plan", "wrong plan"), ("tensor", "bad tensors"), ("num_samples", "sample count"),
                   ("metrics lack", "bad evaluation"), ("eval", "bad evaluation"), ("update is", "norm bound"))
"""Prefixes of the engine's update verdicts (server.coordinator, server.robust) and their refusal label."""


def update_refusal(reason: str) -> str:
    """The refusal label of an update verdict's reason: one of a fixed set (the reason's text can name tensors)."""
    for prefix, label in UPDATE_REFUSALS:
        if reason.startswith(prefix):
            return f"update {label}"
    return "update other"


def count_refusal(counts: Counter, label: str) -> None:
    """Count one refusal under ``label``; once MAX_REFUSAL_KINDS - 1 labels are taken, new ones under "other"."""
    counts[label if label in counts or len(counts) < MAX_REFUSAL_KINDS - 1 else "other"] += 1


# -- the functional core --------------------------------------------------------------------------------------


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


def _history(record: dict[str, Any]) -> dict[str, Any]:
    return {"round": record["round"], "accuracy": record.get("accuracy"),
            "per_tier": {t: v.get("accuracy") for t, v in record.get("per_tier", {}).items()}}


def fleet_snapshot(engine: Any, *, now: float, wall: float, transport: Mapping[str, int] | None = None,
                   refusals: Mapping[str, int] | None = None, aggregators: Mapping[str, int] | None = None,
                   rounds: int | None = None, previous: Snapshot | None = None) -> dict[str, Any]:
    """Everything the status pages show, as fresh plain data (no reference into the engine survives).

    ``engine`` is a server.engine.RoundEngine; ``now`` its monotonic clock, ``wall`` the Unix time at the same
    instant (deadlines are shown as Unix times); ``transport`` the endpoint's counters, ``refusals`` the loop's
    refusals by label, ``aggregators`` each aggregator's briefed round (0: started, absent: not yet). ``previous``,
    the snapshot before this one of the same run: what it knew of each device's last answer carries over, and
    the records it summed are not read again (but its last one: the final evaluation adds to it)."""
    records = engine.records
    done = len(previous["completed"]) if previous and len(previous["completed"]) <= len(records) else 0
    seen = max(0, done - 1)  # records the previous snapshot holds as they are now
    new = records[seen:]
    opened = engine.opened
    asked = {*opened.train, *opened.evaluate} if opened is not None else set()
    answered_now = {d for d in asked if not engine.awaits(d)}
    last_answered = _last_answered(previous, new, engine.pending, answered_now,
                                   opened.round if opened else None)
    last_accuracy = {d["id"]: d["last_accuracy"] for d in previous["devices"]} if seen else {}
    last_accuracy.update({d: v.get("accuracy") for r in new for d, v in r.get("per_device", {}).items()})
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
            "last_accuracy": last_accuracy.get(device_id),
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
            "aggregators": _aggregators(engine, aggregators)}


def _completed(record: dict[str, Any]) -> dict[str, Any]:
    """The figures of one completed round (one line of metrics.jsonl) the metrics are summed from."""
    return {"round": record["round"], "seconds": record.get("seconds", 0.0),
            "participants": record.get("participants", 0), "selected": record.get("selected", 0),
            "missed": sum(1 for reason in record.get("dropped", {}).values() if reason == NO_ANSWER),
            "accuracy": record.get("accuracy"),
            "per_tier": {t: dict(v) for t, v in record.get("per_tier", {}).items()},
            "bytes_by_tier": {t: dict(v) for t, v in record.get("bytes_by_tier", {}).items()},
            "wire_bytes_out": record.get("wire_bytes_out", 0), "wire_bytes_in": record.get("wire_bytes_in", 0)}


def _aggregators(engine: Any, briefed: Mapping[str, int] | None) -> list[dict[str, Any]]:
    """What the engine knows of each aggregator: the round whose brief it holds, the updates it was told to fold in
    the open round, whether their partial sums are still awaited."""
    if not briefed and not engine.remote:
        return []
    told, missing = engine.told_to_fold(), set(engine.partials_missing())
    return [{"name": name, "briefed_round": (briefed or {}).get(name), "told": told.get(name, 0),
             "partial_awaited": name in missing} for name in sorted(set(briefed or {}) | set(told))]


# -- Prometheus ----------------------------------------------------------------------------------------------


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
    for reason, value in sorted(_all_refusals(snapshot).items()):
        refusals.add_metric([reason], value)
    families = [info, rounds, trained, duration, last_duration, participants, missed, nbytes, wire, devices,
                round_gauge, in_round, deadline, accuracy, evaluated, refusals]
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


TRANSPORT_REFUSALS = (("frames_rejected", "frame rejected"), ("frames_repeated", "frame repeated"),
                      ("messages_expired", "message expired"))
"""The endpoint's counters of frames it refused, and their refusal label."""


def _all_refusals(snapshot: Snapshot) -> dict[str, int]:
    out = dict(snapshot["refusals"])
    for key, label in TRANSPORT_REFUSALS:
        out[label] = out.get(label, 0) + snapshot["transport"].get(key, 0)
    return out


class SnapshotCollector:
    """A prometheus_client collector over the latest snapshot (per run: no global registry, no mutable metric)."""

    def __init__(self, latest: Any) -> None:
        self.latest = latest

    def collect(self) -> list:
        snapshot = self.latest()
        return [] if snapshot is None else metric_families(snapshot)


# -- the thin shell: an HTTP server thread ---------------------------------------------------------------------


class StatusServer:
    """Serves the latest published snapshot on ``host:port`` from a daemon thread until :meth:`close`."""

    def __init__(self, host: str, port: int) -> None:
        self._snapshot: Snapshot | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(lambda: self._snapshot))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes: the server's RSS, and its CPU
        handler = type("Handler", (_Handler,), {"status": self})
        try:
            self.httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise ValueError(f"--status-port {port}: cannot listen on {host}:{port} ({exc.strerror or exc}); "
                             "pick a free port, or 0 for any") from None
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                       name="fedara-status", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/"

    def publish(self, snapshot: Snapshot) -> None:
        """Make ``snapshot`` the one served (the caller must not change it afterwards)."""
        self._snapshot = snapshot

    def latest(self) -> Snapshot | None:
        return self._snapshot

    def close(self) -> None:
        """Stop serving and close the port."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()

    def __enter__(self) -> StatusServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Handler(BaseHTTPRequestHandler):
    """GET/HEAD of /, /metrics and /api/status; every other method is refused with 405."""

    status: StatusServer
    server_version = "fedara-status"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._answer(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(HTTPStatus.OK, METRICS_CONTENT_TYPE, generate_latest(self.status.registry), body)
        elif path == "/api/status":
            snapshot = self.status.latest()
            data = json.dumps(snapshot if snapshot is not None else {"starting": True}).encode()
            self._send(HTTPStatus.OK, "application/json", data, body)
        elif path in ("/", "/index.html"):
            self._send(HTTPStatus.OK, "text/html; charset=utf-8", STATUS_PAGE.encode(), body)
        else:
            self._send(HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", b"not found: see / /metrics /api/status\n",
                       body)

    def _refuse(self) -> None:
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, "text/plain; charset=utf-8", b"read-only: GET only\n", True,
                   allow="GET, HEAD")

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse  # noqa: N815

    def _send(self, code: HTTPStatus, content_type: str, data: bytes, body: bool, allow: str | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        if allow:
            self.send_header("Allow", allow)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        LOG.debug("%s " + format, self.address_string(), *args)


STATUS_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>FedARA run status</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.2em;color:#222}
h1{font-size:1.3em;margin:0 0 .3em} h2{font-size:1.05em;margin:1.2em 0 .4em}
table{border-collapse:collapse} th,td{padding:3px 9px;border-bottom:1px solid #ddd;text-align:left}
th{background:#f3f3f3} td.num{text-align:right} .off{color:#999} .late{color:#b00}
#meta span{margin-right:1.5em} svg text{font-size:11px}
</style></head>
<body>
<h1>FedARA run <span id="run">…</span></h1>
<div id="meta"></div>
<h2>Open round</h2><div id="round">none</div>
<h2>Accuracy per tier</h2><svg id="plot" width="640" height="260" role="img" aria-label="accuracy per tier"></svg>
<h2>Devices</h2>
<table id="devices"><thead><tr><th>device</th><th>tier</th><th>memory limit (MiB)</th><th>limit source</th>
<th>budget (MiB)</th><th>runtime</th><th>online</th><th>last answered round</th><th>last accuracy</th></tr></thead>
<tbody></tbody></table>
<p><a href="/metrics">/metrics</a> · <a href="/api/status">/api/status</a> · read-only, refreshes every 2 s</p>
<script>
"use strict";
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf", "#7f7f7f"];
let snap = null;
function text(el, value) { el.textContent = value; return el; }
function cell(row, value, cls) { const td = text(document.createElement("td"), value); if (cls) td.className = cls; row.appendChild(td); }
function fmt(v, digits) { return v === null || v === undefined ? "–" : Number(v).toFixed(digits); }
function drawDevices(s) {
  const body = document.querySelector("#devices tbody");
  body.replaceChildren();
  for (const d of s.devices) {
    const row = document.createElement("tr");
    row.dataset.device = d.id;
    if (!d.online) row.className = "off";
    cell(row, d.id); cell(row, d.tier); cell(row, fmt(d.memory_limit_mb, 0), "num");
    cell(row, d.memory_limit_source || "–"); cell(row, fmt(d.budget_mb, 0), "num"); cell(row, d.runtime || "–");
    cell(row, d.online ? "yes" : "no");
    cell(row, d.last_answered_round === null ? "–" : String(d.last_answered_round), "num");
    cell(row, fmt(d.last_accuracy, 4), "num");
    body.appendChild(row);
  }
}
function drawRound(s) {
  const el = document.getElementById("round");
  const r = s.open_round;
  if (!r) { text(el, "none (last trained round: " + (s.last_trained_round ?? "–") + ")"); return; }
  const left = Math.max(0, r.deadline_unix - Date.now() / 1000);
  el.replaceChildren();
  text(el, "round " + r.round + ": " + r.answered + " of " + r.asked + " answered (" + r.train + " train, " +
       r.evaluate + " evaluate), deadline in " + left.toFixed(0) + " s");
  if (r.waiting_for.length) {
    const w = text(document.createElement("div"), "waiting for: " + r.waiting_for.join(", "));
    if (left < 10) w.className = "late";
    el.appendChild(w);
  }
}
function drawMeta(s) {
  text(document.getElementById("run"), s.run_id + " (" + s.algorithm + ")");
  const c = s.completed, last = c.length ? c[c.length - 1] : null;
  const up = c.reduce((a, r) => a + Object.values(r.bytes_by_tier).reduce((b, t) => b + (t.up || 0), 0), 0);
  const down = c.reduce((a, r) => a + Object.values(r.bytes_by_tier).reduce((b, t) => b + (t.down || 0) + (t.eval || 0), 0), 0);
  const refused = Object.values(s.refusals).reduce((a, v) => a + v, 0) + (s.transport.frames_rejected || 0);
  const meta = document.getElementById("meta");
  meta.replaceChildren();
  for (const part of ["rounds completed " + c.length + (s.rounds ? " of " + s.rounds : ""),
                      "accuracy " + fmt(last && last.accuracy, 4), "down " + (down / 1e6).toFixed(2) + " MB",
                      "up " + (up / 1e6).toFixed(2) + " MB", "refused " + refused,
                      "aggregators " + (s.aggregators.length ? s.aggregators.map(a => a.name + "@" + (a.briefed_round ?? "–")).join(" ") : "none")])
    meta.appendChild(text(document.createElement("span"), part));
}
function svg(tag, attrs) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  return el;
}
function drawPlot(s) {
  const plot = document.getElementById("plot");
  plot.replaceChildren();
  const W = 640, H = 260, L = 44, R = 110, T = 10, B = 30;
  const rounds = s.history.map(h => h.round);
  const maxRound = Math.max(1, s.rounds || 0, ...rounds);
  const x = r => L + (r - 1) / Math.max(1, maxRound - 1) * (W - L - R), y = a => T + (1 - a) * (H - T - B);
  plot.appendChild(svg("rect", {x: L, y: T, width: W - L - R, height: H - T - B, fill: "none", stroke: "#999"}));
  for (const a of [0, 0.25, 0.5, 0.75, 1]) {
    plot.appendChild(svg("line", {x1: L, x2: W - R, y1: y(a), y2: y(a), stroke: "#eee"}));
    plot.appendChild(text(svg("text", {x: L - 6, y: y(a) + 4, "text-anchor": "end"}), a.toFixed(2)));
  }
  const step = Math.max(1, Math.ceil(maxRound / 10));
  for (let r = 1; r <= maxRound; r += step)
    plot.appendChild(text(svg("text", {x: x(r), y: H - B + 14, "text-anchor": "middle"}), String(r)));
  plot.appendChild(text(svg("text", {x: W - R, y: H - 2, "text-anchor": "end"}), "round"));
  const tiers = [...new Set(s.history.flatMap(h => Object.keys(h.per_tier)))].sort((a, b) => b.localeCompare(a));
  const series = [["all", h => h.accuracy], ...tiers.map(t => ["tier " + t, h => h.per_tier[t]])];
  series.forEach(([name, get], i) => {
    const pts = s.history.filter(h => get(h) !== null && get(h) !== undefined).map(h => [x(h.round), y(get(h))]);
    const color = COLORS[i % COLORS.length];
    if (pts.length) plot.appendChild(svg("polyline", {points: pts.map(p => p.join(",")).join(" "), fill: "none", stroke: color, "stroke-width": i ? 1.5 : 2.5}));
    for (const [px, py] of pts) plot.appendChild(svg("circle", {cx: px, cy: py, r: 2.5, fill: color}));
    plot.appendChild(text(svg("text", {x: W - R + 8, y: T + 14 + 16 * i, fill: color}), name));
  });
}
function draw() {
  if (!snap || snap.starting) return;
  drawMeta(snap); drawRound(snap); drawDevices(snap); drawPlot(snap);
}
async function refresh() {
  try { const r = await fetch("/api/status", {cache: "no-store"}); if (r.ok) { snap = await r.json(); draw(); } }
  catch (e) { text(document.getElementById("round"), "no answer from the server (the run may have ended)"); }
}
refresh();
setInterval(refresh, 2000);
setInterval(() => snap && drawRound(snap), 1000);
</script>
</body></html>
"""
