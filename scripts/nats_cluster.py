#!/usr/bin/env python3
"""An N-node NATS cluster with MQTT on loopback, for tests and demos (Debian's ``nats-server``, 2.9.10 here).

    python scripts/nats_cluster.py --nodes 3 --dir /tmp/nats
    # prints the --broker list (mqtt://127.0.0.1:P1,mqtt://127.0.0.1:P2,...) and runs until Ctrl-C or SIGTERM

Each node gets its own folder with a config file (``server_name``, ``listen``, ``max_payload: 8MB``, ``jetstream {
store_dir, max_mem, max_file }``, ``cluster { name, listen, routes }``, ``mqtt { listen }``: MQTT needs JetStream),
its JetStream store and its log. The nodes start together ("connection refused" between routes in the first second
is normal). NATS creates its MQTT streams (3 replicas) a few seconds after start, so ``start`` returns only once a
QoS 1 message published on the first node reached a subscriber on each node (once its subscription was
acknowledged: NATS makes a JetStream consumer per QoS 1 subscription, which can take seconds). ``kill(i)`` SIGKILLs node i, as a
crashed machine would go. The command stops its nodes on Ctrl-C, SIGTERM (``kill %1`` of a cluster started with
``&``) and SIGHUP alike, starting or running: it leaves no nats-server behind.
"""
from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

NATS_SERVER = "nats-server"
READY_TIMEOUT_S = 90.0
PROBE_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
PORT_ATTEMPTS = 3


class NatsClusterError(RuntimeError):
    """The cluster did not come up (the message names the logs to read)."""


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node_config(name: str, folder: Path, client: int, route: int, mqtt: int, routes: list[int]) -> str:
    """One node's nats-server configuration."""
    route_urls = ", ".join(f'"nats-route://127.0.0.1:{port}"' for port in routes)
    return (f'server_name: "{name}"\n'
            f"listen: 127.0.0.1:{client}\n"
            "max_payload: 8MB\n"
            f'jetstream {{\n  store_dir: "{folder / "jetstream"}"\n  max_mem: 256MB\n  max_file: 1GB\n}}\n'
            f'cluster {{\n  name: "fedara"\n  listen: 127.0.0.1:{route}\n  routes: [{route_urls}]\n}}\n'
            f"mqtt {{\n  listen: 127.0.0.1:{mqtt}\n}}\n")


