"""The operator's live view (server.outputs.status_server): /metrics, / and /api/status of ``--status-port``.

The core (fleet_snapshot, metric_families) is driven on a real RoundEngine with explicit time; the server on a
published snapshot; one slow test runs ``python -m server.broker_loop --status-port 0`` with device processes,
scrapes /metrics after every round against metrics.jsonl, and loads / in headless chromium.
"""
from __future__ import annotations

import contextlib
import http.client
import copy
import json
import logging
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
from paho.mqtt import publish
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from device_runtime.messages import DEFAULT_TOPIC_PREFIX
from device_runtime.topics import Topics
from server import broker_loop
from server.outputs.prometheus_metrics import SnapshotCollector
from server.outputs.refusals import MAX_REFUSAL_KINDS, count_refusal, update_refusal
from server.outputs.status_server import StatusServer
from server.outputs.status_snapshot import fleet_snapshot
from server.outputs.report import METRICS_FILE, read_metrics
from tests.support.waiting import wait_for
from tests.support.scripts import load_script
from tests.support.engine import answer, join, make_engine, two_rounds_engine
from tests.support.machine import missing_binary, require
from tests.support.processes import child_env

REPO_ROOT = Path(__file__).resolve().parents[2]
QUICK = ["--dataset", "digits", "--max-samples", "600", "--local-epochs", "1", "--batch-size", "32", "--lr", "0.05",
         "--lam", "2", "--lam-warmup", "1", "--threads", "1", "--join-timeout", "300", "--round-deadline", "300"]
