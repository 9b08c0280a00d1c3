"""python -m device_runtime: one FedARA device, training on its local shard for a server over MQTT.

    python -m device_runtime --broker mqtt://HOST:1883 --device-id dev_000 --data client_000.npz \\
        --workdir /var/lib/fedara [--memory-budget-mb 256] [--threads 1] [--runtime auto] \\
        [--username dev_000 --password P --tls-ca ca.pem]

The device reconnects on its own, resumes from its workdir after a restart, and exits cleanly on SIGTERM
(exit status 0; 1: the broker refused the connection; 2: bad arguments, an unreadable shard, or the server
refused this device).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

PASSWORD_ENV = "FEDARA_MQTT_PASSWORD"
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
EXIT_OK, EXIT_BROKER_REFUSED, EXIT_REFUSED = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m device_runtime", description=__doc__.splitlines()[0])
    p.add_argument("--broker", required=True, help="mqtt://[user[:pass]@]host[:port] or mqtts://... (TLS)")
    p.add_argument("--device-id", required=True, help="this device's id: its MQTT client id and topic level")
    p.add_argument("--data", required=True, help="the device's shard (.npz written by the server's partitioner)")
    p.add_argument("--workdir", required=True, help="cached artifacts, heads and state survive restarts here")
    p.add_argument("--memory-budget-mb", type=float, default=None,
                   help="memory training may use; the server picks the largest rank tier predicted to fit")
    p.add_argument("--threads", type=int, default=1, help="compute threads")
    p.add_argument("--runtime", default="auto", choices=("auto", "onnxruntime", "onnxruntime-training"),
                   help="auto: stock onnxruntime's portable step graphs whenever onnxruntime is installed; "
                        "onnxruntime-training: the training API (onnxruntime-training-cpu)")
    p.add_argument("--prefix", default=None, help="MQTT topic prefix, the server's --prefix (default: both sides' default)")
    p.add_argument("--username", default=None)
    p.add_argument("--password", default=os.environ.get(PASSWORD_ENV),
                   help=f"MQTT password (default: ${PASSWORD_ENV}, which keeps it out of the process list)")
    p.add_argument("--tls-ca", default=None, help="CA certificate to verify an mqtts:// broker")
    p.add_argument("--max-message-bytes", type=int, default=256 * 1024,
                   help="largest MQTT publish; longer messages travel as chunks (the broker's limit or less)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads < 1:
        print("error: --threads must be >= 1", file=sys.stderr)
        return EXIT_REFUSED
    for name in THREAD_ENV_VARS:  # before numpy loads its BLAS
        os.environ.setdefault(name, str(args.threads))
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format=f"%(asctime)s {args.device_id} %(name)s %(levelname)s %(message)s")

    from device_runtime.agent import DeviceAgent, DeviceRefused, Interrupted, Workdir
    from device_runtime.messages import DEFAULT_TOPIC_PREFIX
    from device_runtime.profile import ProfileError, collect_profile
    from device_runtime.protocol import ProtocolError, Topics
    from device_runtime.runtimes import RuntimeUnavailable, detect
    from device_runtime.shard import ShardError, load_shard
    from device_runtime.transport import BrokerRefusedError, MqttEndpoint

    try:
        topics = Topics(args.prefix or DEFAULT_TOPIC_PREFIX, args.device_id)
        shard = load_shard(args.data)
        profile = collect_profile(args.memory_budget_mb, args.threads, detect(args.runtime))
        endpoint = MqttEndpoint(args.device_id, args.broker, subscriptions=[topics.down],
                                will=(topics.status, b"offline"), username=args.username, password=args.password,
                                tls_ca=args.tls_ca, max_frame_bytes=args.max_message_bytes, clean_session=False)
        workdir = Workdir(args.workdir)
    except (ProtocolError, ShardError, ProfileError, RuntimeUnavailable, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    agent = DeviceAgent(args.device_id, shard, profile, endpoint, workdir, topics, threads=args.threads)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()
        if agent.computing:
            raise Interrupted()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        agent.run(stop)
    except Interrupted:
        pass
    except BrokerRefusedError as exc:
        logging.getLogger("fedara.device").error("%s", exc)
        return EXIT_BROKER_REFUSED
    except DeviceRefused as exc:
        logging.getLogger("fedara.device").error("the server refused this device: %s", exc)
        return EXIT_REFUSED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