class NatsCluster:
    """``nodes`` nats-server processes forming one cluster, each with an MQTT listener on loopback."""

    def __init__(self, folder: str | Path, nodes: int = 3) -> None:
        if nodes < 1:
            raise ValueError(f"--nodes must be >= 1, got {nodes}")
        self.folder = Path(folder)
        self.names = [f"n{i + 1}" for i in range(nodes)]
        self.ports = self._free_ports()
        self.processes: list[subprocess.Popen[bytes] | None] = [None] * nodes

    def _free_ports(self) -> list[tuple[int, int, int]]:
        """(client, route, mqtt) ports per node, all different, each free a moment ago."""
        ports: list[int] = []
        while len(ports) < 3 * len(self.names):
            port = free_port()
            if port not in ports:
                ports.append(port)
        return [tuple(ports[3 * i:3 * i + 3]) for i in range(len(self.names))]

    @property
    def mqtt_ports(self) -> list[int]:
        return [mqtt for _, _, mqtt in self.ports]

    @property
    def urls(self) -> list[str]:
        """Each node's MQTT URL."""
        return [f"mqtt://127.0.0.1:{port}" for port in self.mqtt_ports]

    @property
    def broker(self) -> str:
        """The --broker value naming every node."""
        return ",".join(self.urls)

    def log(self, i: int) -> Path:
        return self.folder / self.names[i] / "nats.log"

    def start(self, timeout: float = READY_TIMEOUT_S) -> NatsCluster:
        """Start every node; return once MQTT works across the cluster (raises NatsClusterError otherwise). A port
        another process took since it was picked (a shared machine) means new ports and another try."""
        binary = shutil.which(NATS_SERVER) or (Path("/usr/sbin") / NATS_SERVER)
        if not Path(binary).exists():
            raise NatsClusterError(f"{NATS_SERVER} not found (Debian: apt-get install -y nats-server)")
        for _ in range(PORT_ATTEMPTS - 1):
            try:
                return self._start(str(binary), timeout)
            except NatsClusterError:
                logs = [self.log(i) for i in range(len(self.names)) if self.log(i).exists()]
                if not any("address already in use" in log.read_text(errors="replace") for log in logs):
                    raise
                for log in logs:
                    log.unlink()
                self.ports = self._free_ports()
        return self._start(str(binary), timeout)

    def _start(self, binary: str, timeout: float) -> NatsCluster:
        routes = [route for _, route, _ in self.ports]
        for i, (name, (client, route, mqtt)) in enumerate(zip(self.names, self.ports)):
            folder = self.folder / name
            folder.mkdir(parents=True, exist_ok=True)
            conf = folder / "nats.conf"
            conf.write_text(node_config(name, folder, client, route, mqtt, routes))
            with open(self.log(i), "ab") as log, held_stop():
                self.processes[i] = subprocess.Popen([binary, "-c", str(conf)], stdout=log,
                                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not self.mqtt_works():
            dead = [self.names[i] for i, p in enumerate(self.processes) if p is not None and p.poll() is not None]
            if dead or time.monotonic() > deadline:
                self.stop()
                why = f"nodes {dead} exited" if dead else f"MQTT did not work across the nodes within {timeout:g} s"
                raise NatsClusterError(f"{why}; see {self.folder}/*/nats.log")
            time.sleep(0.5)
        return self

    def mqtt_works(self, alive: list[int] | None = None) -> bool:
        """Whether a QoS 1 message published on the first (alive) node reaches a subscriber on each, once every
        subscription is acknowledged (NATS makes a JetStream consumer for each: that can take seconds)."""
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        nodes = alive if alive is not None else list(range(len(self.names)))
        topic = f"nats-cluster-probe/{uuid.uuid4().hex}"
        got = {i: threading.Event() for i in nodes}
        subscribed = {i: threading.Event() for i in nodes}
        clients = []
        try:
            for i in nodes:
                client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"probe-{uuid.uuid4().hex[:12]}",
                                     clean_session=True, protocol=mqtt.MQTTv311)
                client.on_message = lambda c, u, m, i=i: got[i].set()
                client.on_subscribe = lambda c, u, mid, codes, p, i=i: subscribed[i].set()
                client.on_connect = lambda c, u, f, rc, p: c.subscribe(topic, qos=1) if not rc.is_failure else None
                client.connect("127.0.0.1", self.mqtt_ports[i], keepalive=10)
                client.loop_start()
                clients.append(client)
            if not all(event.wait(PROBE_TIMEOUT_S) for event in subscribed.values()):
                return False
            clients[0].publish(topic, b"probe", qos=1).wait_for_publish(PROBE_TIMEOUT_S)
            return all(event.wait(PROBE_TIMEOUT_S) for event in got.values())
        except (OSError, RuntimeError, ValueError):
            return False
        finally:
            for client in clients:
                client.disconnect()
                client.loop_stop()

    def kill(self, i: int) -> None:
        """SIGKILL node i (as if its machine died)."""
        proc = self.processes[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        """Stop every node still running."""
        for proc in self.processes:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in self.processes:
            if proc is None:
                continue
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class Stop(Exception):
    """SIGTERM or SIGHUP arrived: stop the cluster as Ctrl-C does."""


_held: list[int] | None = None  # while a node starts: the stop signals that arrived, raised once it is recorded


@contextlib.contextmanager
def held_stop():
    """Hold a stop signal until the body is done: a Stop raised inside ``Popen`` (while it waits for the exec) or
    before its result is stored would lose a running node that nothing then stops."""
    global _held
    _held = []
    try:
        yield
    finally:
        held, _held = _held, None
        if held:
            raise Stop(signal.Signals(held[0]).name)


def _stop_on_signal(signum: int, frame: object) -> None:
    for other in (signal.SIGTERM, signal.SIGHUP):  # a second signal must not cut the stop short
        signal.signal(other, signal.SIG_IGN)
    if _held is not None:
        _held.append(signum)
        return
    raise Stop(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/nats_cluster.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=3, help="cluster nodes, each with an MQTT listener")
    p.add_argument("--dir", default="runs/nats-cluster", help="configs, JetStream stores and logs go here")
    args = p.parse_args(argv)
    try:
        cluster = NatsCluster(args.dir, args.nodes)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _stop_on_signal)
    try:
        cluster.start()
        print(f"--broker {cluster.broker}", flush=True)
        print(f"logs: {Path(args.dir).resolve()}/*/nats.log; Ctrl-C or SIGTERM stops the cluster", flush=True)
        while all(p is not None and p.poll() is None for p in cluster.processes):
            time.sleep(1)
        print("a node exited; stopping the cluster", file=sys.stderr)
    except NatsClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Stop):
        pass
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
