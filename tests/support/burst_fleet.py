"""A fleet run whose devices' updates reach the aggregator processes all at once, whatever the timing (for
tests/mqtt/test_member_lost_updates.py and scripts/bench_member_lost.py).

The server is the real broker loop (``broker_loop.main``, in this process) with ``--aggregators N`` member processes
over a real broker; the devices are scripts/fleet_load.py's simulated devices (the whole device protocol, each its
own MQTT connection), in this process too. Their training answers of a round are held until every device holds its
own, then published at once, their frames interleaved through one connection in turn (as mosquitto forwards a
burst): every member has as many updates half-received at once as devices routed to it. A device asked again
re-sends its saved answer at once, on its own connection. ``tight``: the members run as tests/support/tight_member.py
(room for two incomplete updates, no spill), so most of a burst is pushed out there."""
from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from unittest import mock

import numpy as np
import paho.mqtt.publish

from device_runtime.auth import new_key
from device_runtime.framing import chunk
from device_runtime.transport import BrokerURL
from server import broker_loop
from server.mqtt.enrollment import save_enrollment
from tests.support.scripts import load_script

FLEET = load_script("fleet_load")
FRAME_BYTES = 256 << 10
"""Each dense update (FedAvgCNN 3×32×32, ~3.5 MB) travels in ~14 frames."""
TIERS = (1.0, 0.25)
"""Device i trains at tier TIERS[i % 2]: dense and factorized updates."""
WAIT_S = 300.0


class BurstHost(FLEET.DeviceHost):
    """Simulated devices whose training answers of a round go out in one interleaved burst (see the module docstring).
    Each plan's synthetic update is drawn from its tensors' shapes: two runs send the same updates."""

    def __init__(self, url: str) -> None:
        super().__init__(url, FRAME_BYTES, 64 << 20, 0.0, 0.0, 0, together=threading.Barrier(1))
        self.broker = BrokerURL.parse(url)

    def synthetic(self, ref, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.decoded[ref] = tensors
        rng = np.random.default_rng([int(n) for k in sorted(tensors) for n in tensors[k].shape])
        return {k: rng.standard_normal(v.shape, dtype=np.float32) * np.float32(1e-2) for k, v in tensors.items()}

    def hold(self, round_index: int, publish) -> None:
        held = self.held.setdefault(round_index, [])
        held.append(publish)
        if len(held) < len(self.devices):
            return
        frames = [chunk(sealed, FRAME_BYTES, msg_id) for _, _, sealed, msg_id in held]
        topics = [topic for _, topic, _, _ in self.held.pop(round_index)]
        paho.mqtt.publish.multiple([(topic, fs[i], 1, False) for i in range(max(map(len, frames)))
                                    for topic, fs in zip(topics, frames) if i < len(fs)],
                                   hostname=self.broker.host, port=self.broker.port)


def tight_member_command(*args, **kwargs) -> list[str]:
    """``broker_loop.aggregator_command``'s member, run as tests/support/tight_member.py."""
    return [sys.executable, "-m", "tests.support.tight_member", *AGGREGATOR_COMMAND(*args, **kwargs)[3:]]


AGGREGATOR_COMMAND = broker_loop.aggregator_command


def fleet_run(folder: Path, cache: Path, url: str, *, devices: int, aggregators: int, rounds: int, deadline_s: float,
              tight: bool) -> Path:
    """A run of ``rounds`` rounds of ``devices`` simulated devices (at TIERS) through ``aggregators`` member processes
    on the broker ``url``, in ``folder``; returns its run folder (the server's OUT)."""
    ids = [f"dev_{i:05d}" for i in range(devices)]
    keys = {d: new_key() for d in ids}
    enrollment = save_enrollment(folder / "enrollment.json", keys)
    overrides = folder / "overrides.json"
    overrides.write_text(json.dumps({d: TIERS[i % len(TIERS)] for i, d in enumerate(ids)}))
    host, stop = BurstHost(url), threading.Event()

    def start_devices() -> None:  # one at a time, as fleet_load's device processes do
        for device_id in ids:
            device = host.devices[device_id] = FLEET.SimDevice(host, device_id, keys[device_id], folder / device_id)
            device.start()
            device.endpoint.wait_connected(WAIT_S)
            device.join()
            device.planned.wait(WAIT_S)

    threads = [threading.Thread(target=host.serve, args=(stop,), daemon=True),
               threading.Thread(target=start_devices, daemon=True)]
    for thread in threads:
        thread.start()
    out = folder / "run"
    command = tight_member_command if tight else AGGREGATOR_COMMAND
    try:
        with mock.patch.object(broker_loop, "aggregator_command", command):
            code = broker_loop.main([
                "--broker", url, "--prefix", FLEET.PREFIX, "--enroll", str(enrollment), "--dataset", "cifar10",
                "--data-dir", str(FLEET.fake_cifar(folder / "data")), "--model", "fedavgcnn", "--rounds", str(rounds),
                "--min-devices", str(devices), "--rank-tiers", ",".join(map(str, TIERS)), "--rank-overrides",
                str(overrides), "--round-deadline", str(deadline_s), "--join-timeout", str(deadline_s),
                "--max-message-bytes", str(FRAME_BYTES), "--aggregators", str(aggregators), "--threads", "1",
                "--cache-dir", str(cache), "--out", str(out)])
    finally:
        stop.set()
        threads[0].join(WAIT_S)
        for device in host.devices.values():
            device.endpoint.stop()
    if code != 0:
        raise RuntimeError(f"the server exited with {code}: see {out / broker_loop.SERVER_LOG}")
    return out
