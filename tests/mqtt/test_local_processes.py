"""server.mqtt.local_processes: the local device processes the broker loop starts, and their end."""
from __future__ import annotations

import signal
import sys
from pathlib import Path

from server.mqtt.local_processes import LocalDevices
from tests.support.waiting import wait_for

DEVICE_LIKE = ("import signal, sys\n"
               "signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))  # a device ends cleanly on SIGTERM\n"
               "print('ready', flush=True)\n"
               "while True:\n"
               "    signal.pause()\n")


def test_a_device_stopped_with_sigstop_ends_on_sigterm_when_the_run_stops_its_devices(tmp_path: Path):
    """A stopped process that handles SIGTERM runs its handler only once continued: without a SIGCONT it would wait
    for the SIGKILL that follows stop's timeout."""
    devices = LocalDevices()
    log = tmp_path / "dev.log"
    devices.spawn("dev_000", [sys.executable, "-c", DEVICE_LIKE], log)
    wait_for(lambda: "ready" in log.read_text(), 60.0, "the handler installed")
    proc = devices.processes["dev_000"]
    proc.send_signal(signal.SIGSTOP)  # a board that hangs
    devices.stop(timeout=60.0)
    assert proc.returncode == 3  # its SIGTERM handler ran, no SIGKILL
