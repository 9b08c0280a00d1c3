"""scripts/bench_drain.py, its smallest run: every queued junk frame is drained and counted, under both MQTT
versions."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.broker import MOSQUITTO_BIN
from tests.support.machine import missing_binary, require
from tests.support.processes import child_env
from tests.support.scripts import SCRIPTS


def test_every_queued_junk_frame_is_drained_under_both_mqtt_versions(tmp_path: Path):
    require(missing_binary("mosquitto", "mosquitto", MOSQUITTO_BIN))
    out = tmp_path / "drain.json"
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_drain.py"), "--frames", "300", "--repeats", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, env=child_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [(r["mqtt"], r["frames"]) for r in runs] == [("3.1.1", 300), ("5", 300)]
    assert "CPU us/frame" in done.stdout


def test_zero_frames_exits_2_naming_the_flag():
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_drain.py"), "--frames", "0"], capture_output=True,
                          text=True, timeout=120, env=child_env())
    assert done.returncode == 2 and "--frames" in done.stderr and "Traceback" not in done.stderr, done.stderr