DEVICES, ROUNDS = 3, 3
TIERS = (1.0, 0.25)
WAIT_S = 600.0
"""Bounds every wait of the run test: building the artifacts alone took 4 min on a 2-core machine at load 14."""
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS_DIR = "runs/test_artifacts"
"""Where the run test keeps the status page's screenshot (runs/ is git-ignored)."""


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """/metrics parsed by prometheus_client's own parser: (sample name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def render(snapshot: dict) -> str:
    """What /metrics says of ``snapshot`` (the server's collector, without the process metrics)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snapshot))
    return generate_latest(registry).decode()


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def post(url: str) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=b"x", method="POST"), timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def answer_to(method: str, port: int) -> int:
    """The status code of a ``method`` request for / on 127.0.0.1:``port``."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(method, "/")
        return connection.getresponse().status
    finally:
        connection.close()


def refused_connection(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


# -- the functional core --------------------------------------------------------------------------------------


def test_the_snapshot_shows_the_devices_the_open_round_and_nothing_that_still_belongs_to_the_engine():
    engine = two_rounds_engine()
    snapshot = fleet_snapshot(engine, now=5.0, wall=1000.0, transport={"frames_rejected": 2},
                              refusals={"join refused": 1}, rounds=3)
    frozen = copy.deepcopy(snapshot)
    assert [(d["id"], d["tier"], d["budget_mb"], d["runtime"], d["online"]) for d in snapshot["devices"]] == [
        ("dev_000", "1", 500.0, "onnxruntime", True), ("dev_001", "0.25", 50.0, "onnxruntime", True)]
    assert snapshot["open_round"] == {"round": 2, "train": 2, "evaluate": 0, "asked": 2, "answered": 1,
                                      "deadline_unix": 1000.0 + (3.0 + 10.0 - 5.0), "waiting_for": ["dev_001"]}
    assert {d["id"]: d["last_answered_round"] for d in snapshot["devices"]} == {"dev_000": 2, "dev_001": 1}
    assert snapshot["last_trained_round"] == 1 and snapshot["completed"] == []
    json.dumps(snapshot)  # plain data
    engine.close_round(20.0)  # completes round 1's record
    engine.records[-1]["per_tier"]["1"]["accuracy"] = -1.0
    assert snapshot == frozen  # nothing in it is a reference into the engine
    later = fleet_snapshot(engine, now=21.0, wall=1016.0, previous=snapshot)
    assert later["open_round"] is None and [c["round"] for c in later["completed"]] == [1]
    assert {d["id"]: d["last_accuracy"] for d in later["devices"]} == {"dev_000": 0.5, "dev_001": None}
    # Round 1's record does not list who trained: that dev_001 answered round 1 is known from the snapshot before.
    assert {d["id"]: d["last_answered_round"] for d in later["devices"]} == {"dev_000": 2, "dev_001": 1}
    alone = fleet_snapshot(engine, now=21.0, wall=1016.0)
    assert {d["id"]: d["last_answered_round"] for d in alone["devices"]} == {"dev_000": 2, "dev_001": None}


def test_a_snapshot_built_on_the_one_before_equals_one_built_from_scratch():
    engine = two_rounds_engine()
    before = fleet_snapshot(engine, now=5.0, wall=1000.0)
    for round_index in (3, 4, 5):
        engine.close_round(10.0 * round_index)  # completes the record of round_index - 2
        engine.records[-1]["bytes_by_tier"]["1"]["eval"] += 7  # as the final evaluation adds to the last record
        for device_id, task in engine.open_round(round_index, 10.0 * round_index + 1).items():
            answer(engine, device_id, task, now=10.0 * round_index + 2)
        later = fleet_snapshot(engine, now=60.0, wall=1055.0, previous=before)
        assert later == fleet_snapshot(engine, now=60.0, wall=1055.0, previous={**before, "completed": []})
        assert [c["round"] for c in later["completed"]] == list(range(1, round_index - 1))
        assert later["completed"][-1]["bytes_by_tier"]["1"]["eval"] == engine.records[-1]["bytes_by_tier"]["1"]["eval"]
        before = later


def test_the_metrics_sum_the_completed_records_and_count_the_open_round_per_tier():
    engine = two_rounds_engine()
    engine.close_round(20.0)
    engine.open_round(3, 21.0)
    snapshot = fleet_snapshot(engine, now=22.0, wall=1000.0, transport={"frames_rejected": 2},
                              refusals={"join refused": 1, "update stale": 3}, rounds=3)
    values = samples(render(snapshot))
    record = engine.records[0]
    assert values["fedara_rounds_completed_total", ()] == 1
    assert values["fedara_round_duration_seconds_sum", ()] == pytest.approx(record["seconds"])
    for tier, directions in record["bytes_by_tier"].items():
        for direction, nbytes in directions.items():
            assert values["fedara_bytes_total", (("direction", direction), ("tier", tier))] == nbytes
    assert values["fedara_accuracy", (("tier", "all"),)] == pytest.approx(record["accuracy"])
    assert values["fedara_accuracy", (("tier", "1"),)] == pytest.approx(record["per_tier"]["1"]["accuracy"])
    assert values["fedara_evaluated_devices", (("tier", "1"),)] == 1
    assert values["fedara_devices", (("state", "online"), ("tier", "0.25"))] == 1
    assert values["fedara_open_round", ()] == 3
    assert values["fedara_open_round_devices", (("state", "asked"), ("tier", "0.25"))] == 1
    assert values["fedara_open_round_devices", (("state", "answered"), ("tier", "0.25"))] == 0
    assert values["fedara_refusals_total", (("reason", "frame rejected"),)] == 2
    assert values["fedara_refusals_total", (("reason", "update stale"),)] == 3
    assert not any(name.startswith("fedara_aggregator") for name, _ in values)


def test_the_aggregators_figures_show_what_the_engine_knows_of_them():
    engine = make_engine(remote=True)
    join(engine, "dev_000")
    engine.open_round(1, 0.0)
    engine.remote._told = {"agg-1": {"dev_000": None}}  # as receive_receipt leaves it for an accepted update
    snapshot = fleet_snapshot(engine, now=1.0, wall=1000.0, aggregators={"agg-0": 1, "agg-1": 1, "agg-2": 0})
    assert snapshot["aggregators"] == [
        {"name": "agg-0", "briefed_round": 1, "told": 0, "partial_awaited": False},
        {"name": "agg-1", "briefed_round": 1, "told": 1, "partial_awaited": True},
        {"name": "agg-2", "briefed_round": 0, "told": 0, "partial_awaited": False}]
    values = samples(render(snapshot))
    assert values["fedara_aggregator_updates", (("aggregator", "agg-1"),)] == 1
    assert values["fedara_aggregator_partial_awaited", (("aggregator", "agg-1"),)] == 1
    assert values["fedara_aggregator_briefed_round", (("aggregator", "agg-2"),)] == 0


def test_refusal_labels_stay_a_bounded_set_whatever_a_sender_writes():
    assert update_refusal("stale: update for round 1, round 2 is open") == "update stale"
    assert update_refusal("tensor fe.evil_name_0001: shape (3,), expected (4,)") == "update bad tensors"
    assert update_refusal("non-finite: round 3: train_loss is nan: no update sent") == "update non-finite"
    assert update_refusal("anything else 1234") == "update other"
    counts: Counter = Counter()
    for i in range(10 * MAX_REFUSAL_KINDS):
        count_refusal(counts, f"link kind {i}")
    assert len(counts) == MAX_REFUSAL_KINDS and counts["other"] == 10 * MAX_REFUSAL_KINDS - (MAX_REFUSAL_KINDS - 1)


# -- the shell: the HTTP server ---------------------------------------------------------------------------------


def test_the_server_is_read_only_and_its_port_closes():
    engine = two_rounds_engine()
    snapshot = fleet_snapshot(engine, now=5.0, wall=time.time())
    with StatusServer("127.0.0.1", 0) as status:
        port = status.httpd.server_address[1]
        assert get(status.url + "api/status") == (200, b'{"starting": true}')
        status.publish(snapshot)
        code, body = get(status.url + "api/status")
        assert code == 200 and json.loads(body) == json.loads(json.dumps(snapshot))
        code, body = get(status.url + "metrics")
        values = samples(body.decode())
        assert code == 200 and values["fedara_open_round", ()] == 2
        assert values["process_resident_memory_bytes", ()] > 10e6  # the server's RSS
        code, body = get(status.url)
        assert code == 200 and b"/api/status" in body and b"<svg" in body
        assert re.findall(rb'<tr data-device="([^"]+)"', body) == [b"dev_000", b"dev_001"]  # in the HTML itself
        links = re.findall(rb'(?:src|href)\s*=\s*"([^"]*)"', body)
        assert links and all(link.startswith(b"/") for link in links), links  # no external assets
        for path in ("", "metrics", "api/status"):
            assert post(status.url + path) == 405
        for method, code in (("PUT", 405), ("DELETE", 405), ("PATCH", 405), ("OPTIONS", 405), ("TRACE", 501),
                             ("CONNECT", 501), ("BREW", 501)):  # 501: http.server's own "unsupported method"
            assert answer_to(method, port) == code, method
        assert get(status.url + "nothing")[0] == 404
        assert json.loads(get(status.url + "api/status")[1]) == json.loads(json.dumps(snapshot))  # unchanged
    assert refused_connection(port)


def test_a_client_that_drops_its_connection_costs_a_debug_line_not_a_traceback(caplog, capfd):
    """A browser closing a tab mid-answer: the server's write meets a reset connection (the answer, megabytes of
    JSON, is larger than the socket buffers, and the client resets right after asking)."""
    snapshot = fleet_snapshot(two_rounds_engine(), now=5.0, wall=time.time())
    big = dict(snapshot, devices=snapshot["devices"] * 20_000)
    caplog.set_level(logging.DEBUG, logger="fedara.status")
    with StatusServer("127.0.0.1", 0) as status:
        status.publish(big)
        with socket.create_connection(status.httpd.server_address[:2]) as client:
            client.sendall(b"GET /api/status HTTP/1.1\r\nHost: x\r\n\r\n")
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
        wait_for(lambda: any("dropped its connection" in r.getMessage() for r in caplog.records), 30,
                 "the dropped client logged")
        assert get(status.url + "metrics")[0] == 200  # still serving
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--status-port", "70000"], "--status-port must be a TCP port in 0..65535"),
    (["--status-port", "-1"], "--status-port must be a TCP port in 0..65535"),
    (["--status-host", "0.0.0.0"], "--status-host 0.0.0.0 needs --status-port PORT"),
    (["--status-linger", "60"], "--status-linger 60.0 needs --status-port PORT"),
    (["--status-port", "0", "--status-linger", "-1"], "--status-linger must be seconds >= 0, got -1"),
    (["--broker-connect-timeout", "0"], "--broker-connect-timeout must be positive seconds, got 0"),
])
def test_a_bad_status_flag_is_one_line_and_exit_2(flags: list[str], message: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture):
    assert broker_loop.main([*QUICK, "--local-devices", "1", "--out", str(tmp_path / "run"), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_status_port_that_is_not_a_number_is_refused_by_the_parser(capsys: pytest.CaptureFixture):
    with pytest.raises(SystemExit) as exit_info:
        broker_loop.build_parser().parse_args(["--status-port", "http"])
    assert exit_info.value.code == 2 and "--status-port: invalid int value: 'http'" in capsys.readouterr().err


@pytest.mark.slow
def test_a_taken_status_port_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert broker_loop.main([*QUICK, "--local-devices", "1", "--cache-dir", str(tmp_path / "cache"),
                                 "--out", str(tmp_path / "run"), "--status-port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"--status-port {port}: cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err


# -- a real run --------------------------------------------------------------------------------------------------


class ServerProcess:
    """``python -m server.broker_loop`` in a child process, its output collected by a thread."""

    def __init__(self, command: list[str]) -> None:
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=child_env(repo_on_path=True), cwd=REPO_ROOT)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def url(self) -> str | None:
        for line in list(self.lines):
            if line.startswith("status: http://"):
                return line.split()[1]
        return None

    def device(self, device_id: str) -> psutil.Process:
        """The local device process running ``device_id``."""
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            if f"--device-id {device_id} " in " ".join(child.cmdline()) + " ":
                return child
        raise AssertionError(f"no process for {device_id}")

    def output(self) -> str:
        return "".join(self.lines)


@pytest.fixture
def server_process() -> Iterator[Callable[[list[str]], ServerProcess]]:
    started: list[ServerProcess] = []

    def start(flags: list[str]) -> ServerProcess:
        started.append(ServerProcess([sys.executable, "-m", "server.broker_loop", *QUICK, *flags]))
        return started[-1]
    yield start
    for server in started:
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGTERM)
            server.proc.wait(60)


def chromium(url: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    """Headless chromium on ``url`` after its scripts ran (root needs --no-sandbox)."""
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--user-data-dir={out / 'chromium-profile'}", "--virtual-time-budget=5000",
                           "--window-size=1200,1000", *args, url],
                          capture_output=True, text=True, timeout=120)


def check_against_metrics_file(values: dict, run: Path) -> int:
    """The scraped figures equal those of the rounds metrics.jsonl records; returns how many rounds they cover."""
    completed = int(values["fedara_rounds_completed_total", ()])
    records = read_metrics(run / METRICS_FILE)[:completed] if completed else []
    assert len(records) == completed
    assert values["fedara_round_duration_seconds_count", ()] == completed
    assert values["fedara_round_duration_seconds_sum", ()] == pytest.approx(sum(r["seconds"] for r in records))
    bytes_by: Counter = Counter()
    for record in records:
        for tier, directions in record["bytes_by_tier"].items():
            for direction, nbytes in directions.items():
                bytes_by[direction, tier] += nbytes
    scraped = {(dict(labels)["direction"], dict(labels)["tier"]): v
               for (name, labels), v in values.items() if name == "fedara_bytes_total"}
    assert scraped == dict(bytes_by)
    assert values["fedara_wire_bytes_total", (("direction", "out"),)] == sum(r["wire_bytes_out"] for r in records)
    if records:
        last = records[-1]
        assert values["fedara_accuracy", (("tier", "all"),)] == pytest.approx(last["accuracy"])
        for tier, figures in last["per_tier"].items():
            assert values["fedara_accuracy", (("tier", tier),)] == pytest.approx(figures["accuracy"])
            assert values["fedara_evaluated_devices", (("tier", tier),)] == figures["devices"]
        assert values["fedara_last_round_devices", (("state", "aggregated"),)] == last["participants"]
    return completed


def held_round(status: Callable[[], dict], server: ServerProcess, device_id: str) -> dict | None:
    """Wait until the open round waits only for the (suspended) ``device_id``: the run holds still. None if it
    ended (its process, or its rounds: the page lingers)."""
    def holding() -> tuple[dict | None] | None:
        if server.proc.poll() is not None:
            return (None,)
        snapshot = status()
        if snapshot.get("finished"):
            return (None,)
        return (snapshot,) if (snapshot.get("open_round") or {}).get("waiting_for") == [device_id] else None
    return wait_for(holding, WAIT_S, f"a round waiting for {device_id}")[0]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # four device and server processes and a browser: minutes on a loaded 2-core machine
def test_a_run_shows_its_fleet_on_metrics_and_in_a_browser_then_closes_its_port(server_process, tmp_path: Path):
    """One device is suspended between rounds, so the run holds still while /metrics is scraped and compared with
    metrics.jsonl, and while chromium loads the page; after the run the page lingers with its final state, in the
    console's words, until SIGTERM; then the port is closed."""
    overrides = tmp_path / "overrides.json"
    overrides.write_text(json.dumps({f"dev_{i:03d}": TIERS[i % len(TIERS)] for i in range(DEVICES)}))
    run = tmp_path / "run"
    server = server_process(["--rounds", str(ROUNDS), "--local-devices", str(DEVICES), "--rank-overrides",
                             str(overrides), "--cache-dir", str(tmp_path / "cache"), "--out", str(run),
                             "--status-port", "0", "--status-linger", str(WAIT_S)])
    url = wait_for(server.url, WAIT_S, "the status URL")
    port = int(url.rsplit(":", 1)[1].strip("/"))

    def status() -> dict:
        try:
            return json.loads(get(url + "api/status")[1])
        except OSError:  # the run ended: its port is closed
            return {}
    wait_for(lambda: len([d for d in status().get("devices", []) if d["ready"]]) == DEVICES, WAIT_S,
             "every device ready")
    held = server.device("dev_002")
    screenshot = tmp_path / "status_page.png"
    checked: list[int] = []
    junk_sent = False
    held.suspend()
    try:
        while (snapshot := held_round(status, server, "dev_002")) is not None:
            code, body = get(url + "metrics")
            assert code == 200
            completed = check_against_metrics_file(samples(body.decode()), run)
            page = None
            if CHROMIUM is not None and (not checked or (completed >= 2 and max(checked) < 2)):
                # The device table, drawn by the page's script from /api/status; the screenshot shows the plot
                # too once two rounds are complete.
                page = chromium(url, tmp_path, "--dump-dom", f"--screenshot={screenshot}")
            if not junk_sent:  # junk on a device's topic is refused, and counted by reason
                broker = next(line.split(" on ")[1].split(",")[0] for line in server.lines if line.startswith("run "))
                host, broker_port = broker.removeprefix("mqtt://").split(":")
                publish.single(Topics(DEFAULT_TOPIC_PREFIX, "dev_000").up, b"junk", qos=1, hostname=host,
                               port=int(broker_port))
                wait_for(lambda: samples(get(url + "metrics")[1].decode()).get(
                    ("fedara_refusals_total", (("reason", "frame rejected"),)), 0) >= 1, WAIT_S, "the junk refused")
                junk_sent = True
            assert post(url + "api/status") == 405 and post(url + "metrics") == 405
            after = status()
            if (after.get("open_round") or {}).get("round") != snapshot["open_round"]["round"]:
                # dev_002's answer was on its way when it was suspended: the round closed, so what was seen since
                # was not of a held run; the next round, opened after that answer, is held (dev_002 stays suspended)
                print(f"round {snapshot['open_round']['round']} was not held: dev_002 had answered it", flush=True)
                continue
            # The run held still throughout: the POSTs changed nothing, the page showed the held round.
            assert {k: v for k, v in after["open_round"].items() if k != "deadline_unix"} == {
                k: v for k, v in snapshot["open_round"].items() if k != "deadline_unix"}
            assert [c["round"] for c in snapshot["completed"]] == list(range(1, completed + 1))
            checked.append(completed)
            print(f"held at round {snapshot['open_round']['round']}: /metrics matches the {completed} rounds of "
                  "metrics.jsonl", flush=True)
            if page is not None:
                assert page.returncode == 0 and screenshot.stat().st_size > 10_000, page.stderr[-2000:]
                rows = re.findall(r'<tr data-device="([^"]+)"', page.stdout)
                assert rows == [f"dev_{i:03d}" for i in range(DEVICES)], page.stdout[-3000:]
                shown = re.search(r'<div id="round">.*?</div>', page.stdout, re.S)
                assert "waiting for: dev_002" in page.stdout, shown and shown.group(0)
            held.resume()
            wait_for(lambda: server.proc.poll() is not None or status().get("finished")
                     or status().get("completed", [])[completed:], WAIT_S, "the next round")
            with contextlib.suppress(psutil.NoSuchProcess):  # the run may have ended with its devices
                held.suspend()
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            held.resume()
    wait_for(lambda: "status: the run has ended" in server.output(), WAIT_S, "the run's end")
    final = next(line for line in server.lines if line.startswith("final accuracy "))
    assert f"(after round {ROUNDS}); wrote " in final
    code, page = get(url)
    last = read_metrics(run / METRICS_FILE)[-1]
    assert code == 200 and b"run finished" in page and f"round {ROUNDS}/{ROUNDS} trained".encode() in page
    assert f"accuracy after round {ROUNDS}: {last['accuracy']:.4f}".encode() in page
    server.proc.send_signal(signal.SIGTERM)  # ends the linger
    assert server.proc.wait(WAIT_S) == 0, server.output()[-3000:]
    assert len(checked) >= 2 and checked == sorted(set(checked)), checked
    assert refused_connection(port)
    assert "Traceback" not in server.output()
    records = read_metrics(run / METRICS_FILE)
    assert len(records) == ROUNDS and {t for r in records for t in r["per_tier"]} == {"1", "0.25"}
    if CHROMIUM is None:  # what precedes was checked; the page was not loaded in a browser
        require(missing_binary("chromium", "chromium"))
    kept = REPO_ROOT / ARTIFACTS_DIR / screenshot.name
    kept.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(screenshot, kept)
    print(f"status page screenshot (test artifact): {kept}")


def test_the_status_bench_script_measures_a_tiny_fleet(tmp_path: Path, capsys: pytest.CaptureFixture):
    """scripts/bench_status.py end to end on a tiny fleet: its table and JSON, not its timings."""
    bench = load_script("bench_status")
    assert bench.main(["--devices", "4", "--records", "2", "--out", str(tmp_path / "bench.json")]) == 0
    (row,) = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert row["devices"] == 4 and row["rounds"] == 2 and row["json_kb"] > 0
    assert "/metrics ms" in capsys.readouterr().out
